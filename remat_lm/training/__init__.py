"""Training: configs and flags, data, optimizer, the jitted step, orbax checkpoints, logging.

`train.py` parses flags into a `TrainConfig` and calls `run`; notebooks and tests import the same.

Example:
    >>> from remat_lm.training import TrainConfig, run
    >>> result = run(TrainConfig(model="gpt2", preset="tiny", num_iterations=3, progress=False))
    >>> [r["loss"] for r in result.history]
"""
from remat_lm.training.config import TrainConfig, UsageError, build_parser, config_from_args
from remat_lm.training.run import RunResult, Setup, TrainingDiverged, memory_report, prepare, run

__all__ = ["RunResult", "Setup", "TrainConfig", "TrainingDiverged", "UsageError", "build_parser",
           "config_from_args", "memory_report", "prepare", "run"]
