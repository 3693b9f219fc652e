"""RecomputeConfig: Megatron-Core's activation-recompute settings, validated once."""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal, Union

from remat import names as _names
from remat import policies as _policies

GRANULARITIES = ("none", "full", "selective")
METHODS = ("none", "uniform", "block")
DETERMINISM_CHECKS = (True, False, "structure", "values")


class RecomputeConfigError(ValueError):
    """A bad recompute setting. `fields` names the RecomputeConfig field(s) at fault, so a command
    line can name its flag (`remat_lm.training.flags.flag_error`) without validating the settings again."""

    def __init__(self, fields, message: str):
        super().__init__(message)
        self.fields = (fields,) if isinstance(fields, str) else tuple(fields)


def check_region(use_reentrant: bool, policy, determinism_check, enabled: bool = True) -> None:
    """The rules for one recompute region's options, shared by `RecomputeConfig` and
    `remat.checkpoint` (one copy of the rules). Raises RecomputeConfigError."""
    if not isinstance(use_reentrant, bool):
        raise RecomputeConfigError("use_reentrant", f"use_reentrant={use_reentrant!r} must be True or False")
    if use_reentrant and policy is not None:
        raise RecomputeConfigError(("use_reentrant", "policy"), f"use_reentrant=True saves only the inputs, so "
                                   f"policy={_show(policy)} has no effect; drop the policy or use_reentrant")
    if not (isinstance(determinism_check, bool) or determinism_check in ("structure", "values")):
        raise RecomputeConfigError("determinism_check", f"determinism_check={determinism_check!r} is not valid; use "
                                   f"True, False, 'structure' or 'values'")
    # NOTE: jax.checkpoint (the non-reentrant path) traces the function once and recomputes that very
    # program, so there is no second trace whose program or values could differ: "structure" and
    # "values" cannot apply there and are refused rather than ignored. True (the default) is accepted
    # everywhere: it checks what can differ, which there is nothing.
    if isinstance(determinism_check, str) and enabled and not use_reentrant:
        raise RecomputeConfigError(("determinism_check", "use_reentrant"),
                                   f"determinism_check={determinism_check!r} needs use_reentrant=True (jax.checkpoint "
                                   "traces once and recomputes that same program, so only the reentrant path, which "
                                   "traces again, can differ); add use_reentrant=True or drop the check")


