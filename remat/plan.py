"""plan(): which layers form which recompute regions (Megatron-Core semantics)."""
from __future__ import annotations

from remat.config import RecomputeConfig
from remat.regions import Segment, every, segments  # noqa: F401  (the doctests use them)

__all__ = ["Segment", "plan"]


def plan(n_layers: int, cfg: RecomputeConfig) -> tuple[Segment, ...]:
    """Split `n_layers` layers into segments per `cfg` (its `layers` spec; see `remat.regions`).

    Args:
      n_layers: number of layers (>= 1).
      cfg: the recompute config; checked with `cfg.validate_for(n_layers)`.
    Returns:
      Segments tiling 0..n_layers in order.
    Example:
      >>> plan(8, RecomputeConfig(granularity="full", method="uniform", num_layers=3))[0]
      Segment(start=0, stop=3, checkpointed=True)
      >>> [tuple(s) for s in plan(6, RecomputeConfig(granularity="full", layers=segments("0-3,3-5")))]
      [(0, 3, True), (3, 5, True), (5, 6, False)]
      >>> [tuple(s) for s in plan(5, RecomputeConfig(granularity="full", layers=every(2)))]
      [(0, 1, True), (1, 2, False), (2, 3, True), (3, 4, False), (4, 5, True)]
    """
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        raise ValueError(f"n_layers={n_layers!r} must be a positive int")
    cfg.validate_for(n_layers)
    if not cfg.enabled:
        return (Segment(0, n_layers, False),)
    if cfg.layers is None:  # Megatron's method none (and selective): each layer is a region
        return tuple(Segment(i, i + 1, True) for i in range(n_layers))
    return cfg.layers.split(n_layers)
