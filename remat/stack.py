"""apply_layers(): run a stack of layers grouped and rematerialized per a RecomputeConfig.

This is the one place where layers are grouped into recompute regions; the Linen and NNX helpers
and plain-JAX users all call it.

Example:
    >>> import jax.numpy as jnp
    >>> apply_layers(lambda w, h, k: jnp.tanh(h @ w), [jnp.eye(2)] * 3, jnp.ones((1, 2)),
    ...              RecomputeConfig(granularity="full")).shape
    (1, 2)
"""
from __future__ import annotations

import inspect
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from remat.checkpoint import checkpoint
from remat.config import RecomputeConfig

from remat.regions import Every

__all__ = ["apply_layers", "stack_trees"]


def _runs(n_layers: int, cfg: RecomputeConfig):
    """(start, count, parts) runs of equal groups for the scan layout.

    A group is `parts`, a tuple of (size, checkpointed, policy) segments laid end to end; a run is
    `count` consecutive groups with the same parts, scanned as one `lax.scan`. A checkpointed
    segment is a group; layers outside regions are groups of one, except with `every=k`, where a
    region and the k-1 plain layers after it form one group, so the scan stays one run.
    """
    segs = cfg.split(n_layers)
    units = []
    i = 0
    while i < len(segs):
        s = segs[i]
        part = (s.stop - s.start, s.checkpointed, cfg.effective_policy(s.start) if s.checkpointed else None)
        nxt = segs[i + 1] if i + 1 < len(segs) else None
        if isinstance(cfg.layers, Every) and s.checkpointed and nxt is not None and not nxt.checkpointed:
            units.append((s.start, (part, (nxt.stop - nxt.start, False, None))))
            i += 2
            continue
        if s.checkpointed:
            units.append((s.start, (part,)))
        else:
            units += [(j, ((1, False, None),)) for j in range(s.start, s.stop)]
        i += 1
    runs = []
    for start, parts in units:
        if runs and runs[-1][2] == parts:
            runs[-1][1] += 1
        else:
            runs.append([start, 1, parts])
    return [tuple(r) for r in runs]


