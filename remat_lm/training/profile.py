"""`--profile_steps A:B`: a `jax.profiler` trace of training steps A+1..B.

The steps are numbered as the log numbers them: `--profile_steps 0:3` traces the first three
steps, `10:12` steps 11 and 12 (the trace starts after step A is done and stops after step B). The
train step is compiled before the first step, so no step's trace holds a compilation.

Where: `<checkpoint_dir>/profile` with `--checkpoint_dir` (orbax ignores folders that are not step
numbers), else beside `--log_jsonl` (`runs/x.jsonl` → `runs/x.profile`), else `runs/profile`.
`jax.profiler` writes `plugins/profile/<timestamp>/` there: `<host>.xplane.pb` (TensorBoard /
XProf: `tensorboard --logdir DIR`) and `perfetto_trace.json.gz` (https://ui.perfetto.dev). Each
step is a `StepTraceAnnotation("train", step_num=n)`.

Example:
    >>> prof = StepProfiler.from_config(cfg, out=sys.stdout)
    >>> with prof.step(n): state, metrics = compiled(state, x, y)
"""
from __future__ import annotations

import contextlib
import glob
import os

import jax

from remat_lm.argtypes import parse_int

__all__ = ["StepProfiler", "parse_steps", "profile_dir"]


def parse_steps(spec: str, num_iterations: int) -> tuple[int, int]:
    """'A:B' → (A, B) with 0 <= A < B <= num_iterations; ValueError naming the fix otherwise.

    Example:
      >>> parse_steps("10:12", 100)
      (10, 12)
    """
    a, sep, b = str(spec).partition(":")
    try:
        a, b = parse_int(a.strip()), parse_int(b.strip())
        ok = bool(sep) and 0 <= a < b <= num_iterations
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--profile_steps {spec!r}: expected A:B with integers 0 <= A < B <= --num_iterations "
                         f"({num_iterations}); the trace covers steps A+1..B, e.g. --profile_steps 10:13")
    return a, b


def profile_dir(checkpoint_dir: str | None, log_jsonl: str | None) -> str:
    """Where the trace goes (see the module docstring)."""
    if checkpoint_dir:
        return os.path.join(checkpoint_dir, "profile")
    if log_jsonl:
        root, ext = os.path.splitext(log_jsonl)
        return (root if ext else log_jsonl) + ".profile"
    return os.path.join("runs", "profile")


class StepProfiler:
    """Starts a trace before step A+1 and stops it after step B (before step B+1 starts, or when
    training ends)."""

    def __init__(self, first: int, last: int, directory: str, out=None):
        self.first, self.last, self.directory, self.out = first, last, directory, out
        self.active = False

    @classmethod
    def from_config(cls, cfg, out=None) -> "StepProfiler":
        """The run's profiler; without `--profile_steps` one that never traces."""
        if not cfg.profile_steps:
            return cls(0, 0, "", out)
        a, b = parse_steps(cfg.profile_steps, cfg.num_iterations)
        return cls(a, b, profile_dir(cfg.checkpoint_dir, cfg.log_jsonl), out)

    @contextlib.contextmanager
    def step(self, n: int):
        """Around step n (1-based, before its timer starts): starts the trace at step first+1 and
        annotates each traced step; the trace stops before step last+1 or at `close`."""
        if self.active and n > self.last:
            self.close()
        if not self.active and self.first < n <= self.last:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True
        if self.active:
            with jax.profiler.StepTraceAnnotation("train", step_num=n):
                yield
        else:
            yield

    def close(self) -> None:
        """Stop the trace if one is running and say where it is."""
        if not self.active:
            return
        jax.profiler.stop_trace()
        self.active = False
        if jax.process_index() == 0:
            runs = sorted(glob.glob(os.path.join(self.directory, "plugins", "profile", "*")), key=os.path.getmtime)
            where = runs[-1] if runs else self.directory
            print(f"profile  steps {self.first + 1}..{self.last} traced to {where} (TensorBoard: tensorboard "
                  f"--logdir {self.directory}; Perfetto: perfetto_trace.json.gz at ui.perfetto.dev)", file=self.out)
