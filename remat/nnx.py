"""Flax NNX helpers: a layer stack grouped and rematerialized per `remat.plan`.

# NOTE: randomness. Each layer runs as a pure function of its (graphdef, state), so an update a
# layer makes to its own state (an RNG stream's counter, a running statistic) is discarded after
# the call, and a recompute region re-runs the layer from the same state. A dropout layer drawing
# from its own `nnx.Rngs` would therefore use the same mask in every call (and, with one shared
# `Rngs`, in every layer). So the stack owns the randomness: each call draws one key from its own
# `rngs` (a real state update of the stack, outside every region), folds in the layer index, and
# reseeds every RNG stream of that layer with it (folding in the stream's name) before the layer
# runs. Masks then differ between layers and between calls, and the forward and the recomputation
# of a region see the same keys, so remat leaves gradients unchanged. A layer that changes any other
# state, or draws random numbers while the stack has no `rngs`, raises instead of silently
# repeating itself.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import jax
from flax import nnx

from remat.config import RecomputeConfig
from remat.stack import _select, _signature, apply_layers


def _reseed(module, key) -> None:
    """Give every RNG stream of `module` a key derived from `key` and its name, counter 0."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.RngStream):
            node.key[...] = jax.random.fold_in(key, zlib.crc32(node.tag.encode()) & 0x7FFFFFFF)
            node.count[...] = 0 * node.count[...]


def _var(module, path):
    """The Variable object at a flattened-state `path` (for naming its kind in errors)."""
    keys = [getattr(p, "key", getattr(p, "name", getattr(p, "idx", p))) for p in path[:-1]]
    node = nnx.state(module)
    try:
        for k in keys:
            node = node[k]
    except Exception:
        return node
    return node


def _snapshot(module):
    """[(path, value)] of `module`'s state now, and the paths of its RNG counters."""
    flat = lambda st: jax.tree_util.tree_flatten_with_path(st)[0]
    return flat(nnx.state(module)), {p for p, _ in flat(nnx.state(module, nnx.RngCount))}


def _where(path) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path[:-1])


def _check_unchanged(i: int, before, module, reseeded: bool) -> None:
    """Raise ValueError when layer `i` changed its state during the call (RNG counters excepted
    when the stack reseeded them)."""
    (old, counters), (new, _) = before, _snapshot(module)
    old, new = dict(old), dict(new)
    added = [p for p in new if p not in old]
    if added:
        kinds = sorted({type(v).__name__ for _, v in nnx.to_flat_state(nnx.state(module))
                        if not isinstance(v, nnx.Param)} or {"?"})
        raise ValueError(
            f"remat.nnx.LayerStack: layer {i} added state during the call ({', '.join(_where(p) for p in added)}; "
            f"e.g. an nnx.Intermediate from sow, kinds here: {', '.join(kinds)}); layers run as pure functions of "
            f"their state (a recompute region re-runs them), so it would be lost. Return the value from the layer "
            f"instead (with out=... to pick x), or call the layer outside the stack")
    for path, a in old.items():
        b = new.get(path)
        if a is b:
            continue
        where = f"{_where(path)}, {type(_var(module, path)).__name__}"
        if path in counters:
            if reseeded:
                continue
            raise ValueError(
                f"remat.nnx.LayerStack: layer {i} drew random numbers from its own nnx.Rngs ({where}); run as a "
                f"pure function of its state it would draw the same ones in every call (and in every layer sharing "
                f"that Rngs). Give the stack the randomness: LayerStack(layers, recompute, rngs=nnx.Rngs(dropout="
                f"seed)), or call it with key=..., so each layer and each call gets its own key")
        raise ValueError(
            f"remat.nnx.LayerStack: layer {i} changed its state during the call ({where}); layers run as pure "
            f"functions of their state (a recompute region re-runs them), so the update would be lost. Keep "
            f"that state outside the stack, or make the layer stateless in the forward pass")


