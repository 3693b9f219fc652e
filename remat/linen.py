"""Flax Linen: `LayerStack` (layers grouped into regions per a RecomputeConfig), `remat_module`
(`nn.remat` taking the library's policy names; `partitioning_remat` in `flax.linen.partitioning.remat`'s
numbering), `tag_submodules` (a layer's submodule outputs tagged with their module paths, for a model
that tags nothing), and `stack_layers` / `unstack_layers` (a model's
per-layer variables to the stack's layout and back)."""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from remat import names as _names
from remat import policies as _policies
from remat.config import RecomputeConfig
from remat.stack import _check_selectors, _signature, _split, _stack_sides, apply_layers, stack_trees

__all__ = ["LayerStack", "remat_module", "partitioning_remat", "stack_layers", "tag_submodules", "unstack_layers"]


class LayerStack(nn.Module):
    """`n_layers` copies of a Linen layer, run and rematerialized per `recompute`.

    The layer is called as `layer(x, *args, **kwargs) -> x` (or `out(layer(...))`, see `out`).
    Variables are `h_0 ... h_{L-1}` (loop) or one `h` with a leading layer axis (`scan=True`) in every
    collection the layer has (params, batch_stats, cache), whatever the recompute config, so
    checkpoints load under any setting. Collections made mutable by `apply(..., mutable=...)` (a
    decode cache, batch_stats, sow's intermediates) are written back per layer (loop layout; `scan`
    refuses them). Dropout keys come from the `dropout` RNG stream, folded with the
    layer index, and are identical in the forward and the recomputation.

    Attributes:
      layer: a Linen module class or factory (e.g. `functools.partial(Block, cfg)`), called with
        `parent=None` to build the layer template, or a Module instance (`Block(cfg)`), cloned.
      n_layers: number of layers.
      recompute: the RecomputeConfig.
      scan: run layers under `lax.scan` with stacked parameters.
      layer_axis_name: under `scan`, the name of the leading layer axis added to partitioning
        metadata (`nn.with_logical_partitioning` / `nn.with_partitioning` boxes), as `nn.scan`'s
        `metadata_params={nn.PARTITION_NAME: ...}` does, so sharding rules see one name per axis.
      out: picks x out of what the layer returns, for layers returning more than x (e.g.
        `lambda y: y[1]` for `(cache, x)`); a layer returning anything but x without it raises,
        naming the layer and its signature.
      side: picks a per-layer value out of what the layer returns (e.g. `lambda y: y[1]` for
        `(x, attn_weights)`, with `out=lambda y: y[0]`; without `out`, `side` sees the layer's x):
        the call then returns `(x, sides)`, the values stacked along a leading layer axis.
    Example:
      >>> import functools
      >>> class Block(nn.Module):
      ...     width: int
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return x + nn.Dropout(0.1, deterministic=False)(nn.Dense(self.width)(x))
      >>> stack = LayerStack(functools.partial(Block, 8), 4, RecomputeConfig(granularity="full"))
      >>> x, key = jnp.ones((2, 8)), jax.random.key(0)
      >>> variables = stack.init({"params": key, "dropout": key}, x)
      >>> sorted(variables["params"])
      ['h_0', 'h_1', 'h_2', 'h_3']
      >>> stack.apply(variables, x, rngs={"dropout": key}).shape
      (2, 8)
      >>> hidden = LayerStack(functools.partial(Block, 8), 4, side=lambda x: x)   # each layer's x
      >>> [a.shape for a in hidden.apply(variables, x, rngs={"dropout": key})]
      [(2, 8), (4, 2, 8)]
    """
    layer: Callable[..., nn.Module]
    n_layers: int
    recompute: RecomputeConfig = RecomputeConfig()
    scan: bool = False
    prevent_cse: bool = True
    out: Callable | None = None
    layer_axis_name: str | None = "layers"
    side: Callable | None = None

    def __post_init__(self):
        _check_selectors("remat.linen.LayerStack", self.out, self.side)
        super().__post_init__()

    @nn.compact
    def __call__(self, x, *args, **kwargs):
        self.recompute.validate_for(self.n_layers)
        template = (self.layer.clone(parent=None) if isinstance(self.layer, nn.Module)
                    else self.layer(parent=None))
        L = self.n_layers
        names = ["h"] if self.scan else [f"h_{i}" for i in range(L)]
        if self.is_initializing():
            # One key per layer from the same stream in both layouts, so loop and scan initialize
            # identical weights (h_i == h[i]). Every collection the layer makes (params, batch_stats,
            # cache) is kept under the same name.
            keys = jax.random.split(self.make_rng("params"), L)
            init_one = lambda k: dict(template.init({"params": k, "dropout": k}, x, *args, **kwargs))  # noqa: E731
            first = None
            if self.scan:  # boxed (partitioned) leaves get the layer axis, as nn.scan gives them
                made = [nn.meta.add_axis(jax.vmap(init_one)(keys), 0, {nn.PARTITION_NAME: self.layer_axis_name})]
            else:
                # Each layer is initialized on the previous one's output, which is the stack's
                # (docs/architecture.md, Design notes: `linen.py` init).
                made, h, sides = [], x, []
                for i, k in enumerate(keys):
                    y, v = template.init_with_output({"params": k, "dropout": k}, h, *args, **kwargs)
                    made.append(dict(v))
                    h, s = _split(self.out, self.side, y, h, i, _signature(template), "remat.linen.LayerStack")
                    sides.append(s)
                first = h if self.side is None else (h, _stack_sides(sides, "remat.linen.LayerStack"))
            for name, v in zip(names, made):
                for col, tree in v.items():
                    if col == "params":
                        self.param(name, lambda rng, t=tree: t)
                    else:
                        self.variable(col, name, lambda t=tree: t)
            if first is not None:
                return first
        present = {c: t for c, t in self.variables.items()}
        layer_vars = [{c: t[n] for c, t in present.items() if n in t} for n in names]
        mutable = self.scope.mutable if not self.is_initializing() else False
        if mutable is not False and self.scan:
            raise ValueError(f"remat.linen.LayerStack(scan=True) cannot write collections back per layer (this call "
                             f"makes {mutable!r} mutable, e.g. a decode cache, batch_stats or sow's intermediates); "
                             f"use scan=False, or apply without mutable=")
        keys = None
        if self.has_rng("dropout"):
            base = self.make_rng("dropout")
            keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(L))
        signature, out, side, initializing = _signature(template), self.out, self.side, self.is_initializing()

        def apply_layer(v, h, ik, *a):
            i, key = ik if isinstance(ik, tuple) else (None, ik)
            *a, kw = a
            carried, upd = h if mutable is not False else (h, None)
            rngs = None if key is None else {"dropout": key}
            # (While initializing, a layer may write its collections, e.g. a cache, as it would in a
            # plain init; the variables kept are the ones its own init made.)
            with _layer(()):   # the template is applied as a root: its submodules' paths are the layer's
                y = template.apply(v, carried, *a, rngs=rngs, mutable=True if initializing else mutable, **kw)
            if initializing:
                y = y[0]
            elif mutable is not False:
                y, new = y
                upd = {**upd, i: dict(new)}
            y, s = _split(out, side, y, carried, i, signature, "remat.linen.LayerStack")
            y = (y, upd) if mutable is not False else y
            return y if side is None else (y, s)

        if self.scan:
            stacked, ks = layer_vars[0], keys
        else:  # the layer index rides with its key (a constant), so updates find their layer
            stacked, ks = layer_vars, [(i, None if keys is None else keys[i]) for i in range(L)]
        h = (x, {}) if mutable is not False else x
        # NOTE: `apply_layer` closes over `out` and `side` (the selectors); the reentrant backward
        # re-runs it after this call returns, so the stack's result must not rebind those names.
        result = apply_layers(apply_layer, stacked, h, self.recompute, keys=ks, args=args + (kwargs,),
                              scan=self.scan, prevent_cse=self.prevent_cse, collect=side is not None,
                              name=_where(self, type(template)))
        sides = None
        if side is not None:
            result, sides = result
            sides = sides if self.scan else _stack_sides(sides, "remat.linen.LayerStack")
        if mutable is False:
            return result if side is None else (result, sides)
        result, upd = result
        for i, new in upd.items():
            for col, tree in new.items():
                if self.is_mutable_collection(col) and col != "params":
                    self.put_variable(col, names[i], tree)
        return result if side is None else (result, sides)


