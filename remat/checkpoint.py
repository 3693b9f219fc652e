"""checkpoint(): `jax.checkpoint` with the library's policy names, plus what it lacks.

The default path is `jax.checkpoint(fn, prevent_cse=..., policy=<resolved>, static_argnums=...)`
as JAX gives it. Added around it, without changing its semantics: registry policy names
(`remat.policies`), `static_argnames`, a warning for a name-based policy on a region that tags none
of its names, `torch.utils.checkpoint`'s immediate form, the reentrant path (a `jax.custom_vjp`
that saves only the inputs and re-traces in the backward, with `determinism_check`), and region
inputs kept sharded or in host memory between the forward and the backward. docs/architecture.md
says why each exists.

Example:
    >>> import jax, jax.numpy as jnp
    >>> layer = checkpoint(lambda w, x: jnp.tanh(x @ w), policy="dots")
    >>> jax.grad(lambda w: layer(w, jnp.ones((2, 4))).sum())(jnp.eye(4)).shape
    (4, 4)
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from remat import _compat
from remat import check as _check
from remat import memory as _memory
from remat import policies as _policies
from remat.config import check_region

__all__ = ["VALUES_RTOL", "checkpoint"]

# determinism_check="values": max |forward - recompute| allowed per output leaf, relative to the
# leaf's max |forward|. Same-program float32 recomputation differs by at most a few ulps (XLA may
# fuse it differently); a wrong dropout mask or RNG key moves values by O(1).
VALUES_RTOL = 1e-5

# JAX's own checkpoint, bound once: a caller that replaces `jax.checkpoint` by this module's
# (as a conformance test does) must not make the library call itself.
_JAX_CHECKPOINT = jax.checkpoint

_OPTIONS = ("prevent_cse", "policy", "static_argnums", "static_argnames", "use_reentrant", "determinism_check",
            "name", "shard_inputs", "offload_inputs")
_DEFAULTS = dict(prevent_cse=True, policy=None, static_argnums=(), static_argnames=(), use_reentrant=False,
                 determinism_check=None, name=None, shard_inputs=None, offload_inputs=())


def _names_parameter(fn, name: str) -> bool:
    """Whether `fn` has a parameter called `name` that a keyword can set."""
    try:
        p = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def checkpoint(fn: Callable | None = None, *args, prevent_cse: bool | Sequence[bool] = True, policy=None,
               static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
               use_reentrant: bool = False, determinism_check: bool | str | None = None, name: str | None = None,
               shard_inputs: dict | None = None, offload_inputs: Sequence[int] = (), **unknown):
    """`fn` rematerialized: `jax.checkpoint`, with the library's policy names and options.

    `checkpoint(fn, **options)` returns the wrapped function, as `jax.checkpoint` does
    (`@checkpoint` and `@functools.partial(checkpoint, policy=...)` decorate). The
    `torch.utils.checkpoint` form runs at once: `checkpoint(fn, *args, **kwargs)`, where a keyword
    named like an option is the option and every other keyword goes to `fn` (an option that is
    also a parameter of `fn` is refused as ambiguous).

    Args:
      fn: the function; omitted (`checkpoint(policy=...)`), a decorator is returned.
      prevent_cse, static_argnums: as `jax.checkpoint`.
      policy: a `remat.policies` name or a JAX policy callable; default saves nothing.
      static_argnames: keyword arguments passed to `fn` as Python values (hashable to be reused).
      use_reentrant: True: a `jax.custom_vjp` that saves only the inputs and re-traces `fn` in the
        backward (reverse mode only).
      determinism_check: with `use_reentrant=True`: None (the avals check), False, True (the
        traced programs too, as `"structure"`) or `"values"` (the rules: `remat.check`).
      name: the region's name in errors and warnings (default `fn.__name__`).
      shard_inputs: {argument index: (saved spec, recompute spec)}: those inputs are kept sharded
        as `saved` between the forward and the backward and resharded to `recompute` before
        recomputing (needs a mesh; reverse mode only).
      offload_inputs: argument indices whose floating inputs wait in pinned host memory between
        the forward and the backward (reverse mode only; on a CPU nothing moves).
    Returns:
      the wrapped function, a decorator without `fn`, or `fn`'s result in the immediate form.
    Example:
      >>> import jax, jax.numpy as jnp
      >>> block = lambda w, x: jnp.tanh(x @ w)
      >>> w, x = jnp.eye(4), jnp.ones((2, 4))
      >>> g = jax.grad(lambda w: checkpoint(block)(w, x).sum())(w)
      >>> g2 = jax.grad(lambda w: checkpoint(block, w, x, use_reentrant=True).sum())(w)
      >>> bool(jnp.allclose(g, g2))
      True
    """
    if unknown and not args:
        raise TypeError(
            f"remat.checkpoint(fn, **options) returns the rematerialized function, as jax.checkpoint does; it was "
            f"given keyword argument(s) {sorted(unknown)}, which are not options. Call the result with them: "
            f"remat.checkpoint(fn, policy=...)(*args, **kwargs). Options: {', '.join(_OPTIONS)}")
    opts = dict(prevent_cse=prevent_cse, policy=policy, static_argnums=static_argnums,
                static_argnames=static_argnames, use_reentrant=use_reentrant, determinism_check=determinism_check,
                name=name, shard_inputs=shard_inputs, offload_inputs=tuple(offload_inputs))
    if fn is None:
        return functools.partial(checkpoint, **opts)
    if args:
        clash = [k for k in _OPTIONS if opts[k] != _DEFAULTS[k] and _names_parameter(fn, k)]
        if clash:
            both = " and ".join(repr(k) for k in clash)
            kws = ", ".join(f"{k}=..." for k in clash)
            raise TypeError(
                f"remat.checkpoint(fn, *args, {kws}): {both} {'is an option' if len(clash) == 1 else 'are options'} "
                f"of remat.checkpoint and {'a parameter' if len(clash) == 1 else 'parameters'} of "
                f"{getattr(fn, '__name__', 'fn')}, taken here as the option; pass {'it' if len(clash) == 1 else 'them'} "
                f"to the function with remat.checkpoint(functools.partial(fn, {kws}), *args), or call "
                f"remat.checkpoint(fn, **options)(*args, {kws})")
        return checkpoint(fn, **opts)(*args, **unknown)
    if not callable(fn):
        raise TypeError(f"remat.checkpoint: expected a function, got {type(fn).__name__} {fn!r}")
    check_region(use_reentrant, policy, determinism_check)
    argnums = (static_argnums,) if type(static_argnums) is int else static_argnums
    if not (type(argnums) is tuple and all(type(d) is int for d in argnums)):
        raise TypeError(f"remat.checkpoint: static_argnums must be an int or a tuple of ints, got {static_argnums!r}")
    argnums = tuple(argnums)
    argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    region = name or getattr(fn, "__name__", None) or type(fn).__name__
    resolved = _policies.resolve(policy)
    plain = _JAX_CHECKPOINT(fn, prevent_cse=prevent_cse, policy=resolved, static_argnums=argnums)

    def run(a, kw):
        moved = bool(use_reentrant or shard_inputs or offload_inputs)
        if not moved and _fences():  # built for an accelerator: a region that offloads is fenced
            off = _policies.offloads(resolved)
            moved = off if off is not None else _policy_offloads(plain, a, kw)
        if not use_reentrant:
            _warn_untagged(policy, plain, fn, a, kw, region)
        if not moved:
            return plain(*a, **kw)
        return _custom(fn, a, kw, argnums=argnums, policy=resolved, prevent_cse=prevent_cse, region=region,
                       use_reentrant=use_reentrant, determinism_check=determinism_check,
                       shard_inputs=shard_inputs, offload_inputs=tuple(offload_inputs))

    if not argnames:
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            return run(a, kw)
        return wrapped

    @functools.lru_cache(maxsize=64)
    def bound(items):  # one function per static keyword values, so JAX's trace cache is reused
        return checkpoint(functools.partial(fn, **dict(items)), **{**opts, "static_argnames": (), "name": region})

    @functools.wraps(fn)
    def wrapped_kw(*a, **kw):
        items = tuple(sorted((k, kw.pop(k)) for k in argnames if k in kw))
        try:
            f = bound(items)
        except TypeError:  # unhashable static values: a fresh function (a fresh trace) per call
            f = checkpoint(functools.partial(fn, **dict(items)), **{**opts, "static_argnames": (), "name": region})
        return f(*a, **kw)
    return wrapped_kw


def _warn_untagged(policy, plain, fn, args, kwargs, region) -> None:
    """`remat.policies.warn_untagged` on the region's program, traced through `plain` itself so
    that the real call reuses JAX's trace; once per region (its name and `fn`'s code), policy and
    input avals."""
    if _policies.by_name(policy) is None:
        return
    key = _policies.region_key((region, _identity(fn)), policy, args, kwargs)
    try:
        _policies.warn_untagged(policy, lambda: plain(*args, **kwargs), (), region, key=key)
    except (jax.errors.JAXTypeError, TypeError, ValueError):
        return  # the real call raises JAX's own error


def _identity(fn):
    """What stays the same across the traces of one region: a function's code (a closure made anew
    per call is the same region), with a partial's bound arguments; a callable object's class."""
    bound = ()
    while isinstance(fn, functools.partial):
        bound += (fn.args, tuple(sorted(fn.keywords.items())))
        fn = fn.func
    code = getattr(fn, "__code__", None) or type(fn)
    try:
        hash(bound)
    except TypeError:
        bound = tuple(map(type, jax.tree.leaves(bound)))
    return code, bound


def _policy_offloads(plain, args, kwargs) -> bool:
    """Whether what the backward of `plain` keeps includes host-memory values (a policy that
    offloads, where `remat.policies.offloads` cannot tell from the policy)."""
    try:
        closed = jax.make_jaxpr(lambda a, kw: jax.tree.leaves(jax.vjp(lambda *x: plain(*x, **kw), *a)[1]))(
            args, kwargs)
    except Exception:  # noqa: BLE001 - e.g. static arguments: then the policy is taken as offloading
        return True
    return any(not _on_device_aval(a) for a in closed.out_avals)


def _fences(target: str | None = None) -> bool:
    """Whether offloading regions are fenced when built for `target` (default: the platform being
    built for): on the accelerators, where host memory is memory of its own."""
    return (target or _memory.target_platform()) in _memory.ACCELERATORS


# --- the custom_vjp regions: reentrant, and saved inputs moved between forward and backward ------

def _is_inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _on_device_aval(a) -> bool:
    space = getattr(a, "memory_space", None)
    return space is None or "host" not in str(space).lower()


def _on_device(x) -> bool:
    return _on_device_aval(jax.typeof(x))


def _is_traced(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.core.Tracer)) or (
        type(leaf) in (bool, int, float, complex))


def _custom(fn, args, kwargs, *, argnums, policy, prevent_cse, region, use_reentrant, determinism_check,
            shard_inputs, offload_inputs):
    """A region as a `custom_vjp` over its flat traced inputs: reentrant, or `jax.checkpoint` whose
    saved inputs are moved (sharded, offloaded) or whose host-memory residuals are fenced."""
    n = len(args)
    for what, idx in (("static_argnums", argnums), ("shard_inputs", list(shard_inputs or ())),
                      ("offload_inputs", offload_inputs)):
        bad = [i for i in idx if not -n <= i < n]
        if bad:
            raise ValueError(f"remat.checkpoint: {what} entry {bad[0]} is out of range for {n} argument(s)")
    static = {d % n for d in argnums}
    leaves, in_tree = jax.tree.flatten((tuple(a if i not in static else _Const(a) for i, a in enumerate(args)),
                                        kwargs), is_leaf=lambda x: isinstance(x, _Const))
    traced = [_is_traced(l) for l in leaves]
    arg_of = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a if i not in static else _Const(a),
                                                                      is_leaf=lambda x: isinstance(x, _Const))]
    arg_of += [None] * (len(leaves) - len(arg_of))
    dyn = [l for l, t in zip(leaves, traced) if t]
    dyn_arg = [a for a, t in zip(arg_of, traced) if t]

    def flat_fn(*vals):
        it = iter(vals)
        full = [next(it) if t else (l.value if isinstance(l, _Const) else l) for l, t in zip(leaves, traced)]
        a, kw = jax.tree.unflatten(in_tree, full)
        return fn(*a, **kw)

    # Values the function closes over that are tracers of an enclosing transformation become inputs
    # (a custom_vjp may not close over them): JAX's public closure conversion. Its trace is the
    # forward's program; the reentrant backward traces `fn` again unless hoisted values tie it to that
    # program.
    conv, hoisted = jax.closure_convert(flat_fn, *dyn)
    nd, tree = len(dyn), []

    def flat(f):
        def body(*v):
            leaves, t = jax.tree.flatten(f(*v))
            tree[:] = [t]
            return leaves
        return body

    forward = flat(conv)
    again = flat(conv) if hoisted else flat(lambda *v: flat_fn(*v[:nd]))
    inputs = dyn + list(hoisted)
    shard = {i % n: v for i, v in (shard_inputs or {}).items()}
    storage = _storage(dyn, dyn_arg, shard, {i % n for i in offload_inputs})
    if use_reentrant:
        # None: the avals check (free); an explicit True asks for the whole trace-time check
        check = True if determinism_check is None else "structure" if determinism_check is True else determinism_check
        try:
            out = _reentrant(forward, again, inputs, name=region, determinism_check=check, storage=storage)
        except TypeError as e:
            if "forward-mode autodiff" not in str(e):
                raise
            raise TypeError(f"remat.checkpoint(use_reentrant=True) (region {region!r}) is a custom_vjp, which "
                            f"forward-mode AD (jax.jvp, jax.jacfwd, jax.linearize) cannot differentiate: use "
                            f"use_reentrant=False (the default) for forward mode") from None
    else:
        cse = prevent_cse if isinstance(prevent_cse, bool) else any(jax.tree.leaves(prevent_cse))
        out = _stored(forward, inputs, policy=policy, prevent_cse=cse, storage=storage)
    out_tree = tree[0]
    return jax.tree.unflatten(out_tree, out)


class _Const:
    """A static argument kept whole through flattening."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _cotangents(g):
    return [x for x in jax.tree.leaves(g) if _is_inexact(x) and jnp.size(x) > 0]


