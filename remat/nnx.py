"""Flax NNX helpers: a layer stack grouped and rematerialized per `remat.plan`."""
from __future__ import annotations

from typing import Sequence

from flax import nnx

from remat.config import RecomputeConfig
from remat.stack import apply_layers


class LayerStack(nnx.Module):
    """Run NNX layers (`layer(x, *args) -> x`) per a RecomputeConfig.

    Each layer is split into (graphdef, state); the states flow through `remat.apply_layers`, so
    checkpointed regions see explicit inputs (both the `jax.checkpoint` and the reentrant path).
    Layers must not mutate their state during the call (use deterministic dropout, or none).

    Example:
      >>> stack = LayerStack([Block(cfg, rngs=rngs) for _ in range(4)], RecomputeConfig(granularity="full"))
      >>> y = stack(x)
    """

    def __init__(self, layers: Sequence[nnx.Module], recompute: RecomputeConfig = RecomputeConfig(),
                 prevent_cse: bool = True):
        recompute.validate_for(len(layers))
        self.layers = nnx.List(list(layers))
        self.recompute = recompute
        self.prevent_cse = prevent_cse

    def __call__(self, x, *args):
        split = [nnx.split(layer) for layer in self.layers]
        graphdefs = [g for g, _ in split]

        # The layer index rides along as the per-layer "key" (a constant) so each layer finds
        # its graphdef; only the states are traced.
        def apply_layer(state, h, i, *a):
            return nnx.merge(graphdefs[i], state)(h, *a)

        return apply_layers(apply_layer, [s for _, s in split], x, self.recompute,
                            keys=list(range(len(split))), args=args, prevent_cse=self.prevent_cse)