def apply_layers(apply_layer: Callable, params, x, cfg: RecomputeConfig, *, keys=None, args: tuple = (),
                 scan: bool = False, prevent_cse: bool = True, collect: bool = False, name: str | None = None):
    """Apply `apply_layer` layer after layer, with regions rematerialized per `cfg`.

    Args:
      apply_layer: `(layer_params, x, key, *args) -> x` (with `collect`, `-> (x, per_layer_out)`);
        `key` is None when `keys` is None.
      params: a sequence of per-layer parameter pytrees, or (`scan=True`) one pytree whose leaves
        have a leading layer axis.
      x: the input activation (any pytree carried from layer to layer).
      cfg: the recompute config.
      keys: optional per-layer PRNG keys (leading layer axis), e.g. for dropout.
      args: extra arguments given to every layer (arrays are traced; other values are constants).
      scan: run the layers under `lax.scan` (constant compile time in depth).
      prevent_cse: as `jax.checkpoint`.
      collect: return `(x, outs)`, the layers' per-layer outputs (outputs of their regions): a list
        (loop layout) or, with `scan`, one pytree whose leaves have a leading layer axis.
      name: what the layers are, in the regions' names (`Block at Model/stack, layers[0:2]`).
    Example:
      >>> import jax.numpy as jnp
      >>> ws, x = [jnp.eye(4)] * 3, jnp.ones((2, 4))
      >>> y = apply_layers(lambda p, h, k: h + jnp.tanh(h @ p), ws, x, RecomputeConfig(granularity="full"))
      >>> y.shape
      (2, 4)
    """
    n_layers = jax.tree.leaves(params)[0].shape[0] if scan else len(params)

    def run(ps, h, ks, *a):
        outs = []
        for i, p in enumerate(ps):
            h = apply_layer(p, h, None if ks is None else ks[i], *a)
            if collect:
                h, o = h
                outs.append(o)
        return (h, outs) if collect else h

    shard = None
    if cfg.shard_inputs:  # the carried activation (argument 1 of `run`/`run_stacked`) is (B, T, C)
        U = P.UNCONSTRAINED
        shard = {1: (P(U, cfg.shard_inputs, U), P(U, None, U))}
    offload = (1,) if cfg.offload_inputs else ()  # the carried activation, in pinned host memory

    def ckpt(fn, ps, h, ks, policy, label):
        # Leaves that are no arrays (a Python bool such as `deterministic`, the layer index riding
        # with its key) stay constants of the region, as a plain loop of layers sees them.
        leaves, tree = jax.tree.flatten((ps, h, ks) + tuple(args))
        keep = [_is_array(l) for l in leaves]

        def region(*a):
            it = iter(jax.tree.leaves(a))
            return fn(*jax.tree.unflatten(tree, [next(it) if k else l for l, k in zip(leaves, keep)]))
        masked = jax.tree.unflatten(tree, [l if k else None for l, k in zip(leaves, keep)])
        return checkpoint(region, use_reentrant=cfg.use_reentrant, policy=policy,
                          determinism_check=cfg.determinism_check, prevent_cse=prevent_cse,
                          name=label if name is None else f"{name}, {label}", shard_inputs=shard,
                          offload_inputs=offload)(*masked)

    if not scan:
        outs = []
        for s in cfg.split(n_layers):
            ps = list(params[s.start:s.stop])
            ks = None if keys is None else keys[s.start:s.stop]
            x = (ckpt(run, ps, x, ks, cfg.effective_policy(s.start), f"layers[{s.start}:{s.stop}]")
                 if s.checkpointed else run(ps, x, ks, *args))
            if collect:
                x, o = x
                outs += o
        return (x, outs) if collect else x

    def run_stacked(p, h, k, *a):  # p: params with a leading axis of `size` layers
        size = jax.tree.leaves(p)[0].shape[0]
        r = run([jax.tree.map(lambda t: t[j], p) for j in range(size)], h,
                None if k is None else [k[j] for j in range(size)], *a)
        return (r[0], _stack(r[1])) if collect else r

    # Each scan step hands its xs slice to the region as is; one-layer segments have no unit axis
    # (docs/architecture.md, Design notes: `stack.py` scan inputs).
    outs = []
    for start, count, parts in _runs(n_layers, cfg):
        gsize = sum(size for size, _, _ in parts)
        stop = start + count * gsize
        xs = []
        for off, size in zip(itertools.accumulate([0] + [p[0] for p in parts]), (p[0] for p in parts)):
            def group(a, off=off, size=size):
                a = a if (start, stop) == (0, n_layers) else a[start:stop]
                if len(parts) > 1:
                    a = a.reshape((count, gsize) + a.shape[1:])[:, off:off + size]
                    return a.reshape((count,) + a.shape[2:]) if size == 1 else a
                return a.reshape(((count, size) if size > 1 else (count,)) + a.shape[1:])
            xs.append((jax.tree.map(group, params), None if keys is None else group(keys)))

        def body(h, xs, start=start, parts=parts):
            off, ys = 0, []
            for (p, k), (size, ck, policy) in zip(xs, parts):
                fn = run_stacked if size > 1 else apply_layer  # a segment of one: that layer's params
                h = ckpt(fn, p, h, k, policy, f"layers[{start + off}:{start + off + size}] (scanned)") if ck \
                    else fn(p, h, k, *args)
                if collect:  # each part's outputs with a leading axis of its `size` layers
                    h, o = h
                    ys.append(o if size > 1 else jax.tree.map(lambda a: a[None], o))
                off += size
            return h, (_concat(ys) if collect else None)

        x, ys = lax.scan(body, x, xs)
        if collect:  # (count, group size, ...) -> (count * group size, ...): the run's layers in order
            outs.append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), ys))
    return (x, _concat(outs)) if collect else x


def _stack(trees):
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def _concat(trees):
    return trees[0] if len(trees) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *trees)


def stack_trees(trees, fn: str, stack: Callable, shape: Callable = np.shape, is_leaf=None):
    """Layer trees combined leaf by leaf by `stack` (a new leading layer axis); ValueError naming
    `fn`, the layer and the path where a layer's structure or a leaf's `shape` differs from layer 0's.

    Example:
      >>> stack_trees([{"w": np.zeros(2)}, {"w": np.ones(2)}], "f", lambda *a: np.stack(a))["w"].shape
      (2, 2)
    """
    trees = list(trees)
    if not trees:
        raise ValueError(f"{fn}(scan=True): no layers to stack")
    first = jax.tree_util.tree_flatten_with_path(trees[0], is_leaf=is_leaf)[0]
    for i, t in enumerate(trees[1:], 1):
        leaves = jax.tree_util.tree_flatten_with_path(t, is_leaf=is_leaf)[0]
        if [p for p, _ in leaves] != [p for p, _ in first]:
            raise ValueError(f"{fn}(scan=True): layer {i} holds other variables than layer 0: stacking needs "
                             f"layers of one structure; use scan=False")
        for (path, a), (_, b) in zip(leaves, first):
            if shape(a) != shape(b):
                raise ValueError(f"{fn}(scan=True): layer {i}'s {jax.tree_util.keystr(path)} has shape {shape(a)}, "
                                 f"layer 0's {shape(b)}: stacking needs layers of one shape; use scan=False")
    return jax.tree.map(stack, *trees, is_leaf=is_leaf)


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def _signature(module) -> str:
    try:
        return f"{type(module).__name__}.__call__{inspect.signature(type(module).__call__)}"
    except (TypeError, ValueError):
        return type(module).__name__


