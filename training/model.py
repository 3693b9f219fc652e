"""The two model families behind one interface: config building, init, loss, FLOPs, llm.c I/O.

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
import importlib
from types import ModuleType
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family module (`models.gpt2` / `models.llama3`) and its config class."""
    name: str
    module: ModuleType
    config_cls: type

    def config(self, preset: str, **overrides):
        return self.config_cls.preset(preset, **overrides)

    def loss_fn(self, params, mcfg, idx, targets, dropout_key=None):
        return self.module.loss_fn(params, mcfg, idx, targets, dropout_key)

    def flops_per_token(self, mcfg, seq_len: int) -> float:
        return float(self.module.flops_per_token(mcfg, seq_len))

    def num_params(self, mcfg) -> int:
        return int(self.module.num_params(mcfg))

    def llmc_shapes(self, mcfg) -> dict:
        return self.module.llmc_shapes(mcfg)

    def from_llmc(self, mcfg, tensors):
        return self.module.from_llmc(mcfg, tensors)

    def to_llmc(self, mcfg, params):
        return self.module.to_llmc(mcfg, params)


_FAMILIES = {"gpt2": ("models.gpt2", "GPT2Config"), "llama3": ("models.llama3", "Llama3Config")}


def family(name: str) -> Family:
    """The Family for `name` ("gpt2" or "llama3")."""
    mod_name, cls_name = _FAMILIES[name]
    mod = importlib.import_module(mod_name)
    return Family(name, mod, getattr(mod, cls_name))


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
    return fam.module.init_params(mcfg, key)


def decay_mask(params) -> Any:
    """True for the leaves AdamW decays: weights and embeddings, not norms (`ln_*`) or biases (`b`)."""
    def keep(path, leaf):
        keys = [getattr(k, "key", getattr(k, "name", str(k))) for k in path]
        is_norm = any(str(k).startswith("ln") or "norm" in str(k) for k in keys)
        is_bias = str(keys[-1]) in ("b", "bias")
        return not (is_norm or is_bias)
    return jax.tree_util.tree_map_with_path(keep, params)
