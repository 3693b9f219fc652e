"""A decoder-only language model in Flax Linen, in the style of Flax's lm1b example, adopting remat.

The model is written the usual Linen way (`nn.MultiHeadDotProductAttention` with a decode cache,
blocks named `encoderdecoderblock_i`). Adopting the library is the lines marked `# remat:`:
`remat_module` wraps the block class (parameter paths unchanged), and the `attention_fn` wrapper
tags q, k, v and the attention context so that the selective presets (`core_attn`) have names to
keep. `remat=None` is the original model; `"nn.remat"` is the plain Flax baseline.

    python -m examples.linen_lm     # saved bytes, compiled temp on XLA:GPU (h200) and on XLA:CPU
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import remat.linen  # remat:
from remat import RecomputeConfig, names  # remat:


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 64
    emb_dim: int = 64
    num_heads: int = 4
    num_layers: int = 4
    mlp_dim: int = 256
    max_len: int = 64
    decode: bool = False
    remat: Any = None  # None | "nn.remat" | a RecomputeConfig for remat.linen.remat_module


# remat: name q, k, v and the context for the policies. `functools.wraps` matters: Flax passes an
# attention_fn only the keyword arguments its signature names, and `**kw` names none (the mask
# would be dropped).
@functools.wraps(nn.dot_product_attention)
def tagged_attention(query, key, value, **kw):
    query, key, value = (checkpoint_name(t, names.QKV) for t in (query, key, value))
    return checkpoint_name(nn.dot_product_attention(query, key, value, **kw), names.ATTN_CONTEXT)


class MlpBlock(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        h = checkpoint_name(nn.Dense(self.config.mlp_dim)(x), names.MLP_UP)  # remat: tag
        h = checkpoint_name(nn.gelu(h), names.MLP_ACT)  # remat: tag
        return nn.Dense(x.shape[-1])(h)


class EncoderDecoder1DBlock(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x, decoder_mask=None, deterministic=True):
        cfg = self.config
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=cfg.num_heads, decode=cfg.decode, deterministic=deterministic,
                                            attention_fn=tagged_attention)(h, mask=decoder_mask)  # remat: tagged
        x = x + h
        return x + MlpBlock(cfg)(nn.LayerNorm()(x))


class Decoder(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens, deterministic=True):
        cfg = self.config
        x = nn.Embed(cfg.vocab_size, cfg.emb_dim)(tokens)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, cfg.max_len, cfg.emb_dim))
        if cfg.decode:
            i = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
            x = x + jax.lax.dynamic_slice_in_dim(pos, i.value, x.shape[1], axis=1)
            if not self.is_initializing():
                i.value += x.shape[1]
            mask = None
        else:
            x = x + pos[:, :x.shape[1]]
            mask = nn.make_causal_mask(tokens)
        block = EncoderDecoder1DBlock
        if cfg.remat == "nn.remat":
            block = nn.remat(block, static_argnums=(3,))
        elif cfg.remat is not None:
            block = remat.linen.remat_module(block, recompute=cfg.remat, static_argnums=(3,))  # remat: the one change
        for i in range(cfg.num_layers):
            x = block(cfg, name=f"encoderdecoderblock_{i}")(x, mask, deterministic)
        return nn.Dense(cfg.vocab_size, name="logitdense")(nn.LayerNorm()(x))


def loss_fn(params, cfg, tokens):
    logits = Decoder(cfg).apply({"params": params}, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def init(cfg, key, batch=2, seq=33):
    return Decoder(cfg).init(key, jnp.zeros((batch, seq - 1), jnp.int32))["params"]


def generate(params, cfg, prompt, steps):
    """Greedy decoding with the KV cache (one token a step)."""
    dcfg = dataclasses.replace(cfg, decode=True)
    cache = Decoder(dcfg).init(jax.random.key(0), jnp.zeros((prompt.shape[0], cfg.max_len), jnp.int32))["cache"]
    model = Decoder(dcfg)

    @jax.jit
    def step(cache, tok):
        logits, upd = model.apply({"params": params, "cache": cache}, tok, mutable=["cache"])
        return upd["cache"], jnp.argmax(logits[:, -1], -1)[:, None]

    out = [prompt[:, :1]]
    for t in range(prompt.shape[1] + steps - 1):
        cache, nxt = step(cache, out[-1] if t >= prompt.shape[1] - 1 else prompt[:, t:t + 1])
        out.append(nxt if t >= prompt.shape[1] - 1 else prompt[:, t + 1:t + 2])
    return jnp.concatenate(out, axis=1)


TARGET = "h200"  # the first temp column: XLA:GPU for it, no GPU needed (pip install 'remat[targets]')
SETTINGS = {"original": None, "nn.remat": "nn.remat",
            "remat_module": RecomputeConfig(granularity="full"),
            "remat_module core_attn": RecomputeConfig(granularity="selective")}


def measure(batch=2, seq=33, labels=None, target=TARGET):
    """{setting: (grads, saved bytes, `target`'s temp, XLA:CPU temp)} of `jax.grad(loss)`, tiny float32 shapes."""
    from remat.memory import compiled_memory, compiled_stats, saved_residuals
    key = jax.random.key(0)
    tokens = jax.random.randint(key, (batch, seq), 0, Config.vocab_size)
    params = init(Config(), key, batch, seq)
    out = {}
    for label, r in SETTINGS.items():
        if labels is not None and label not in labels:
            continue
        cfg = Config(remat=r)
        loss = functools.partial(loss_fn, cfg=cfg, tokens=tokens)
        grad = jax.jit(jax.grad(loss)).lower(params).compile()  # this host: the gradient and its temp
        out[label] = (grad(params), saved_residuals(loss, params).intermediates,
                      compiled_memory(jax.grad(loss), params, target=target).temp, compiled_stats(grad).temp)
    return out


if __name__ == "__main__":
    gpu = f"temp {remat.planning.targets.get(TARGET).compiler} ({TARGET})"
    print(f"{'setting':<24} {'saved':>10} {gpu:>22} {'temp XLA:CPU (this host)':>26}")
    for label, (_, saved, gpu_temp, cpu_temp) in measure().items():
        print(f"{label:<24} {saved / 2**20:6.2f} MiB {gpu_temp / 2**20:18.2f} MiB {cpu_temp / 2**20:22.2f} MiB")
