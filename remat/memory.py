"""What is saved for the backward pass, and what XLA compiled.

# NOTE: `saved_residuals` wraps JAX's internal `saved_residuals` (jax 0.10 exports only
# `print_saved_residuals`), imported by `remat._compat`, the one module touching JAX internals.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections import defaultdict

import jax
import numpy as np

from remat import names as _names
from remat import policies as _policies
from remat.config import RecomputeConfig
from remat.plan import plan as _plan

from remat._compat import saved_residuals as _jax_saved_residuals

_NAMED = re.compile(r"named '([^']+)'")


_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM when allocating")


def is_oom(err: BaseException) -> bool:
    """True for an out-of-memory error: XLA's (at compile or run time, any backend) or Python's.

    Example:
      >>> is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB"))
      True
    """
    return isinstance(err, MemoryError) or any(s in str(err) for s in _OOM_MARKERS)

@dataclasses.dataclass(frozen=True)
class Residual:
    """One saved value: tag name (or its source), shape, dtype, bytes, JAX's description, kind."""
    name: str
    shape: tuple
    dtype: str
    bytes: int
    source: str
    kind: str  # "argument", "named", "intermediate", "constant"
    host: bool = False  # offloaded to host memory (a policy's `offload` choice)


@dataclasses.dataclass(frozen=True)
class SavedResiduals:
    """Rows of saved values with totals. `total` counts arguments too; `intermediates` does not."""
    rows: tuple

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def intermediates(self) -> int:
        return sum(r.bytes for r in self.rows if r.kind != "argument")

    @property
    def offloaded(self) -> int:
        """Bytes kept in host memory (offloaded); the rest stay on the device."""
        return sum(r.bytes for r in self.rows if r.host)

    def by_name(self) -> dict:
        """{tag name or source kind: (count, bytes)}, largest first."""
        acc = defaultdict(lambda: [0, 0])
        for r in self.rows:
            key = r.name if r.kind == "named" else f"<{r.kind}:{r.name}>" if r.kind != "argument" else "<arguments>"
            key += " (host)" if r.host else ""
            acc[key][0] += 1
            acc[key][1] += r.bytes
        return dict(sorted(((k, tuple(v)) for k, v in acc.items()), key=lambda kv: -kv[1][1]))

    def __getitem__(self, key):  # dict-style access for programs: res["total"], res["rows"]
        return self.as_dict()[key]

    def as_dict(self) -> dict:
        return {"rows": [dataclasses.asdict(r) for r in self.rows], "by_name": self.by_name(),
                "total": self.total, "intermediates": self.intermediates}

    def table(self) -> str:
        """A pretty-printed table grouped by tag name."""
        lines = [f"{'saved value':<36} {'count':>5} {'MiB':>10}"]
        for k, (c, b) in self.by_name().items():
            lines.append(f"{k[:36]:<36} {c:>5} {b / MiB:>10.2f}")
        lines.append(f"{'total (intermediates)':<36} {'':>5} {self.intermediates / MiB:>10.2f}")
        lines.append(f"{'total (with arguments)':<36} {'':>5} {self.total / MiB:>10.2f}")
        if self.offloaded:
            lines.append(f"{'of which offloaded to host':<36} {'':>5} {self.offloaded / MiB:>10.2f}")
            if jax.default_backend() == "cpu":
                lines.append("note: on CPU, offloading moves nothing (host and device memory are the same): "
                             "no device memory is saved; it does on GPU/TPU")
        return "\n".join(lines)


def _nbytes(aval) -> int:
    try:
        return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        return int(np.prod(aval.shape, dtype=np.int64)) * 8


