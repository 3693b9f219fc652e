"""LLaMA-3 exactly as llm.c's train_llama3.py computes it (docs/llmc-format.md), in Flax Linen.

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
    >>> cfg = Llama3Config.preset("tiny", recompute=RecomputeConfig(granularity="selective"))
    >>> num_params(cfg), cfg.n_kv_head, cfg.ffn_hidden   # SwiGLU width: `ffn_hidden`
    (41120, 2, 96)
    >>> params = init_params(cfg, jax.random.key(0))
    >>> grads = jax.grad(loss_fn)(params, cfg, jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32))
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from remat import RecomputeConfig, names
from remat.memory import LayerBytes
from remat_lm.models import layers, llmc_io
from remat_lm.models.config import ModelConfig
from remat_lm.models.family import Family
from remat_lm.models.layers import RMSNorm, SwiGLU, blocks, cross_entropy, dense, lm_head
from remat_lm.models.memory_model import F32, lm_head_bytes, lse_bytes

def ffn_hidden(n_embd: int, ffn_dim_multiplier: float, multiple_of: int) -> int:
    """SwiGLU width H, llm.c's rule: `h = int(m·int(8C/3))`, rounded up to a multiple of `multiple_of`.

    Example:
      >>> ffn_hidden(4096, 1.3, 1024)
      14336
    """
    h = int(ffn_dim_multiplier * int(2 * 4 * n_embd / 3))
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


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


@dataclasses.dataclass(frozen=True)
class Llama3Config(ModelConfig):
    """LLaMA-3 shape and training-time settings (fields as in llm.c's LlamaConfig): `ModelConfig`'s
    fields (vocab_size not padded) and

    Args:
      n_kv_head: key/value heads (grouped-query attention), dividing n_head.
      ffn_dim_multiplier, multiple_of: the SwiGLU width rule (see `ffn_hidden`).
      norm_eps: RMSNorm epsilon; rope_theta, use_scaled_rope: RoPE base and LLaMA-3.1 scaling.
    Example:
      >>> Llama3Config.preset("tiny").ffn_hidden
      96
    """
    n_kv_head: int
    ffn_dim_multiplier: float = 1.0
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = True

    PRESETS: ClassVar[dict] = PRESETS
    TITLE: ClassVar[str] = "LLaMA-3"
    use_bias: ClassVar[bool] = False
    _POSITIVE: ClassVar[tuple[str, ...]] = ModelConfig._POSITIVE + ("n_kv_head", "multiple_of")

    def _check_shape(self):
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"Llama3Config.n_embd={self.n_embd} must split into n_head={self.n_head} heads "
                             f"of even size (RoPE rotates feature pairs); choose n_head so n_embd/n_head is even")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"Llama3Config.n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        for f in ("ffn_dim_multiplier", "norm_eps", "rope_theta"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Llama3Config.{f}={v!r} must be a positive number")

    @property
    def ffn_hidden(self) -> int:
        """SwiGLU width H (llm.c's rule, `ffn_hidden`)."""
        return ffn_hidden(self.n_embd, self.ffn_dim_multiplier, self.multiple_of)

    @property
    def rope(self) -> tuple[float, bool]:
        """(theta, use_scaled) of the RoPE on q and k."""
        return self.rope_theta, self.use_scaled_rope


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
        layers.check_length(cfg, idx.shape[1])
        wte = self.param("wte", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.n_embd), jnp.float32)
        norm = functools.partial(RMSNorm, epsilon=cfg.norm_eps)
        x = blocks(self, jnp.take(wte, idx, axis=0), norm, SwiGLU, deterministic, decode_pos)  # (B, T, C)
        head = dense(cfg.vocab_size, dt, use_bias=False, name="lm_head",
                     dot_general=functools.partial(lax.dot_general, preferred_element_type=jnp.float32))
        if targets is None or not cfg.loss_chunk:
            logits = checkpoint_name(head(x), names.LM_HEAD)  # (B, T, V) float32
            return logits, None if targets is None else cross_entropy(logits, targets, cfg.vocab_size)
        head(x[:, :0])  # no positions: makes the kernel at init, computes nothing
        return lm_head(x, head.variables["params"]["kernel"], targets, cfg.vocab_size, cfg.loss_chunk)  # None, loss


def init_params(config: Llama3Config, key, batch_shape=(1, 1)):
    """Fresh float32 parameters.

    Example:
      >>> init = lambda key: init_params(Llama3Config.preset("tiny"), key)
      >>> params = jax.eval_shape(init, jax.random.key(0))  # shapes only; init(key) makes the arrays
      >>> sorted(params)
      ['blocks', 'lm_head', 'ln_f', 'wte']
    """
    return layers.init_params(Llama3, config, key, batch_shape)


def loss_fn(params, config: Llama3Config, idx, targets, dropout_key=None):
    """Mean cross-entropy (`remat_lm.models.layers.loss_fn`: dropout exactly when `dropout_key` is given)."""
    return layers.loss_fn(Llama3, params, config, idx, targets, dropout_key)


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


@dataclasses.dataclass(frozen=True)
class Llama3Header(llmc_io.Header):
    """A LLaMA-3 llm.c model file header (slots 2..13, then version 3.1 in slots 14, 15), and the
    LLaMA-3 file format (`llmc_io.Header`): magic 20240803 for model and debug-state files; the
    float fields are float32 bit patterns (InfiniTrain's convention), which llm.c master writes
    truncated to integers (`read_model` overrides replace them).

    The float fields hold the shortest decimal that round-trips the stored float32 (so a file
    written with ``norm_eps=1e-5`` reads back as ``1e-05``).

    Example:
        >>> h = Llama3Header(8192, 128256, 32, 32, 8, 4096, 1.3, 1024, 1e-5, 500000.0, True, 4)
        >>> h.ffn_hidden(), h.n_params()
        (14336, 8030261248)
    """
    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    ffn_dim_multiplier: float
    multiple_of: int
    norm_eps: float
    rope_theta: float
    use_scaled_rope: bool
    max_gen_batch_size: int

    kind = "llama3"
    title = "LLaMA-3"
    model_magic = 20240803
    state_magic = 20240803  # model files and debug-state files share it
    trailer = (3, 1)  # llm.c's version major, minor
    # plausible (exclusive low, inclusive high) ranges of the float slots; anything outside (0,
    # tiny denormals, truncated integers read as float32 bits) is rejected
    float_ranges = {"ffn_dim_multiplier": (1e-3, 1e3), "norm_eps": (1e-12, 0.5), "rope_theta": (1.0, 1e12)}
    flags = ("use_scaled_rope",)
    counts = ("max_gen_batch_size",)
    exporter = "train_llama3.py"
    truncation = "llm.c master train_llama3.py writes int(value)"
    float_fix = ("pass the true values with --ffn_dim_multiplier/--norm_eps/--rope_theta "
                 "(read_model(..., ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0) for LLaMA-3.1-8B), "
                 "or re-export the file with float32 bit patterns in slots 8, 10, 11")

    @property
    def head_dim(self) -> int:
        """Per-head feature count ``n_embd // n_head``."""
        return self.n_embd // self.n_head

    def ffn_hidden(self) -> int:
        """SwiGLU width H (`ffn_hidden`: ``int(m*int(8C/3))`` rounded up to ``multiple_of``).

        Example:
            >>> Llama3Header(16, 96, 2, 4, 2, 32, 1.0, 32, 1e-5, 1e4, True, 4).ffn_hidden()
            96
        """
        return ffn_hidden(self.n_embd, self.ffn_dim_multiplier, self.multiple_of)

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """`llmc_shapes` as `[(name, shape), ...]` in file order; c_attn rows are [q; k; v].

        Example:
            >>> [n for n, _ in Llama3Header(16, 96, 2, 4, 2, 32, 1.0, 32, 1e-5, 1e4, True, 4).tensor_shapes()][:3]
            ['wte', 'ln_1.w', 'attn.c_attn.w']
        """
        return list(llmc_shapes(self).items())

    def problem(self) -> str | None:
        if self.n_embd % self.n_head:
            return f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}"
        if self.n_head % self.n_kv_head:
            return f"n_head {self.n_head} is not divisible by n_kv_head {self.n_kv_head}"
        if self.head_dim % 2:
            return f"head_dim {self.head_dim} (n_embd / n_head) is odd, RoPE needs feature pairs"
        if self.ffn_hidden() <= 0:
            return f"FFN width {self.ffn_hidden()} (from ffn_dim_multiplier {self.ffn_dim_multiplier}) is not positive"
        return None


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
    """Parameters → {llm.c tensor name: float32 np.ndarray}, in the model file's order
    (`remat_lm.models.llmc_io.to_llmc`).

    Example:
      >>> tensors = to_llmc(cfg, params); tensors["mlp.c_fc2.w"].shape  # (L, H, C)
      (2, 96, 32)
    """
    return llmc_io.to_llmc(params, llmc_shapes(config))


