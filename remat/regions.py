"""Which layers are recompute regions: one value, `RecomputeConfig(layers=...)`.

Each spec knows how to split n layers into `Segment`s (`split`) and what it needs of n (`check`).
`RecomputeConfig` keeps exactly one (Megatron's `method`/`num_layers` spell `uniform`/`block`), so
two choices of the regions cannot be combined; without one, each layer is a region (Megatron's
method `none`).

| spec | regions | also spelled |
|---|---|---|
| `uniform(n)` | each run of n consecutive layers (the last may be shorter) | `method="uniform", num_layers=n` |
| `block(n)` | the first n layers, one region each; the rest are not rematerialized | `method="block", num_layers=n` |
| `every(k)` | layers 0, k, 2k, ..., one region each; the layers between are not | |
| `segments((0, 3), (3, 5))` | those half-open layer ranges; layers in none are not | `segments("0-3,3-5")` |
| `count(n)` | n contiguous regions of near-equal size (DeepSpeed's number_checkpoints) | |
| `per_layer((None, "mlp", ...))` | a policy per layer, None: not rematerialized | |

Example:
    >>> import remat
    >>> cfg = remat.RecomputeConfig(granularity="full", layers=remat.segments((0, 2)))
    >>> [tuple(s) for s in cfg.split(4)]
    [(0, 2, True), (2, 4, False)]
    >>> cfg == remat.RecomputeConfig(granularity="full", layers=remat.segments("0-2"))
    True
"""
from __future__ import annotations

import abc
import dataclasses
from typing import NamedTuple

from remat.errors import RecomputeConfigError, is_int, show

__all__ = ["Segment", "Layers", "Uniform", "Block", "Every", "Segments", "Count", "PerLayer", "uniform", "block",
           "every", "segments", "count", "per_layer", "parse_segments"]


class Segment(NamedTuple):
    """Layers [start, stop); `checkpointed` regions keep only their input (or what the policy saves)."""
    start: int
    stop: int
    checkpointed: bool


class Layers(abc.ABC):
    """Base of the specs. `field` names the spec's value in its errors (`RecomputeConfigError.field`);
    `value()` is that value."""
    field: str

    @abc.abstractmethod
    def split(self, n_layers: int) -> tuple[Segment, ...]:
        """The segments tiling 0..n_layers in order."""

    def check(self, n_layers: int) -> None:
        """RecomputeConfigError unless the spec fits a stack of `n_layers` layers."""

    def value(self):
        return getattr(self, dataclasses.fields(self)[0].name)

    def __repr__(self):
        return f"{self._name}({self.value()})"

    def _require_positive(self, meaning: str) -> None:
        v = self.value()
        if not is_int(v) or v < 1:
            raise RecomputeConfigError(self.field, f"must be an integer >= 1 (got {v!r}): {meaning}", v)


@dataclasses.dataclass(frozen=True, repr=False)
class _Megatron(Layers):
    """Megatron's methods: `n` (its `num_layers`) layers per region or checkpointed, at most n_layer."""
    n: int
    field = "num_layers"
    method = ""  # the Megatron method the spec is

    def __post_init__(self):
        if not is_int(self.n):
            raise RecomputeConfigError("num_layers", f"must be an int >= 1 (got {self.n!r})", self.n)
        if self.n < 1:
            what = "layers per region" if self.method == "uniform" else "checkpointed layers"
            raise RecomputeConfigError("num_layers", f"must be >= 1 (got {self.n}): the number of {what} of method "
                                       f"{self.method}", self.n)

    def __repr__(self):
        return f"{self.method}({self.n})"

    def check(self, n_layers):
        if self.n > n_layers:
            raise RecomputeConfigError("num_layers", f"{self.n} exceeds n_layer={n_layers}; use 1..{n_layers}", self.n)


class Uniform(_Megatron):
    """Each run of `n` consecutive layers is one region (Megatron's method `uniform`)."""
    method = "uniform"

    def split(self, n_layers):
        return tuple(Segment(i, min(i + self.n, n_layers), True) for i in range(0, n_layers, self.n))


