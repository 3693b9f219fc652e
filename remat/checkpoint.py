"""checkpoint(): rematerialize a function, like `torch.utils.checkpoint`, in two ways.

Non-reentrant (default) is `jax.checkpoint` with a policy: JAX traces the function once and keeps
whatever the policy saves. Reentrant is a `jax.custom_vjp` whose forward keeps only the inputs and
whose backward re-traces the function under `jax.vjp`, checked against the forward (remat.check).

# NOTE: inputs. Arguments are pytrees. Array leaves are traced; every other leaf (Python numbers,
# strings, None) and every argument listed in `static_argnums` is passed through as a constant,
# so callers never need `functools.partial`. In the reentrant path only inexact (floating) leaves
# are differentiated; integer and PRNG-key leaves get no cotangent.
#
# NOTE: scheduling. XLA sees no data dependency between a recomputation and the backward that
# consumes it, so its scheduler may run every recomputation during the forward pass. XLA:CPU's does
# on a loop of layers (plain `jax.checkpoint` keeps all of no-remat's temp there); XLA:GPU's and
# XLA:TPU's do not (tied and untied compile to the same temp: docs/targets.md). So built for the CPU
# each region's residuals are made to depend on the arrival of its output cotangent in the backward
# (`_tie`: `x + 0·s`, s a finite-guarded reduction of the cotangent, exact and NaN-safe) before the
# pullback runs (`_tied`, a custom_vjp around `jax.vjp` of `jax.checkpoint`, so the policy still
# decides what is saved; the reentrant path ties too); built for cuda or tpu the region is plain
# `jax.checkpoint` (`tie_needed`).
#
# NOTE: offload. A region that keeps residuals in host memory (`offload_inputs`, or a policy that
# offloads) is, built for an accelerator, fenced: its output waits for its copies to host memory
# (`_fence`) and its input cotangents leave its backward together (`_join`). Without both, XLA:GPU's
# latency-hiding scheduler starts each copy to host only just before the copy back, and fills the
# copies' latency with other regions' deferred weight gradients, so offloading raised the device
# temp above saving the same values on the device (docs/offload.md has the HLO and the figures).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np

import weakref

from jax.extend import core as _jcore
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir

from remat import _compat
from remat import check as _check
from remat import memory as _memory
from remat import policies as _policies
from remat.config import check_region


# determinism_check="values": max |forward - recompute| allowed per output leaf, relative to the
# leaf's max |forward|. Same-program float32 recomputation differs by at most a few ulps (XLA may
# fuse it differently); a wrong dropout mask or RNG key moves values by O(1).
VALUES_RTOL = 1e-5

# JAX's own checkpoint, bound once: a caller that replaces `jax.checkpoint` by this module's
# (as a drop-in test does) must not make the library call itself.
_JAX_CHECKPOINT = jax.checkpoint


class _Static:
    """A leaf passed through untraced (hashable by identity is enough: it is only closed over)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _is_traced(leaf) -> bool:
    """A leaf JAX traces: an array, a NumPy scalar or a Python number (as `jax.checkpoint` does)."""
    if isinstance(leaf, _Static):
        return False
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.core.Tracer)) or (
        type(leaf) in (bool, int, float, complex))


def _is_inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _on_device(x) -> bool:
    space = getattr(jax.typeof(x), "memory_space", None)
    return space is None or "host" not in str(space).lower()


def _cotangents(g):
    return [x for x in jax.tree.leaves(g) if _is_inexact(x) and jnp.size(x) > 0]


def _barrier(xs, gl):
    """`xs` through one optimization barrier with the cotangent leaves `gl`: available only once
    `gl` is. No arithmetic, and it passes host-memory arrays as they are."""
    return list(jax.lax.optimization_barrier((tuple(xs), tuple(gl)))[0])


def _fences(target: str | None = None) -> bool:
    """Whether offloading regions are fenced (`_fence`/`_join`) when built for `target` (default:
    the platform being built for): on the accelerators, where host memory is memory of its own."""
    return (target or _memory.target_platform()) in _memory.ACCELERATORS


def _fence(out, res):
    """`out` through one optimization barrier with the host-memory leaves of `res`: the region's
    output exists only once every copy to host memory is done. Returns (out, fenced?).

    # NOTE: why (docs/offload.md has the HLO). XLA:GPU turns each move to host memory into an
    # asynchronous copy-start/copy-done pair, and its latency-hiding scheduler starts the copy as
    # late as the copy's latency allows before its one use, the copy back in the backward. So in a
    # loop of layers the device buffer lives from the forward to the backward next to its host copy
    # (more device temp than saving the values on the device; docs/offload.md has the measurement).
    # The barrier gives the copy a consumer in the forward. The residuals stay the
    # barrier's inputs, not its outputs: inside `lax.scan` XLA's host offloader fails on a
    # host-memory barrier output that is stacked by the loop.
    """
    host = [x for x in jax.tree.leaves(res) if hasattr(x, "dtype") and not _on_device(x)]
    if not host:
        return out, False
    leaves, tree = jax.tree.flatten(out)
    idx = [i for i, x in enumerate(leaves) if hasattr(x, "dtype")]
    if not idx:
        return out, False
    got = jax.lax.optimization_barrier(([leaves[i] for i in idx], host))[0]
    for i, x in zip(idx, got):
        leaves[i] = x
    return jax.tree.unflatten(tree, leaves), True


