"""`--target NAME`: build the run's programs for an accelerator (`remat.planning.targets`), present or not.

`resolve(cfg)` gives the run's `remat.planning.targets.Target` (None without `--target`) and whether its
devices are compile-only ones (`deviceless`: this host has not got them) or this host's own (the
host is the target: training works as without the flag). Everything the run compiles is then built
for it (`building(setup)`: `remat.memory.building_for(platform)` and the mesh), the preflight
compares with its `memory_limit`, and `--recompute_method auto` takes that as its default budget.

Example:
    >>> from remat_lm.training import TrainConfig
    >>> t, deviceless = resolve(TrainConfig(target="h200x8", mesh="fsdp=8", dry_run=True))
    >>> t.hardware(), deviceless, words(t)
    ('8 x NVIDIA H200 141GB HBM3e', True, 'XLA:GPU for 8 x NVIDIA H200 141GB HBM3e')

A run that would train on compile-only devices (no --dry_run, no --memory_report) is bad input,
found before any data is read.
"""
from __future__ import annotations

import contextlib
import re

import jax

import remat
from remat.planning import targets as remat_targets
from remat_lm.argtypes import UsageError

__all__ = ["Refused", "building", "check_mesh", "devices", "get", "host_has", "is_host_cpu", "limit_words",
           "refused", "refused_bytes", "resolve", "words"]


def get(name: str) -> remat_targets.Target:
    """`remat.planning.targets.get(name)`, its ValueError as a UsageError naming `--target` and the valid names."""
    try:
        return remat_targets.get(name)
    except ValueError as e:
        msg = str(e)
        raise UsageError("--" + msg if msg.startswith("target ") else f"--target {name!r}: {msg}") from None


def is_host_cpu(name: str) -> bool:
    """True for `cpu` / `cpuxN`: this host's CPU, whose device count is known only once JAX has started."""
    return re.fullmatch(r"cpu(x\d+)?", str(name).strip().lower(), re.ASCII) is not None


def host_has(t: remat_targets.Target) -> bool:
    """True when this host's own devices are `t`'s: the platform and device kind, and at least `t.count`."""
    devices = jax.devices() if t.platform != "cpu" else jax.devices("cpu")
    if t.platform == "cpu":
        return jax.default_backend() == "cpu" and len(devices) >= t.count
    return len(devices) >= t.count and all(t.spec.is_device(d) for d in devices)


def _fix_for(t: remat_targets.Target, n: int) -> str:
    """The target of the same accelerator with `n` devices, as a `--target` value."""
    if t.platform == "cuda":
        return t.spec.kind if n == 1 else f"{t.spec.kind}x{n}"
    if t.platform == "tpu":
        if n == 1:
            return t.spec.kind
        return f"{t.spec.kind}:{'x'.join(map(str, _balanced(n, 3 if t.spec.kind == 'v5p' else 2)))}"
    return "cpu" if n == len(jax.devices("cpu")) else f"cpux{n}"