def saved_residuals(fn, *args) -> SavedResiduals:
    """List what `jax.vjp(fn, *args)` keeps for the backward pass.

    Args:
      fn: a function of arrays/pytrees (closed-over constants allowed).
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`s are not accepted: use arrays).
    Returns:
      SavedResiduals with `.rows`, `.total`, `.intermediates`, `.by_name()`, `.table()`.
    Example:
      >>> import jax.numpy as jnp
      >>> from jax.ad_checkpoint import checkpoint_name
      >>> f = lambda w, x: jnp.sum(jnp.sin(checkpoint_name(x @ w, "mlp_up")))
      >>> saved_residuals(f, jnp.ones((8, 8)), jnp.ones((4, 8))).by_name()   # {name: (count, bytes)}
      {'<arguments>': (2, 384), '<intermediate:cos>': (1, 128)}
      >>> g = jax.checkpoint(f, policy=_policies.get("save_names:mlp_up"))  # keep the tagged product instead
      >>> saved_residuals(g, jnp.ones((8, 8)), jnp.ones((4, 8))).by_name()
      {'<arguments>': (2, 384), 'mlp_up': (1, 128)}
    """
    rows = []
    for aval, src in _jax_saved_residuals(fn, *args):
        m = _NAMED.search(src)
        if m:
            kind, name = "named", m.group(1)
        elif src.startswith("from the argument"):
            kind, name = "argument", src.removeprefix("from the argument ").strip()
        elif src.startswith("from a") :
            kind, name = "constant", src.removeprefix("from ").strip()
        else:
            kind = "intermediate"
            name = src.split(" from ")[0].removeprefix("output of ").strip()
        dtype = str(aval.dtype) if hasattr(aval, "dtype") else "?"
        host = "host" in str(getattr(aval, "memory_space", "")).lower()
        rows.append(Residual(name, tuple(getattr(aval, "shape", ())), dtype, _nbytes(aval), src, kind, host))
    inter = {r.name for r in rows if r.kind == "intermediate"}
    if "scan" in inter and inter & _VIEW_PRIMITIVES:
        views = _argument_views(fn, args, rows)
        if views is not None:
            rows = [dataclasses.replace(r, kind="argument", name=f"{r.name} of an argument") if v else r
                    for r, v in zip(rows, views)]
    return SavedResiduals(tuple(rows))


# NOTE: argument views. Under `lax.scan` a stack's parameters enter the loop reshaped or sliced
# per group of layers (`remat.stack.apply_layers`), so JAX lists those reshapes among the saved
# values ("output of reshape"), though they are the arguments' own bytes seen through a new shape,
# not activations. A saved value computed from an argument by these shape-only primitives alone
# (offsets aside) is counted as an argument, so `intermediates` counts the same activations in
# every layout. A cast is a new buffer and stays an intermediate. The check traces the program a
# second time, so it runs only where a scan's outputs are saved beside such a view (the scan
# layout), and other programs are traced once.
_VIEW_PRIMITIVES = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose", "slice",
                              "dynamic_slice", "copy", "copy_p", "reduce_precision"})


def _argument_views(fn, args, rows):
    """Per row of `rows` (JAX's saved-residual order): whether it is a shape-only view of an
    argument; None when the program traced here does not line up with the rows."""
    from jax.extend.core import Literal
    leaves, tree = jax.tree.flatten(args)
    closed, out_shape = jax.make_jaxpr(lambda *a: jax.vjp(lambda *b: fn(*jax.tree.unflatten(tree, b)), *a),
                                       return_shape=True)(*leaves)
    jaxpr = closed.jaxpr
    outs = jaxpr.outvars[len(jaxpr.outvars) - len(jax.tree.leaves(out_shape[1])):]
    subst = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive.name == "reduce_precision"}
    res = {subst.get(v, v) for v in outs if not isinstance(v, Literal)}
    views = set(jaxpr.invars)
    for e in jaxpr.eqns:
        first, *rest = e.invars or [None]
        if (e.primitive.name in _VIEW_PRIMITIVES and not isinstance(first, Literal) and first in views
                and all(isinstance(v, Literal) or v.aval.shape == () for v in rest)):
            views.update(e.outvars)
    flags = [False] * sum(isinstance(v, Literal) for v in outs)
    flags += [False for v in list(jaxpr.constvars) + list(jaxpr.invars) if v in res]
    flags += [v in views for e in jaxpr.eqns for v in e.outvars if v in res]
    shapes = [tuple(v.aval.shape) for e in jaxpr.eqns for v in e.outvars if v in res]
    if len(flags) != len(rows) or shapes != [r.shape for r in rows[len(rows) - len(shapes):]]:
        return None
    return flags


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's memory analysis and cost analysis of one compiled function (bytes, FLOPs)."""
    temp: int
    argument: int
    output: int
    alias: int
    generated_code: int
    host_temp: int
    flops: float | None  # None: the compiler gave no cost analysis
    host_argument: int = 0
    host_output: int = 0
    flops_source: str = "compiler"  # or "jaxpr matmuls" (remat.targets.matmul_flops)

    @property
    def peak_estimate(self) -> int:
        """argument + output + temp - alias: what the program needs live at once, at most."""
        return self.argument + self.output + self.temp - self.alias


