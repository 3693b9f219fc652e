"""Per-step logging: the dense llm.c-style line, the JSONL record, MFU and memory.

    step 12/200 | loss 3.4102 | norm 0.83 | lr 3.0e-04 | 412 ms | 9,950 tok/s | mfu n/a | mem 1.20 GiB

MFU is model FLOPs per token (the model's `flops_per_token`, which does not count recomputation)
times tokens per second, over the peak of the devices in use from the hardware table
(`remat.planning.targets.SPECS`, which the planner and the preflight read too); devices not in it
(every CPU) report "n/a". Memory is the device's `peak_bytes_in_use` when the backend
reports `memory_stats()`, else XLA's compiled estimate of the step (arguments + outputs +
temporaries - aliased), shown as `mem 1.20 GiB (compiled est.)`.

Example:
    >>> print(format_line(12, 200, dict(loss=3.41, grad_norm=0.83, lr=3e-4, step_ms=412.0,
    ...                                 tokens_per_s=9950, mfu=None, memory_bytes=None)))
"""
from __future__ import annotations

import json
import os

import jax

from remat.memory import compiled_stats, format_bytes
from remat.planning import targets

__all__ = ["JsonlWriter", "LogWriteError", "compiled_estimate", "device_memory", "format_line", "peak_flops",
           "truncate_after"]


def peak_flops(device, dtype: str) -> float | None:
    """Peak dense matrix FLOP/s of one device for `dtype` ("bfloat16", "float32"), from the hardware
    table `remat.planning.targets.SPECS`; None for a device not in it (every CPU).

    Example:
      >>> import types
      >>> peak_flops(types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite"), "float32")
      197000000000000.0
    """
    spec = targets.spec_of(device)
    return None if spec is None else spec.peak_flops.get(dtype)


def device_memory(devices) -> int | None:
    """Peak bytes in use, the maximum over `devices`, from `memory_stats()`; None if unsupported."""
    best = None
    for d in devices:
        if d.process_index != jax.process_index():  # another process's device (multi-process runs)
            continue
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if stats:
            v = stats.get("peak_bytes_in_use", stats.get("bytes_in_use"))
            if v is not None:
                best = max(best or 0, int(v))
    return best


def compiled_estimate(compiled) -> int | None:
    """XLA's estimate of the bytes a compiled program needs live at once (per device):
    `remat.memory.compiled_stats(compiled).peak_estimate`, None where the backend has none."""
    try:
        return compiled_stats(compiled).peak_estimate
    except Exception:  # backends without a memory analysis
        return None


def format_line(step: int, total: int, m: dict) -> str:
    """The one dense line per step."""
    mfu = "n/a" if m.get("mfu") is None else f"{100 * m['mfu']:.1f}%"
    mem = format_bytes(m.get("memory_bytes"))
    if m.get("memory_source") == "compiled_estimate":
        mem += " (compiled est.)"
    line = (f"step {step:{len(str(total))}d}/{total} | loss {m['loss']:.4f} | norm {m['grad_norm']:.2f} | "
            f"lr {m['lr']:.1e} | {m['step_ms']:.0f} ms | {m['tokens_per_s']:,.0f} tok/s | mfu {mfu} | mem {mem}")
    if m.get("val_loss") is not None:
        line += f" | val {m['val_loss']:.4f}"
    return line


class LogWriteError(OSError):
    """Writing `--log_jsonl` failed mid-run (a full disk, an I/O error): `train.py` prints its one line
    and exits 1."""


class JsonlWriter:
    """Appends one JSON object per step to a file (flushed per line, so a killed run keeps its log).

    The file is opened at the first record, so a run that fails before its first step leaves no
    log. With `append`, records of steps after `keep_through` (logged by a killed run after its
    last checkpoint, and about to be logged again by the resumed run) and a torn last line are
    dropped first, so the log holds each step once.
    """

    def __init__(self, path: str | None, append: bool, keep_through: int | None = None):
        self.fh = None
        self.path = path if path and jax.process_index() == 0 else None
        self.append, self.keep_through = append, keep_through

    def _open(self):
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        if self.append and self.keep_through is not None and os.path.isfile(self.path):
            truncate_after(self.path, self.keep_through)
        self.fh = open(self.path, "a" if self.append else "w")

    def write(self, record: dict) -> None:
        """Append `record`; LogWriteError (one line, naming the fix) when the file cannot take it."""
        try:
            if self.path and self.fh is None:
                self._open()
            if self.fh:
                self.fh.write(json.dumps(record) + "\n")
                self.fh.flush()
        except OSError as e:
            path, self.path = self.path, None  # no more writes, and close() must not flush the failed line again
            if self.fh is not None:
                try:
                    self.fh.close()
                except OSError:
                    pass
                self.fh = None
            raise LogWriteError(e.errno, f"writing --log_jsonl {path} failed at step {record.get('step')}: "
                                         f"{e.strerror or e}; free space there or pass --log_jsonl on another disk") from None

    def close(self) -> None:
        if self.fh:
            self.fh.close()
            self.fh = None


def truncate_after(path: str, step: int) -> int:
    """Drop the records of steps after `step` (and unparsable lines; records without a step stay)
    from a JSONL log, atomically
    (a temporary file renamed over it). Returns how many lines were dropped.

    Example:
      >>> truncate_after("runs/x.jsonl", 500)   # the run resumes from checkpoint step 500
    """
    with open(path) as fh:
        lines = fh.read().splitlines()
    keep = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # a line torn by a kill mid-write
            continue
        if isinstance(rec, dict) and (not isinstance(rec.get("step"), int) or rec["step"] <= step):
            keep.append(line)
    dropped = len(lines) - len(keep)
    if dropped:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            fh.write("".join(l + "\n" for l in keep))
        os.replace(tmp, path)
    return dropped
