"""The model-family interface (`Family`) and the registry: the one place that maps a family name
to its model file.

Each model file (`remat_lm.models.gpt2`, `remat_lm.models.llama3`) builds one `Family` from its own
parts and names it `FAMILY`: the config class (a `remat_lm.models.config.ModelConfig`) and presets,
the Linen model, `init_params` / `loss_fn`, `num_params` / `flops_per_token`, `activation_bytes`
(the analytic memory model), and the llm.c side: the header class that describes its file format
(`remat_lm.models.llmc_io.Header`: magics, header slots, tensor table) with `llmc_header` /
`config_from_llmc` and `to_llmc` / `from_llmc`. Callers call those parts directly (`fam.loss_fn(...)`);
nothing outside the model files and this registry compares family names or probes config
attributes (tests/test_family_interface.py checks it).

# NOTE: imports run one way. This module imports no model code (it stays free of JAX, so the CLI's
# flag parsing and `remat_lm.models.llmc_io` can consult it): `get` imports a model file by its
# name on first use, and the model files import this module for `Family`.

Example:
    >>> fam = get("gpt2")
    >>> cfg = fam.config("tiny")
    >>> fam.num_params(cfg), of(cfg).name, NAMES
    (35712, 'gpt2', ('gpt2', 'llama3'))
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any, Callable

# family name (the --model value and the llm.c "kind") → its model file
MODULES = {"gpt2": "remat_lm.models.gpt2", "llama3": "remat_lm.models.llama3"}
NAMES = tuple(MODULES)


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """What one model family provides; its model file builds one and calls it `FAMILY`.

    Fields:
      name: the --model value and llm.c kind ("gpt2"); title: for messages ("GPT-2").
      config_cls: the config class (`ModelConfig` subclass); presets: {name: config fields};
        config(preset, **overrides): `config_cls.preset`.
      model_cls: the Linen model; `model_cls(config).apply({"params": p}, idx, targets)` → (logits, loss).
      init_params(config, key): fresh float32 parameters.
      loss_fn(params, config, idx, targets, dropout_key=None): mean cross-entropy.
      num_params(config); flops_per_token(config, seq_len=None): training FLOPs per token.
      activation_bytes(config, batch, seq): (LayerBytes of one layer, bytes outside the stack),
        the analytic memory model (remat_lm/models/memory_model.py, docs/memory-model.md).
      header_cls: the llm.c header, which describes the file format (`remat_lm.models.llmc_io.Header`).
      llmc_shapes(config_or_header): {llm.c tensor name: shape} in file order.
      llmc_header(config); config_from_llmc(header, **fields): config ↔ header.
      to_llmc(config, params) → {name: float32 array}; from_llmc(config, tensors) → params.
      tokenizer_preset: the preset whose vocabulary is llm.c's tokenizer of the family's token
        shards (for messages about ids that do not fit a model).

    Example:
      >>> get("llama3").config("tiny").ffn_hidden
      96
    """
    name: str
    title: str
    config_cls: type
    presets: dict
    config: Callable[..., Any]
    model_cls: type
    init_params: Callable[..., Any]
    loss_fn: Callable[..., Any]
    num_params: Callable[[Any], int]
    flops_per_token: Callable[..., float]
    activation_bytes: Callable[..., Any]
    header_cls: type
    llmc_shapes: Callable[[Any], dict]
    llmc_header: Callable[[Any], Any]
    config_from_llmc: Callable[..., Any]
    to_llmc: Callable[[Any, Any], dict]
    from_llmc: Callable[[Any, Any], Any]
    tokenizer_preset: str


def get(name: str) -> Family:
    """The Family called `name` (its model file is imported on first use).

    Example:
      >>> get("gpt2").title
      'GPT-2'
    """
    if name not in MODULES:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(NAMES)}")
    return importlib.import_module(MODULES[name]).FAMILY


def families() -> tuple[Family, ...]:
    """Every registered Family, in NAMES order (imports every model file)."""
    return tuple(get(name) for name in NAMES)


def of(obj) -> Family:
    """The Family of a model config or an llm.c header.

    Example:
      >>> of(get("gpt2").header_cls(64, 256, 2, 4, 32, 256)).name
      'gpt2'
    """
    for module_name in MODULES.values():
        # an object of a family's class exists only once its model file is imported
        fam = getattr(sys.modules.get(module_name), "FAMILY", None)
        if fam is not None and isinstance(obj, (fam.config_cls, fam.header_cls)):
            return fam
    raise TypeError(f"{type(obj).__name__} is not a model config or llm.c header of a known family ({', '.join(NAMES)})")
