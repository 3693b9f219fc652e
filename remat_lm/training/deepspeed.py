"""DeepSpeed's `activation_checkpointing` config block → RecomputeConfig settings.

The block's keys (DeepSpeed's defaults in brackets) and what each becomes here:

| key | becomes |
|---|---|
| `partition_activations` [false] | `shard_inputs=<tensor axis>`: region inputs kept split along T over
|                                  | the tensor-parallel axis, all-gathered before recomputing; without a
|                                  | tensor axis, or with sequence parallelism (which already splits them),
|                                  | there is nothing to partition (a note says so) |
| `cpu_checkpointing` [false] | `offload_inputs=True`: region inputs wait in pinned host memory |
| `number_checkpoints` [null] | `layers=remat.count(N)`: the layers split into N contiguous regions of near-equal size |
| `contiguous_memory_optimization` [false] | accepted; XLA already does it (see `NOTES`) |
| `synchronize_checkpoint_boundary` [false] | accepted; XLA already does it (see `NOTES`) |
| `profile` [false] | accepted; see `NOTES` for what to use instead |

Other top-level keys of a DeepSpeed config (optimizer, zero_optimization, ...) are not read; they
are listed in the notes so nobody believes they took effect.

Example:
    >>> from remat import RecomputeConfig
    >>> ds = parse({"activation_checkpointing": {"number_checkpoints": 2}})   # or load("ds_config.json")
    >>> RecomputeConfig(granularity="full", **ds.recompute_kwargs(tensor_axis=None)).layers
    count(2)
"""
from __future__ import annotations

import dataclasses
import json

import remat.regions
from remat.errors import is_int

__all__ = ["BLOCK", "BOOL_KEYS", "KEYS", "NOTES", "DeepSpeedCheckpointing", "load", "parse"]

BLOCK = "activation_checkpointing"

# What XLA does in place of the DeepSpeed options that have no setting here.
NOTES = {
    "contiguous_memory_optimization":
        "XLA's buffer assignment already places every saved activation in one preallocated arena at "
        "compile time, so there is no allocator fragmentation to avoid",
    "synchronize_checkpoint_boundary":
        "XLA orders work by data dependencies, and remat makes each region's recomputation wait for its "
        "output cotangent, so no device synchronization is needed at region boundaries",
    "profile":
        "XLA fuses forward and recomputation, so there are no per-region timings; use --memory_report "
        "(what each region saves) or jax.profiler for time",
}
BOOL_KEYS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
             "synchronize_checkpoint_boundary", "profile")
KEYS = BOOL_KEYS + ("number_checkpoints",)


