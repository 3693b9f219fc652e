"""The model-family registry: the one place that maps a family name to its code.

A `Family` names the module of one model ("gpt2" → `remat_lm.models.gpt2`, "llama3" → `remat_lm.models.llama3`)
and reaches everything through it: the config class and presets, the Linen model, `init_params`,
`loss_fn`, `num_params`, `flops_per_token`, and the llm.c side (the model file owns its tensor
table `llmc_shapes`, its header mapping `llmc_header` / `config_from_llmc`, and `to_llmc` /
`from_llmc`; `remat_lm.models.llmc_io` owns the byte layout, the header class and the magic numbers).
Code that must tell GPT-2 from LLaMA-3 asks `get(name)` or `of(config_or_header)`; nothing
else compares family names or config classes.

Example:
    >>> fam = get("gpt2")
    >>> cfg = fam.config("tiny")
    >>> fam.num_params(cfg), of(cfg).name, NAMES
    (35712, 'gpt2', ('gpt2', 'llama3'))
"""
from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

from remat_lm.models import llmc_io


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family, by name; its code is imported on first use (so `remat_lm.models.llmc_io` and the
    CLI's flag parsing can consult the registry without loading JAX).

    Example:
      >>> get("llama3").config("tiny").ffn_hidden
      96
    """
    name: str         # the --model value and the llm.c "kind"
    title: str        # for messages: "GPT-2"
    module_name: str  # the model file
    config_name: str
    model_name: str
    header_name: str  # the llm.c header class in remat_lm.models.llmc_io
    model_magic: int  # llm.c model file magic
    state_magic: int  # llm.c debug-state file magic

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(self.module_name)

    @property
    def config_cls(self) -> type:
        return getattr(self.module, self.config_name)

    @property
    def model_cls(self) -> type:
        return getattr(self.module, self.model_name)

    @property
    def header_cls(self) -> type:
        return getattr(llmc_io, self.header_name)

    @property
    def presets(self) -> dict:
        return self.module.PRESETS

    def config(self, preset: str, **overrides):
        """`preset` from the family's PRESETS with fields overridden."""
        return self.config_cls.preset(preset, **overrides)

    def model(self, config):
        """The Linen model (`GPT2(config)` / `Llama3(config)`)."""
        return self.model_cls(config)

    def init_params(self, config, key):
        return self.module.init_params(config, key)

    def loss_fn(self, params, config, idx, targets, dropout_key=None):
        return self.module.loss_fn(params, config, idx, targets, dropout_key)

    def num_params(self, config) -> int:
        return int(self.module.num_params(config))

    def flops_per_token(self, config, seq_len: int | None = None) -> float:
        return float(self.module.flops_per_token(config, seq_len))

    def llmc_shapes(self, config_or_header) -> dict:
        """{llm.c tensor name: shape} in file order: the model file's one table."""
        return self.module.llmc_shapes(config_or_header)

    def to_llmc(self, config, params) -> dict:
        return self.module.to_llmc(config, params)

    def from_llmc(self, config, tensors):
        return self.module.from_llmc(config, tensors)

    def llmc_header(self, config):
        """The llm.c header (`remat_lm.models.llmc_io`) describing `config`."""
        return self.module.llmc_header(config)

    def config_from_llmc(self, header, **fields):
        """A model config for an llm.c header; `fields` (recompute, dtype, ...) are added."""
        return self.module.config_from_llmc(header, **fields)


FAMILIES = {f.name: f for f in (
    Family("gpt2", "GPT-2", "remat_lm.models.gpt2", "GPT2Config", "GPT2", "GPT2Header",
           llmc_io.GPT2_MAGIC, llmc_io.GPT2_STATE_MAGIC),
    Family("llama3", "LLaMA-3", "remat_lm.models.llama3", "Llama3Config", "Llama3", "Llama3Header",
           llmc_io.LLAMA3_MAGIC, llmc_io.LLAMA3_MAGIC),
)}
NAMES = tuple(FAMILIES)


def get(name: str) -> Family:
    """The Family called `name`.

    Example:
      >>> get("gpt2").title
      'GPT-2'
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(NAMES)}")
    return FAMILIES[name]


def of(obj) -> Family:
    """The Family of a model config or an llm.c header (by its class, without importing models).

    Example:
      >>> of(llmc_io.GPT2Header(64, 256, 2, 4, 32, 256)).name
      'gpt2'
    """
    cls = type(obj)
    for f in FAMILIES.values():
        if (cls.__module__, cls.__name__) in ((f.module_name, f.config_name), (llmc_io.__name__, f.header_name)):
            return f
    raise TypeError(f"{cls.__name__} is not a model config or llm.c header of a known family ({', '.join(NAMES)})")
