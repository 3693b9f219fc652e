"""Memory preflight: before the first step, the compiled train step's peak against what the devices hold.

The peak is XLA's estimate for the compiled step (arguments + outputs + temp − aliased, per device;
`remat_lm.training.log.compiled_estimate`). What there is: on a GPU/TPU `memory_stats()['bytes_limit']` of
the devices in the mesh (the smallest); on CPU the host's available RAM (`MemAvailable` in
/proc/meminfo), shared by all CPU devices of the mesh, so the need is the per-device peak times
their number; with `--target` and no such device here, the target's `memory_limit` per device (JAX's
share of a GPU's memory, a TPU's HBM), the peak being its compiler's. The line names the verdict:
`fits on 8 x NVIDIA H200 141GB HBM3e with 61% headroom at batch 8` or `does not fit ...`; a program
that XLA:TPU refuses to compile for lack of memory does not fit, with the compiler's figure
(`refusal`). When the step does not fit, `check` raises a UsageError whose one line says what it
needs, what there is, and the setting to try, found by compiling (not running) at most a few
candidates, most memory-saving first:

  1. full remat (every layer), the run's `--loss_chunk`;  2. the same with `--loss_chunk 128`.
     The first that fits gives `--recompute_method auto --memory_budget B` (plus `--loss_chunk`):
     the planner (remat.plan_for_budget) then picks the cheapest recompute per layer that fits B,
     which is 80% of what there is (per device), rounded down.
  3. If neither fits (or the target's compiler refuses them), a smaller `--batch_size` (a multiple
     of the mesh's size that divides the sequences per step) with `--grad_accum_steps` raised so that their product stays the same, `--activation_recompute` and the
     chunked loss: concrete flags, verified by compiling exactly the configuration they give (at most
     3 tries); or, when the parameters and optimizer state alone exceed the budget, a smaller
     model or more devices. The candidates are compiled for the run's target too.

No advice offloads to host memory: each drops `--cpu_checkpointing` and offload policies (whether
an offload frees device memory depends on the compiler: docs/offload.md), and the planner's
default candidates keep everything on the device.

It runs after the step is compiled and before anything is trained or written, for `--dry_run` too.
`train.py --no-preflight` skips the check (and then may die of XLA's RESOURCE_EXHAUSTED).

Example:
    >>> compiled = compile_train_step(setup)
    >>> check(setup, compiled)   # raises UsageError("the train step needs 3055.2 GiB ...")
"""
from __future__ import annotations

import dataclasses
import math

from remat import policies
from remat.memory import GiB, MiB, compiled_stats
from remat.memory import format_bytes
from remat.planning import recompute_config
from remat_lm.argtypes import parse_size
from remat_lm.training.checks import device_memory_limit, host_available
from remat_lm.training.compile import compile_train_step
from remat_lm.training.config import UsageError
from remat_lm.training.log import compiled_estimate
from remat_lm.training import target as run_target

__all__ = ["BATCH_TRIES", "DEFAULT_CHUNK", "HEADROOM", "Capacity", "advice", "capacity", "capacity_of", "check",
           "headroom", "host_available", "refusal", "split_batch", "verdict"]

