"""GPT-2 exactly as llm.c computes it (docs/llmc-format.md), in Flax Linen.

Pre-LN blocks with LayerNorm (eps 1e-5), fused c_attn, causal attention scaled by 1/sqrt(D),
tanh-GELU MLP of width 4C, learned positions `wpe`, final `ln_f`, LM head tied to `wte`, and a
vocabulary padded to `padded_vocab_size` whose extra columns are left out of the softmax.

Example:
    >>> cfg = GPT2Config.preset("tiny", recompute=RecomputeConfig(granularity="full"))
    >>> params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    >>> num_params(cfg)
    35712
    >>> idx = jnp.zeros((2, 8), jnp.int32)
    >>> loss = jax.jit(loss_fn, static_argnums=1)(params, cfg, idx, idx)   # gradients: see loss_fn
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat import RecomputeConfig, names
from remat.memory import LayerBytes
from remat_lm.models import layers, llmc_io
from remat_lm.models.config import ModelConfig
from remat_lm.models.family import Family
from remat_lm.models.layers import MLP, LayerNorm, blocks, lm_head
from remat_lm.models.memory_model import F32, lm_head_bytes, lse_bytes

NORM = functools.partial(LayerNorm, epsilon=1e-5)


# Parameter counts with the padded vocabulary (tests/test_models.py checks them).
PRESETS = {
    "d12": dict(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768),   # 124,475,904
    "d24": dict(block_size=1024, vocab_size=50257, n_layer=24, n_head=16, n_embd=1024),  # 354,871,296
    "d36": dict(block_size=1024, vocab_size=50257, n_layer=36, n_head=20, n_embd=1280),  # 774,090,240
    "d48": dict(block_size=1024, vocab_size=50257, n_layer=48, n_head=25, n_embd=1600),  # 1,557,686,400
    "tiny": dict(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=32),         # 35,712
}


@dataclasses.dataclass(frozen=True)
class GPT2Config(ModelConfig):
    """GPT-2 shape and training-time settings: `ModelConfig`'s fields (block_size: rows of `wpe`)
    and padded_vocab_size: Vp >= V, the rows of `wte` and the logits' width (default V rounded up
    to a multiple of 128).

    Example:
      >>> GPT2Config.preset("d12", dtype="bfloat16").padded_vocab_size
      50304
    """
    padded_vocab_size: int | None = None

    PRESETS: ClassVar[dict] = PRESETS
    TITLE: ClassVar[str] = "GPT-2"
    use_bias: ClassVar[bool] = True
    rope: ClassVar[None] = None  # learned positions `wpe` instead

    def _check_shape(self):
        if self.padded_vocab_size is None:
            object.__setattr__(self, "padded_vocab_size", -(-self.vocab_size // 128) * 128)
        if not isinstance(self.padded_vocab_size, int) or self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"GPT2Config.padded_vocab_size={self.padded_vocab_size!r} must be an int >= "
                             f"vocab_size={self.vocab_size}; leave it unset for vocab_size rounded up to 128")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPT2Config.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                             f"choose n_head among the divisors of n_embd")

    @property
    def logits_width(self) -> int:
        """The padded vocabulary: the rows of `wte`."""
        return self.padded_vocab_size

    @property
    def n_kv_head(self) -> int:
        """Key/value heads: one per query head."""
        return self.n_head

    @property
    def ffn_hidden(self) -> int:
        """MLP width 4C."""
        return 4 * self.n_embd


def _init_wte(config: GPT2Config):
    def init(key, shape, dtype):
        w = jax.random.normal(key, shape, dtype) * 0.02
        return w.at[config.vocab_size:].set(0.0)  # llm.c files carry zero padded rows
    return init


class GPT2(nn.Module):
    """The GPT-2 language model.

    `__call__(idx, targets=None, *, deterministic=True, decode_pos=None)` returns `(logits, loss)`: logits
    (B, T, Vp) float32 and the mean cross-entropy over B·T positions (None without targets).
    With `loss_chunk` > 0 and targets the loss is computed over chunks and logits is None (call
    without targets for them). Dropout needs `deterministic=False` and a `dropout` RNG.
    Decoding: with `decode_pos` (an int, may be traced) idx holds the tokens at positions
    decode_pos..decode_pos+T-1; attention reads and extends the key/value `cache` collection
    (`apply({"params": p, "cache": c}, idx, decode_pos=pos, mutable=["cache"])`, loop layout;
    remat_lm.models.sample drives it).
    Example:
      >>> logits, loss = GPT2(GPT2Config.preset("tiny")).apply({"params": params}, idx)
      >>> logits.shape, loss  # (B, T, Vp); no targets, no loss
      ((2, 8, 256), None)
    """
    config: GPT2Config

    @nn.compact
    def __call__(self, idx, targets=None, *, deterministic: bool = True, decode_pos=None):
        cfg, T = self.config, idx.shape[1]
        layers.check_length(cfg, T)
        wte = self.param("wte", _init_wte(cfg), (cfg.padded_vocab_size, cfg.n_embd), jnp.float32)
        wpe = self.param("wpe", nn.initializers.normal(0.02), (cfg.block_size, cfg.n_embd), jnp.float32)
        rows = wpe[:T] if decode_pos is None else jax.lax.dynamic_slice_in_dim(wpe, decode_pos, T, axis=0)  # (T, C)
        x = blocks(self, jnp.take(wte, idx, axis=0) + rows, NORM, MLP, deterministic, decode_pos)  # (B, T, C)
        return lm_head(x, wte, targets, cfg.vocab_size, cfg.loss_chunk, tied=True)  # logits (B, T, Vp) or None, loss


def init_params(config: GPT2Config, key, batch_shape=(1, 1)):
    """Fresh float32 parameters.

    Example:
      >>> init = lambda key: init_params(GPT2Config.preset("tiny"), key)
      >>> params = jax.eval_shape(init, jax.random.key(0))  # shapes only; init(key) makes the arrays
      >>> sorted(params), params["wte"].shape
      (['blocks', 'ln_f', 'wpe', 'wte'], (256, 32))
    """
    return layers.init_params(GPT2, config, key, batch_shape)


def loss_fn(params, config: GPT2Config, idx, targets, dropout_key=None):
    """Mean cross-entropy; dropout is on exactly when `dropout_key` is given.

    Example:
      >>> loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)(params, cfg, idx, targets)
      >>> jax.tree.structure(grads) == jax.tree.structure(params)
      True
    """
    return layers.loss_fn(GPT2, params, config, idx, targets, dropout_key)


def num_params(config: GPT2Config) -> int:
    """Parameter count (wte padded to Vp), as in llm.c."""
    C, L = config.n_embd, config.n_layer
    return config.padded_vocab_size * C + config.block_size * C + L * (12 * C * C + 13 * C) + 2 * C


def flops_per_token(config: GPT2Config, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), for MFU.

    Example:
      >>> round(flops_per_token(GPT2Config.preset("d12")) / 1e9, 3)  # GFLOP per token at T = 1024
      0.799
    """
    # NOTE: 6N for the matmuls of N parameters (wpe is a lookup, not a matmul; the tied wte counts
    # once, as the LM head), plus causal attention: QKᵀ and PV are 2·2·T·C FLOPs per token and
    # layer, halved by the mask, times 3 for forward + backward: 6·L·C·T (llm.c's figure).
    T = config.block_size if seq_len is None else seq_len
    n = num_params(config) - config.block_size * config.n_embd
    return 6.0 * n + 6.0 * config.n_layer * config.n_embd * T