def _shapes(t):
    return jax.tree.map(lambda a: f"{getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', ()))}", t)


def _like(y, x) -> bool:
    """Whether `y` has `x`'s tree structure and leaf shapes."""
    return jax.tree.structure(y) == jax.tree.structure(x) and all(
        getattr(a, "shape", None) == getattr(b, "shape", None) for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(x)))


def _select(out, y, x, i, signature, side=None):
    """The carried activation from a layer's output `y` (`out(y)` when an `out` selector is given),
    checked against the input `x`'s structure and shapes."""
    if out is not None:
        y = out(y)
    if not _like(y, x):
        where = "a layer" if i is None else f"layer {i}"
        hint = " (with side=, out= picks x and side= the rest: out=lambda y: y[0], side=lambda y: y[1])" if side else ""
        raise ValueError(f"LayerStack: {where} ({signature}) returned {_shapes(y)}, but the stack carries x = "
                         f"{_shapes(x)} from layer to layer: a layer must return x, or give the stack out=... to "
                         f"pick x from its output (e.g. out=lambda y: y[1] for a layer returning (cache, x)){hint}")
    return y


def _check_selectors(stack: str, out, side) -> None:
    """TypeError naming `stack` when `out` or `side` is given but not callable."""
    for name, f in (("out", out), ("side", side)):
        if f is not None and not callable(f):
            raise TypeError(f"{stack}: {name}= must be a function of what a layer returns (e.g. {name}=lambda y: "
                            f"y[{0 if name == 'out' else 1}]), got {f!r}")


def _split(out, side, y, x, i, signature, stack: str):
    """(x, side value) from a layer's output `y`: x by `_select`, the side value `side(y)` (None
    without `side`), each checked."""
    if side is None:
        return _select(out, y, x, i, signature), None
    where = "a layer" if i is None else f"layer {i}"
    if out is not None and _like(y, x):
        raise ValueError(f"{stack}: side= and out= were given, but {where} ({signature}) returns only x "
                         f"({_shapes(y)}); they pick x and a per-layer value from a layer returning more (e.g. "
                         f"out=lambda y: y[0], side=lambda y: y[1] for a layer returning (x, attn_weights)): return "
                         f"the value from the layer, or leave out= unset for side= to see each layer's x "
                         f"(side=lambda x: x collects the layers' outputs)")
    h = _select(out, y, x, i, signature, side=True)
    value = side(y)
    bad = [type(a).__name__ for a in jax.tree.leaves(value, is_leaf=lambda a: a is None)
           if a is None or not (_is_array(a) or isinstance(a, (int, float, bool, complex)))]
    if bad or not jax.tree.leaves(value):
        raise ValueError(f"{stack}: side= returned {_shapes(value) if not bad else ', '.join(bad)} for {where} "
                         f"({signature}); side outputs are stacked along a leading layer axis, so side= must "
                         f"return arrays (or a pytree of arrays) from what the layer returns")
    return h, jax.tree.map(jnp.asarray, value)


def _stack_sides(values, stack: str):
    """Per-layer side outputs (a list) stacked along a leading layer axis; ValueError naming `stack`
    and the first layer whose structure or shapes differ from layer 0's."""
    for i, v in enumerate(values[1:], 1):
        if not _like(v, values[0]) or any(a.dtype != b.dtype for a, b in
                                          zip(jax.tree.leaves(v), jax.tree.leaves(values[0]))):
            raise ValueError(f"{stack}: side= gave layer {i} {_shapes(v)} but layer 0 {_shapes(values[0])}; side "
                             f"outputs are returned stacked along a leading layer axis, so every layer's must have "
                             f"the same structure, shapes and dtypes")
    return _stack(values)
