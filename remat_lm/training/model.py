"""The model family of a run (`family(name)`, the registry `remat_lm.models.family`) and training's view
of a model config: `config_dict`, `init_params`, `decay_mask`.

# NOTE: layout-independent init. `remat.linen.LayerStack` draws one key per layer from the same
# stream in both layouts (h_i == h[i]), so every recompute and layout setting starts from the same
# weights (and the same first loss).

Example:
    >>> fam = family("gpt2")
    >>> mcfg = fam.config("tiny", recompute=RecomputeConfig(granularity="full"))
    >>> params = init_params(fam, mcfg, jax.random.PRNGKey(0))
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from remat_lm.models.family import Family, get


def family(name: str) -> Family:
    """The Family for `name` ("gpt2" or "llama3"): `remat_lm.models.family.get`."""
    return get(name)


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


def init_params(fam: Family, mcfg, key) -> Any:
    """Fresh float32 parameters for `mcfg`, identical for every recompute and layout setting.

    Example:
      >>> params = init_params(family("gpt2"), cfg, jax.random.PRNGKey(0))
    """
    return fam.init_params(mcfg, key)


def decay_mask(params) -> Any:
    """True for the leaves AdamW decays: weights and embeddings, not norms (`ln_*`) or biases (`b`)."""
    def keep(path, leaf):
        keys = [getattr(k, "key", getattr(k, "name", str(k))) for k in path]
        is_norm = any(str(k).startswith("ln") or "norm" in str(k) for k in keys)
        is_bias = str(keys[-1]) in ("b", "bias")
        return not (is_norm or is_bias)
    return jax.tree_util.tree_map_with_path(keep, params)
