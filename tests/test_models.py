"""GPT-2 and LLaMA-3: gradients under every recompute setting equal the no-remat model's.

Tiny presets (C=32, 4 heads, 2 or 3 layers), B=2, T=16, float32 unless a test says otherwise.
Every setting compiles once (`_value_and_grad` is cached); gradients are compared in llm.c's
tensor layout so loop and scan models line up name by name.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remat_lm.bench.common import REFERENCE_BATCH, reference_config
from remat_lm.models import attention, gpt2, layers, llama3
from remat import RecomputeConfig, memory

MODELS = {"gpt2": gpt2, "llama3": llama3}
CONFIGS = {"gpt2": gpt2.GPT2Config, "llama3": llama3.Llama3Config}
B, T = 2, 16

# Tolerance for recompute vs no recompute in float32: a recomputation repeats the forward's
# operations, but XLA may fuse the copies differently, which moves float32 rounding (~1e-7
# relative per op) around; 1e-5 of the leaf's largest entry leaves room for that and nothing else.
GRAD_TOL = 1e-5

FULL = dict(granularity="full")
SETTINGS = {  # id: (n_layer, RecomputeConfig kwargs); adding a row adds its tests
    "full-none": (2, dict(FULL)),
    "full-uniform1": (2, dict(FULL, method="uniform", num_layers=1)),
    "full-uniform2": (2, dict(FULL, method="uniform", num_layers=2)),
    "full-block1": (2, dict(FULL, method="block", num_layers=1)),
    "full-block2": (2, dict(FULL, method="block", num_layers=2)),
    "full-uniform2-L3": (3, dict(FULL, method="uniform", num_layers=2)),  # a 2 + 1 remainder
    "full-block2-L3": (3, dict(FULL, method="block", num_layers=2)),      # 2 regions + 1 plain
    "selective-core_attn": (2, dict(granularity="selective", modules=("core_attn",))),
    "selective-mlp": (2, dict(granularity="selective", modules=("mlp",))),
    "selective-core_attn+mlp+norm": (2, dict(granularity="selective", modules=("core_attn", "mlp", "norm"))),
}
# Reentrant (custom_vjp) recompute applies to granularity full only.
SETTINGS.update({f"{k}-reentrant": (n, dict(kw, use_reentrant=True))
                 for k, (n, kw) in list(SETTINGS.items()) if kw["granularity"] == "full"})

# NOTE: test time. Each setting costs one XLA:CPU compilation (~1 s CPU for the tiny model at
# backend optimization level 0, twice that at the default level). The fast run covers each
# distinct plan once with the Python loop of layers (full-uniform1 and full-block2 on 2 layers
# plan exactly as full-none), reentrant per layer and with a remainder region, and under scan the
# settings whose scan layout differs (uniform with a remainder, block, reentrant).
# The other combinations are marked `slow` (`pytest -m slow`).
FAST_LOOP = ("full-none", "full-uniform2", "full-block1", "full-uniform2-L3", "full-block2-L3",
             "selective-core_attn", "selective-mlp", "selective-core_attn+mlp+norm",
             "full-none-reentrant", "full-uniform2-L3-reentrant")
FAST_SCAN = ("full-none", "full-uniform2-L3", "full-block2-L3", "full-none-reentrant")
# NOTE: excess precision. By default XLA:CPU may keep a fused bf16 intermediate in float32 where
# the unfused program rounds it; a recomputation fuses differently from the forward, so bf16
# gradients then differ from no-remat by bf16-sized noise (measured up to 1.8e-2 of max|g| on
# the tiny LLaMA, as large as bf16 vs float32 itself). With `xla_allow_excess_precision` off
# every bf16 result is rounded where the program says, and recompute is exact again. No effect
# on float32.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_allow_excess_precision": False}


def _cases():
    for setting in SETTINGS:
        for scan in (False, True):
            fast = setting in (FAST_SCAN if scan else FAST_LOOP)
            yield pytest.param(setting, scan, id=f"{setting}-{'scan' if scan else 'loop'}",
                               marks=() if fast else pytest.mark.slow)


def _config(model: str, n_layer: int = 2, **kw):
    # The tiled attention core (the default on CPU) with a tile of 8 < T = 16: every model test
    # crosses a tile boundary, masked tiles skipped (remat_lm/models/attention.py).
    kw.setdefault("attention_tile", 8)
    return CONFIGS[model].preset("tiny", n_layer=n_layer, **kw)


@functools.lru_cache(maxsize=None)
def _tensors(model: str, n_layer: int):
    """Fixed float32 weights in llm.c layout (shared by loop and scan models): matrices N(0, 0.1²)
    (larger than GPT-2's init so that every path carries signal), norm weights N(1, 0.1²)."""
    rng = np.random.default_rng(n_layer)
    shapes = MODELS[model].llmc_shapes(_config(model, n_layer))
    norms = ("ln_1.w", "ln_2.w", "ln_f.w")
    return {k: (rng.standard_normal(s) * 0.1 + (k in norms)).astype(np.float32) for k, s in shapes.items()}


def _batch(cfg):
    k1, k2 = jax.random.split(jax.random.key(1))
    return (jax.random.randint(k1, (B, T), 0, cfg.vocab_size), jax.random.randint(k2, (B, T), 0, cfg.vocab_size))


@functools.lru_cache(maxsize=None)
def _value_and_grad(model: str, cfg, dropout_seed: int | None = None):
    """(loss, {llm.c name: gradient}) for `cfg`, jitted; one compilation per distinct config."""
    mod = MODELS[model]
    params = mod.from_llmc(cfg, _tensors(model, cfg.n_layer))
    key = None if dropout_seed is None else jax.random.key(dropout_seed)
    x, y = _batch(cfg)
    step = jax.jit(jax.value_and_grad(mod.loss_fn), static_argnums=1).lower(params, cfg, x, y, key)
    loss, grads = step.compile(COMPILER_OPTIONS)(params, x, y, key)
    return np.asarray(loss), mod.to_llmc(cfg, grads)


def _assert_grads_close(got, want, tol=GRAD_TOL):
    assert got.keys() == want.keys()
    for k in want:
        scale = np.abs(want[k]).max()
        err = np.abs(got[k].astype(np.float64) - want[k]).max()
        assert err <= tol * scale, f"{k}: max|Δg| = {err:.3e} > {tol:g}·max|g| = {tol * scale:.3e}"


# ------------------------------------------------------------------------------------------------
# Recompute settings: loss and every gradient equal the no-remat model's.

# LLaMA-3 in the fast run: selective and reentrant (plain and the scanned remainder with the slow set:
# GPT-2 keeps both fast); the rest of its fast GPT-2 matrix runs with `-m slow` (the layer stack is shared).
LLAMA_FAST = {("selective-core_attn", False)}
# GPT-2 cases whose code path another fast case takes (uniform2 at L=3 covers L=2, block2 covers
# block1, core_attn+mlp+norm covers mlp, reentrant under scan and in the loop cover reentrant uniform):
GPT2_SLOW = {("full-uniform2", False), ("full-block1", False), ("selective-mlp", False),
             ("full-uniform2-L3-reentrant", False), ("full-uniform2-L3", False)}  # uniform2-L3 stays fast under scan


def _model_cases():
    for model in MODELS:
        for p in _cases():
            setting, scan = p.values
            slow = bool(p.marks) or (model == "llama3" and (setting, scan) not in LLAMA_FAST) or (
                model == "gpt2" and (setting, scan) in GPT2_SLOW)
            yield pytest.param(model, setting, scan, id=f"{model}-{p.id}", marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("model, setting, scan", list(_model_cases()))
def test_recompute_matches_no_remat(model, setting, scan):
    n_layer, kw = SETTINGS[setting]
    loss0, g0 = _value_and_grad(model, _config(model, n_layer))  # the no-remat loop model
    loss, g = _value_and_grad(model, _config(model, n_layer, scan_layers=scan, recompute=RecomputeConfig(**kw)))
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)  # the same forward; only fusion may differ
    _assert_grads_close(g, g0)


@pytest.mark.parametrize("model", list(MODELS))
def test_matches_llmc_float64_reference(model):
    # llm.c's math, independently: tests/llmc_reference.py is a float64 NumPy forward and
    # hand-written backward. float32 against float64 on this tiny model: ≤ 6e-7 of max|g| measured.
    ref = pytest.importorskip("llmc_reference")
    cfg = _config(model)
    if model == "gpt2":
        header = ref.GPT2Header(cfg.block_size, cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd,
                                cfg.padded_vocab_size)
    else:
        header = ref.Llama3Header(cfg.block_size, cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_kv_head,
                                  cfg.n_embd, cfg.ffn_dim_multiplier, cfg.multiple_of, cfg.norm_eps,
                                  cfg.rope_theta, cfg.use_scaled_rope, 4)
    x, y = (np.asarray(a) for a in _batch(cfg))
    _, loss_ref, g_ref = ref.forward_backward(model, header, _tensors(model, 2), x, y)
    loss, g = _value_and_grad(model, cfg)  # the no-remat model, already compiled
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    _assert_grads_close(g, g_ref, tol=1e-5)


@pytest.mark.parametrize("model", ["gpt2", pytest.param("llama3", marks=pytest.mark.slow)])  # shared stack code
def test_scan_matches_loop(model):
    loss0, g0 = _value_and_grad(model, _config(model))
    loss, g = _value_and_grad(model, _config(model, scan_layers=True))
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    _assert_grads_close(g, g0)


@pytest.mark.parametrize("recompute, scan", [pytest.param(dict(FULL), False, marks=pytest.mark.slow), (dict(FULL, use_reentrant=True), False),
                                             (dict(FULL), True)], ids=["full", "reentrant", "full-scan"])
# (full in the loop with the slow set: the loop's dropout keys are the scan's, and reentrant keeps the loop fast)
@pytest.mark.parametrize("model", ["gpt2", pytest.param("llama3", marks=pytest.mark.slow)])  # shared dropout code
def test_dropout_recompute_is_bit_exact(model, recompute, scan):
    # Dropout masks come from the same per-layer keys (LayerStack folds the layer index into the
    # `dropout` stream, in the loop and under scan) in the forward and in the recomputation, and
    # the float32 arithmetic repeats the forward's, so gradients are bit-equal: measured so with
    # COMPILER_OPTIONS. (At XLA's default optimization level the two programs may fuse
    # differently; differences then stay below 1e-6 relative, far from a wrong mask's O(1).)
    loss0, g0 = _value_and_grad(model, _config(model, dropout=0.1), dropout_seed=7)
    cfg = _config(model, dropout=0.1, scan_layers=scan, recompute=RecomputeConfig(**recompute))
    loss, g = _value_and_grad(model, cfg, dropout_seed=7)
    nodrop, _ = _value_and_grad(model, _config(model))
    assert abs(float(loss0) - float(nodrop)) > 1e-4, "dropout had no effect"
    assert loss == loss0
    for k in g0:
        np.testing.assert_array_equal(g[k], g0[k], err_msg=k)


# ------------------------------------------------------------------------------------------------
# Structure: what each setting saves for the backward pass.

def _saved(model: str, n_layer: int, **recompute):
    cfg = _config(model, n_layer, recompute=RecomputeConfig(**recompute))
    mod = MODELS[model]
    params = mod.from_llmc(cfg, _tensors(model, n_layer))
    return memory.saved_residuals(lambda p, x, y: mod.loss_fn(p, cfg, x, y), params, *_batch(cfg)).intermediates


@pytest.mark.parametrize("model", ["gpt2", pytest.param("llama3", marks=pytest.mark.slow)])  # shared stack code
def test_saved_residual_ordering(model):
    none = _saved(model, 4)
    full = _saved(model, 4, **FULL)
    core_attn = _saved(model, 4, granularity="selective", modules=("core_attn",))
    uniform2 = _saved(model, 4, **FULL, method="uniform", num_layers=2)
    block2 = _saved(model, 4, **FULL, method="block", num_layers=2)
    assert full < core_attn < none
    assert uniform2 < full
    assert full < block2 < none


def test_gpt2_no_remat_saves_what_pytorch_does_or_less():
    # The bench reference shape (remat_lm.bench.common.REFERENCE); PyTorch eager's saved bytes there:
    # docs/BENCHMARKS.md, torch_peer.
    cfg = reference_config("gpt2")
    params = jax.eval_shape(lambda: gpt2.init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    idx = jnp.zeros((REFERENCE_BATCH, cfg.block_size), jnp.int32)
    saved = memory.saved_residuals(lambda p, x, y: gpt2.loss_fn(p, cfg, x, y), params, idx, idx)
    assert saved.intermediates <= 333 * 2**20, saved.table()
    names = saved.by_name()
    # flash-style attention: no (B, H, T, T) tensor is kept
    assert not any(len(r.shape) >= 4 and r.shape[-2:] == (256, 256) for r in saved.rows), saved.table()
    assert names["qkv"][1] == 8 * 3 * 8 * 256 * 256 * 4


# ------------------------------------------------------------------------------------------------
# Lean pieces against a plain JAX formulation (float32).

def _plain_ln(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * w + b


def _plain_rms(x, w):
    return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w


def _plain_attention(q, k, v, H, K, rate=0.0, key=None):
    Bq, Tq, _ = q.shape
    D, G = q.shape[-1] // H, H // K
    qh = q.reshape(Bq, Tq, K, G, D)
    kh, vh = k.reshape(Bq, Tq, K, D), v.reshape(Bq, Tq, K, D)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qh, kh) / math.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((Tq, Tq), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    if rate:
        p = jnp.where(attention.dropout_keep(key, rate, p.shape), p / (1 - rate), 0.0)
    return jnp.einsum("bkgqs,bskd->bqkgd", p, vh).reshape(q.shape)


def _plain_ce(logits, y, n_valid):
    logp = jax.nn.log_softmax(logits[..., :n_valid], axis=-1)
    return -jnp.take_along_axis(logp, y[..., None], -1).mean()


def _rand(i, shape, scale=1.0):  # NumPy, so that building LEAN at import compiles nothing
    return (np.random.default_rng(i).standard_normal(shape) * scale).astype(np.float32)


_C, _H = 32, 4
_TARGETS = np.random.default_rng(17).integers(0, 200, (B, T)).astype(np.int32)
LEAN = {  # id: (lean fn, plain fn, args)
    "layer_norm": (lambda x, w, b: gpt2.NORM(dtype=jnp.float32).apply({"params": {"scale": w, "bias": b}}, x),
                   _plain_ln, (_rand(0, (B, T, _C), 3.0) + 1.0, 1.0 + _rand(1, (_C,), 0.1), _rand(2, (_C,), 0.1))),
    "rms_norm": (lambda x, w: layers.rms_norm(x, w, 1e-5), _plain_rms, (_rand(3, (B, T, _C), 3.0), 1.0 + _rand(4, (_C,), 0.1))),
    "gelu_tanh": (layers._gelu, functools.partial(jax.nn.gelu, approximate=True), (_rand(5, (B, T, 4 * _C), 3.0),)),
    "swiglu": (layers._swiglu, lambda g, u: jax.nn.silu(g) * u, (_rand(6, (B, T, 96), 3.0), _rand(7, (B, T, 96)))),
    "attention_mha": (lambda q, k, v: attention.xla_causal_attention(q, k, v, _H, _H),
                      lambda q, k, v: _plain_attention(q, k, v, _H, _H),
                      (_rand(8, (B, T, _C)), _rand(9, (B, T, _C)), _rand(10, (B, T, _C)))),
    "attention_gqa": (lambda q, k, v: attention.xla_causal_attention(q, k, v, _H, 2),
                      lambda q, k, v: _plain_attention(q, k, v, _H, 2),
                      (_rand(11, (B, T, _C)), _rand(12, (B, T, _C // 2)), _rand(13, (B, T, _C // 2)))),
    "attention_dropout": (lambda q, k, v: attention.xla_causal_attention(q, k, v, _H, 2, dropout_rate=0.2, key=jax.random.key(3)),
                          lambda q, k, v: _plain_attention(q, k, v, _H, 2, 0.2, jax.random.key(3)),
                          (_rand(14, (B, T, _C)), _rand(15, (B, T, _C // 2)), _rand(16, (B, T, _C // 2)))),
    "cross_entropy": (lambda z: layers.cross_entropy(z, _TARGETS, 200),  # 256 columns, 200 valid
                      lambda z: _plain_ce(z, _TARGETS, 200),
                      (_rand(18, (B, T, 256), 3.0),)),
}


@pytest.mark.parametrize("piece", list(LEAN))
def test_lean_piece_matches_plain(piece):
    lean, plain, args = LEAN[piece]
    cot = _rand(99, jax.eval_shape(plain, *args).shape)

    @jax.jit  # one compilation for both formulations, forward and gradients
    def both(*a):
        return [(y, vjp(cot)) for y, vjp in (jax.vjp(fn, *a) for fn in (plain, lean))]

    (y0, g0), (y, g) = both(*args)
    np.testing.assert_allclose(y, y0, rtol=0, atol=1e-6 * float(jnp.abs(y0).max()))
    for i, (a, b) in enumerate(zip(g, g0)):
        err, scale = float(jnp.abs(a - b).max()), float(jnp.abs(b).max())
        assert err <= 1e-6 * scale, f"{piece} argument {i}: max|Δg| {err:.3e} vs max|g| {scale:.3e}"


def test_lean_attention_keeps_no_square_tensors():
    q, k, v = LEAN["attention_gqa"][2]
    saved = memory.saved_residuals(lambda q, k, v: attention.xla_causal_attention(q, k, v, _H, 2).sum(), q, k, v)
    assert not any(len(r.shape) >= 4 and r.shape[-2:] == (T, T) for r in saved.rows), saved.table()
    assert saved.intermediates <= 4 * B * _H * T, saved.table()  # only the log-sum-exp


def test_lean_pieces_keep_only_their_inputs():
    """The recomputed activations and norms keep their inputs; rms_norm its input and per-row rstd."""
    x, w = LEAN["rms_norm"][2]
    pieces = {"rms_norm": (lambda x: layers.rms_norm(x, w, 1e-5), x),
              "layer_norm": (lambda x: LEAN["layer_norm"][0](x, w, w), x),
              "gelu_tanh": (layers._gelu, LEAN["gelu_tanh"][2][0])}
    for piece, (fn, arg) in pieces.items():
        saved = memory.saved_residuals(lambda a: fn(a).sum(), arg)
        kept = sum(r.bytes for r in saved.rows if r.kind == "intermediate")  # not the closed-over weights
        assert kept <= 2 * 4 * B * T + 4, (piece, saved.table())  # at most mean and rstd per row
    gate, up = LEAN["swiglu"][2]
    saved = memory.saved_residuals(lambda g, u: layers._swiglu(g, u).sum(), gate, up)
    assert saved.intermediates == 0, saved.table()


def test_rope_scaling_branches():
    freqs = layers.rope_frequencies(8, 500000.0, False)
    scaled = layers.rope_frequencies(8, 500000.0, True)
    wavelen = 2 * np.pi / freqs
    assert wavelen[0] < 2048 and scaled[0] == freqs[0]                       # high frequency: kept
    assert wavelen[-1] > 8192 and np.isclose(scaled[-1], freqs[-1] / 8)       # low frequency: / 8
    mid = (2048 < wavelen) & (wavelen < 8192)
    assert mid.any() and np.all((scaled[mid] > freqs[mid] / 8) & (scaled[mid] < freqs[mid]))


# ------------------------------------------------------------------------------------------------
# llm.c layout, presets, configs.

@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("model", list(MODELS))
def test_llmc_round_trip(model, scan):
    mod = MODELS[model]
    cfg = _config(model, 3, scan_layers=scan)
    shapes = mod.llmc_shapes(cfg)
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    params = mod.from_llmc(cfg, tensors)
    init = jax.eval_shape(lambda: mod.init_params(cfg, jax.random.key(0)))  # the model's own layout
    assert jax.tree.structure(params) == jax.tree.structure(init)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(lambda a: (a.shape, a.dtype), init)
    back = mod.to_llmc(cfg, params)
    assert list(back) == list(shapes)  # the model file's order
    assert all(v.dtype == np.float32 and v.shape == shapes[k] for k, v in back.items())
    jax.tree.map(np.testing.assert_array_equal, back, tensors)
    jax.tree.map(np.testing.assert_array_equal, mod.from_llmc(cfg, back), params)
    other = dataclasses.replace(cfg, scan_layers=not scan)  # the other layout reads the same tensors
    jax.tree.map(np.testing.assert_array_equal, mod.to_llmc(other, mod.from_llmc(other, tensors)), tensors)


@pytest.mark.parametrize("model", list(MODELS))
def test_from_llmc_rejects_wrong_tensors(model):
    mod, cfg = MODELS[model], _config(model)
    tensors = dict(_tensors(model, 2))
    with pytest.raises(ValueError, match="ln_f.w"):
        mod.from_llmc(cfg, {k: v for k, v in tensors.items() if k != "ln_f.w"})
    tensors["attn.c_proj.w"] = tensors["attn.c_proj.w"][:, :, :-1]
    with pytest.raises(ValueError, match="attn.c_proj.w"):
        mod.from_llmc(cfg, tensors)


def _preset_comment_counts(mod) -> dict:
    src = inspect.getsource(mod)
    return {name: int(count.replace(",", ""))
            for name, count in re.findall(r'"(\w+)": dict\([^#]*#\s*([\d,]+)', src)}


@pytest.mark.parametrize("model", list(MODELS))
def test_preset_parameter_counts(model):
    mod, cls = MODELS[model], CONFIGS[model]
    counts = _preset_comment_counts(mod)
    assert set(counts) == set(mod.PRESETS)
    for name, count in counts.items():
        cfg = cls.preset(name)
        assert mod.num_params(cfg) == count == sum(math.prod(s) for s in mod.llmc_shapes(cfg).values()), name
    tiny = cls.preset("tiny")
    shapes = jax.eval_shape(lambda: mod.init_params(tiny, jax.random.key(0)))
    assert sum(math.prod(s.shape) for s in jax.tree.leaves(shapes)) == counts["tiny"]
    assert mod.flops_per_token(tiny) > 6 * (counts["tiny"] - tiny.vocab_size * tiny.n_embd)


def test_preset_shapes():
    assert gpt2.GPT2Config.preset("d12").padded_vocab_size == 50304
    assert llama3.Llama3Config.preset("8b").ffn_hidden == 14336
    assert llama3.Llama3Config.preset("1b").ffn_hidden == 8192
    assert llama3.Llama3Config.preset("tiny").ffn_hidden == 96


@pytest.mark.parametrize("model, kwargs, match", [
    ("gpt2", dict(dtype="float16"), "dtype='float16'.*float32, bfloat16"),
    ("gpt2", dict(n_embd=30), "n_embd=30 is not divisible by n_head=4"),
    ("gpt2", dict(padded_vocab_size=100), "padded_vocab_size=100"),
    ("gpt2", dict(dropout=1.0), "dropout"),
    ("gpt2", dict(n_layer=0), "n_layer=0"),
    ("gpt2", dict(recompute=RecomputeConfig(granularity="full", method="block", num_layers=3)),
     "num_layers: 3 exceeds n_layer=2; use 1..2"),
    ("gpt2", dict(recompute="full"), "RecomputeConfig"),
    ("llama3", dict(dtype="fp32"), "dtype='fp32'"),
    ("llama3", dict(n_kv_head=3), "n_kv_head=3 must divide n_head=4"),
    ("llama3", dict(n_embd=36, n_head=4), "even"),
    ("llama3", dict(norm_eps=0.0), "norm_eps"),
    ("llama3", dict(recompute=RecomputeConfig(granularity="full", method="uniform", num_layers=5)),
     "num_layers: 5 exceeds n_layer=2"),
])
def test_config_validation(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CONFIGS[model].preset("tiny", **kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="valid: d12"):
        gpt2.GPT2Config.preset("d13")


@pytest.mark.parametrize("model", list(MODELS))
def test_call_without_targets(model):
    mod, cfg = MODELS[model], _config(model)
    net = {"gpt2": gpt2.GPT2, "llama3": llama3.Llama3}[model](cfg)
    logits, loss = jax.eval_shape(lambda p, x: net.apply({"params": p}, x),
                                  mod.from_llmc(cfg, _tensors(model, 2)), _batch(cfg)[0])
    vp = getattr(cfg, "padded_vocab_size", cfg.vocab_size)
    assert loss is None and logits.shape == (B, T, vp) and logits.dtype == jnp.float32


# ------------------------------------------------------------------------------------------------
# bfloat16 compute.

def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _eqns(sub)


@pytest.mark.parametrize("model", ["gpt2", pytest.param("llama3", marks=pytest.mark.slow)])  # shared bf16 code
def test_bf16(model):
    # Tolerance: GRAD_TOL, as for float32. With excess precision off (COMPILER_OPTIONS) the
    # recomputation rounds every bf16 value where the forward did, so recompute is exact here
    # (measured bit-equal). With XLA's default excess precision expect ~2e-2 of max|g|: bf16 has
    # 8 significant bits (2^-9 ≈ 2e-3 per rounding) and ~10 roundings lie between a weight
    # gradient and the loss; that is bf16's own noise, which the bf16-vs-float32 check below
    # bounds from the other side.
    mod = MODELS[model]
    loss0, g0 = _value_and_grad(model, _config(model, dtype="bfloat16"))
    loss, g = _value_and_grad(model, _config(model, dtype="bfloat16", recompute=RecomputeConfig(**FULL)))
    assert loss.dtype == np.float32 and all(v.dtype == np.float32 for v in g.values())
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    _assert_grads_close(g, g0)
    loss32, g32 = _value_and_grad(model, _config(model))
    np.testing.assert_allclose(loss0, loss32, rtol=1e-3)  # a sanity bound on the casts
    _assert_grads_close(g0, g32, tol=5e-2)

    cfg = _config(model, dtype="bfloat16")
    params = mod.from_llmc(cfg, _tensors(model, 2))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(jax.eval_shape(lambda: mod.init_params(cfg, jax.random.key(0)))))
    net = {"gpt2": gpt2.GPT2, "llama3": llama3.Llama3}[model](cfg)
    jaxpr = jax.make_jaxpr(lambda p: net.apply({"params": p}, *_batch(cfg)))(params)
    logits, loss_out = jaxpr.out_avals
    assert logits.dtype == jnp.float32 and loss_out.dtype == jnp.float32
    dots = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    # What the backward keeps is bf16, except per-row statistics and the float32 logits.
    saved = memory.saved_residuals(lambda p, x, y: mod.loss_fn(p, cfg, x, y), params, *_batch(cfg))
    wide = [r for r in saved.rows if r.kind != "argument" and r.dtype == "float32" and math.prod(r.shape) >= B * T * cfg.n_embd]
    assert [r.shape[-1] for r in wide] == [logits.shape[-1]], saved.table()
