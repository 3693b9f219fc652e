"""The transformer pieces GPT-2 and LLaMA-3 share, in Flax Linen, on Flax's `nn.Dense`; the norms
and the cross-entropy have their backward written out where XLA:GPU keeps less than with Flax's
norms and optax's loss (the figures are in comments): the attention layer, the two MLPs, the one
pre-norm `Block(norm, mlp)`, the LM head and its chunked loss, and RoPE. The
attention cores live in remat_lm/models/attention.py (`CausalSelfAttention` calls its switch); the
llm.c tensor layout in remat_lm/models/llmc_io.py.

Shapes: B batch, T sequence, C n_embd, H query heads, K kv heads, D head dim, F MLP hidden width,
V (padded) vocabulary. Every shape in models/ is written as a trailing comment on the line that
makes the value: `y = f(x)  # (B, T, C)`.

Activations are tagged with `checkpoint_name(x, remat.names.X)` at the points that
remat/names.py lists: `Block` tags block_input, ln_1 and ln_2, the modules here the rest.
`attn_probs` tags only the cuDNN and Pallas kernels' residuals (remat_lm/models/attention.py).
Parameters are float32; computation runs in the config's `dtype` (Flax casts at use).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from remat import names
from remat.linen import LayerStack
from remat_lm.models import attention as attention_lib
from remat_lm.models import parallel

F32 = jnp.float32

__all__ = ["F32", "dense", "cross_entropy", "lm_logits", "lm_head", "rope_frequencies", "apply_rope",
           "layer_norm", "rms_norm", "LayerNorm", "RMSNorm", "CausalSelfAttention", "MLP", "SwiGLU", "Block", "check_length", "blocks", "init_params", "loss_fn"]


def dense(features: int, dtype, *, use_bias: bool = True, std: float = 0.02, name: str | None = None,
          **kw) -> nn.Dense:
    """`nn.Dense` with float32 parameters, computing in `dtype`, kernel initialized N(0, std²).

    Example:
      >>> layer = dense(96, jnp.float32)
      >>> variables = layer.init(jax.random.key(0), x)
      >>> variables["params"]["kernel"].shape, layer.apply(variables, x).shape  # kernel: (in, out)
      ((32, 96), (2, 8, 96))
    """
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=F32,
                    kernel_init=nn.initializers.normal(std), name=name, **kw)


def cross_entropy(logits, targets, n_valid: int, total: int | None = None):
    """Mean cross-entropy in float32 (`optax.softmax_cross_entropy_with_integer_labels`'s value);
    vocabulary columns >= n_valid are left out of the softmax.

    Args:
      logits: (..., V); targets: (...) int; n_valid: the real vocabulary size.
      total: divide the summed loss by this count instead of `targets.size` (a chunk's share of
        the mean over a whole batch, `lm_head`).
    Example:
      >>> logits = jnp.zeros((2, 8, 256))   # uniform over the first 200 of 256 columns
      >>> round(float(cross_entropy(logits, targets % 200, 200)), 4), round(float(np.log(200)), 4)
      (5.2983, 5.2983)
    """
    return _cross_entropy(logits, targets, n_valid, targets.size if total is None else total)


def lm_logits(x, kernel, tied: bool = False):
    """The LM head: float32 logits x·kernel, computed in x's dtype, tagged `lm_head`.

    Args:
      x: (B, T, C) final hidden states; kernel: (C, V) head weight (float32, cast to x's dtype), or
        with `tied` the (V, C) embedding table (no transposed copy of it is made or kept).
    Example:
      >>> lm_logits(x, wte, tied=True).shape  # (B, T, V)
      (2, 8, 256)
    """
    spec = "btc,vc->btv" if tied else "btc,cv->btv"
    return checkpoint_name(jnp.einsum(spec, x, kernel.astype(x.dtype), preferred_element_type=F32),
                           names.LM_HEAD)  # (B, T, V)


def lm_head(x, kernel, targets=None, n_valid: int | None = None, chunk: int = 0, tied: bool = False):
    """LM head and mean cross-entropy, optionally over T-chunks so the (B, T, V) logits never exist.

    Args:
      x: (B, T, C) final hidden states; kernel: (C, V) head weight, or (V, C) with `tied`
        (`lm_logits`); targets: (B, T) int or None.
      n_valid: vocabulary columns in the softmax (default all of the kernel's).
      chunk: 0 for the plain head; N > 0 computes the loss over chunks of N positions (the last
        chunk may be shorter), each rematerialized: only (B, N, V) logits are live at a time, in
        the forward and in the backward.
    Returns:
      (logits, loss): logits (B, T, V) float32, or None when `chunk` > 0 and targets are given
      (call again without targets for them); loss None without targets.
    Example:
      >>> _, chunked = lm_head(x, wte, targets, 256, chunk=4, tied=True)  # logits never built whole: None
      >>> _, plain = lm_head(x, wte, targets, 256, tied=True)
      >>> bool(jnp.allclose(chunked, plain, atol=1e-6))
      True
    """
    n_valid = kernel.shape[0 if tied else 1] if n_valid is None else n_valid
    if targets is None or not chunk:
        logits = lm_logits(x, kernel, tied)  # (B, T, V)
        return logits, None if targets is None else cross_entropy(logits, targets, n_valid)
    return None, _chunked_loss(x, kernel, targets, n_valid, chunk, tied)


def _chunk_loss(x, kernel, t, n_valid, total, tied):
    return _cross_entropy(lm_logits(x, kernel, tied), t, n_valid, total)  # x (B, N, C) → logits (B, N, V)


# The cross-entropy's backward written out (softmax − one-hot, from the logits and the per-row
# log-sum-exp): XLA:GPU keeps less than with optax's loss. Measured for an H200 (deviceless):
# chunked, GPT-2 d12, B=8, T=1024, bf16, chunks of 128, loop layers (`python -m
# remat_lm.bench.offload --target h200 --settings none,full`): temp 646.7 → 462.2 MiB with full
# remat, 3986.8 → 3802.3 without; unchunked, the reference GPT-2 (`python -m
# remat_lm.bench.selective --target h200 --models gpt2`): none bf16 16 KiB less, every other row
# equal or less. docs/models.md, "The layers' forms", has the LLaMA-3 8B figures.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cross_entropy(logits, targets, n_valid: int, total: int):
    return _ce_fwd(logits, targets, n_valid, total)[0]


def _valid_columns(z, n_valid: int):
    if n_valid >= z.shape[-1]:
        return z
    return jnp.where(lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) < n_valid, z, -jnp.inf)


def _ce_fwd(logits, targets, n_valid, total):
    z = _valid_columns(logits.astype(F32), n_valid)  # (..., V)
    lse = jax.nn.logsumexp(z, axis=-1)  # (...)
    picked = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), -1)[..., 0]
    return (lse - picked).sum() / total, (logits, lse, targets)


def _ce_bwd(n_valid, total, res, g):
    logits, lse, targets = res
    p = jnp.exp(_valid_columns(logits.astype(F32), n_valid) - lse[..., None])  # the softmax, (..., V)
    onehot = lax.broadcasted_iota(jnp.int32, p.shape, p.ndim - 1) == targets[..., None]
    return ((p - onehot) * (g / total)).astype(logits.dtype), None


_cross_entropy.defvjp(_ce_fwd, _ce_bwd)


def _chunked_loss(x, kernel, targets, n_valid: int, chunk: int, tied: bool):
    # Each chunk's head projection + cross-entropy is one `jax.checkpoint` region saving nothing:
    # the backward recomputes a chunk's logits right before its own gradient. Chunks run under
    # `lax.scan`; a remainder T % N is one more region. Each chunk's loss is its summed
    # cross-entropy over B·T, so the chunks add up to the mean.
    B, T, C = x.shape
    chunk = min(chunk, T)
    n, rem = divmod(T, chunk)  # n >= 1 full chunks, then a remainder
    body = jax.checkpoint(functools.partial(_chunk_loss, n_valid=n_valid, total=B * T, tied=tied), prevent_cse=False)
    xs = x[:, :n * chunk].reshape(B, n, chunk, C).swapaxes(0, 1)  # (n, B, N, C)
    ts = targets[:, :n * chunk].reshape(B, n, chunk).swapaxes(0, 1)  # (n, B, N)
    loss, _ = lax.scan(lambda acc, xt: (acc + body(xt[0], kernel, xt[1]), None), jnp.zeros((), F32), (xs, ts))
    if rem:
        loss = loss + body(x[:, n * chunk:], kernel, targets[:, n * chunk:])
    return loss


def rope_frequencies(head_dim: int, theta: float, use_scaled: bool) -> np.ndarray:
    """RoPE frequencies 1/theta^(2i/D) in float32, with LLaMA-3.1 scaling when `use_scaled`
    (llm.c's apply_scaling: factor 8, low/high frequency factors 1 and 4, original context 8192).

    Example:
      >>> rope_frequencies(128, 500000.0, True).shape
      (64,)
    """
    freqs = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)))
    freqs = freqs.astype(np.float32)
    if not use_scaled:
        return freqs
    # wavelengths below 8192/4 keep their frequency, above 8192/1 are divided by 8, between interpolate
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
        c_attn = dense((H + 2 * K) * D, self.dtype, use_bias=self.use_bias, name="c_attn")
        if self.sharding is None and jax.sharding.get_abstract_mesh().size <= 1:
            # one matmul, split: on one device per-piece matmuls cost 8-10 MiB of temp on every
            # selective preset of the scan layout (reference GPT-2, XLA:GPU)
            q, k, v = jnp.split(c_attn(x), [H * D, (H + K) * D], axis=-1)  # (B, T, H·D), (B, T, K·D) ×2
        else:  # under a multi-device mesh, one matmul per piece (`_pieces`)
            q, k, v = _pieces(c_attn, x, (H * D, (H + K) * D))
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
        y = dense(C, self.dtype, use_bias=self.use_bias, std=self.proj_std, name="c_proj")(y)
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


# The activations are recomputed from their inputs in the backward (`jax.checkpoint`), so a layer
# keeps its (B, T, F) inputs, not the activation's internals; GELU is computed in float32. Measured
# on XLA:GPU (h200, deviceless) at the reference shape, no remat, scan layout (docs/models.md,
# "The layers' forms"): GPT-2 308.3 MiB of temp, 564.3 with plain
# `nn.gelu`; LLaMA-3 305.4, 449.5 with plain `silu(gate)·up`. `prevent_cse` as measured: GPT-2's
# full remat, loop, 72.0 MiB without it, 80.0 with it; LLaMA-3's 76.0 with it, 78.0 without.
_gelu = jax.checkpoint(lambda h: nn.gelu(h.astype(F32), approximate=True).astype(h.dtype), prevent_cse=False)
_swiglu = jax.checkpoint(lambda gate, up: nn.silu(gate) * up)


def _pieces(layer: nn.Dense, x, splits):
    """`layer(x)` split at the output offsets `splits`, each piece its own matmul with its columns of
    the kernel: each of q, k, v gets its own sharding (under tensor parallelism XLA moves weight
    columns, not activations; LLaMA-3 8B under FSDP on h200x8 with full remat, cuDNN's attention
    refuses the differently sharded q, k, v that slices of one fused output get). The slicing and
    the matmuls are one `jax.checkpoint`, so the backward slices the kernel again instead of keeping
    each layer's column blocks (in the scan layout autodiff stacks them: 6 MiB more temp for the
    reference GPT-2 on XLA:GPU)."""
    layer(x[..., :0, :])  # no positions: makes the parameters, computes nothing
    p = layer.variables["params"]
    with jax.named_scope(layer.name):  # the ops carry the layer's name, as `layer(x)`'s would
        return _split_matmul(x.astype(layer.dtype), p["kernel"], p.get("bias"), tuple(splits), layer.dtype)


@functools.partial(jax.checkpoint, prevent_cse=False, static_argnums=(3, 4))
def _split_matmul(x, kernel, bias, splits, dtype):
    out = []
    bias = [None] * (len(splits) + 1) if bias is None else jnp.split(bias, splits)
    for w, b in zip(jnp.split(kernel, splits, axis=-1), bias):
        y = jnp.einsum("...i,io->...o", x, w.astype(dtype))
        out.append(y if b is None else y + b.astype(y.dtype))
    return tuple(out)


class MLP(nn.Module):
    """GPT-2's MLP: c_fc → tanh-GELU → c_proj → dropout; tags mlp_up, mlp_act, mlp_out.

    Fields (both MLPs): `hidden` units, compute `dtype`, `dropout`, the output projection's init
    `proj_std`, `sharding` (a `remat_lm.models.parallel.ShardingConfig` or None: hidden units split
    over its tensor axis).
    """
    hidden: int
    dtype: Any = F32
    dropout: float = 0.0
    proj_std: float = 0.02
    sharding: Any = None

    def up(self, x):
        """(B, T, C) → the activation (B, T, F), tagged."""
        h = dense(self.hidden, self.dtype, name="c_fc")(x)
        h = checkpoint_name(parallel.split(h, self.sharding), names.MLP_UP)  # (B, T, F)
        return _gelu(h)

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        h = checkpoint_name(self.up(x), names.MLP_ACT)  # (B, T, F)
        y = dense(x.shape[-1], self.dtype, use_bias=self.use_bias, std=self.proj_std, name="c_proj")(h)
        y = checkpoint_name(parallel.residual(y, self.sharding), names.MLP_OUT)
        return nn.Dropout(self.dropout)(y, deterministic)

    use_bias = True


class SwiGLU(MLP):
    """LLaMA's MLP: c_proj(silu(c_fc2(x)) · c_fc(x)) → dropout, no biases; tags mlp_up/gate/act/out."""
    use_bias = False

    def up(self, x):
        sc = self.sharding
        up = dense(self.hidden, self.dtype, use_bias=False, name="c_fc")(x)
        up = checkpoint_name(parallel.split(up, sc), names.MLP_UP)  # (B, T, F)
        gate = dense(self.hidden, self.dtype, use_bias=False, name="c_fc2")(x)
        gate = checkpoint_name(parallel.split(gate, sc), names.MLP_GATE)  # (B, T, F)
        return _swiglu(gate, up)


# The norms are the models' hand-written backward passes: each keeps its input and per-row
# statistics (in float32) and rebuilds the normalized input in the backward. Measured on XLA:GPU
# (h200, deviceless) at the reference shape, temp in MiB against Flax's layer, plain and under
# `nn.remat` (docs/models.md, "The layers' forms"):
#   GPT-2, LayerNorm: no remat, scan 308.3 (`nn.LayerNorm` 368.6); `nn.remat(nn.LayerNorm)` reads
#     304.1 there but 12.0 MiB more for selective core_attn and mlp in the scan layout (328.8, 200.8);
#   LLaMA-3, RMSNorm: no remat, loop 372.1 (`nn.RMSNorm` 402.1, `nn.remat(nn.RMSNorm)` 404.0):
#     Flax's RMSNorm multiplies x by a (B, T, C) `rsqrt(var + eps)·scale`, which autodiff keeps.

def _norm_fwd(x, w, b, eps, center):
    xf = x.astype(F32)
    mean = xf.mean(-1, keepdims=True) if center else jnp.zeros((), F32)  # (..., 1)
    rstd = lax.rsqrt(jnp.square(xf - mean).mean(-1, keepdims=True) + eps)  # (..., 1)
    y = (xf - mean) * rstd * w.astype(F32)
    y = (y if b is None else y + b.astype(F32)).astype(x.dtype)
    return y, (x, mean, rstd, w, None if b is None else jnp.zeros((0,), b.dtype))  # the empty array: b's dtype


def _norm_bwd(eps, center, res, dy):
    x, mean, rstd, w, b0 = res
    xhat = (x.astype(F32) - mean) * rstd
    dy = dy.astype(F32)
    rows = tuple(range(x.ndim - 1))
    g = dy * w.astype(F32)
    dx = rstd * (g - (g.mean(-1, keepdims=True) if center else 0.0) - xhat * (g * xhat).mean(-1, keepdims=True))
    db = None if b0 is None else dy.sum(rows).astype(b0.dtype)
    return dx.astype(x.dtype), (dy * xhat).sum(rows).astype(w.dtype), db


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _norm(x, w, b, eps, center):
    return _norm_fwd(x, w, b, eps, center)[0]


_norm.defvjp(_norm_fwd, _norm_bwd)


def layer_norm(x, w, b, eps=1e-5):
    """LayerNorm over the last axis, computed in float32, returned in x's dtype.

    Example:
      >>> y = layer_norm(x, jnp.ones(32), jnp.zeros(32))  # x: (B, T, 32)
      >>> round(float(y.mean()), 4), round(float(y.std()), 2)
      (0.0, 1.0)
    """
    return _norm(x, w, b, eps, True)


def rms_norm(x, w, eps=1e-5):
    """RMSNorm `x·rsqrt(mean(x²)+eps)·w` over the last axis in float32, returned in x's dtype.

    Example:
      >>> y = rms_norm(x, jnp.ones(32), 1e-5)
      >>> round(float(jnp.sqrt(jnp.mean(y ** 2))), 2)
      1.0
    """
    return _norm(x, w, None, eps, False)


class LayerNorm(nn.Module):
    """`nn.LayerNorm`'s interface and parameters (`scale`, `bias`) on `layer_norm`; output in `dtype`."""
    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = F32
    center: ClassVar[bool] = True  # subtract the mean and add a bias (RMSNorm: neither)

    @nn.compact
    def __call__(self, x):
        C = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (C,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (C,), self.param_dtype) if self.center else None
        return _norm(x, scale, bias, self.epsilon, self.center).astype(self.dtype or x.dtype)


class RMSNorm(LayerNorm):
    """`nn.RMSNorm`'s interface and parameter (`scale`) on `rms_norm`; output in `dtype`."""
    center: ClassVar[bool] = False


class Block(nn.Module):
    """The pre-norm block of both models: x + attn(ln_1(x)), then + mlp(ln_2(x)); tags
    block_input, ln_1, ln_2.

    Attributes:
      config: the model config (`remat_lm.models.config.ModelConfig`): heads, width, dtype,
        dropout, attention core, sharding; `use_bias` and `rope` (None, or (theta, use_scaled)).
      norm: the norm's constructor, called `norm(dtype=..., name=...)` (`nn.LayerNorm`, `nn.RMSNorm`).
      mlp: the MLP class (`MLP`, `SwiGLU`).
    """
    config: Any
    norm: Callable[..., nn.Module]
    mlp: Callable[..., nn.Module]

    @nn.compact
    def __call__(self, x, deterministic: bool = True, decode_pos=None):
        cfg, dt = self.config, self.config.compute_dtype
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # residual projections, as GPT-2 and llm.c scale them
        sc = cfg.sharding  # sequence parallelism: (B, T, C) split along T between the pieces
        theta, scaled = cfg.rope or (None, False)
        x = checkpoint_name(parallel.residual(x, sc), names.BLOCK_INPUT)  # (B, T, C)
        h = checkpoint_name(parallel.residual(self.norm(dtype=dt, name="ln_1")(x), sc), names.LN_1)
        x = x + CausalSelfAttention(cfg.n_head, cfg.n_kv_head, dt, cfg.dropout, cfg.use_bias, theta, scaled,
                                    proj_std, cfg.attention, cfg.attention_tile, sc, name="attn")(h, deterministic, decode_pos)
        x = parallel.residual(x, sc)
        h = checkpoint_name(parallel.residual(self.norm(dtype=dt, name="ln_2")(x), sc), names.LN_2)
        y = self.mlp(cfg.ffn_hidden, dt, cfg.dropout, proj_std, sc, name="mlp")(h, deterministic)
        return parallel.residual(x + y, sc)


def init_params(model_cls, config, key, batch_shape=(1, 1)):
    """Fresh float32 parameters of `model_cls(config)` (the family's `init_params`)."""
    # the parameters do not depend on the attention core; the xla core takes any T (Pallas: multiples of 128)
    model = model_cls(dataclasses.replace(config, attention="xla"))
    return model.init({"params": key}, jnp.zeros(batch_shape, jnp.int32))["params"]


def loss_fn(model_cls, params, config, idx, targets, dropout_key=None):
    """Mean cross-entropy of `model_cls(config)`; dropout is on exactly when `dropout_key` is given."""
    rngs = None if dropout_key is None else {"dropout": dropout_key}
    return model_cls(config).apply({"params": params}, idx, targets, deterministic=dropout_key is None, rngs=rngs)[1]


def check_length(config, T: int):
    """Refuse a sequence longer than the model's `block_size`."""
    if T > config.block_size:
        raise ValueError(f"sequence length {T} exceeds block_size={config.block_size}")


def blocks(module: nn.Module, x, norm, mlp, deterministic: bool, decode_pos=None):
    """The model's layer stack inside `module` (a model whose `config` it reads): dropout on the
    embedded input x (B, T, C), `Block(norm, mlp)` × n_layer grouped and rematerialized by
    `remat.linen.LayerStack` (params `blocks`), then the final norm `ln_f`."""
    cfg = module.config
    x = nn.Dropout(cfg.dropout)(x.astype(cfg.compute_dtype), deterministic)
    x = parallel.residual(x, cfg.sharding)  # the residual stream entering the blocks (remat_lm.models.parallel)
    decode = () if decode_pos is None else (decode_pos,)  # the blocks' third argument, only when decoding
    x = LayerStack(functools.partial(Block, cfg, norm, mlp), cfg.n_layer, cfg.recompute,
                   scan=cfg.scan_layers, name="blocks")(x, deterministic, *decode)
    return norm(dtype=cfg.compute_dtype, name="ln_f")(x)  # (B, T, C)