def _join(mask, cts):
    """The region's input cotangents through one optimization barrier: the next region's backward
    (which needs the input cotangent) starts only once this region's weight gradients are done.

    # NOTE: why. The copies back from host memory are asynchronous too, and to hide their latency
    # XLA:GPU's scheduler fills the wait with whatever is ready: every earlier region's weight
    # gradients (their only consumer is the program's output, so nothing orders them). Deferred,
    # they keep their inputs (recomputed activations, attention gradients) live across regions: 3
    # regions' worth at the peak of a 4-layer GPT-2. With the barrier one region's backward is live.
    """
    idx = [i for i, (m, ct) in enumerate(zip(mask, cts)) if m and hasattr(ct, "dtype")]
    if not idx:
        return cts
    out = list(cts)
    for i, ct in zip(idx, jax.lax.optimization_barrier([cts[i] for i in idx])):
        out[i] = ct
    return tuple(out)


def _tie(dyn, g):
    """Make every inexact leaf of `dyn` depend on the cotangent `g`, exactly and NaN-safely.

    # NOTE: two forms, by the platform the program is built for (`remat.memory.target_platform`).
    # On accelerators (cuda, rocm, tpu) XLA keeps optimization barriers through scheduling, so one
    # barrier over the leaves and `g` orders them for free. XLA:CPU strips barriers before
    # scheduling, so there device leaves get `x + 0·s`, s a finite-guarded full reduction of one
    # cotangent leaf (indexing one element is ambiguous under explicit sharding): one pass over
    # `g` per region. Host-memory leaves (offloaded inputs) take the barrier on every platform:
    # arithmetic would pull them to the device, and the barrier is what makes the copy back
    # (`_load`) wait for `g`.
    """
    gl = _cotangents(g)
    idx = [i for i, x in enumerate(dyn) if _is_inexact(x)]
    if not gl or not idx:
        return dyn
    out = list(dyn)
    if _memory.target_platform() in _memory.ACCELERATORS:
        barred = idx
    else:
        barred = [i for i in idx if not _on_device(dyn[i])]
        s = jnp.sum(gl[0])
        zero = jnp.where(jnp.isfinite(s), s, jnp.zeros_like(s)) * 0
        for i in idx:
            if i not in barred:
                out[i] = _compat.weak_like(dyn[i] + zero.astype(dyn[i].dtype), dyn[i])
    if barred:
        for i, x in zip(barred, _barrier([dyn[i] for i in barred], gl)):
            out[i] = x
    return out


def _reentrant(flat_fn, dyn, *, name: str, determinism_check, storage=None, first=None):
    """The reentrant region. `first`: (ClosedJaxpr, output tree) of a trace of `flat_fn` made for
    this call, which the forward evaluates (so the Python function is traced once for the forward
    and once more, checked against it, in the backward)."""
    state: dict[str, Any] = {}
    run = None
    if first is not None:
        closed0, tree0 = first

        def run(*a):
            return jax.tree.unflatten(tree0, jax.core.eval_jaxpr(closed0.jaxpr, closed0.consts, *jax.tree.leaves(a)))

    @jax.custom_vjp
    def region(*dyn):
        return run(*dyn) if run is not None else flat_fn(*dyn)

    def fwd(*dyn):
        if determinism_check == "structure":  # fingerprint the very program that computes `out`
            if run is not None:
                closed, tree, state["run"] = closed0, tree0, run
            else:
                closed, tree, state["run"] = _check.trace(flat_fn, *dyn)
            state["jaxpr"] = _check.fingerprint(closed, tree)
            out = state["run"](*dyn)
        else:
            out = run(*dyn) if run is not None else flat_fn(*dyn)
        marks = ()
        if determinism_check:
            marks, state["specs"] = _check.fingerprint_outputs(out)
            state["tree"] = jax.tree.structure(out)
        saved = tuple(jax.tree.leaves(out)) if determinism_check == "values" else ()
        kept, state["restore"] = _store(dyn, dyn, storage or {})
        if _fences():
            out, state["fenced"] = _fence(out, kept)
        return out, (tuple(kept), marks, saved)

    def bwd(res, g):
        dyn, marks, saved = res
        dyn = _tie(_load(list(dyn), state["restore"], g), g)
        mask = [_is_inexact(x) for x in dyn]
        recompute = flat_fn
        if determinism_check == "structure":
            # A fresh trace must equal the forward's program; then the forward's own program (saved,
            # the one that ran) is what gets differentiated, so nothing unchecked slips in between.
            closed, tree, _ = _check.trace(flat_fn, *dyn)
            _check.compare_structure(name, state["jaxpr"], _check.fingerprint(closed, tree))
            recompute = state["run"]

        def f_diff(*diff):
            it = iter(diff)
            return recompute(*[next(it) if m else x for x, m in zip(dyn, mask)])

        def pullback(diff, g):
            out, vjp_fn = jax.vjp(f_diff, *diff)
            if determinism_check:
                _check.compare_outputs(name, state["tree"], marks, state["specs"], out)
            return out, vjp_fn(g)

        # Trace the recomputation + pullback, then keep only the equations the cotangents need
        # (early stop): the recomputed outputs serve only as avals for the check.
        diff = [x for x, m in zip(dyn, mask) if m]
        closed, (out_shape, _) = jax.make_jaxpr(pullback, return_shape=True)(diff, g)
        n_out = len(jax.tree.leaves(out_shape))
        keep_out = determinism_check == "values"
        jaxpr, _ = _compat.dce_jaxpr(closed.jaxpr, [keep_out] * n_out + [True] * (len(closed.out_avals) - n_out),
                                instantiate=True)
        flat = jax.core.eval_jaxpr(jaxpr, closed.consts, *jax.tree.leaves((diff, g)))
        if keep_out:
            _check.compare_values(name, saved, flat[:n_out], tolerance=VALUES_RTOL)
            flat = flat[n_out:]
        cts = iter(flat)
        cts = tuple(next(cts) if m else None for m in mask)
        return _join(mask, cts) if state.get("fenced") else cts

    region.defvjp(fwd, bwd)
    return region(*dyn)


