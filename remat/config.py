"""RecomputeConfig: Megatron-Core's activation-recompute settings, validated once."""
from __future__ import annotations

import dataclasses
from typing import Callable, Union

from remat import names as _names
from remat import policies as _policies
from remat import regions as _regions
from remat.errors import RecomputeConfigError, is_int, show

__all__ = ["RecomputeConfig", "RecomputeConfigError", "check_region", "GRANULARITIES", "METHODS",
           "DETERMINISM_CHECKS"]

GRANULARITIES = ("none", "full", "selective")
METHODS = ("none", "uniform", "block")
DETERMINISM_CHECKS = (None, True, False, "structure", "values")


def check_region(use_reentrant: bool, policy, determinism_check, enabled: bool = True) -> None:
    """The rules for one recompute region's options, shared by `RecomputeConfig` and
    `remat.checkpoint`. Raises RecomputeConfigError."""
    if not isinstance(use_reentrant, bool):
        raise RecomputeConfigError("use_reentrant", f"must be True or False (got {use_reentrant!r})", use_reentrant)
    if use_reentrant and policy is not None:
        raise RecomputeConfigError(
            "use_reentrant", f"the reentrant path saves only the inputs, so policy {show(policy)} has no "
            "effect; drop the policy or use_reentrant", use_reentrant, also=("policy",))
    if not (determinism_check is None or isinstance(determinism_check, bool)
            or determinism_check in ("structure", "values")):
        raise RecomputeConfigError(
            "determinism_check", f"{determinism_check!r} is not valid; use None (the check that applies), "
            "True, False, 'structure' or 'values'", determinism_check)
    # determinism_check's rules: remat/check.py's docstring.
    if determinism_check not in (None, False) and enabled and not use_reentrant:
        raise RecomputeConfigError(
            "determinism_check", f"{determinism_check!r} needs use_reentrant=True (jax.checkpoint traces once "
            "and recomputes that same program, so only the reentrant path, which traces again, can differ); "
            "add use_reentrant=True or leave determinism_check unset", determinism_check,
            also=("use_reentrant",))


