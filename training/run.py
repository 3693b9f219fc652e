"""The training run: validate everything (`prepare`), then train, report memory, or dry-run.

`prepare` does every check that can fail on user input (flags against the model, data files,
`--init_from`, `--resume`, the mesh against the devices and the batch) and raises UsageError
before anything is written. `run` then trains: a tqdm bar, one dense line per step, optional
JSONL, validation, asynchronous orbax checkpoints, and a stop with a clear message on a
non-finite loss.

Example:
    >>> from training import TrainConfig, run
    >>> result = run(TrainConfig(preset="tiny", num_iterations=3, progress=False))
    >>> result.history[-1]["loss"]
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import remat
from models.llmc_io import LlmcFormatError
from training import checkpoint as ckpt
from training import checks
from training import data as data_lib
from training import log as log_lib
from training import preflight
from training import sharding as sh
from training import signals
from models import attention
from training.config import TrainConfig, UsageError, parse_mesh
from training.model import Family, config_dict, family
from training.optim import make_optimizer, optimizer_settings
from training.profile import StepProfiler
from training.samples import make_sampler
from training.step import init_state, make_eval_step, make_train_step

VAL_FRACTION = 0.02


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; the message says which step and what was kept."""


class Interrupted(RuntimeError):
    """SIGINT/SIGTERM stopped training at a step boundary (in-flight save completed); `code` is the
    exit status (130 / 143) and the message says what was kept."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


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
    "sequence_parallel", "distribute_saved_activations",
})


def _warn(message: str) -> None:
    sys.stderr.write("warning: " + " ".join(message.split()) + "\n")
    sys.stderr.flush()


def _oom_error(cfg: TrainConfig, where: str, e: BaseException) -> UsageError:
    detail = " ".join(str(e).split())[:200] if not isinstance(e, MemoryError) else "host MemoryError"
    return UsageError(f"out of memory {where} ({detail}); lower --batch_size ({cfg.batch_size}) or "
                      f"--sequence_length ({cfg.sequence_length}), add --grad_accum_steps, or turn on "
                      f"--activation_recompute (see --memory_report)")


@dataclasses.dataclass
class Setup:
    """Everything `prepare` validated and built; nothing has been written yet."""
    cfg: TrainConfig
    fam: Family
    mcfg: Any                      # the model config of the run (first recompute config)
    mcfgs: list                    # [(label, model config)] one per --recompute_method entry
    train_ds: data_lib.Dataset
    val_ds: data_lib.Dataset | None
    mesh: Any
    tx: Any
    schedule: Any
    abstract_state: Any
    state_sharding: Any
    x_sharding: Any
    start_step: int = 0
    resume_meta: dict | None = None
    resume_older: tuple = ()           # older steps to fall back to if the start step fails to restore
    resume_changes: tuple = ()         # "--flag new (was old)" for allowed changes on --resume
    damaged_steps: tuple = ()          # steps newer than the start found damaged (set aside before saving)
    init_params: Any = None            # parameters read from --init_from FILE.bin (shape from its header)
    init_dir_step: int | None = None   # step to read params from for --init_from DIR
    sampler: Any = None                # training.samples.Sampler for --sample_every


@dataclasses.dataclass
class RunResult:
    """What a run produced: one record per step (the JSONL objects) and the final state."""
    history: list
    state: Any = None
    setup: Setup | None = None
    stopped: str | None = None


def _model_config(cfg: TrainConfig, fam: Family, recompute, vocab_size: int, block_size: int):
    over = dict(vocab_size=vocab_size, block_size=block_size, dtype=cfg.dtype, dropout=cfg.dropout,
                scan_layers=cfg.scan_layers, recompute=recompute, loss_chunk=cfg.loss_chunk,
                attention=cfg.attention, attention_tile=cfg.attention_tile)
    for k in ("n_layer", "n_head", "n_embd"):
        if getattr(cfg, k) is not None:
            over[k] = getattr(cfg, k)
    try:
        mcfg = fam.config(cfg.preset, **over)
        # cudnn where it cannot run is a usage error now, not a trace-time failure later
        attention.resolve(mcfg.attention, mcfg.compute_dtype, mcfg.n_embd // mcfg.n_head, mcfg.dropout > 0)
        return mcfg
    except ValueError as e:
        raise UsageError(str(e).replace("attention='cudnn'", "--attention cudnn").replace("attention='tiled' (--attention tiled)", "--attention tiled")) from None


def _load_data(paths, what):
    try:
        return data_lib.load(paths, what)
    except LlmcFormatError as e:
        raise UsageError(f"{what} {e}") from None


# Model config fields an llm.c header fixes, and the flags that may also set them.
_SHAPE_FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")


def _load_llmc(cfg: TrainConfig, fam: Family):
    """--init_from FILE.bin: (model config from the file's header, parameters), via models.llmc.load.

    Every shape field comes from the header (the preset is not consulted for shapes); a shape flag
    that disagrees with it is a UsageError naming both values. LLaMA-3 files from llm.c master
    (float header slots truncated to integers) are read with the preset's values for those slots.
    """
    from models import llmc

    path = cfg.init_from
    kw = dict(scan_layers=cfg.scan_layers, dtype=cfg.dtype)
    try:
        try:
            mcfg, params = llmc.load(path, **kw)
        except LlmcFormatError as e:
            if cfg.model != "llama3" or "truncated integers" not in str(e):
                raise
            base = fam.config(cfg.preset)
            mcfg, params = llmc.load(path, norm_eps=base.norm_eps, rope_theta=base.rope_theta,
                                     ffn_dim_multiplier=base.ffn_dim_multiplier, **kw)
    except (LlmcFormatError, ValueError) as e:
        raise UsageError(f"--init_from {e}") from None
    kind = "gpt2" if type(mcfg).__name__ == "GPT2Config" else "llama3"
    if kind != cfg.model:
        raise UsageError(f"--init_from {path} is an llm.c {kind} model but this run is --model {cfg.model}; "
                         f"pass --model {kind}")
    bad = [f"--{k} {getattr(cfg, k)} but the file has {k} {getattr(mcfg, k)}" for k in _SHAPE_FLAGS
           if getattr(cfg, k) is not None and getattr(cfg, k) != getattr(mcfg, k)]
    if bad:
        raise UsageError(f"--init_from {path}: the model shape comes from the file's header: {'; '.join(bad)}; "
                         f"drop those flags (or pass a file written with that shape)")
    return dataclasses.replace(mcfg, dropout=cfg.dropout), params


def prepare(cfg: TrainConfig) -> Setup:
    """Validate the run against files, devices and the model; build what training needs.

    Raises UsageError (one line, naming the fix) for every bad input. Writes nothing.
    """
    sh.maybe_initialize_distributed()
    fam = family(cfg.model)
    recomputes = cfg.recompute_configs()
    train_ds = _load_data(cfg.data, "--data")

    base = fam.config(cfg.preset)
    init_is_file = bool(cfg.init_from) and not os.path.isdir(cfg.init_from)
    if cfg.init_from and not os.path.exists(cfg.init_from):
        raise UsageError(f"--init_from {cfg.init_from}: no such file or directory; pass an llm.c .bin model "
                         f"file or a train.py checkpoint directory")
    file_mcfg = init_params = None
    if init_is_file:
        file_mcfg, init_params = _load_llmc(cfg, fam)
        base = file_mcfg
    if cfg.vocab_size is not None:
        vocab = cfg.vocab_size
    elif train_ds.kind == "text" and not cfg.init_from:
        vocab = data_lib.BYTE_VOCAB
    else:
        vocab = base.vocab_size
    if cfg.block_size is not None:
        block = cfg.block_size
    elif cfg.init_from:
        block = base.block_size
    else:
        block = max(base.block_size, cfg.sequence_length)
    if file_mcfg is not None:
        mcfgs = [(label, dataclasses.replace(file_mcfg, recompute=rc)) for label, rc in recomputes]
    else:
        mcfgs = [(label, _model_config(cfg, fam, rc, vocab, block)) for label, rc in recomputes]
    mcfg = mcfgs[0][1]
    if cfg.sequence_length > mcfg.block_size:
        raise UsageError(f"--sequence_length {cfg.sequence_length} exceeds the model's block_size "
                         f"{mcfg.block_size}; use --sequence_length <= {mcfg.block_size}")

    train_ds.check(mcfg.vocab_size, cfg.sequence_length, "--data")
    val_ds = None
    if cfg.val_data:
        val_ds = _load_data(cfg.val_data, "--val_data")
        val_ds.check(mcfg.vocab_size, cfg.sequence_length, "--val_data")
        if val_ds.kind != train_ds.kind:
            raise UsageError(f"--val_data is {val_ds.kind} but --data is {train_ds.kind}; pass the same kind")
    elif cfg.val_every > 0:
        train_ds, val_ds = train_ds.split_tail(VAL_FRACTION, cfg.sequence_length + 1)

    sampler = make_sampler(cfg, mcfg, train_ds, val_ds)  # validates --tokenizer and --prompt
    mesh = sh.make_mesh(parse_mesh(cfg.mesh), cfg.batch_size)
    checks.check_model_size(fam.num_params(mcfg), parse_mesh(cfg.mesh)["fsdp"], list(mesh.devices.flat))
    sh.check_tensor(mcfg, parse_mesh(cfg.mesh), cfg.sequence_length, cfg.sequence_parallel)
    tx, schedule = _optimizer(optimizer_settings(cfg))
    abstract_state = jax.eval_shape(lambda: init_state(fam, mcfg, tx, cfg.seed))
    state_sharding = sh.state_shardings(mesh, abstract_state)
    setup = Setup(cfg, fam, mcfg, mcfgs, train_ds, val_ds, mesh, tx, schedule, abstract_state, state_sharding,
                  sh.batch_sharding(mesh, 3, 1), sampler=sampler)
    if cfg.memory_report:
        return setup

    if cfg.checkpoint_dir:
        checks.check_output_dir(cfg.checkpoint_dir, "--checkpoint_dir")
    if cfg.log_jsonl:
        checks.check_output_file(cfg.log_jsonl, "--log_jsonl")
    mcfg_dict = config_dict(mcfg)
    if cfg.checkpoint_dir:
        info = ckpt.inspect_dir(cfg.checkpoint_dir, "--resume" if cfg.resume else "--checkpoint_dir")
        if cfg.resume:
            if info.step is None:
                raise UsageError(f"--resume: {cfg.checkpoint_dir} holds no complete checkpoint (it is empty or "
                                 f"missing); run without --resume to start fresh")
            _choose_resume_step(setup, info, mcfg_dict)
        elif info.step is not None:
            raise UsageError(f"--checkpoint_dir {cfg.checkpoint_dir} already holds checkpoints (latest step "
                             f"{info.step}); pass --resume to continue, or choose a new directory")

    if init_params is not None:
        setup.init_params = init_params
    elif cfg.init_from:
        info = ckpt.inspect_dir(cfg.init_from, "--init_from")
        if info.step is None:
            raise UsageError(f"--init_from {cfg.init_from}: the directory holds no complete checkpoint; pass an "
                             f"llm.c .bin file or a train.py --checkpoint_dir")
        if info.meta.get("model") != cfg.model:
            raise UsageError(f"--init_from {cfg.init_from} holds a {info.meta.get('model')} model but this run is "
                             f"--model {cfg.model}; pass --model {info.meta.get('model')}")
        saved = {k: v for k, v in ckpt.saved_shapes(cfg.init_from, info.step).items() if k.startswith("params.")}
        want = ckpt.leaf_shapes({"params": abstract_state["params"]})
        if saved != want:
            diff = sorted(set(saved.items()) ^ set(want.items()))[:2]
            raise UsageError(f"--init_from {cfg.init_from}: its parameter shapes do not match --preset {cfg.preset} "
                             f"(e.g. {diff}); pass the preset and --scan_layers setting it was trained with")
        setup.init_dir_step = info.step
    return setup


def _choose_resume_step(setup: Setup, info, mcfg_dict: dict) -> None:
    """The newest step of --checkpoint_dir whose metadata and array metadata read back and match this
    run; newer damaged steps are skipped with a one-line warning each (their data is checked again,
    against the saved digest, when `_initial_state` restores it)."""
    cfg, d = setup.cfg, setup.cfg.checkpoint_dir
    damaged = list(info.damaged)
    older = sorted((s for s in info.steps if s <= info.step), reverse=True)
    for i, step in enumerate(older):
        try:
            meta = info.meta if step == info.step else ckpt.step_meta(d, step, "--resume")
            changes = _check_resume_step(cfg, d, step, meta, mcfg_dict, setup.abstract_state)
        except ckpt.CheckpointDamaged as e:
            damaged.append((step, str(e)))
            continue
        for s_, why in damaged:
            _warn(f"--resume {d}: {why}; falling back to step {step}, the newest intact one")
        setup.start_step, setup.resume_meta, setup.resume_changes = step, meta, tuple(changes)
        setup.resume_older, setup.damaged_steps = tuple(older[i + 1:]), tuple(s_ for s_, _ in damaged)
        return
    raise UsageError(f"--resume {d}: no step is intact ({damaged[0][1]}); run without --resume in a new "
                     f"--checkpoint_dir to start fresh")


def _check_resume_step(cfg: TrainConfig, directory: str, step: int, meta: dict, mcfg_dict: dict,
                       abstract_state) -> list[str]:
    """UsageError unless checkpoint `step` can continue this run; returns the allowed flag changes."""
    ckpt.check_compatible(ckpt.DirInfo(step, meta), directory, cfg.model, mcfg_dict, "--resume")
    saved_cfg = meta.get("train_config") or {}
    now = cfg.to_dict()
    norm = lambda v: tuple(v) if isinstance(v, list) else v
    diff = [k for k in now if k in saved_cfg and norm(saved_cfg[k]) != norm(now[k])]
    bad = [k for k in diff if k not in RESUME_MAY_CHANGE]
    show = lambda k: f"--{k} {now[k]!r} (checkpoint: {norm(saved_cfg[k])!r})"
    if bad:
        raise UsageError(f"--resume {directory}: step {step} was trained with other settings: "
                         f"{', '.join(show(k) for k in bad)}; resume with the flags it was trained with (only "
                         f"recompute settings, logging, evaluation, checkpoint cadence, --mesh and --num_iterations "
                         f"may change)")
    if step >= cfg.num_iterations:
        raise UsageError(f"--resume: {directory} is already at step {step} >= --num_iterations "
                         f"{cfg.num_iterations}; raise --num_iterations to train on")
    _check_saved_state(directory, step, abstract_state)
    return [show(k) for k in diff if k not in ("resume", "checkpoint_dir")]


def _check_saved_state(directory: str, step: int, abstract_state) -> None:
    """UsageError unless the saved state has exactly this run's leaves and shapes."""
    saved, want = ckpt.saved_shapes(directory, step), ckpt.leaf_shapes(abstract_state)
    if saved != want:
        diff = sorted(set(saved.items()) ^ set(want.items()))[:2]
        raise UsageError(f"--resume {directory}: step {step} holds a train state of another structure than this "
                         f"run's (e.g. {diff}); resume with the flags it was written with")


# ------------------------------------------------------------------------------------------------
# Compilation


# NOTE: compiled programs are cached per process, keyed by everything they depend on, so that
# runs in one process (notebooks, tests, a resume after a run) share compilations. A training
# run from the CLI compiles each program once either way.

@functools.lru_cache(maxsize=16)
def _optimizer(settings: tuple):
    return make_optimizer(*settings)


def _init_config(mcfg):
    """The model config with everything that does not change the initial parameters reset."""
    return dataclasses.replace(mcfg, recompute=type(mcfg.recompute)(), dropout=0.0, dtype="float32", loss_chunk=0)


# The optimizer state's structure and initial values do not depend on the hyperparameters.
_INIT_OPTIMIZER = (1.0, 0, 1, 0.0, 0.0, 1.0)


@functools.lru_cache(maxsize=8)
def _init_jit(fam_name: str, init_mcfg, mesh):
    fam, (tx, _) = family(fam_name), _optimizer(_INIT_OPTIMIZER)
    fn = lambda seed: init_state(fam, init_mcfg, tx, seed)
    abstract = jax.eval_shape(fn, 0)
    return jax.jit(fn, out_shardings=sh.state_shardings(mesh, abstract))


_COMPILED: collections.OrderedDict = collections.OrderedDict()
_COMPILED_MAX = 8


def compile_train_step(setup: Setup, mcfg=None):
    """AOT-compile the train step for the run's shapes and shardings (cached per process)."""
    cfg = setup.cfg
    mcfg = sh.model_sharding(setup.mcfg if mcfg is None else mcfg, setup.mesh, cfg.sequence_parallel)
    key = (setup.fam.name, mcfg, optimizer_settings(cfg), cfg.dropout, setup.mesh, cfg.grad_accum_steps,
           cfg.batch_size, cfg.sequence_length)
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    fn = make_train_step(setup.fam, mcfg, setup.tx, setup.schedule, cfg.dropout)
    jitted = jax.jit(fn, in_shardings=(setup.state_sharding, setup.x_sharding, setup.x_sharding),
                     out_shardings=(setup.state_sharding, sh.replicated(setup.mesh)), donate_argnums=(0,))
    b = _batch_struct(setup)
    with jax.set_mesh(setup.mesh):  # the model's tensor/sequence-parallel constraints are PartitionSpecs
        compiled = jitted.lower(_abstract_with_sharding(setup.abstract_state, setup.state_sharding), b, b).compile()
    _COMPILED[key] = compiled
    while len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return compiled


def _batch_struct(setup: Setup):
    c = setup.cfg
    return jax.ShapeDtypeStruct((c.grad_accum_steps, c.batch_size, c.sequence_length), jnp.int32,
                                sharding=setup.x_sharding)


def _abstract_with_sharding(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def plan_memory(setup: Setup, out=None):
    """--recompute_method auto: choose a setting per layer that fits --memory_budget
    (`remat.plan_for_budget` on the real train step), print the plan, and make it the run's
    recompute config. A budget below what full remat needs is a UsageError stating the minimum."""
    from models.memory_model import activation_bytes

    cfg, base = setup.cfg, setup.mcfg
    print(f"planner  fitting the train step into --memory_budget {cfg.memory_budget} per device "
          f"(compiling candidate settings)", file=out)
    try:
        plan = remat.plan_for_budget(
            lambda rc: compile_train_step(setup, dataclasses.replace(base, recompute=rc)), base.n_layer,
            cfg.memory_budget_bytes, layer_bytes=activation_bytes(base, cfg.batch_size, cfg.sequence_length)[0])
    except ValueError as e:
        raise UsageError(f"--memory_budget {cfg.memory_budget}: {e}") from None
    print(plan.table(), file=out)
    setup.mcfg = dataclasses.replace(base, recompute=plan.recompute_config())
    setup.mcfgs = [("auto", setup.mcfg)]
    return plan


# ------------------------------------------------------------------------------------------------
# Memory report and dry run


def memory_report(setup: Setup) -> str:
    """What the backward keeps (by tagged name) and XLA's compiled memory, one column per config."""
    cfg = setup.cfg
    params = setup.abstract_state["params"]
    xy = jax.ShapeDtypeStruct((cfg.batch_size, cfg.sequence_length), jnp.int32)
    cols = []
    for label, mcfg in setup.mcfgs:
        with jax.set_mesh(setup.mesh):  # --distribute_saved_activations constrains with PartitionSpecs
            res = remat.memory.saved_residuals(lambda p, x, y, m=mcfg: setup.fam.loss_fn(p, m, x, y), params, xy, xy)
        ma = compile_train_step(setup, mcfg).memory_analysis()
        g = lambda k: int(getattr(ma, k, 0) or 0) if ma is not None else 0
        comp = {"temp": g("temp_size_in_bytes"), "arguments": g("argument_size_in_bytes"),
                "outputs": g("output_size_in_bytes"), "aliased": g("alias_size_in_bytes")}
        comp["peak estimate"] = comp["arguments"] + comp["outputs"] + comp["temp"] - comp["aliased"]
        cols.append((label, res, comp))
    names = []
    for _, res, _ in cols:
        names += [k for k in res.by_name() if k not in names]
    w0, w = 46, max(18, *(len(c[0]) + 2 for c in cols))
    mib = lambda b: f"{b / 2**20:,.2f} MiB" if b >= 2**20 else f"{b / 2**10:,.1f} KiB"
    dev = setup.mesh.devices.flat[0]
    lines = [f"memory report: {cfg.model} {cfg.preset} ({setup.fam.num_params(setup.mcfg):,} params), micro-batch "
             f"{cfg.batch_size}x{cfg.sequence_length}, {cfg.dtype}, mesh {cfg.mesh} on {setup.mesh.size} "
             f"{dev.platform} device(s)",
             "", "saved for the backward of one micro-batch (count x size), by tagged name",
             "".ljust(w0) + "".join(c[0].rjust(w) for c in cols)]
    for n in names:
        cells = []
        for _, res, _ in cols:
            c, b = res.by_name().get(n, (0, 0))
            cells.append(f"{c} x {mib(b)}" if c else "-")
        lines.append(f"  {n[:w0 - 2]}".ljust(w0) + "".join(x.rjust(w) for x in cells))
    lines.append("  total (intermediates)".ljust(w0) + "".join(mib(r.intermediates).rjust(w) for _, r, _ in cols))
    lines.append("  total (with arguments)".ljust(w0) + "".join(mib(r.total).rjust(w) for _, r, _ in cols))
    lines += ["", "XLA's compiled train step, per device", "".ljust(w0) + "".join(c[0].rjust(w) for c in cols)]
    for k in ("temp", "arguments", "outputs", "aliased", "peak estimate"):
        lines.append(f"  {k}".ljust(w0) + "".join(mib(comp[k]).rjust(w) for _, _, comp in cols))
    wl = max(len(c[0]) for c in cols) + 2
    lines += ["", "summary, one row per setting",
              "  " + "setting".ljust(wl) + "saved (intermediates)".rjust(22) + "compiled temp".rjust(16)
              + "peak estimate".rjust(16)]
    for label, res, comp in cols:
        lines.append("  " + label.ljust(wl) + mib(res.intermediates).rjust(22) + mib(comp["temp"]).rjust(16)
                     + mib(comp["peak estimate"]).rjust(16))
    return "\n".join(lines)


def describe(setup: Setup, compiled=None) -> str:
    """A summary of the run (printed at the start and by --dry_run)."""
    cfg, m = setup.cfg, setup.mcfg
    rc = m.recompute
    segs = remat.plan(m.n_layer, rc) if rc.enabled else ()
    regions = sum(1 for s in segs if s.checkpointed)
    lines = [
        f"model    {cfg.model} {cfg.preset if setup.init_params is None else 'from ' + str(cfg.init_from)}: "
        f"{setup.fam.num_params(m):,} params, {m.n_layer} layers, "
        f"width {m.n_embd}, vocab {m.vocab_size}, block {m.block_size}, {m.dtype}"
        + (", scan" if m.scan_layers else ""),
        f"remat    {setup.mcfgs[0][0]}" + (f" ({regions} recompute regions, policy {rc.effective_policy() if rc.layer_policies is None else 'per layer'}"
                                            f"{', reentrant' if rc.use_reentrant else ''})" if rc.enabled else "")
        + (f"; loss over chunks of {m.loss_chunk} positions" if m.loss_chunk else ""),
        f"data     {setup.train_ds.description}: {setup.train_ds.n_tokens:,} tokens"
        + (f"; val {setup.val_ds.description}: {setup.val_ds.n_tokens:,} tokens" if setup.val_ds else ""),
        f"batch    {cfg.batch_size} x {cfg.sequence_length} x {cfg.grad_accum_steps} accum = "
        f"{cfg.tokens_per_step:,} tokens/step, {setup.fam.flops_per_token(m, cfg.sequence_length) / 1e6:,.1f} "
        f"MFLOP/token",
        f"mesh     {cfg.mesh} over {setup.mesh.size} {setup.mesh.devices.flat[0].platform} device(s)",
    ]
    lines[2:2] = [f"deepspeed {note}" for note in cfg.deepspeed_notes()]
    if compiled is not None:
        lines.append(f"memory   {log_lib.gib(log_lib.compiled_estimate(compiled))} per device (compiled est.)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Training


def _initial_state(setup: Setup):
    """(train state, data position): restored (--resume), from --init_from weights, or fresh."""
    cfg = setup.cfg
    if setup.resume_meta is not None:
        abstract = _abstract_with_sharding(setup.abstract_state, setup.state_sharding)
        d, mcfg_dict = cfg.checkpoint_dir, config_dict(setup.mcfg)
        steps = [setup.start_step, *setup.resume_older]
        for i, step in enumerate(steps):
            try:
                if i:
                    _check_resume_step(cfg, d, step, ckpt.step_meta(d, step, "--resume"), mcfg_dict,
                                       setup.abstract_state)
                state, meta = ckpt.restore(d, step, abstract)
            except ckpt.CheckpointDamaged as e:
                if i + 1 == len(steps):
                    raise UsageError(f"--resume {d}: {e}, and no older step is intact; run without --resume in a "
                                     f"new --checkpoint_dir to start fresh") from None
                _warn(f"--resume {d}: {e}; falling back to step {steps[i + 1]}, the newest intact one")
                setup.damaged_steps += (step,)
                continue
            setup.start_step, setup.resume_meta = step, meta
            return state, int(meta["data_position"])
    if setup.init_params is not None:
        params = setup.init_params
    elif setup.init_dir_step is not None:
        abstract = {"params": _abstract_with_sharding(setup.abstract_state["params"], setup.state_sharding["params"])}
        try:
            params = ckpt.restore(cfg.init_from, setup.init_dir_step, abstract, partial=True)[0]["params"]
        except ckpt.CheckpointDamaged as e:
            raise UsageError(f"--init_from {cfg.init_from}: {e}; pass an intact checkpoint directory") from None
    else:
        return _init_jit(setup.fam.name, _init_config(setup.mcfg), setup.mesh)(cfg.seed), 0
    return _fresh_with_params(setup, jax.device_put(params, setup.state_sharding["params"])), 0


def _fresh_with_params(setup: Setup, params):
    """A step-0 train state around given parameters (same rng as a fresh init with the seed)."""
    tx, seed = setup.tx, setup.cfg.seed

    def build(p):
        rng = jax.random.split(jax.random.PRNGKey(seed))[1]
        return {"params": p, "opt_state": tx.init(p), "step": jnp.zeros((), jnp.int32), "rng": rng}

    return jax.jit(build, out_shardings=setup.state_sharding)(params)


def _finite(*xs) -> bool:
    return all(math.isfinite(float(x)) for x in xs)


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
    if cfg.recompute_method == "auto":
        plan_memory(setup, out)
    if cfg.memory_report:
        print(memory_report(setup), file=out)
        return RunResult([], None, setup, stopped="memory_report")
    signals.set_phase("compiling the train step")
    model = cfg.preset if setup.init_params is None else f"from {cfg.init_from}"
    print(f"compile  the train step ({cfg.model} {model}, micro-batch {cfg.batch_size}x{cfg.sequence_length})",
          file=out, flush=True)
    t_compile = time.perf_counter()
    try:
        compiled = compile_train_step(setup)
    except Exception as e:
        if remat.memory.is_oom(e):
            raise _oom_error(cfg, "compiling the train step", e) from None
        raise
    t_compile = time.perf_counter() - t_compile
    if cfg.preflight:  # the compiled peak against the devices' memory: UsageError with advice
        fit = preflight.check(setup, compiled)
        if fit:
            print(f"preflight {fit}", file=out)
    if cfg.dry_run:
        print(describe(setup, compiled), file=out)
        print(f"dry run: the train step compiled in {t_compile:.1f} s; nothing was trained or written", file=out)
        return RunResult([], None, setup, stopped="dry_run")
    return _train(setup, compiled, out, t_compile)


def _train(setup: Setup, compiled, out, t_compile: float) -> RunResult:
    cfg, mesh = setup.cfg, setup.mesh
    if jax.process_index() != 0:  # multi-host: one process reports
        out = open(os.devnull, "w")
    devices = list(mesh.devices.flat)
    print(describe(setup, compiled), file=out)
    print(f"compile  {t_compile:.1f} s", file=out)
    signals.set_phase("restoring the train state")
    state, position = _initial_state(setup)
    start = setup.start_step
    if start:
        print(f"resume   from step {start} of {cfg.checkpoint_dir} (data position {position})"
              + (f"; changed: {', '.join(setup.resume_changes)}" if setup.resume_changes else ""), file=out)

    eval_fn = None
    if setup.val_ds is not None and cfg.val_every > 0:
        xs = sh.batch_sharding(mesh, 2, 0)
        eval_fn = jax.jit(make_eval_step(setup.fam, setup.mcfg),
                          in_shardings=(setup.state_sharding["params"], xs, xs), out_shardings=sh.replicated(mesh))

    def evaluate(params):
        xs = sh.batch_sharding(mesh, 2, 0)
        losses = []
        for i in range(cfg.val_steps):
            x, y = setup.val_ds.eval_batch(i, cfg.batch_size, cfg.sequence_length)
            losses.append(float(eval_fn(params, sh.put_batch(x, xs), sh.put_batch(y, xs))))
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
                moved = ckpt.set_aside(cfg.checkpoint_dir, s_)
                print(f"resume   damaged step {s_} moved to {moved} (step {s_} is trained and saved again)", file=out)
            checkpointer = ckpt.Checkpointer(cfg.checkpoint_dir, cfg.keep_checkpoints)
        checkpointer.save(n, state, {"step": n, "data_position": position, "model": cfg.model,
                                     "model_config": config_dict(setup.mcfg), "train_config": cfg.to_dict()})

    writer = log_lib.JsonlWriter(cfg.log_jsonl, append=start > 0, keep_through=start)
    history, times, last_saved = [], [], (start if start else None)
    bar = tqdm(total=cfg.num_iterations, initial=start, desc="train", unit="step", file=sys.stderr,
               disable=(not cfg.progress or jax.process_index() != 0) or None, dynamic_ncols=True,
               leave=False)
    t_run = time.perf_counter()
    stopped, n = None, start
    signals.set_phase("training")
    try:
        for step in range(start, cfg.num_iterations):
            try:
                x, y = setup.train_ds.batch(position, cfg.seed, cfg.batch_size, cfg.sequence_length,
                                            cfg.grad_accum_steps)
                xd, yd = sh.put_batch(x, setup.x_sharding), sh.put_batch(y, setup.x_sharding)
                with profiler.step(step + 1):  # a jax.profiler trace of --profile_steps
                    t0 = time.perf_counter()
                    state, metrics = compiled(state, xd, yd)
                    metrics = jax.device_get(metrics)
                    dt = time.perf_counter() - t0
            except Exception as e:
                if remat.memory.is_oom(e):
                    raise _oom_error(cfg, f"at step {step + 1}", e) from None
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
            tqdm.write(log_lib.format_line(n, cfg.num_iterations, rec), file=out)
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
        raise Interrupted(f"{signals.describe(sig)} after step {n} of {cfg.num_iterations}; {kept}",
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
