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
# NOTE: offload. A region that keeps residuals in host memory (`offload_saved`, or a policy that
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

from remat import _compat
from remat import check as _check
from remat import memory as _memory
from remat import policies as _policies
from remat.config import check_region


# determinism_check="values": max |forward - recompute| allowed per output leaf, relative to the
# leaf's max |forward|. Same-program float32 recomputation differs by at most a few ulps (XLA may
# fuse it differently); a wrong dropout mask or RNG key moves values by O(1).
VALUES_RTOL = 1e-5


class _Static:
    """A leaf passed through untraced (hashable by identity is enough: it is only closed over)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _is_traced(leaf) -> bool:
    return not isinstance(leaf, _Static) and isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _is_inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _flatten(args: tuple, static_argnums: Sequence[int]):
    """Split `args` into traced leaves and a function rebuilding the args from them."""
    n = len(args)
    static = set()
    for i in static_argnums:
        if not -n <= i < n:
            raise ValueError(f"static_argnums entry {i} is out of range for {n} argument(s)")
        static.add(i % n)
    marked = tuple(_Static(a) if i in static else a for i, a in enumerate(args))
    leaves, tree = jax.tree.flatten(marked, is_leaf=lambda x: isinstance(x, _Static) or x is None)
    traced = [_is_traced(l) for l in leaves]
    dyn = [l for l, t in zip(leaves, traced) if t]
    owner = [i for i, a in enumerate(marked)
             for _ in jax.tree.leaves(a, is_leaf=lambda x: isinstance(x, _Static) or x is None)]
    dyn_arg = [o for o, t in zip(owner, traced) if t]

    def rebuild(dyn_vals):
        it = iter(dyn_vals)
        full = [next(it) if t else (l.value if isinstance(l, _Static) else l) for l, t in zip(leaves, traced)]
        return jax.tree.unflatten(tree, full)

    return dyn, rebuild, dyn_arg


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
    # (GPT-2 d12: 1.9 GiB device temp for `offload_names:qkv,mlp_up`, more than saving the values on
    # the device). The barrier gives the copy a consumer in the forward. The residuals stay the
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


def _join(dyn, cts):
    """The region's input cotangents through one optimization barrier: the next region's backward
    (which needs the input cotangent) starts only once this region's weight gradients are done.

    # NOTE: why. The copies back from host memory are asynchronous too, and to hide their latency
    # XLA:GPU's scheduler fills the wait with whatever is ready: every earlier region's weight
    # gradients (their only consumer is the program's output, so nothing orders them). Deferred,
    # they keep their inputs (recomputed activations, attention gradients) live across regions: 3
    # regions' worth at the peak of a 4-layer GPT-2. With the barrier one region's backward is live.
    """
    idx = [i for i, (x, ct) in enumerate(zip(dyn, cts)) if _is_inexact(x) and hasattr(ct, "dtype")]
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
                out[i] = dyn[i] + zero.astype(dyn[i].dtype)
    if barred:
        for i, x in zip(barred, _barrier([dyn[i] for i in barred], gl)):
            out[i] = x
    return out


def _reentrant(flat_fn, dyn, *, name: str, determinism_check, storage=None):
    state: dict[str, Any] = {}

    @jax.custom_vjp
    def region(*dyn):
        return flat_fn(*dyn)

    def fwd(*dyn):
        if determinism_check == "structure":  # fingerprint the very program that computes `out`
            closed, tree, state["run"] = _check.trace(flat_fn, *dyn)
            state["jaxpr"] = _check.fingerprint(closed, tree)
            out = state["run"](*dyn)
        else:
            out = flat_fn(*dyn)
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
        return _join(dyn, cts) if state.get("fenced") else cts

    region.defvjp(fwd, bwd)
    return region(*dyn)


def _storage(dyn, dyn_arg, shard_saved, offload_saved=()):
    """{dyn index: (move while saved, move back for the recomputation)} for `shard_saved` arguments
    (a resharding) and `offload_saved` arguments (to pinned host memory and back)."""
    out = {}
    for i, a in enumerate(dyn_arg):
        if shard_saved and a in shard_saved:
            saved, full = shard_saved[a]
            out[i] = (functools.partial(_shard_store, spec=saved),
                      functools.partial(jax.lax.with_sharding_constraint, shardings=full))
        elif a in offload_saved and _is_inexact(dyn[i]):
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
    ck = jax.checkpoint(flat_fn, policy=policy, prevent_cse=prevent_cse)

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
        cts = tuple(None if not _is_inexact(x) else ct for x, ct in zip(dyn, pullback(g)))
        return _join(dyn, cts) if state.get("fenced") else cts

    region.defvjp(fwd, bwd)
    return region(*dyn)


def checkpoint(fn: Callable | None = None, *args, use_reentrant: bool = False, policy=None,
               determinism_check: bool | str | None = None, static_argnums: Sequence[int] = (),
               prevent_cse: bool = True, name: str | None = None, tie_to_cotangent: bool | None = None,
               shard_saved=None, offload_saved: Sequence[int] = (), **kwargs):
    """Run `fn(*args, **kwargs)` keeping less for the backward pass and recomputing the rest.

    Args:
      fn: the function; its arguments and outputs may be pytrees. A callable that is itself a
        pytree with array leaves (an Equinox module, an NNX module) is an input like the
        arguments, and a function closing over traced values (weights of an outer `jax.grad`) has
        them hoisted into inputs (`jax.closure_convert`), so both differentiate as in plain JAX.
      *args: arguments. Non-array leaves and `static_argnums` arguments are constants.
      **kwargs: keyword arguments for `fn` (array leaves traced, the rest constants, e.g. `train=False`).
      use_reentrant: False (default) uses `jax.checkpoint` with `policy`; True uses a
        `jax.custom_vjp` that saves only the inputs and re-traces `fn` in the backward.
      policy: a `remat.policies` name or a JAX policy callable (non-reentrant only); default saves
        nothing inside the region.
      determinism_check: what to compare between the forward and the recomputation. None
        (default): the check that applies: with `use_reentrant=True` the recomputation's output
        shapes, dtypes and shardings against the forward's at trace time; on `jax.checkpoint` none
        (it traces once and recomputes that program: nothing can differ). False: no check. With
        `use_reentrant=True` only (elsewhere refused): True (the shape/dtype/sharding check),
        `"structure"` (also the traced programs: operations and their parameters, wiring, shapes,
        dtypes, literal values and closed-over constant values, `remat.check.fingerprint`; the
        backward differentiates the forward's own program) or `"values"` (debugging, costs memory:
        also keeps the forward's outputs and compares the recomputed values at run time, raising
        CheckpointError above VALUES_RTOL).
      static_argnums: positions of arguments passed through untraced.
      prevent_cse: passed to `jax.checkpoint`.
      name: region name used in error messages (default `fn.__name__`).
      tie_to_cotangent: (non-reentrant) make the recomputation wait for the region's output
        cotangent, so XLA cannot schedule it early and the compiled peak really falls (see the
        NOTE above). None (default): where the target's compiler needs it (`tie_needed`: XLA:CPU
        only; on cuda and tpu this is plain `jax.checkpoint`, except for an offloading policy,
        which is fenced as `offload_saved` says); True/False force it (False: no fence). Under the tie
        `jax.jvp`/`jacfwd` called on this function still work (the region sees forward mode and
        runs untied), but `jax.linearize`, or `jax.jvp` of an already jitted function, on CPU meet
        JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp function": pass
        tie_to_cotangent=False there.
      shard_saved: {argument index: (saved spec, recompute spec)}: keep those region inputs sharded
        as `saved` (e.g. along the sequence over an `fsdp` axis) between the forward and the
        backward, and reshard them to `recompute` spec (an all-gather) before recomputing, as
        Megatron's distribute_saved_activations does. Needs a mesh context (`jax.set_mesh`).
      offload_saved: argument indices whose floating inputs are kept in pinned host memory between
        the forward and the backward and copied back before recomputing (DeepSpeed's
        cpu_checkpointing). On CPU, host and device memory are the same: it compiles and moves nothing.
        Built for a GPU or TPU an offloading region (this, or a policy that offloads) is fenced:
        its output waits for the copies to host memory, and its backward hands its input
        cotangents on only once its weight gradients are done (docs/offload.md).
    Returns:
      `fn(*args)`; or, called without args (`checkpoint(use_reentrant=True)(fn)` or `@checkpoint`),
      a wrapped function.
    Example:
      >>> import jax, jax.numpy as jnp
      >>> block = lambda w, x: jnp.tanh(x @ w)
      >>> w, x = jnp.eye(4), jnp.ones((2, 4))
      >>> g = jax.grad(lambda w: checkpoint(block, w, x).sum())(w)
      >>> g_reentrant = jax.grad(lambda w: checkpoint(block, w, x, use_reentrant=True).sum())(w)
      >>> bool(jnp.allclose(g, g_reentrant))
      True
    """
    opts = dict(use_reentrant=use_reentrant, policy=policy, determinism_check=determinism_check,
                static_argnums=tuple(static_argnums), prevent_cse=prevent_cse, name=name,
                tie_to_cotangent=tie_to_cotangent, shard_saved=shard_saved, offload_saved=tuple(offload_saved))
    if fn is None:
        return lambda f: checkpoint(f, **opts)
    if not args and not kwargs:
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            return _run(fn, a, kw, **opts)
        return wrapped
    return _run(fn, args, kwargs, **opts)


def _call(f, *args, **kwargs):
    return f(*args, **kwargs)


def _closes_over_tracers(fn, depth: int = 3) -> bool:
    """True when `fn` (a function, a functools.partial, a bound method) reaches a JAX tracer
    through its closure cells, partial arguments, defaults or `__self__` (a few levels deep)."""
    if depth < 0:
        return False
    seen = []
    if isinstance(fn, functools.partial):
        seen += [fn.func, fn.args, fn.keywords]
    seen += [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _cell_set(c)]
    seen += [getattr(fn, "__self__", None), getattr(fn, "__defaults__", None)]
    for v in seen:
        if v is None:
            continue
        if any(isinstance(l, jax.core.Tracer) for l in jax.tree.leaves(v)):
            return True
        if callable(v) and not isinstance(v, type) and _closes_over_tracers(v, depth - 1):
            return True
    return False


def _cell_set(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


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
    ck = jax.checkpoint(flat_fn, policy=policy, prevent_cse=prevent_cse)
    try:
        closed = jax.make_jaxpr(lambda *d: jax.tree.leaves(jax.vjp(ck, *d)[1]))(*dyn)
    except Exception:  # noqa: BLE001 - a region that only traces in place (closed-over tracers): unknown
        return False
    return any("host" in str(getattr(a, "memory_space", "")).lower() for a in closed.out_avals)


def _has_arrays(tree) -> bool:
    return any(_is_traced(l) or isinstance(l, jax.core.Tracer) for l in jax.tree.leaves(tree))


def _run(fn, args, kwargs, *, use_reentrant, policy, determinism_check, static_argnums, prevent_cse, name,
         tie_to_cotangent, shard_saved, offload_saved):
    check_region(use_reentrant, policy, determinism_check)  # the rules RecomputeConfig also applies
    region = name or getattr(fn, "__name__", None) or type(fn).__name__
    n = len(args)
    # NOTE: a pytree callable (Equinox/NNX module) carries its weights as leaves: it becomes argument
    # 0 of `_call`, so its weights are region inputs. Keyword arguments ride as one last dict
    # argument. Argument indices the caller gives (static_argnums, shard_saved, offload_saved) keep
    # counting `args` from 0 and are shifted here.
    shift, target = 0, fn
    if not isinstance(fn, type) and _has_arrays(fn):
        args, fn, shift = (fn,) + tuple(args), _call, 1
    if kwargs:
        target = fn
        fn = lambda *a: target(*a[:-1], **a[-1])  # noqa: E731
        args = tuple(args) + (dict(kwargs),)
    for i in static_argnums:
        if not -n <= i < n:
            raise ValueError(f"static_argnums entry {i} is out of range for {n} argument(s)")
    static_argnums = [i % n + shift for i in static_argnums]
    if shard_saved:
        shard_saved = {i % n + shift: v for i, v in shard_saved.items()}
    dyn, rebuild, dyn_arg = _flatten(tuple(args), static_argnums)
    bad = [i for i in offload_saved if not -n <= i < n]
    if bad:
        raise ValueError(f"offload_saved entry {bad[0]} is out of range for {n} argument(s)")
    storage = _storage(dyn, dyn_arg, shard_saved, {i % n + shift for i in offload_saved})
    if storage and not use_reentrant and tie_to_cotangent is False:
        raise ValueError("shard_saved and offload_saved move the saved inputs inside the backward, which only the "
                         "tied or reentrant forms have: drop tie_to_cotangent=False (or pass use_reentrant=True)")

    def flat_fn(*dyn_vals):
        return fn(*rebuild(dyn_vals))

    _policies.warn_untagged(policy, flat_fn, dyn, region)  # as given: a registry name reads as that name
    policy = _policies.resolve(policy)
    # an offloading policy on an accelerator takes the custom_vjp form too: it fences the region (_fence, _join)
    fenced = (not use_reentrant and tie_to_cotangent is None and _fences()
              and _policy_offloads(policy, flat_fn, dyn, prevent_cse))
    tied = bool(storage) or fenced or (tie_needed() if tie_to_cotangent is None else tie_to_cotangent)
    if tied and tie_to_cotangent is None and not storage and _compat.forward_mode(dyn):
        tied = False  # forward mode (jax.jvp, jacfwd) has no backward to order: JAX's checkpoint as it is

    def go(flat_fn, dyn):
        if use_reentrant:
            check = True if determinism_check is None else determinism_check  # the check that applies
            return _reentrant(flat_fn, dyn, name=region, determinism_check=check, storage=storage)
        if tied:
            return _tied(flat_fn, dyn, policy=policy, prevent_cse=prevent_cse, storage=storage)
        return jax.checkpoint(flat_fn, policy=policy, prevent_cse=prevent_cse)(*dyn)

    # NOTE: closures. `fn` may close over a traced value (a weight of the outer jax.grad, the
    # PyTorch habit), which a custom_vjp may not capture. Such values are hoisted into region inputs
    # as JAX's own `closure_convert` does for custom_vjp users: up front when a tracer is found in
    # the closure, else on the UnexpectedTracerError of an eager call (a tracer reached another way).
    hoist = lambda: jax.closure_convert(flat_fn, *dyn)  # noqa: E731
    if (use_reentrant or tied) and _closes_over_tracers(target if kwargs else fn):
        conv, hoisted = hoist()
        return go(conv, list(dyn) + list(hoisted))
    try:
        return go(flat_fn, dyn)
    except jax.errors.UnexpectedTracerError:
        conv, hoisted = hoist()
        return go(conv, list(dyn) + list(hoisted))