def _storage(dyn, dyn_arg, shard_inputs, offload_inputs=()):
    """{dyn index: (move while saved, move back for the recomputation)} for `shard_inputs` arguments
    (a resharding) and `offload_inputs` arguments (to pinned host memory and back)."""
    out = {}
    for i, a in enumerate(dyn_arg):
        if shard_inputs and a in shard_inputs:
            saved, full = shard_inputs[a]
            out[i] = (functools.partial(_shard_store, spec=saved),
                      functools.partial(jax.lax.with_sharding_constraint, shardings=full))
        elif a in offload_inputs and _is_inexact(dyn[i]):
            out[i] = (functools.partial(jax.device_put, device=jax.memory.Space.Host),
                      functools.partial(jax.device_put, device=jax.memory.Space.Device))
    return out


def _shard_store(x, spec):
    """`x` resharded to `spec` (one axis sharded), made by a collective so that it is materialized.

    # NOTE: resharding a replicated input is a local slice, and XLA fuses that slice (and the
    # elementwise ops producing the input) into the backward's consumer, which then reads the full
    # input: it stays live from the forward to the backward and the compiled temp does not fall at
    # all (an optimization barrier does not survive XLA:CPU's pipeline). Going through the last
    # axis first (P(..., axis)) makes the second step an all-to-all, which XLA does not fuse: the
    # shard is a buffer of its own and the full input dies after the forward. The all-to-all moves
    # 1/n of the input per device, less than the all-gather the recomputation needs anyway.
    """
    specs = tuple(spec)
    dims = [d for d, a in enumerate(specs) if a not in (None, P.UNCONSTRAINED)]
    if len(dims) == 1 and dims[0] != x.ndim - 1 and len(specs) == x.ndim:
        first = list(specs)
        first[-1], first[dims[0]] = specs[dims[0]], (P.UNCONSTRAINED if specs[-1] == P.UNCONSTRAINED else None)
        try:
            x = jax.lax.with_sharding_constraint(x, P(*first))
        except ValueError:  # the last axis does not split evenly: a plain reshard
            pass
    return jax.lax.with_sharding_constraint(x, spec)


def _store(res, dyn, storage):
    """Keep residuals that are region inputs listed in `storage` as `storage` says (sharded, or in
    host memory).

    Returns the residuals and {residual index: function restoring it before the recomputation}.
    """
    out, restore = list(res), {}
    for i, (put, back) in storage.items():
        for j, r in enumerate(out):
            if r is dyn[i]:
                out[j], restore[j] = put(r), back
    return out, restore


def _load(res, restore, g):
    """Move stored residuals back for the recomputation, each only once the cotangent `g` exists:
    `_tie` first, so that the move's own input depends on `g`. Otherwise XLA may gather a sharded
    input, or copy an offloaded one back from host memory, right after the forward, and the
    saving is gone (tests/test_lowering.py checks every copy back on cuda and tpu)."""
    idx = sorted(restore)
    tied = _tie([res[j] for j in idx], g)
    out = list(res)
    for j, r in zip(idx, tied):
        out[j] = restore[j](r)
    return out