def llmc_shapes(config) -> dict:
    """{llm.c tensor name: shape}, in the model file's order: the one GPT-2 table (remat_lm.models.llmc_io
    reads and writes files by it). `config` is a GPT2Config or an llm.c GPT2Header.

    Example:
      >>> llmc_shapes(GPT2Config.preset("tiny"))["attn.c_attn.w"]
      (2, 96, 32)
    """
    Vp, T, L, C = config.padded_vocab_size, config.block_size, config.n_layer, config.n_embd
    per = {"ln_1.w": (C,), "ln_1.b": (C,), "attn.c_attn.w": (3 * C, C), "attn.c_attn.b": (3 * C,),
           "attn.c_proj.w": (C, C), "attn.c_proj.b": (C,), "ln_2.w": (C,), "ln_2.b": (C,),
           "mlp.c_fc.w": (4 * C, C), "mlp.c_fc.b": (4 * C,), "mlp.c_proj.w": (C, 4 * C), "mlp.c_proj.b": (C,)}
    return {"wte": (Vp, C), "wpe": (T, C), **{k: (L,) + s for k, s in per.items()},
            "ln_f.w": (C,), "ln_f.b": (C,)}


@dataclasses.dataclass(frozen=True)
class GPT2Header(llmc_io.Header):
    """A GPT-2 llm.c model file header (slots 2..7), and the GPT-2 file format (`llmc_io.Header`):
    magic 20240326, debug states 20240327 version 2, `wte` padded to Vp with zero rows.

    Example:
        >>> h = GPT2Header(1024, 50257, 12, 12, 768, 50304)
        >>> h.n_params(), h.tensor_shapes()[0]
        (124475904, ('wte', (50304, 768)))
    """
    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    padded_vocab_size: int

    kind = "gpt2"
    title = "GPT-2"
    model_magic = 20240326
    state_magic = 20240327
    state_version = 2
    padded = ("wte", "vocab_size", "padded_vocab_size")
    exporter = "train_gpt2.py"
    retired_versions = (1, 2)
    retired = "llm.c's format without vocab padding (versions before 3)"

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """`llmc_shapes` as `[(name, shape), ...]` in file order."""
        return list(llmc_shapes(self).items())

    def problem(self) -> str | None:
        if self.n_embd % self.n_head:
            return f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}"
        if self.padded_vocab_size < self.vocab_size:
            return f"padded_vocab_size {self.padded_vocab_size} is smaller than vocab_size {self.vocab_size}"
        return None

    def logit_widths(self) -> list[int]:
        # llm.c's debug states hold logits of width V (train_gpt2.py, test_gpt2.c), some writers Vp: accept both
        # (docs/llmc-format.md).
        return sorted({self.vocab_size, self.padded_vocab_size})


