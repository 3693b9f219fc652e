"""The planner's time model: a roofline per operation of a layer's traced forward, on a target.

A layer's forward is read from the jaxpr of the train step (the first rematerialized region that
carries `checkpoint_name` tags, `layer_region`); `profile` splits its operations by tag (each
tag's share: the operations that produce that tagged value from the layer's inputs and the other
tags) and prices every operation on the target: `max(FLOPs / peak FLOP/s of its dtype,
bytes / memory bandwidth)` for a matrix product, `bytes / memory bandwidth` for anything else.
docs/planner.md states the model and its assumptions.

Example:
    >>> import jax, jax.numpy as jnp, remat
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> f = lambda w, x: checkpoint_name(jnp.tanh(x @ w), "mlp_up")
    >>> jp = jax.make_jaxpr(f)(jnp.ones((64, 64)), jnp.ones((8, 64)))
    >>> p = profile(jp, Roofline(1e12, {"float32": 1e12}))
    >>> sorted(p.tags), p.tags["mlp_up"].bytes
    (['mlp_up'], 2048)
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Mapping

import numpy as np

from remat.compiled import attention_flops, compiled_stats

__all__ = ["REMAT_PRIMITIVES", "LayerProfile", "Roofline", "TagCost", "eqn_seconds", "jaxpr_seconds",
           "layer_region", "measure_host", "of_target", "profile", "program_seconds"]

REMAT_PRIMITIVES = ("remat2", "checkpoint", "remat")


@dataclasses.dataclass(frozen=True)
class Roofline:
    """What the time model needs of a device: HBM bandwidth (bytes/s) and dense matrix FLOP/s per
    dtype name; `host_link` (bytes/s, one direction) for offloads, None when not known."""
    memory_bandwidth: float
    peak_flops: Mapping[str, float] = dataclasses.field(hash=False)
    host_link: float | None = None
    source: str = ""

    def __post_init__(self):
        if not self.memory_bandwidth > 0 or not self.peak_flops:
            raise ValueError("Roofline needs a positive memory_bandwidth and peak_flops per dtype; for the host CPU "
                             "use remat.planning.cost.measure_host()")

    def flops_rate(self, dtype) -> float:
        try:
            name = np.dtype(dtype).name
        except TypeError:   # an HLO type name with no NumPy dtype (s8, f8e4m3fn, ...)
            name = str(dtype)
        return self.peak_flops.get(name) or self.peak_flops.get("float32") or max(self.peak_flops.values())


def of_target(target) -> Roofline:
    """The roofline of a `remat.planning.targets.Target` (its Spec's figures); the host CPU's is measured."""
    spec = target.spec
    if spec.platform == "cpu" or not spec.memory_bandwidth:
        return measure_host()
    return Roofline(spec.memory_bandwidth, dict(spec.peak_flops), spec.host_link, f"remat.planning.targets {spec.kind}")


_HOST: list = []


def measure_host(n: int = 512) -> Roofline:
    """This host's roofline, measured once per process: float32 matmul FLOP/s (an n×n product) and
    copy bandwidth (a 64 MiB array), each the best of 5 runs. No host link: on the host, offloading
    moves nothing off the device."""
    if _HOST:
        return _HOST[0]
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    big = jax.device_put(jnp.ones((16 * 2 ** 20,), jnp.float32), cpu)
    mm = jax.jit(lambda a: a @ a)
    cp = jax.jit(lambda x: x * 1.0001)

    def best(fn, x):
        jax.block_until_ready(fn(x))
        t = []
        for _ in range(5):
            s = time.perf_counter()
            jax.block_until_ready(fn(x))
            t.append(time.perf_counter() - s)
        return min(t)

    flops = 2 * n ** 3 / best(mm, a)
    bw = 2 * big.nbytes / best(cp, big)
    _HOST.append(Roofline(bw, {"float32": flops, "bfloat16": flops, "float16": flops}, None,
                          "measured on this host (remat.planning.cost.measure_host)"))
    return _HOST[0]


def program_seconds(compiled, roof: Roofline) -> float:
    """The roofline time of a compiled program from the compiler's own optimized program: every
    kernel (`remat.compiled.hlo_kernels`: fusions, GEMMs, copies; every loop iteration counted)
    takes `max(FLOPs / peak FLOP/s of its dtype, bytes / memory bandwidth)`, and the kernels add up.

    Args:
      compiled: a `remat.memory.CompiledMemory` (from `compiled_stats`) or a `jax.stages.Compiled`.
      roof: the target's `Roofline`.
    Example:
      >>> import jax.numpy as jnp
      >>> c = jax.jit(lambda a: a @ a).lower(jnp.ones((64, 64))).compile()
      >>> program_seconds(c, Roofline(1e9, {"float32": 1e9})) > 0
      True
    """
    cm = compiled_stats(compiled)
    if not cm.kernels:
        raise ValueError("program_seconds needs the optimized program (compiled_stats of a jax.stages.Compiled)")
    return float(sum(n * max(f / roof.flops_rate(d or "float32"), b / roof.memory_bandwidth)
                     for f, b, n, d in cm.kernels))


def _nbytes(aval) -> int:
    try:
        return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
    except (AttributeError, TypeError):
        return 0


def _subjaxprs(eqn):
    out = []
    for v in eqn.params.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
            jp = getattr(j, "jaxpr", j)
            if hasattr(jp, "eqns"):
                out.append(jp)
    return out


# operations that move no data of their own (views, or folded into their consumer by XLA)
_FREE = frozenset({"name", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "device_put",
                   "sharding_constraint", "optimization_barrier", "copy", "copy_p", "iota"})


def _heavy(eqn) -> bool:
    return eqn.primitive.name == "dot_general" or "attention" in eqn.primitive.name or bool(_subjaxprs(eqn))


def eqn_seconds(eqn, roof: Roofline) -> float:
    """The roofline time of one matrix product, attention call or nested program (a scan's body times
    its length); 0 for an elementwise operation (`jaxpr_seconds` prices those as fused kernels)."""
    name = eqn.primitive.name
    moved = sum(_nbytes(v.aval) for v in eqn.invars) + sum(_nbytes(v.aval) for v in eqn.outvars)
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        flops = 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs.shape[d] for d in lc)
        return max(flops / roof.flops_rate(lhs.dtype), moved / roof.memory_bandwidth)
    att = attention_flops(eqn)
    if att is not None:
        return max(att / roof.flops_rate(eqn.invars[0].aval.dtype), moved / roof.memory_bandwidth)
    subs = _subjaxprs(eqn)
    if subs:
        if name == "cond":
            return max(jaxpr_seconds(s, roof) for s in subs)
        if name in ("custom_vjp_call", "custom_jvp_call"):
            subs = subs[:1]   # the primal program (the others are its rules)
        t = sum(jaxpr_seconds(s, roof) for s in subs)
        return t * eqn.params.get("length", 1) if name == "scan" else t
    return 0.0


def _fused_seconds(jaxpr, idx, roof: Roofline) -> float:
    """The memory time of the elementwise operations `idx` of `jaxpr`, as XLA fuses them.

    Args:
        jaxpr: the program.
        idx: indices of its elementwise equations.
        roof: the target's `Roofline`.
    """
    eqns = jaxpr.eqns
    heavy_out = set(jaxpr.invars)
    boundary = {v for v in jaxpr.outvars if not hasattr(v, "val")}
    for e in eqns:
        if _heavy(e):
            heavy_out.update(e.outvars)
            boundary.update(v for v in e.invars if not hasattr(v, "val"))
        elif e.primitive.name == "name":
            boundary.update(v for v in e.invars if not hasattr(v, "val"))
    for e in reversed(eqns):   # a view of a value that leaves the fusion leaves it too
        if e.primitive.name in _FREE and any(v in boundary for v in e.outvars):
            boundary.update(v for v in e.invars if not hasattr(v, "val"))
        if e.primitive.name in _FREE and all(v in heavy_out for v in e.invars if not hasattr(v, "val")):
            heavy_out.update(e.outvars)
    boundary.discard(None)
    total, read = 0, set()
    for i in idx:
        e = eqns[i]
        if _heavy(e) or e.primitive.name in _FREE:
            continue
        total += sum(2 * _nbytes(v.aval) for v in e.outvars if v in boundary)
        for v in e.invars:
            if not hasattr(v, "val") and v in heavy_out and v not in read:
                read.add(v)
                total += _nbytes(v.aval)
    return total / roof.memory_bandwidth


def jaxpr_seconds(jaxpr, roof: Roofline) -> float:
    """The roofline time of a (closed) jaxpr: its matrix products, attention calls and nested
    programs, and its elementwise operations as fused kernels."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return float(sum(eqn_seconds(e, roof) for e in jaxpr.eqns)) + _fused_seconds(jaxpr, range(len(jaxpr.eqns)), roof)


def layer_region(jaxpr):
    """The program of one layer's rematerialized forward: of the remat regions (depth first, scans
    and calls included) whose program carries `checkpoint_name` tags, the first of those with the
    most distinct tags (a layer's, not a loss head's region with its one tag); None when none."""
    found = []

    def walk(jp):
        for eqn in getattr(jp, "jaxpr", jp).eqns:
            subs = _subjaxprs(eqn)
            if eqn.primitive.name in REMAT_PRIMITIVES and subs and _has_names(subs[0]):
                found.append(subs[0])
                continue
            for sub in subs:
                walk(sub)

    walk(jaxpr)
    return max(found, key=lambda r: len(_names_in(r)), default=None)


def _names_in(jaxpr) -> set:
    out = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            out.add(eqn.params["name"])
        for sub in _subjaxprs(eqn):
            out |= _names_in(sub)
    return out


def _has_names(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" or any(_has_names(s) for s in _subjaxprs(eqn)):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class TagCost:
    """One tag of a layer: `bytes` its values hold (per device), `recompute_s` the roofline time of
    the operations that produce them from the layer's inputs and the other tagged values."""
    bytes: int
    recompute_s: float
    count: int = 1


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """A layer's tags (in program order), the time of its untagged operations and of its forward."""
    tags: Mapping[str, TagCost]
    untagged_s: float
    forward_s: float

    @property
    def order(self) -> tuple:
        return tuple(self.tags)


def profile(region, roof: Roofline, divisor: int = 1) -> LayerProfile:
    """Split a layer's forward program by tag and price each tag's share and the untagged work.

    Args:
        region: the layer's forward (a jaxpr or closed jaxpr, e.g. from `layer_region`).
        roof: the target's `Roofline`.
        divisor: devices sharing the work, so bytes and times are per device.

    Example: see the module docstring.
    """
    jaxpr = getattr(region, "jaxpr", region)
    eqns = jaxpr.eqns
    producer = {}
    for i, e in enumerate(eqns):
        for v in e.outvars:
            producer[v] = i
    tagged = {e.outvars[0] for e in eqns if e.primitive.name == "name"}
    claimed: set = set()
    order: dict = {}
    cost = lambda ids: (sum(eqn_seconds(eqns[j], roof) for j in ids) + _fused_seconds(jaxpr, ids, roof)) / divisor
    for i, e in enumerate(eqns):
        if e.primitive.name != "name":
            continue
        tag = e.params["name"]
        share, stack = set(), list(e.invars)
        while stack:
            v = stack.pop()
            j = None if hasattr(v, "val") else producer.get(v)
            if j is None or j in claimed or j in share or v in tagged:
                continue
            share.add(j)
            stack.extend(eqns[j].invars)
        claimed |= share
        t = cost(sorted(share))
        b = _nbytes(e.outvars[0].aval) // divisor
        prev = order.get(tag)
        order[tag] = TagCost(b, t) if prev is None else TagCost(prev.bytes + b, prev.recompute_s + t, prev.count + 1)
    light = [j for j in sorted(claimed) if not _heavy(eqns[j])]
    return LayerProfile(order, _fused_seconds(jaxpr, light, roof) / divisor, cost(sorted(claimed)))
