"""Flax Linen helpers: a layer stack grouped per `remat.plan`, and `remat_module`, a drop-in for `nn.remat`."""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
from flax.core import meta
import jax
import jax.numpy as jnp

from remat import policies as _policies
from remat.config import RecomputeConfig
from remat.checkpoint import checkpoint
from remat.stack import _select, _signature, apply_layers


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
        `parent=None` to build the layer template.
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
        template = self.layer(parent=None)
        L = self.n_layers
        names = ["h"] if self.scan else [f"h_{i}" for i in range(L)]
        if self.is_initializing():
            # One key per layer from the same stream in both layouts, so loop and scan initialize
            # identical weights (h_i == h[i]). Every collection the layer makes (params, batch_stats,
            # cache) is kept under the same name.
            keys = jax.random.split(self.make_rng("params"), L)
            init_one = lambda k: dict(template.init({"params": k, "dropout": k}, x, *args, **kwargs))  # noqa: E731
            if self.scan:  # boxed (partitioned) leaves get the layer axis, as nn.scan gives them
                made = [meta.add_axis(jax.vmap(init_one)(keys), 0, {meta.PARTITION_NAME: self.layer_axis_name})]
            else:
                made = [init_one(k) for k in keys]
            for name, v in zip(names, made):
                for col, tree in v.items():
                    if col == "params":
                        self.param(name, lambda rng, t=tree: t)
                    else:
                        self.variable(col, name, lambda t=tree: t)
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


def remat_module(module_cls, recompute: RecomputeConfig | str | None = None, *,
                 static_argnums: Sequence[int] = (), prevent_cse: bool = True):
    """`module_cls` whose calls are recompute regions of `remat.checkpoint` (the stacks' machinery).

    A drop-in for `nn.remat(module_cls, policy=..., static_argnums=...)`: the same class name, so
    parameter paths (`Block_0/...`) are unchanged. Each call after init runs the module through
    `remat.checkpoint` with all its variables, RNG keys and arguments as region inputs, so the
    backward's recomputation waits for its cotangent and the compiled temp falls (plain `nn.remat`
    may raise it on XLA:CPU; docs/BENCHMARKS.md). Mutable collections (`batch_stats`, `cache`,
    `intermediates` from `sow`) are returned by the region and written back.

    Args:
      module_cls: a Linen module class.
      recompute: a RecomputeConfig (granularity `none` returns `module_cls` unchanged; its policy,
        use_reentrant and determinism_check apply), a `remat.policies` name or JAX policy callable, or
        None: no remat, `module_cls` itself.
      static_argnums: Flax's convention (`nn.remat`): `self` is argument 0, the first call argument 1.
        (Non-array arguments, e.g. a Python bool, are constants anyway.)
      prevent_cse: passed to `jax.checkpoint`.
    Example:
      >>> class MyBlock(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x, deterministic):
      ...         return x + nn.Dropout(0.1, deterministic=deterministic)(nn.Dense(8)(x))
      >>> Block = remat_module(MyBlock, "full_remat", static_argnums=(2,))  # self, x, deterministic
      >>> variables = Block().init(jax.random.key(0), jnp.ones((2, 8)), True)
      >>> Block().apply(variables, jnp.ones((2, 8)), True).shape
      (2, 8)
      >>> remat_module(MyBlock, RecomputeConfig()) is MyBlock   # granularity none: unchanged
      True
    """
    if recompute is None:
        return module_cls
    if isinstance(recompute, RecomputeConfig):
        if not recompute.enabled:
            return module_cls
        opts = dict(policy=recompute.effective_policy(), use_reentrant=recompute.use_reentrant,
                    determinism_check=recompute.determinism_check)
    else:
        _policies.validate(recompute)
        opts = dict(policy=recompute)
    bad = [i for i in static_argnums if i < 1]
    if bad:
        raise ValueError(f"remat_module: static_argnums {bad}: Flax counts `self` as argument 0, so the first call "
                         f"argument is 1 (as in nn.remat)")
    static = tuple(i - 1 for i in static_argnums)
    base_call = module_cls.__call__

    def __call__(self, *args, **kwargs):
        if self.is_initializing():  # init is not differentiated: build the variables the usual way
            return base_call(self, *args, **kwargs)
        scope = self.scope
        variables = {c: v for c, v in self.variables.items()}
        keys = {n: self.make_rng(n) for n in sorted(scope.rngs)}
        mutable = scope.mutable
        template = self.clone(parent=None)

        def region(variables, keys, *args, **kwargs):
            out = nn.Module.apply(template, variables, *args, rngs=keys or None, mutable=mutable,
                                  method=base_call, **kwargs)
            return out if mutable is not False else (out, {})

        out, updates = checkpoint(region, variables, keys, *args, static_argnums=tuple(i + 2 for i in static),
                                  prevent_cse=prevent_cse, name="/".join(scope.path) or module_cls.__name__,
                                  **opts, **kwargs)
        for col, tree in updates.items():
            if self.is_mutable_collection(col):
                for name, value in tree.items():
                    scope.put_variable(col, name, value)
        return out

    return type(module_cls.__name__, (module_cls,), {"__call__": __call__, "__qualname__": module_cls.__qualname__,
                                                     "__module__": module_cls.__module__})


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
