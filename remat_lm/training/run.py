"""The training run: validate everything (`prepare`), then train, report memory, or dry-run.

`run` ties the stages together, one module each: `remat_lm.training.prepare` (every input check, the
frozen `Setup`; writes nothing), `remat_lm.training.compile` (the AOT-compiled train step, the planner for
`--recompute_method auto`), `remat_lm.training.report` (`--memory_report`, the summary), `remat_lm.training.resume`
(the step to continue from, the initial state) and `remat_lm.training.loop` (the loop).

Example:
    >>> from remat_lm.training import TrainConfig, run
    >>> result = run(TrainConfig(preset="tiny", num_iterations=3, progress=False))
    >>> result.history[-1]["loss"]
"""
from __future__ import annotations

import sys
import time

import remat
from remat_lm.training import preflight
from remat_lm.training import saving
from remat_lm.training import signals
from remat_lm.training import target as run_target
from remat_lm.training.checks import is_oom
from remat_lm.training.compile import compile_train_step, plan_memory
from remat_lm.training.config import TrainConfig
from remat_lm.training.loop import Interrupted, RunResult, TrainingDiverged, oom_error, train
from remat_lm.training.prepare import Setup, prepare
from remat_lm.training.report import memory_report, run_summary

__all__ = ["Interrupted", "RunResult", "Setup", "TrainingDiverged", "compile_train_step", "describe",
           "memory_report", "plan_memory", "prepare", "run"]


def run(cfg: TrainConfig, out=None) -> RunResult:
    """Validate, then train (or report memory, or dry-run) as `cfg` says.

    Args:
      cfg: the TrainConfig.
      out: where the summary and per-step lines go (default sys.stdout).
    Returns:
      RunResult with `history` (one dict per step, as written to --log_jsonl) and the final state.
    Raises:
      UsageError for bad input (before writing anything); TrainingDiverged on a non-finite loss.
    """
    out = sys.stdout if out is None else out
    setup = prepare(cfg)
    if setup.auto is not None:  # --recompute_method auto: the planner's answer becomes the model config
        setup, _ = plan_memory(setup, out)
    if cfg.memory_report:
        print(memory_report(setup), file=out)
        return RunResult([], None, setup, stopped="memory_report")
    # the run holds --checkpoint_dir from here to its end (saving.DirLock); a dry run writes nothing
    lock = saving.hold_directory(cfg.checkpoint_dir) if cfg.checkpoint_dir and not cfg.dry_run else None
    if lock is not None:
        signals.on_leave(lock.release)
    try:
        return _compile_and_train(cfg, setup, out)
    finally:
        if lock is not None:
            signals.forget(lock.release)
            lock.release()


def _compile_and_train(cfg: TrainConfig, setup: Setup, out) -> RunResult:
    signals.set_phase("compiling the train step")
    model = cfg.preset if setup.init_params is None else f"from {cfg.init_from}"
    built = f" by {run_target.words(setup.target)}" if setup.target is not None else ""
    print(f"compile  the train step ({cfg.model} {model}, micro-batch {cfg.batch_size}x{cfg.sequence_length}){built}",
          file=out, flush=True)
    t_compile = time.perf_counter()
    try:
        compiled = compile_train_step(setup)
    except run_target.Refused as e:  # the target's compiler: too large for its memory (a verdict)
        raise preflight.refusal(setup, e, advise=cfg.preflight) from None
    except Exception as e:
        if is_oom(e):
            raise oom_error(cfg, "compiling the train step", e) from None
        raise
    t_compile = time.perf_counter() - t_compile
    if cfg.preflight:  # the compiled peak against the devices' memory: UsageError with advice
        fit = preflight.check(setup, compiled)
        if fit:
            print(f"preflight {fit}", file=out)
    if cfg.dry_run:
        print(run_summary(setup, compiled), file=out)
        print(f"dry run: the train step compiled in {t_compile:.1f} s{built}; nothing was trained or written",
              file=out)
        return RunResult([], None, setup, stopped="dry_run")
    return train(setup, compiled, out, t_compile)
