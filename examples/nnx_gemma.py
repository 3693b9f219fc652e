"""A Gemma-style decoder in Flax NNX (RMSNorm, RoPE, grouped-query attention, GeGLU, tied
embeddings), adopting remat.

The blocks follow Gemma's NNX convention: `block(x, positions, *, attn_mask) -> (cache, x)`.
Adopting the library is the lines marked `# remat:`: the block list becomes a
`remat.nnx.LayerStack` (with `out=` picking x from `(cache, x)`, keyword arguments forwarded) and
four activations are tagged for the selective presets. `remat=None` is the original model;
`"nnx.remat"` wraps each block call in `nnx.remat`, the plain Flax baseline.

    python -m examples.nnx_gemma     # saved bytes, compiled temp on XLA:GPU (h200) and on XLA:CPU
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import remat.nnx  # remat:
from remat import RecomputeConfig, names  # remat:


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    width: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    hidden: int = 192
    layers: int = 4
    remat: Any = None  # None | "nnx.remat" | a RecomputeConfig for remat.nnx.LayerStack


def rope(x, positions, base=10_000.0):  # x: (B, T, H, D)
    half = x.shape[-1] // 2
    freq = positions[..., None] / base ** (jnp.arange(half) / half)  # (B, T, D/2)
    sin, cos = jnp.sin(freq)[:, :, None], jnp.cos(freq)[:, :, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class RMSNorm(nnx.Module):
    def __init__(self, width):
        self.scale = nnx.Param(jnp.zeros((width,)))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + self.scale[...])


class Attention(nnx.Module):
    def __init__(self, cfg: Config, rngs):
        self.cfg = cfg
        self.q = nnx.Linear(cfg.width, cfg.heads * cfg.head_dim, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(cfg.width, 2 * cfg.kv_heads * cfg.head_dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(cfg.heads * cfg.head_dim, cfg.width, use_bias=False, rngs=rngs)

    def __call__(self, x, positions, attn_mask):
        cfg, (B, T, _) = self.cfg, x.shape
        q = rope(self.q(x).reshape(B, T, cfg.heads, cfg.head_dim), positions)
        k, v = jnp.split(self.kv(x).reshape(B, T, 2 * cfg.kv_heads, cfg.head_dim), 2, axis=2)
        k = rope(k, positions)
        q, k, v = (checkpoint_name(t, names.QKV) for t in (q, k, v))  # remat: tag
        k, v = (jnp.repeat(t, cfg.heads // cfg.kv_heads, axis=2) for t in (k, v))
        logits = jnp.einsum("bthd,bshd->bhts", q, k) * cfg.head_dim ** -0.5
        probs = jax.nn.softmax(jnp.where(attn_mask[:, None], logits, -1e9), axis=-1)
        ctx = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, -1)
        return self.out(checkpoint_name(ctx, names.ATTN_CONTEXT))  # remat: tag


class GeGLU(nnx.Module):
    def __init__(self, cfg: Config, rngs):
        self.gate = nnx.Linear(cfg.width, cfg.hidden, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(cfg.width, cfg.hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(cfg.hidden, cfg.width, use_bias=False, rngs=rngs)

    def __call__(self, x):
        h = checkpoint_name(jax.nn.gelu(self.gate(x)) * self.up(x), names.MLP_ACT)  # remat: tag
        return self.down(h)


class Block(nnx.Module):
    def __init__(self, cfg: Config, rngs):
        self.pre_attention_norm, self.attn = RMSNorm(cfg.width), Attention(cfg, rngs)
        self.pre_ffw_norm, self.mlp = RMSNorm(cfg.width), GeGLU(cfg, rngs)

    def __call__(self, x, positions, *, attn_mask):
        x = x + self.attn(self.pre_attention_norm(x), positions, attn_mask)
        return None, x + self.mlp(self.pre_ffw_norm(x))  # (cache, x): no cache in this sketch


class Transformer(nnx.Module):
    def __init__(self, cfg: Config, rngs):
        self.cfg = cfg
        self.embedder = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        layers = [Block(cfg, rngs) for _ in range(cfg.layers)]
        if isinstance(cfg.remat, RecomputeConfig):
            self.layers = remat.nnx.LayerStack(layers, cfg.remat, out=lambda y: y[1])  # remat: the one change
        else:
            self.layers = nnx.List(layers)
        self.final_norm = RMSNorm(cfg.width)

    def __call__(self, tokens):
        B, T = tokens.shape
        x = self.embedder(tokens) * self.cfg.width ** 0.5
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        if isinstance(self.layers, remat.nnx.LayerStack):
            x = self.layers(x, positions, attn_mask=mask)  # remat: the stack runs the blocks
        elif self.cfg.remat == "nnx.remat":
            for layer in self.layers:
                x = nnx.remat(lambda m, x: m(x, positions, attn_mask=mask)[1])(layer, x)
        else:
            for layer in self.layers:
                _, x = layer(x, positions, attn_mask=mask)
        return self.embedder.attend(self.final_norm(x))


def loss_fn(model, tokens):
    logp = jax.nn.log_softmax(model(tokens[:, :-1]))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def sample(model, prompt, steps):
    """Greedy sampling (the whole prefix each step; this sketch keeps no cache)."""
    out = prompt
    for _ in range(steps):
        out = jnp.concatenate([out, jnp.argmax(model(out)[:, -1], -1)[:, None]], axis=1)
    return out


TARGET = "h200"  # the first temp column: XLA:GPU for it, no GPU needed (pip install 'remat[targets]')
SETTINGS = {"original": None, "nnx.remat": "nnx.remat", "LayerStack": RecomputeConfig(granularity="full"),
            "LayerStack core_attn": RecomputeConfig(granularity="selective")}


def measure(batch=2, seq=33, labels=None, target=TARGET):
    """{setting: (grads as a list of leaves, saved bytes, `target`'s temp, XLA:CPU temp)} of
    `jax.grad(loss)`, tiny float32 shapes."""
    from remat.memory import compiled_memory, compiled_stats, saved_residuals
    tokens = jax.random.randint(jax.random.key(0), (batch, seq), 0, Config.vocab)
    out = {}
    for label, r in SETTINGS.items():
        if labels is not None and label not in labels:
            continue
        model = Transformer(Config(remat=r), nnx.Rngs(0))  # same seed: same weights in every setting
        graphdef, params = nnx.split(model)
        loss = lambda p: loss_fn(nnx.merge(graphdef, p), tokens)  # noqa: E731
        grad = jax.jit(jax.grad(loss)).lower(params).compile()  # this host: the gradient and its temp
        out[label] = (jax.tree.leaves(grad(params)), saved_residuals(loss, params).intermediates,
                      compiled_memory(jax.grad(loss), params, target=target).temp,
                      compiled_stats(grad).temp)
    return out


if __name__ == "__main__":
    gpu = f"temp {remat.planning.targets.get(TARGET).compiler} ({TARGET})"
    print(f"{'setting':<24} {'saved':>10} {gpu:>22} {'temp XLA:CPU (this host)':>26}")
    for label, (_, saved, gpu_temp, cpu_temp) in measure().items():
        print(f"{label:<24} {saved / 2**20:6.2f} MiB {gpu_temp / 2**20:18.2f} MiB {cpu_temp / 2**20:22.2f} MiB")