def remat_module(target, variables=True, rngs=True, concrete: bool = False, prevent_cse: bool = True,
                 static_argnums: int | Sequence[int] = (), policy=None, methods=None, *,
                 static_argnames: str | Sequence[str] = (), recompute: RecomputeConfig | None = None):
    """`nn.remat` with the policy given by name or as a JAX policy callable, and static keywords.

    Takes every form and argument `nn.remat` takes (a Module class, a method as a decorator, a
    function taking a module first; `variables`, `rngs`, `concrete`, `prevent_cse`, `methods`;
    `static_argnums` counting `self` as 0) and returns what `nn.remat` returns, but for the class
    name: the class keeps its own, so auto-named submodules keep the paths they have without remat
    (`Block_0`, where `nn.remat` names them `CheckpointBlock_0`). Keyword arguments are static (Python
    values the body may branch on) when named in `static_argnames` or when they are a Python bool,
    None or str (`deterministic=True`, `init_cache=False`); every other keyword is traced, as in
    `nn.remat`.

    Args:
      target: a Linen Module class, a Module method (decorator form) or a function taking a module.
      variables, rngs, concrete, prevent_cse, static_argnums, methods: as `nn.remat`.
      policy: a `remat.policies` name or a JAX policy callable.
      static_argnames: keyword arguments passed as static values (hashable) whatever their type.
      recompute: a RecomputeConfig instead of `policy`: granularity `none` returns `target` itself,
        otherwise its `effective_policy()` is the policy. A config that groups layers or needs the
        library's own region (`use_reentrant`, a determinism check, offloaded or sharded inputs) is
        refused: use `remat.linen.LayerStack`.
    Example:
      >>> class MyBlock(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x, deterministic=True):
      ...         return x + nn.Dropout(0.1, deterministic=deterministic)(nn.Dense(8)(x))
      >>> Block = remat_module(MyBlock, policy="full")
      >>> variables = Block().init(jax.random.key(0), jnp.ones((2, 8)))
      >>> Block().apply(variables, jnp.ones((2, 8)), deterministic=True).shape  # a static keyword
      (2, 8)
      >>> remat_module(MyBlock, recompute=RecomputeConfig()) is MyBlock   # granularity none: unchanged
      True
    """
    if isinstance(variables, RecomputeConfig):
        raise TypeError(f"remat_module: the second argument is nn.remat's `variables` (a collection filter); "
                        f"pass the config as recompute={variables!r}")
    if recompute is not None:
        if not recompute.enabled:
            return target
        if policy is not None:
            raise TypeError("remat_module: give the policy once, as policy= or inside recompute=")
        _check_one_region(recompute)
        policy = recompute.effective_policy()
    argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    bad = [i for i in argnums if i < 1]
    if bad:
        raise ValueError(f"remat_module: static_argnums {bad}: Flax counts `self` as argument 0, so the first call "
                         f"argument is 1 (as in nn.remat)")
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    # the static keywords travel as argument 1 of the lifted function, so the user's numbers move by one
    lift = functools.partial(nn.remat, variables=variables, rngs=rngs, concrete=concrete, prevent_cse=prevent_cse,
                             static_argnums=(1, *(i + 1 for i in argnums)), policy=_policies.resolve(policy))
    if isinstance(target, nn.Module):  # an instance: nn.remat refuses it with Flax's own error
        return nn.remat(target, variables, rngs, concrete, prevent_cse, static_argnums, _policies.resolve(policy))
    if not isinstance(target, type):
        return _static_keywords(target, lift, names, argnums, policy)
    if not issubclass(target, nn.Module):
        raise TypeError(f"remat_module: {target!r} is not a flax.linen.Module class, method or function")
    wrapped = {m: _static_keywords(getattr(target, m), lift, names, argnums, policy)
               for m in (methods or ("__call__",))}
    cls = type(target.__name__, (target,), {**wrapped, "__qualname__": target.__qualname__,
                                            "__module__": target.__module__})
    _LAYER_CLASSES.add(cls)   # its calls are layers for tag_submodules
    return cls


