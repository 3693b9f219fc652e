"""Flax NNX: `LayerStack` (layers grouped into regions per a RecomputeConfig, loop or scan layout),
`remat` (`nnx.remat` taking the library's policy names), and `stack_layers` / `unstack_layers` (a
model state's layer list to the paths of a stored stack and back)."""
from __future__ import annotations

import contextlib
import functools
import inspect
import zlib
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from remat import names as _names
from remat import policies as _policies
from remat.config import RecomputeConfig
from remat.stack import _check_selectors, _signature, _split, _stack_sides, apply_layers, stack_trees

__all__ = ["LayerStack", "remat", "stack_layers", "tag_submodules", "unstack_layers"]

# State: each layer runs as a pure function of its (graphdef, state); the non-Param Variables it
# updates (a BatchStat, its own Rngs' counters, an nnx.Cache) leave the layer and its region as
# outputs beside x and are written back after the call (under scan stacked, as nnx.scan writes
# them), so a recompute region re-runs from the state it was given. When the stack owns the
# randomness (its `rngs`, or `key=` per call), each layer's RNG streams are reseeded from one key
# per call folded with the layer index, and their counters are not written back.


def _reseed(module, key) -> None:
    """Give every RNG stream of `module` a key derived from `key` and its name, counter 0."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.RngStream):
            node.key[...] = jax.random.fold_in(key, zlib.crc32(node.tag.encode()) & 0x7FFFFFFF)
            node.count[...] = 0 * node.count[...]


def _snapshot(module):
    """{path: value} of `module`'s state now (the values compared by identity after the call)."""
    return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(module))}


def _where(path) -> str:
    return "/".join(str(p) for p in path)


def _updates(i, before, module, reseeded: bool):
    """The non-Param state layer `i` changed during the call (an nnx.State; its RNG streams left
    out when the stack reseeded them); ValueError when it added state or changed a Param."""
    after = nnx.to_flat_state(nnx.state(module))
    added = [p for p, _ in after if p not in before]
    if added:
        kinds = sorted({type(v).__name__ for p, v in after if p in added} or {"?"})
        raise ValueError(
            f"remat.nnx.LayerStack: layer {i} added state during the call ({', '.join(map(_where, added))}; "
            f"e.g. an nnx.Intermediate from sow, kinds here: {', '.join(kinds)}); layers run as pure functions of "
            f"their state (a recompute region re-runs them), so it would be lost. Return the value from the layer "
            f"instead (with out=... to pick x, side=... to collect it per layer), or call the layer outside the stack")
    changed = {p for p, v in after if v.get_value() is not before[p]}
    params = sorted(_where(p) for p, v in after if p in changed and isinstance(v, nnx.Param))
    if params:
        raise ValueError(
            f"remat.nnx.LayerStack: layer {i} changed its nnx.Param state during the call ({', '.join(params)}); "
            f"the stack writes back only the non-Param state a layer updates (batch statistics, RNG counters, "
            f"caches). Update parameters outside the stack, or hold the value in another nnx.Variable type")
    if reseeded:
        changed -= {p for p, v in after if isinstance(v, nnx.RngState)}
    return nnx.state(module, lambda path, _: path in changed)


def _check_unshared(layers, updates) -> None:
    """ValueError when two layers of a list update the same Variable object (e.g. one shared
    nnx.Rngs): each runs from the state it held before the call, so they would repeat each other."""
    seen = {}
    for i, (layer, upd) in enumerate(zip(layers, updates)):
        paths = {p for p, _ in nnx.to_flat_state(upd)}
        for path, node in nnx.iter_graph(layer):
            if path in paths and isinstance(node, nnx.Variable):
                j = seen.setdefault(id(node), (i, path))
                if j[0] != i:
                    raise ValueError(
                        f"remat.nnx.LayerStack: layers {j[0]} and {i} share one {type(node).__name__} that changes "
                        f"during the call ({_where(j[1])}; e.g. one nnx.Rngs stored by both); each runs from the "
                        f"state it held before the call, so the second would repeat the first. Give each layer its "
                        f"own (nnx.Dropout(rate, rngs=rngs) forks one), or give the stack the randomness: "
                        f"LayerStack(layers, recompute, rngs=nnx.Rngs(dropout=seed))")


