"""The analytic activation-memory model (remat_lm/models/memory_model.py, docs/memory-model.md) against what
JAX actually saves, for both models, float32 and bf16, every granularity, method and tag policy."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from remat_lm.models import gpt2, llama3, memory_model
import remat
from remat import RecomputeConfig as R
from remat import memory

B, T = 4, 128
BASES = {
    "gpt2": (gpt2, gpt2.GPT2Config(block_size=T, vocab_size=512, n_layer=4, n_head=4, n_embd=128)),
    "llama3": (llama3, llama3.Llama3Config.preset("tiny", block_size=T, vocab_size=512, n_layer=4, n_head=4,
                                                  n_kv_head=2, n_embd=128)),
}
SETTINGS = {
    "none": R(), "full": R(granularity="full"), "uniform2": R(granularity="full", method="uniform", num_layers=2),
    "uniform3": R(granularity="full", method="uniform", num_layers=3),
    "block2": R(granularity="full", method="block", num_layers=2),
    "reentrant": R(granularity="full", use_reentrant=True),
    "core_attn": R(granularity="selective"), "mlp": R(granularity="selective", modules="mlp"),
    "all3": R(granularity="selective", modules="core_attn,mlp,norm"),
    "everything": R(granularity="full", policy="everything"),
    "save_qkv": R(granularity="full", method="uniform", num_layers=2, policy="save_names:qkv,mlp_up"),
}


def _prediction_params():
    # fast: every setting once, GPT-2 in float32 and LLaMA-3 in bfloat16; the other halves slow
    for model in BASES:
        for setting in SETTINGS:
            for dtype in ("float32", "bfloat16"):
                fast = (model, dtype) in {("gpt2", "float32"), ("llama3", "bfloat16")}
                yield pytest.param(model, setting, dtype, id=f"{model}-{setting}-{dtype}",
                                   marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("model, setting, dtype", list(_prediction_params()))
def test_prediction_within_1_percent(model, setting, dtype):
    mod, base = BASES[model]
    cfg = dataclasses.replace(base, recompute=SETTINGS[setting], dtype=dtype)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                          jax.eval_shape(lambda: mod.init_params(cfg, jax.random.PRNGKey(0))))
    idx = jnp.zeros((B, T), jnp.int32)
    measured = memory.saved_residuals(lambda p: mod.loss_fn(p, cfg, idx, idx), params).intermediates
    layer, head = memory_model.activation_bytes(cfg, B, T)
    predicted = memory.predict_saved(layer, cfg.n_layer, cfg.recompute, head)
    # The goal is 5%; the model accounts for every saved value, so hold it to 1%.
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


def test_unmodelled_policies_return_none():
    layer, head = memory_model.activation_bytes(BASES["gpt2"][1], B, T)
    assert memory.predict_saved(layer, 4, R(granularity="full", policy="dots"), head) is None


@pytest.mark.parametrize("model", list(BASES))
def test_prediction_for_per_layer_policies(model):
    mod, base = BASES[model]
    rc = R(granularity="full", layers=remat.per_layer((None, "mlp", "full", "core_attn+norm")))
    cfg = dataclasses.replace(base, recompute=rc)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                          jax.eval_shape(lambda: mod.init_params(cfg, jax.random.PRNGKey(0))))
    idx = jnp.zeros((B, T), jnp.int32)
    measured = memory.saved_residuals(lambda p: mod.loss_fn(p, cfg, idx, idx), params).intermediates
    layer, head = memory_model.activation_bytes(cfg, B, T)
    assert abs(memory.predict_saved(layer, cfg.n_layer, rc, head) - measured) <= 0.01 * measured


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("setting", ["none", "full", "uniform3"])
@pytest.mark.parametrize("model", list(BASES))
def test_prediction_with_chunked_loss(model, setting, dtype):
    # T=128 in chunks of 48: two chunks under the scan and a remainder of 32.
    mod, base = BASES[model]
    cfg = dataclasses.replace(base, recompute=SETTINGS[setting], dtype=dtype, loss_chunk=48)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                          jax.eval_shape(lambda: mod.init_params(cfg, jax.random.PRNGKey(0))))
    idx = jnp.zeros((B, T), jnp.int32)
    res = memory.saved_residuals(lambda p: mod.loss_fn(p, cfg, idx, idx), params)
    assert "lm_head" not in res.by_name()  # no chunk's logits are kept for the backward
    layer, head = memory_model.activation_bytes(cfg, B, T)
    predicted = memory.predict_saved(layer, cfg.n_layer, cfg.recompute, head)
    assert abs(predicted - res.intermediates) <= 0.01 * res.intermediates, (predicted, res.intermediates)


@pytest.mark.parametrize("model", list(BASES))
def test_unchunked_loss_keeps_one_logits_sized_buffer(model):
    """The cross-entropy's backward keeps the logits themselves (tagged lm_head) and each row's
    log-sum-exp: one float32 (B, T, V) value, nothing else of that size."""
    mod, cfg = BASES[model]
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                          jax.eval_shape(lambda: mod.init_params(cfg, jax.random.PRNGKey(0))))
    idx = jnp.zeros((B, T), jnp.int32)
    res = memory.saved_residuals(lambda p: mod.loss_fn(p, cfg, idx, idx), params)
    logits = jax.eval_shape(lambda p: mod.GPT2(cfg).apply({"params": p}, idx)[0] if model == "gpt2"
                            else mod.Llama3(cfg).apply({"params": p}, idx)[0], params)
    head = lambda r: r.name == "lm_head" or "(_ce_fwd)" in r.source  # noqa: E731 (the MLP's may share the shape)
    wide = [r for r in res.rows if r.kind != "argument" and r.shape == logits.shape and head(r)]
    assert [(r.name, r.dtype, r.bytes) for r in wide] == [("lm_head", "float32", logits.size * 4)], res.table()
    rows = [r for r in res.rows if r.kind != "argument" and r.shape == logits.shape[:-1] and head(r)]
    assert [(r.dtype, r.bytes) for r in rows] == [("float32", logits.size // logits.shape[-1] * 4)], res.table()
