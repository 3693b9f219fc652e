"""remat: activation checkpointing (rematerialization) for JAX and Flax transformer training.

Example:
    >>> import jax.numpy as jnp, remat
    >>> cfg = remat.RecomputeConfig(granularity="full", method="uniform", num_layers=2)
    >>> [tuple(s) for s in cfg.split(4)]
    [(0, 2, True), (2, 4, True)]
    >>> layer = lambda w, x: jnp.tanh(x @ w)
    >>> remat.checkpoint(layer, use_reentrant=True)(jnp.eye(4), jnp.ones((2, 4))).shape
    (2, 4)
"""
from remat._host import prepare_host

prepare_host()  # before any JAX backend starts: the CPU platform on a host without an accelerator

from remat import names, policies
from remat.check import CheckpointError
from remat.checkpoint import checkpoint
from remat.config import RecomputeConfig
from remat.regions import Segment
from remat import regions
from remat.regions import block, count, every, per_layer, segments, uniform
from remat.planning.planner import BudgetPlan, plan_for_budget
from remat.stack import apply_layers
from remat import memory

__all__ = ["BudgetPlan", "CheckpointError", "RecomputeConfig", "Segment", "apply_layers", "block", "checkpoint",
           "count", "every", "memory", "names", "per_layer", "plan", "plan_for_budget", "prepare_host", "policies", "regions",
           "segments", "uniform"]
__version__ = "0.1.0"


def plan(n_layers: int, cfg: RecomputeConfig) -> list[Segment]:
    """The regions of an `n_layers` stack under `cfg`: `cfg.split(n_layers)` in function form.

    Example:
      >>> [tuple(s) for s in plan(3, RecomputeConfig(granularity="full", method="block", num_layers=2))]
      [(0, 1, True), (1, 2, True), (2, 3, False)]
    """
    return cfg.split(n_layers)