class LayerStack(nnx.Module):
    """Run NNX layers (`layer(x, *args) -> x`) per a RecomputeConfig.

    Each layer is split into (graphdef, state); the states flow through `remat.apply_layers`, so
    checkpointed regions see explicit inputs (both the `jax.checkpoint` and the reentrant path).
    State a layer updates (not its `nnx.Param`s: a BatchNorm's `BatchStat`, its own `nnx.Rngs`
    counters, an `nnx.Cache`) is written back after the call, in both layouts, as `nnx.scan`
    does. Dropout from the stack: pass `rngs` (or `key=` per call); every call draws one key from
    it and reseeds every layer's RNG streams from it and the layer index, so masks differ between
    layers and calls and are the same with and without remat.

    Args:
      layers: the layers, each `layer(x, *args, **kwargs) -> x` (or `out(layer(...))`); with
        `scan=True` also one module holding them stacked.
      recompute: the RecomputeConfig.
      prevent_cse: passed to `jax.checkpoint`.
      rngs: the stack's RNG streams (its `dropout` stream, else `default`), or None.
      out, side: the selectors of x and of a per-layer side output in what a layer returns, as
        `remat.linen.LayerStack` takes them (with `side`, the call returns `(x, sides)` stacked
        along a leading layer axis).
      scan: run the layers under `lax.scan` (constant compile time in depth). The stack then holds
        them as one module whose Variables have a leading layer axis, stacked once here (every layer
        must have the same structure, graphdef), or takes such a module as `layers` (made under
        `nnx.vmap`, NNX's scan-over-layers layout); each call scans that state in place, with no
        copy of the weights. `stack[i]` is then a copy merged from a slice.
      layer_axis_name: under `scan`, the name of the leading layer axis added to partitioning
        metadata when the stack stacks the layers itself.
    Call: `stack(x, *args, key=None, **kwargs)`; `key` (a typed or raw PRNG key) replaces the draw
    from `rngs`; `args` and `kwargs` go to every layer; returns x, or `(x, sides)` with `side`.
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
      >>> hidden = LayerStack(list(stack), RecomputeConfig(granularity="full"), side=lambda x: x)
      >>> [a.shape for a in hidden(jax.numpy.ones((2, 8)), key=jax.random.key(0))]   # x, each layer's x
      [(2, 8), (4, 2, 8)]
    """

    def __init__(self, layers: Sequence[nnx.Module] | nnx.Module, recompute: RecomputeConfig = RecomputeConfig(),
                 prevent_cse: bool = True, rngs: nnx.Rngs | None = None, out=None, scan: bool = False,
                 layer_axis_name: str | None = "layers", side=None):
        _check_selectors("remat.nnx.LayerStack", out, side)
        if isinstance(layers, nnx.Module):  # the layers stacked in one module (made under nnx.vmap)
            if not scan:
                raise ValueError(f"remat.nnx.LayerStack: got one {type(layers).__name__} holding the layers stacked "
                                 f"along a leading axis (as made under nnx.vmap); that layout runs under lax.scan: "
                                 f"pass scan=True, or a list of layers")
            self.n_layers = _stacked_len(layers)
            self.layers = layers
        elif scan:
            layers = list(layers)
            split = [nnx.split(layer) for layer in layers]
            for i, (g, _) in enumerate(split[1:], 1):
                if g != split[0][0]:
                    raise ValueError(f"remat.nnx.LayerStack(scan=True): layer {i} differs in structure from layer 0 "
                                     f"({type(layers[i]).__name__} vs {type(layers[0]).__name__}, or different "
                                     f"submodules/shapes); scan needs identical layers: use scan=False")
            # Stacked once, here: one module with a leading layer axis on every Variable
            # (docs/architecture.md, Design notes: `nnx.py` scan layout).
            stacked = jax.tree.map(lambda *t: jnp.stack(t), *[s for _, s in split])
            if layer_axis_name is not None:
                stacked = nnx.spmd.add_axis(stacked, 0, {nnx.PARTITION_NAME: layer_axis_name})
            self.n_layers = len(layers)
            self.layers = nnx.merge(split[0][0], stacked)
        else:
            self.n_layers = len(layers)
            self.layers = nnx.List(list(layers))
        recompute.validate_for(self.n_layers)
        self.out = out
        self.side = side
        self.scan = scan
        self.layer_axis_name = layer_axis_name
        self.recompute = recompute
        self.prevent_cse = prevent_cse
        self.rngs = rngs

    def __len__(self) -> int:
        return self.n_layers

    def __getitem__(self, i):
        """Layer `i`; under scan a new module merged from a slice of the stacked state (a copy:
        updating it leaves the stack unchanged)."""
        if not self.scan:
            return self.layers[i]
        if not -self.n_layers <= i < self.n_layers:
            raise IndexError(f"remat.nnx.LayerStack: layer {i} out of range for {self.n_layers} layers")
        graphdef, state = nnx.split(self.layers)
        one = jax.tree.map(lambda a: a[i], state)
        if self.layer_axis_name is not None:
            try:
                one = nnx.spmd.remove_axis(one, 0, {nnx.PARTITION_NAME: self.layer_axis_name})
            except ValueError:  # made under nnx.vmap with another (or no) axis name
                pass
        return nnx.merge(graphdef, one)

    def __iter__(self):
        return (self[i] for i in range(self.n_layers)) if self.scan else iter(self.layers)

    def __call__(self, x, *args, key=None, **kwargs):
        first = self.layers if self.scan else self.layers[0]  # (its type: the stacked module is one layer's)
        if (key is None and self.rngs is not None and "rngs" not in kwargs
                and not any(isinstance(a, nnx.Rngs) for a in args) and _takes_rngs(first)):
            kwargs = {**kwargs, "rngs": self.rngs}  # layers drawing from an Rngs passed per call (Gemma's way)
        elif key is None and self.rngs is not None:
            key = self.rngs.dropout()
        if key is not None and not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)  # a raw uint32 key, as from jax.random.PRNGKey
        # NNX objects passed per call ride from layer to layer with x as their state
        # (docs/architecture.md, Design notes: `nnx.py` per-call graph nodes).
        nodes = _Nodes(args, kwargs)
        args, kwargs = nodes.args, nodes.kwargs
        out, side = self.out, self.side
        if self.scan:
            graphdef, states = nnx.split(self.layers)
            graphdefs = [graphdef]
            keys = None if key is None else jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(self.n_layers))
        else:
            split = [nnx.split(layer) for layer in self.layers]
            graphdefs, states = [g for g, _ in split], [st for _, st in split]
            # The layer index rides along with its key (a constant) so each layer finds its graphdef.
            keys = [(i, None if key is None else jax.random.fold_in(key, i)) for i in range(len(split))]

        # The states and keys are traced; the regions close over `out`/`side`, not `self` (the stack
        # is a pytree of the very states passed in, and a closure over traced values costs a hoisting).
        # What a layer updates leaves it as a per-layer output beside x (docs/architecture.md, Design
        # notes: `nnx.py` layer state).
        def apply_layer(state, h, ik, *a):
            i, k = ik if isinstance(ik, tuple) else (None, ik)
            *a, kw = a
            h, (a, kw), done = nodes.enter(h, a, kw)
            module = nnx.merge(graphdefs[0 if i is None else i], state)
            if k is not None:
                _reseed(module, k)
            before = _snapshot(module)
            y = module(h, *a, **kw)
            upd = _updates("(scanned)" if i is None else i, before, module, k is not None)
            y, s = _split(out, side, y, h, i, _signature(module), "remat.nnx.LayerStack")
            return done(y), (upd, s)

        result, per_layer = apply_layers(apply_layer, states, nodes.carry(x), self.recompute, keys=keys,
                                         args=tuple(args) + (kwargs,), scan=self.scan,
                                         prevent_cse=self.prevent_cse, collect=True,
                                         name=type(self.layers if self.scan else self.layers[0]).__name__)
        if self.scan:
            upd, sides = per_layer
            nnx.update(self.layers, upd)  # stacked along the layer axis, as the state is
        else:
            upd, sides = [u for u, _ in per_layer], [s for _, s in per_layer]
            _check_unshared(self.layers, upd)
            for layer, u in zip(self.layers, upd):
                nnx.update(layer, u)
            sides = None if side is None else _stack_sides(sides, "remat.nnx.LayerStack")
        result = nodes.finish(result)
        return result if side is None else (result, sides)