def _tied(flat_fn, dyn, *, policy, prevent_cse, storage=None):
    """`jax.checkpoint` whose backward waits for the output cotangent before recomputing.

    The forward runs `jax.vjp` of the checkpointed function and hands its residuals (what the
    policy saved, plus the region inputs) to a `custom_vjp`; the backward makes them depend on
    the cotangent (`_tie`) and only then calls the pullback, which recomputes the rest. Residuals in
    host memory fence the region on an accelerator (`_fence`, `_join`).
    """
    state: dict[str, Any] = {}
    ck = _JAX_CHECKPOINT(flat_fn, policy=policy, prevent_cse=prevent_cse)
    mask = [_is_inexact(x) for x in dyn]  # the backward closes over no traced input

    @jax.custom_vjp
    def region(*dyn):
        return flat_fn(*dyn)

    def fwd(*dyn):
        out, pullback = jax.vjp(ck, *dyn)
        leaves, state["tree"] = jax.tree.flatten(pullback)
        leaves, state["restore"] = _store(leaves, dyn, storage or {})
        if _fences():
            out, state["fenced"] = _fence(out, leaves)
        return out, tuple(leaves)

    def bwd(res, g):
        res = _load(list(res), state["restore"], g)
        pullback = jax.tree.unflatten(state["tree"], _tie(res, g))
        cts = tuple(ct if m else None for m, ct in zip(mask, pullback(g)))
        return _join(mask, cts) if state.get("fenced") else cts

    region.defvjp(fwd, bwd)
    return region(*dyn)


# --- the linear half of a staged region: forward-evaluable and transposed with the tie -----------
#
# NOTE: a region traced into a jaxpr (a jit, scan or loop body) cannot know yet whether it will be
# differentiated forward or backward. It is staged as a `custom_jvp` whose rule runs `jax.vjp` of
# the checkpointed function (the forward: what the policy saves) and expresses the tangent map as
# one linear primitive, `_lin_p`, whose operands are the residuals and the input tangents.
# Evaluated forward (`jax.jvp`, `jax.linearize` of a jitted function) it is the transpose of the
# pullback (`jax.linear_transpose`); transposed (`jax.grad`) it is the pullback with the residuals
# tied to the output cotangent, as `_tied` does. Batching maps both halves with `jax.vmap`. So a
# staged region keeps the tie in reverse mode and still supports every forward mode.


class _LinSpec:
    """The two halves of a region's tangent map (hashable by identity, as JAX params must be)."""
    __slots__ = ("fwd", "bwd", "out_avals", "n_res")

    def __init__(self, fwd, bwd, out_avals, n_res):
        self.fwd, self.bwd, self.out_avals, self.n_res = fwd, bwd, tuple(out_avals), n_res


_lin_p = _jcore.Primitive("remat_tied_linear")
_lin_p.multiple_results = True


def _lin_impl(*args, spec):
    return list(spec.fwd(list(args[:spec.n_res]), list(args[spec.n_res:])))


_lin_p.def_impl(_lin_impl)
_lin_p.def_abstract_eval(lambda *args, spec: list(spec.out_avals))
_mlir.register_lowering(_lin_p, _mlir.lower_fun(_lin_impl, multiple_results=True))


def _lin_transpose(cts, *args, spec):
    res, ts = args[:spec.n_res], args[spec.n_res:]
    cts = [_ad.instantiate_zeros(c) for c in cts]
    in_cts = spec.bwd(list(res), cts)
    return [None] * len(res) + [c if _ad.is_undefined_primal(t) else None for t, c in zip(ts, in_cts)]


_ad.primitive_transposes[_lin_p] = _lin_transpose