def compiled_stats(compiled) -> CompiledMemory:
    """XLA's memory and cost analysis of a `jax.stages.Compiled`: the one reader of
    `memory_analysis()` / `cost_analysis()` in the project (a `CompiledMemory` is returned as is).

    Raises ValueError when the backend gives no memory analysis.
    Example:
      >>> import jax.numpy as jnp
      >>> stats = compiled_stats(jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(1024)).compile())
      >>> stats.argument, stats.output
      (4096, 4096)
    """
    if isinstance(compiled, CompiledMemory):
        return compiled
    ma = compiled.memory_analysis()
    if ma is None:
        raise ValueError(f"XLA gave no memory analysis for this program on {jax.default_backend()}")
    try:
        ca = compiled.cost_analysis()
    except Exception:  # pragma: no cover - backends without a cost model
        ca = None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    g = lambda k: int(getattr(ma, k, 0) or 0)
    return CompiledMemory(temp=g("temp_size_in_bytes"), argument=g("argument_size_in_bytes"),
                          output=g("output_size_in_bytes"), alias=g("alias_size_in_bytes"),
                          generated_code=g("generated_code_size_in_bytes"),
                          host_temp=g("host_temp_size_in_bytes"),
                          host_argument=g("host_argument_size_in_bytes"), host_output=g("host_output_size_in_bytes"),
                          flops=float(ca["flops"]) if ca and "flops" in ca else None)


def compiled_memory(fn, *args, static_argnums=()) -> CompiledMemory:
    """Compile `fn(*args)` with jit and read XLA's memory and cost analysis (`compiled_stats`).

    Example:
      >>> compiled_memory(lambda x: jax.numpy.sin(x) * 2, jax.numpy.ones(1024)).output
      4096
    """
    return compiled_stats(jax.jit(fn, static_argnums=static_argnums).lower(*args).compile())


# ------------------------------------------------------------------------------------------------
# The platform a program is built for.

# NOTE: the attention core (remat_lm/models/attention.py) and the cotangent tie (remat/checkpoint.py `_tie`)
# differ per platform, and both are chosen while tracing, before XLA knows the lowering platforms.
# `jax.lax.platform_dependent` would defer the choice to lowering, but differentiating it keeps the
# residuals of every branch (a `cond`'s residuals are the union over branches, zero-filled where a
# branch has none), so a cuDNN program would also allocate the tiled core's. Instead the platform
# is explicit: `building_for(platform)` names it while tracing (`lowered_for` does), and without it
# the host's own backend is the target, as when train.py runs on the machine it trains on. The
# target is a `jax.make_user_context`, part of JAX's trace and jit cache keys.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
ACCELERATORS = ("cuda", "rocm", "tpu")
# a jit-cache-sensitive context: the same function traced for two platforms is traced twice
_TARGET = jax.make_user_context(None)


def host_platform() -> str:
    """This process's default backend in lowering words: cpu, cuda, rocm or tpu."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
    return "rocm" if "rocm" in version else "cuda"


def target_platform() -> str:
    """The platform the program being traced is built for: `building_for`'s, else the host's.

    Example:
      >>> with building_for("tpu"):
      ...     target_platform()
      'tpu'
    """
    return _TARGET.value or host_platform()


@contextlib.contextmanager
def building_for(platform: str):
    """Trace for `platform` (cpu | cuda | rocm | tpu): the platform-dependent pieces (attention
    core, cotangent tie) take that platform's form, whatever this host is."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} is not valid; use one of {', '.join(PLATFORMS)}")
    with _TARGET(platform):
        yield


def lowered_for(fn, platform: str, *args, **kwargs) -> jax.stages.Lowered:
    """`fn(*args, **kwargs)` jitted, traced and lowered for `platform` from any host (no compile).

    `fn` may be jitted already (its shardings and donation are kept). Read the program with
    `.as_text()` (StableHLO): e.g. the cuDNN attention call `__cudnn$fmha...` on cuda, the Pallas
    kernel `tpu_custom_call` on tpu, `_xla_buffer_placement = "pinned_host"` for offloaded values.
    `python -m remat_lm.bench.lower` does it for the train step.
    Example:
      >>> "stablehlo.sine" in lowered_for(jax.numpy.sin, "tpu", jax.numpy.ones(4)).as_text()
      True
    """
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    with building_for(platform):
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,))


