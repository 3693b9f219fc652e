"""Megatron-style recompute flags → RecomputeConfig, shared by every command line (train.py,
`python -m models.llmc verify`), so the flags mean the same everywhere.

Example:
    >>> recompute_configs(activation_recompute=True, methods=("uniform",), num_layers=2)
    [('full/uniform/2', RecomputeConfig(granularity='full', method='uniform', ...))]
"""
from __future__ import annotations

from remat import policies
from remat.config import RecomputeConfig


def granularity(activation_recompute: bool, recompute_granularity: str | None) -> str:
    """`--activation_recompute` alone means granularity full."""
    if recompute_granularity is None:
        return "full" if activation_recompute else "none"
    return recompute_granularity


def recompute_configs(*, activation_recompute: bool = False, recompute_granularity: str | None = None,
                      methods: tuple = ("none",), num_layers: int = 1, modules: str | None = None,
                      policy: str | None = None, use_reentrant: bool = False, segments: str | None = None,
                      every: int | None = None, cpu_checkpointing: bool = False, deepspeed=None,
                      tensor_axis: str | None = None) -> list:
    """[(label, RecomputeConfig)], one per method; ValueError naming the flag and the fix otherwise.

    `segments` ('0-3,3-5'), `every` (k) and `cpu_checkpointing` are `--recompute_segments`,
    `--recompute_every` and `--cpu_checkpointing`; `deepspeed` is a `remat.deepspeed.DeepSpeedCheckpointing`
    (`--deepspeed_config`), which turns recompute on at granularity full; `tensor_axis` is the mesh's
    tensor-parallel axis, if any, for its `partition_activations`.
    """
    method_flag = ",".join(methods)
    g = granularity(activation_recompute or deepspeed is not None, recompute_granularity)
    if activation_recompute and g == "none":
        raise ValueError("--activation_recompute contradicts --recompute_granularity none; drop one of them")
    if deepspeed is not None and g != "full":
        raise ValueError(f"--deepspeed_config checkpoints whole layers (granularity full) but --recompute_granularity "
                         f"is {g}; drop --recompute_granularity")
    if g == "none":
        if any(m != "none" for m in methods):
            raise ValueError(f"--recompute_method {method_flag} needs recompute turned on; add "
                             f"--activation_recompute (granularity full), or drop --recompute_method")
        for flag, value in (("--remat_policy", policy), ("--recompute_modules", modules),
                            ("--recompute_segments", segments), ("--recompute_every", every)):
            if value is not None:
                raise ValueError(f"{flag} {value} needs recompute turned on; add --activation_recompute"
                                 + (" --recompute_granularity selective" if flag == "--recompute_modules" else ""))
        if use_reentrant:
            raise ValueError("--use_reentrant needs recompute turned on; add --activation_recompute")
        if cpu_checkpointing:
            raise ValueError("--cpu_checkpointing needs recompute turned on (it offloads region inputs); add "
                             "--activation_recompute")
    if g == "selective" and any(m != "none" for m in methods):
        raise ValueError(f"--recompute_method {method_flag} applies to --recompute_granularity full "
                         f"only (selective recomputes inside every layer); drop --recompute_method")
    if g == "selective" and use_reentrant:
        raise ValueError("--use_reentrant cannot be combined with --recompute_granularity selective (a "
                         "reentrant region saves only its inputs); use granularity full or drop --use_reentrant")
    if g == "full" and modules is not None:
        raise ValueError("--recompute_modules applies to --recompute_granularity selective; for full "
                         "granularity choose what a region saves with --remat_policy")
    regions = deepspeed.number_checkpoints if deepspeed is not None else None
    manual = [(f, v) for f, v in (("--recompute_segments", segments), ("--recompute_every", every),
                                  ("--deepspeed_config number_checkpoints", regions)) if v is not None]
    if len(manual) > 1:
        raise ValueError(f"{manual[0][0]} and {manual[1][0]} both choose which layers are regions; pass only one")
    if manual and g != "full":
        raise ValueError(f"{manual[0][0]} {manual[0][1]} chooses whole-layer regions: it needs "
                         f"--recompute_granularity full (or just --activation_recompute)")
    if manual and any(m != "none" for m in methods):
        raise ValueError(f"{manual[0][0]} {manual[0][1]} replaces --recompute_method {method_flag}; drop one of them")
    if segments is not None:
        try:
            RecomputeConfig(granularity="full", segments=segments)
        except ValueError as e:
            raise ValueError(f"--recompute_segments: {e}") from None
    if every is not None and (not isinstance(every, int) or every < 1):
        raise ValueError(f"--recompute_every {every!r} must be an integer >= 1 (layers 0, k, 2k, ... are regions)")
    if policy is not None:
        try:
            policies.validate(policy)
        except ValueError as e:
            raise ValueError(f"--remat_policy: {e}") from None
    if any(m in ("uniform", "block") for m in methods) and num_layers < 1:
        raise ValueError(f"--recompute_num_layers {num_layers} must be >= 1 with "
                         f"--recompute_method uniform/block")
    out = []
    for m in methods:
        kw = dict(granularity=g, method=m, num_layers=num_layers, policy=policy, use_reentrant=use_reentrant,
                  segments=segments, every=every, offload_inputs=bool(cpu_checkpointing))
        if deepspeed is not None:
            kw.update(deepspeed.recompute_kwargs(tensor_axis))
        if modules is not None:
            kw["modules"] = modules
        try:
            rc = RecomputeConfig(**kw)
        except ValueError as e:
            raise ValueError(f"recompute flags: {e}") from None
        label = g if g != "full" else f"full/{m}" + (f"/{num_layers}" if m != "none" else "")
        if segments is not None:
            label = f"full/segments/{segments}"
        elif every is not None:
            label = f"full/every/{every}"
        elif rc.regions is not None:
            label = f"full/regions/{rc.regions}"
        label += "+offload" if rc.offload_inputs else ""
        out.append((label, rc))
    return out