class Block(_Megatron):
    """The first `n` layers are each a region; the rest run without remat (Megatron's method `block`)."""
    method = "block"

    def split(self, n_layers):
        segs = [Segment(i, i + 1, True) for i in range(self.n)]
        return tuple(segs + ([Segment(self.n, n_layers, False)] if self.n < n_layers else []))


@dataclasses.dataclass(frozen=True, repr=False)
class Every(Layers):
    """Layers 0, k, 2k, ... are each a region of one layer; the layers between them are not
    rematerialized (PyTorch/Megatron `checkpoint_every=k`)."""
    k: int
    field, _name = "every", "every"
    __post_init__ = lambda self: self._require_positive("every k-th layer is a region")  # noqa: E731

    def split(self, n_layers):
        segs = []
        for i in range(0, n_layers, self.k):
            segs.append(Segment(i, i + 1, True))
            if self.k > 1 and i + 1 < n_layers:
                segs.append(Segment(i + 1, min(i + self.k, n_layers), False))
        return tuple(segs)

    def check(self, n_layers):
        if self.k > n_layers:
            raise RecomputeConfigError("every", f"{self.k} exceeds n_layer={n_layers}; use 1..{n_layers}", self.k)


@dataclasses.dataclass(frozen=True, repr=False)
class Segments(Layers):
    """Explicit regions: half-open layer ranges ((start, stop), ...) in increasing order, not
    overlapping (the tutorial's ManualCheckpoint). Layers in no range are not rematerialized."""
    ranges: tuple
    field = "segments"

    def __post_init__(self):
        given = self.ranges
        if isinstance(given, str):
            object.__setattr__(self, "ranges", parse_segments(given))
        else:
            try:
                object.__setattr__(self, "ranges", tuple((a, b) for a, b in given))
            except (TypeError, ValueError):
                raise RecomputeConfigError("segments", f"must be (start, stop) pairs, e.g. ((0, 3), (3, 5)) or "
                                           f"'0-3,3-5' (got {given!r})", given) from None
        if not self.ranges:
            raise RecomputeConfigError("segments", "is empty; give at least one (start, stop) range, e.g. '0-3'",
                                       self.ranges)
        prev = 0
        for a, b in self.ranges:
            if not (is_int(a) and is_int(b)) or a < prev or b <= a:
                raise RecomputeConfigError("segments", f"({a!r}, {b!r}) is not valid; segments are half-open layer "
                                           "ranges start-stop with start < stop, in increasing order and not "
                                           "overlapping, e.g. 0-3,3-5", self.ranges)
            prev = b

    def __repr__(self):
        return f"segments({show(self.ranges)!r})"

    def split(self, n_layers):
        segs, at = [], 0
        for a, b in self.ranges:
            if a > at:
                segs.append(Segment(at, a, False))
            segs.append(Segment(a, b, True))
            at = b
        return tuple(segs + ([Segment(at, n_layers, False)] if at < n_layers else []))

    def check(self, n_layers):
        stop = self.ranges[-1][1]
        if stop > n_layers:
            raise RecomputeConfigError("segments", f"{show(self.ranges)} reaches layer {stop} but n_layer={n_layers}; "
                                       f"stops must be <= {n_layers}", self.ranges)


@dataclasses.dataclass(frozen=True, repr=False)
class Count(Layers):
    """`n` contiguous regions of near-equal size, the first L mod n one layer longer (DeepSpeed's
    `number_checkpoints`)."""
    n: int
    field, _name = "regions", "count"
    __post_init__ = lambda self: self._require_positive("the number of recompute regions")  # noqa: E731

    def split(self, n_layers):
        q, r = divmod(n_layers, self.n)
        stops = [(i + 1) * q + min(i + 1, r) for i in range(self.n)]
        return tuple(Segment(a, b, True) for a, b in zip([0] + stops[:-1], stops))

    def check(self, n_layers):
        if self.n > n_layers:
            raise RecomputeConfigError("regions", f"{self.n} exceeds n_layer={n_layers}; use 1..{n_layers} (the "
                                       "number of regions: DeepSpeed's number_checkpoints)", self.n)