def _lin_jvp(primals, tangents, *, spec):
    tangents = [_ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(lambda *a: _lin_impl(*a, spec=spec), tuple(primals), tuple(tangents))


_ad.primitive_jvps[_lin_p] = _lin_jvp


def _lin_batch(args, dims, *, spec):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    res, ts = list(args[:spec.n_res]), list(args[spec.n_res:])
    res_axes = [d for d in dims[:spec.n_res]]
    ts = [jnp.broadcast_to(t, (size,) + jnp.shape(t)) if d is None else jnp.moveaxis(t, d, 0)
          for t, d in zip(ts, dims[spec.n_res:])]
    fwd = jax.vmap(spec.fwd, in_axes=(res_axes, 0))
    bwd = jax.vmap(spec.bwd, in_axes=(res_axes, 0))
    avals = [jax.ShapeDtypeStruct((size,) + a.shape, a.dtype) for a in spec.out_avals]
    out = _lin_p.bind(*res, *ts, spec=_LinSpec(fwd, bwd, [jax.core.ShapedArray(a.shape, a.dtype) for a in avals],
                                               spec.n_res))
    return out, [0] * len(out)


_batching.primitive_batchers[_lin_p] = _lin_batch


def _float0_zeros(x):
    return np.zeros(jnp.shape(x), dtype=jax.dtypes.float0)


def _tied_jvp(flat_fn, dyn, *, policy, prevent_cse):
    """A staged region: `jax.checkpoint` as a custom_jvp whose tangent map is `_lin_p` (see NOTE)."""
    ck = _JAX_CHECKPOINT(flat_fn, policy=policy, prevent_cse=prevent_cse)
    diff = [i for i, x in enumerate(dyn) if _is_inexact(x)]
    n_in = len(dyn)

    @jax.custom_jvp
    def region(*dyn):
        return ck(*dyn)

    @region.defjvp
    def region_jvp(primals, tangents):
        out, pullback = jax.vjp(ck, *primals)
        res, tree = jax.tree.flatten(pullback)
        odiff = [j for j, y in enumerate(out) if _is_inexact(y)]
        int_cts = {j: _float0_zeros(y) for j, y in enumerate(out) if j not in odiff}
        int_ts = {i: _float0_zeros(x) for i, x in enumerate(primals) if i not in diff}

        def pull(res, ct_diff):  # cotangents of the inexact outputs -> of the inexact inputs
            cts = dict(int_cts)
            cts.update(zip(odiff, ct_diff))
            full = jax.tree.unflatten(tree, res)([cts[j] for j in range(len(out))])
            return [full[i] for i in diff]

        out_avals = [jax.typeof(out[j]) for j in odiff]
        out_avals = [jax.core.ShapedArray(a.shape, a.dtype) for a in out_avals]

        def fwd(res, t_diff):
            shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
            return jax.linear_transpose(lambda ct: pull(res, ct), shapes)(list(t_diff))[0]

        def bwd(res, ct_diff):
            return pull(_tie(list(res), ct_diff), ct_diff)

        t_diff = [tangents[i] for i in diff]
        if odiff and diff:
            t_out = _lin_p.bind(*res, *t_diff, spec=_LinSpec(fwd, bwd, out_avals, len(res)))
        else:
            t_out = [jnp.zeros(a.shape, a.dtype) for a in out_avals]
        t_all = dict(int_cts)
        t_all.update(zip(odiff, t_out))
        del int_ts
        return out, [t_all[j] for j in range(len(out))]

    del n_in
    return region(*dyn)


# --- the public function ------------------------------------------------------------------------

_OPTIONS = ("prevent_cse", "policy", "static_argnums", "static_argnames", "use_reentrant", "determinism_check",
            "name", "tie_to_cotangent", "shard_inputs", "offload_inputs")


def checkpoint(fn: Callable | None = None, *args, prevent_cse: bool | Sequence[bool] | Any = True, policy=None,
               static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
               use_reentrant: bool = False, determinism_check: bool | str | None = None, name: str | None = None,
               tie_to_cotangent: bool | None = None, shard_inputs=None, offload_inputs: Sequence[int] = (),
               **unknown):
    """`fn` rematerialized: `jax.checkpoint`'s semantics and signature, plus the library's options.

    `remat.checkpoint(fn, **options)` returns the wrapped function (as `jax.checkpoint` /
    `jax.remat` do; `@remat.checkpoint` and `@functools.partial(remat.checkpoint, policy=...)`
    decorate). The options are keyword-only and never shared with `fn`'s own keyword arguments:
    call the result as `remat.checkpoint(fn, policy=...)(*args, **kwargs)`.
    `torch.utils.checkpoint`'s form runs at once: `remat.checkpoint(fn, *args, use_reentrant=..., **kwargs)`
    is `remat.checkpoint(fn, use_reentrant=...)(*args, **kwargs)` (there, a keyword named like an
    option is the option; use the first form for a function taking such a keyword).

    As in JAX: arguments are pytrees whose array leaves and Python scalars are traced (a Python
    `bool` is a tracer inside `fn`: use `static_argnums` for control flow), `static_argnums` /
    `static_argnames` are passed as they are (and must be hashable to be cached), the function is
    traced once per distinct call signature, and forward mode (`jax.jvp`, `jacfwd`,
    `jax.linearize`), reverse mode, `vmap`, `jit` and higher orders compose. Beyond JAX: leaves
    that are no JAX type (strings, functions, objects) are constants instead of an error, and a
    callable that is itself a pytree with array leaves (an Equinox or NNX module) is an input like
    the arguments.

    Args:
      fn: the function; called without it (`checkpoint(policy=...)`) returns a decorator.
      prevent_cse: as `jax.checkpoint`: a bool, or a pytree prefix of the arguments (`(args,)` /
        `(args, kwargs)`) of bools per argument.
      policy: a `remat.policies` name or a JAX policy callable (non-reentrant only); default saves
        nothing inside the region.
      static_argnums, static_argnames: as `jax.checkpoint`.
      use_reentrant: False (default) is `jax.checkpoint` with `policy`; True is a `jax.custom_vjp`
        that saves only the inputs and re-traces `fn` in the backward (reverse mode only: forward
        mode raises, naming `use_reentrant=False`).
      determinism_check: what to compare between the forward and the recomputation: None (default,
        the check that applies), False, or with `use_reentrant=True` True, `"structure"`, `"values"`
        (the rules: `remat.check`).
      name: region name used in error messages (default `fn.__name__`).
      tie_to_cotangent: (non-reentrant) make the recomputation wait for the region's output
        cotangent, so XLA cannot schedule it early and the compiled peak really falls (see the
        NOTE above). None (default): where the target's compiler needs it (`tie_needed`: XLA:CPU
        only; on cuda and tpu this is plain `jax.checkpoint`, except for an offloading policy,
        which is fenced as `offload_inputs` says); True/False force it (False: no fence). The tie
        applies only where there is a backward to order: forward mode is plain `jax.checkpoint`.
      shard_inputs: {argument index: (saved spec, recompute spec)}: keep those region inputs sharded
        as `saved` (e.g. along the sequence over an `fsdp` axis) between the forward and the
        backward, and reshard them to `recompute` spec (an all-gather) before recomputing, as
        Megatron's distribute_saved_activations does. Needs a mesh context (`jax.set_mesh`).
        Reverse mode only.
      offload_inputs: argument indices whose floating inputs are kept in pinned host memory between
        the forward and the backward and copied back before recomputing (DeepSpeed's
        cpu_checkpointing). On CPU, host and device memory are the same: it compiles and moves
        nothing. Built for a GPU or TPU an offloading region (this, or a policy that offloads) is
        fenced: its output waits for the copies to host memory, and its backward hands its input
        cotangents on only once its weight gradients are done (docs/offload.md). Reverse mode only.
    Returns:
      the wrapped function, or a decorator when `fn` is omitted.
    Example:
      >>> import jax, jax.numpy as jnp
      >>> block = lambda w, x: jnp.tanh(x @ w)
      >>> w, x = jnp.eye(4), jnp.ones((2, 4))
      >>> g = jax.grad(lambda w: checkpoint(block)(w, x).sum())(w)
      >>> g_reentrant = jax.grad(lambda w: checkpoint(block, use_reentrant=True)(w, x).sum())(w)
      >>> bool(jnp.allclose(g, g_reentrant))
      True
      >>> jax.jvp(checkpoint(jnp.sin), (1.0,), (1.0,))[1]   # forward mode, as jax.checkpoint
      Array(0.5403023, dtype=float32, weak_type=True)
    """
    if unknown and not args:
        raise TypeError(
            f"remat.checkpoint(fn, **options) returns the rematerialized function, as jax.checkpoint does; it was "
            f"given keyword argument(s) {sorted(unknown)}, which are not options. Call the result with them: "
            f"remat.checkpoint(fn, policy=...)(*args, **kwargs). Options: {', '.join(_OPTIONS)}")
    opts = dict(prevent_cse=prevent_cse, policy=policy, static_argnums=static_argnums,
                static_argnames=static_argnames, use_reentrant=use_reentrant, determinism_check=determinism_check,
                name=name, tie_to_cotangent=tie_to_cotangent, shard_inputs=shard_inputs,
                offload_inputs=tuple(offload_inputs))
    if fn is None:
        return functools.partial(checkpoint, **opts)
    if args:  # torch.utils.checkpoint's form: run now; keywords that are not options go to fn
        return checkpoint(fn, **opts)(*args, **unknown)
    if not callable(fn):
        raise TypeError(f"remat.checkpoint: expected a function, got {type(fn).__name__} {fn!r}")
    check_region(use_reentrant, policy, determinism_check)  # the rules RecomputeConfig also applies
    opts["static_argnums"] = _argnums(static_argnums)
    opts["static_argnames"] = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)

    @functools.wraps(fn)
    def wrapped(*a, **kw):
        return _run(fn, a, kw, **opts)

    return wrapped