def llmc_header(config: GPT2Config) -> GPT2Header:
    """The llm.c header describing `config`."""
    return GPT2Header(block_size=config.block_size, vocab_size=config.vocab_size, n_layer=config.n_layer,
                      n_head=config.n_head, n_embd=config.n_embd, padded_vocab_size=config.padded_vocab_size)


def config_from_llmc(header: GPT2Header, **fields) -> GPT2Config:
    """A GPT2Config for an llm.c header; `fields` (recompute, dtype, scan_layers...) are added."""
    return GPT2Config(block_size=header.block_size, vocab_size=header.vocab_size,
                      padded_vocab_size=header.padded_vocab_size, n_layer=header.n_layer,
                      n_head=header.n_head, n_embd=header.n_embd, **fields)


def to_llmc(config: GPT2Config, params) -> dict:
    """Parameters → {llm.c tensor name: float32 np.ndarray}, in the model file's order
    (`remat_lm.models.llmc_io.to_llmc`: the one mapping of names and layouts).

    Example:
      >>> tensors = to_llmc(cfg, params); tensors["attn.c_attn.w"].shape  # (L, 3C, C)
      (2, 96, 32)
    """
    return llmc_io.to_llmc(params, llmc_shapes(config))


def from_llmc(config: GPT2Config, tensors) -> dict:
    """{llm.c tensor name: array} → parameters for `config` (loop or scan layout).

    Example:
      >>> scan_cfg = dataclasses.replace(cfg, scan_layers=True)
      >>> scan_params = from_llmc(scan_cfg, to_llmc(cfg, params))
      >>> scan_params["blocks"]["h"]["attn"]["c_attn"]["kernel"].shape  # stacked: (L, C, 3C)
      (2, 32, 96)
    """
    return llmc_io.from_llmc("GPT-2", llmc_shapes(config), tensors, config.scan_layers)


def activation_bytes(config: GPT2Config, batch: int, seq: int) -> tuple[LayerBytes, int]:
    """(bytes one layer keeps without remat, bytes kept outside the layer stack): the analytic
    memory model (remat_lm/models/memory_model.py, docs/memory-model.md).

    Example:
      >>> layer, head = activation_bytes(GPT2Config.preset("tiny"), batch=2, seq=8)
      >>> layer.tagged["qkv"], head  # 3·s·b·h·4 bytes; the head's float32 logits dominate
      (6144, 20816)
    """
    a = jnp.dtype(config.compute_dtype).itemsize
    s, b, h = seq, batch, config.n_embd
    sbh = s * b * h * a
    tagged = {names.BLOCK_INPUT: sbh, names.LN_1: sbh, names.QKV: 3 * sbh, names.ATTN_CONTEXT: sbh,
              names.LN_2: sbh, names.MLP_UP: 4 * sbh, names.MLP_ACT: 4 * sbh}
    # mid-layer residual (input of ln_2) + LayerNorm mean and rstd for 2 norms + lse, and in
    # bf16 the bf16 casts of the layer's 12h² matmul weights
    untagged = sbh + 2 * 2 * s * b * F32 + lse_bytes(config, b, s) + (12 * h * h * a if a < F32 else 0)
    # last layer's output and ln_f (input, mean, rstd, output), the token ids (int32; counted only
    # when they are a closed-over constant, not an argument), and the LM head: float32 logits over
    # the padded vocabulary and in bf16 the cast of the tied head, or chunked targets
    Vp = config.padded_vocab_size
    head = 2 * sbh + 2 * s * b * F32 + s * b * 4 + lm_head_bytes(config, s * b, Vp, Vp * h * a if a < F32 else 0)
    # GELU's internals (four (s, b, 4h) values), recomputed from mlp_up: kept only by a save-everything policy
    return LayerBytes(tagged, untagged, swaps={names.ATTN_OUT: sbh}, internals=4 * 4 * sbh), head


FAMILY = Family(
    name="gpt2", title="GPT-2", config_cls=GPT2Config, presets=PRESETS, config=GPT2Config.preset, model_cls=GPT2,
    init_params=init_params, loss_fn=loss_fn, num_params=num_params, flops_per_token=flops_per_token,
    activation_bytes=activation_bytes, header_cls=GPT2Header, llmc_shapes=llmc_shapes, llmc_header=llmc_header,
    config_from_llmc=config_from_llmc, to_llmc=to_llmc, from_llmc=from_llmc, tokenizer_preset="d12")