def _stacked_len(module) -> int:
    """The leading axis every array of `module`'s state shares (its number of stacked layers)."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(module))[0]
    sizes = {jax.tree_util.keystr(p): (getattr(a, "shape", ()) or (None,))[0] for p, a in leaves}
    if not sizes or len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(f"remat.nnx.LayerStack(scan=True): the module's state has no common leading layer axis "
                         f"({', '.join(f'{k}: {v}' for k, v in list(sizes.items())[:4])}); make the layers under "
                         f"nnx.vmap (with nnx.split_rngs), or pass a list of layers")
    return int(next(iter(sizes.values())))


def _takes_rngs(layer) -> bool:
    try:
        return "rngs" in inspect.signature(type(layer).__call__).parameters
    except (TypeError, ValueError):
        return False


class _Slot:
    """Where a per-call graph node sits among a layer's arguments (a constant of the region)."""
    __slots__ = ("pos",)

    def __init__(self, pos):
        self.pos = pos


class _Nodes:
    """The NNX objects among a stack call's arguments, carried beside x as their state."""

    def __init__(self, args, kwargs):
        self.objs, self.defs = {}, {}
        args, kwargs = list(args), dict(kwargs)
        for pos, v in [(i, a) for i, a in enumerate(args)] + [(k, v) for k, v in kwargs.items()]:
            if isinstance(v, (nnx.Module, nnx.Rngs, nnx.Variable)):
                self.objs[pos] = v
                if isinstance(pos, int):
                    args[pos] = _Slot(pos)
                else:
                    kwargs[pos] = _Slot(pos)
        self.args, self.kwargs = tuple(args), kwargs

    def carry(self, x):
        if not self.objs:
            return x
        states = {}
        for pos, obj in self.objs.items():
            self.defs[pos], states[pos] = nnx.split(obj)
        return (x, states)

    def enter(self, h, a, kw):
        """(x, the layer's arguments with the nodes in place, a function packing y back with their states)."""
        if not self.objs:
            return h, (a, kw), lambda y: y
        x, states = h
        live = {pos: nnx.merge(self.defs[pos], states[pos]) for pos in self.objs}
        put = lambda v: live[v.pos] if isinstance(v, _Slot) else v  # noqa: E731
        return x, ([put(v) for v in a], {k: put(v) for k, v in kw.items()}), (
            lambda y: (y, {pos: nnx.state(obj) for pos, obj in live.items()}))

    def finish(self, result):
        if not self.objs:
            return result
        y, states = result
        for pos, obj in self.objs.items():
            nnx.update(obj, states[pos])
        return y


