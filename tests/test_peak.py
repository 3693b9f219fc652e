"""The compiled peak really falls: XLA:GPU's temp bytes (an H200, compiled deviceless) for the GPT-2
gradient at the bench reference shape (8 layers, C=256, 4 heads, T=256, B=8, vocab 1024, float32).
Only compiled, never run.
"""
import dataclasses
import sys

import jax
import jax.numpy as jnp
import pytest

from remat_lm.bench.common import REFERENCE_BATCH, reference_config
from remat_lm.models import gpt2
from remat import RecomputeConfig
from remat.planning import targets

import targethelp

REF = reference_config("gpt2")
IDX = jnp.zeros((REFERENCE_BATCH, REF.block_size), jnp.int32)
SETTINGS = {
    "none": RecomputeConfig(),
    "full": RecomputeConfig(granularity="full"),
    "uniform2": RecomputeConfig(granularity="full", method="uniform", num_layers=2),
    "block4": RecomputeConfig(granularity="full", method="block", num_layers=4),
}


def temp(scan: bool, rc: RecomputeConfig) -> int:
    cfg = dataclasses.replace(REF, recompute=rc, scan_layers=scan)
    params = jax.eval_shape(lambda: gpt2.init_params(cfg, jax.random.PRNGKey(0)))
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    return targets.compiled_memory(jax.grad(lambda p: gpt2.loss_fn(p, cfg, IDX, IDX)), params, target="h200").temp


@pytest.mark.slow  # ~25 s; tests/test_flag_to_program.py keeps the train step's full/none temp fast
@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_full_remat_cuts_compiled_temp_on_xla_gpu(scan):
    targethelp.need("cuda")
    t = {k: temp(scan, rc) for k, rc in SETTINGS.items()}
    assert t["full"] / t["none"] <= 0.15, {k: v / 2**20 for k, v in t.items()}
    assert t["full"] < t["uniform2"] < t["none"] and t["full"] < t["block4"] < t["none"], t