def _argnums(static_argnums):
    if type(static_argnums) is int:
        return (static_argnums,)
    if isinstance(static_argnums, (tuple, list)) and all(type(d) is int for d in static_argnums):
        return tuple(static_argnums)
    raise TypeError(f"the `static_argnums` argument to `remat.checkpoint` must be an int or a tuple of ints, but got "
                    f"value {static_argnums}")


def _call(f, *args, **kwargs):
    return f(*args, **kwargs)


def tie_needed(platform: str | None = None) -> bool:
    """Whether the non-reentrant path ties recomputation to the cotangent when built for `platform`
    (default: the platform being built for, `remat.memory.target_platform()`): only on XLA:CPU.

    # NOTE: measured by compiling the same GPT-2 gradients both ways (docs/targets.md, "The
    # cotangent tie"): on XLA:CPU plain `jax.checkpoint` keeps ~all of no-remat's temp, tied it
    # falls to a fifth; on XLA:GPU (H200) and XLA:TPU (v5e) the two compile to the same temp bytes,
    # loop and scan, full, uniform and selective, so there the library is `jax.checkpoint` as JAX
    # gives it, forward-mode AD included.
    """
    return (platform or _memory.target_platform()) == "cpu"


def _policy_offloads(policy, flat_fn, dyn, prevent_cse) -> bool:
    """Whether `policy` keeps any of this region's residuals in host memory: from the policy where
    `remat.policies.offloads` knows it, else by tracing what `jax.vjp` of the region keeps."""
    known = _policies.offloads(policy)
    if known is not None:
        return known
    ck = _JAX_CHECKPOINT(flat_fn, policy=policy, prevent_cse=prevent_cse)
    try:
        closed = jax.make_jaxpr(lambda *d: jax.tree.leaves(jax.vjp(ck, *d)[1]))(*dyn)
    except Exception:  # noqa: BLE001 - a region that only traces in place (closed-over tracers): unknown
        return False
    return any("host" in str(getattr(a, "memory_space", "")).lower() for a in closed.out_avals)


