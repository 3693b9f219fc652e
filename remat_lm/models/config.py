"""`ModelConfig`: the fields and checks every model family's config shares (GPT2Config, Llama3Config).

A family's config subclasses it with its own shape fields (GPT-2: `padded_vocab_size`; LLaMA-3:
`n_kv_head`, the SwiGLU width rule, RMSNorm and RoPE settings), its `PRESETS` and `_check_shape`
(the rules between its shape fields). Every config answers the same questions: `compute_dtype`,
`head_dim`, `n_kv_head` (GPT-2: one key/value head per query head), `ffn_hidden` (the MLP width),
so code outside the model files never asks which family a config belongs to.

# NOTE: field order. The shared shape fields come first and may be given by position; the
# training-time settings after them are keyword-only (`KW_ONLY`), so that a family's own fields,
# with or without defaults, can follow them.

Example:
    >>> from remat_lm.models.gpt2 import GPT2Config
    >>> cfg = GPT2Config.preset("tiny", dtype="bfloat16")
    >>> cfg.head_dim, cfg.n_kv_head, cfg.ffn_hidden, cfg.compute_dtype.__name__
    (8, 4, 128, 'bfloat16')
    >>> GPT2Config.preset("tiny", loss_chunk=-1)
    Traceback (most recent call last):
    ValueError: GPT2Config.loss_chunk=-1 must be an int >= 0 (0: no chunking)
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from remat.errors import is_int
from remat import RecomputeConfig
from remat_lm.models import parallel
from remat_lm.models.attention import ATTENTION, DEFAULT_TILE

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and training-time settings every family shares.

    Args:
      block_size: maximum sequence length T.
      vocab_size: V, the tokenizer's vocabulary.
      n_layer, n_head, n_embd: depth, query heads, width C.
      dropout: dropout on embeddings, attention probabilities and residual branches.
      dtype: compute dtype, "float32" or "bfloat16" (parameters stay float32).
      scan_layers: run the blocks under `lax.scan` (stacked parameters `blocks/h`).
      recompute: the activation-recompute settings (remat.RecomputeConfig).
      loss_chunk: 0, or N > 0 to compute the LM head and loss over chunks of N positions, each
        rematerialized, so the (B, T, V) logits never exist (`remat_lm.models.layers.lm_head`).
      attention: the attention core, auto | tiled | xla | cudnn | pallas (remat_lm/models/attention.py);
        attention_tile: the tiled core's query tile.
      sharding: a `remat_lm.models.parallel.ShardingConfig` for tensor/sequence parallelism, or None (no
        constraints; the model runs without a mesh). Set by the train step, not stored in checkpoints.
    """
    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    _: dataclasses.KW_ONLY
    dropout: float = 0.0
    dtype: str = "float32"
    scan_layers: bool = False
    recompute: RecomputeConfig = RecomputeConfig()
    loss_chunk: int = 0
    attention: str = "auto"
    attention_tile: int = DEFAULT_TILE
    sharding: parallel.ShardingConfig | None = None

    PRESETS: ClassVar[dict] = {}
    TITLE: ClassVar[str] = ""  # the family, for messages: "GPT-2"
    _POSITIVE: ClassVar[tuple[str, ...]] = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")

    def __post_init__(self):
        name = type(self).__name__
        if not is_int(self.loss_chunk) or self.loss_chunk < 0:
            raise ValueError(f"{name}.loss_chunk={self.loss_chunk!r} must be an int >= 0 (0: no chunking)")
        for f in self._POSITIVE:
            v = getattr(self, f)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name}.{f}={v!r} must be a positive int")
        self._check_shape()
        if self.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype={self.dtype!r} is not valid; use one of {', '.join(DTYPES)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{name}.dropout={self.dropout!r} must be in [0, 1)")
        if not isinstance(self.recompute, RecomputeConfig):
            raise ValueError(f"{name}.recompute={self.recompute!r} must be a remat.RecomputeConfig")
        if self.attention not in ATTENTION:
            raise ValueError(f"{name}.attention={self.attention!r} is not valid; use one of {', '.join(ATTENTION)}")
        if not is_int(self.attention_tile) or self.attention_tile < 1:
            raise ValueError(f"{name}.attention_tile={self.attention_tile!r} must be a positive int, e.g. {DEFAULT_TILE}")
        try:
            parallel.check(self.sharding)
        except ValueError as e:
            raise ValueError(f"{name}.{e}") from None
        self.recompute.validate_for(self.n_layer)

    def _check_shape(self) -> None:
        """The family's rules between its shape fields (after the positive-int checks); ValueError."""

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def logits_width(self) -> int:
        """Columns of the LM head's logits (the vocabulary, padded where the family pads it)."""
        return self.vocab_size

    @classmethod
    def preset(cls, name: str, **overrides):
        """A preset from the family's PRESETS with fields overridden, e.g. `preset("d12", n_layer=6)`."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown {cls.TITLE} preset {name!r}; valid: {', '.join(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})