HEADROOM = 0.8       # a suggested budget leaves 20% to the rest of the process (and, on CPU, the host)
DEFAULT_CHUNK = 128  # --loss_chunk suggested when the run has none (at most a quarter of T)
BATCH_TRIES = 3      # compilations at most to verify a suggested smaller batch


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Bytes the mesh's devices can hold, where the figure comes from, and how many compiled
    per-device peaks share it (CPU devices all live in host RAM)."""
    bytes: int
    what: str
    sharing: int = 1

    @property
    def budget_flag(self) -> str:
        """A per-device `--memory_budget` that leaves HEADROOM, rounded down (0.1 GiB or 1 MiB)."""
        n = self.bytes * HEADROOM / self.sharing
        return f"{math.floor(n / GiB * 10) / 10:g}GiB" if n >= GiB else f"{max(1, int(n // MiB))}MiB"

    @property
    def budget(self) -> int:
        """`budget_flag` in bytes."""
        return parse_size(self.budget_flag)


def capacity(devices) -> Capacity | None:
    """What the devices hold: accelerator `bytes_limit` (smallest over `devices`), or host RAM."""
    devices = list(devices)
    if all(d.platform == "cpu" for d in devices):
        avail = host_available()
        return None if avail is None else Capacity(avail, "available host RAM (MemAvailable)", len(devices))
    limits = [lim for lim in map(device_memory_limit, devices) if lim is not None]
    if not limits:
        return None
    return Capacity(min(limits), f"the device memory limit ({devices[0].platform} bytes_limit)", 1)


def capacity_of(setup) -> Capacity | None:
    """What one device of the run holds: `--target`'s `memory_limit` when its devices are compile-only
    (`remat_lm.training.target.limit_words` says what that is), else the devices' own (`capacity`)."""
    if setup.deviceless:
        t = setup.target
        return Capacity(t.memory_limit, run_target.limit_words(t), 1)
    return capacity(setup.mesh.devices.flat)


def headroom(need: int, cap: Capacity) -> int:
    """The percent of the capacity left free, rounded down: 61 for a step needing 39.4% of it."""
    return max(0, math.floor(100 * (1 - need / cap.bytes)))


def verdict(setup, need: int | None, cap: Capacity, refused: run_target.Refused | None = None) -> str:
    """`fits on 8 x NVIDIA H200 141GB HBM3e with 61% headroom at batch 8` / `does not fit on ...`."""
    where = f" on {setup.target.hardware()}" if setup.target is not None else ""
    batch = f" at batch {setup.cfg.batch_size}"
    if refused is None and need is not None and need <= cap.bytes:
        return f"fits{where} with {headroom(need, cap)}% headroom{batch}"
    return f"does not fit{where}{batch}"


def check(setup, compiled, compile_step=None) -> str | None:
    """Raise UsageError (one line: need, capacity, verdict, what to try) unless the compiled step fits.

    Args:
      setup: the run's `remat_lm.training.prepare.Setup`; compiled: its compiled train step.
      compile_step: `(setup, model_config) -> compiled` (default `remat_lm.training.compile.compile_train_step`),
        which compiles the candidate settings of the advice.
    Returns:
      a line for the run's summary ("needs X of Y ...: fits ..."), or None when the capacity is unknown.
    """
    compile_step = compile_train_step if compile_step is None else compile_step
    cap = capacity_of(setup)
    peak = compiled_estimate(compiled)
    if cap is None or peak is None:
        return None
    need = peak * cap.sharing
    t = setup.target
    if t is not None:
        per = " per device" if cap.sharing == 1 else f" ({cap.sharing} devices x {format_bytes(peak)})"
        figure = f"the train step needs {format_bytes(need)}{per} ({t.compiler}'s figure)"
        if need <= cap.bytes:
            return f"{figure} of {format_bytes(cap.bytes)} ({cap.what}): {verdict(setup, need, cap)}"
        head = f"{figure} but {cap.what} is {format_bytes(cap.bytes)}: {verdict(setup, need, cap)}"
    else:
        if need <= cap.bytes:
            return f"the train step needs {format_bytes(need)} of {format_bytes(cap.bytes)} {cap.what}: fits"
        per = f" ({cap.sharing} devices x {format_bytes(peak)})" if cap.sharing > 1 else ""
        head = (f"the train step needs {format_bytes(need)}{per} (XLA's compiled peak) but {cap.what} is "
                f"{format_bytes(cap.bytes)}")
    raise UsageError(f"{head}; {_hint(setup, cap, compile_step)}; or pass --no-preflight to try anyway")


def refusal(setup, err: run_target.Refused, compile_step=None, advise: bool = True) -> UsageError:
    """The UsageError for a train step the target's compiler refused (`Refused`): the compiler's words
    and figure, the verdict (does not fit), and, with `advise`, the setting to try (compiled for it)."""
    compile_step = compile_train_step if compile_step is None else compile_step
    cap = capacity_of(setup)
    head = f"the train step {verdict(setup, None, cap, err)}: {err}"
    if not advise or cap is None:
        return UsageError(head)
    return UsageError(f"{head}; {_hint(setup, cap, compile_step)}")


