"""Training's view of a model config and its parameters: `config_dict` (what a checkpoint stores)
and `decay_mask` (what AdamW decays). The model family itself is `remat_lm.models.family.get(name)`.

Example:
    >>> from remat_lm.models.gpt2 import GPT2Config
    >>> config_dict(GPT2Config.preset("tiny"))["n_layer"]
    2
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax


def config_dict(mcfg) -> dict:
    """A model config as JSON-able values (the recompute config, the loss chunking and the
    tensor-parallel sharding are left out: they do not change the parameters, so a checkpoint
    restores under any such setting)."""
    out = {}
    for f in dataclasses.fields(mcfg):
        if f.name in ("recompute", "loss_chunk", "sharding"):
            continue
        out[f.name] = getattr(mcfg, f.name)
    return out


def decay_mask(params) -> Any:
    """True for the leaves AdamW decays: weights and embeddings, not norms (`ln_*`) or biases (`b`)."""
    def keep(path, leaf):
        keys = [getattr(k, "key", getattr(k, "name", str(k))) for k in path]
        is_norm = any(str(k).startswith("ln") or "norm" in str(k) for k in keys)
        is_bias = str(keys[-1]) in ("b", "bias")
        return not (is_norm or is_bias)
    return jax.tree_util.tree_map_with_path(keep, params)