def _tie(xs, g):
    """`xs` through one optimization barrier with the cotangent `g`: available only once `g` is
    (what makes a stored input's move back wait for the backward)."""
    gl = _cotangents(g)
    idx = [i for i, x in enumerate(xs) if _is_inexact(x)]
    if not gl or not idx:
        return list(xs)
    out = list(xs)
    for i, x in zip(idx, jax.lax.optimization_barrier(([xs[i] for i in idx], gl))[0]):
        out[i] = x
    return out


def _fence(out, res):
    """`out` through one optimization barrier with the host-memory leaves of `res`: the region's
    output exists only once every copy to host memory is done (docs/offload.md). Returns
    (out, fenced?)."""
    host = [x for x in jax.tree.leaves(res) if hasattr(x, "dtype") and not _on_device(x)]
    leaves, tree = jax.tree.flatten(out)
    idx = [i for i, x in enumerate(leaves) if hasattr(x, "dtype")]
    if not host or not idx:
        return out, False
    for i, x in zip(idx, jax.lax.optimization_barrier(([leaves[i] for i in idx], host))[0]):
        leaves[i] = x
    return jax.tree.unflatten(tree, leaves), True


def _join(mask, cts):
    """The region's input cotangents through one optimization barrier, so the next region's
    backward starts once this region's weight gradients are done (docs/offload.md)."""
    idx = [i for i, (m, ct) in enumerate(zip(mask, cts)) if m and hasattr(ct, "dtype")]
    if not idx:
        return cts
    out = list(cts)
    for i, ct in zip(idx, jax.lax.optimization_barrier([cts[i] for i in idx])):
        out[i] = ct
    return tuple(out)


