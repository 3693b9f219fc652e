"""remat_lm/models/attention.py: the tiled causal core against a float64 reference and today's (xla) core,
its dropout bits, its memory growth, cuDNN's named residuals, and the attention switch.

The model-level checks (every recompute setting, dropout bit-equal under remat, the float64 llm.c
reference) run in tests/test_models.py, whose tiny models use the tiled core with a tile smaller
than T (`attention_tile=8`, T=16), so they cross tile boundaries.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import llmc_reference as ref
from trainhelp import ours
from remat_lm.models import attention, gpt2
from remat import memory, policies
from remat.planning import targets
from targethelp import GPU, need

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# id: (B, T, H, K, D, tile)
CASES = {
    "T<tile": (2, 12, 4, 4, 8, 16),
    "T%tile": (2, 37, 4, 2, 8, 16),  # 3 tiles, the last one 5 rows
    "K<H": (2, 32, 4, 1, 8, 16),     # multi-query: 4 query heads read one kv head
    "tile1": (1, 9, 2, 2, 4, 1),     # every tile one row
}
# NOTE: test time. Each case compiles the core's forward and backward, one block per tile
# (~1-3 s on a 2-core machine); the default run keeps a handful, the rest are `slow`.
SLOW = {"tile1", ("K<H", "float32"), ("T%tile", "bfloat16"), ("K<H", "bfloat16")}


def _params(*cases):
    out = []
    for c in cases:
        key = c if len(c) > 1 else c[0]
        out.append(pytest.param(*c, marks=pytest.mark.slow) if key in SLOW else pytest.param(*c))
    return out


def _inputs(B, T, H, K, D, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    return f(B, T, H * D), f(B, T, K * D), f(B, T, K * D), f(B, T, H * D)  # q, k, v, cotangent


def _reference(q, k, v, dy, H, K):
    """float64 forward and backward (tests/llmc_reference.py), k and v repeated over the groups."""
    B, T, _ = q.shape
    D, G = q.shape[-1] // H, H // K
    heads = lambda a, n: a.astype(np.float64).reshape(B, T, n, D).transpose(0, 2, 1, 3)  # (B, n, T, D)
    qh, kh, vh = heads(q, H), np.repeat(heads(k, K), G, axis=1), np.repeat(heads(v, K), G, axis=1)
    y, p = ref._attention_fwd(qh, kh, vh)
    dq, dk, dv = ref._attention_bwd(heads(dy, H), qh, kh, vh, p)
    merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, -1)
    fold = lambda a: a.reshape(B, K, G, T, D).sum(2)  # the G query heads' shares of a kv head
    return merge(y), (merge(dq), merge(fold(dk)), merge(fold(dv)))


def _vjp(fn, q, k, v, dy):
    y, pull = jax.vjp(fn, q, k, v)
    return y, pull(jnp.asarray(dy, y.dtype))


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() / np.abs(np.asarray(b, np.float64)).max())


@pytest.mark.parametrize("case", _params(*[(c,) for c in CASES]))
def test_tiled_matches_float64_reference(case):
    # float32 against float64: every value is a sum of at most T products rounded at ~6e-8
    # relative (the online kernel adds one rescaling per key tile); 1e-6 of the largest entry
    # leaves room for that and for nothing like a wrong mask, a dropped tile or a misplaced group
    # (those are O(1)).
    B, T, H, K, D, tile = CASES[case]
    q, k, v, dy = _inputs(B, T, H, K, D)
    y0, g0 = _reference(q, k, v, dy, H, K)
    fn = lambda q, k, v: attention.tiled_causal_attention(q, k, v, H, K, tile=tile)
    y, g = jax.jit(lambda *a: _vjp(fn, *a))(q, k, v, dy)
    assert _rel(y, y0) <= 1e-6
    for name, a, b in zip("qkv", g, g0):
        assert _rel(a, b) <= 1e-6, (case, f"d{name}", _rel(a, b))


@pytest.mark.parametrize("case, dtype", _params(("T%tile", "float32"), ("K<H", "bfloat16"),
                                                ("K<H", "float32"), ("T%tile", "bfloat16")))
def test_tiled_matches_xla_core_with_dropout(case, dtype):
    # Both cores draw dropout bits as a pure function of (key, position), so with the same key
    # they drop the same probabilities. float32: 1e-6 relative, as above.
    # bfloat16 (inputs, outputs and the probabilities fed to the P·V and dS·K products are bf16
    # in both cores; scores and softmax float32): the cores round the same quantities, but the
    # tiled core sums dk and dv over query tiles in float32 before one rounding, where the xla
    # core rounds one matmul, and XLA may order the float32 sums differently: results may differ
    # by a few bf16 ulps (2^-8 ≈ 3.9e-3 relative each); the online kernel also rounds the
    # unnormalized probabilities exp(s - running max) to bf16 for P·V and divides by the row sum
    # after, where the xla core rounds the normalized ones: again a rounding of the same size.
    # 2e-2 of the largest entry is five ulps; a wrong mask or dropped tile is O(1).
    B, T, H, K, D, tile = CASES[case]
    dt = jnp.dtype(dtype)
    q, k, v, dy = (jnp.asarray(a, dt) for a in _inputs(B, T, H, K, D, seed=1))
    key = jax.random.key(3)
    xla = lambda q, k, v: attention.xla_causal_attention(q, k, v, H, K, dropout_rate=0.3, key=key)
    tiled = lambda q, k, v: attention.tiled_causal_attention(q, k, v, H, K, tile=tile, dropout_rate=0.3, key=key)
    (y0, g0), (y, g) = jax.jit(lambda *a: (_vjp(xla, *a), _vjp(tiled, *a)))(q, k, v, dy)
    nodrop = attention.tiled_causal_attention(q, k, v, H, K, tile=tile)
    assert _rel(nodrop, y0) > 0.1, "dropout had no effect"
    tol = 1e-6 if dtype == "float32" else 2e-2
    assert y.dtype == y0.dtype == dt and all(a.dtype == dt for a in g)
    assert _rel(y, y0) <= tol
    for name, a, b in zip("qkv", g, g0):
        assert _rel(a, b) <= tol, (case, dtype, f"d{name}", _rel(a, b))


def test_dropout_bits_are_a_function_of_position():
    keep = jax.jit(attention.dropout_keep, static_argnums=(1, 2, 3))
    key, rate, shape = jax.random.key(0), 0.25, (2, 2, 2, 24, 24)
    full = np.asarray(keep(key, rate, shape, 0))
    for a, e in [(0, 7), (7, 14), (14, 24)]:  # any query tiling, any key prefix: the same bits
        part = np.asarray(keep(key, rate, shape[:3] + (e - a, e), a))
        np.testing.assert_array_equal(part, full[:, :, :, a:e, :e])
    tile = jax.jit(lambda i, j: attention.dropout_keep(key, rate, shape[:3] + (8, 8), i * 8, j * 8))
    for i, j in [(0, 0), (2, 1), (1, 2)]:  # (query tile, key tile) blocks at traced offsets, as the online kernel draws
        np.testing.assert_array_equal(np.asarray(tile(i, j)), full[:, :, :, 8 * i:8 * i + 8, 8 * j:8 * j + 8])
    assert not np.array_equal(full, np.asarray(keep(jax.random.key(1), rate, shape, 0)))
    many = np.asarray(keep(key, rate, (4, 4, 2, 64, 64), 0))  # 131,072 draws
    assert abs(many.mean() - 0.75) < 5 * math.sqrt(0.75 * 0.25 / many.size)  # binomial, 5 sigma
    assert abs(many[..., 0::2].mean() - many[..., 1::2].mean()) < 0.01  # neighbouring keys alike


def _layer_grad(fn, T, H=2, D=16):
    x = jax.ShapeDtypeStruct((1, T, H * D), jnp.float32)
    return jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))).lower(x, x, x).compile()


def _layer_temp(fn, T, H=2, D=16):
    """XLA:GPU's temp (compiled deviceless for an H200) of one attention layer's forward + backward."""
    x = jax.ShapeDtypeStruct((1, T, H * D), jnp.float32)
    return targets.compiled_memory(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)), x, x, x,
                                   target=GPU).temp


def _hlo_instructions(compiled):
    return sum(1 for line in compiled.as_text().splitlines() if " = " in line)


def test_online_program_size_does_not_grow_with_tiles():
    # The online kernel's loops are traced once: one attention layer's forward + backward has the
    # same number of HLO instructions at 4 and at 128 tiles (T=8192, tile 64: an unrolled kernel
    # would have 8k backward blocks), and the long sequence compiles like the short one.
    fn = lambda q, k, v: attention.tiled_causal_attention(q, k, v, 2, 2, tile=64)
    small, long = _layer_grad(fn, 256), _layer_grad(fn, 8192)
    assert _hlo_instructions(long) == _hlo_instructions(small), (_hlo_instructions(small), _hlo_instructions(long))


def test_tiled_temp_grows_as_T_times_tile():
    # One attention layer's forward + backward, read from what XLA:GPU compiled for an H200: doubling
    # T doubles the tiled core's temp (blocks are tile × T) and quadruples the xla core's (T × T scores).
    need("cuda")
    tiled = lambda q, k, v: attention.tiled_causal_attention(q, k, v, 2, 2, tile=64)
    xla = lambda q, k, v: attention.xla_causal_attention(q, k, v, 2, 2)
    # (Measured on XLA:GPU, h200: 1.52× and 4.00×, t2 = 0.02·x2; the online kernel's temp is O(T·D)
    # accumulators plus one (t, t) tile.)
    t1, t2 = _layer_temp(tiled, 512), _layer_temp(tiled, 1024)
    x1, x2 = _layer_temp(xla, 512), _layer_temp(xla, 1024)
    assert t2 / t1 < 2.5 and x2 / x1 > 3.5, (t1, t2, x1, x2)
    assert t2 < 0.2 * x2


def test_resolve_and_switch():
    assert attention.resolve("auto", jnp.float32, 64) == "tiled"
    assert attention.resolve("auto", jnp.bfloat16, 64) == ("cudnn" if jax.default_backend() == "gpu" else "tiled")
    assert attention.resolve("tiled", jnp.bfloat16, 64) == "tiled"
    with pytest.raises(ValueError, match="attention='flash' is not valid; use one of auto, tiled, xla, cudnn"):
        attention.resolve("flash", jnp.float32, 64)
    if jax.default_backend() != "gpu":  # this machine has no cuDNN: the library says so and names the fix
        q = jnp.zeros((1, 8, 32), jnp.bfloat16)
        with pytest.raises(ValueError, match="use attention='tiled'"):
            attention.causal_attention(q, q, q, 4, 4, attention="cudnn")
        with pytest.raises(ValueError, match="use attention='tiled'"):
            attention.cudnn_causal_attention(q, q, q, 4, 4)  # jax's own "cuDNN is not detected", mapped
    with pytest.raises(ValueError, match="attention='fast'"):
        gpt2.GPT2Config.preset("tiny", attention="fast")
    with pytest.raises(ValueError, match="attention_tile=0"):
        gpt2.GPT2Config.preset("tiny", attention_tile=0)


def test_model_attention_field_changes_the_program():
    # The config field reaches the core: xla keeps (T, T) scores in its compiled temp, tiled does not
    # (the gradient compiled by XLA:GPU for an H200).
    need("cuda")
    temps = {}
    for impl in ("xla", "tiled"):
        cfg = gpt2.GPT2Config.preset("tiny", block_size=128, attention=impl, attention_tile=32)
        params = jax.eval_shape(lambda: gpt2.init_params(cfg, jax.random.key(0)))
        idx = jax.ShapeDtypeStruct((2, 128), jnp.int32)
        temps[impl] = targets.compiled_memory(jax.grad(lambda p, x, y: gpt2.loss_fn(p, cfg, x, y)), params, idx, idx,
                                              target=GPU).temp
    # measured on XLA:GPU, h200: 1.84 vs 3.94 MB (0.47); the xla core's (B, H, T, T) float32 scores are
    # 0.5 MB per copy
    assert temps["tiled"] < 0.8 * temps["xla"], temps


def _named(q, k, v, H, K):
    return attention.cudnn_causal_attention(q, k, v, H, K, implementation="xla")


def test_cudnn_wrapper_names_its_residuals_and_keeps_gradients():
    # The wrapper used for cuDNN, run with XLA's implementation of jax.nn.dot_product_attention:
    # its VJP's residuals carry `attn_probs`, so the policies decide about them by name.
    B, T, H, K, D, _ = CASES["K<H"]
    q, k, v, dy = _inputs(B, T, H, K, D, seed=2)
    f = lambda q, k, v: (_named(q, k, v, H, K) * dy).sum()
    saved = memory.saved_residuals(f, q, k, v)
    assert "attn_probs" in saved.by_name(), saved.table()
    assert all(r.name == "attn_probs" for r in saved.rows if r.kind not in ("argument", "constant")), saved.table()
    for name, kept in (("core_attn", False), ("save_names:attn_probs", True), ("everything", True), ("full", False)):
        s = memory.saved_residuals(jax.checkpoint(f, policy=policies.get(name)), q, k, v)
        assert ("attn_probs" in s.by_name()) == kept, (name, s.table())
    y0, g0 = _reference(q, k, v, dy, H, K)
    g = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, g0):
        assert _rel(a, b) <= 1e-6


def test_train_attention_flag(tmp_path):
    from remat_lm.training.config import config_from_args
    from remat_lm.training.run import prepare
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 40)
    setup = prepare(config_from_args(["--attention", "xla", "--attention_tile", "16", "--data", str(text)]))
    assert (setup.mcfg.attention, setup.mcfg.attention_tile) == ("xla", 16)
    if jax.default_backend() == "gpu":
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--attention", "cudnn", "--data", str(text),
                        "--log_jsonl", str(tmp_path / "l.jsonl")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    lines = ours(p.stderr)
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "--attention cudnn cannot run" in lines[0] and "use --attention tiled" in lines[0]
    assert not (tmp_path / "l.jsonl").exists()
