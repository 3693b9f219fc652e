"""Prepare a training run: every check that can fail on user input, before anything is written.

`prepare(cfg)` checks the flags against the model, the data files, `--init_from`, `--resume` and
the mesh against the devices and the batch, raises UsageError (one line, naming the fix) for bad
input, and returns a frozen `Setup`. It writes nothing.

Example:
    >>> setup = prepare(TrainConfig(preset="tiny", num_iterations=3))
    >>> setup.mcfg.n_layer
    2
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from remat_lm.models import attention
from remat_lm.models import family
from remat_lm.models.llmc_io import LlmcFormatError
from remat import RecomputeConfig
from remat.config import RecomputeConfigError
from remat_lm.training.flags import AutoRecompute
from remat_lm.training.flags import flag_error
from remat_lm.training import checks
from remat_lm.training import data as data_lib
from remat_lm.training import distributed
from remat_lm.training import saving
from remat_lm.training import sharding as sh
from remat_lm.training import target as run_target
from remat_lm.training.compile import optimizer
from remat_lm.training.config import TrainConfig, UsageError, default_loss_chunk, parse_mesh
from remat_lm.training.model import config_dict
from remat_lm.training.optim import optimizer_settings
from remat_lm.training.profile import profile_dir
from remat_lm.training.resume import choose_resume_step
from remat_lm.training.samples import make_sampler
from remat_lm.training.step import init_state

VAL_FRACTION = 0.02


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything `prepare` validated and built; nothing has been written yet. Frozen: a later stage
    (the planner, resume fallback) makes a new one with `dataclasses.replace`."""
    cfg: TrainConfig
    fam: family.Family
    base_mcfg: Any                 # the model config with recompute off: shapes, dtype, attention (what the
                                   # parameters, the data checks and samples depend on)
    mcfgs: tuple                   # ((label, model config), ...) one per --recompute_method entry; () while
                                   # an `auto` request waits for the planner (remat_lm.training.compile.plan_memory)
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
    schedule_note: str | None = None   # on --resume: the saved run's --lr_decay_iters kept (remat_lm.training.resume)
    damaged_steps: tuple = ()          # steps newer than the start found damaged (set aside before saving)
    init_params: Any = None            # parameters read from --init_from FILE.bin (shape from its header)
    init_dir_step: int | None = None   # step to read params from for --init_from DIR
    sampler: Any = None                # remat_lm.training.samples.Sampler for --sample_every
    auto: AutoRecompute | None = None  # --recompute_method auto: the request plan_memory answers
    target: Any = None                 # --target: the remat.planning.targets.Target every program is built for
    deviceless: bool = False           # the target's devices are compile-only (this host has not got them)

    @property
    def mcfg(self):
        """The model config of the run (the first recompute setting)."""
        if not self.mcfgs:
            raise RuntimeError("--recompute_method auto is not planned yet: call remat_lm.training.compile.plan_memory(setup)")
        return self.mcfgs[0][1]


def flag_fields(cfg: TrainConfig) -> dict:
    """The model-config fields the run's flags set whatever the model's shape (from a preset or from an
    --init_from file's header): every one must reach the model either way."""
    return dict(dtype=cfg.dtype, dropout=cfg.dropout, scan_layers=cfg.scan_layers, loss_chunk=cfg.loss_chunk or 0,
                attention=cfg.attention, attention_tile=cfg.attention_tile)


