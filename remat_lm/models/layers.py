"""Shared transformer pieces for the GPT-2 and LLaMA-3 models (Flax Linen), lean in saved memory:
custom-gradient primitives (norms, activations, embedding, cross-entropy, the LM head, RoPE) and
the Linen building blocks made of them. The attention cores live in remat_lm/models/attention.py
(`CausalSelfAttention` calls its switch); the llm.c tensor layout in remat_lm/models/llmc_io.py.

Shapes: B batch, T sequence, C n_embd, H query heads, K kv heads, G = H/K, D head dim, F MLP
hidden width, V (padded) vocabulary. Every shape
in models/ is written as a trailing comment on the line that makes the value: `y = f(x)  # (B, T, C)`.

Activations are tagged with `checkpoint_name(x, remat.names.X)` at the points that
remat/names.py lists; blocks tag block_input, ln_1 and ln_2, the modules here tag the rest.
`attn_probs` tags only the cuDNN and Pallas kernels' residuals (remat_lm/models/attention.py): the tiled and
xla cores never keep their probabilities.

# NOTE: lean residuals. A plain JAX formulation keeps what autodiff finds convenient: GELU's and
# LayerNorm's internals, (B, H, T, T) masks, exp(scores), softmax outputs: more than PyTorch
# eager keeps for the same model (docs/BENCHMARKS.md compares them). Each piece below is a
# `jax.custom_vjp` that keeps what PyTorch's kernels keep and recomputes the rest:
#   layer_norm / rms_norm: the input and per-row statistics (the weights are arguments);
#   gelu_tanh: its input; swiglu: its two inputs;
#   the attention cores (remat_lm/models/attention.py): q, k, v and the per-row log-sum-exp
#     (flash-attention style): scores and probabilities are rebuilt in the backward;
#   cross_entropy: the logits (the per-row log-sum-exp is recomputed in the backward);
#   embed: nothing but the token ids it was given (no int32 copy of them).
# Inside remat regions the custom_vjp residuals are ordinary values to the policy: untagged, so
# recomputed unless a tagged value they derive from is saved. Gradients match the plain
# formulation to float32 rounding (tests/test_models.py).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from remat_lm.models import attention as attention_lib
from remat_lm.models import parallel
from remat import names

F32 = jnp.float32


# ------------------------------------------------------------------------------------------------
# Functional pieces with lean custom VJPs.

def _ln_stats(x, eps):
    xf = x.astype(F32)
    mean = xf.mean(-1, keepdims=True)  # (..., 1)
    rstd = lax.rsqrt(jnp.square(xf - mean).mean(-1, keepdims=True) + eps)  # (..., 1)
    return xf, mean, rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x, w, b, eps=1e-5):
    """LayerNorm over the last axis, computed in float32, returned in x's dtype.

    Args:
      x: (..., C) input; w, b: (C,) scale and shift; eps: variance epsilon.
    Example:
      >>> y = layer_norm(x, jnp.ones(32), jnp.zeros(32))  # x: (B, T, 32)
      >>> round(float(y.mean()), 4), round(float(y.std()), 2)
      (0.0, 1.0)
    """
    return _ln_fwd(x, w, b, eps)[0]


def _ln_fwd(x, w, b, eps):
    xf, mean, rstd = _ln_stats(x, eps)
    y = ((xf - mean) * rstd * w.astype(F32) + b.astype(F32)).astype(x.dtype)
    return y, (x, mean, rstd, w, jnp.zeros((0,), b.dtype))  # the empty array carries b's dtype


def _ln_bwd(eps, res, dy):
    x, mean, rstd, w, b0 = res
    xhat = (x.astype(F32) - mean) * rstd
    dy = dy.astype(F32)
    rows = tuple(range(x.ndim - 1))
    g = dy * w.astype(F32)
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return (dx.astype(x.dtype), (dy * xhat).sum(rows).astype(w.dtype), dy.sum(rows).astype(b0.dtype))


layer_norm.defvjp(_ln_fwd, _ln_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, w, eps=1e-5):
    """RMSNorm `x·rsqrt(mean(x²)+eps)·w` over the last axis in float32, returned in x's dtype.

    Example:
      >>> y = rms_norm(x, jnp.ones(32), 1e-5)
      >>> round(float(jnp.sqrt(jnp.mean(y ** 2))), 2)
      1.0
    """
    return _rms_fwd(x, w, eps)[0]


def _rms_fwd(x, w, eps):
    xf = x.astype(F32)
    rstd = lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps)  # (..., 1)
    return (xf * rstd * w.astype(F32)).astype(x.dtype), (x, rstd, w)


def _rms_bwd(eps, res, dy):
    x, rstd, w = res
    xhat = x.astype(F32) * rstd
    dy = dy.astype(F32)
    g = dy * w.astype(F32)
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx.astype(x.dtype), (dy * xhat).sum(tuple(range(x.ndim - 1))).astype(w.dtype)


rms_norm.defvjp(_rms_fwd, _rms_bwd)

_GELU_C = math.sqrt(2.0 / math.pi)


@jax.custom_vjp
def gelu_tanh(x):
    """GELU, tanh approximation (GPT-2's), in float32; the backward keeps only x.

    Example:
      >>> gelu_tanh(jnp.array([-3.0, 0.0, 3.0])).round(3)
      Array([-0.004,  0.   ,  2.996], dtype=float32)
    """
    xf = x.astype(F32)
    return (xf * (0.5 * (1.0 + jnp.tanh(_GELU_C * (xf + 0.044715 * xf ** 3))))).astype(x.dtype)


def _gelu_fwd(x):
    return gelu_tanh(x), x


def _gelu_bwd(x, dy):
    xf = x.astype(F32)
    t = jnp.tanh(_GELU_C * (xf + 0.044715 * xf ** 3))
    dydx = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * xf * xf)
    return ((dy.astype(F32) * dydx).astype(x.dtype),)


gelu_tanh.defvjp(_gelu_fwd, _gelu_bwd)


@jax.custom_vjp
def swiglu(gate, up):
    """`silu(gate) · up` in float32 (LLaMA's MLP activation); the backward keeps only its inputs.

    Example:
      >>> gate, up = jnp.array([0.0, 1.0, 2.0]), jnp.ones(3)
      >>> [round(float(y), 3) for y in swiglu(gate, up)]   # silu(gate) · up
      [0.0, 0.731, 1.762]
    """
    g = gate.astype(F32)
    return (g * jax.nn.sigmoid(g) * up.astype(F32)).astype(up.dtype)


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, dy):
    gate, up = res
    g, u, dy = gate.astype(F32), up.astype(F32), dy.astype(F32)
    s = jax.nn.sigmoid(g)
    dgate = dy * u * s * (1.0 + g * (1.0 - s))
    return dgate.astype(gate.dtype), (dy * g * s).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_vjp
def embed(table, idx):
    """Rows of `table` (V, C) at integer `idx` (...) → (..., C); the backward keeps `idx` as given.

    Example:
      >>> embed(wte, idx).shape  # (B, T, C)
      (2, 8, 32)
    """
    return jnp.take(table, idx, axis=0)


def _embed_fwd(table, idx):
    # NOTE: `table` is a parameter, alive anyway; keeping it costs nothing and gives its shape.
    return jnp.take(table, idx, axis=0), (table, idx)


def _embed_bwd(res, dy):
    table, idx = res
    return jnp.zeros_like(table).at[idx].add(dy.astype(table.dtype)), None


embed.defvjp(_embed_fwd, _embed_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def cross_entropy(logits, targets, n_valid: int, total: int | None = None):
    """Mean cross-entropy over all positions; vocabulary columns >= n_valid are left out.

    Args:
      logits: (..., V) float32; targets: (...) int; n_valid: the real vocabulary size.
      total: divide the summed loss by this count instead of `targets.size` (a chunk's share of
        the mean over a whole batch, `lm_head`).
    Example:
      >>> logits = jnp.zeros((2, 8, 256))   # uniform over the first 200 of 256 columns
      >>> round(float(cross_entropy(logits, targets % 200, 200)), 4), round(float(np.log(200)), 4)
      (5.2983, 5.2983)
    """
    return _ce_fwd(logits, targets, n_valid, total)[0]


def _ce_masked(logits, n_valid):
    if n_valid >= logits.shape[-1]:
        return logits
    col = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.where(col < n_valid, logits, -jnp.inf)


def _ce_fwd(logits, targets, n_valid, total=None):
    z = _ce_masked(logits.astype(F32), n_valid)
    picked = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), -1)[..., 0]
    nll = jax.nn.logsumexp(z, axis=-1) - picked
    return (nll.mean() if total is None else nll.sum() / total), (logits, targets)


def _ce_bwd(n_valid, total, res, g):
    logits, targets = res
    z = _ce_masked(logits.astype(F32), n_valid)
    p = jnp.exp(z - jax.nn.logsumexp(z, axis=-1, keepdims=True))  # the log-sum-exp is recomputed: one more pass over z
    onehot = lax.broadcasted_iota(jnp.int32, p.shape, p.ndim - 1) == targets[..., None]
    d = (p - onehot) * (g / (targets.size if total is None else total))
    return d.astype(logits.dtype), None


cross_entropy.defvjp(_ce_fwd, _ce_bwd)


def lm_logits(x, w):
    """The LM head: float32 logits x·wᵀ, computed in x's dtype, tagged `lm_head`.

    Args:
      x: (B, T, C) final hidden states; w: (V, C) head weight (float32, cast to x's dtype).
    Example:
      >>> lm_logits(x, wte).shape  # (B, T, V)
      (2, 8, 256)
    """
    return checkpoint_name(jnp.einsum("btc,vc->btv", x, w.astype(x.dtype), preferred_element_type=F32),
                           names.LM_HEAD)  # (B, T, V)


def lm_head(x, w, targets=None, n_valid: int | None = None, chunk: int = 0):
    """LM head and mean cross-entropy, optionally over T-chunks so the (B, T, V) logits never exist.

    Args:
      x: (B, T, C) final hidden states; w: (V, C) head weight; targets: (B, T) int or None.
      n_valid: vocabulary columns in the softmax (default all of w's rows).
      chunk: 0 for the plain head; N > 0 computes the loss over chunks of N positions (the last
        chunk may be shorter), each rematerialized: only (B, N, V) logits are live at a time, in
        the forward and in the backward.
    Returns:
      (logits, loss): logits (B, T, V) float32, or None when `chunk` > 0 and targets are given
      (call again without targets for them); loss None without targets.
    Example:
      >>> _, chunked = lm_head(x, wte, targets, 256, chunk=4)  # logits never built whole: None
      >>> _, plain = lm_head(x, wte, targets, 256)
      >>> bool(jnp.allclose(chunked, plain, atol=1e-6))
      True
    """
    n_valid = w.shape[0] if n_valid is None else n_valid
    if targets is None or not chunk:
        logits = lm_logits(x, w)  # (B, T, V)
        return logits, None if targets is None else cross_entropy(logits, targets, n_valid)
    return None, _chunked_loss(x, w, targets, n_valid, chunk)


# NOTE: the chunked loss. Each chunk's head projection + cross-entropy is one `jax.checkpoint`
# region (saving nothing inside): the forward keeps only the chunk's input rows and targets, and
# the backward recomputes that chunk's logits right before its own gradient, so at most one
# chunk's (B, N, V) logits and their gradient are live. Chunks run under `lax.scan` (the body is
# compiled once); a remainder T % N is one more region of its own size. Each chunk's loss is its
# summed cross-entropy over B·T, so the chunks add up to the mean (`cross_entropy(..., total)`);
# the weight gradient is accumulated across chunks by the scan's transpose.
def _chunk_loss(x, w, t, n_valid, total):
    return cross_entropy(lm_logits(x, w), t, n_valid, total)  # x (B, N, C) → logits (B, N, V)


def _chunked_loss(x, w, targets, n_valid: int, chunk: int):
    B, T, C = x.shape
    chunk = min(chunk, T)
    n, rem = divmod(T, chunk)  # n >= 1 full chunks, then a remainder
    body = jax.checkpoint(functools.partial(_chunk_loss, n_valid=n_valid, total=B * T), prevent_cse=False)
    xs = x[:, :n * chunk].reshape(B, n, chunk, C).swapaxes(0, 1)  # (n, B, N, C)
    ts = targets[:, :n * chunk].reshape(B, n, chunk).swapaxes(0, 1)  # (n, B, N)
    loss, _ = lax.scan(lambda acc, xt: (acc + body(xt[0], w, xt[1]), None), jnp.zeros((), F32), (xs, ts))
    if rem:
        loss = loss + body(x[:, n * chunk:], w, targets[:, n * chunk:])
    return loss


def rope_frequencies(head_dim: int, theta: float, use_scaled: bool) -> np.ndarray:
    """RoPE frequencies 1/theta^(2i/D) in float32, with LLaMA-3.1 scaling when `use_scaled`.

    Example:
      >>> rope_frequencies(128, 500000.0, True).shape
      (64,)
    """
    freqs = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)))
    freqs = freqs.astype(np.float32)
    if not use_scaled:
        return freqs
    # NOTE: llm.c's apply_scaling: factor 8, low/high frequency factors 1 and 4, original
    # context 8192. Wavelengths below 8192/4 keep their frequency, above 8192/1 are divided by
    # 8, in between they interpolate.
    scale, low, high, old_ctx = 8.0, 1.0, 4.0, 8192.0
    wavelen = (2 * math.pi / freqs).astype(np.float32)
    smooth = ((old_ctx / wavelen - low) / (high - low)).astype(np.float32)
    mid = (1 - smooth) * freqs / scale + smooth * freqs
    out = np.where(wavelen < old_ctx / high, freqs, np.where(wavelen > old_ctx / low, freqs / scale, mid))
    return out.astype(np.float32)


def apply_rope(x, theta: float, use_scaled: bool, pos=None, max_len: int | None = None):
    """Rotate adjacent feature pairs (x[2i], x[2i+1]) at position t by t·freq_i (float32 math).

    Args:
      x: (B, T, heads, D), at positions 0..T-1, or pos..pos+T-1 when `pos` is given.
      pos, max_len: decoding: the first position (may be traced) and the cache length the angle
        table is built for (NumPy, as for positions 0..T-1, so both paths rotate by bit-identical
        factors).
    Example:
      >>> qh = q.reshape(2, 8, 4, 8)  # (B, T, heads, D)
      >>> bool(jnp.allclose(jnp.linalg.norm(apply_rope(qh, 500000.0, True), axis=-1),
      ...                   jnp.linalg.norm(qh, axis=-1), atol=1e-5))   # a rotation keeps lengths
      True
    """
    B, T, nh, D = x.shape
    angles = np.outer(np.arange(T if pos is None else max_len, dtype=np.float32),
                      rope_frequencies(D, theta, use_scaled))  # (T or max_len, D/2)
    cos, sin = np.cos(angles), np.sin(angles)
    if pos is not None:
        cos, sin = (lax.dynamic_slice_in_dim(jnp.asarray(t), pos, T, axis=0) for t in (cos, sin))  # (T, D/2)
    cos, sin = cos[None, :, None], sin[None, :, None]  # (1, T, 1, D/2)
    xr = x.astype(F32).reshape(B, T, nh, D // 2, 2)
    x0, x1 = xr[..., 0], xr[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)  # (B, T, heads, D/2, 2)
    return out.reshape(x.shape).astype(x.dtype)


# ------------------------------------------------------------------------------------------------
# Linen modules. Parameters are float32; computation runs in `dtype` (parameters cast at use).

class Linear(nn.Module):
    """y = x·wᵀ (+ b), w stored (out_features, in_features) as PyTorch and llm.c store it.

    Example:
      >>> layer = Linear(96)
      >>> variables = layer.init(jax.random.key(0), x)
      >>> variables["params"]["w"].shape, layer.apply(variables, x).shape  # w: (out, in)
      ((96, 32), (2, 8, 96))
    """
    # NOTE: PyTorch's weight layout instead of Flax's (in, out) `kernel` makes the llm.c mapping
    # (models/*.py to_llmc/from_llmc) names and stacking only, no transposes; dot_general takes
    # either layout at the same cost.
    features: int
    use_bias: bool = True
    dtype: Any = F32
    std: float = 0.02
    out_dtype: Any = None  # e.g. float32 logits from bf16 inputs

    @nn.compact
    def __call__(self, x, splits: tuple[int, ...] | None = None):
        """y (..., features); with `splits` (output offsets), the pieces of y, each its own matmul
        with rows of w (under tensor parallelism each piece stays split by heads: no resharding)."""
        w = self.param("w", nn.initializers.normal(self.std), (self.features, x.shape[-1]), F32)
        b = self.param("b", nn.initializers.zeros, (self.features,), F32) if self.use_bias else None
        if splits is not None:
            bs = jnp.split(b, splits) if b is not None else [None] * (len(splits) + 1)
            return tuple(self._apply(x, wi, bi) for wi, bi in zip(jnp.split(w, splits), bs))
        return self._apply(x, w, b)

    def _apply(self, x, w, b):
        y = jnp.einsum("...i,oi->...o", x.astype(self.dtype), w.astype(self.dtype),
                       preferred_element_type=self.out_dtype)
        return y if b is None else y + b.astype(y.dtype)


class LMHead(nn.Module):
    """An untied LM head, param `w` (V, C) as `Linear(V, use_bias=False)` stores it, and its loss.

    `__call__(x, targets=None)` returns `lm_head(x, w, targets, n_valid, chunk)`: (logits, loss).
    Example:
      >>> head = LMHead(256)
      >>> variables = head.init(jax.random.key(0), x)
      >>> logits, loss = head.apply(variables, x, targets)
      >>> logits.shape, loss.shape
      ((2, 8, 256), ())
    """
    features: int
    n_valid: int | None = None
    chunk: int = 0

    @nn.compact
    def __call__(self, x, targets=None):
        w = self.param("w", nn.initializers.normal(0.02), (self.features, x.shape[-1]), F32)
        return lm_head(x, w, targets, self.n_valid, self.chunk)


class LayerNorm(nn.Module):
    """LayerNorm (params `w`, `b`), float32 math, output in `dtype`."""
    dtype: Any = F32
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        C = x.shape[-1]
        w = self.param("w", nn.initializers.ones, (C,), F32)
        b = self.param("b", nn.initializers.zeros, (C,), F32)
        return layer_norm(x, w, b, self.eps).astype(self.dtype)


class RMSNorm(nn.Module):
    """RMSNorm (param `w`), float32 math, output in `dtype`."""
    dtype: Any = F32
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.ones, (x.shape[-1],), F32)
        return rms_norm(x, w, self.eps).astype(self.dtype)


class CausalSelfAttention(nn.Module):
    """c_attn → (RoPE) → causal GQA core → c_proj → dropout; tags qkv, attn_context, attn_out.

    Attributes:
      attention, attention_tile: the core (`remat_lm.models.attention.causal_attention`: auto, tiled, xla,
        cudnn, pallas) and the tiled core's query tile.
      n_head, n_kv_head: query and key/value heads (n_kv_head == n_head: plain multi-head).
      rope_theta: apply RoPE to q and k when set (`use_scaled_rope`: LLaMA-3.1 scaling).
      proj_std: init std of c_proj (GPT-2 scales it by 1/sqrt(2·n_layer)).
      sharding: a `remat_lm.models.parallel.ShardingConfig`: heads split over its tensor axis (or None).
    `__call__(x, deterministic=True, decode_pos=None)`: with `decode_pos` (an int, may be traced)
    x holds positions decode_pos..decode_pos+T-1 and the layer decodes (see `_decode`).
    Example:
      >>> attn = CausalSelfAttention(4, 2, attention="xla")
      >>> variables = attn.init(jax.random.key(0), x, True)
      >>> attn.apply(variables, x, True).shape
      (2, 8, 32)
    """
    n_head: int
    n_kv_head: int
    dtype: Any = F32
    dropout: float = 0.0
    use_bias: bool = True
    rope_theta: float | None = None
    use_scaled_rope: bool = False
    proj_std: float = 0.02
    attention: str = "auto"
    attention_tile: int = attention_lib.DEFAULT_TILE
    sharding: Any = None

    @nn.compact
    def __call__(self, x, deterministic: bool = True, decode_pos=None):
        B, T, C = x.shape
        H, K, D = self.n_head, self.n_kv_head, C // self.n_head
        c_attn = Linear((H + 2 * K) * D, self.use_bias, self.dtype, name="c_attn")
        if self.sharding is None:
            q, k, v = jnp.split(c_attn(x), [H * D, (H + K) * D], axis=-1)  # (B, T, H·D), (B, T, K·D) ×2
        else:  # one matmul per piece: an even split of c_attn's output over tensor is not head-aligned
            q, k, v = c_attn(x, splits=(H * D, (H + K) * D))
        if decode_pos is not None:
            y = self._decode(q.reshape(B, T, H, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D), decode_pos)
        else:
            if self.rope_theta is not None:
                q = apply_rope(q.reshape(B, T, H, D), self.rope_theta, self.use_scaled_rope).reshape(B, T, H * D)
                k = apply_rope(k.reshape(B, T, K, D), self.rope_theta, self.use_scaled_rope).reshape(B, T, K * D)
            q, k, v = (checkpoint_name(parallel.split(t, self.sharding), names.QKV) for t in (q, k, v))
            rate = 0.0 if deterministic else self.dropout
            key = self.make_rng("dropout") if rate > 0 else None
            y = attention_lib.causal_attention(q, k, v, H, K, attention=self.attention, tile=self.attention_tile,
                                               dropout_rate=rate, key=key,
                                               spec=None if self.sharding is None else self.sharding.split)  # (B, T, C)
        y = checkpoint_name(parallel.split(y, self.sharding), names.ATTN_CONTEXT)
        y = Linear(C, self.use_bias, self.dtype, self.proj_std, name="c_proj")(y)
        y = checkpoint_name(parallel.residual(y, self.sharding), names.ATTN_OUT)
        return nn.Dropout(self.dropout)(y, deterministic)

    def _decode(self, q, k, v, pos):
        """Write k, v (B, S, K, D) at positions pos..pos+S-1 of the `cache` collection (`k`, `v`:
        (B, T_max, K, D) in the compute dtype) and attend over it (`attention_lib.cached_attention`).

        The cache is made by `init` (its length: the input's) and must be passed to `apply` with
        `mutable=["cache"]`; positions past T_max are clamped by the update, so callers check them.
        """
        made = self.has_variable("cache", "k")
        if not made and not self.is_initializing():
            raise ValueError("decoding (decode_pos set) needs a key/value cache: pass variables {'params': ..., "
                             "'cache': ...} from remat_lm.models.sample.init_cache and apply(..., mutable=['cache'])")
        ck = self.variable("cache", "k", jnp.zeros, k.shape, k.dtype)  # (B, T_max, K, D)
        cv = self.variable("cache", "v", jnp.zeros, v.shape, v.dtype)
        if self.rope_theta is not None:  # the angle table spans the cache, sliced at pos
            T_max = ck.value.shape[1]
            q = apply_rope(q, self.rope_theta, self.use_scaled_rope, pos, T_max)
            k = apply_rope(k, self.rope_theta, self.use_scaled_rope, pos, T_max)
        if made:  # (init only makes the cache: it stays empty, as Flax's decoders leave it)
            ck.value = lax.dynamic_update_slice(ck.value, k.astype(ck.value.dtype), (0, pos, 0, 0))
            cv.value = lax.dynamic_update_slice(cv.value, v.astype(cv.value.dtype), (0, pos, 0, 0))
        positions = pos + jnp.arange(q.shape[1])  # (S,)
        return attention_lib.cached_attention(q, ck.value, cv.value, positions)  # (B, S, H·D)


class _FeedForward(nn.Module):
    """The fields both MLPs take: `hidden` units, compute `dtype`, `dropout`, the output projection's
    init `proj_std`, and `sharding` (a `remat_lm.models.parallel.ShardingConfig` or None: hidden
    units split over its tensor axis)."""
    hidden: int
    dtype: Any = F32
    dropout: float = 0.0
    proj_std: float = 0.02
    sharding: Any = None


class MLP(_FeedForward):
    """GPT-2's MLP: c_fc → tanh-GELU → c_proj → dropout; tags mlp_up, mlp_act, mlp_out."""

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        h = Linear(self.hidden, True, self.dtype, name="c_fc")(x)
        h = checkpoint_name(parallel.split(h, self.sharding), names.MLP_UP)  # (B, T, F)
        h = checkpoint_name(gelu_tanh(h), names.MLP_ACT)
        y = Linear(x.shape[-1], True, self.dtype, self.proj_std, name="c_proj")(h)
        y = checkpoint_name(parallel.residual(y, self.sharding), names.MLP_OUT)
        return nn.Dropout(self.dropout)(y, deterministic)


class SwiGLU(_FeedForward):
    """LLaMA's MLP: c_proj(silu(c_fc2(x)) · c_fc(x)) → dropout, no biases; tags mlp_up/gate/act/out."""

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        sc = self.sharding
        up = checkpoint_name(parallel.split(Linear(self.hidden, False, self.dtype, name="c_fc")(x), sc),
                             names.MLP_UP)  # (B, T, F)
        gate = checkpoint_name(parallel.split(Linear(self.hidden, False, self.dtype, name="c_fc2")(x), sc),
                               names.MLP_GATE)  # (B, T, F)
        h = checkpoint_name(swiglu(gate, up), names.MLP_ACT)  # (B, T, F)
        y = Linear(x.shape[-1], False, self.dtype, self.proj_std, name="c_proj")(h)
        y = checkpoint_name(parallel.residual(y, sc), names.MLP_OUT)
        return nn.Dropout(self.dropout)(y, deterministic)
