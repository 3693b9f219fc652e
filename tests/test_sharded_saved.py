"""Sharded saved activations (Megatron's distribute_saved_activations) on 8 CPU devices.

Mesh data=2 x fsdp=4 (Auto axes); the batch is sharded over `data`, so activations are replicated
over `fsdp`. With `shard_inputs="fsdp"` each region keeps its input sharded along T over fsdp
and all-gathers it before recomputing.
"""
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import remat
from tinyblocks import block, init_block, rel_err

L, B, T, C = 4, 8, 32, 32
KEY = jax.random.PRNGKey(0)
PS = [init_block(k, C) for k in jax.random.split(KEY, L)]
X = jax.random.normal(KEY, (B, T, C))


def loss(ps, x, cfg):
    return jnp.mean(remat.apply_layers(lambda p, h, k: block(p, h), ps, x, cfg) ** 2)


@pytest.mark.slow  # ~20 s; tests/test_tensor_parallel.py keeps --distribute_saved_activations (the same shard_inputs) fast
@pytest.mark.parametrize("reentrant", [False, True])  # False: ~16-50 s
def test_saved_inputs_sharded_over_fsdp_on_xla_cpu(reentrant):
    assert len(jax.devices()) >= 8, "tests/conftest.py sets 8 host devices"
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    ref = jax.grad(loss)(PS, X, remat.RecomputeConfig())
    out = {}
    with jax.set_mesh(mesh):
        x = jax.device_put(X, NamedSharding(mesh, P("data", None, None)))
        for axis in (None, "fsdp"):
            cfg = remat.RecomputeConfig(granularity="full", use_reentrant=reentrant, shard_inputs=axis)
            f = jax.jit(jax.grad(loss), static_argnums=2)
            compiled = f.lower(PS, x, cfg).compile()
            moved = re.findall(r"= \w+\[\d+,\d+,\d+\]\S* (?:all-gather|all-to-all|all-reduce)\(", compiled.as_text())
            out[axis] = compiled.memory_analysis().temp_size_in_bytes, len(moved)
            assert rel_err(f(PS, x, cfg), ref) <= 1e-5  # gradients unchanged
    # Per device, the L-1 saved region inputs (B/2, T, C) float32 shrink to a quarter.
    saved_inputs = (L - 1) * (B // 2) * T * C * 4
    assert out[None][0] - out["fsdp"][0] >= 0.75 * saved_inputs * 0.9, out
    # Activations (rank-3 arrays) now move between devices: the shards are made by an all-to-all
    # (remat/checkpoint.py `_shard_store`) and gathered, or the recomputation reduced, for the backward.
    assert out["fsdp"][1] > out[None][1] == 0, out


def test_shard_inputs_needs_recompute():
    with pytest.raises(ValueError, match="needs granularity full"):
        remat.RecomputeConfig(shard_inputs="fsdp")
