"""Resuming and starting a run: which saved step to continue from (`choose_resume_step`, checked
while preparing) and the train state the loop starts with (`initial_state`: restored, from
`--init_from` weights, or fresh).

Example:
    >>> setup = prepare(TrainConfig(preset="tiny", checkpoint_dir="runs/a", resume=True))
    >>> state, position, setup = initial_state(setup)   # setup: start_step after any fallback
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

from remat_lm.training import saving
from remat_lm.training.compile import abstract_with_sharding, init_config, init_jit, optimizer
from remat_lm.training.config import TrainConfig, UsageError
from remat_lm.training.model import config_dict
from remat_lm.training.optim import optimizer_settings

# TrainConfig fields that may differ when resuming: recompute settings, logging and evaluation,
# checkpoint cadence, the step count to stop at, and where it runs (the mesh). Every other field
# (model, data, batch, optimizer, seed, dtype, dropout...) must equal the stored run config.
RESUME_MAY_CHANGE = frozenset({
    "activation_recompute", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "recompute_modules", "remat_policy", "use_reentrant", "memory_budget",
    "log_jsonl", "progress", "val_every", "val_steps", "memory_report", "dry_run",
    "num_iterations", "checkpoint_dir", "checkpoint_every", "keep_checkpoints", "resume", "init_from", "mesh",
    "recompute_segments", "recompute_every", "cpu_checkpointing", "deepspeed_config", "loss_chunk",
    "preflight", "profile_steps", "sample_every", "sample_length", "prompt", "temperature", "top_k", "tokenizer",
    "sequence_parallel", "distribute_saved_activations", "target",
})
# NOTE: the learning-rate schedule on resume. --lr_decay_iters defaults to --num_iterations, so a
# finished 6-step run resumed with --num_iterations 12 (what the "already at step" error advises)
# would stretch its cosine to 12 steps, the learning rate at step 7 jumping from the schedule's
# floor back up (x7 with --warmup_iters 2). So a resume keeps the saved run's schedule length (its effective --lr_decay_iters) unless the flag
# is passed, and says so on the resume line; an explicit --lr_decay_iters that differs is a
# deliberate change, allowed and listed with the other changes. Compared as effective values, so
# passing the saved length explicitly is no change.
SCHEDULE_FLAG = "lr_decay_iters"


def _decay_iters(train_config: dict) -> int | None:
    """The schedule length a run used: its --lr_decay_iters, else its --num_iterations."""
    return train_config.get(SCHEDULE_FLAG) or train_config.get("num_iterations")


def _warn(message: str) -> None:
    sys.stderr.write("warning: " + " ".join(message.split()) + "\n")
    sys.stderr.flush()


def choose_resume_step(setup, info, mcfg_dict: dict):
    """The setup resuming from the newest step of --checkpoint_dir whose metadata and array metadata
    read back and match this run; newer damaged steps are skipped with a one-line warning each
    (their data is checked again, against the saved digest, when `initial_state` restores it)."""
    cfg, d = setup.cfg, setup.cfg.checkpoint_dir
    damaged = list(info.damaged)
    older = sorted((s for s in info.steps if s <= info.step), reverse=True)
    for i, step in enumerate(older):
        try:
            meta = info.meta if step == info.step else saving.step_meta(d, step, "--resume")
            changes = _check_resume_step(cfg, d, step, meta, mcfg_dict, setup.abstract_state)
        except saving.CheckpointDamaged as e:
            damaged.append((step, str(e)))
            continue
        for s_, why in damaged:
            _warn(f"--resume {d}: {why}; falling back to step {step}, the newest intact one")
        setup = _keep_schedule(setup, meta)
        return dataclasses.replace(setup, start_step=step, resume_meta=meta, resume_changes=tuple(changes),
                                   resume_older=tuple(older[i + 1:]), damaged_steps=tuple(s_ for s_, _ in damaged))
    raise UsageError(f"--resume {d}: no step is intact ({damaged[0][1]}); run without --resume in a new "
                     f"--checkpoint_dir to start fresh")


def _keep_schedule(setup, meta: dict):
    """The setup with the saved run's schedule length when --lr_decay_iters was not passed and the
    default (--num_iterations) would change it; see the NOTE on SCHEDULE_FLAG."""
    cfg = setup.cfg
    saved = _decay_iters(meta.get("train_config") or {})
    if getattr(cfg, SCHEDULE_FLAG) is not None or saved is None or saved == cfg.num_iterations:
        return setup
    cfg = dataclasses.replace(cfg, **{SCHEDULE_FLAG: saved})
    tx, schedule = optimizer(optimizer_settings(cfg))
    note = (f"the learning-rate schedule stays the saved run's: --lr_decay_iters {saved} (it would follow "
            f"--num_iterations {cfg.num_iterations}; pass --lr_decay_iters to change it)")
    return dataclasses.replace(setup, cfg=cfg, tx=tx, schedule=schedule, schedule_note=note)


def _check_resume_step(cfg: TrainConfig, directory: str, step: int, meta: dict, mcfg_dict: dict,
                       abstract_state) -> list[str]:
    """UsageError unless checkpoint `step` can continue this run; returns the allowed flag changes."""
    saving.check_compatible(saving.DirInfo(step, meta), directory, cfg.model, mcfg_dict, "--resume")
    saved_cfg = meta.get("train_config") or {}
    now = cfg.to_dict()
    norm = lambda v: tuple(v) if isinstance(v, list) else v
    diff = [k for k in now if k in saved_cfg and k != SCHEDULE_FLAG and norm(saved_cfg[k]) != norm(now[k])]
    bad = [k for k in diff if k not in RESUME_MAY_CHANGE]
    show = lambda k: f"--{k} {now[k]!r} (checkpoint: {norm(saved_cfg[k])!r})"
    if bad:
        raise UsageError(f"--resume {directory}: step {step} was trained with other settings: "
                         f"{', '.join(show(k) for k in bad)}; resume with the flags it was trained with (only "
                         f"recompute settings, logging, evaluation, checkpoint cadence, --mesh, --num_iterations "
                         f"and --lr_decay_iters may change)")
    changes = [show(k) for k in diff if k not in ("resume", "checkpoint_dir")]
    saved_decay = _decay_iters(saved_cfg)
    if now.get(SCHEDULE_FLAG) is not None and saved_decay is not None and now[SCHEDULE_FLAG] != saved_decay:
        changes.append(f"--{SCHEDULE_FLAG} {now[SCHEDULE_FLAG]!r} (checkpoint: {saved_decay!r})")
    if step >= cfg.num_iterations:
        raise UsageError(f"--resume: {directory} is already at step {step} >= --num_iterations "
                         f"{cfg.num_iterations}; raise --num_iterations to train on (the learning rate keeps "
                         f"the saved schedule, --lr_decay_iters {saved_decay or cfg.num_iterations}, unless you "
                         f"pass --lr_decay_iters)")
    _check_saved_state(directory, step, abstract_state)
    return changes


def _check_saved_state(directory: str, step: int, abstract_state) -> None:
    """UsageError unless the saved state has exactly this run's leaves and shapes."""
    saved, want = saving.saved_shapes(directory, step), saving.leaf_shapes(abstract_state)
    if saved != want:
        diff = sorted(set(saved.items()) ^ set(want.items()))[:2]
        raise UsageError(f"--resume {directory}: step {step} holds a train state of another structure than this "
                         f"run's (e.g. {diff}); resume with the flags it was written with")