def _storage(dyn, dyn_arg, shard, offload):
    """{input index: (move while saved, move back for the recomputation)}."""
    out = {}
    for i, a in enumerate(dyn_arg):
        if a in shard:
            saved, full = shard[a]
            out[i] = (functools.partial(_shard_store, spec=saved),
                      functools.partial(jax.lax.with_sharding_constraint, shardings=full))
        elif a in offload and _is_inexact(dyn[i]):
            out[i] = (functools.partial(jax.device_put, device=jax.memory.Space.Host),
                      functools.partial(jax.device_put, device=jax.memory.Space.Device))
    return out


def _shard_store(x, spec):
    """`x` resharded to `spec` through the last axis first, so that the shard is made by an
    all-to-all, which XLA does not fuse into the backward (docs/architecture.md)."""
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
    """Residuals that are region inputs listed in `storage`, moved as it says; and {residual index:
    the move back}."""
    out, restore = list(res), {}
    for i, (put, back) in storage.items():
        for j, r in enumerate(out):
            if r is dyn[i]:
                out[j], restore[j] = put(r), back
    return out, restore


def _load(res, restore, g):
    """Stored residuals moved back, each only once the cotangent `g` exists."""
    idx = sorted(restore)
    out = list(res)
    for j, r in zip(idx, _tie([res[j] for j in idx], g)):
        out[j] = restore[j](r)
    return out


