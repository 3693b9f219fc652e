"""LLaMA-3 exactly as llm.c's train_llama3.py computes it (shared/design/FORMATS.md), in Flax Linen.

How it differs from GPT-2 (remat_lm/models/gpt2.py):
  - RMSNorm (float32, eps `norm_eps`, weight only) instead of LayerNorm; no biases anywhere.
  - No learned positions: RoPE on q and k over adjacent feature pairs, theta `rope_theta`, with
    the LLaMA-3.1 frequency scaling when `use_scaled_rope`.
  - Grouped-query attention: `n_kv_head` key/value heads shared by n_head/n_kv_head query heads;
    c_attn's rows are [q; k; v] with (n_head + 2·n_kv_head)·D outputs.
  - SwiGLU MLP `c_proj(silu(c_fc2(x)) · c_fc(x))` of width H = multiple_of·ceil(int(
    ffn_dim_multiplier·int(2·4C/3)) / multiple_of) instead of GELU of width 4C.
  - Untied LM head `lm_head`; the vocabulary is not padded.

Example:
    >>> cfg = Llama3Config.preset("tiny", recompute=RecomputeConfig(granularity="full"))
    >>> params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    >>> num_params(cfg)
    41120
    >>> idx = jnp.zeros((2, 8), jnp.int32)
    >>> loss = jax.jit(loss_fn, static_argnums=1)(params, cfg, idx, idx)   # gradients: see loss_fn
"""
from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from remat_lm.models import parallel
from remat_lm.models.attention import ATTENTION, DEFAULT_TILE
from remat_lm.models.layers import CausalSelfAttention, LMHead, RMSNorm, SwiGLU, embed
from remat_lm.models.llmc_io import Llama3Header, check_llmc_tensors, stack_layers, unstack_layers
from remat import RecomputeConfig, names
from remat.linen import LayerStack

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Norm (RMSNorm), attention (CausalSelfAttention with GQA and RoPE, no biases) and MLP (SwiGLU)
# are the shared pieces of remat_lm/models/layers.py.


