"""The planner: a recompute setting per layer (or per tag) that fits a memory budget, its cost
model, and the compile-only targets (XLA:GPU, XLA:TPU) it plans for.

Example:
    >>> from remat.plan import targets
    >>> targets.get("h200").platform
    'cuda'
"""
from remat.plan.planner import BudgetPlan, front, plan_for_budget, recompute_config

__all__ = ["BudgetPlan", "front", "plan_for_budget", "recompute_config"]


def _split(n_layers, cfg):
    """`remat.plan(n_layers, cfg)`: `cfg.split(n_layers)`, the regions of a stack (the function form)."""
    return cfg.split(n_layers)


class _Callable(__import__("types").ModuleType):
    """`remat.plan` is this subpackage and, called, `RecomputeConfig.split` in function form."""

    def __call__(self, n_layers, cfg):
        return _split(n_layers, cfg)


__import__("sys").modules[__name__].__class__ = _Callable
