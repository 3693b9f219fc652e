"""Flax Linen helpers: a layer stack grouped per `remat.plan`, and `nn.remat` with a config."""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat.config import RecomputeConfig
from remat.policies import get as _get_policy
from remat.stack import apply_layers


class LayerStack(nn.Module):
    """`n_layers` copies of a Linen layer, run and rematerialized per `recompute`.

    The layer is called as `layer(x, *args) -> x`. Parameters are `h_0 ... h_{L-1}` (loop) or one
    `h` with a leading layer axis (`scan=True`), whatever the recompute config, so checkpoints
    load under any setting. Dropout keys come from the `dropout` RNG stream, folded with the
    layer index, and are identical in the forward and the recomputation.

    Attributes:
      layer: a Linen module class or factory (e.g. `functools.partial(Block, cfg)`), called with
        `parent=None` to build the layer template.
      n_layers: number of layers.
      recompute: the RecomputeConfig.
      scan: run layers under `lax.scan` with stacked parameters.
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

    @nn.compact
    def __call__(self, x, *args):
        self.recompute.validate_for(self.n_layers)
        template = self.layer(parent=None)

        def init_one(rng):
            return template.init({"params": rng, "dropout": rng}, x, *args)["params"]

        # One key per layer from the same stream in both layouts, so loop and scan initialize
        # identical weights (h_i == h[i]).
        # (Outside init, Flax still traces the init functions to check shapes: any key will do.)
        keys = jax.random.split(self.make_rng("params"), self.n_layers) if self.is_initializing() else None
        pick = lambda rng: keys if keys is not None else jax.random.split(rng, self.n_layers)
        if self.scan:
            params = self.param("h", lambda rng: jax.vmap(init_one)(pick(rng)))
        else:
            params = [self.param(f"h_{i}", lambda rng, i=i: init_one(pick(rng)[i])) for i in range(self.n_layers)]
        keys = None
        if self.has_rng("dropout"):
            base = self.make_rng("dropout")
            keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(self.n_layers))

        def apply_layer(p, h, key, *a):
            return template.apply({"params": p}, h, *a, rngs=None if key is None else {"dropout": key})

        return apply_layers(apply_layer, params, x, self.recompute, keys=keys, args=args,
                            scan=self.scan, prevent_cse=self.prevent_cse)


def remat_module(module_cls, recompute: RecomputeConfig | str | None = None, *,
                 static_argnums: Sequence[int] = (), prevent_cse: bool = True):
    """`nn.remat(module_cls)` with a policy from a config or registry name.

    `static_argnums` count the call's own arguments from 0 (x is 0); Linen counts `self` as
    argument 0, so they are shifted by one here.

    Example:
      >>> class MyBlock(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x, deterministic):
      ...         return x + nn.Dropout(0.1, deterministic=deterministic)(nn.Dense(8)(x))
      >>> Block = remat_module(MyBlock, "core_attn", static_argnums=(1,))  # x, deterministic
      >>> variables = Block().init(jax.random.key(0), jnp.ones((2, 8)), True)
      >>> Block().apply(variables, jnp.ones((2, 8)), True).shape
      (2, 8)
    """
    if isinstance(recompute, RecomputeConfig):
        if recompute.use_reentrant:
            raise ValueError("remat_module wraps nn.remat (non-reentrant); for use_reentrant=True "
                             "use remat.linen.LayerStack")
        name = recompute.effective_policy()
    else:
        name = recompute
    policy = None if name is None else _get_policy(name)
    return nn.remat(module_cls, policy=policy, prevent_cse=prevent_cse,
                    static_argnums=tuple(i + 1 for i in static_argnums))
