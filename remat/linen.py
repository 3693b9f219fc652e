"""Flax Linen: `LayerStack` (layers grouped into regions per a RecomputeConfig), `remat_module`
(`nn.remat` taking the library's policy names), and `stack_layers` / `unstack_layers` (a model's
per-layer variables to the stack's layout and back)."""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat import policies as _policies
from remat.config import RecomputeConfig
from remat.stack import _select, _signature, apply_layers

__all__ = ["LayerStack", "remat_module", "stack_layers", "unstack_layers"]


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
    """
    layer: Callable[..., nn.Module]
    n_layers: int
    recompute: RecomputeConfig = RecomputeConfig()
    scan: bool = False
    prevent_cse: bool = True
    out: Callable | None = None
    layer_axis_name: str | None = "layers"

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
                made, h = [], x
                for i, k in enumerate(keys):
                    y, v = template.init_with_output({"params": k, "dropout": k}, h, *args, **kwargs)
                    made.append(dict(v))
                    h = _select(self.out, y, h, i, _signature(template))
                first = h
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
        signature, out, initializing = _signature(template), self.out, self.is_initializing()

        def apply_layer(v, h, ik, *a):
            i, key = ik if isinstance(ik, tuple) else (None, ik)
            *a, kw = a
            carried, upd = h if mutable is not False else (h, None)
            rngs = None if key is None else {"dropout": key}
            # (While initializing, a layer may write its collections, e.g. a cache, as it would in a
            # plain init; the variables kept are the ones its own init made.)
            y = template.apply(v, carried, *a, rngs=rngs, mutable=True if initializing else mutable, **kw)
            if initializing:
                y = y[0]
            elif mutable is not False:
                y, new = y
                upd = {**upd, i: dict(new)}
            y = _select(out, y, carried, i, signature)
            return (y, upd) if mutable is not False else y

        if self.scan:
            stacked, ks = layer_vars[0], keys
        else:  # the layer index rides with its key (a constant), so updates find their layer
            stacked, ks = layer_vars, [(i, None if keys is None else keys[i]) for i in range(L)]
        h = (x, {}) if mutable is not False else x
        # NOTE: `apply_layer` closes over `out` (the selector); the reentrant backward re-runs it
        # after this call returns, so the stack's result must not rebind that name.
        result = apply_layers(apply_layer, stacked, h, self.recompute, keys=ks, args=args + (kwargs,),
                              scan=self.scan, prevent_cse=self.prevent_cse)
        if mutable is False:
            return result
        result, upd = result
        for i, new in upd.items():
            for col, tree in new.items():
                if self.is_mutable_collection(col) and col != "params":
                    self.put_variable(col, names[i], tree)
        return result


def remat_module(target, variables=True, rngs=True, concrete: bool = False, prevent_cse: bool = True,
                 static_argnums: int | Sequence[int] = (), policy=None, methods=None, *,
                 recompute: RecomputeConfig | None = None):
    """`nn.remat` with the policy given by name or as a JAX policy callable.

    Takes every form and argument `nn.remat` takes (a Module class, a method as a decorator, a
    function taking a module first; `variables`, `rngs`, `concrete`, `prevent_cse`, `methods`;
    `static_argnums` counting `self` as 0) and returns what `nn.remat` returns, but for the class
    name: the class keeps its own, so auto-named submodules keep the paths they have without remat
    (`Block_0`, where `nn.remat` names them `CheckpointBlock_0`).

    Args:
      target: a Linen Module class, a Module method (decorator form) or a function taking a module.
      variables, rngs, concrete, prevent_cse, static_argnums, methods: as `nn.remat`.
      policy: a `remat.policies` name or a JAX policy callable.
      recompute: a RecomputeConfig instead of `policy`: granularity `none` returns `target` itself,
        otherwise its `effective_policy()` is the policy. A config that groups layers or needs the
        library's own region (`use_reentrant`, a determinism check, offloaded or sharded inputs) is
        refused: use `remat.linen.LayerStack`.
    Example:
      >>> class MyBlock(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x, deterministic):
      ...         return x + nn.Dropout(0.1, deterministic=deterministic)(nn.Dense(8)(x))
      >>> Block = remat_module(MyBlock, policy="full", static_argnums=(2,))  # self, x, deterministic
      >>> variables = Block().init(jax.random.key(0), jnp.ones((2, 8)), True)
      >>> Block().apply(variables, jnp.ones((2, 8)), True).shape
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
    out = nn.remat(target, variables, rngs, concrete, prevent_cse, static_argnums, _policies.resolve(policy),
                   methods)
    if isinstance(target, type):
        out.__name__, out.__qualname__, out.__module__ = target.__name__, target.__qualname__, target.__module__
    return out


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
        return {"h": jax.tree.map(lambda *t: jnp.stack(t), *layers)}
    return {f"h_{i}": layer for i, layer in enumerate(layers)}


def unstack_layers(stacked) -> list:
    """The per-layer variables of a `LayerStack` collection (`h_0 ... h_{L-1}` or a stacked `h`),
    in layer order: the inverse of `stack_layers`."""
    if "h" in stacked:
        n = jax.tree.leaves(stacked["h"])[0].shape[0]
        return [jax.tree.map(lambda t, i=i: t[i], stacked["h"]) for i in range(n)]
    return [stacked[f"h_{i}"] for i in range(len([k for k in stacked if k.startswith("h_")]))]
