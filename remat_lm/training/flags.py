"""The recompute flags of every command line (train.py, `python -m remat_lm.llmc verify`).

`FLAGS` is the one table of the CLI's recompute vocabulary: each flag's name (Megatron's and
DeepSpeed's spellings), type, default, help and the `RecomputeConfig` field it sets. The dataclass
`RecomputeFlags` (`TrainConfig`'s base) and every parser's flags are generated from it;
`FIELD_FLAGS` reads it backwards, field to flag, so a `RecomputeConfigError` becomes
`--recompute_num_layers: must be >= 1 (got 0)` (`flag_error`). `from_flags` turns flag values into
`RecomputeConfig`s (or an `AutoRecompute` request for `--recompute_method auto`); the settings are
validated by `RecomputeConfig` alone, and this module checks only what a config cannot see (two
flags for one field, a flag that implies a granularity).

Example:
    >>> recompute_configs(activation_recompute=True, methods=("uniform",), num_layers=2)
    [('full/uniform/2', RecomputeConfig(granularity='full', method='uniform', ...))]
    >>> from_flags({"activation_recompute": True, "recompute_every": 2})[0][0]
    'full/every/2'
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Collection, Mapping

from remat_lm import argtypes
from remat import names as _names
from remat import policies
import remat
from remat.config import GRANULARITIES, METHODS, RecomputeConfig, RecomputeConfigError
from remat.errors import is_int

__all__ = ["Flag", "FLAGS", "BY_NAME", "FIELD_FLAGS", "RecomputeFlags", "AutoRecompute", "argparse_kwargs",
           "add_arguments", "defaults", "granularity", "flag_error", "recompute_configs", "from_flags"]


@dataclasses.dataclass(frozen=True)
class Flag:
    """One recompute flag, `--<name>`.

    Args:
      name: the flag without dashes (also the `TrainConfig` field).
      type: bool (`--name` / `--no-name`), int or str; a default of None means "unset".
      default: the value when the flag is not given.
      help: the help text.
      field: the `RecomputeConfig` field it sets (None: it sets none directly).
      choices, metavar: as argparse's.
      train_only: only `train.py` has it (it needs the train step).
    """
    name: str
    type: type
    default: Any
    help: str
    field: str | None = None
    choices: tuple | None = None
    metavar: str | None = None
    train_only: bool = False


__all__ = ["BY_NAME", "FIELD_FLAGS", "FLAGS", "AutoRecompute", "Flag", "RecomputeFlags", "add_arguments",
           "argparse_kwargs", "defaults", "flag_error", "flag_word", "from_flags", "granularity", "recompute_configs"]

FLAGS = (
    Flag("activation_recompute", bool, False, "turn activation recompute on; without --recompute_granularity it "
         "means granularity full"),
    Flag("recompute_granularity", str, None, "none | full (whole layers) | selective (sub-modules inside every "
         "layer); default: full with --activation_recompute, else none", "granularity", choices=GRANULARITIES),
    Flag("recompute_method", str, "none", "for granularity full: none (each layer a region) | uniform (runs of "
         "--recompute_num_layers layers) | block (first --recompute_num_layers layers) | auto (train.py: a setting "
         "per layer, planned to fit --memory_budget); with --memory_report a comma list gives one row per method",
         "method", metavar="{" + ",".join(METHODS + ("auto",)) + "}"),
    Flag("memory_budget", str, None, "with --recompute_method auto: the compiled peak per device to fit "
         "(arguments + outputs + temp - aliased of the train step), e.g. 12GiB, 512MiB or a number of bytes",
         "budget", metavar="SIZE", train_only=True),
    Flag("recompute_plan", str, None, "a plan as the planner prints it (`plan:` line of --recompute_method auto, "
         "`python -m remat_lm.bench.planner`): 'POLICY xN; POLICY xN ...', one run per group of layers, first layer "
         "first, e.g. 'save_names:qkv,mlp_up x6; none x6'; a trailing '; scan' or '; loop' (the layout it was planned for) sets "
         "--scan_layers; sets every recompute setting", "layer_policies",
         metavar="PLAN", train_only=True),
    Flag("recompute_num_layers", int, 1, "the N of --recompute_method uniform/block (1..n_layer); no other method "
         "takes it", "num_layers"),
    Flag("recompute_modules", str, None, "selective granularity: comma list of sub-modules to recompute, from "
         f"{','.join(_names.MODULES)} (default core_attn); not with --remat_policy, which replaces them", "modules"),
    Flag("remat_policy", str, None, "what a recompute region saves, a remat.policies name: "
         + ", ".join(policies.names()) + " (selective modules combine with '+', e.g. core_attn+mlp)", "policy"),
    Flag("use_reentrant", bool, False, "recompute through a custom_vjp that saves only region inputs (full "
         "granularity only)", "use_reentrant"),
    Flag("scan_layers", bool, False, "run the layers under lax.scan (constant compile time in depth)"),
    Flag("recompute_segments", str, None, "explicit recompute regions as half-open layer ranges, e.g. 0-3,3-5 "
         "(layers 0-2 one region, 3-4 another); layers in no range are not rematerialized; replaces "
         "--recompute_method; turns recompute on (granularity full)", "segments", metavar="A-B,C-D"),
    Flag("recompute_every", int, None, "checkpoint every k-th layer: layers 0, k, 2k, ... are each a region, the "
         "layers between them are not rematerialized; replaces --recompute_method; turns recompute on (granularity "
         "full)", "every", metavar="K"),
    Flag("cpu_checkpointing", bool, False, "keep each recompute region's input in pinned host memory between the "
         "forward and the backward (DeepSpeed's cpu_checkpointing; on CPU nothing moves)", "offload_inputs"),
    Flag("deepspeed_config", str, None, "a DeepSpeed JSON config whose activation_checkpointing block sets the "
         "recompute settings (number_checkpoints, cpu_checkpointing, partition_activations, ...); turns recompute "
         "on (granularity full)", metavar="FILE.json"),
)
BY_NAME = {f.name: f for f in FLAGS}


def _field(flag: Flag) -> tuple:
    tp = flag.type if flag.default is not None else typing.Optional[flag.type]
    return flag.name, tp, dataclasses.field(default=flag.default, metadata={"recompute_flag": flag.name,
                                                                             "help": flag.help})


# The recompute fields of TrainConfig (its base class), one per entry of FLAGS.
RecomputeFlags = dataclasses.make_dataclass("RecomputeFlags", [_field(f) for f in FLAGS], frozen=True)
RecomputeFlags.__doc__ = "The recompute flags' values, one field per entry of `FLAGS` (TrainConfig's base)."
RecomputeFlags.__module__ = __name__

# The flag that sets each RecomputeConfig field (or region spec's value), read from FLAGS; two come
# from --deepspeed_config, and `shard_inputs` from train.py's --distribute_saved_activations.
FIELD_FLAGS = {**{f.field: f"--{f.name}" for f in FLAGS if f.field},
               "regions": "--deepspeed_config number_checkpoints",
               "shard_inputs": "--distribute_saved_activations"}


# Text flags that hold numbers: ASCII digits only (int() would misread or reject '²'), named in the error.
_ARG_TYPES = {"recompute_segments": argtypes.ascii_digits("0-3,3-5")}
_INT = argtypes.integer()  # one object, so every parser's recompute flags have the same type


@dataclasses.dataclass(frozen=True)
class AutoRecompute:
    """A request to plan the recompute setting per layer (`--recompute_method auto`): what
    `remat.plan_for_budget` is asked for (`remat_lm.training.compile.plan_memory` asks it). It is not a RecomputeConfig and never reaches a model;
    the planner's answer (`BudgetPlan.recompute_config()`) does.

    Args:
      budget: the compiled peak per device to fit, in bytes.
    Example:
      >>> AutoRecompute(budget=12 * 2**30).budget
      12884901888
    """
    budget: int

    def __post_init__(self):
        if not is_int(self.budget) or self.budget < 1:
            raise ValueError(f"--memory_budget {self.budget!r} must be a number of bytes >= 1")


def argparse_kwargs(flag: Flag) -> dict:
    """`parser.add_argument(f"--{flag.name}", **argparse_kwargs(flag))`: the one way a flag is parsed.

    Example:
      >>> argparse_kwargs(BY_NAME["recompute_every"])["type"]("2")
      2
    """
    kw: dict = {"help": flag.help, "default": flag.default}
    if flag.type is bool:
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = _ARG_TYPES.get(flag.name) or {int: _INT}.get(flag.type, flag.type)
        if flag.choices is not None:
            kw["choices"] = flag.choices
        kw["metavar"] = flag.metavar or (None if flag.choices else {int: "N", str: "STR"}[flag.type])
        if flag.default is not None:
            kw["help"] += " (default: %(default)s)"
    return kw


def add_arguments(parser: argparse.ArgumentParser, *, train: bool = True) -> None:
    """Add every recompute flag (without the train.py-only ones unless `train`) to `parser`."""
    for f in FLAGS:
        if train or not f.train_only:
            parser.add_argument(f"--{f.name}", **argparse_kwargs(f))


def defaults() -> dict:
    """{flag name: default} of every recompute flag."""
    return {f.name: f.default for f in FLAGS}


def granularity(activation_recompute: bool, recompute_granularity: str | None, *, regions: bool = False) -> str:
    """`--activation_recompute` alone means granularity full; so does a flag that chooses the regions
    (`regions`: `--recompute_segments`, `--recompute_every` or `--deepspeed_config` given)."""
    if recompute_granularity is None:
        return "full" if activation_recompute or regions else "none"
    return recompute_granularity


def _flag_of(field: str, value, flags: Mapping[str, str]) -> str:
    """The flag that sets `field` (a region spec in `layers` by the flag of its kind: `every(2)` is
    `--recompute_every`); a field without a flag keeps its name."""
    if field == "layers" and isinstance(value, remat.regions.Layers):
        field = value.field
    return flags.get(field, field)


def flag_error(e: RecomputeConfigError, flags: Mapping[str, str] = FIELD_FLAGS) -> str:
    """A RecomputeConfigError with the flags of its fields in front: `--recompute_every: must be ...`.

    Example:
      >>> try:
      ...     RecomputeConfig(granularity="full", layers=remat.every(0))
      ... except RecomputeConfigError as e:
      ...     flag_error(e)
      '--recompute_every: must be an integer >= 1 (got 0): every k-th layer is a region'
    """
    named = [_flag_of(e.field, e.value, flags)] + [_flag_of(f, None, flags) for f in e.fields[1:]]
    return f"{' and '.join(dict.fromkeys(named))}: {e.message}"


def recompute_configs(*, activation_recompute: bool = False, recompute_granularity: str | None = None,
                      methods: tuple = ("none",), num_layers: int = 1, modules: str | None = None,
                      policy: str | None = None, use_reentrant: bool = False, segments: str | None = None,
                      every: int | None = None, cpu_checkpointing: bool = False, deepspeed=None,
                      tensor_axis: str | None = None, distribute_axis: str | None = None) -> list:
    """[(label, RecomputeConfig)], one per method; ValueError naming the flag and the fix otherwise.

    `segments` ('0-3,3-5'), `every` (k) and `cpu_checkpointing` are `--recompute_segments`,
    `--recompute_every` and `--cpu_checkpointing`; `deepspeed` is a `remat_lm.training.deepspeed.DeepSpeedCheckpointing`
    (`--deepspeed_config`), which turns recompute on at granularity full; `tensor_axis` is the mesh's
    tensor-parallel axis, if any, for its `partition_activations`; `distribute_axis` is the axis
    train.py's `--distribute_saved_activations` splits region inputs over (its `shard_inputs`).
    """
    g = granularity(activation_recompute, recompute_granularity,
                    regions=deepspeed is not None or segments is not None or every is not None)
    # What a RecomputeConfig cannot see: flag words (two flags for one field, a flag that implies a
    # granularity). Every rule about the settings themselves is RecomputeConfig's.
    if activation_recompute and g == "none":
        raise ValueError("--activation_recompute contradicts --recompute_granularity none; drop one of them")
    if deepspeed is not None and g != "full":
        raise ValueError(f"--deepspeed_config checkpoints whole layers (granularity full) but --recompute_granularity "
                         f"is {g}; drop --recompute_granularity")
    flags = dict(FIELD_FLAGS)  # the flag that set each field, for messages
    given = [(f, v) for f, v in (("segments", segments), ("every", every),
                                 ("regions", None if deepspeed is None else deepspeed.number_checkpoints))
             if v is not None]
    if len(given) > 1:
        raise ValueError(" and ".join(flags[f] for f, _ in given) + " each say which layers are regions; pass "
                         "only one")
    try:
        layers = (remat.segments(segments) if segments is not None else
                  remat.every(every) if every is not None else None)
    except RecomputeConfigError as e:
        raise ValueError(flag_error(e, flags)) from None
    base = dict(granularity=g, policy=policy, use_reentrant=use_reentrant, layers=layers,
                offload_inputs=bool(cpu_checkpointing), modules=modules)
    if deepspeed is not None:
        base.update(deepspeed.recompute_kwargs(tensor_axis))
        if deepspeed.cpu_checkpointing and not cpu_checkpointing:
            flags["offload_inputs"] = "--deepspeed_config cpu_checkpointing"
        if base.get("shard_inputs") is not None:
            flags["shard_inputs"] = "--deepspeed_config partition_activations"
    if distribute_axis is not None:
        if base.get("shard_inputs") is not None:
            raise ValueError("--distribute_saved_activations and --deepspeed_config partition_activations ask for the "
                             "same thing; pass only one")
        base["shard_inputs"] = distribute_axis
    takes_n = [m for m in methods if m in ("uniform", "block")]
    out = []
    for m in methods:
        # a comma list (--memory_report) compares methods: --recompute_num_layers is the N of those that take one
        n = 1 if takes_n and m not in takes_n else num_layers
        try:
            rc = RecomputeConfig(method=m, num_layers=n, **base)
        except RecomputeConfigError as e:
            raise ValueError(_off_error(e, flags, g, recompute_granularity) or flag_error(e, flags)) from None
        out.append((argtypes.config_label(rc), rc))
    return out


# The settings that mean nothing with recompute off, worded "has no effect with recompute off" on a command line.
_OFF_FIELDS = ("method", "num_layers", "modules", "policy", "use_reentrant", "layers", "offload_inputs", "shard_inputs")


def _off_error(e: RecomputeConfigError, flags: Mapping[str, str], g: str,
               recompute_granularity: str | None) -> str | None:
    """A setting RecomputeConfig refused because recompute is off (granularity `g` is none), in flag
    words: the flag that would be ignored and how to turn recompute on; None for any other error."""
    if g != "none" or e.field not in _OFF_FIELDS or "is not valid" in e.message:
        return None  # a value that is not valid is refused as itself, recompute on or off
    flag = _flag_of(e.field, e.value, flags)
    on = "--activation_recompute" + (" --recompute_granularity selective" if e.field == "modules" else "")
    if recompute_granularity is not None:  # the user said none
        on = f"--recompute_granularity {'selective' if e.field == 'modules' else 'full'} (not none)"
    return f"{flag}: has no effect with recompute off; add {on}, or drop {flag}"


def from_flags(values: Mapping[str, Any], *, tensor_axis: str | None = None,
               distribute_axis: str | None = None, default_budget: int | None = None,
               given: Collection[str] | None = None) -> list:
    """Flag values ({flag name: value}; missing ones take their defaults) → [(label, RecomputeConfig)],
    one per `--recompute_method` entry, or [("auto", AutoRecompute)] for `--recompute_method auto`.
    `default_budget` (bytes; train.py's `--target` memory per device) is auto's budget
    when `--memory_budget` is not given. `given`: the flags on the command line; a setting that
    conflicts with `--recompute_plan` or auto is then refused even at its default value (without
    it, a value other than the default counts as given). ValueError naming the flag and the fix.
    """
    v = {**defaults(), **{k: values[k] for k in BY_NAME if k in values}}
    given = {f.name for f in FLAGS if v[f.name] != f.default} if given is None else set(given)
    methods = tuple(m.strip() for m in str(v["recompute_method"]).split(","))
    if v["recompute_plan"] is not None:
        return [_plan_config(v, given)]
    if "auto" in methods or v["memory_budget"] is not None:
        return [("auto", _auto_request(v, methods, default_budget, given))]
    deepspeed = None
    if v["deepspeed_config"] is not None:
        from remat_lm.training import deepspeed as _deepspeed
        try:
            deepspeed = _deepspeed.load(v["deepspeed_config"])
        except ValueError as e:
            raise ValueError(f"--deepspeed_config {e}") from None
    return recompute_configs(
        activation_recompute=v["activation_recompute"], recompute_granularity=v["recompute_granularity"],
        methods=methods, num_layers=v["recompute_num_layers"], modules=v["recompute_modules"],
        policy=v["remat_policy"], use_reentrant=v["use_reentrant"], segments=v["recompute_segments"],
        every=v["recompute_every"], cpu_checkpointing=v["cpu_checkpointing"], deepspeed=deepspeed,
        tensor_axis=tensor_axis, distribute_axis=distribute_axis)


def _spelled(f: Flag, value) -> str:
    """How `value` of flag `f` is written on a command line: `--no-activation_recompute`, `--recompute_num_layers`."""
    return f"--no-{f.name}" if f.type is bool and value is False else f"--{f.name}"


def _plan_config(v: dict, given: set) -> tuple:
    """`--recompute_plan PLAN` → ("plan", RecomputeConfig) of its per-layer policies; every other
    recompute flag given is then an error naming it (the plan sets them all)."""
    from remat.planning.tagplan import parse_plan

    for f in FLAGS:
        if f.name in ("recompute_plan", "scan_layers") or f.name not in given:
            continue
        if (f.name, v[f.name]) in (("recompute_granularity", "full"), ("activation_recompute", True)):
            continue  # what a plan means anyway: Megatron users write them with it
        raise ValueError(f"--recompute_plan sets every layer's recompute itself; drop {_spelled(f, v[f.name])}")
    try:
        lp = parse_plan(v["recompute_plan"])
    except ValueError as e:
        raise ValueError(f"--recompute_plan: {e}") from None
    from remat.planning import recompute_config
    return ("plan", recompute_config(lp))


def _auto_request(v: dict, methods: tuple, default_budget: int | None, given: set) -> AutoRecompute:
    """`--recompute_method auto --memory_budget SIZE` → AutoRecompute (without the flag: `default_budget`,
    if any); the planner chooses every other recompute setting, so giving one is an error naming it."""
    if methods != ("auto",):
        if "auto" in methods:
            raise ValueError(f"--recompute_method {v['recompute_method']}: auto plans every layer itself; pass "
                             f"--recompute_method auto alone")
        raise ValueError(f"--memory_budget {v['memory_budget']} needs --recompute_method auto (the planner that "
                         f"fits it); add --recompute_method auto or drop --memory_budget")
    if v["memory_budget"] is None and not default_budget:
        raise ValueError("--recompute_method auto needs --memory_budget SIZE (e.g. 12GiB), the compiled peak "
                         "to fit (or --target NAME, whose memory is then the budget); add it, or choose "
                         "--recompute_method none/uniform/block")
    if v["memory_budget"] is None:
        budget = int(default_budget)
    else:
        try:
            budget = argtypes.parse_size(v["memory_budget"])
        except ValueError as e:
            raise ValueError(f"--memory_budget: {e}") from None
    fixed = ("activation_recompute", "recompute_method", "memory_budget", "scan_layers")  # any layout plans
    for f in FLAGS:
        value = v[f.name]
        if f.name in fixed or f.name not in given or (f.name == "recompute_granularity" and value == "full"):
            continue
        flag = _spelled(f, value)
        raise ValueError(f"--recompute_method auto cannot be combined with {flag} (auto chooses the policy of "
                         f"every layer itself); drop {flag}")
    return AutoRecompute(budget)
