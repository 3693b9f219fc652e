"""Device mesh and shardings: the batch over `data` x `fsdp`, parameters and optimizer state over `fsdp`.

# NOTE: FSDP (ZeRO-3) on JAX's own SPMD engine. Every array is placed with a NamedSharding and the
# jitted step is compiled for those placements; XLA inserts the all-gathers of parameters and the
# reduce-scatters of gradients. The `fsdp` axis is data-parallel too (each fsdp shard sees its own
# part of the batch), so the batch is split over both axes; `data` alone replicates parameters.
# A parameter is split along its largest axis that the fsdp size divides; a parameter with no
# such axis (a scalar, a small bias) is replicated.

Example:
    >>> mesh = make_mesh({"data": 2, "fsdp": 4})
    >>> shardings = state_shardings(mesh, abstract_state)
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from training.config import MESH_AXES, UsageError

BATCH_AXES = ("data", "fsdp")


def maybe_initialize_distributed() -> bool:
    """`training.distributed.initialize()`: `jax.distributed.initialize()` when the environment asks."""
    from training import distributed

    return distributed.initialize()


def make_mesh(shape: dict[str, int], global_batch: int | None = None) -> Mesh:
    """A Mesh with axes ("data", "fsdp") of the given sizes over the first data·fsdp devices.

    Raises UsageError when the mesh does not divide the device count or the batch.
    """
    n = int(np.prod([shape[a] for a in MESH_AXES]))
    devices = jax.devices()
    spec = ",".join(f"{a}={shape[a]}" for a in MESH_AXES)
    if len(devices) % n:
        raise UsageError(f"--mesh {spec} spans {n} devices, which does not divide the {len(devices)} available "
                         f"({devices[0].platform}); use axis sizes whose product divides {len(devices)}")
    if global_batch is not None and global_batch % n:
        raise UsageError(f"--mesh {spec} splits the batch over {n} devices but --batch_size {global_batch} is not "
                         f"divisible by {n}; use a batch size that is a multiple of {n}")
    arr = np.array(devices[:n]).reshape([shape[a] for a in MESH_AXES])
    return Mesh(arr, MESH_AXES)


def spec_for(shape, fsdp: int) -> P:
    """The PartitionSpec of one parameter: its largest fsdp-divisible axis over "fsdp"."""
    if fsdp > 1:
        for ax in sorted(range(len(shape)), key=lambda a: -shape[a]):
            if shape[ax] % fsdp == 0 and shape[ax] >= fsdp:
                return P(*[("fsdp" if a == ax else None) for a in range(len(shape))])
    return P()


def state_shardings(mesh: Mesh, abstract_state):
    """NamedShardings for a pytree of arrays/ShapeDtypeStructs (parameters and optimizer state)."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda a: NamedSharding(mesh, spec_for(np.shape(a), fsdp)), abstract_state)


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int) -> NamedSharding:
    """Shard axis `batch_axis` of an `ndim`-D batch over data x fsdp."""
    return NamedSharding(mesh, P(*[(BATCH_AXES if a == batch_axis else None) for a in range(ndim)]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put_batch(array: np.ndarray, sharding: NamedSharding):
    """Place a host batch (the same on every process) as one global array."""
    return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])