def _model_config(cfg: TrainConfig, fam: family.Family, recompute, vocab_size: int, block_size: int, shaped=None):
    """The model config of the run: `fam.config(preset)` with the shape flags, or `shaped` (the config an
    llm.c header fixes), with `flag_fields(cfg)` and `recompute` set; the attention core checked."""
    over = dict(flag_fields(cfg), recompute=recompute)
    if shaped is None:
        over.update(vocab_size=vocab_size, block_size=block_size)
        for k in ("n_layer", "n_head", "n_embd"):
            if getattr(cfg, k) is not None:
                over[k] = getattr(cfg, k)
    try:
        mcfg = fam.config(cfg.preset, **over) if shaped is None else dataclasses.replace(shaped, **over)
        if cfg.loss_chunk is None:  # the default: chunked where a device's logits are large
            mesh = parse_mesh(cfg.mesh)
            per_device = max(1, cfg.batch_size // (mesh["data"] * mesh["fsdp"]))
            mcfg = dataclasses.replace(mcfg, loss_chunk=default_loss_chunk(per_device, cfg.sequence_length,
                                                                           mcfg.logits_width))
        # cudnn where it cannot run is a usage error now, not a trace-time failure later
        attention.resolve(mcfg.attention, mcfg.compute_dtype, mcfg.n_embd // mcfg.n_head, mcfg.dropout > 0,
                          seq_len=cfg.sequence_length)
        return mcfg
    except RecomputeConfigError as e:  # e.g. --recompute_num_layers larger than the model's layers
        raise UsageError(flag_error(e)) from None
    except ValueError as e:
        raise UsageError(str(e).replace("attention='cudnn'", "--attention cudnn").replace("attention='pallas'", "--attention pallas").replace("attention='tiled' (--attention tiled)", "--attention tiled")) from None


def _load_data(paths, what):
    try:
        return data_lib.load(paths, what)
    except LlmcFormatError as e:
        raise UsageError(f"{what} {e}") from None


# Model config fields an llm.c header fixes, and the flags that may also set them.
_SHAPE_FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")


def _load_llmc(cfg: TrainConfig, fam: family.Family):
    """--init_from FILE.bin: (model config from the file's header, parameters), via remat_lm.models.llmc.load.

    Every shape field comes from the header (the preset is not consulted for shapes); a shape flag
    that disagrees with it is a UsageError naming both values. Files whose float header slots hold
    truncated integers (LLaMA-3 files from llm.c master) are read with the preset's values for those
    slots (the header's float fields are config fields of the same names).
    """
    from remat_lm.models import llmc

    path = cfg.init_from
    kw = dict(scan_layers=cfg.scan_layers, dtype=cfg.dtype)
    try:
        try:
            mcfg, params = llmc.load(path, **kw)
        except LlmcFormatError as e:
            floats = fam.header_cls.float_ranges
            if not floats or "truncated integers" not in str(e):
                raise
            base = fam.config(cfg.preset)
            mcfg, params = llmc.load(path, **{k: getattr(base, k) for k in floats}, **kw)
    except (LlmcFormatError, ValueError) as e:
        raise UsageError(f"--init_from {e}") from None
    kind = family.of(mcfg).name
    if kind != cfg.model:
        raise UsageError(f"--init_from {path} is an llm.c {kind} model but this run is --model {cfg.model}; "
                         f"pass --model {kind}")
    bad = [f"--{k} {getattr(cfg, k)} but the file has {k} {getattr(mcfg, k)}" for k in _SHAPE_FLAGS
           if getattr(cfg, k) is not None and getattr(cfg, k) != getattr(mcfg, k)]
    if bad:
        raise UsageError(f"--init_from {path}: the model shape comes from the file's header: {'; '.join(bad)}; "
                         f"drop those flags (or pass a file written with that shape)")
    return mcfg, params


def _check_outputs_apart(cfg: TrainConfig, data_files, val_files) -> None:
    """UsageError when an output path (log, checkpoints, profile) is, or is inside, an input
    (remat_lm.training.checks.check_outputs_apart); also checks the profile directory is usable."""
    outputs = [(f"--{k}", getattr(cfg, k)) for k in ("log_jsonl", "checkpoint_dir") if getattr(cfg, k)]
    if cfg.profile_steps:
        trace = profile_dir(cfg.checkpoint_dir, cfg.log_jsonl)
        checks.check_output_dir(trace, "--profile_steps (its trace directory)")
        outputs.append(("--profile_steps", trace))
    inputs = [("--data", p) for p in (data_files or data_lib.default_corpus())]
    inputs += [("--val_data", p) for p in val_files]
    inputs += [(f"--{k}", getattr(cfg, k)) for k in ("init_from", "deepspeed_config", "tokenizer") if getattr(cfg, k)]
    checks.check_outputs_apart(outputs, inputs, cfg.checkpoint_dir, profiling=bool(cfg.profile_steps))


def prepare(cfg: TrainConfig) -> Setup:
    """Validate the run against files, devices and the model; build what training needs.

    Raises UsageError (one line, naming the fix) for every bad input. Writes nothing.
    """
    distributed.initialize()  # jax.distributed, when the environment asks for several processes
    fam = family.get(cfg.model)
    recomputes = cfg.recompute_configs()
    target, deviceless = run_target.resolve(cfg)  # a bad --target, or training on devices not here: now
    data_files = checks.check_data_files(cfg.data, "--data")  # special, unreadable or too large: before reading
    val_files = checks.check_data_files(cfg.val_data, "--val_data")
    if cfg.init_from:
        checks.check_input_file(cfg.init_from, "--init_from", "pass an llm.c .bin model file or a train.py "
                                "checkpoint directory", allow_dir=True)
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
    # NOTE: byte-level text (the default corpus) means a vocabulary of 256, right for a run that trains on
    # it. A run built for a --target this host has not got trains on nothing: it measures the model a
    # user would train there, so without --data it keeps the preset's vocabulary (an 8B LLaMA-3's
    # 128,256-way logits are a large part of its step), and --vocab_size still sets one.
    if cfg.vocab_size is not None:
        vocab = cfg.vocab_size
    elif train_ds.kind == "text" and not cfg.init_from and not (deviceless and not cfg.data):
        vocab = data_lib.BYTE_VOCAB
    else:
        vocab = base.vocab_size
    if cfg.block_size is not None:
        block = cfg.block_size
    elif cfg.init_from:
        block = base.block_size
    else:
        block = max(base.block_size, cfg.sequence_length)
    build = lambda rc: _model_config(cfg, fam, rc, vocab, block, shaped=file_mcfg)
    model = build(RecomputeConfig())  # recompute off: what does not depend on the recompute setting
    auto = recomputes[0][1] if isinstance(recomputes[0][1], AutoRecompute) else None
    mcfgs = () if auto else tuple((label, build(rc)) for label, rc in recomputes)
    if cfg.sequence_length > model.block_size:
        raise UsageError(f"--sequence_length {cfg.sequence_length} exceeds the model's block_size "
                         f"{model.block_size}; use --sequence_length <= {model.block_size}")

    train_ds.check(model.vocab_size, cfg.sequence_length, "--data")
    val_ds = None
    if cfg.val_data:
        val_ds = _load_data(cfg.val_data, "--val_data")
        val_ds.check(model.vocab_size, cfg.sequence_length, "--val_data")
        if val_ds.kind != train_ds.kind:
            raise UsageError(f"--val_data is {val_ds.kind} but --data is {train_ds.kind}; pass the same kind")
        if val_ds.token_format != train_ds.token_format:
            raise UsageError(f"--val_data {val_ds.description} is an {val_ds.token_format.words()} but --data "
                             f"is an {train_ds.token_format.words()}; their token ids come from different "
                             f"tokenizers: pass shards of one format")
    elif cfg.val_every > 0:
        train_ds, val_ds = train_ds.split_tail(VAL_FRACTION, cfg.sequence_length + 1)

    checks.check_batch_size(cfg, model)
    sampler = make_sampler(cfg, model, train_ds, val_ds)  # validates --tokenizer and --prompt
    mesh = sh.make_mesh(parse_mesh(cfg.mesh), cfg.batch_size, run_target.devices(target) if deviceless else None)
    limit = dict(limit=target.memory_limit, what=f"{run_target.limit_words(target)} is") if deviceless else {}
    checks.check_model_size(fam.num_params(model), parse_mesh(cfg.mesh)["fsdp"], list(mesh.devices.flat), **limit)
    sh.check_tensor(model, parse_mesh(cfg.mesh), cfg.sequence_length, cfg.sequence_parallel)
    tx, schedule = optimizer(optimizer_settings(cfg))
    abstract_state = jax.eval_shape(lambda: init_state(fam, model, tx, cfg.seed))
    state_sharding = sh.state_shardings(mesh, abstract_state)
    setup = Setup(cfg, fam, model, mcfgs, train_ds, val_ds, mesh, tx, schedule, abstract_state, state_sharding,
                  sh.batch_sharding(mesh, 3, 1), sampler=sampler, auto=auto, target=target, deviceless=deviceless)
    if cfg.memory_report:
        return setup

    if cfg.checkpoint_dir:
        checks.check_output_dir(cfg.checkpoint_dir, "--checkpoint_dir")
        # another run holding the directory is named first (remat_lm.training.run takes it). Not in a
        # multi-process run: process 0 of this very run may hold it already; there
        # `saving.hold_directory` (collective) tells every process.
        if not cfg.dry_run and jax.process_count() == 1:
            saving.check_free(cfg.checkpoint_dir)
    if cfg.log_jsonl:
        checks.check_output_file(cfg.log_jsonl, "--log_jsonl")
    _check_outputs_apart(cfg, data_files, val_files)
    mcfg_dict = config_dict(model)
    if cfg.checkpoint_dir:
        info = saving.inspect_dir(cfg.checkpoint_dir, "--resume" if cfg.resume else "--checkpoint_dir")
        if cfg.resume:
            if info.step is None:
                raise UsageError(f"--resume: {cfg.checkpoint_dir} holds no complete checkpoint (it is empty or "
                                 f"missing); run without --resume to start fresh")
            setup = choose_resume_step(setup, info, mcfg_dict)
        elif info.step is not None:
            raise UsageError(f"--checkpoint_dir {cfg.checkpoint_dir} already holds checkpoints (latest step "
                             f"{info.step}); pass --resume to continue, or choose a new directory")

    if init_params is not None:
        setup = dataclasses.replace(setup, init_params=init_params)
    elif cfg.init_from:
        info = saving.inspect_dir(cfg.init_from, "--init_from")
        if info.step is None:
            raise UsageError(f"--init_from {cfg.init_from}: the directory holds no complete checkpoint; pass an "
                             f"llm.c .bin file or a train.py --checkpoint_dir")
        if info.meta.get("model") != cfg.model:
            raise UsageError(f"--init_from {cfg.init_from} holds a {info.meta.get('model')} model but this run is "
                             f"--model {cfg.model}; pass --model {info.meta.get('model')}")
        saved = {k: v for k, v in saving.saved_shapes(cfg.init_from, info.step).items() if k.startswith("params.")}
        want = saving.leaf_shapes({"params": abstract_state["params"]})
        if saved != want:
            diff = sorted(set(saved.items()) ^ set(want.items()))[:2]
            raise UsageError(f"--init_from {cfg.init_from}: its parameter shapes do not match --preset {cfg.preset} "
                             f"(e.g. {diff}); pass the preset and --scan_layers setting it was trained with")
        setup = dataclasses.replace(setup, init_dir_step=info.step)
    return setup