@dataclasses.dataclass(frozen=True)
class DeepSpeedCheckpointing:
    """A validated `activation_checkpointing` block (DeepSpeed's defaults for missing keys).

    Args:
      partition_activations, cpu_checkpointing, contiguous_memory_optimization,
      synchronize_checkpoint_boundary, profile: DeepSpeed's switches.
      number_checkpoints: the number of recompute regions, or None (every layer a region).
      ignored: top-level keys of the config file other than the block (not read).
      source: where the block came from, for messages.
    Example:
      >>> DeepSpeedCheckpointing(cpu_checkpointing=True, number_checkpoints=2).recompute_kwargs()
      {...'offload_inputs': True...}
    """
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    ignored: tuple = ()
    source: str = "deepspeed config"

    def __post_init__(self):
        for k in BOOL_KEYS:
            v = getattr(self, k)
            if not isinstance(v, bool):
                raise ValueError(f"{self.source}: {BLOCK}.{k} = {json.dumps(v)} must be true or false")
        n = self.number_checkpoints
        if n is not None and (not is_int(n) or n < 1):
            raise ValueError(f"{self.source}: {BLOCK}.number_checkpoints = {json.dumps(n)} must be a positive "
                             f"integer (the number of recompute regions) or null (every layer a region)")
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ValueError(f"{self.source}: {BLOCK}.contiguous_memory_optimization needs "
                             f"partition_activations = true (as in DeepSpeed); set it or drop the option")

    def recompute_kwargs(self, tensor_axis: str | None = None) -> dict:
        """RecomputeConfig fields this block sets (granularity full is the caller's)."""
        kw = {}
        if self.number_checkpoints is not None:
            kw["layers"] = remat.regions.count(self.number_checkpoints)
        if self.cpu_checkpointing:
            kw["offload_inputs"] = True
        if self.partition_activations and tensor_axis is not None:
            kw["shard_inputs"] = tensor_axis
        return kw

    def notes(self, tensor_axis: str | None = None, sequence_parallel: bool = False) -> list[str]:
        """One line per setting: what it became, or what XLA does instead (`sequence_parallel`: the
        mesh has a tensor axis whose sequence parallelism already splits region inputs)."""
        out = []
        n = self.number_checkpoints
        out.append(f"number_checkpoints={n}: " + (f"{n} contiguous recompute regions of near-equal size"
                                                  if n is not None else "null: every layer is a region"))
        out.append("cpu_checkpointing=" + ("true: region inputs are kept in pinned host memory (on CPU, host and "
                                           "device memory are the same: nothing moves)"
                                           if self.cpu_checkpointing else "false: region inputs stay on the device"))
        if not self.partition_activations:
            out.append("partition_activations=false: saved activations are not partitioned")
        elif tensor_axis is not None:
            out.append(f"partition_activations=true: region inputs kept split along T over the "
                       f"'{tensor_axis}' axis, all-gathered before recomputing")
        elif sequence_parallel:
            out.append("partition_activations=true: no effect here, sequence parallelism already keeps region "
                       "inputs split along T over the tensor axis (pass --no-sequence_parallel to split them here "
                       "instead)")
        else:
            out.append("partition_activations=true: no effect here, the mesh has no tensor-parallel axis (its axes "
                       "split the batch, so no device holds a copy of another's activations; there is nothing "
                       "to partition)")
        for k in ("contiguous_memory_optimization", "synchronize_checkpoint_boundary", "profile"):
            out.append(f"{k}={str(getattr(self, k)).lower()}: accepted; {NOTES[k]}")
        if self.ignored:
            out.append(f"not read (only {BLOCK} is): {', '.join(self.ignored)}")
        return out


def parse(config: dict, source: str = "deepspeed config") -> DeepSpeedCheckpointing:
    """Validate a DeepSpeed config dict and return its `activation_checkpointing` block.

    Raises ValueError naming the source, the key and what is valid.
    Example:
      >>> parse({"activation_checkpointing": {"number_checkpoints": 4}}).number_checkpoints
      4
    """
    if not isinstance(config, dict):
        raise ValueError(f"{source}: expected a JSON object with an \"{BLOCK}\" block")
    if BLOCK not in config:
        raise ValueError(f"{source}: no \"{BLOCK}\" block; add one, e.g. "
                         f"{{\"{BLOCK}\": {{\"number_checkpoints\": 4, \"cpu_checkpointing\": true}}}}")
    block = config[BLOCK]
    if not isinstance(block, dict):
        raise ValueError(f"{source}: \"{BLOCK}\" must be an object of settings, got {json.dumps(block)}")
    unknown = [k for k in block if k not in KEYS]
    if unknown:
        raise ValueError(f"{source}: unknown {BLOCK} key(s) {', '.join(map(repr, unknown))}; valid keys: "
                         f"{', '.join(KEYS)}")
    return DeepSpeedCheckpointing(**block, ignored=tuple(k for k in config if k != BLOCK), source=source)


def load(path: str) -> DeepSpeedCheckpointing:
    """Read a DeepSpeed JSON config file and return its validated `activation_checkpointing` block."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; pass a DeepSpeed JSON config file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e.__class__.__name__}: {e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return parse(config, source=path)