def stack_layers(state, stack: str = "layers", scan: bool = False, layer_axis_name: str | None = "layers"):
    """A model state with a plain layer list at `stack` (`layers/0/...`, as `nnx.List` keeps it)
    mapped to the paths of a `LayerStack` stored there (`layers/layers/0/...`; with `scan=True`
    the layers' Variables stacked along a new leading axis, `layers/layers/...` of shape (L, ...),
    the partitioning metadata getting `layer_axis_name` as the stack gives it); `unstack_layers` is
    the inverse. So a checkpoint of the model without the stack loads into the model with it:
    `nnx.update(model, stack_layers(restored))`, and back. (A model holding its layers stacked
    already, made under `nnx.vmap`, maps with `scan=False`: only the `layers/` level is added.)

    Example:
      >>> st = nnx.State({"layers": {0: {"w": 1}, 1: {"w": 2}}, "head": {"w": 3}})
      >>> sorted(stack_layers(st)["layers"]["layers"])
      [0, 1]
      >>> unstack_layers(stack_layers(st)) == st
      True
      >>> stack_layers(st, scan=True)["layers"]["layers"]["w"].tolist()
      [1, 2]
    """
    out = {k: _nested_dict(v) for k, v in state.items()}
    if stack not in out:
        raise ValueError(f"remat.nnx.stack_layers: the state has no {stack!r} entry (its top level: {sorted(out, key=str)}); "
                         f"pass stack= the attribute that holds the layer list")
    layers = out[stack]
    keys = sorted(layers, key=str) if not all(isinstance(k, int) for k in layers) else sorted(layers)
    if keys != list(range(len(keys))):
        raise ValueError(f"remat.nnx.stack_layers: {stack!r} holds {keys}, not a layer list 0 ... L-1 (as nnx.List "
                         f"keeps one); a state with missing layers cannot be mapped to a stack")
    if scan:
        layers = stack_trees([_nested_dict(layers[i]) for i in keys], "remat.nnx.stack_layers", _stack,
                             shape=lambda v: jnp.shape(v[...] if _is_var(v) else v), is_leaf=_is_var)
        if layer_axis_name is not None:
            layers = nnx.spmd.add_axis(layers, 0, {nnx.PARTITION_NAME: layer_axis_name})
    out[stack] = {"layers": layers}
    return nnx.State(out) if isinstance(state, nnx.State) else out


