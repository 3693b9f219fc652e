"""A tiny transformer-like block in plain JAX, Linen and NNX, tagged with remat.names (test helper).

Shapes: B batch, T time, C channels, H heads; trailing comments give shapes.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name as tag

from remat import names as N

B, T, C, H = 2, 8, 16, 2


def init_block(key, c=C, dtype=jnp.float32):
    ks = jax.random.split(key, 4)
    s = 0.2
    return {
        "ln_1": jnp.ones((c,), dtype), "ln_2": jnp.ones((c,), dtype),
        "c_attn": jax.random.normal(ks[0], (c, 3 * c), dtype) * s,
        "c_proj": jax.random.normal(ks[1], (c, c), dtype) * s,
        "c_fc": jax.random.normal(ks[2], (c, 4 * c), dtype) * s,
        "mlp_proj": jax.random.normal(ks[3], (4 * c, c), dtype) * s,
    }


PARAM_NAMES = ("ln_1", "ln_2", "c_attn", "c_proj", "c_fc", "mlp_proj")


def _ln(x, w):
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5) * w.astype(jnp.float32)).astype(x.dtype)


def block(p, x, dropout_key=None, rate=0.0, compute_dtype=None):
    """x: (B, T, C) -> (B, T, C). Materialized attention probabilities (tagged attn_probs)."""
    dt = compute_dtype or x.dtype
    w = {k: v.astype(dt) for k, v in p.items()}
    x = tag(x, N.BLOCK_INPUT)
    b, t, c = x.shape
    h = tag(_ln(x, w["ln_1"]), N.LN_1)
    qkv = tag(h @ w["c_attn"], N.QKV)                                    # (B, T, 3C)
    q, k, v = jnp.split(qkv.reshape(b, t, 3, H, c // H), 3, axis=2)     # (B, T, 1, H, D)
    q, k, v = (a[:, :, 0].transpose(0, 2, 1, 3) for a in (q, k, v))      # (B, H, T, D)
    s = (q @ k.transpose(0, 1, 3, 2)).astype(jnp.float32) / jnp.sqrt(c // H)  # (B, H, T, T)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
    probs = tag(jax.nn.softmax(s, axis=-1).astype(dt), N.ATTN_PROBS)
    if dropout_key is not None and rate > 0:
        keep = jax.random.bernoulli(dropout_key, 1 - rate, probs.shape)
        probs = jnp.where(keep, probs / (1 - rate), 0).astype(dt)
    ctx = tag((probs @ v).transpose(0, 2, 1, 3).reshape(b, t, c), N.ATTN_CONTEXT)  # (B, T, C)
    x = x + tag(ctx @ w["c_proj"], N.ATTN_OUT)
    h = tag(_ln(x, w["ln_2"]), N.LN_2)
    up = tag(h @ w["c_fc"], N.MLP_UP)                                    # (B, T, 4C)
    act = tag(jax.nn.gelu(up, approximate=True), N.MLP_ACT)
    return x + tag(act @ w["mlp_proj"], N.MLP_OUT)


class LinenBlock(nn.Module):
    """The same block as a Linen module (params created with self.param)."""
    c: int = C
    rate: float = 0.0

    @nn.compact
    def __call__(self, x):
        p = {k: self.param(k, lambda key, k=k: init_block(key, self.c)[k]) for k in PARAM_NAMES}
        key = self.make_rng("dropout") if (self.rate > 0 and self.has_rng("dropout")) else None
        return block(p, x, key, self.rate)


class NNXBlock(nnx.Module):
    """The same block as an NNX module."""

    def __init__(self, rngs: nnx.Rngs, c: int = C):
        p = init_block(rngs.params(), c)
        for k, v in p.items():
            setattr(self, k, nnx.Param(v))

    def __call__(self, x):
        return block({k: getattr(self, k)[...] for k in PARAM_NAMES}, x)


def rel_err(a, b) -> float:
    """max over leaves of max|a-b| / max|b|."""
    errs = jax.tree.leaves(jax.tree.map(
        lambda u, v: float(jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32)))
                           / max(float(jnp.max(jnp.abs(v.astype(jnp.float32)))), 1e-30)), a, b))
    return max(errs)
