"""The planner: a recompute setting per layer (or per tag) that fits a memory budget, its cost
model, and the compile-only targets (XLA:GPU, XLA:TPU) it plans for.

Example:
    >>> from remat.planning import targets
    >>> targets.get("h200").platform
    'cuda'
"""
from remat.planning.planner import BudgetPlan, front, plan_for_budget, recompute_config

__all__ = ["BudgetPlan", "front", "plan_for_budget", "recompute_config"]

