"""RecomputeConfig: Megatron-Core's activation-recompute settings, validated once."""
from __future__ import annotations

import dataclasses
from typing import Callable, Union

from remat import names as _names
from remat import policies as _policies
from remat import regions as _regions
from remat import errors as _errors
from remat.errors import RecomputeConfigError, is_int, lit, refuse
from remat.regions import parse_segments  # noqa: F401  (its home was here)

GRANULARITIES = ("none", "full", "selective")
METHODS = ("none", "uniform", "block")
DETERMINISM_CHECKS = (None, True, False, "structure", "values")


def check_region(use_reentrant: bool, policy, determinism_check, enabled: bool = True) -> None:
    """The rules for one recompute region's options, shared by `RecomputeConfig` and
    `remat.checkpoint` (one copy of the rules). Raises RecomputeConfigError."""
    if not isinstance(use_reentrant, bool):
        raise refuse("{use_reentrant} must be True or False", use_reentrant=use_reentrant, valid=(True, False))
    if use_reentrant and policy is not None:
        raise refuse("{use_reentrant} saves only the inputs, so {policy} has no effect; drop the {policy!n} or "
                     "{use_reentrant!n}", use_reentrant=use_reentrant, policy=policy)
    if not (determinism_check is None or isinstance(determinism_check, bool)
            or determinism_check in ("structure", "values")):
        raise refuse("{determinism_check} is not valid; use None (the check that applies), True, False, "
                     "'structure' or 'values'", determinism_check=determinism_check, valid=DETERMINISM_CHECKS)
    # determinism_check's rules: remat/check.py's docstring.
    if determinism_check not in (None, False) and enabled and not use_reentrant:
        raise refuse("{determinism_check} needs {use_reentrant=True} (jax.checkpoint traces once and recomputes "
                     "that same program, so only the reentrant path, which traces again, can differ); add "
                     "{use_reentrant=True} or leave {determinism_check!n} unset",
                     determinism_check=determinism_check, use_reentrant=use_reentrant, valid=(None, False))


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
        `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`); default `nothing_saveable` (nothing,
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
            raise refuse(f"{{recompute granularity}} is not valid; use one of {', '.join(GRANULARITIES)}",
                         granularity=g, valid=GRANULARITIES)
        if m not in METHODS:
            raise refuse(f"{{recompute method}} is not valid; use one of {', '.join(METHODS)}", method=m,
                         valid=METHODS)
        if not is_int(n):
            raise refuse("{recompute num_layers} must be an int", num_layers=n, valid="an int >= 1")
        method_layers = {"uniform": _regions.uniform, "block": _regions.block}[m](n) if m != "none" else None
        if g == "none" and m != "none":
            raise refuse("{recompute method} was given but {granularity} turns recompute off; set "
                         "{granularity=full} or drop the {method!n}", method=m, granularity=g)
        if g == "selective" and m != "none":
            raise refuse("{recompute method} applies to {granularity=full} only; selective recompute acts inside "
                         "every layer: use {method=none}", method=m, granularity=g)
        if m == "none" and n != 1:
            raise refuse("{recompute num_layers} is the N of {method=uniform} or {method=block}, and {method} would "
                         "ignore it; choose one of those methods, or leave {num_layers=1} (the default)",
                         num_layers=n, method=m, valid=(1,))
        for flag in ("use_reentrant", "offload_inputs"):
            if not isinstance(getattr(self, flag), bool):
                raise refuse(f"{{recompute {flag}}} must be True or False", **{flag: getattr(self, flag)},
                             valid=(True, False))
        if self.modules is not None:
            unknown = [x for x in self.modules if x not in _names.MODULES]
            if unknown or not self.modules:
                raise refuse(f"{{recompute modules}}: unknown {lit(unknown or 'empty list')}; valid modules: "
                             f"{', '.join(_names.MODULES)}", modules=self.modules, valid=_names.MODULES)
        self._check_ignored()
        if g == "selective" and self.modules is None:
            object.__setattr__(self, "modules", ("core_attn",))
        if self.policy is not None:
            try:
                _policies.validate(self.policy)
            except ValueError as e:
                raise refuse(f"{{recompute policy}}: {lit(e)}", policy=self.policy) from None
        if self.use_reentrant and g == "selective":
            raise refuse("{use_reentrant} cannot be combined with {granularity}: the reentrant path saves only "
                         "each region's inputs, so selective saving means nothing there; use {granularity=full} "
                         "with {use_reentrant!n}, or drop {use_reentrant!n}", use_reentrant=True, granularity=g)
        check_region(self.use_reentrant, self.policy, self.determinism_check, self.enabled)
        self._resolve_layers(method_layers)
        axis = self.shard_inputs
        if axis is not None:
            if not isinstance(axis, str):
                raise refuse("{recompute shard_inputs} must be a mesh axis name (a str)", shard_inputs=axis,
                             valid="a mesh axis name")
            if g == "none":
                raise refuse("{recompute shard_inputs} needs recompute on: it keeps the inputs of whole-layer "
                             "recompute regions, so it needs {granularity=full}", shard_inputs=axis,
                             granularity=g, valid="granularity 'full'")
            if g != "full":
                raise refuse(f"{{recompute shard_inputs}} keeps the inputs of whole-layer recompute regions: it "
                             f"needs {{granularity=full}}, not {lit(g)} (as Megatron's distribute_saved_activations)",
                             shard_inputs=axis, granularity=g, valid="granularity 'full'")
            if self.offload_inputs:
                raise refuse("{recompute shard_inputs!n} and {offload_inputs!n} both decide where region inputs "
                              "wait (sharded over a mesh axis, or in host memory); pass only one",
                             shard_inputs=axis, offload_inputs=True)

    def _check_ignored(self):
        """Refuse a setting that the granularity (or another setting) would ignore, naming both."""
        g = self.granularity
        shown_modules = None if self.modules is None else ",".join(self.modules)
        if g == "none":
            dc = self.determinism_check
            policy = None if self.policy is None else _Shown(self.policy)
            given = [(f, v) for f, v in (("policy", policy), ("modules", shown_modules),
                                         ("use_reentrant", True if self.use_reentrant else None),
                                         ("determinism_check", None if dc is False else dc),
                                         ("offload_inputs", True if self.offload_inputs else None))
                     if v is not None]
            if given:
                field, value = given[0]
                raise refuse(f"{{recompute {field}}} has no effect with {{granularity}} (recompute is off); set "
                             f"{{granularity=full}} (or 'selective'), or drop {{{field}!n}}",
                             **{field: value}, granularity=g)
        if g == "full" and self.modules is not None:
            raise refuse("{recompute modules} applies to {granularity=selective} only; {granularity} recomputes whole "
                         "layers: choose what a region saves with a {policy!n}, or use {granularity=selective}",
                         modules=shown_modules, granularity=g)
        if g == "selective" and self.modules is not None and self.policy is not None:
            raise refuse(f"{{recompute policy}} replaces the selective preset, so {{modules}} would be ignored; pass "
                         f"one of them (e.g. {{policy={'+'.join(self.modules)}}} is that preset)",
                         modules=shown_modules, policy=self.policy)

    def _resolve_layers(self, method_layers) -> None:
        """Check `layers` (Megatron's method/num_layers may spell the same value) and fill in the other
        spelling: `method`/`num_layers` for `uniform`/`block`, `layers` for a method."""
        layers, g = self.layers, self.granularity
        if layers is None:
            layers = method_layers
        elif not isinstance(layers, _regions.Layers):
            raise refuse("{layers} is not a region spec; use remat.uniform(n), remat.block(n), remat.every(k), "
                         "remat.segments(...), remat.count(n) or remat.per_layer(...)", layers=layers,
                         valid="a remat.regions spec")
        elif method_layers is not None and method_layers != layers:
            raise refuse("{recompute layers} and {method} each say which layers are regions; pass only one",
                         layers=layers, method=self.method)
        if layers is None:
            return
        if g != "full":
            raise refuse("{recompute layers} applies to {granularity=full} only; with {granularity} "
                         + ("recompute is off" if g == "none" else "each layer is a region"),
                         layers=layers, granularity=g, valid="granularity 'full'")
        if isinstance(layers, _regions.PerLayer):
            if self.use_reentrant or self.policy is not None:
                raise refuse("{recompute layers} (one policy per layer) needs no {policy!n} and no "
                             "{use_reentrant!n}: it already says what every layer does", layers=layers,
                             policy=self.policy, use_reentrant=self.use_reentrant)
            for i, p in enumerate(layers.policies):
                if p is not None:
                    try:
                        _policies.validate(p)
                    except ValueError as e:
                        raise refuse(f"{{layers!n}} per_layer policy [{i}]: {lit(e)}", layers=layers) from None
        object.__setattr__(self, "layers", layers)
        if isinstance(layers, (_regions.Uniform, _regions.Block)):
            object.__setattr__(self, "method", "uniform" if isinstance(layers, _regions.Uniform) else "block")
            object.__setattr__(self, "num_layers", layers.n)

    def __repr__(self):  # a policy callable shown as the JAX expression that builds it (policies.describe)
        shown = (f"{f.name}={_show(getattr(self, f.name))}" for f in dataclasses.fields(self) if f.repr)
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
          remat.errors.RecomputeConfigError: recompute_num_layers=5 exceeds n_layer=4...
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


class _Shown:
    """A value whose repr shows a policy callable as `remat.policies.describe` does (in a tuple too)."""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return _show(self.value)


def _show(value) -> str:
    """repr(value), with policy callables (also inside a tuple) as the JAX expression that builds them."""
    return _errors.show_policy(value)
