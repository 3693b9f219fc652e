"""plan(): which layers form which recompute regions (Megatron-Core semantics)."""
from __future__ import annotations

from typing import NamedTuple

from remat.config import RecomputeConfig


class Segment(NamedTuple):
    """Layers [start, stop); `checkpointed` regions keep only their input (or what the policy saves)."""
    start: int
    stop: int
    checkpointed: bool


def plan(n_layers: int, cfg: RecomputeConfig) -> tuple[Segment, ...]:
    """Split `n_layers` layers into segments per `cfg`.

    Args:
      n_layers: number of layers (>= 1).
      cfg: the recompute config; checked with `cfg.validate_for(n_layers)`.
    Returns:
      Segments tiling 0..n_layers in order.
    Example:
      >>> plan(8, RecomputeConfig(granularity="full", method="uniform", num_layers=3))
      (Segment(0, 3, True), Segment(3, 6, True), Segment(6, 8, True))
    """
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers={n_layers!r} must be a positive int")
    cfg.validate_for(n_layers)
    if cfg.granularity == "none":
        return (Segment(0, n_layers, False),)
    if cfg.layer_policies is not None:
        return tuple(Segment(i, i + 1, p is not None) for i, p in enumerate(cfg.layer_policies))
    if cfg.granularity == "selective" or cfg.method == "none":
        return tuple(Segment(i, i + 1, True) for i in range(n_layers))
    n = cfg.num_layers
    if cfg.method == "uniform":
        return tuple(Segment(i, min(i + n, n_layers), True) for i in range(0, n_layers, n))
    # block: the first n layers are each a region, the rest run without remat.
    segs = [Segment(i, i + 1, True) for i in range(n)]
    if n < n_layers:
        segs.append(Segment(n, n_layers, False))
    return tuple(segs)