def from_llmc(config: Llama3Config, tensors) -> dict:
    """{llm.c tensor name: array} → parameters for `config` (loop or scan layout).

    Example:
      >>> back = from_llmc(cfg, to_llmc(cfg, params))
      >>> bool(jnp.array_equal(back["lm_head"]["kernel"], params["lm_head"]["kernel"]))
      True
    """
    return llmc_io.from_llmc("LLaMA-3", llmc_shapes(config), tensors, config.scan_layers)


def activation_bytes(config: Llama3Config, batch: int, seq: int) -> tuple[LayerBytes, int]:
    """(bytes one layer keeps without remat, bytes kept outside the layer stack): the analytic
    memory model (remat_lm/models/memory_model.py, docs/memory-model.md).

    Example:
      >>> layer, head = activation_bytes(Llama3Config.preset("tiny"), batch=2, seq=8)
      >>> layer.tagged["mlp_up"], layer.constants  # s·b·H·4 bytes; RoPE cos/sin for q and k
      (6144, 512)
    """
    a = jnp.dtype(config.compute_dtype).itemsize
    s, b, h, nh, kv = seq, batch, config.n_embd, config.n_head, config.n_kv_head
    hd, H = config.head_dim, config.ffn_hidden
    sbh, sbH = s * b * h * a, s * b * H * a
    tagged = {names.BLOCK_INPUT: sbh, names.LN_1: sbh, names.QKV: (nh + 2 * kv) * hd * s * b * a,
              names.ATTN_CONTEXT: sbh, names.LN_2: sbh, names.MLP_UP: sbH, names.MLP_GATE: sbH, names.MLP_ACT: sbH}
    w = ((nh + 2 * kv) * hd * h + h * h + 3 * h * H) * a if a < F32 else 0  # bf16 weight casts
    # mid-layer residual + RMSNorm rstd for 2 norms + lse (+ weight casts); RoPE cos/sin for q and k
    untagged = sbh + 2 * s * b * F32 + lse_bytes(config, b, s) + w
    constants = 4 * s * (hd // 2) * F32
    # last output; final RMSNorm (rstd, normalized input); the token ids (as for GPT-2); the LM
    # head: float32 logits and in bf16 the head's weight cast, or chunked targets
    V = config.vocab_size
    head = 2 * sbh + s * b * F32 + s * b * 4 + lm_head_bytes(config, s * b, V, V * h * a if a < F32 else 0)
    # SwiGLU's internals (three (s, b, H) values), recomputed from mlp_gate and mlp_up
    return LayerBytes(tagged, untagged, constants, swaps={names.ATTN_OUT: sbh}, internals=3 * sbH), head


FAMILY = Family(
    name="llama3", title="LLaMA-3", config_cls=Llama3Config, presets=PRESETS, config=Llama3Config.preset,
    model_cls=Llama3, init_params=init_params, loss_fn=loss_fn, num_params=num_params,
    flops_per_token=flops_per_token, activation_bytes=activation_bytes, header_cls=Llama3Header,
    llmc_shapes=llmc_shapes, llmc_header=llmc_header, config_from_llmc=config_from_llmc, to_llmc=to_llmc,
    from_llmc=from_llmc, tokenizer_preset="1b")
