"""Analytic activation memory of the GPT-2 and LLaMA-3 models (derivation: docs/memory-model.md).

Notation (Korthikanti et al.): s sequence length, b batch, h hidden size, a bytes per activation
in the compute dtype, f = 4 bytes (float32 statistics and logits). `remat.memory.predict_saved`
turns a layer's bytes into a stack's bytes under any recompute setting.

Example:
    >>> from remat_lm.models.gpt2 import GPT2Config
    >>> from remat import RecomputeConfig
    >>> from remat.memory import format_bytes, predict_saved
    >>> layer, head = activation_bytes(GPT2Config.preset("d12"), batch=8, seq=1024)
    >>> format_bytes(predict_saved(layer, 12, RecomputeConfig(), head))  # no remat
    '6.09 GiB'
    >>> format_bytes(predict_saved(layer, 12, RecomputeConfig(granularity="full"), head))
    '1.86 GiB'
"""
from __future__ import annotations

import jax.numpy as jnp

from remat_lm.models import family
from remat import names as N
from remat.memory import LayerBytes

F32 = 4


def activation_bytes(config, batch: int, seq: int) -> tuple[LayerBytes, int]:
    """(bytes one layer keeps without remat, bytes kept outside the layer stack)."""
    a = jnp.dtype(config.compute_dtype).itemsize
    s, b, h, nh = seq, batch, config.n_embd, config.n_head
    sbh = s * b * h * a
    lse = b * nh * s * F32  # the flash-style attention's log-sum-exp, per layer
    if family.of(config).name == "gpt2":
        tagged = {N.BLOCK_INPUT: sbh, N.LN_1: sbh, N.QKV: 3 * sbh, N.ATTN_CONTEXT: sbh, N.LN_2: sbh,
                  N.MLP_UP: 4 * sbh, N.MLP_ACT: 4 * sbh}
        # mid-layer residual (input of ln_2) + LayerNorm mean and rstd for 2 norms + lse, and in
        # bf16 the bf16 casts of the layer's 12h² matmul weights
        untagged = sbh + 2 * 2 * s * b * F32 + lse + (12 * h * h * a if a < F32 else 0)
        # last layer's output and ln_f (input, mean, rstd, output), the token ids (int32; counted only
        # when they are a closed-over constant, not an argument), and the LM head (`_lm_head`): float32
        # logits over the padded vocabulary and in bf16 the cast of the tied head, or chunked targets
        Vp = config.padded_vocab_size
        head = 2 * sbh + 2 * s * b * F32 + s * b * 4 + _lm_head(config, s * b, Vp * h * a if a < F32 else 0)
        return LayerBytes(tagged, untagged, swaps={N.ATTN_OUT: sbh}), head
    hd, H = config.head_dim, config.ffn_hidden
    sbH = s * b * H * a
    tagged = {N.BLOCK_INPUT: sbh, N.LN_1: sbh, N.QKV: (nh + 2 * config.n_kv_head) * hd * s * b * a,
              N.ATTN_CONTEXT: sbh, N.LN_2: sbh, N.MLP_UP: sbH, N.MLP_GATE: sbH, N.MLP_ACT: sbH}
    w = ((nh + 2 * config.n_kv_head) * hd * h + h * h + 3 * h * H) * a if a < F32 else 0  # bf16 weight casts
    # mid-layer residual + RMSNorm rstd for 2 norms + lse (+ weight casts); RoPE cos/sin for q and k
    untagged = sbh + 2 * s * b * F32 + lse + w
    constants = 4 * s * (hd // 2) * F32
    # last output; final RMSNorm (rstd, normalized input); the token ids (as for GPT-2); the LM
    # head (`_lm_head`): float32 logits and in bf16 the head's weight cast, or chunked targets
    head = 2 * sbh + s * b * F32 + s * b * 4 + _lm_head(config, s * b, config.vocab_size * h * a if a < F32 else 0)
    return LayerBytes(tagged, untagged, constants, swaps={N.ATTN_OUT: sbh}), head


def _lm_head(config, rows: int, weight_cast: int) -> int:
    """What the LM head and loss keep besides their input: the float32 logits (rows·V·f) and, in
    bf16, the head weight's cast; chunked (`loss_chunk` > 0), neither, only the targets regrouped
    into chunks (int32, one per row): each chunk's logits are recomputed in the backward."""
    if config.loss_chunk:
        return rows * 4
    V = getattr(config, "padded_vocab_size", config.vocab_size)
    return rows * V * F32 + weight_cast
