"""The training loop (`train`): a tqdm bar, one dense line per step, optional JSONL, validation,
asynchronous orbax saves, samples, profiles, and a stop with a clear message on a non-finite
loss or a signal.

Example:
    >>> setup = prepare(TrainConfig(preset="tiny", num_iterations=3, progress=False))
    >>> result = train(setup, compile_train_step(setup), sys.stdout, t_compile=0.0)
    >>> result.history[-1]["loss"]
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

import remat
from remat_lm.training import log as log_lib
from remat_lm.training import saving
from remat_lm.training import sharding as sh
from remat_lm.training import signals
from remat_lm.training.checks import is_oom
from remat_lm.training.compile import batch_struct
from remat_lm.training.config import LOG_SECONDS, TrainConfig, UsageError
from remat_lm.training.distributed import put_rows
from remat_lm.training.model import config_dict
from remat_lm.training.profile import StepProfiler
from remat_lm.training.report import run_summary
from remat_lm.training.resume import initial_state
from remat_lm.training.step import make_eval_step


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; the message says which step and what was kept."""


class Interrupted(RuntimeError):
    """SIGINT/SIGTERM stopped training at a step boundary (in-flight save completed); `code` is the
    exit status (130 / 143) and the message says what was kept."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code



def oom_error(cfg: TrainConfig, where: str, e: BaseException) -> UsageError:
    detail = " ".join(str(e).split())[:200] if not isinstance(e, MemoryError) else "host MemoryError"
    return UsageError(f"out of memory {where} ({detail}); lower --batch_size ({cfg.batch_size}) or "
                      f"--sequence_length ({cfg.sequence_length}), add --grad_accum_steps, or turn on "
                      f"--activation_recompute (see --memory_report)")


@dataclasses.dataclass
class RunResult:
    """What a run produced: one record per step (the JSONL objects) and the final state."""
    history: list
    state: Any = None
    setup: Any = None               # the remat_lm.training.prepare.Setup the run used
    stopped: str | None = None


def _finite(*xs) -> bool:
    return all(math.isfinite(float(x)) for x in xs)


def train(setup, compiled, out, t_compile: float) -> RunResult:
    """Train from the prepared `setup` with its `compiled` train step; see the module doc."""
    cfg, mesh = setup.cfg, setup.mesh
    if jax.process_index() != 0:  # multi-host: one process reports
        out = open(os.devnull, "w")
    devices = list(mesh.devices.flat)
    print(run_summary(setup, compiled), file=out)
    print(f"compile  {t_compile:.1f} s", file=out)
    signals.set_phase("restoring the train state")
    state, position, setup = initial_state(setup)  # setup: the step restored, damaged steps skipped
    start = setup.start_step
    if start:
        print(f"resume   from step {start} of {cfg.checkpoint_dir} (data position {position})"
              + (f"; changed: {', '.join(setup.resume_changes)}" if setup.resume_changes else "")
              + (f"; {setup.schedule_note}" if setup.schedule_note else ""), file=out)

    eval_fn = None
    if setup.val_ds is not None and cfg.val_every > 0:
        xs = sh.batch_sharding(mesh, 2, 0)
        eval_fn = jax.jit(make_eval_step(setup.fam, setup.mcfg),
                          in_shardings=(setup.state_sharding["params"], xs, xs), out_shardings=sh.replicated(mesh))

    def evaluate(params):
        xs = sh.batch_sharding(mesh, 2, 0)
        losses = []
        for i in range(cfg.val_steps):
            xd, yd = put_rows(lambda r: setup.val_ds.eval_batch(i, cfg.batch_size, cfg.sequence_length, rows=r),
                              (cfg.batch_size, cfg.sequence_length), xs, 0)  # this process's rows only
            losses.append(float(eval_fn(params, xd, yd)))
        return float(np.mean(losses))

    profiler = StepProfiler.from_config(cfg, out)
    if profiler.last and profiler.last <= start:
        raise UsageError(f"--profile_steps {cfg.profile_steps}: this run resumes after step {start}, so none of "
                         f"those steps runs; choose steps after {start}")
    peak = log_lib.peak_flops(devices[0], cfg.dtype)
    flops_step = setup.fam.flops_per_token(setup.mcfg, cfg.sequence_length) * cfg.tokens_per_step
    est = log_lib.compiled_estimate(compiled)
    checkpointer = None  # created at the first save: a run that fails before it leaves no directory

    def save(n):
        nonlocal checkpointer
        if checkpointer is None:
            for s_ in sorted(s_ for s_ in setup.damaged_steps if s_ > start):
                moved = saving.set_aside(cfg.checkpoint_dir, s_)
                print(f"resume   damaged step {s_} moved to {moved} (step {s_} is trained and saved again)", file=out)
            checkpointer = saving.Checkpointer(cfg.checkpoint_dir, cfg.keep_checkpoints)
        checkpointer.save(n, state, {"step": n, "data_position": position, "model": cfg.model,
                                     "model_config": config_dict(setup.mcfg), "train_config": cfg.to_dict()})

    writer = log_lib.JsonlWriter(cfg.log_jsonl, append=start > 0, keep_through=start)
    history, times, last_saved = [], [], (start if start else None)
    bar = tqdm(total=cfg.num_iterations, initial=start, desc="train", unit="step", file=sys.stderr,
               disable=(not cfg.progress or jax.process_index() != 0) or None, dynamic_ncols=True,
               leave=False)
    t_run = time.perf_counter()
    stopped, n, last_line = None, start, -math.inf
    signals.set_phase("training")
    try:
        for step in range(start, cfg.num_iterations):
            try:
                read = lambda r: setup.train_ds.batch(position, cfg.seed, cfg.batch_size, cfg.sequence_length,
                                                      cfg.grad_accum_steps, rows=r)
                xd, yd = put_rows(read, batch_struct(setup).shape, setup.x_sharding, 1)  # this process's rows only
                with profiler.step(step + 1):  # a jax.profiler trace of --profile_steps
                    t0 = time.perf_counter()
                    state, metrics = compiled(state, xd, yd)
                    metrics = jax.device_get(metrics)
                    dt = time.perf_counter() - t0
            except Exception as e:
                if is_oom(e):
                    raise oom_error(cfg, f"at step {step + 1}", e) from None
                raise
            position += 1
            loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
            if not _finite(loss, norm):
                kept = (f"the last good checkpoint is step {last_saved} in {cfg.checkpoint_dir} (continue with "
                        f"--resume and a lower --learning_rate)" if last_saved is not None
                        else "no checkpoint was written" + ("" if cfg.checkpoint_dir else " (no --checkpoint_dir)"))
                stopped = (f"step {step + 1}: loss is {loss} (grad norm {norm}); stopping without saving this "
                           f"step; {kept}")
                break
            n = step + 1
            if step > start:  # the first step of a process warms up caches: left out of timing
                times.append(dt)
            mem = log_lib.device_memory(devices)
            rec = {"step": n, "loss": loss, "grad_norm": norm, "lr": float(metrics["lr"]), "step_ms": 1000 * dt,
                   "tokens_per_s": cfg.tokens_per_step / dt,
                   "mfu": None if peak is None else flops_step / dt / (peak * len(devices)),
                   "memory_bytes": mem if mem is not None else est,
                   "memory_source": "device" if mem is not None else "compiled_estimate"}
            if eval_fn is not None and (n % cfg.val_every == 0 or n == cfg.num_iterations):
                rec["val_loss"] = evaluate(state["params"])
            history.append(rec)
            writer.write(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if _log_due(cfg, n, start, rec, last_line):
                tqdm.write(log_lib.format_line(n, cfg.num_iterations, rec), file=out)
                last_line = time.perf_counter()
            if setup.sampler is not None and setup.sampler.due(n):  # after the step's timing
                tqdm.write(setup.sampler.report(state["params"], n), file=out)
            if cfg.checkpoint_dir and (n == cfg.num_iterations or (cfg.checkpoint_every and n % cfg.checkpoint_every == 0)):
                save(n)
                last_saved = n
            if checkpointer:
                checkpointer.check()  # a failed asynchronous save surfaces here, at the save that failed
            if signals.pending():
                break
    finally:
        profiler.close()
        bar.close()
        writer.close()
        if checkpointer:
            checkpointer.close()  # waits for in-flight saves: the last good checkpoint is complete
    if stopped:
        raise TrainingDiverged(stopped)
    sig = signals.pending()
    if sig:
        kept = (f"checkpoint step {last_saved} in {cfg.checkpoint_dir} is complete; continue with --resume"
                if last_saved is not None else "no checkpoint was written"
                + ("" if cfg.checkpoint_dir else " (no --checkpoint_dir)"))
        raise Interrupted(f"{signals.stop_words(sig)} after step {n} of {cfg.num_iterations}; {kept}",
                          signals.exit_code(sig))
    wall = time.perf_counter() - t_run
    if history:
        first, last = history[0]["loss"], history[-1]["loss"]
        avg = f"{1000 * np.mean(times):.0f} ms/step (first step excluded)" if times else "n/a"
        val = [h["val_loss"] for h in history if "val_loss" in h]
        tail = np.mean([h["loss"] for h in history[-max(1, len(history) // 10):]])
        print(f"done     {len(history)} steps in {wall:.1f} s, {avg}; loss {first:.4f} -> {last:.4f} "
              f"(mean of the last 10% of steps {tail:.4f})"
              + (f", val loss {val[-1]:.4f}" if val else "")
              + (f"; checkpoint step {last_saved} in {cfg.checkpoint_dir}" if cfg.checkpoint_dir else ""), file=out)
    return RunResult(history, state, setup)


def _log_due(cfg, n: int, start: int, rec: dict, last_line: float) -> bool:
    """Whether step n gets its line: every `log_every` steps, or (0) the first, the last, a step with
    a validation loss and otherwise one about every LOG_SECONDS."""
    if n in (start + 1, cfg.num_iterations) or "val_loss" in rec:
        return True
    if cfg.log_every:
        return n % cfg.log_every == 0
    return time.perf_counter() - last_line >= LOG_SECONDS