@dataclasses.dataclass(frozen=True)
class RecomputeConfig:
    """How a stack of layers is rematerialized.

    Args:
      granularity: `none` (no remat), `full` (whole layers are recompute regions) or `selective`
        (every layer saves its tagged activations except those of `modules`).
      method: for `full` only. `none`: each layer is a region; `uniform`: each run of
        `num_layers` consecutive layers is one region; `block`: the first `num_layers` layers are
        regions, the rest are not rematerialized. (Megatron's spelling of `layers=remat.uniform(n)`
        and `layers=remat.block(n)`.)
      num_layers: the N of `uniform`/`block` (any other method takes only the default, 1).
      policy: what a region saves: a `remat.policies` name or a JAX policy callable (e.g.
        `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`); default `full` (nothing,
        `jax.checkpoint_policies.nothing_saveable`) for granularity `full` and the `modules` preset
        for `selective`. Not with `modules` (a policy replaces the preset), `use_reentrant` or
        granularity `none`.
      modules: selective sub-modules to recompute (`core_attn`, `mlp`, `norm`; a tuple or the string
        `"core_attn,mlp"`); granularity `selective` only, default `("core_attn",)`.
      use_reentrant: (a bool) recompute through a `jax.custom_vjp` that saves only region inputs,
        instead of `jax.checkpoint`. Granularity `full` only.
      determinism_check: what to compare between the forward and the recomputation: None (default,
        the check that applies), False, or with `use_reentrant=True` True, `"structure"`, `"values"`
        (the rules: `remat.check`).
      shard_inputs: a mesh axis name: each region keeps its input (B, T, C) sharded along T over
        that axis between forward and backward and all-gathers it before recomputing (Megatron's
        distribute_saved_activations). Granularity `full` (as in Megatron), not with
        `offload_inputs`. Needs a mesh context (`jax.set_mesh`).
      offload_inputs: keep each region's saved inputs in pinned host memory between the forward and
        the backward (DeepSpeed's cpu_checkpointing). On CPU it compiles and moves nothing.
      layers: which layers are regions, one `remat.regions` value: `remat.uniform(n)`,
        `remat.block(n)`, `remat.every(k)`, `remat.segments((0, 3), (3, 5))`, `remat.count(n)`,
        `remat.per_layer(policies)`; None (default): each layer is a region. Granularity `full`.
        `method`/`num_layers` are Megatron's spelling of `uniform(n)`/`block(n)`: either may be
        given (or both, when they agree), and both are filled in from the other.
    Every setting that would be ignored is refused (RecomputeConfigError naming both fields): a
    policy, modules, use_reentrant or a determinism check with granularity `none`, modules outside
    `selective` or beside a policy, num_layers without `uniform`/`block`, two choices of the regions.
    Example:
      >>> RecomputeConfig(granularity="full", method="uniform", num_layers=2)
      RecomputeConfig(granularity='full', method='uniform', num_layers=2, ...)
      >>> RecomputeConfig(granularity="full", layers=_regions.uniform(2)).method
      'uniform'
    """
    granularity: str = "none"  # one of GRANULARITIES
    method: str = "none"  # one of METHODS
    num_layers: int = 1
    policy: str | Callable | None = None
    modules: tuple[str, ...] | None = None
    use_reentrant: bool = False
    determinism_check: Union[bool, str, None] = None
    shard_inputs: str | None = None
    offload_inputs: bool = False
    layers: _regions.Layers | None = None

    def __post_init__(self):
        if isinstance(self.modules, str):  # accept "core_attn,mlp" from a CLI or a user
            object.__setattr__(self, "modules", tuple(m.strip() for m in self.modules.split(",") if m.strip()))
        elif self.modules is not None:
            object.__setattr__(self, "modules", tuple(self.modules))
        g, m, n = self.granularity, self.method, self.num_layers
        if g not in GRANULARITIES:
            raise RecomputeConfigError("granularity", f"{g!r} is not valid; use one of {', '.join(GRANULARITIES)}", g)
        if m not in METHODS:
            raise RecomputeConfigError("method", f"{m!r} is not valid; use one of {', '.join(METHODS)}", m)
        if not is_int(n):
            raise RecomputeConfigError("num_layers", f"must be an int >= 1 (got {n!r})", n)
        method_layers = {"uniform": _regions.uniform, "block": _regions.block}[m](n) if m != "none" else None
        if g == "none" and m != "none":
            raise RecomputeConfigError(
                "method", f"{m} has no effect with granularity none (recompute is off); set granularity "
                "full or drop the method", m)
        if g == "selective" and m != "none":
            raise RecomputeConfigError(
                "method", f"{m} applies to granularity full only; selective recompute acts inside every "
                "layer: leave method none", m)
        if m == "none" and n != 1:
            raise RecomputeConfigError(
                "num_layers", f"{n} is the N of method uniform or block, which method none would ignore; "
                "choose one of those methods, or leave num_layers 1 (the default)", n, also=("method",))
        for flag in ("use_reentrant", "offload_inputs"):
            if not isinstance(getattr(self, flag), bool):
                raise RecomputeConfigError(
                    flag, f"must be True or False (got {getattr(self, flag)!r})", getattr(self, flag))
        if self.modules is not None:
            unknown = [x for x in self.modules if x not in _names.MODULES]
            if unknown or not self.modules:
                raise RecomputeConfigError(
                    "modules", f"unknown {unknown or 'empty list'}; valid modules: "
                    f"{', '.join(_names.MODULES)}", self.modules)
        self._check_ignored()
        if g == "selective" and self.modules is None:
            object.__setattr__(self, "modules", ("core_attn",))
        if self.policy is not None:
            try:
                _policies.validate(self.policy)
            except ValueError as e:
                raise RecomputeConfigError("policy", str(e), self.policy) from None
        if self.use_reentrant and g == "selective":
            raise RecomputeConfigError(
                "use_reentrant", "cannot be combined with granularity selective: the reentrant path saves "
                "only each region's inputs, so selective saving means nothing there; use granularity full "
                "with use_reentrant, or drop use_reentrant", True)
        check_region(self.use_reentrant, self.policy, self.determinism_check, self.enabled)
        self._resolve_layers(method_layers)
        axis = self.shard_inputs
        if axis is not None:
            if not isinstance(axis, str):
                raise RecomputeConfigError("shard_inputs", f"must be a mesh axis name (a str), not {axis!r}", axis)
            if g != "full":
                raise RecomputeConfigError(
                    "shard_inputs", f"keeps the inputs of whole-layer recompute regions, so it needs "
                    f"granularity full, not {g} (as Megatron's distribute_saved_activations)", axis)
            if self.offload_inputs:
                raise RecomputeConfigError(
                    "shard_inputs", f"{axis!r} keeps region inputs sharded over a mesh axis, and "
                    "offload_inputs keeps them in host memory; pass only one", axis, also=("offload_inputs",))

    def _check_ignored(self):
        """Refuse a setting that the granularity (or another setting) would ignore, naming both."""
        g = self.granularity
        if g == "none":
            dc = self.determinism_check
            given = [(f, v) for f, v in (("policy", self.policy), ("modules", self.modules),
                                         ("use_reentrant", True if self.use_reentrant else None),
                                         ("determinism_check", None if dc is False else dc),
                                         ("offload_inputs", True if self.offload_inputs else None))
                     if v is not None]
            if given:
                field, value = given[0]
                raise RecomputeConfigError(
                    field, f"{show(value)} has no effect with granularity none (recompute is off); set "
                    f"granularity full (or selective), or drop {field}", value)
        if g == "full" and self.modules is not None:
            raise RecomputeConfigError(
                "modules", f"{','.join(self.modules)} applies to granularity selective only; granularity full "
                "recomputes whole layers: choose what a region saves with a policy, or use granularity "
                "selective", self.modules)
        if g == "selective" and self.modules is not None and self.policy is not None:
            raise RecomputeConfigError(
                "policy", f"{show(self.policy)} replaces the selective preset, so modules "
                f"{','.join(self.modules)} would be ignored; pass one of them (policy "
                f"{'+'.join(self.modules)!r} is that preset)", self.policy, also=("modules",))

    def _resolve_layers(self, method_layers) -> None:
        """Check `layers` (Megatron's method/num_layers may spell the same value) and fill in the other
        spelling: `method`/`num_layers` for `uniform`/`block`, `layers` for a method."""
        layers, g = self.layers, self.granularity
        if layers is None:
            layers = method_layers
        elif not isinstance(layers, _regions.Layers):
            raise RecomputeConfigError(
                "layers", f"{layers!r} is not a region spec; use remat.uniform(n), remat.block(n), "
                "remat.every(k), remat.segments(...), remat.count(n) or remat.per_layer(...)", layers)
        elif method_layers is not None and method_layers != layers:
            raise RecomputeConfigError(
                "layers", f"{layers!r} and method {self.method} each say which layers are regions; pass only "
                "one", layers, also=("method",))
        if layers is None:
            return
        if g != "full":
            raise RecomputeConfigError(
                "layers", f"{layers!r} applies to granularity full only; with granularity {g} "
                + ("recompute is off" if g == "none" else "each layer is a region"), layers)
        if isinstance(layers, _regions.PerLayer):
            if self.use_reentrant or self.policy is not None:
                raise RecomputeConfigError(
                    "layers", "per_layer (one policy per layer) needs no policy and no use_reentrant: it "
                    "already says what every layer does", layers,
                    also=("use_reentrant",) if self.use_reentrant else ("policy",))
            for i, p in enumerate(layers.policies):
                if p is not None:
                    try:
                        _policies.validate(p)
                    except ValueError as e:
                        raise RecomputeConfigError("layers", f"per_layer policy [{i}]: {e}", layers) from None
        object.__setattr__(self, "layers", layers)
        if isinstance(layers, (_regions.Uniform, _regions.Block)):
            object.__setattr__(self, "method", "uniform" if isinstance(layers, _regions.Uniform) else "block")
            object.__setattr__(self, "num_layers", layers.n)

    def __repr__(self):  # a policy callable shown as the JAX expression that builds it (policies.describe)
        shown = (f"{f.name}={show(getattr(self, f.name))}" for f in dataclasses.fields(self) if f.repr)
        return f"{type(self).__name__}({', '.join(shown)})"

    @property
    def enabled(self) -> bool:
        return self.granularity != "none"

    def effective_policy(self, layer: int | None = None):
        """The policy (a name or a JAX policy callable) the region starting at `layer` uses (None when
        recompute is off or reentrant); `remat.policies.describe` prints it."""
        if self.granularity == "none" or self.use_reentrant:
            return None
        if isinstance(self.layers, _regions.PerLayer):
            return None if layer is None else self.layers.policies[layer]
        if self.policy is not None:
            return self.policy
        return _policies.NOTHING if self.granularity == "full" else "+".join(self.modules)

    def validate_for(self, n_layers: int) -> "RecomputeConfig":
        """Check the config against a model with `n_layers` layers; returns self.

        Example:
          >>> RecomputeConfig(granularity="full", method="block", num_layers=2).validate_for(4)
          RecomputeConfig(granularity='full', method='block', num_layers=2, ...)
          >>> RecomputeConfig(granularity="full", method="block", num_layers=5).validate_for(4)
          Traceback (most recent call last):
          remat.errors.RecomputeConfigError: num_layers: 5 exceeds n_layer=4; use 1..4
        """
        if self.layers is not None:
            self.layers.check(n_layers)
        return self

    def split(self, n_layers: int) -> tuple["_regions.Segment", ...]:
        """Which layers form which regions: segments tiling 0..n_layers in order (checked with
        `validate_for`). Recompute off is one plain segment; no layer spec is a region per layer.

        Example:
          >>> RecomputeConfig(granularity="full", method="uniform", num_layers=3).split(8)[0]
          Segment(start=0, stop=3, checkpointed=True)
          >>> [tuple(s) for s in RecomputeConfig(granularity="full", layers=_regions.every(2)).split(5)]
          [(0, 1, True), (1, 2, False), (2, 3, True), (3, 4, False), (4, 5, True)]
        """
        if not is_int(n_layers) or n_layers < 1:
            raise ValueError(f"n_layers={n_layers!r} must be a positive int")
        self.validate_for(n_layers)
        if not self.enabled:
            return (_regions.Segment(0, n_layers, False),)
        if self.layers is None:
            return tuple(_regions.Segment(i, i + 1, True) for i in range(n_layers))
        return self.layers.split(n_layers)