def _has_arrays(tree) -> bool:
    return any(_is_traced(l) and not isinstance(l, (bool, int, float, complex)) for l in jax.tree.leaves(tree))


class _Hashably:
    """A constant as a cache key: by value when hashable, else by identity (as JAX's remat does)."""
    __slots__ = ("value", "hash", "hashable")

    def __init__(self, value):
        self.value = value
        try:
            self.hash, self.hashable = hash(value), True
        except TypeError:
            self.hash, self.hashable = id(value), False

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        if not isinstance(other, _Hashably):
            return False
        if self.hashable and other.hashable:
            try:
                return type(self.value) is type(other.value) and bool(self.value == other.value)
            except Exception:
                return self.value is other.value
        return self.value is other.value


class _Traced:
    """One trace of a region: its jaxpr, constants and output tree."""
    __slots__ = ("jaxpr", "consts", "out_tree", "hoist", "bodies", "__weakref__")

    def __init__(self, closed, out_tree):
        self.jaxpr, self.consts, self.out_tree = closed.jaxpr, list(closed.consts), out_tree
        self.hoist = [j for j, c in enumerate(self.consts) if isinstance(c, jax.core.Tracer)]
        self.bodies = {}

    def body(self, n_hoist, name):
        """The traced program as a function of (hoisted constants, inputs) -> flat outputs (one
        function object per trace, so JAX's own caches of `jax.checkpoint` hit too)."""
        if name in self.bodies:
            return self.bodies[name]
        jaxpr, consts, hoist = self.jaxpr, list(self.consts), self.hoist
        for j in hoist:
            consts[j] = None  # the body keeps no tracer: hoisted values arrive as inputs

        def body(*vals):
            cs = list(consts)
            for j, v in zip(hoist, vals[:n_hoist]):
                cs[j] = v
            return jax.core.eval_jaxpr(jaxpr, cs, *vals[n_hoist:])
        body.__name__ = body.__qualname__ = name
        if not hoist:
            self.bodies[name] = body
        return body


# {fn: {call signature: _Traced}}: one trace per distinct call signature, as jax.checkpoint keeps
# (dropped with the function; a trace that closed over a tracer is never kept).
_TRACES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _traced(fn, key, flat_fn, dyn) -> _Traced:
    """The trace of `flat_fn(*dyn)` for `fn` under the call signature `key` (None: not cached)."""
    try:
        per_fn = _TRACES.get(fn) if key is not None else None
    except TypeError:  # not weakly referenceable: trace every call
        per_fn = None
    if per_fn is not None and key in per_fn:
        return per_fn[key]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
    t = _Traced(closed, jax.tree.structure(out_shape))
    if not t.hoist and key is not None:
        try:
            _TRACES.setdefault(fn, {})[key] = t
        except TypeError:
            pass
    return t


def _cse_flags(prevent_cse, args, kwargs, static_leaf):
    """`prevent_cse` as one bool per traced leaf (JAX's rule: a pytree prefix of `args`, or of
    `(args, kwargs)` when there are keyword arguments), or the bool itself."""
    if isinstance(prevent_cse, bool):
        return prevent_cse
    cse_args = (tuple(args), kwargs) if kwargs else tuple(args)
    try:
        per = jax.tree.map(lambda p, sub: jax.tree.map(lambda _: bool(p), sub), prevent_cse, cse_args,
                           is_leaf=lambda x: isinstance(x, bool))
    except ValueError as e:
        raise ValueError(f"remat.checkpoint: prevent_cse must be a bool or a pytree prefix of the arguments "
                         f"{'(args, kwargs)' if kwargs else '(args,)'}, one bool per argument: {e}") from None
    flags = jax.tree.leaves(per)
    return tuple(f for f, s in zip(flags, static_leaf) if not s)