def _stored(body, dyn, *, policy, prevent_cse, storage):
    """`jax.checkpoint` of `body` as a custom_vjp whose residuals are moved per `storage` and, where
    some are in host memory on an accelerator, fenced (`_fence`, `_join`)."""
    state: dict[str, Any] = {}
    ck = _JAX_CHECKPOINT(body, policy=policy, prevent_cse=prevent_cse)
    mask = [_is_inexact(x) for x in dyn]

    @jax.custom_vjp
    def region(*dyn):
        return body(*dyn)

    def fwd(*dyn):
        out, pullback = jax.vjp(ck, *dyn)
        leaves, state["tree"] = jax.tree.flatten(pullback)
        leaves, state["restore"] = _store(leaves, dyn, storage)
        if _fences():
            out, state["fenced"] = _fence(out, leaves)
        return out, tuple(leaves)

    def bwd(res, g):
        res = _load(list(res), state["restore"], g)
        cts = tuple(ct if m else None for m, ct in zip(mask, jax.tree.unflatten(state["tree"], res)(g)))
        return _join(mask, cts) if state.get("fenced") else cts

    region.defvjp(fwd, bwd)
    return region(*dyn)


def _reentrant(body, again, dyn, *, name: str, determinism_check, storage):
    """The reentrant region: the forward runs `body` and keeps only the inputs; the backward traces
    `again` (the function itself) under `jax.vjp`, checked against the forward per
    `determinism_check` (remat.check)."""
    state: dict[str, Any] = {}

    @jax.custom_vjp
    def region(*dyn):
        return body(*dyn)

    def fwd(*dyn):
        if determinism_check == "structure":  # fingerprint the very program that computes `out`
            closed, tree, state["run"] = _check.trace(body, *dyn)
            state["jaxpr"] = _check.fingerprint(closed, tree)
            out = state["run"](*dyn)
        else:
            out = body(*dyn)
        marks = ()
        if determinism_check:
            marks, state["specs"] = _check.fingerprint_outputs(out)
            state["tree"] = jax.tree.structure(out)
        saved = tuple(jax.tree.leaves(out)) if determinism_check == "values" else ()
        kept, state["restore"] = _store(dyn, dyn, storage)
        if _fences():
            out, state["fenced"] = _fence(out, kept)
        return out, (tuple(kept), marks, saved)

    def bwd(res, g):
        dyn, marks, saved = res
        dyn = _load(list(dyn), state["restore"], g)
        mask = [_is_inexact(x) for x in dyn]
        recompute = again
        if determinism_check == "structure":
            # a fresh trace must equal the forward's program; then the forward's own program is
            # differentiated, so nothing unchecked slips in between
            closed, tree, _ = _check.trace(again, *dyn)
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

        # Trace the recomputation and its pullback, then keep only the equations the cotangents
        # need (early stop): the recomputed outputs serve only the check.
        diff = [x for x, m in zip(dyn, mask) if m]
        closed, (out_shape, _) = jax.make_jaxpr(pullback, return_shape=True)(diff, g)
        n_out = len(jax.tree.leaves(out_shape))
        keep = determinism_check == "values"
        jaxpr, _ = _compat.dce_jaxpr(closed.jaxpr, [keep] * n_out + [True] * (len(closed.out_avals) - n_out),
                                     instantiate=True)
        flat = jax.core.eval_jaxpr(jaxpr, closed.consts, *jax.tree.leaves((diff, g)))
        if keep:
            _check.compare_values(name, saved, flat[:n_out], tolerance=VALUES_RTOL)
            flat = flat[n_out:]
        cts = iter(flat)
        cts = tuple(next(cts) if m else None for m in mask)
        return _join(mask, cts) if state.get("fenced") else cts

    region.defvjp(fwd, bwd)
    return region(*dyn)