def initial_state(setup):
    """(train state, data position, setup): the state restored (--resume), from --init_from weights, or
    fresh. On --resume the returned setup names the step actually restored (`start_step`,
    `resume_meta`) and the damaged steps skipped on the way (`damaged_steps`)."""
    cfg = setup.cfg
    if setup.resume_meta is not None:
        abstract = abstract_with_sharding(setup.abstract_state, setup.state_sharding)
        d, mcfg_dict = cfg.checkpoint_dir, config_dict(setup.base_mcfg)
        steps = [setup.start_step, *setup.resume_older]
        for i, step in enumerate(steps):
            try:
                if i:
                    _check_resume_step(cfg, d, step, saving.step_meta(d, step, "--resume"), mcfg_dict,
                                       setup.abstract_state)
                state, meta = saving.restore(d, step, abstract)
            except saving.CheckpointDamaged as e:
                if i + 1 == len(steps):
                    raise UsageError(f"--resume {d}: {e}, and no older step is intact; run without --resume in a "
                                     f"new --checkpoint_dir to start fresh") from None
                _warn(f"--resume {d}: {e}; falling back to step {steps[i + 1]}, the newest intact one")
                setup = dataclasses.replace(setup, damaged_steps=setup.damaged_steps + (step,))
                continue
            return state, int(meta["data_position"]), dataclasses.replace(setup, start_step=step, resume_meta=meta)
    if setup.init_params is not None:
        params = setup.init_params
    elif setup.init_dir_step is not None:
        abstract = {"params": abstract_with_sharding(setup.abstract_state["params"], setup.state_sharding["params"])}
        try:
            params = saving.restore(cfg.init_from, setup.init_dir_step, abstract, partial=True)[0]["params"]
        except saving.CheckpointDamaged as e:
            raise UsageError(f"--init_from {cfg.init_from}: {e}; pass an intact checkpoint directory") from None
    else:
        return init_jit(setup.fam.name, init_config(setup.base_mcfg), setup.mesh)(cfg.seed), 0, setup
    return _fresh_with_params(setup, jax.device_put(params, setup.state_sharding["params"])), 0, setup


def _fresh_with_params(setup, params):
    """A step-0 train state around given parameters (same rng as a fresh init with the seed)."""
    tx, seed = setup.tx, setup.cfg.seed

    def build(p):
        rng = jax.random.split(jax.random.PRNGKey(seed))[1]
        return {"params": p, "opt_state": tx.init(p), "step": jnp.zeros((), jnp.int32), "rng": rng}

    return jax.jit(build, out_shardings=setup.state_sharding)(params)