def _balanced(n: int, k: int) -> tuple[int, ...]:
    """`n` as `k` factors, smallest first, as near each other as they go: (2, 4) for 8, (2, 2, 2) in 3."""
    if k == 1:
        return (n,)
    a = max(d for d in range(1, int(round(n ** (1 / k))) + 2) if n % d == 0 and d ** k <= n)
    return (a, *_balanced(n // a, k - 1))


def _mesh_flag(n: int) -> str:
    return "--mesh fsdp=1" if n == 1 else f"--mesh fsdp={n}"


def check_mesh(t: remat_targets.Target, mesh: str, n: int) -> None:
    """UsageError unless `--mesh` (the flag's text, spanning `n` devices) spans exactly the target's
    devices, naming both and the fix."""
    if n == t.count:
        return
    over = (f"--mesh fsdp=1 for its one device" if t.count == 1 else
            f"a mesh over all {t.count} (e.g. {_mesh_flag(t.count)})")
    raise UsageError(f"--mesh {mesh} spans {n} device{'s' if n != 1 else ''} but --target {t.name} has {t.count}; "
                     f"pass --target {_fix_for(t, n)} for that mesh, or {over}")


def resolve(cfg) -> tuple[remat_targets.Target | None, bool]:
    """(the run's Target or None, deviceless): UsageError (one line) for a bad name, a mesh of
    another size, a missing compiler, or a run that would train on devices this host has not got."""
    if cfg.target is None:
        return None, False
    t = get(cfg.target)
    check_mesh(t, cfg.mesh, cfg.mesh_size)
    if host_has(t):
        return t, False
    if not (cfg.dry_run or cfg.memory_report):
        devs = jax.devices()
        raise UsageError(f"--target {t.name} is {t.hardware()}, which this host has not got (it has {len(devs)} "
                         f"{devs[0].platform} device{'s' if len(devs) != 1 else ''}), so nothing can train on it; "
                         f"add --dry_run (compile and check the train step for it"
                         f"{', with the planned setting' if cfg.recompute_method == 'auto' else ''}) or --memory_report")
    devices(t)  # the compiler's presence, now: its absence is one line before any data is read
    return t, True


def devices(t: remat_targets.Target) -> list:
    """`t`'s compile-only devices; a missing compiler is a UsageError naming the install
    (`remat.planning.targets.TargetUnavailable`)."""
    try:
        return t.devices()
    except remat_targets.TargetUnavailable as e:
        raise UsageError(f"--target {t.name}: {e}") from None


def words(t: remat_targets.Target) -> str:
    """Which compiler gives the figures, for what: `XLA:GPU for 8 x NVIDIA H200 141GB HBM3e`."""
    return f"{t.compiler} for {t.hardware()}"


def limit_words(t: remat_targets.Target) -> str:
    """What `t.memory_limit` is: `JAX's share (75%) of an NVIDIA H200's 141.00 GiB`."""
    fmt = remat.memory.format_bytes
    if t.platform == "cuda" and t.memory_limit < t.memory:
        return f"JAX's share ({t.memory_limit / t.memory:.0%}) of an {' '.join(t.spec.title.split()[:2])}'s {fmt(t.memory)}"
    return f"the {fmt(t.memory)} of {'this host (available RAM)' if t.platform == 'cpu' else 'a ' + t.spec.title}"


@contextlib.contextmanager
def building(setup):
    """Trace and compile for the run's devices: under the mesh, and `remat.memory.building_for` the
    target's platform when its devices are compile-only (the attention core and other platform
    choices follow it; on the target itself they follow the host, which is the same platform)."""
    with contextlib.ExitStack() as stack:
        if getattr(setup, "deviceless", False):
            stack.enter_context(remat.memory.building_for(setup.target.platform))
        stack.enter_context(jax.set_mesh(setup.mesh))
        yield


class Refused(MemoryError):
    """The target's compiler refused a program too large for its memory (XLA:TPU's RESOURCE_EXHAUSTED):
    one line naming the compiler and its words (`remat.planning.targets.compile`'s), `needed` (bytes, the
    compiler's figure, or None) and `flops` (the program's matmul FLOPs per device, or None)."""

    def __init__(self, message: str, needed: int | None, flops: float | None = None):
        super().__init__(message)
        self.needed, self.flops = needed, flops


def refused(t: remat_targets.Target, e: BaseException, flops: float | None = None) -> Refused:
    """`e`, the compiler's out-of-memory error for `t`, as a `Refused`."""
    first = (str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__).rstrip(".")
    return Refused(f"{t.compiler} cannot fit the program on {t.hardware()}: {first}", refused_bytes(first), flops)


# XLA:TPU's two wordings: "the total memory required for HLO temporaries (47.68G) exceeds available
# HBM (15.75G)" and "Used 20.22G of 15.48G hbm" (G: GiB, as it counts HBM).
_NEEDED = re.compile(r"required[^(]*\(([\d.]+)([KMGT])\)|Used ([\d.]+)([KMGT]) of")


def refused_bytes(message: str) -> int | None:
    """The bytes a compiler's refusal says the program needs (`... HLO temporaries (47.68G) exceeds
    available HBM (15.75G)` → 47.68 GiB), or None when it names no figure."""
    m = _NEEDED.search(str(message))
    if not m:
        return None
    value, unit = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    return int(float(value) * 1024 ** ("KMGT".index(unit) + 1))