class LayerStack(nnx.Module):
    """Run NNX layers (`layer(x, *args) -> x`) per a RecomputeConfig.

    Each layer is split into (graphdef, state); the states flow through `remat.apply_layers`, so
    checkpointed regions see explicit inputs (both the `jax.checkpoint` and the reentrant path).
    Dropout: pass `rngs` (or `key=` per call); every call draws one key from it and every layer's
    RNG streams are reseeded from it and the layer index (see the NOTE above), so masks differ
    between layers and calls and are the same with and without remat.

    Args:
      layers: the layers, each `layer(x, *args, **kwargs) -> x` (or `out(layer(...))`).
      recompute: the RecomputeConfig.
      prevent_cse: passed to `jax.checkpoint`.
      rngs: the stack's RNG streams (its `dropout` stream, else `default`), or None.
      out: picks x out of what a layer returns, for layers returning more than x (e.g.
        `lambda y: y[1]` for `(cache, x)`); a layer returning anything but x without it raises,
        naming the layer and its signature.
      scan: run the layers under `lax.scan` (constant compile time in depth): their states are
        stacked along a new leading axis at each call, so every layer must have the same structure
        (graphdef). Gradients reach each layer's own parameters.
    Call: `stack(x, *args, key=None, **kwargs)`; `key` (a typed or raw PRNG key) replaces the draw
    from `rngs`; `args` and `kwargs` go to every layer.
    Example:
      >>> class Block(nnx.Module):
      ...     def __init__(self, width, rngs):
      ...         self.dense, self.drop = nnx.Linear(width, width, rngs=rngs), nnx.Dropout(0.1, rngs=rngs)
      ...     def __call__(self, x):
      ...         return x + self.drop(self.dense(x))
      >>> rngs = nnx.Rngs(params=0, dropout=1)
      >>> stack = LayerStack([Block(8, rngs=rngs) for _ in range(4)], RecomputeConfig(granularity="full"),
      ...                    rngs=nnx.Rngs(dropout=2))
      >>> stack(jax.numpy.ones((2, 8))).shape
      (2, 8)
    """

    def __init__(self, layers: Sequence[nnx.Module], recompute: RecomputeConfig = RecomputeConfig(),
                 prevent_cse: bool = True, rngs: nnx.Rngs | None = None, out=None, scan: bool = False):
        recompute.validate_for(len(layers))
        self.out = out
        self.scan = scan
        self.layers = nnx.List(list(layers))
        self.recompute = recompute
        self.prevent_cse = prevent_cse
        self.rngs = rngs

    def __call__(self, x, *args, key=None, **kwargs):
        split = [nnx.split(layer) for layer in self.layers]
        graphdefs = [g for g, _ in split]
        if key is None and self.rngs is not None:
            key = self.rngs.dropout()
        if key is not None and not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)  # a raw uint32 key, as from jax.random.PRNGKey
        keys = [(i, None if key is None else jax.random.fold_in(key, i)) for i in range(len(split))]
        if self.scan:
            return self._scanned(graphdefs, [s for _, s in split], x, key, args, kwargs)

        # The layer index rides along with its key (a constant) so each layer finds its graphdef;
        # the states and keys are traced. (The regions close over `out`, not `self`: the stack is a
        # pytree of the very states passed in, and a closure over traced values costs a hoisting.)
        out = self.out

        def apply_layer(state, h, ik, *a):
            i, k = ik
            *a, kw = a
            module = nnx.merge(graphdefs[i], state)
            if k is not None:
                _reseed(module, k)
            before = _snapshot(module)
            y = module(h, *a, **kw)
            _check_unchanged(i, before, module, k is not None)
            return _select(out, y, h, i, _signature(module))

        return apply_layers(apply_layer, [s for _, s in split], x, self.recompute,
                            keys=keys, args=args + (kwargs,), prevent_cse=self.prevent_cse)

    def _scanned(self, graphdefs, states, x, key, args, kwargs):
        """The layers under `lax.scan`: one graphdef, the states stacked along a leading axis."""
        for i, g in enumerate(graphdefs[1:], 1):
            if g != graphdefs[0]:
                raise ValueError(f"remat.nnx.LayerStack(scan=True): layer {i} differs in structure from layer 0 "
                                 f"({type(self.layers[i]).__name__} vs {type(self.layers[0]).__name__}, or different "
                                 f"submodules/shapes); scan needs identical layers: use scan=False")
        stacked = jax.tree.map(lambda *t: jax.numpy.stack(t), *states)
        n = len(states)
        keys = None if key is None else jax.vmap(lambda i: jax.random.fold_in(key, i))(jax.numpy.arange(n))
        out = self.out

        def apply_layer(state, h, k, *a):
            *a, kw = a
            module = nnx.merge(graphdefs[0], state)
            if k is not None:
                _reseed(module, k)
            before = _snapshot(module)
            y = module(h, *a, **kw)
            _check_unchanged("(scanned)", before, module, k is not None)
            return _select(out, y, h, None, _signature(module))

        return apply_layers(apply_layer, stacked, x, self.recompute, keys=keys, args=args + (kwargs,),
                            scan=True, prevent_cse=self.prevent_cse)
