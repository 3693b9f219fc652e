"""Tensor and sequence parallelism for the models, by sharding annotations only.

`ShardingConfig` names the mesh axes; a model config whose `sharding` field holds one constrains
its activations with `jax.lax.with_sharding_constraint` at the Megatron points, and
`param_tensor_axis` says which parameter axis is split over `tensor` (column-parallel c_attn,
c_fc, c_fc2: the output axis; row-parallel c_proj: the input axis). XLA inserts every collective.

# NOTE: how the model learns the axis names. The model config carries `sharding: ShardingConfig |
# None` (default None: no constraint at all, the model runs without any mesh). The train step sets
# it (`remat_lm.training.sharding.model_sharding`) only for the compiled step, under `jax.set_mesh(mesh)`,
# because the constraints are bare PartitionSpecs that need a mesh context; init, eval_shape with
# (1, 1) token batches, sampling and llm.c I/O keep None. `remat_lm.training.model.config_dict` leaves the
# field out of checkpoints: a run restores under any mesh.
#
# The layout (Megatron-LM's, arXiv 1909.08053 and 2205.05198):
#   - between the blocks' pieces (norms, residual adds, dropout) an activation (B, T, C) is
#     P(batch, tensor, None) with sequence parallelism (`sequence=True`), else P(batch, None, None);
#     so is the embedding output entering the first block. Left free, sharding propagation may
#     pick another layout for it: with distributed saved activations (remat `shard_inputs`, whose
#     store first splits the region input along C) XLA computed it split along C and all-gathered
#     it, whole, for the first block's forward (tests/test_tensor_parallel.py);
#   - q, k, v, the attention context and the MLP hidden (B, T, F) are P(batch, None, tensor):
#     heads and hidden units split, T whole. Going in, XLA all-gathers the norm's output along T;
#     coming out of the row-parallel c_proj it reduce-scatters the partial sums along T (an
#     all-reduce without sequence parallelism).
#   - c_attn's outputs are [q; k; v], so an even split of its output axis is not head-aligned: the
#     layer runs one matmul per piece with columns of the one `nn.Dense` kernel
#     (`remat_lm.models.layers._pieces`), so XLA moves columns of the weight, not activations.
#     Checkpoints and .bin files do not depend on the mesh.
# Annotations never change values: the gradients equal one device's (tests/test_tensor_parallel.py).

Example:
    >>> from remat_lm.models.gpt2 import GPT2Config
    >>> sc = ShardingConfig()                         # axes data, fsdp (batch) and tensor
    >>> cfg = GPT2Config.preset("tiny", sharding=sc)  # then trace under jax.set_mesh(mesh)
    >>> cfg.sharding.tensor, cfg.sharding.sequence
    ('tensor', True)
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

# (module, submodule, parameter) → the parameter's axis split over `tensor`, counted from the end so
# the scan layout's leading layer axis does not matter. Everything else is not split over tensor.
TENSOR_SPLIT = {
    ("attn", "c_attn", "kernel"): -1, ("attn", "c_attn", "bias"): -1,   # column-parallel: output features
    ("attn", "c_proj", "kernel"): -2,                                   # row-parallel: input features
    ("mlp", "c_fc", "kernel"): -1, ("mlp", "c_fc", "bias"): -1,
    ("mlp", "c_fc2", "kernel"): -1,
    ("mlp", "c_proj", "kernel"): -2,
}


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Mesh axis names the model constrains its activations with.

    Args:
      batch: the axes the batch is split over (data parallel and FSDP).
      tensor: the tensor-parallel axis: heads and MLP hidden units are split over it.
      sequence: sequence parallelism: between attention and MLP, (B, T, C) is split along T over
        `tensor` (else replicated over it).
    Example:
      >>> ShardingConfig(batch=("data", "fsdp"), tensor="tensor", sequence=True)
      ShardingConfig(batch=('data', 'fsdp'), tensor='tensor', sequence=True)
    """
    batch: tuple[str, ...] = ("data", "fsdp")
    tensor: str = "tensor"
    sequence: bool = True

    def __post_init__(self):
        object.__setattr__(self, "batch", tuple(self.batch))
        names = self.batch + (self.tensor,)
        if not all(isinstance(a, str) and a for a in names) or len(set(names)) != len(names):
            raise ValueError(f"ShardingConfig: axis names {names!r} must be distinct non-empty strings")
        if not isinstance(self.sequence, bool):
            raise ValueError(f"ShardingConfig.sequence={self.sequence!r} must be True or False")

    @property
    def residual(self) -> P:
        """(B, T, C) between the pieces of a block: T split over tensor with sequence parallelism."""
        return P(self.batch, self.tensor if self.sequence else None, None)

    @property
    def split(self) -> P:
        """(B, T, F) inside attention and MLP: features (heads, hidden units) split over tensor."""
        return P(self.batch, None, self.tensor)


def check(sharding) -> None:
    """Raise ValueError unless `sharding` is None or a ShardingConfig (for model configs)."""
    if sharding is not None and not isinstance(sharding, ShardingConfig):
        raise ValueError(f"sharding={sharding!r} must be a remat_lm.models.parallel.ShardingConfig or None")


def residual(x, sharding: ShardingConfig | None):
    """Constrain a (B, T, C) activation between attention and MLP (no-op without `sharding`)."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding.residual)


def split(x, sharding: ShardingConfig | None):
    """Constrain a (B, T, F) activation whose features are split over tensor (no-op without `sharding`)."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding.split)


def param_tensor_axis(path: tuple[str, ...]) -> int | None:
    """The axis (negative) of the parameter at `path` split over tensor, or None.

    `path` is the parameter's key path (any prefix: optimizer state, `blocks/h_3`, ...).
    Example:
      >>> param_tensor_axis(("params", "blocks", "h_0", "attn", "c_attn", "kernel"))
      -1
    """
    return TENSOR_SPLIT.get(tuple(path[-3:]))