def _hint(setup, cap: Capacity, compile_step) -> str:
    try:
        return advice(setup, cap, compile_step)
    except Exception as e:  # a candidate that does not even compile must not hide the finding
        return (f"compiling a more memory-saving setting failed ({type(e).__name__}); lower --batch_size or "
                f"--sequence_length, or add --activation_recompute --loss_chunk 128")


def _full(mcfg):
    """Full remat on every layer, written as the planner writes its minimum (the same program)."""
    return recompute_config((policies.NOTHING,) * mcfg.n_layer)


def _peak(setup, compile_step, mcfg) -> tuple[int | None, object]:
    """(compiled peak, compiled) of a candidate; (None, the Refused) when the target's compiler refused it."""
    try:
        compiled = compile_step(setup, mcfg)
    except run_target.Refused as e:
        return None, e
    return compiled_estimate(compiled), compiled


def _needs(p: int | None, refused, cap: Capacity) -> str:
    """`needs 12.3 GiB`, or `is refused by XLA:TPU (needs 47.7 GiB)` for a refused candidate."""
    if p is not None:
        return f"needs {format_bytes(p * cap.sharing)}"
    figure = f" (needs {format_bytes(refused.needed)})" if refused.needed else ""
    return f"is refused by {refused.args[0].split(' cannot fit')[0]}{figure}"