MiB, GiB = 2 ** 20, 2 ** 30


def format_bytes(n: float | None, up: bool = False) -> str:
    """Bytes in GiB/MiB/KiB, whichever reads best: the one bytes formatter for messages and
    reports ("n/a" for None). `up` rounds up (a minimum stays a minimum).

    Example:
      >>> format_bytes(3 * 2**30), format_bytes(1536 * 2**10), format_bytes(1000), format_bytes(1025, up=True)
      ('3.00 GiB', '1.50 MiB', '1000 B', '1.1 KiB')
    """
    if n is None:
        return "n/a"
    a = abs(n)
    for unit, scale, digits in (("GiB", GiB, 2), ("MiB", MiB, 2), ("KiB", 2 ** 10, 1)):
        if a >= scale:
            v = n / scale
            if up:
                v = math.ceil(v * 10**digits) / 10**digits
            return f"{v:.{digits}f} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """What one layer keeps for its backward pass without remat, in bytes.

    `tagged` maps remat.names tags to bytes (block_input included); `untagged` counts the values
    with no tag (norm statistics, the mid-layer residual sum, the attention log-sum-exp, bf16
    casts of weights); `constants` are closed-over tables (RoPE) that `jax.checkpoint` keeps too;
    `swaps` are tagged values that no-remat does not keep but a tag-saving policy does, in place
    of an untagged value it then recomputes (the attention output instead of the residual sum).
    """
    tagged: dict
    untagged: int
    constants: int = 0
    swaps: dict = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.tagged.values()) + self.untagged + self.constants


def predict_saved(layer: LayerBytes, n_layers: int, cfg: RecomputeConfig, head: int = 0) -> int | None:
    """Analytic saved bytes of a layer stack under `cfg`, plus `head` bytes kept outside the stack.

    A checkpointed region keeps its input (`block_input`) and, per layer, the tagged values its
    policy saves; untagged values are recomputed. Policies are registry names or JAX policy callables;
    returns None for those that do not save by tag name (`dots`, `dots_no_batch`, offloading ones,
    a callable of your own: `remat.policies.by_name` says which do). Derivation: docs/memory-model.md.

    Example:
      >>> layer = LayerBytes({_names.BLOCK_INPUT: 100, _names.QKV: 300}, untagged=50)
      >>> predict_saved(layer, 8, RecomputeConfig()), predict_saved(layer, 8, RecomputeConfig(granularity="full"))
      (3600, 800)
    """
    inp = layer.tagged.get(_names.BLOCK_INPUT, 0)
    if cfg.granularity == "none":
        return n_layers * layer.total + head
    total = head
    for seg in _plan(n_layers, cfg):
        k = seg.stop - seg.start
        if not seg.checkpointed:
            total += k * layer.total
            continue
        per = _region_bytes(layer, cfg.effective_policy(seg.start), cfg.use_reentrant)
        if per is None:
            return None
        inner, inner_inputs = per
        total += inp + k * inner + (k - 1) * inner_inputs
    return total


def _region_bytes(layer: LayerBytes, policy, reentrant: bool):
    """(bytes kept per layer inside a region besides its input, bytes per inner layer input)."""
    inp = layer.tagged.get(_names.BLOCK_INPUT, 0)
    untagged = 0
    pol = _policies.resolve(policy)
    everything = pol is jax.checkpoint_policies.everything_saveable
    if pol is None or pol is jax.checkpoint_policies.nothing_saveable:  # reentrant, or nothing saved in a region
        saved = frozenset()
    elif everything:
        saved, untagged = frozenset(layer.tagged), layer.untagged
    else:
        rule = _policies.by_name(pol)
        if rule is None or rule.offload:
            return None  # not by name, or offloading: not modelled
        saved = frozenset(n for n in (*layer.tagged, *layer.swaps) if rule.saves(n))
    inner = sum(b for n, b in layer.tagged.items() if n in saved and n != _names.BLOCK_INPUT) + untagged
    inner += sum(b for n, b in layer.swaps.items() if n in saved) if not everything else 0
    inner += 0 if reentrant else layer.constants
    return inner, (inp if _names.BLOCK_INPUT in saved else 0)