class Block(nn.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(x)); tags block_input, ln_1, ln_2."""
    config: "Llama3Config"

    @nn.compact
    def __call__(self, x, deterministic: bool = True, decode_pos=None):
        cfg, dt = self.config, self.config.compute_dtype
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        sc = cfg.sharding  # sequence parallelism: (B, T, C) split along T between the pieces
        x = checkpoint_name(parallel.residual(x, sc), names.BLOCK_INPUT)  # (B, T, C)
        h = checkpoint_name(parallel.residual(RMSNorm(dt, cfg.norm_eps, name="ln_1")(x), sc), names.LN_1)
        x = x + CausalSelfAttention(cfg.n_head, cfg.n_kv_head, dt, cfg.dropout, use_bias=False,
                                    rope_theta=cfg.rope_theta, use_scaled_rope=cfg.use_scaled_rope,
                                    proj_std=proj_std, attention=cfg.attention,
                                    attention_tile=cfg.attention_tile, sharding=sc, name="attn")(h, deterministic, decode_pos)
        x = parallel.residual(x, sc)
        h = checkpoint_name(parallel.residual(RMSNorm(dt, cfg.norm_eps, name="ln_2")(x), sc), names.LN_2)
        return parallel.residual(x + SwiGLU(cfg.ffn_hidden, dt, cfg.dropout, proj_std, sc, name="mlp")(h, deterministic), sc)


def ffn_hidden(n_embd: int, ffn_dim_multiplier: float, multiple_of: int) -> int:
    """SwiGLU width H, llm.c's rule: `h = int(m·int(8C/3))`, rounded up to a multiple of `multiple_of`.

    Example:
      >>> ffn_hidden(4096, 1.3, 1024)
      14336
    """
    h = int(ffn_dim_multiplier * int(2 * 4 * n_embd / 3))
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


@dataclasses.dataclass(frozen=True)
class Llama3Config:
    """LLaMA-3 shape and training-time settings (fields as in llm.c's LlamaConfig).

    Args:
      block_size: maximum sequence length; vocab_size: V (not padded).
      n_layer, n_head, n_kv_head, n_embd: depth, query heads, key/value heads, width C.
      ffn_dim_multiplier, multiple_of: the SwiGLU width rule (see `ffn_hidden`).
      norm_eps: RMSNorm epsilon; rope_theta, use_scaled_rope: RoPE base and LLaMA-3.1 scaling.
      dropout, dtype ("float32"|"bfloat16" compute), scan_layers, recompute, loss_chunk, attention,
        attention_tile, sharding: as for GPT-2.
    Example:
      >>> Llama3Config.preset("tiny").ffn_hidden
      96
    """
    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    ffn_dim_multiplier: float = 1.0
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = True
    dropout: float = 0.0
    dtype: str = "float32"
    scan_layers: bool = False
    recompute: RecomputeConfig = RecomputeConfig()
    loss_chunk: int = 0
    attention: str = "auto"
    attention_tile: int = DEFAULT_TILE
    sharding: parallel.ShardingConfig | None = None

    def __post_init__(self):
        if not isinstance(self.loss_chunk, int) or isinstance(self.loss_chunk, bool) or self.loss_chunk < 0:
            raise ValueError(f"Llama3Config.loss_chunk={self.loss_chunk!r} must be an int >= 0 (0: no chunking)")
        for f in ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "multiple_of"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Llama3Config.{f}={v!r} must be a positive int")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"Llama3Config.n_embd={self.n_embd} must split into n_head={self.n_head} heads "
                             f"of even size (RoPE rotates feature pairs); choose n_head so n_embd/n_head is even")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"Llama3Config.n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        for f in ("ffn_dim_multiplier", "norm_eps", "rope_theta"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Llama3Config.{f}={v!r} must be a positive number")
        if self.dtype not in DTYPES:
            raise ValueError(f"Llama3Config.dtype={self.dtype!r} is not valid; use one of {', '.join(DTYPES)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"Llama3Config.dropout={self.dropout!r} must be in [0, 1)")
        if not isinstance(self.recompute, RecomputeConfig):
            raise ValueError(f"Llama3Config.recompute={self.recompute!r} must be a remat.RecomputeConfig")
        if self.attention not in ATTENTION:
            raise ValueError(f"Llama3Config.attention={self.attention!r} is not valid; use one of {', '.join(ATTENTION)}")
        if not isinstance(self.attention_tile, int) or isinstance(self.attention_tile, bool) or self.attention_tile < 1:
            raise ValueError(f"Llama3Config.attention_tile={self.attention_tile!r} must be a positive int, e.g. {DEFAULT_TILE}")
        try:
            parallel.check(self.sharding)
        except ValueError as e:
            raise ValueError(f"Llama3Config.{e}") from None
        self.recompute.validate_for(self.n_layer)

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_hidden(self) -> int:
        """SwiGLU width H (llm.c's rule, `ffn_hidden`)."""
        return ffn_hidden(self.n_embd, self.ffn_dim_multiplier, self.multiple_of)

    @classmethod
    def preset(cls, name: str, **overrides) -> "Llama3Config":
        """A preset from PRESETS with fields overridden, e.g. `preset("8b", n_layer=4)`."""
        if name not in PRESETS:
            raise ValueError(f"unknown LLaMA-3 preset {name!r}; valid: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# Parameter counts (tests/test_models.py checks them). `1b` is LLaMA-3.2-1B's shape with an
# untied head (3.2-1B ties it: 1.24B).
PRESETS = {
    "8b": dict(block_size=8192, vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
               ffn_dim_multiplier=1.3, multiple_of=1024, norm_eps=1e-5, rope_theta=500000.0,
               use_scaled_rope=True),  # 8,030,261,248
    "1b": dict(block_size=8192, vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
               ffn_dim_multiplier=1.5, multiple_of=256, norm_eps=1e-5, rope_theta=500000.0,
               use_scaled_rope=True),  # 1,498,482,688
    "tiny": dict(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                 ffn_dim_multiplier=1.0, multiple_of=32, norm_eps=1e-5, rope_theta=500000.0,
                 use_scaled_rope=True),  # 41,120
}


class Llama3(nn.Module):
    """The LLaMA-3 language model.

    `__call__(idx, targets=None, *, deterministic=True, decode_pos=None)` returns `(logits, loss)`: logits
    (B, T, V) float32 and the mean cross-entropy over B·T positions (None without targets).
    With `loss_chunk` > 0 and targets the loss is computed over chunks and logits is None.
    Decoding (`decode_pos`, a `cache` collection): as for GPT-2 (RoPE at the decoded positions).
    Example:
      >>> model = Llama3(Llama3Config.preset("tiny"))
      >>> logits, loss = jax.jit(model.apply)({"params": params}, idx, targets)
      >>> logits.shape  # (B, T, V)
      (2, 8, 256)
    """
    config: Llama3Config

    @nn.compact
    def __call__(self, idx, targets=None, *, deterministic: bool = True, decode_pos=None):
        cfg, dt = self.config, self.config.compute_dtype
        if idx.shape[1] > cfg.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size={cfg.block_size}")
        wte = self.param("wte", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.n_embd), jnp.float32)
        x = embed(wte, idx).astype(dt)  # (B, T, C)
        x = nn.Dropout(cfg.dropout)(x, deterministic)
        x = parallel.residual(x, cfg.sharding)  # the residual stream entering the blocks (NOTE in remat_lm.models.parallel)
        decode = () if decode_pos is None else (decode_pos,)  # the blocks' third argument, only when decoding
        # NOTE: the one place layers are grouped and rematerialized (remat.linen.LayerStack).
        x = LayerStack(functools.partial(Block, cfg), cfg.n_layer, cfg.recompute,
                       scan=cfg.scan_layers, name="blocks")(x, deterministic, *decode)
        x = RMSNorm(dt, cfg.norm_eps, name="ln_f")(x)  # (B, T, C)
        return LMHead(cfg.vocab_size, chunk=cfg.loss_chunk, name="lm_head")(x, targets)  # logits (B, T, V) or None


def init_params(config: Llama3Config, key, batch_shape=(1, 1)):
    """Fresh float32 parameters.

    Example:
      >>> init = lambda key: init_params(Llama3Config.preset("tiny"), key)
      >>> params = jax.eval_shape(init, jax.random.key(0))  # shapes only; init(key) makes the arrays
      >>> sorted(params)
      ['blocks', 'lm_head', 'ln_f', 'wte']
    """
    # the parameters do not depend on the attention core; the xla core takes any T (Pallas: multiples of 128)
    return Llama3(dataclasses.replace(config, attention="xla")).init({"params": key}, jnp.zeros(batch_shape, jnp.int32))["params"]


def loss_fn(params, config: Llama3Config, idx, targets, dropout_key=None):
    """Mean cross-entropy; dropout is on exactly when `dropout_key` is given.

    Example:
      >>> loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)(params, cfg, idx, targets)
      >>> jax.tree.structure(grads) == jax.tree.structure(params)
      True
    """
    rngs = None if dropout_key is None else {"dropout": dropout_key}
    return Llama3(config).apply({"params": params}, idx, targets, deterministic=dropout_key is None, rngs=rngs)[1]


def num_params(config: Llama3Config) -> int:
    """Parameter count (embedding and LM head counted separately: they are untied)."""
    C, L, H, D = config.n_embd, config.n_layer, config.ffn_hidden, config.head_dim
    per_layer = (config.n_head + 2 * config.n_kv_head) * D * C + C * C + 3 * H * C + 2 * C
    return 2 * config.vocab_size * C + L * per_layer + C


def flops_per_token(config: Llama3Config, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), for MFU.

    Example:
      >>> round(flops_per_token(Llama3Config.preset("8b"), seq_len=2048) / 1e9, 3)  # GFLOP per token
      46.64
    """
    # NOTE: 6N over the matmul parameters (the wte lookup is not a matmul; lm_head is), plus
    # causal attention 6·L·C·T as for GPT-2 (GQA shares k/v, not the QKᵀ and PV work).
    T = config.block_size if seq_len is None else seq_len
    n = num_params(config) - config.vocab_size * config.n_embd
    return 6.0 * n + 6.0 * config.n_layer * config.n_embd * T


_LAYER_TENSORS = {
    "ln_1.w": ("ln_1", "w"), "attn.c_attn.w": ("attn", "c_attn", "w"), "attn.c_proj.w": ("attn", "c_proj", "w"),
    "ln_2.w": ("ln_2", "w"), "mlp.c_fc.w": ("mlp", "c_fc", "w"), "mlp.c_fc2.w": ("mlp", "c_fc2", "w"),
    "mlp.c_proj.w": ("mlp", "c_proj", "w"),
}


def llmc_shapes(config) -> dict:
    """{llm.c tensor name: shape}, in the model file's order: the one LLaMA-3 table
    (remat_lm.models.llmc_io reads and writes files by it); c_attn rows are [q; k; v]. `config` is a
    Llama3Config or an llm.c Llama3Header.

    Example:
      >>> llmc_shapes(Llama3Config.preset("tiny"))["mlp.c_fc2.w"]
      (2, 96, 32)
    """
    V, L, C = config.vocab_size, config.n_layer, config.n_embd
    H = ffn_hidden(C, config.ffn_dim_multiplier, config.multiple_of)
    qkv = (config.n_head + 2 * config.n_kv_head) * (C // config.n_head)
    return {"wte": (V, C), "ln_1.w": (L, C), "attn.c_attn.w": (L, qkv, C), "attn.c_proj.w": (L, C, C),
            "ln_2.w": (L, C), "mlp.c_fc.w": (L, H, C), "mlp.c_fc2.w": (L, H, C), "mlp.c_proj.w": (L, C, H),
            "ln_f.w": (C,), "lm_head.w": (V, C)}


def llmc_header(config: Llama3Config) -> Llama3Header:
    """The llm.c header describing `config`."""
    return Llama3Header(block_size=config.block_size, vocab_size=config.vocab_size, n_layer=config.n_layer,
                        n_head=config.n_head, n_kv_head=config.n_kv_head, n_embd=config.n_embd,
                        ffn_dim_multiplier=config.ffn_dim_multiplier, multiple_of=config.multiple_of,
                        norm_eps=config.norm_eps, rope_theta=config.rope_theta,
                        use_scaled_rope=bool(config.use_scaled_rope), max_gen_batch_size=4)


def config_from_llmc(header: Llama3Header, **fields) -> Llama3Config:
    """A Llama3Config for an llm.c header; `fields` (recompute, dtype, scan_layers...) are added."""
    return Llama3Config(block_size=header.block_size, vocab_size=header.vocab_size, n_layer=header.n_layer,
                        n_head=header.n_head, n_kv_head=header.n_kv_head, n_embd=header.n_embd,
                        ffn_dim_multiplier=header.ffn_dim_multiplier, multiple_of=header.multiple_of,
                        norm_eps=header.norm_eps, rope_theta=header.rope_theta,
                        use_scaled_rope=header.use_scaled_rope, **fields)


def to_llmc(config: Llama3Config, params) -> dict:
    """Parameters → {llm.c tensor name: float32 np.ndarray}, in the model file's order.

    Example:
      >>> tensors = to_llmc(cfg, params); tensors["mlp.c_fc2.w"].shape  # (L, H, C)
      (2, 96, 32)
    """
    b = params["blocks"]
    out = {"wte": np.asarray(params["wte"], np.float32)}
    out.update({k: stack_layers(b, config.n_layer, config.scan_layers, p) for k, p in _LAYER_TENSORS.items()})
    out["ln_f.w"] = np.asarray(params["ln_f"]["w"], np.float32)
    out["lm_head.w"] = np.asarray(params["lm_head"]["w"], np.float32)
    return out


def from_llmc(config: Llama3Config, tensors) -> dict:
    """{llm.c tensor name: array} → parameters for `config` (loop or scan layout).

    Example:
      >>> back = from_llmc(cfg, to_llmc(cfg, params))
      >>> bool(jnp.array_equal(back["lm_head"]["w"], params["lm_head"]["w"]))
      True
    """
    check_llmc_tensors("LLaMA-3", llmc_shapes(config), tensors)
    f = lambda k: jnp.asarray(np.asarray(tensors[k], np.float32))
    blocks = unstack_layers({p: np.asarray(tensors[k], np.float32) for k, p in _LAYER_TENSORS.items()},
                            config.n_layer, config.scan_layers)
    return {"wte": f("wte"), "blocks": blocks, "ln_f": {"w": f("ln_f.w")}, "lm_head": {"w": f("lm_head.w")}}