def _run(fn, args, kwargs, *, use_reentrant, policy, determinism_check, static_argnums, static_argnames, prevent_cse,
         name, tie_to_cotangent, shard_inputs, offload_inputs):
    region = name or getattr(fn, "__name__", None) or type(fn).__name__
    n = len(args)
    if not all(-n <= d < n for d in static_argnums):
        raise ValueError(f"the `static_argnums` argument to `remat.checkpoint` can only take integer values greater "
                         f"than or equal to `-len(args)` and less than `len(args)`, but got {static_argnums}, while "
                         f"`len(args)` = {n}")
    for what, idx in (("shard_inputs", list(shard_inputs or ())), ("offload_inputs", list(offload_inputs))):
        bad = [i for i in idx if not -n <= i < n]
        if bad:
            raise ValueError(f"{what} entry {bad[0]} is out of range for {n} argument(s)")
    static = {d % n for d in static_argnums}
    # NOTE: a pytree callable (Equinox/NNX module) carries its weights as leaves: it becomes argument
    # 0 of `_call`, so its weights are region inputs. Argument indices the caller gives
    # (static_argnums, shard_inputs, offload_inputs) keep counting `args` from 0 and are shifted here.
    owner, shift = fn, 0
    if not isinstance(fn, type) and _has_arrays(fn):
        args, fn, shift, owner = (fn,) + tuple(args), _call, 1, _call
    static = {i + shift for i in static}
    skw = {k: kwargs[k] for k in static_argnames if k in kwargs}
    dkw = {k: v for k, v in kwargs.items() if k not in skw}
    dargs = tuple(_Static(a) if i in static else a for i, a in enumerate(args))
    leaves, in_tree = jax.tree.flatten((dargs, dkw), is_leaf=lambda x: isinstance(x, _Static))
    is_static = [not _is_traced(l) for l in leaves]
    dyn = [l for l, s in zip(leaves, is_static) if not s]
    consts = [(l.value if isinstance(l, _Static) else l) if s else None for l, s in zip(leaves, is_static)]
    arg_of = [i for i, a in enumerate(dargs) for _ in jax.tree.leaves(a, is_leaf=lambda x: isinstance(x, _Static))]
    arg_of += [None] * (len(leaves) - len(arg_of))
    dyn_arg = [a for a, s in zip(arg_of, is_static) if not s]
    del leaves

    def rebuild(vals):
        it = iter(vals)
        full = [c if s else next(it) for c, s in zip(consts, is_static)]
        a, kw = jax.tree.unflatten(in_tree, full)
        return a, {**kw, **skw}

    def flat_fn(*vals):
        a, kw = rebuild(vals)
        return fn(*a, **kw)

    key = (in_tree, tuple(_Hashably(c) for c, s in zip(consts, is_static) if s),
           tuple(_Hashably(v) for v in skw.values()), tuple(skw), tuple(jax.typeof(x) for x in dyn),
           _compat.trace_context(), _memory.target_platform())
    try:
        hash(key)
    except TypeError:
        key = None
    if use_reentrant:
        key = None  # the reentrant path re-traces the Python function per call: no cached program
    traced = _traced(owner, key, flat_fn, dyn)
    # NOTE: closures. `fn` may close over a traced value (a weight of the outer jax.grad, the
    # PyTorch habit). Tracing it puts such values among the jaxpr's constants, which is how JAX
    # finds them too (`jax.closure_convert`); they are hoisted into region inputs, so no
    # custom_vjp/custom_jvp closes over a tracer.
    hoisted = [traced.consts[j] for j in traced.hoist]
    nh = len(hoisted)
    body = traced.body(nh, region)
    inputs = hoisted + dyn
    cse = _cse_flags(prevent_cse, args, dkw, is_static)
    if not isinstance(cse, bool):
        cse = (False,) * nh + cse

    shard = {i % n + shift: v for i, v in shard_inputs.items()} if shard_inputs else None
    storage = _storage(dyn, dyn_arg, shard, {i % n + shift for i in offload_inputs})
    storage = {i + nh: v for i, v in storage.items()}
    if storage and not use_reentrant and tie_to_cotangent is False:
        raise ValueError("shard_inputs and offload_inputs move the saved inputs inside the backward, which only the "
                         "tied or reentrant forms have: drop tie_to_cotangent=False (or pass use_reentrant=True)")
    _policies.warn_untagged(policy, body, inputs, region)  # as given: a registry name reads as that name
    policy = _policies.resolve(policy)
    mode = _compat.ad_mode()
    # an offloading policy on an accelerator takes the custom_vjp form too: it fences the region (_fence, _join)
    fenced = (not use_reentrant and tie_to_cotangent is None and mode not in ("eager", "forward") and _fences()
              and _policy_offloads(policy, body, inputs, cse))

    if use_reentrant:
        if mode == "forward":
            raise TypeError(f"remat.checkpoint(use_reentrant=True) (region {region!r}) is a custom_vjp, which "
                            f"forward-mode AD (jax.jvp, jax.jacfwd, jax.linearize) cannot differentiate: use "
                            f"use_reentrant=False (the default) for forward mode")
        check = True if determinism_check is None else determinism_check  # the check that applies
        # The reentrant backward re-traces the Python function itself (that is what its check
        # compares), unless hoisted closure values force the traced program.
        if nh:
            out = _reentrant(body, inputs, name=region, determinism_check=check, storage=storage)
            return jax.tree.unflatten(traced.out_tree, out)
        first = (_jcore.ClosedJaxpr(traced.jaxpr, traced.consts), traced.out_tree)
        return _reentrant(flat_fn, dyn, name=region, determinism_check=check, storage=storage, first=first)
    tie = tie_needed() if tie_to_cotangent is None else bool(tie_to_cotangent)
    if storage or fenced:
        flat = _tied(body, inputs, policy=policy, prevent_cse=cse, storage=storage)
    elif not tie or mode in ("eager", "forward"):
        flat = _JAX_CHECKPOINT(body, policy=policy, prevent_cse=cse)(*inputs)
    elif mode == "reverse":
        flat = _tied(body, inputs, policy=policy, prevent_cse=cse)
    else:
        flat = _tied_jvp(body, inputs, policy=policy, prevent_cse=cse)
    return jax.tree.unflatten(traced.out_tree, flat)