def advice(setup, cap: Capacity, compile_step) -> str:
    """The setting to try, found by compiling the most memory-saving candidates (see the module doc)."""
    cfg, mcfg = setup.cfg, setup.mcfg
    budget = cap.budget
    chunk = mcfg.loss_chunk or min(DEFAULT_CHUNK, max(1, cfg.sequence_length // 4))
    full = _full(mcfg)
    auto = f"--recompute_method auto --memory_budget {cap.budget_flag}"
    drop = [f for f, on in (("--recompute_granularity", cfg.recompute_granularity not in (None, "full")),
                            ("--recompute_modules", cfg.recompute_modules is not None),
                            ("--remat_policy", cfg.remat_policy is not None),
                            ("--use_reentrant", cfg.use_reentrant), ("--scan_layers", cfg.scan_layers),
                            ("--cpu_checkpointing", cfg.cpu_checkpointing)) if on]
    without = f" (without {', '.join(drop)})" if drop else ""
    planner = "the planner then picks the cheapest recompute per layer that fits"
    last = None
    for c in dict.fromkeys((mcfg.loss_chunk, chunk)):
        cand = dataclasses.replace(mcfg, recompute=full, loss_chunk=c)
        p, compiled = _peak(setup, compile_step, cand)
        last = (p, compiled)
        what = "full remat" + (f" and --loss_chunk {c}" if c else "")
        if p is not None and p <= budget:
            flags = auto + (f" --loss_chunk {c}" if c != mcfg.loss_chunk else "")
            return f"{what} {_needs(p, compiled, cap)}: try {flags}{without} ({planner})"
    p_min, compiled = last
    return _batch_advice(setup, cap, compile_step, chunk, p_min, compiled)


def split_batch(seqs: int, most: int, step: int = 1) -> tuple[int, int] | None:
    """`(batch_size, grad_accum_steps)` whose product is exactly `seqs`: the largest micro-batch that is
    at most `most`, a multiple of `step` and divides `seqs`; None when there is none.

    Example:
        >>> split_batch(65536, 44731)
        (32768, 2)
        >>> split_batch(96, 40, step=8)
        (32, 3)
        >>> split_batch(12, 5, step=8) is None
        True
    """
    # NOTE: only divisors: rounding the accumulation up (ceil(seqs / b)) would change the optimizer's
    # step (65,536 sequences became 2 x 44,731 = 89,462), which the advice promises to keep.
    best = None
    for d in range(1, math.isqrt(seqs) + 1):
        if seqs % d:
            continue
        for b in (d, seqs // d):
            if b <= most and b % step == 0 and (best is None or b > best):
                best = b
    return None if best is None else (best, seqs // best)


def _batch_advice(setup, cap, compile_step, chunk, p_min, compiled) -> str:
    """A smaller micro-batch with full remat and the chunked loss, as concrete flags, verified by
    compiling exactly the configuration they give."""
    cfg, budget = setup.cfg, cap.budget
    if p_min is None:  # refused by the target's compiler: only its figure for the temporaries, if any
        temp, fixed = compiled.needed or 0, 0
    else:
        temp = compiled_stats(compiled).temp
        fixed = p_min - temp  # parameters, optimizer state, gradients, the batch: what temp is not
    what = f"even full remat with --loss_chunk {chunk} {_needs(p_min, compiled, cap)}"
    step = setup.mesh.size  # the batch is sharded over every mesh axis
    drop = [f for f, on in (("--recompute_granularity", cfg.recompute_granularity not in (None, "full")),
                            ("--recompute_method", cfg.recompute_method != "none"),
                            ("--memory_budget", cfg.memory_budget is not None),
                            ("--recompute_modules", cfg.recompute_modules is not None),
                            ("--remat_policy", cfg.remat_policy is not None),
                            ("--cpu_checkpointing", cfg.cpu_checkpointing)) if on]
    without = f" (without {', '.join(drop)})" if drop else ""
    b, seqs = cfg.batch_size, cfg.batch_size * cfg.grad_accum_steps  # sequences per optimizer step
    for _ in range(BATCH_TRIES):
        if fixed >= budget or (temp <= 0 and p_min is not None):
            return (f"{what} and the parameters and optimizer state alone need {format_bytes(fixed * cap.sharing)}: use a "
                    f"smaller model, or shard them over more devices (--mesh fsdp=N)")
        # below the micro-batch that did not fit (half of it when a refusal gave no figure)
        most = min(int(b * (budget - fixed) / temp), b - 1) if temp > 0 else b // 2
        if most < step:
            break
        split = split_batch(seqs, most, step)
        if split is None:
            return (f"{what}; a micro-batch of at most {most:,} might fit, but none that is a multiple of {step} "
                    f"(the mesh's devices) divides the {seqs:,} sequences per step: choose --batch_size and "
                    f"--grad_accum_steps whose product is near {seqs:,}, with --activation_recompute "
                    f"--loss_chunk {chunk}{without}")
        b, accum = split
        tcfg = dataclasses.replace(cfg, batch_size=b, grad_accum_steps=accum, activation_recompute=True,
                                   recompute_granularity=None, recompute_method="none", memory_budget=None,
                                   recompute_modules=None, remat_policy=None, cpu_checkpointing=False,
                                   loss_chunk=chunk)
        trial = dataclasses.replace(setup, cfg=tcfg)
        p, compiled = _peak(trial, compile_step, dataclasses.replace(setup.mcfg, recompute=tcfg.recompute,
                                                                     loss_chunk=chunk))
        if p is not None and p <= budget:
            keep = f" --grad_accum_steps {accum}" if accum != cfg.grad_accum_steps else ""
            short = (f"; {b:,} is the largest micro-batch that divides them (a multiple of {step}) below the "
                     f"{most:,} that might fit" if 2 * b <= most else "")
            return (f"{what}: reduce the micro-batch, e.g. --batch_size {b}{keep} --activation_recompute "
                    f"--loss_chunk {chunk}{without}, which {_needs(p, compiled, cap)} "
                    f"(the same {seqs:,} sequences, {seqs * cfg.sequence_length:,} tokens, per step{short})")
        if p is None:
            temp, fixed, p_min = compiled.needed or 0, 0, None
        else:
            temp = compiled_stats(compiled).temp
            fixed, p_min = p - temp, p
    return (f"{what}, and no smaller batch found fits: use a shorter --sequence_length, a smaller model, or "
            f"more devices (--mesh fsdp=N)")