@dataclasses.dataclass(frozen=True)
class RecomputeConfig:
    """How a stack of layers is rematerialized.

    Args:
      granularity: `none` (no remat), `full` (whole layers are recompute regions) or `selective`
        (every layer saves its tagged activations except those of `modules`).
      method: for `full` only. `none`: each layer is a region; `uniform`: each run of
        `num_layers` consecutive layers is one region; `block`: the first `num_layers` layers are
        regions, the rest are not rematerialized.
      num_layers: the N of `uniform`/`block` (any other method takes only the default, 1).
      policy: what a region saves: a `remat.policies` name or a JAX policy callable (e.g.
        `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`); default `full_remat` (nothing,
        `jax.checkpoint_policies.nothing_saveable`) for granularity `full` and the `modules` preset
        for `selective`. Not with `modules` (a policy replaces the preset), `use_reentrant` or
        granularity `none`.
      modules: selective sub-modules to recompute (`core_attn`, `mlp`, `norm`; a tuple or the string
        `"core_attn,mlp"`); granularity `selective` only, default `("core_attn",)`.
      use_reentrant: (a bool) recompute through a `jax.custom_vjp` that saves only region inputs,
        instead of `jax.checkpoint`. Granularity `full` only.
      layer_policies: one policy (a name or a JAX policy callable; None: not rematerialized) per
        layer, for granularity `full` with method `none`: what `remat.plan_for_budget` chooses.
        Overrides `policy`.
      segments: explicit recompute regions, the tutorial's `ManualCheckpoint`: half-open layer ranges
        `((start, stop), ...)` in increasing order, not overlapping (e.g. `((0, 3), (3, 5))`: layers
        0-2 form one region, layers 3-4 another). Layers in no segment (gaps) are not
        rematerialized. Also accepted as the CLI string `"0-3,3-5"`. Granularity `full`, method `none`.
      every: checkpoint every k-th layer (Megatron/PyTorch `checkpoint_every=k`): layers 0, k, 2k, ...
        are each a recompute region (of one layer); the layers between them are not
        rematerialized. `every=1` is the same as method `none`. Granularity `full`, method `none`.
      regions: split the layers into this many contiguous recompute regions of near-equal size (the
        first L mod N have one layer more; DeepSpeed's `number_checkpoints`). Granularity `full`,
        method `none`.
      offload_inputs: keep each region's saved inputs in pinned host memory between the forward and
        the backward (DeepSpeed's `cpu_checkpointing`). On CPU it compiles and moves nothing.
      shard_saved_axis: a mesh axis name: each region keeps its input (B, T, C) sharded along T over
        that axis between forward and backward and all-gathers it before recomputing (Megatron's
        distribute_saved_activations). Needs a mesh context (`jax.set_mesh`).
      determinism_check: compare the recomputation's output shapes/dtypes/shardings with the
        forward's at trace time (`True`), also its traced program (`"structure"`: operations, shapes,
        dtypes, literal and constant values; see `remat.check.fingerprint`), also its values at run
        time (`"values"`, for debugging), or not (`False`). `"structure"` and `"values"` need
        `use_reentrant=True`: `jax.checkpoint` traces once, so nothing else can differ.
    Every setting that would be ignored is refused (RecomputeConfigError naming both fields): a
    policy, modules, use_reentrant or a determinism check with granularity `none`, modules outside
    `selective` or beside a policy, num_layers without `uniform`/`block`.
    Example:
      >>> RecomputeConfig(granularity="full", method="uniform", num_layers=2)
      RecomputeConfig(granularity='full', method='uniform', num_layers=2, ...)
    """
    granularity: Literal["none", "full", "selective"] = "none"
    method: Literal["none", "uniform", "block"] = "none"
    num_layers: int = 1
    policy: str | Callable | None = None
    modules: tuple[str, ...] | None = None
    use_reentrant: bool = False
    determinism_check: Union[bool, str] = True
    layer_policies: tuple | None = None
    shard_saved_axis: str | None = None
    segments: tuple | None = None
    every: int | None = None
    regions: int | None = None
    offload_inputs: bool = False

    def __post_init__(self):
        if isinstance(self.modules, str):  # accept "core_attn,mlp" from a CLI or a user
            object.__setattr__(self, "modules", tuple(m.strip() for m in self.modules.split(",") if m.strip()))
        elif self.modules is not None:
            object.__setattr__(self, "modules", tuple(self.modules))
        g, m = self.granularity, self.method
        if g not in GRANULARITIES:
            raise RecomputeConfigError("granularity", f"recompute granularity={g!r} is not valid; use one of "
                                       f"{', '.join(GRANULARITIES)}")
        if m not in METHODS:
            raise RecomputeConfigError("method", f"recompute method={m!r} is not valid; use one of "
                                       f"{', '.join(METHODS)}")
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool):
            raise RecomputeConfigError("num_layers", f"recompute num_layers={self.num_layers!r} must be an int")
        if m in ("uniform", "block") and self.num_layers < 1:
            raise RecomputeConfigError("num_layers", f"recompute num_layers={self.num_layers} must be >= 1 with "
                                       f"method={m!r} (the number of layers per region for uniform, of checkpointed "
                                       "layers for block)")
        if g == "none" and m != "none":
            raise RecomputeConfigError(("method", "granularity"), f"recompute method={m!r} was given but "
                                       "granularity='none' turns recompute off; set granularity='full' "
                                       "(--activation_recompute --recompute_granularity full) or drop the method")
        if g == "selective" and m != "none":
            raise RecomputeConfigError("method", f"recompute method={m!r} applies to granularity='full' only; "
                                       "selective recompute acts inside every layer: use method='none'")
        if m not in ("uniform", "block") and self.num_layers != 1:
            raise RecomputeConfigError(("num_layers", "method"), f"recompute num_layers={self.num_layers} is the N of "
                                       f"method='uniform' or method='block', and method={m!r} would ignore it; "
                                       "choose one of those methods, or leave num_layers=1 (the default)")
        for flag in ("use_reentrant", "offload_inputs"):
            if not isinstance(getattr(self, flag), bool):
                raise RecomputeConfigError(flag, f"recompute {flag}={getattr(self, flag)!r} must be True or False")
        if self.modules is not None:
            unknown = [x for x in self.modules if x not in _names.MODULES]
            if unknown or not self.modules:
                raise RecomputeConfigError("modules", f"recompute modules={self.modules!r}: unknown "
                                           f"{unknown or 'empty list'}; "
                                           f"valid modules: {', '.join(_names.MODULES)}")
        self._check_ignored()
        if g == "selective" and self.modules is None:
            object.__setattr__(self, "modules", ("core_attn",))
        if self.policy is not None:
            try:
                _policies.validate(self.policy)
            except ValueError as e:
                raise RecomputeConfigError("policy", f"recompute policy={_show(self.policy)}: {e}") from None
        if self.use_reentrant and g == "selective":
            raise RecomputeConfigError("use_reentrant", "use_reentrant=True cannot be combined with "
                                       "granularity='selective': the reentrant path saves only each region's "
                                       "inputs, so selective saving means nothing there; use granularity='full' "
                                       "with use_reentrant, or drop use_reentrant")
        check_region(self.use_reentrant, self.policy, self.determinism_check, self.enabled)
        if self.layer_policies is not None:
            object.__setattr__(self, "layer_policies", tuple(self.layer_policies))
            if g != "full" or m != "none" or self.use_reentrant or self.policy is not None:
                raise RecomputeConfigError("layer_policies", "layer_policies (one policy per layer) needs "
                                           "granularity='full', method='none', no policy and no use_reentrant: it "
                                           "already says what every layer does")
            for i, p in enumerate(self.layer_policies):
                if p is not None:
                    try:
                        _policies.validate(p)
                    except ValueError as e:
                        raise RecomputeConfigError("layer_policies", f"layer_policies[{i}]: {e}") from None
        self._check_manual()
        if self.offload_inputs and (g == "none" or self.shard_saved_axis is not None):
            raise RecomputeConfigError(("offload_inputs", "granularity") if g == "none" else "offload_inputs",
                                       "offload_inputs=True (cpu_checkpointing) needs recompute "
                                       "on (granularity full or selective) and no shard_saved_axis (a region input "
                                       "is either offloaded or sharded)")
        if self.shard_saved_axis is not None and (not isinstance(self.shard_saved_axis, str) or g == "none"):
            raise RecomputeConfigError("shard_saved_axis", f"shard_saved_axis={self.shard_saved_axis!r} must be a "
                                       "mesh axis name and needs recompute on (granularity full or selective)")

    def _check_ignored(self):
        """Refuse a setting that the granularity (or another setting) would ignore, naming both."""
        g = self.granularity
        shown_modules = None if self.modules is None else ",".join(self.modules)
        if g == "none":
            dc = self.determinism_check
            policy = None if self.policy is None else _Shown(self.policy)
            given = [(f, v) for f, v in (("policy", policy), ("modules", shown_modules),
                                         ("use_reentrant", True if self.use_reentrant else None),
                                         ("determinism_check", dc if dc in ("structure", "values") else None))
                     if v is not None]
            if given:
                field, value = given[0]
                raise RecomputeConfigError((field, "granularity"), f"recompute {field}={value!r} has no effect with "
                                           "granularity='none' (recompute is off); set granularity='full' (or "
                                           f"'selective'), or drop {field}")
        if g == "full" and self.modules is not None:
            raise RecomputeConfigError(("modules", "granularity"), f"recompute modules={shown_modules!r} applies to "
                                       "granularity='selective' only; granularity='full' recomputes whole layers: "
                                       "choose what a region saves with a policy, or use granularity='selective'")
        if g == "selective" and self.modules is not None and self.policy is not None:
            raise RecomputeConfigError(("modules", "policy"), f"recompute policy={_show(self.policy)} replaces the "
                                       f"selective preset, so modules={shown_modules!r} would be ignored; pass one "
                                       f"of them (e.g. policy='{'+'.join(self.modules)}' is that preset)")

    def _check_manual(self):
        """Validate (and normalize) `segments` and `every`."""
        if isinstance(self.segments, str):
            object.__setattr__(self, "segments", parse_segments(self.segments))
        elif self.segments is not None:
            try:
                segs = tuple((a, b) for a, b in self.segments)
            except (TypeError, ValueError):
                raise RecomputeConfigError("segments", f"recompute segments={self.segments!r} must be (start, stop) "
                                           "pairs, e.g. ((0, 3), (3, 5)) or '0-3,3-5'") from None
            object.__setattr__(self, "segments", segs)
        segs, k = self.segments, self.every
        if segs is not None:
            if not segs:
                raise RecomputeConfigError("segments", "recompute segments=() is empty; give at least one (start, "
                                           "stop) range, e.g. '0-3'")
            prev = 0
            for a, b in segs:
                if not (_is_int(a) and _is_int(b)) or a < prev or b <= a:
                    raise RecomputeConfigError("segments", f"recompute segments={_fmt_segments(segs)}: ({a!r}, "
                                               f"{b!r}) is not valid; segments are half-open layer ranges start-stop "
                                               "with start < stop, in increasing order and not overlapping, e.g. "
                                               "0-3,3-5")
                prev = b
        if k is not None and (not _is_int(k) or k < 1):
            raise RecomputeConfigError("every", f"recompute every={k!r} must be an integer >= 1 (every k-th layer is "
                                       "a region)")
        r = self.regions
        if r is not None and (not _is_int(r) or r < 1):
            raise RecomputeConfigError("regions", f"recompute regions={r!r} must be an integer >= 1 (the number of "
                                       "recompute regions)")
        given = [(f, v) for f, v in (("segments", segs), ("every", k), ("regions", r)) if v is not None]
        if len(given) > 1:
            raise RecomputeConfigError(tuple(f for f, _ in given), f"recompute {' and '.join(f for f, _ in given)} "
                                       "each say which layers are regions; pass only one")
        for field, value in given:
            if self.granularity != "full" or self.method != "none" or self.layer_policies is not None:
                shown = _fmt_segments(value) if field == "segments" else value
                raise RecomputeConfigError((field, "method" if self.method != "none" else "granularity"), "recompute "
                                           f"{field}={shown!r} needs granularity='full' and method='none' (it "
                                           "replaces the method) and no layer_policies; got "
                                           f"granularity={self.granularity!r}, method={self.method!r}")

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
        if self.layer_policies is not None:
            return None if layer is None else self.layer_policies[layer]
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
          remat.config.RecomputeConfigError: recompute_num_layers=5 exceeds n_layer=4...
        """
        if self.layer_policies is not None and len(self.layer_policies) != n_layers:
            raise RecomputeConfigError("layer_policies", f"layer_policies has {len(self.layer_policies)} entries for "
                                       f"n_layer={n_layers}; give one per layer")
        if self.segments is not None and self.segments[-1][1] > n_layers:
            raise RecomputeConfigError("segments", f"recompute_segments={_fmt_segments(self.segments)} reaches layer "
                                       f"{self.segments[-1][1]} but n_layer={n_layers}; stops must be <= {n_layers}")
        if self.every is not None and self.every > n_layers:
            raise RecomputeConfigError("every", f"recompute_every={self.every} exceeds n_layer={n_layers}; use "
                                       f"1..{n_layers}")
        if self.regions is not None and self.regions > n_layers:
            raise RecomputeConfigError("regions", f"recompute regions={self.regions} exceeds n_layer={n_layers}; use "
                                       f"1..{n_layers} (the region count: DeepSpeed's number_checkpoints)")
        if self.method in ("uniform", "block") and self.num_layers > n_layers:
            raise RecomputeConfigError("num_layers", f"recompute_num_layers={self.num_layers} exceeds "
                                       f"n_layer={n_layers}; use 1..{n_layers}")
        return self


@dataclasses.dataclass(frozen=True)
class AutoRecompute:
    """A request to plan the recompute setting per layer (`--recompute_method auto`): what
    `remat.plan_for_budget` is asked for. It is not a RecomputeConfig and never reaches a model;
    the planner's answer (`BudgetPlan.recompute_config()`) does.

    Args:
      budget: the compiled peak per device to fit, in bytes.
    Example:
      >>> AutoRecompute(budget=12 * 2**30).budget
      12884901888
    """
    budget: int

    def __post_init__(self):
        if not _is_int(self.budget) or self.budget < 1:
            raise RecomputeConfigError("budget", f"recompute budget={self.budget!r} must be a number of bytes >= 1")


class _Shown:
    """A value whose repr shows a policy callable as `remat.policies.describe` does (in a tuple too)."""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return _show(self.value)


def _show(value) -> str:
    """repr(value), with policy callables (also inside a tuple) as the JAX expression that builds them."""
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_show, value)) + ("," if len(value) == 1 else "") + ")"
    return _policies.describe(value) if callable(value) else repr(value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fmt_segments(segs) -> str:
    return ",".join(f"{a}-{b}" for a, b in segs) if segs else repr(segs)


def _ascii_int(text: str) -> bool:
    """Digits 0-9 only (`str.isdigit` also takes '²' and '٣', which `int` reads or refuses)."""
    text = text.strip()
    return bool(text) and text.isascii() and text.isdigit()


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
            raise RecomputeConfigError("segments", f"recompute segments {spec!r}: {part!r} is not START-STOP; give "
                                       "half-open layer ranges, e.g. 0-3,3-5 (layers 0,1,2 and 3,4)")
        out.append((int(a), int(b)))
    return tuple(out)