def partitioning_remat(target, variables=True, rngs=True, concrete: bool = False, prevent_cse: bool = True,
                       static_argnums: int | Sequence[int] = (), policy=None, methods=None, *,
                       static_argnames: str | Sequence[str] = (), recompute: RecomputeConfig | None = None):
    """`remat_module` with `flax.linen.partitioning.remat`'s numbering: `static_argnums` counts the first
    call argument as 0 (not `self`), as Hugging Face's Flax models write it.

    Example:
      >>> class Layer(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x, deterministic):
      ...         return nn.Dropout(0.1, deterministic=deterministic)(nn.Dense(8)(x))
      >>> Checkpointed = partitioning_remat(Layer, static_argnums=(1,))  # deterministic: argument 1
      >>> x = jnp.ones((2, 8))
      >>> Checkpointed().apply(Checkpointed().init(jax.random.key(0), x, True), x, True).shape
      (2, 8)
    """
    argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    if any(i < 0 for i in argnums):
        raise ValueError(f"partitioning_remat: static_argnums {argnums}: the first call argument is 0")
    return remat_module(target, variables, rngs, concrete, prevent_cse, tuple(i + 1 for i in argnums), policy,
                        methods, static_argnames=static_argnames, recompute=recompute)


class _Layers(threading.local):
    """The module paths of the layers being called on this thread, innermost last."""

    def __init__(self):
        self.paths: list = []
        self.classes: tuple | None = None   # while tag_submodules is active: the `layers=` classes