def unstack_layers(state, stack: str = "layers", scan: bool = False, layer_axis_name: str | None = "layers"):
    """The inverse of `stack_layers`: `layers/layers/i/...` back to `layers/i/...` (with `scan=True`,
    the stacked `layers/layers/...` sliced into `layers/i/...`; the stack's own `rngs` state, if
    any, is dropped: the model without the stack has none)."""
    out = {k: _nested_dict(v) for k, v in state.items()}
    if stack not in out or not isinstance(out[stack], dict) or "layers" not in out[stack]:
        raise ValueError(f"remat.nnx.unstack_layers: the state has no {stack}/layers (a LayerStack stored at "
                         f"{stack!r}); pass stack= where the model holds its LayerStack")
    layers = _nested_dict(out[stack]["layers"])
    if scan:
        n = {_leading(v) for v in jax.tree.leaves(layers, is_leaf=_is_var)}
        if len(n) != 1 or None in n:
            raise ValueError(f"remat.nnx.unstack_layers(scan=True): the leaves at {stack}/layers have no common "
                             f"leading layer axis (sizes {sorted(n, key=str)}); use scan=False for a loop layout")
        layers = {i: jax.tree.map(lambda v, i=i: _slice(v, i, layer_axis_name), layers, is_leaf=_is_var)
                  for i in range(n.pop())}
    out[stack] = layers
    return nnx.State(out) if isinstance(state, nnx.State) else out


def _is_var(v) -> bool:
    return isinstance(v, nnx.Variable)


def _stack(*vs):
    return vs[0].replace(jnp.stack([v[...] for v in vs])) if _is_var(vs[0]) else jnp.stack(vs)


def _leading(v):
    shape = getattr(v[...] if _is_var(v) else v, "shape", ())
    return shape[0] if shape else None


def _slice(v, i, layer_axis_name):
    if not _is_var(v):
        return v[i]
    one = v.replace(v[...][i])
    if layer_axis_name is not None:
        try:
            one = nnx.spmd.remove_axis(one, 0, {nnx.PARTITION_NAME: layer_axis_name})
        except ValueError:
            pass
    return one


def _nested_dict(node):
    """Nested States as the plain nested dicts an `nnx.state` holds below its top level."""
    if isinstance(node, nnx.State):
        return {k: _nested_dict(v) for k, v in node.items()}
    return node


def remat(f=None, *, prevent_cse: bool = True, static_argnums: int | tuple[int, ...] = (), policy=None,
          graph: bool | None = None, graph_updates: bool | None = None):
    """`nnx.remat` with the policy given by name or as a JAX policy callable.

    Every form and argument `nnx.remat` takes: a decorator (`@remat`, `@remat(policy=...)`) or a
    call (`remat(f, static_argnums=...)`), `prevent_cse`, `graph` / `graph_updates`; state updates
    made inside (an `Rngs` counter, a BatchStat) are written back as NNX writes them.

    Args:
      f: the function (its arguments may be NNX modules, Variables and `Rngs`); None gives a decorator.
      policy: a `remat.policies` name or a JAX policy callable.
      prevent_cse, static_argnums, graph, graph_updates: as `nnx.remat`.
    Example:
      >>> class Block(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.dense, self.drop = nnx.Linear(8, 8, rngs=rngs), nnx.Dropout(0.1)
      ...     @remat(policy="full")
      ...     def __call__(self, x, rngs):
      ...         return x + self.drop(self.dense(x), rngs=rngs)
      >>> block, rngs = Block(nnx.Rngs(0)), nnx.Rngs(dropout=1)
      >>> block(jax.numpy.ones((2, 8)), rngs).shape
      (2, 8)
      >>> int(rngs.dropout.count[...])   # the stream advanced, as without remat
      1
    """
    opts = dict(prevent_cse=prevent_cse, static_argnums=static_argnums, policy=_policies.resolve(policy),
                graph=graph, graph_updates=graph_updates)
    if f is None:
        return functools.partial(remat, prevent_cse=prevent_cse, static_argnums=static_argnums, policy=policy,
                                 graph=graph, graph_updates=graph_updates)
    rematted = nnx.remat(f, **opts)
    if _policies.by_name(policy) is None:
        return rematted

    @functools.wraps(f)
    def call(*args, **kwargs):
        out = rematted(*args, **kwargs)
        _warn_untagged(policy, f, args, kwargs)
        return out
    return call


