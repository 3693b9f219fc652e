"""TrainConfig: every training setting, validated once; the CLI flags are generated from its fields.

Each field's `metadata` carries its help text, its `choices` where the set is closed and its
bounds (`lo`, `hi`) where it is a number, so the flag name, type, default, help and valid values
are declared once (`build_parser`, `__post_init__`); the recompute fields are inherited from
`remat_lm.training.flags.RecomputeFlags`, generated from the table `python -m remat_lm.llmc verify`
uses too. Validation that needs only the values lives in `TrainConfig.__post_init__`; validation that needs files, devices or the model
(data, `--init_from`, `--resume`, `--mesh` against the device count) happens in
`remat_lm.training.prepare.prepare`, still before anything is written.

Example:
    >>> cfg = TrainConfig(preset="tiny", num_iterations=3, activation_recompute=True,
    ...                   recompute_method="uniform", recompute_num_layers=2)
    >>> cfg.recompute_configs()[0][1].granularity
    'full'
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from typing import Sequence

from remat.errors import is_int
from remat_lm.models.attention import ATTENTION, DEFAULT_TILE
from remat_lm.models.family import NAMES as model_family_names
from remat import RecomputeConfig
from remat_lm import argtypes
from remat_lm.argtypes import UsageError  # noqa: F401  (re-exported: raised throughout training/)
from remat_lm.training.checks import check_input_file, host_available
from remat_lm.training import deepspeed as remat_deepspeed
from remat_lm.training import flags as recompute_flags
from remat_lm.training.flags import RecomputeFlags
from remat.planning import targets as remat_targets
from remat_lm.training.flags import AutoRecompute

__all__ = ["DEFAULT_PRESET", "DEFAULT_PROMPT_TOKENS", "DTYPES", "CHUNK_LOGITS_MIB", "CHUNK_MAX", "CHUNK_MIN", "INT32_MAX", "LOG_SECONDS", "default_loss_chunk", "MESH_AXES", "MODELS", "PATH_FLAGS",
           "SAMPLE_LENGTH_MAX", "SEED_MAX", "TENSOR_AXIS", "TrainConfig", "UsageError", "build_parser",
           "config_from_args", "model_presets", "parse_mesh"]

MODELS = model_family_names  # the model-family registry (remat_lm.models.family)
DTYPES = ("float32", "bfloat16")
MESH_AXES = ("data", "fsdp", "tensor")
TENSOR_AXIS = "tensor"  # Megatron-style tensor (and sequence) parallelism: remat_lm/training/sharding.py
DEFAULT_PRESET = "tiny"
DEFAULT_PROMPT_TOKENS = 32  # the default sample prompt: this many tokens from the start of the validation data
INT32_MAX = 2**31 - 1  # JAX computes in int32 (x64 off): counts, indices and seeds must fit it
SEED_MAX = INT32_MAX  # the seed enters the jitted init as an int32
SAMPLE_LENGTH_MAX = INT32_MAX - 1  # a sample's positions (prompt + generated tokens) are int32 indices
LOG_SECONDS = 5  # --log_every 0: about one step line this often
# --loss_chunk's default: chunk the loss when one device's float32 (micro-batch, T, vocab) logits would
# exceed this many MiB, in chunks whose logits fit in it (a power of two between CHUNK_MIN and CHUNK_MAX)
CHUNK_LOGITS_MIB, CHUNK_MIN, CHUNK_MAX = 64, 128, 1024


# Every flag that names a path, and the fix for an empty one.
PATH_FLAGS = {
    "data": "pass a file or glob pattern, or drop --data for the default corpus",
    "val_data": "pass a file or glob pattern, or drop --val_data to hold out the end of --data",
    "init_from": "pass an llm.c .bin model file or a checkpoint directory, or drop --init_from for a fresh init",
    "deepspeed_config": "pass a DeepSpeed JSON config file, or drop --deepspeed_config",
    "tokenizer": "pass llm.c's gpt2_tokenizer.bin, or drop --tokenizer",
    "checkpoint_dir": "pass a directory to save into, or drop --checkpoint_dir to save nothing",
    "log_jsonl": "pass a file path, or drop --log_jsonl to write no log",
}


def _f(default, help: str, **meta):
    """A field and its flag: `help`, and argparse's `choices`/`metavar`, or the bounds `lo`/`hi` of a
    number (checked by `__post_init__`; an int's `hi` defaults to INT32_MAX)."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def model_presets(model: str) -> tuple[str, ...]:
    """The preset names of `model` ("gpt2" or "llama3"), from the model-family registry."""
    from remat_lm.models.family import get

    return tuple(get(model).presets)


def parse_mesh(spec: str) -> dict[str, int]:
    """'data=2,fsdp=4' → {'data': 2, 'fsdp': 4}; a missing axis is 1.

    Example:
      >>> parse_mesh("fsdp=8")
      {'data': 1, 'fsdp': 8, 'tensor': 1}
    """
    out = {a: 1 for a in MESH_AXES}
    seen = set()
    for part in (p.strip() for p in spec.split(",")):
        name, eq, value = part.partition("=")
        name = name.strip()
        try:
            n = argtypes.parse_int(value.strip()) if eq and name in MESH_AXES and name not in seen else 0
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--mesh {spec!r}: expected AXIS=N[,AXIS=N] with axes {', '.join(MESH_AXES)} "
                             f"and N >= 1, e.g. --mesh data=2,fsdp=4")
        seen.add(name)
        out[name] = n
    return out