_LAYERS = _Layers()
_LAYER_CLASSES: "weakref.WeakSet" = weakref.WeakSet()   # the classes remat_module made


@contextlib.contextmanager
def _layer(path: tuple):
    _LAYERS.paths.append(tuple(path))
    try:
        yield
    finally:
        _LAYERS.paths.pop()


def _relative(path: tuple) -> str | None:
    """The tag of a module at `path` called inside the innermost layer: its path below the layer,
    joined by '.'; None outside any layer, or for the layer itself."""
    if not _LAYERS.paths:
        return None
    layer = _LAYERS.paths[-1]
    if len(path) <= len(layer) or path[:len(layer)] != layer:
        return None
    return _names.path_tag(path[len(layer):])


@contextlib.contextmanager
def tag_submodules(layers: Sequence[type] = ()):
    """Tag the output of every submodule call inside a layer with the submodule's path below the layer.

    For a model that tags nothing: each floating array its submodules return inside a layer (every
    leaf of a tuple or pytree, under one name) gets `jax.ad_checkpoint.checkpoint_name(out, path)`,
    `path` the submodule's module path below the layer joined by '.' (`attn.c_attn`, `mlp.c_fc`;
    whitespace and `,=:+;` in a module name become `_`), and the name is registered
    (`remat.names.register`), so name-based policies (`save_names:attn.c_attn`) and the per-tag
    planner (`remat.plan_for_budget(..., target=..., trace_step=...)`) take them. A layer is a call
    of a class `remat_module` made, a `LayerStack`'s layer, or an instance of a class in `layers`
    (e.g. a block rematerialized with Flax's own `nn.remat`). Nothing outside the layers is tagged,
    so every layer carries the same names and none collides with the rest of the model. Values are
    unchanged (the tag is the identity); only `__call__` outputs are tagged, not other methods.

    It acts while a program is traced (Flax's `nn.intercept_methods`): enter it inside the function
    you jit, around forward and backward (or decorate the train step with it), since a program
    traced without it and cached by `jax.jit` stays untagged.

    Args:
      layers: Linen Module classes whose instances are layers too (beside `remat_module`'s classes
        and `LayerStack`'s layers).
    Example:
      >>> class Block(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return nn.Dense(4, name="c_proj")(jnp.tanh(nn.Dense(4, name="c_fc")(x)))
      >>> Layer = remat_module(Block, policy="full")
      >>> x = jnp.ones((2, 4))
      >>> v = Layer().init(jax.random.key(0), x)
      >>> from remat.policies import region_tags
      >>> with tag_submodules():
      ...     sorted(region_tags(lambda v: Layer().apply(v, x), v))
      ['c_fc', 'c_proj']
      >>> sorted(region_tags(lambda v: Layer().apply(v, x), v))   # outside it: the model as written
      []
      >>> "c_fc" in _names.known()
      True
    """
    extra = tuple(layers)
    bad = [c for c in extra if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise TypeError(f"tag_submodules: layers must be flax.linen.Module classes, got {bad!r}")
    outer = _LAYERS.classes
    _LAYERS.classes = (outer or ()) + extra
    try:
        if outer is not None:   # already tagging on this thread: one interceptor, so one tag per value
            yield
        else:
            with nn.intercept_methods(_tag_interceptor):
                yield
    finally:
        _LAYERS.classes = outer


def _tag_interceptor(next_fun, args, kwargs, context):
    """tag_submodules' method interceptor (Flax's protocol): a layer's call makes its path the one
    below which names are read; a submodule's `__call__` output inside a layer is tagged."""
    module = context.module
    path = tuple(module.path) if module.scope is not None else ()
    name = _relative(path) if context.method_name == "__call__" else None
    is_layer = type(module) in _LAYER_CLASSES or isinstance(module, _LAYERS.classes or ())
    with _layer(path) if is_layer else contextlib.nullcontext():
        out = next_fun(*args, **kwargs)
    if name is None:
        return out
    return _names.tag_tree(out, name)


def _static_keywords(fn: Callable, lift: Callable, names: tuple, argnums: tuple, policy=None) -> Callable:
    """`fn(module, *args, **kwargs)` under `lift` (nn.remat's function form), its static keywords
    (`names`, and Python bools, None and strings) passed as one hashable argument; `argnums`: the
    user's static_argnums, named when a traced value reaches a Python branch; `policy`: for the
    untagged-region warning (`_warn_untagged`)."""
    def body(module, static, *args, **kwargs):
        return fn(module, *args, **dict(static), **kwargs)
    body.__dict__.update(fn.__dict__)  # Flax's marks on the method (`compact`) hold inside the region
    lifted = lift(body)

    @functools.wraps(fn)
    def call(module, *args, **kwargs):
        static = tuple((k, v) for k, v in kwargs.items() if k in names or isinstance(v, (bool, str, type(None))))
        try:
            hash(static)
        except TypeError:
            k = next(k for k, v in static if not _hashable(v))
            raise TypeError(f"remat_module: static keyword {k}={kwargs[k]!r} is not hashable; pass a hashable value "
                            f"or leave {k!r} out of static_argnames") from None
        traced = {k: v for k, v in kwargs.items() if k not in dict(static)}
        try:
            out = lifted(module, static, *args, **traced)
        except jax.errors.TracerBoolConversionError as e:
            if not argnums:
                raise
            raise TypeError(
                f"remat_module: a traced value reached a Python branch in {type(module).__name__}; static_argnums="
                f"{argnums} count `self` as argument 0 (nn.remat's numbering). If they were written for "
                f"flax.linen.partitioning.remat (Hugging Face's Flax models), which counts the first call argument "
                f"as 0, use remat.linen.partitioning_remat or static_argnums={tuple(i + 1 for i in argnums)}. "
                f"JAX: {str(e).splitlines()[0]}") from e
        _warn_untagged(policy, fn, module, static, args, traced)
        return out
    call.__dict__.update(lifted.__dict__)  # Flax's marks, as on what nn.remat returns (`compact`, wrapped once)
    return call


def _where(module, cls, method: str = "__call__") -> str:
    """`Block at Model/blocks_0`: `cls` (and `method`, if not `__call__`), the root module's class
    and `module`'s path."""
    what = cls.__name__ + ("" if method == "__call__" else f".{method}")
    root = module
    while isinstance(root.parent, nn.Module):
        root = root.parent
    path = "/".join(module.path) if module.path else ""
    return f"{what} at {type(root).__name__}/{path}" if path and root is not module else what


def _warn_untagged(policy, fn, module, static, args, kwargs) -> None:
    """`remat.policies.warn_untagged` for one call of a remat_module region: once per module path,
    method, policy and input and variable avals; the body traced (without remat, on an unbound
    copy) once per class, method and avals."""
    if _policies.by_name(policy) is None or module.scope is None:
        return
    try:
        variables = module.variables
        region = _where(module, type(module), fn.__name__)
        key = _policies.region_key((fn, region, static), policy, args, kwargs, variables)
        program = _policies.region_key((fn, static), policy, args, kwargs, variables)
        if key is None:
            return
        unbound, variables = module.unbind()
        streams = tuple(module.scope.rngs)

        def body(v, a, kw):  # keys made inside: nothing is added to the caller's trace
            rngs = {name: jax.random.key(0) for name in streams}
            return unbound.apply(v, *a, method=fn, rngs=rngs, mutable=True, **dict(static), **kw)
        _policies.warn_untagged(policy, body, (variables, args, kwargs), region, key=key, program=program)
    except Exception:  # noqa: BLE001 - the warning is advice; the real call has run
        return


def _hashable(v) -> bool:
    try:
        hash(v)
        return True
    except TypeError:
        return False


def _check_one_region(recompute: RecomputeConfig) -> None:
    """Refuse a config `nn.remat` cannot express: layer grouping, or an option of the library's own region."""
    if recompute.layers is not None:
        raise ValueError(
            f"remat_module: {recompute!r} groups layers into regions ({recompute.layers!r}), but each call of one "
            f"module is one region: group the layers with remat.linen.LayerStack(block, n_layers, recompute), or "
            f"pass a config without a layer spec (granularity full or selective)")
    extra = {"use_reentrant": recompute.use_reentrant, "determinism_check": recompute.determinism_check,
             "offload_inputs": recompute.offload_inputs, "shard_inputs": recompute.shard_inputs}
    extra = {k: v for k, v in extra.items() if v not in (None, False)}
    if extra:
        field, value = next(iter(extra.items()))
        raise ValueError(
            f"remat_module: {field}={value!r} needs the library's own region, which nn.remat does not run; group "
            f"the layers with remat.linen.LayerStack(block, n_layers, recompute) (it runs remat.checkpoint), "
            f"or drop {field}")


def stack_layers(layers: Sequence, scan: bool = False) -> dict:
    """One collection of separately named layers, as a `LayerStack` keeps it.

    Moves a model's existing variables (e.g. `params["encoderdecoderblock_i"]`) under a stack:
    `{"h_0": ..., "h_{L-1}": ...}`, or with `scan=True` one `{"h": ...}` whose leaves have a leading
    layer axis. `unstack_layers` is the inverse.

    Example:
      >>> old = {f"block_{i}": {"w": jnp.full((2,), i)} for i in range(3)}
      >>> new = stack_layers([old[f"block_{i}"] for i in range(3)], scan=True)
      >>> new["h"]["w"].shape
      (3, 2)
      >>> [int(l["w"][0]) for l in unstack_layers(new)]
      [0, 1, 2]
    """
    layers = list(layers)
    if scan:
        return {"h": stack_trees(layers, "remat.linen.stack_layers", lambda *t: jnp.stack(t))}
    return {f"h_{i}": layer for i, layer in enumerate(layers)}


def unstack_layers(stacked) -> list:
    """The per-layer variables of a `LayerStack` collection (`h_0 ... h_{L-1}` or a stacked `h`),
    in layer order: the inverse of `stack_layers`."""
    if "h" in stacked:
        n = {np.shape(t)[:1] for t in jax.tree.leaves(stacked["h"])}
        if len(n) != 1 or n == {()}:
            raise ValueError("remat.linen.unstack_layers: the leaves under 'h' have no common leading layer axis "
                             f"(sizes {sorted(n)}): not a stack built with scan=True")
        return [jax.tree.map(lambda t, i=i: t[i], stacked["h"]) for i in range(n.pop()[0])]
    keys = sorted((k for k in stacked if k.startswith("h_")), key=lambda k: (len(k), k))
    if not keys or keys != [f"h_{i}" for i in range(len(keys))] or len(keys) != len(stacked):
        raise ValueError(f"remat.linen.unstack_layers: expected a LayerStack collection ('h' stacked, or h_0 ... "
                         f"h_(L-1)), got keys {sorted(stacked)}")
    return [stacked[k] for k in keys]
