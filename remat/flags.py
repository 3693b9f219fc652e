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
                      policy: str | None = None, use_reentrant: bool = False) -> list:
    """[(label, RecomputeConfig)], one per method; ValueError naming the flag and the fix otherwise."""
    method_flag = ",".join(methods)
    g = granularity(activation_recompute, recompute_granularity)
    if activation_recompute and g == "none":
        raise ValueError("--activation_recompute contradicts --recompute_granularity none; drop one of them")
    if g == "none":
        if any(m != "none" for m in methods):
            raise ValueError(f"--recompute_method {method_flag} needs recompute turned on; add "
                             f"--activation_recompute (granularity full), or drop --recompute_method")
        for flag, value in (("--remat_policy", policy), ("--recompute_modules", modules)):
            if value is not None:
                raise ValueError(f"{flag} {value} needs recompute turned on; add --activation_recompute "
                                 f"(with --recompute_granularity selective for modules)")
        if use_reentrant:
            raise ValueError("--use_reentrant needs recompute turned on; add --activation_recompute")
    if g == "selective" and any(m != "none" for m in methods):
        raise ValueError(f"--recompute_method {method_flag} applies to --recompute_granularity full "
                         f"only (selective recomputes inside every layer); drop --recompute_method")
    if g == "selective" and use_reentrant:
        raise ValueError("--use_reentrant cannot be combined with --recompute_granularity selective (a "
                         "reentrant region saves only its inputs); use granularity full or drop --use_reentrant")
    if g == "full" and modules is not None:
        raise ValueError("--recompute_modules applies to --recompute_granularity selective; for full "
                         "granularity choose what a region saves with --remat_policy")
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
        kw = dict(granularity=g, method=m, num_layers=num_layers, policy=policy, use_reentrant=use_reentrant)
        if modules is not None:
            kw["modules"] = modules
        try:
            rc = RecomputeConfig(**kw)
        except ValueError as e:
            raise ValueError(f"recompute flags: {e}") from None
        label = g if g != "full" else f"full/{m}" + (f"/{num_layers}" if m != "none" else "")
        out.append((label, rc))
    return out