@dataclasses.dataclass(frozen=True, repr=False)
class PerLayer(Layers):
    """One policy per layer (None: not rematerialized), each layer its own region: what
    `remat.plan_for_budget` chooses. The policies are checked by RecomputeConfig."""
    policies: tuple
    field = "layer_policies"

    def __post_init__(self):
        try:
            object.__setattr__(self, "policies", tuple(self.policies))
        except TypeError:
            raise RecomputeConfigError("layer_policies", f"must be a sequence of policies, one per layer (None: not "
                                       f"rematerialized), not {self.policies!r}", self.policies) from None

    def __repr__(self):
        return f"per_layer({show(self.policies)})"

    def split(self, n_layers):
        return tuple(Segment(i, i + 1, p is not None) for i, p in enumerate(self.policies))

    def check(self, n_layers):
        if len(self.policies) != n_layers:
            raise RecomputeConfigError("layer_policies", f"has {len(self.policies)} entries for n_layer={n_layers}; "
                                       "give one per layer", self.policies)


def uniform(n: int) -> Uniform:
    """Each run of `n` consecutive layers is one region (= `method="uniform", num_layers=n`).

    Example:
      >>> [tuple(s) for s in uniform(2).split(5)]
      [(0, 2, True), (2, 4, True), (4, 5, True)]
    """
    return Uniform(n)


def block(n: int) -> Block:
    """The first `n` layers are each a region, the rest are not rematerialized (= `method="block"`).

    Example:
      >>> [tuple(s) for s in block(2).split(4)]
      [(0, 1, True), (1, 2, True), (2, 4, False)]
    """
    return Block(n)


def every(k: int) -> Every:
    """Layers 0, k, 2k, ... are each a region; the layers between are not rematerialized.

    Example:
      >>> [tuple(s) for s in every(2).split(4)]
      [(0, 1, True), (1, 2, False), (2, 3, True), (3, 4, False)]
    """
    return Every(k)


def segments(*ranges) -> Segments:
    """Explicit regions: half-open layer ranges, or one string `"0-3,3-5"`.

    Example:
      >>> [tuple(s) for s in segments((0, 3), (3, 5)).split(6)]
      [(0, 3, True), (3, 5, True), (5, 6, False)]
      >>> segments("0-3,3-5") == segments((0, 3), (3, 5))
      True
    """
    return Segments(ranges[0] if len(ranges) == 1 and isinstance(ranges[0], str) else ranges)


def count(n: int) -> Count:
    """`n` contiguous regions of near-equal size (DeepSpeed's `number_checkpoints`).

    Example:
      >>> [tuple(s) for s in count(2).split(5)]
      [(0, 3, True), (3, 5, True)]
    """
    return Count(n)


def per_layer(policies) -> PerLayer:
    """A policy name or JAX policy per layer, None where a layer is not rematerialized.

    Example:
      >>> [tuple(s) for s in per_layer((None, "core_attn", "mlp")).split(3)]
      [(0, 1, False), (1, 2, True), (2, 3, True)]
    """
    return PerLayer(policies)


def parse_segments(spec: str) -> tuple:
    """'0-3,3-5' → ((0, 3), (3, 5)): half-open layer ranges start-stop.

    Example:
      >>> parse_segments("0-3,3-5")
      ((0, 3), (3, 5))
    """
    out = []
    for part in (p.strip() for p in spec.split(",")):
        a, dash, b = part.partition("-")
        if not dash or not _ascii_int(a) or not _ascii_int(b):
            raise RecomputeConfigError("segments", f"{part!r} is not START-STOP; give half-open layer ranges, e.g. "
                                       "0-3,3-5 (layers 0,1,2 and 3,4)", spec)
        out.append((int(a), int(b)))
    return tuple(out)


def _ascii_int(text: str) -> bool:
    """Digits 0-9 only (`str.isdigit` also takes '²' and '٣', which `int` reads or refuses)."""
    text = text.strip()
    return bool(text) and text.isascii() and text.isdigit()
