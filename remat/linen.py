"""Flax Linen helpers: a layer stack grouped per `remat.plan`, and `remat_module`, a drop-in for `nn.remat`."""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import flax.linen as nn
from flax.core import lift, meta
import jax
import jax.numpy as jnp

from remat import policies as _policies
from remat.config import RecomputeConfig, check_region
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
                made = [meta.add_axis(jax.vmap(init_one)(keys), 0, {meta.PARTITION_NAME: self.layer_axis_name})]
            else:
                # NOTE: each layer is initialized on the previous one's output and that output is
                # the stack's: running the freshly made layers again would meet their own new
                # collections (a decode cache made for the full length, as lm1b/wmt initialize it,
                # fails Flax's cache shape check when run on it).
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


def _lifted_checkpoint(fn, variables=True, rngs=True, concrete=False, prevent_cse=True, static_argnums=(),
                       policy=None, **options):
    """`flax.core.lift.checkpoint` with `remat.checkpoint` in place of `jax.checkpoint`: Flax's own
    lifting (variables and RNG streams in and out of the region, mutable collections written back),
    the library's region underneath."""
    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
        static = jax.tree_util.tree_map(lambda i: i + 2, static_argnums)  # the two lifted groups lead
        if concrete:
            raise NotImplementedError("The concrete argument is deprecated (as in flax.linen.remat): use "
                                      "static_argnums instead")

        @functools.wraps(fn)
        def rematted(variable_groups, rng_groups, *args, **kwargs):
            scope = scope_fn(variable_groups, rng_groups)
            y = fn(scope, *args, **kwargs)
            return y, repack_fn(scope)

        region = checkpoint(rematted, static_argnums=static, prevent_cse=prevent_cse, policy=policy, **options)
        return region(variable_groups, rng_groups, *args, **kwargs)

    return lift.pack(inner, (variables,), (variables,), (rngs,), name="remat", enable_kwargs=True)


_lifted_checkpoint.__name__ = "checkpoint"


def remat_module(target, variables=True, rngs=True, concrete: bool = False, prevent_cse: bool = True,
                 static_argnums: int | Sequence[int] = (), policy=None, methods=None, *,
                 recompute: RecomputeConfig | None = None, use_reentrant: bool = False, determinism_check=None,
                 tie_to_cotangent: bool | None = None):
    """`nn.remat` on the library's regions: every form `nn.remat` takes, with `remat.checkpoint` underneath.

    A drop-in for `nn.remat(target, variables, rngs, concrete, prevent_cse, static_argnums, policy,
    methods)`: a Module class, or a method as a decorator (`@remat_module`,
    `@functools.partial(remat_module, static_argnums=(2,))` on `__call__`); a Module instance is
    refused with Flax's `TransformTargetError`. The lifting is Flax's own (`flax.core.lift.pack`),
    so variables, RNG streams (the same dropout masks as `nn.remat`, and as no remat),
    `setup`, mutable collections (`batch_stats`, `cache`, `sow`'s intermediates) and
    `static_argnums` behave as in `nn.remat` (Flax's convention: `self` is argument 0; arguments not
    listed are traced, a Python bool too). The region is `remat.checkpoint`, so the backward's
    recomputation waits for its cotangent where the compiler needs it and the compiled temp falls
    (plain `nn.remat` may raise it on XLA:CPU; docs/BENCHMARKS.md).

    Unlike `nn.remat`, the class keeps its name, so auto-named submodules keep the paths they have
    without remat (`Block_0`, where `nn.remat` names them `CheckpointBlock_0`).

    Args:
      target: a Linen Module class, or a Module method (decorator form).
      variables, rngs, concrete, prevent_cse, static_argnums, methods: as `nn.remat`.
      policy: a `remat.policies` name or a JAX policy callable (as `nn.remat`'s `policy`).
      recompute: a RecomputeConfig instead of `policy` (also accepted as the second positional
        argument, as are a policy name or callable, and None: `target` unchanged): granularity `none` returns `target` unchanged; its policy, use_reentrant and
        determinism_check apply. A config that groups layers (`uniform`, `block`, `every`,
        `segments`, `per_layer`) is refused: one module call is one region; group layers with
        `remat.linen.LayerStack`.
      use_reentrant, determinism_check, tie_to_cotangent: `remat.checkpoint`'s options.
    Example:
      >>> class MyBlock(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x, deterministic):
      ...         return x + nn.Dropout(0.1, deterministic=deterministic)(nn.Dense(8)(x))
      >>> Block = remat_module(MyBlock, policy="nothing_saveable", static_argnums=(2,))  # self, x, deterministic
      >>> variables = Block().init(jax.random.key(0), jnp.ones((2, 8)), True)
      >>> Block().apply(variables, jnp.ones((2, 8)), True).shape
      (2, 8)
      >>> remat_module(MyBlock, RecomputeConfig()) is MyBlock   # granularity none: unchanged
      True
    """
    if isinstance(variables, RecomputeConfig) or variables is None:  # the library's positional form
        if recompute is not None:
            raise TypeError("remat_module: a RecomputeConfig given twice (positionally and as recompute=)")
        recompute, variables = variables, True
        if recompute is None:
            return target
    if (isinstance(variables, str) and (_is_policy_name(variables))) or callable(variables):
        # the library's earlier positional form, remat_module(Block, "nothing_saveable"): no collection is
        # named like a policy, and Flax's collection filters are no callables
        if policy is not None:
            raise TypeError("remat_module: a policy given twice (positionally and as policy=)")
        policy, variables = variables, True
        _policies.validate(policy)
    options = dict(use_reentrant=use_reentrant, determinism_check=determinism_check,
                   tie_to_cotangent=tie_to_cotangent)
    if recompute is not None:
        if not recompute.enabled:
            return target
        if recompute.layers is not None:
            raise ValueError(
                f"remat_module: {recompute!r} groups layers into regions ({recompute.layers!r}), but "
                f"each call of one module is one region: group the layers with remat.linen.LayerStack(block, "
                f"n_layers, recompute), or pass a config without a layer spec (granularity full or selective)")
        if policy is not None:
            raise TypeError("remat_module: give the policy once, as policy= or inside recompute=")
        policy = None if recompute.use_reentrant else recompute.effective_policy()
        options.update(use_reentrant=recompute.use_reentrant, determinism_check=recompute.determinism_check)
    elif policy is not None:
        _policies.validate(policy)
    argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    bad = [i for i in argnums if i < 1]
    if bad:
        raise ValueError(f"remat_module: static_argnums {bad}: Flax counts `self` as argument 0, so the first call "
                         f"argument is 1 (as in nn.remat)")
    check_region(options["use_reentrant"], policy, options["determinism_check"])
    lifted = functools.partial(_lifted_checkpoint, **options)
    lifted.__name__ = "checkpoint"
    out = nn.transforms.lift_transform(lifted, target, variables, rngs, concrete, prevent_cse,
                                       tuple(i - 1 for i in argnums), policy, methods=methods)
    if isinstance(target, type):  # keep the class name: auto-named submodules keep their paths
        out.__name__, out.__qualname__ = target.__name__, target.__qualname__
        out.__module__ = target.__module__
    return out


def _is_policy_name(name: str) -> bool:
    try:
        _policies.validate(name)
    except ValueError:
        return False
    return True


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
