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
      >>> plan(8, RecomputeConfig(granularity="full", method="uniform", num_layers=3))[0]
      Segment(start=0, stop=3, checkpointed=True)
      >>> [tuple(s) for s in plan(6, RecomputeConfig(granularity="full", segments="0-3,3-5"))]
      [(0, 3, True), (3, 5, True), (5, 6, False)]
      >>> [tuple(s) for s in plan(5, RecomputeConfig(granularity="full", every=2))]
      [(0, 1, True), (1, 2, False), (2, 3, True), (3, 4, False), (4, 5, True)]
    """
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        raise ValueError(f"n_layers={n_layers!r} must be a positive int")
    cfg.validate_for(n_layers)
    if cfg.granularity == "none":
        return (Segment(0, n_layers, False),)
    if cfg.layer_policies is not None:
        return tuple(Segment(i, i + 1, p is not None) for i, p in enumerate(cfg.layer_policies))
    if cfg.segments is not None:  # explicit regions; the gaps between them are not rematerialized
        segs, at = [], 0
        for a, b in cfg.segments:
            if a > at:
                segs.append(Segment(at, a, False))
            segs.append(Segment(a, b, True))
            at = b
        if at < n_layers:
            segs.append(Segment(at, n_layers, False))
        return tuple(segs)
    if cfg.regions is not None:  # N contiguous regions; the first L mod N one layer longer
        q, r = divmod(n_layers, cfg.regions)
        stops = [(i + 1) * q + min(i + 1, r) for i in range(cfg.regions)]
        return tuple(Segment(a, b, True) for a, b in zip([0] + stops[:-1], stops))
    if cfg.every is not None:  # layers 0, k, 2k, ... are regions of one layer; the rest run plainly
        k, segs = cfg.every, []
        for i in range(0, n_layers, k):
            segs.append(Segment(i, i + 1, True))
            if k > 1 and i + 1 < n_layers:
                segs.append(Segment(i + 1, min(i + k, n_layers), False))
        return tuple(segs)
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
