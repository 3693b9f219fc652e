"""Shared benchmark helpers: the reference shape, interleaved timing, targets, markdown tables,
run metadata, and the compiler a figure comes from (`--target`)."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
from typing import Callable, Mapping, Sequence

from remat.memory import GiB, MiB, format_bytes  # noqa: F401  (the one byte unit and formatter)
from remat.planning import timing as _timing
from remat_lm import argtypes

# NOTE: the reference shape: the small GPT-2 every CPU figure of docs/BENCHMARKS.md is measured on
# (a step takes under a second on two cores), defined here once so that every figure in docs/
# can say which shape it was taken on (remat_lm.bench.policies `--preset ref`, remat_lm.bench.planner,
# remat_lm.bench.attention, remat_lm.bench.compile_time and the tests import it). LLaMA-3's variant keeps the same
# width, depth and sequence, with GQA over 2 key/value heads.
REFERENCE = {
    "gpt2": dict(block_size=256, vocab_size=1024, n_layer=8, n_head=4, n_embd=256),
    "llama3": dict(block_size=256, vocab_size=1024, n_layer=8, n_head=4, n_kv_head=2, n_embd=256,
                   multiple_of=256),
}
REFERENCE_BATCH = 8


def reference_config(model: str = "gpt2", **overrides):
    """The reference-shape model config of `model`, with fields overridden.

    Example:
      >>> cfg = reference_config("gpt2", n_layer=2)
      >>> (cfg.n_layer, cfg.n_embd, cfg.block_size, REFERENCE_BATCH)
      (2, 256, 256, 8)
    """
    from remat_lm.models import family
    return family.get(model).config_cls(**{**REFERENCE[model], **overrides})


def interleaved_ms(steps: Mapping[str, Callable[[], object]], n: int, warmup: int = 1,
                   tick: Callable[[], object] | None = None) -> dict:
    """`remat.planning.timing.interleaved` in milliseconds: {name: [ms per timed step, in round order]}.

    Example:
      >>> ms = interleaved_ms({"a": step_a, "b": step_b}, n=5)
      >>> statistics.median(ms["a"])
    """
    return {k: [s * 1e3 for s in v] for k, v in _timing.interleaved(steps, n, warmup=warmup, tick=tick).items()}


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


@dataclasses.dataclass(frozen=True)
class Target:
    """A benchmark target: what is asked, what was measured, met or missed, and why if missed."""
    name: str
    measured: str
    met: bool
    note: str = ""

    def line(self) -> str:
        s = f"- {self.name}: {self.measured} → **{'met' if self.met else 'missed'}**"
        return s + (f" ({self.note})" if self.note else "")


def targets_markdown(targets: Sequence[Target]) -> str:
    return "\n".join(t.line() for t in targets)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats are expected pre-formatted by the caller."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def machine() -> dict:
    """Where and when: date, host CPU count, platform, jax version and devices."""
    import jax
    try:
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "nproc": os.cpu_count(), "cpu": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "jax": jax.__version__,
            "devices": [str(d) for d in jax.devices()], "backend": jax.default_backend(),
            "loadavg": loadavg()}


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages: how busy the shared machine was (timings depend on it)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ------------------------------------------------------------------------------------------------
# Which compiler a figure comes from: `--target`.

# NOTE: a benchmark's memory figures are one compiler's answer. `--target NAME` (a `remat.planning.targets`
# name: cpu, h200, h200x4, v5e, v5e:2x2, ...) has the bench compile its programs with that target's
# compiler, deviceless where this host is not the target (`remat.planning.targets.compile`), and every JSON
# and report records the compiler (`source`, `source_line`). Step times are only meaningful where
# the program runs: built for a target this host is not, a bench skips its timed columns and says so
# (`timed(target)` is False).

def target_name(text: str) -> str:
    """argparse type of `--target`: a `remat.planning.targets` name, normalized (`H200x4` -> `h200x4`)."""
    from remat.planning import targets
    try:
        return targets.get(text).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_target(parser, default: str = "cpu"):
    """Add `--target NAME` to a bench parser (default `cpu`, this host and its compiler, XLA:CPU).

    Example:
      >>> a = add_target(argparse.ArgumentParser()).parse_args(["--target", "H200"])
      >>> a.target
      'h200'
    """
    parser.add_argument("--target", default=default, type=target_name,
                        help="compile for this remat.planning.targets name (cpu, h200, h200x4, a100-80g, v5e, v5e:2x2, ...): "
                             "its compiler's memory figures, no device needed; timed columns only where this "
                             f"host is the target (default {default})")
    return parser


def timed(target: str) -> bool:
    """True when a program built for `target` runs here (the target's platform is this host's):
    only then are step times measured."""
    from remat.planning import targets
    from remat.memory import host_platform
    return targets.get(target).platform == host_platform()


def compile_for(fn, *args, target: str = "cpu", mesh=None, specs=None):
    """`fn(*args)` jitted and compiled for `target`: on this host as `jax.jit` does when the host is
    the target and no mesh is asked (the figures every CPU table has always had), else by the
    target's compiler with no device (`remat.planning.targets.compile`; `mesh`, `specs` as it takes them).

    Example:
      >>> import jax.numpy as jnp, jax
      >>> compile_for(jnp.sin, jax.ShapeDtypeStruct((4,), jnp.float32)).memory_analysis() is not None
      True
    """
    import jax

    from remat.planning import targets
    from remat.memory import building_for
    t = targets.get(target)
    if timed(t.name) and mesh is None and specs is None:
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        with building_for(t.platform):
            return jitted.lower(*args).compile()
    return targets.compile(fn, *args, target=t, mesh=mesh, specs=specs)


def source(target: str) -> dict:
    """Where a bench's figures come from: {"target", "compiler", "device", "timed", "libtpu_args"}
    (`libtpu_args`: LIBTPU_INIT_ARGS as this process started, which changes XLA:TPU's figures)."""
    from remat.planning import targets
    t = targets.get(target)
    return {"target": t.name, "compiler": t.compiler, "device": t.hardware(), "timed": timed(t.name),
            "libtpu_args": os.environ.get("LIBTPU_INIT_ARGS", "") if t.platform == "tpu" else ""}


def source_line(src: dict, timed_elsewhere: bool = False) -> str:
    """One line naming the compiler of a run's figures (from `source(target)`), for reports;
    `timed_elsewhere`: a program for a target not run here whose step times come from its twin
    compiled for this host (the line then does not say "no step times").

    Example:
      >>> source_line(source("cpu")).startswith("compiled by XLA:CPU")
      True
    """
    if src["timed"]:
        line = f"compiled by {src['compiler']} on this host"
    else:
        line = f"compiled by {src['compiler']} for {src['device']} with no device (remat.planning.targets)"
        line += "" if timed_elsewhere else "; not run, so no step times"
    if src.get("libtpu_args"):
        line += f"; LIBTPU_INIT_ARGS={src['libtpu_args']}"
    return line


def cli(main: Callable[[], int], module: str) -> int:
    """Run a bench module's `main()` as `python -m remat_lm.bench.<module>` (`remat_lm.argtypes.run`:
    bad input found after argument parsing exits 2 with `python -m remat_lm.bench.<module>: error: ...`).

    Example:
      >>> if __name__ == "__main__":
      ...     sys.exit(cli(main, "policies"))
    """
    return argtypes.run(main, f"python -m remat_lm.bench.{module}")


def load_note(meta: dict) -> str:
    """`load average 1.2 at the start` (or `?`), from `machine()`'s `loadavg`: the report headers' words."""
    return f"load average {meta['loadavg'][0] if meta.get('loadavg') else '?'} at the start"


def write_json(path: str | None, obj) -> None:
    """Write `obj` as JSON to `path` (its directory made), when a path is given (`--json`)."""
    import json

    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


def publish(res: dict, report: Callable[[dict], str], module: str, argv, json_path: str | None) -> int:
    """Record the command in `res`, print the report, and write `res` as JSON when asked."""
    import sys

    res["meta"]["command"] = f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)
    print(report(res))
    write_json(json_path, res)
    return 0
