"""remat: activation checkpointing (rematerialization) for JAX and Flax transformer training.

Example:
    >>> import remat
    >>> cfg = remat.RecomputeConfig(granularity="full", method="uniform", num_layers=2)
    >>> remat.plan(4, cfg)
    >>> y = remat.checkpoint(layer, params, x, use_reentrant=True)
"""
from remat import names, policies
from remat.check import CheckpointError
from remat.checkpoint import checkpoint
from remat.config import RecomputeConfig
from remat.plan import Segment, plan
from remat.planner import BudgetPlan, plan_for_budget
from remat.stack import apply_layers
from remat import memory

__all__ = ["BudgetPlan", "CheckpointError", "RecomputeConfig", "Segment", "apply_layers", "checkpoint", "memory",
           "names", "plan", "plan_for_budget", "policies"]
__version__ = "0.1.0"