def _warn_untagged(policy, f, args, kwargs) -> None:
    """`remat.policies.warn_untagged` for one call of an `nnx.remat` region, named by its module's
    class (NNX modules know no path): once per function, policy and input and state avals; `f`
    traced without remat on a copy (`nnx.split` / `nnx.merge`)."""
    try:
        module = args[0] if args and isinstance(args[0], nnx.Module) else None
        name = getattr(f, "__name__", type(f).__name__)
        region = name if module is None else type(module).__name__ + ("" if name == "__call__" else f".{name}")
        graphdef, state = nnx.split((args, kwargs))
        key = _policies.region_key((f, region, graphdef), policy, state)
        if key is None:
            return

        def body(state):
            a, kw = nnx.merge(graphdef, state)
            return f(*a, **kw)
        _policies.warn_untagged(policy, body, (state,), region, key=key)
    except Exception:  # noqa: BLE001 - the warning is advice; the real call has run
        return


@contextlib.contextmanager
def tag_submodules(*layers: nnx.Module):
    """Tag the output of every submodule call inside each of `layers` with its path below the layer.

    The NNX form of `remat.linen.tag_submodules`, for a model that tags nothing: while the context
    is open, each submodule of each layer (`nnx.iter_modules`) returns its floating arrays tagged
    `checkpoint_name(out, path)` (`attn.c_attn`; `remat.names.path_tag`) and the names are registered,
    so name-based policies and the per-tag planner take them. Values are unchanged. NNX has no
    method interceptor: each submodule's class is swapped for a subclass of the same name whose
    `__call__` tags, and swapped back on exit. Pass every layer (the same names in each); the
    layers themselves and the rest of the model are not tagged.

    Args:
      layers: the layer modules (e.g. `*model.blocks`).
    Example:
      >>> class Block(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.c_fc = nnx.Linear(4, 4, rngs=rngs)
      ...     def __call__(self, x):
      ...         return jnp.tanh(self.c_fc(x))
      >>> b = Block(nnx.Rngs(0))
      >>> from remat.policies import region_tags
      >>> with tag_submodules(b):
      ...     sorted(region_tags(lambda x: b(x), jnp.ones((2, 4))))
      ['c_fc']
      >>> type(b.c_fc).__name__
      'Linear'
    """
    bad = [l for l in layers if not isinstance(l, nnx.Module)]
    if bad:
        raise TypeError(f"tag_submodules: layers must be nnx.Module instances, got {bad!r}")
    swapped = []
    try:
        for layer in layers:
            for path, m in nnx.iter_modules(layer):
                if path and not getattr(type(m), "_remat_tag", None):
                    swapped.append((m, type(m)))
                    object.__setattr__(m, "__class__", _tagging(type(m), _names.path_tag(path)))
        yield
    finally:
        for m, cls in reversed(swapped):
            object.__setattr__(m, "__class__", cls)


@functools.lru_cache(maxsize=None)
def _tagging(cls: type, name: str) -> type:
    """A subclass of `cls`, with its name, whose `__call__` tags its floating outputs `name`."""
    def __call__(self, *args, **kwargs):
        return _names.tag_tree(cls.__call__(self, *args, **kwargs), name)
    return type(cls.__name__, (cls,), {"__call__": __call__, "_remat_tag": name, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
