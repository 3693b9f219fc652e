"""Device mesh and shardings: the batch over `data` x `fsdp`, parameters and optimizer state over
`fsdp` and, for Megatron-style tensor parallelism, over `tensor`.

# NOTE: FSDP (ZeRO-3) on JAX's own SPMD engine. Every array is placed with a NamedSharding and the
# jitted step is compiled for those placements; XLA inserts the all-gathers of parameters and the
# reduce-scatters of gradients. The `fsdp` axis is data-parallel too (each fsdp shard sees its own
# part of the batch), so the batch is split over both axes; `data` alone replicates parameters.
# A parameter is split along its largest axis that the fsdp size divides; a parameter with no
# such axis (a scalar, a small bias) is replicated.
#
# NOTE: tensor parallelism (`tensor` axis) by annotations only. `remat_lm.models.parallel.param_tensor_axis`
# names the axis of each attention/MLP weight split over `tensor` (column-parallel c_attn, c_fc,
# c_fc2: output features; row-parallel c_proj: input features); fsdp then takes the largest other
# axis it divides. Each device's batch rows are the same on every tensor shard (the batch is split
# over data x fsdp only). The model learns the axis names from `model_sharding` (a
# `remat_lm.models.parallel.ShardingConfig` in its config), set on the compiled step only, which is traced
# under `jax.set_mesh(mesh)`.

Example:
    >>> mesh = make_mesh({"data": 2, "fsdp": 4})
    >>> shardings = state_shardings(mesh, abstract_state)
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from remat_lm.models import parallel
from remat_lm.training.config import MESH_AXES, TENSOR_AXIS, UsageError

BATCH_AXES = ("data", "fsdp")


def make_mesh(shape: dict[str, int], global_batch: int | None = None, devices=None) -> Mesh:
    """A Mesh with axes ("data", "fsdp", "tensor") of the given sizes over the first data·fsdp·tensor
    of `devices` (default `jax.devices()`; `--target`: its compile-only devices, `remat.planning.targets`).

    An axis missing from `shape` has size 1. Raises UsageError when the mesh does not divide the
    device count or the batch.
    """
    shape = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    n = int(np.prod([shape[a] for a in MESH_AXES]))
    devices = list(jax.devices() if devices is None else devices)
    spec = ",".join(f"{a}={shape[a]}" for a in MESH_AXES)
    if len(devices) % n:
        raise UsageError(f"--mesh {spec} spans {n} devices, which does not divide the {len(devices)} available "
                         f"({devices[0].platform}); use axis sizes whose product divides {len(devices)}")
    nb = int(np.prod([shape[a] for a in BATCH_AXES]))
    if global_batch is not None and global_batch % nb:
        raise UsageError(f"--mesh {spec} splits the batch over {nb} devices (data x fsdp) but --batch_size "
                         f"{global_batch} is not divisible by {nb}; use a batch size that is a multiple of {nb}")
    arr = np.array(devices[:n]).reshape([shape[a] for a in MESH_AXES])
    return Mesh(arr, MESH_AXES)


def spec_for(shape, fsdp: int, tensor_axis: int | None = None, tensor: int = 1) -> P:
    """The PartitionSpec of one parameter: axis `tensor_axis` (negative, or None) over "tensor" when
    tensor > 1, and its largest other fsdp-divisible axis over "fsdp"."""
    spec = [None] * len(shape)
    t = None
    if tensor > 1 and tensor_axis is not None and len(shape) >= -tensor_axis:
        t = len(shape) + tensor_axis
        if shape[t] % tensor == 0:
            spec[t] = TENSOR_AXIS
    if fsdp > 1:
        for ax in sorted(range(len(shape)), key=lambda a: -shape[a]):
            if ax != t and shape[ax] % fsdp == 0 and shape[ax] >= fsdp:
                spec[ax] = "fsdp"
                break
    return P(*spec) if any(spec) else P()


def _key_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def state_shardings(mesh: Mesh, abstract_state):
    """NamedShardings for a pytree of arrays/ShapeDtypeStructs (parameters and optimizer state).

    Attention and MLP weights are split over `tensor` (`remat_lm.models.parallel.param_tensor_axis`).
    """
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape.get(TENSOR_AXIS, 1)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: NamedSharding(mesh, spec_for(np.shape(a), fsdp, parallel.param_tensor_axis(_key_names(path)),
                                                     tensor)), abstract_state)


def model_sharding(mcfg, mesh: Mesh, sequence_parallel: bool = True):
    """`mcfg` with `sharding` set for `mesh` when it has a tensor axis of size > 1 (else unchanged).

    Trace the model under `jax.set_mesh(mesh)` afterwards (the constraints are PartitionSpecs).
    """
    if mesh.shape.get(TENSOR_AXIS, 1) <= 1:
        return mcfg
    sc = parallel.ShardingConfig(batch=BATCH_AXES, tensor=TENSOR_AXIS, sequence=sequence_parallel)
    return dataclasses.replace(mcfg, sharding=sc)


def check_tensor(mcfg, mesh_shape: dict[str, int], sequence_length: int, sequence_parallel: bool = True) -> None:
    """UsageError unless the model splits evenly over the tensor axis (heads, kv heads, MLP hidden
    units, and T with sequence parallelism)."""
    t = mesh_shape.get(TENSOR_AXIS, 1)
    if t <= 1:
        return
    checks = [("n_head", mcfg.n_head), ("n_kv_head", mcfg.n_kv_head), ("MLP hidden size", mcfg.ffn_hidden)]
    if sequence_parallel:
        checks.append(("--sequence_length", sequence_length))
    for what, n in checks:
        if n % t:
            fix = ("or turn off sequence parallelism with --no-sequence_parallel"
                   if what == "--sequence_length" else "or choose a model whose size it divides")
            raise UsageError(f"--mesh {TENSOR_AXIS}={t} splits the {what} ({n}) over {t} devices, which does not "
                             f"divide it; use a {TENSOR_AXIS} size that divides {n} {fix}")


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int) -> NamedSharding:
    """Shard axis `batch_axis` of an `ndim`-D batch over data x fsdp."""
    return NamedSharding(mesh, P(*[(BATCH_AXES if a == batch_axis else None) for a in range(ndim)]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
