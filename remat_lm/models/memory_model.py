"""Analytic activation memory of the model families (derivation: docs/memory-model.md).

Each model file owns its per-layer table (`remat_lm.models.gpt2.activation_bytes`,
`remat_lm.models.llama3.activation_bytes`, reached through its `Family`); this module holds what
they share and `activation_bytes`, which asks the config's family.

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

from remat.memory import LayerBytes
from remat_lm.models import family

F32 = 4


def activation_bytes(config, batch: int, seq: int) -> tuple[LayerBytes, int]:
    """(bytes one layer keeps without remat, bytes kept outside the layer stack), by the config's family."""
    return family.of(config).activation_bytes(config, batch, seq)


def lse_bytes(config, batch: int, seq: int) -> int:
    """The flash-style attention's float32 log-sum-exp of one layer (b·heads·s·f)."""
    return batch * config.n_head * seq * F32


def lm_head_bytes(config, rows: int, vocab: int, weight_cast: int) -> int:
    """What the LM head and loss keep besides their input: the float32 logits (rows·vocab·f, `vocab`
    the logits' width) and, in bf16, the head weight's cast; chunked (`loss_chunk` > 0), neither,
    only the targets regrouped into chunks (int32, one per row): each chunk's logits are
    recomputed in the backward. Unchunked, the loss also keeps per row its log-sum-exp (float32)."""
    if config.loss_chunk:
        return rows * 4
    return rows * vocab * F32 + weight_cast + rows * F32