@dataclasses.dataclass(frozen=True)
class TrainConfig(RecomputeFlags):
    """Every setting of a training run; one CLI flag per field (`--<field name>`). The recompute
    fields come from `RecomputeFlags` (`remat_lm.training.flags.FLAGS`)."""
    # -- model
    model: str = _f("gpt2", "model family", choices=MODELS)
    preset: str = _f(DEFAULT_PRESET, "model preset: gpt2 tiny|d12|d24|d36|d48, llama3 tiny|1b|8b")
    n_layer: int | None = _f(None, "override the preset's number of layers", lo=1)
    n_head: int | None = _f(None, "override the preset's number of attention heads", lo=1)
    n_embd: int | None = _f(None, "override the preset's width", lo=1)
    block_size: int | None = _f(None, "override the preset's maximum sequence length (default: the preset's, "
                                      "raised to --sequence_length when that is longer and no --init_from)", lo=1)
    vocab_size: int | None = _f(None, "vocabulary size (default: 256 for byte-level text data, else the preset's)",
                                lo=1)
    init_from: str | None = _f(None, "initialize from an llm.c model .bin file or an orbax checkpoint "
                                     "directory written by this script (shapes must match the preset)", metavar="PATH")
    dtype: str = _f("float32", "compute dtype (parameters and optimizer state stay float32)", choices=DTYPES)
    dropout: float = _f(0.0, "dropout probability", range=(0.0, 1.0, "left"))
    # -- activation recompute: the fields of RecomputeFlags, validated once, by remat.RecomputeConfig
    distribute_saved_activations: bool = _f(False, "keep each recompute region's input split along T over the "
                                                   "mesh's tensor axis between the forward and the backward, "
                                                   "gathered before its recomputation (Megatron's "
                                                   "--distribute-saved-activations); needs granularity full, "
                                                   "--mesh tensor=N (N > 1) and --no-sequence_parallel")
    loss_chunk: int | None = _f(None, "compute the LM head and cross-entropy over chunks of N positions, each "
                                      "rematerialized, so the (batch, T, vocab) float32 logits never exist; 0: off; "
                                      "default: chunks when a device's float32 logits would exceed %d MiB, of the "
                                      "positions whose logits fit in that (a power of two, %d..%d)"
                                      % (CHUNK_LOGITS_MIB, CHUNK_MIN, CHUNK_MAX), lo=0)
    attention: str = _f("auto", "attention core: tiled (query tiles, masked tiles skipped; any backend) | xla "
                                "(the whole T x T scores) | cudnn (cuDNN flash attention: NVIDIA GPU, bfloat16, "
                                "no dropout) | pallas (Pallas TPU splash attention: TPU, T a multiple of 128, no dropout) | auto "
                                "(for the platform built for: cudnn on an NVIDIA GPU, pallas on TPU, where they apply, "
                                "else tiled)", choices=ATTENTION)
    attention_tile: int = _f(DEFAULT_TILE, "query tile of --attention tiled", lo=1)
    # -- optimization
    batch_size: int = _f(16, "micro-batch size (sequences per forward/backward)", lo=1)
    sequence_length: int = _f(64, "tokens per sequence T", lo=1)
    grad_accum_steps: int = _f(1, "micro-batches accumulated per optimizer step (tokens per step = "
                                  "batch_size * sequence_length * grad_accum_steps)", lo=1)
    num_iterations: int = _f(3000, "optimizer steps to train for (the step count to stop at when resuming)", lo=1)
    learning_rate: float = _f(3e-3, "peak learning rate (AdamW)", range=(0.0, math.inf, False))
    warmup_iters: int = _f(30, "linear warmup steps", lo=0)
    lr_decay: float = _f(0.1, "cosine-decay the learning rate to this fraction of its peak", range=(0.0, 1.0, True))
    lr_decay_iters: int | None = _f(None, "steps of the warmup+cosine schedule (default --num_iterations; on "
                                          "--resume, the saved run's)", lo=1)
    weight_decay: float = _f(0.1, "AdamW weight decay (not applied to norms and biases)", range=(0.0, math.inf, True))
    grad_clip: float = _f(1.0, "clip gradients to this global norm (0: no clipping)", range=(0.0, math.inf, True))
    seed: int = _f(1337, f"seed for initialization, data order and dropout (0..{SEED_MAX})", lo=0, hi=SEED_MAX)
    # -- data
    data: tuple[str, ...] = _f((), "training data: llm.c token shards (*.bin, magic 20240520) or text files "
                                    "(byte-level tokens); glob patterns allowed; default: the Python "
                                    "standard library's source files")
    val_data: tuple[str, ...] = _f((), "validation data, as --data (default: the last 2%% of the training "
                                        "tokens are held out)")
    val_every: int = _f(250, "evaluate every N steps and at the last step (0: never)", lo=0)
    log_every: int = _f(0, "print a step line every N steps; 0: one about every %d s, and always the first, "
                           "the last and every step with a validation loss (--log_jsonl records every step)"
                        % LOG_SECONDS, lo=0)
    val_steps: int = _f(8, "batches per evaluation", lo=1)
    # -- samples (remat_lm/training/samples.py)
    sample_every: int = _f(0, "print a short generation every N steps and at the last step (0: never)", lo=0)
    sample_length: int = _f(128, "tokens generated per sample", lo=1, hi=SAMPLE_LENGTH_MAX)
    prompt: str | None = _f(None, "sample prompt text (default: the first %d tokens of the validation data)"
                            % DEFAULT_PROMPT_TOKENS)
    temperature: float = _f(0.0, "sampling temperature (0: greedy)", range=(0.0, math.inf, True))
    top_k: int | None = _f(None, "sample among the k most likely tokens only (needs --temperature > 0)", lo=1)
    tokenizer: str | None = _f(None, "llm.c tokenizer file (gpt2_tokenizer.bin, magic 20240328) to decode and "
                                     "encode samples of llm.c token data", metavar="FILE")
    # -- checkpoints and logs
    checkpoint_dir: str | None = _f(None, "orbax checkpoint directory (asynchronous, atomic saves)", metavar="DIR")
    checkpoint_every: int = _f(0, "save every N steps (0: only at the end); needs --checkpoint_dir", lo=0)
    keep_checkpoints: int = _f(3, "how many of the latest checkpoints to keep", lo=1)
    resume: bool = _f(False, "continue from the latest complete checkpoint in --checkpoint_dir")
    log_jsonl: str | None = _f(None, "write one JSON object per step to this file (appended to on --resume)",
                                metavar="PATH")
    mesh: str = _f("data=1,fsdp=1", "device mesh: batch sharded over data x fsdp, parameters and optimizer "
                                    "state over fsdp; tensor=N splits attention heads and MLP hidden units over "
                                    "N devices (Megatron tensor parallelism), e.g. data=2,fsdp=2,tensor=2",
                   metavar="data=N,fsdp=M,tensor=K")
    target: str | None = _f(None, "build for this accelerator, with no device present: "
                                  "h100|h200|a100-80g|b200 (XLA:GPU), v5e|v5p|v6e (XLA:TPU), cpu, with a count for a "
                                  "mesh (h200x8, v5e:2x4; --mesh must span its devices); the train step, the "
                                  "preflight, --memory_report and the planner use its compiler, and its memory is "
                                  "the capacity and the default --memory_budget; without its hardware only with "
                                  "--dry_run or --memory_report (the host is the target: trains as usual)",
                            metavar="NAME")
    sequence_parallel: bool = _f(True, "with tensor=N > 1 in --mesh: keep activations between attention and MLP "
                                       "(norms, residual adds, dropout) split along T over tensor (Megatron's "
                                       "sequence parallelism); --no-sequence_parallel keeps them whole on each "
                                       "tensor device")
    memory_report: bool = _f(False, "print what the backward keeps (by tagged name) and XLA's compiled "
                                    "memory for the train step, then exit without training")
    dry_run: bool = _f(False, "validate everything, build and compile the train step, print a summary, "
                              "and exit without training or writing")
    progress: bool = _f(True, "show a tqdm progress bar (on stderr)")
    profile_steps: str | None = _f(None, "write a jax.profiler trace (TensorBoard/Perfetto) of steps A+1..B, e.g. "
                                         "0:3 for the first three, to <checkpoint_dir>/profile, else beside "
                                         "--log_jsonl (x.jsonl -> x.profile), else runs/profile", metavar="A:B")
    preflight: bool = _f(True, "before the first step, compare the compiled step's peak memory with the "
                               "devices' (GPU: bytes_limit; CPU: available host RAM) and stop with advice "
                               "(exit 2) when it does not fit")

    def __post_init__(self):
        if isinstance(self.data, str):
            object.__setattr__(self, "data", (self.data,))
        if isinstance(self.val_data, str):
            object.__setattr__(self, "val_data", (self.val_data,))
        object.__setattr__(self, "data", tuple(self.data))
        object.__setattr__(self, "val_data", tuple(self.val_data))
        self._check_paths()
        self._check_values()
        presets = model_presets(self.model)
        if self.preset not in presets:
            raise UsageError(f"--preset {self.preset!r} is not a {self.model} preset; use one of {', '.join(presets)}")
        if self.batch_size * self.sequence_length > INT32_MAX:
            raise UsageError(f"--batch_size {self.batch_size} x --sequence_length {self.sequence_length} = "
                             f"{self.batch_size * self.sequence_length} tokens per micro-batch exceeds {INT32_MAX} "
                             f"(2**31 - 1: JAX counts a batch's tokens in int32); lower --batch_size or "
                             f"--sequence_length (and raise --grad_accum_steps)")
        if self.top_k is not None and self.temperature == 0:
            raise UsageError(f"--top_k {self.top_k} samples among the k most likely tokens, but --temperature 0 is "
                             f"greedy; add --temperature (e.g. 0.8) or drop --top_k")
        unused = [f for f, on in (("--prompt", self.prompt is not None), ("--temperature", self.temperature > 0),
                                  ("--top_k", self.top_k is not None)) if on]
        if unused and self.sample_every == 0:
            raise UsageError(f"{unused[0]} sets up samples, which are off; add --sample_every N (samples every N "
                             f"steps and at the last)")
        self._follow_plan_layout()
        if self.resume and not self.checkpoint_dir:
            raise UsageError("--resume needs --checkpoint_dir DIR (the directory to continue from)")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise UsageError("--checkpoint_every needs --checkpoint_dir DIR")
        if self.resume and self.init_from:
            raise UsageError("--resume and --init_from both choose the starting weights; pass only one")
        if self.memory_report and self.dry_run:
            raise UsageError("--memory_report and --dry_run are two different exits; pass only one")
        try:
            parse_mesh(self.mesh)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if self.target is not None:
            self._check_target()
        if self.profile_steps is not None:
            from remat_lm.training.profile import parse_steps
            try:
                parse_steps(self.profile_steps, self.num_iterations)
            except ValueError as e:
                raise UsageError(str(e)) from None
        if self.deepspeed_config is not None:  # read by recompute_configs: a FIFO would block, /dev/zero never end
            check_input_file(self.deepspeed_config, "--deepspeed_config", "pass a DeepSpeed JSON config file")
        self.recompute_configs()  # validates the recompute flags

    def _check_values(self) -> None:
        """UsageError for a value outside its field's `choices` or bounds (`lo`, `hi`, `range`), as
        the fields declare them."""
        for f in dataclasses.fields(TrainConfig):
            v, meta = getattr(self, f.name), f.metadata
            if "choices" in meta and v not in meta["choices"]:
                raise UsageError(f"--{f.name} {v!r} is not valid; use one of {', '.join(meta['choices'])}")
            if "lo" in meta and not (v is None and f.default is None):
                lo, hi = meta["lo"], meta.get("hi", INT32_MAX)
                if not is_int(v) or (v < lo and "hi" not in meta):
                    raise UsageError(f"--{f.name} {v!r} must be " + ("a positive integer (or left unset for the "
                                     "default)" if f.default is None else f"an integer >= {lo}"))
                if not lo <= v <= hi:
                    raise UsageError(f"--{f.name} {v!r} is out of range; use an integer in {lo}..{hi}"
                                     + (" (JAX counts and indexes in int32)" if hi == INT32_MAX else ""))
            if "range" in meta:
                lo, hi, closed = meta["range"]
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
                    (lo <= v <= hi) if closed is True else (lo <= v < hi) if closed == "left" else (lo < v <= hi))
                if not ok:
                    rng = {True: f"[{lo}, {hi}]", "left": f"[{lo}, {hi})", False: f"({lo}, {hi}]"}[closed]
                    raise UsageError(f"--{f.name} {v!r} must be a finite number in {rng}")

    def _check_target(self) -> None:
        """UsageError for a --target that is not a name, or a --mesh of another size. The host's CPU
        (`cpu`, `cpuxN`) is checked by `prepare`: its device count needs JAX's backends, which a
        multi-process run may start only after `jax.distributed.initialize`."""
        from remat_lm.training import target as run_target

        if not isinstance(self.target, str) or not self.target.strip():
            raise UsageError(f"--target {self.target!r} is empty; pass an accelerator name "
                             f"({', '.join(remat_targets.names())}) or drop --target")
        if not run_target.is_host_cpu(self.target):
            run_target.check_mesh(run_target.get(self.target), self.mesh, self.mesh_size)

    @property
    def target_budget(self) -> int | None:
        """The target's memory per device that JAX may use (`remat.planning.targets.Target.memory_limit`): the
        default --memory_budget; None without --target."""
        if self.target is None:
            return None
        if _host_cpu(self.target):  # remat.planning.targets' cpu target: the host's available RAM
            return host_available()
        return remat_targets.get(self.target).memory_limit

    @property
    def mesh_size(self) -> int:
        """The number of devices --mesh spans."""
        return math.prod(parse_mesh(self.mesh).values())

    def _check_paths(self) -> None:
        """UsageError for an empty path flag (it read as "unset": nothing saved, no log, a fresh
        init) and a --prompt that is not UTF-8 text."""
        for name, fix in PATH_FLAGS.items():
            v = getattr(self, name)
            for p in (v if isinstance(v, tuple) else () if v is None else (v,)):
                if not str(p).strip():
                    raise UsageError(f"--{name} {p!r} is an empty path; {fix}")
        if self.prompt is not None:
            try:
                self.prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # bytes of argv that are not UTF-8 arrive as lone surrogates
                raise UsageError(f"--prompt holds bytes that are not UTF-8 (at character {e.start}); pass UTF-8 "
                                 f"text") from None

    # -- derived settings

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.recompute_method.split(","))

    @property
    def granularity(self) -> str:
        """The effective granularity (see `--activation_recompute`)."""
        return recompute_flags.granularity(self.activation_recompute, self.recompute_granularity,
                                           regions=any(v is not None for v in (self.recompute_segments,
                                                                               self.recompute_every,
                                                                               self.deepspeed_config)))

    def _follow_plan_layout(self) -> None:
        """A `--recompute_plan` whose text names its layout (`; scan`, `; loop`) sets `scan_layers`: the
        peak it was planned for is that layout's. `--scan_layers` against a loop plan is refused."""
        from remat.planning.tagplan import plan_layout

        layout = plan_layout(self.recompute_plan) if self.recompute_plan is not None else None
        if layout is False and self.scan_layers:
            raise UsageError(f"--recompute_plan {self.recompute_plan!r} was planned for a loop of layers; drop "
                             f"--scan_layers (or plan again with it)")
        if layout:
            object.__setattr__(self, "scan_layers", True)

    @property
    def given_flags(self) -> frozenset | None:
        """The fields whose flags the command line gave (`config_from_args`); None when built otherwise."""
        return getattr(self, "_given", None)

    def recompute_configs(self) -> list:
        """[(label, RecomputeConfig)]: one entry, or one per method of a `--recompute_method` comma list;
        [("auto", remat_lm.training.flags.AutoRecompute)] for `--recompute_method auto` (the planner's request).

        Raises UsageError naming the flag and the fix for every inconsistent combination.
        """
        if len(self.methods) > 1 and not self.memory_report and "auto" not in self.methods:
            raise UsageError(f"--recompute_method {self.recompute_method!r}: a comma list compares methods and "
                             f"needs --memory_report; pass one method to train")
        try:
            out = recompute_flags.from_flags({k: getattr(self, k) for k in recompute_flags.BY_NAME},
                                             tensor_axis=self._partition_axis,
                                             default_budget=self.target_budget, given=self.given_flags,
                                             distribute_axis=TENSOR_AXIS if self.distribute_saved_activations else None)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if self.distribute_saved_activations:
            if isinstance(out[0][1], AutoRecompute):
                raise UsageError("--recompute_method auto cannot be combined with --distribute_saved_activations "
                                 "(the planner does not model split region inputs); drop "
                                 "--distribute_saved_activations")
            self._check_distribute()
        return out

    @property
    def tensor_size(self) -> int:
        """The size of the mesh's tensor axis (1: no tensor parallelism)."""
        return parse_mesh(self.mesh)[TENSOR_AXIS]

    @property
    def _partition_axis(self) -> str | None:
        """Where region inputs can be split: the tensor axis, unless absent or sequence parallelism
        already splits them along T over it (DeepSpeed's partition_activations maps here)."""
        return TENSOR_AXIS if self.tensor_size > 1 and not self.sequence_parallel else None

    def _check_distribute(self) -> None:
        """UsageError when the mesh leaves --distribute_saved_activations nothing to split (what it
        needs of the recompute settings is RecomputeConfig's rule for `shard_inputs`)."""
        flag = "--distribute_saved_activations"
        if self.tensor_size <= 1:
            raise UsageError(f"{flag} splits each region's saved input over the mesh's tensor axis, but --mesh "
                             f"{self.mesh} has none; add tensor=N (N > 1) to --mesh, e.g. --mesh tensor=2, or drop {flag}")
        if self.sequence_parallel:
            raise UsageError(f"{flag}: with sequence parallelism (on by default with --mesh tensor=N) region inputs "
                             f"are already split along T over tensor (as in Megatron, the two exclude each other); "
                             f"add --no-sequence_parallel or drop {flag}")

    @property
    def deepspeed(self):
        """The `--deepspeed_config` file's validated activation_checkpointing block (None without one)."""
        if self.deepspeed_config is None:
            return None
        try:
            return remat_deepspeed.load(self.deepspeed_config)
        except ValueError as e:
            raise UsageError(f"--deepspeed_config {e}") from None

    def deepspeed_notes(self) -> list[str]:
        """What each `--deepspeed_config` setting became (printed at start-up); [] without one."""
        ds = self.deepspeed
        return [] if ds is None else ds.notes(self._partition_axis,
                                              sequence_parallel=self.tensor_size > 1 and self.sequence_parallel)

    @property
    def recompute(self) -> RecomputeConfig | AutoRecompute:
        """The recompute setting of a training run (a single method): a RecomputeConfig, or the
        AutoRecompute request that `remat_lm.training.compile.plan_memory` answers."""
        return self.recompute_configs()[0][1]

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.sequence_length * self.grad_accum_steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_loss_chunk(batch_per_device: int, seq: int, vocab: int) -> int:
    """--loss_chunk's default: 0 while a device's float32 logits fit in CHUNK_LOGITS_MIB, else the
    largest power of two N in CHUNK_MIN..CHUNK_MAX (and at most T) whose (batch, N, vocab) logits do.

    Example:
      >>> default_loss_chunk(8, 256, 1024), default_loss_chunk(8, 1024, 50304), default_loss_chunk(1, 8192, 128256)
      (0, 128, 128)
    """
    row = batch_per_device * vocab * 4  # float32 logits of one position
    if row * seq <= CHUNK_LOGITS_MIB * 2**20:
        return 0
    n = max(CHUNK_MIN, min(CHUNK_MAX, 1 << max(0, (CHUNK_LOGITS_MIB * 2**20 // row).bit_length() - 1)))
    return min(n, seq)


def _host_cpu(name: str) -> bool:
    from remat_lm.training.target import is_host_cpu
    return is_host_cpu(name)



# ------------------------------------------------------------------------------------------------
# The CLI, generated from the fields.

_CHECKED = ("lo", "hi", "range")  # bounds __post_init__ checks (argparse reads only the ASCII form)


def _flag_spec(f: dataclasses.Field, tp) -> dict:
    meta = {k: v for k, v in f.metadata.items() if k not in _CHECKED}
    kw: dict = {"help": meta.pop("help")}
    kw.update(meta)
    args = typing.get_args(tp)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), tp) if optional else tp
    if base is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(base) is tuple:
        kw.update(nargs="+", type=str, metavar="PATH")
    else:
        kw["type"] = {int: argtypes.integer(), float: argtypes.real()}.get(base, base)  # ASCII digits only
    kw["default"] = f.default
    if kw.get("action") is None and "metavar" not in kw and "choices" not in kw:
        kw["metavar"] = {int: "N", float: "X", str: "STR"}.get(base, None)
    if f.default not in (None, (), False) and kw.get("action") is None:
        kw["help"] += " (default: %(default)s)"
    return kw


def build_parser(prog: str = "train.py", description: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser: one `--<field>` per TrainConfig field, with its type, default and help."""
    p = argtypes.Parser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(TrainConfig)
    recompute = p.add_argument_group("activation recompute (remat_lm.training.flags)")
    for f in sorted(dataclasses.fields(TrainConfig), key=lambda f: "recompute_flag" in f.metadata):
        if "recompute_flag" in f.metadata:
            recompute.add_argument(f"--{f.name}", **recompute_flags.argparse_kwargs(recompute_flags.BY_NAME[f.name]))
        else:
            p.add_argument(f"--{f.name}", **_flag_spec(f, hints[f.name]))
    return p


def config_from_args(argv: Sequence[str] | None = None, prog: str = "train.py",
                     description: str | None = None) -> TrainConfig:
    """Parse flags into a TrainConfig. Raises UsageError for invalid values; argparse itself exits 2
    (one line) for unknown flags and values outside a flag's choices.

    Example:
      >>> config_from_args(["--preset", "tiny", "--num_iterations", "3"]).num_iterations
      3
    """
    parser = build_parser(prog, description)
    ns = parser.parse_args(argv)
    unset = object()  # argparse leaves an attribute the namespace already has unless its flag is given
    probe = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(ns), unset)))
    given = frozenset(k for k, v in vars(probe).items() if v is not unset)
    if "scan_layers" in given and not ns.scan_layers and ns.recompute_plan is not None:
        from remat.planning.tagplan import plan_layout
        if plan_layout(ns.recompute_plan):
            raise UsageError(f"--recompute_plan {ns.recompute_plan!r} was planned with the layers under scan; drop "
                             f"--no-scan_layers (or plan again without --scan_layers)")
    cfg = TrainConfig(**vars(ns))
    object.__setattr__(cfg, "_given", given)
    return cfg
