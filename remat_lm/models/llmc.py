"""llm.c `.bin` model and debug-state files for the Flax models, and the check against a reference state.

The byte layouts live in remat_lm/models/llmc_io.py; this module maps them to model configs and
parameters through the family registry (remat_lm/models/family.py). `verify` runs the model on a
debug state's batch and compares logits, loss and gradients; its command line is
`python -m remat_lm.llmc verify` (remat_lm/llmc.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from remat_lm.models import family
from remat_lm.models.llmc_io import LlmcFormatError, read_model, read_state, write_model
from remat import RecomputeConfig

# NOTE: tolerance. A float32 JAX port against a float32 (or float64-derived) reference differs by
# rounding only: ~1e-6 for loss and gradients of the small models checked here. 1e-4 absolute
# (the bound) leaves room for reduction-order differences in deep models while catching
# any real error (a wrong mask, scale or transpose moves values by 1e-2 or more).
ATOL = 1e-4


def header_for(config):
    """The llm.c header describing `config` (the model file's `llmc_header`)."""
    return family.of(config).llmc_header(config)


def format_markdown(presets: dict | None = None) -> str:
    """The llm.c file formats as Markdown tables, from the families' header classes (docs/llmc-format.md
    holds this text; tests/test_llmc_io.py checks it): per family the model-file header slots, the
    tensor order (with one preset's shapes), the debug-state header; then the token shards.

    `presets`: {family name: preset} whose shapes illustrate the tensors (default d12 and 8b).
    """
    from remat_lm.models import llmc_io

    presets = presets or {"gpt2": "d12", "llama3": "8b"}
    out = []
    for fam in family.families():
        h = fam.header_cls
        header = header_for(fam.config(presets[fam.name]))
        out += [f"### {h.title} model file", "",
                f"Magic {h.model_magic}; version {llmc_io.VERSION_FLOAT32} (every tensor float32) or "
                f"{llmc_io.VERSION_BFLOAT16} (every tensor bfloat16, raw 16-bit words)"
                + (f"; versions {', '.join(map(str, h.retired_versions))} are {h.retired} (refused)" if h.retired_versions else "")
                + ".", "", "| slot | field | stored as |", "|---|---|---|",
                "| 0 | magic | int32 |", "| 1 | version | int32 |"]
        slot = 2
        for f in dataclasses.fields(h):
            kind = ("float32 bit pattern" if f.name in h.float_ranges else "int32, 0 or 1" if f.name in h.flags
                    else "int32 >= 0" if f.name in h.counts else "int32 > 0")
            out.append(f"| {slot} | `{f.name}` | {kind} |")
            slot += 1
        for v in h.trailer:
            out.append(f"| {slot} | format version | int32 = {v} |")
            slot += 1
        pad = f" (`{h.padded[0]}` has `{h.padded[2]}` rows; those past `{h.padded[1]}` are zeros)" if h.padded else ""
        out += ["", f"Tensors, in this order{pad}; shapes for preset `{presets[fam.name]}`:", "",
                "| tensor | shape |", "|---|---|"]
        out += [f"| `{name}` | {tuple(shape)} |" for name, shape in header.tensor_shapes()]
        state = ["magic", *(["version"] if h.state_version is not None else []), "B", "T"]
        words = ", ".join(f"slot {i} {w}" for i, w in enumerate(state))
        magic = f"magic {h.state_magic}" + (f", version {h.state_version}" if h.state_version is not None else "")
        out += ["", f"Debug state file: {magic} ({words}); then x and y (B, T) int32, logits (B, T, "
                f"{' or '.join(map(str, ['V' if w == header.vocab_size else 'Vp' for w in header.logit_widths()]))}) "
                f"float32, the loss (one float32), and every parameter's gradient in float32, in the model "
                f"file's tensor order.", ""]
    out += ["### Token shards", "", "| model | magic | version | token |", "|---|---|---|---|"]
    for f in llmc_io.TOKEN_FORMATS.values():
        out.append(f"| {f.title} | {f.magic} | {f.version} | {np.dtype(f.dtype).name}, little-endian |")
    return "\n".join(out)


def config_for(kind: str, header, **fields):
    """A model config for an llm.c header; `fields` (recompute, dtype, scan_layers...) are added."""
    return family.get(kind).config_from_llmc(header, **fields)


def load(path, recompute: RecomputeConfig | None = None, *, scan_layers: bool = False, dtype: str = "float32",
         **overrides):
    """Read an llm.c model file (GPT-2 or LLaMA-3, float32 or bf16) into (config, params).

    Args:
      path: the `.bin` file.
      recompute: the runtime recompute settings (the file knows nothing of recompute).
      scan_layers, dtype: model options applied to the loaded config.
      overrides: values for the header's float slots, None for "as stored" (`read_model`): LLaMA-3's
        norm_eps, rope_theta, ffn_dim_multiplier, which llm.c master writes as truncated integers.
    Raises:
      LlmcFormatError (a ValueError) naming the file and the problem (a non-regular file, a bad header,
      a wrong size, NaN/inf weights); never returns a partial model.
    Example:
      >>> config, params = load("model.bin", RecomputeConfig(granularity="full"))  # e.g. gpt2_124M.bin
      >>> type(config).__name__, config.n_layer, config.recompute.granularity
      ('GPT2Config', 2, 'full')
    """
    kind, header, tensors, _ = read_model(path, **overrides)
    check_finite(path, tensors)
    config = config_for(kind, header, recompute=recompute or RecomputeConfig(), scan_layers=scan_layers, dtype=dtype)
    return config, family.get(kind).from_llmc(config, tensors)


def check_finite(path, tensors: dict) -> None:
    """Raise LlmcFormatError naming the file and the first tensor (in file order) holding NaN or inf.

    Example:
      >>> check_finite("model.bin", read_model("model.bin")[2])
    """
    for name, arr in tensors.items():
        bad = ~np.isfinite(arr)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise LlmcFormatError(f"{path}: tensor {name} holds {int(bad.sum())} non-finite values (the first, "
                                  f"{arr[idx]} at index {list(idx)}); the weights are corrupt or diverged, pass a "
                                  f"model file with finite weights")


def save(path, config, params, dtype: str = "float32") -> None:
    """Write `params` as an llm.c model file (version 3 float32 or 5 bfloat16), atomically.

    Example:
      >>> config, params = load("model.bin")
      >>> save("out.bin", config, params, dtype="bfloat16")
      >>> read_model("out.bin")[3]
      'bfloat16'
    """
    fam = family.of(config)
    write_model(path, fam.name, fam.llmc_header(config), fam.to_llmc(config, params), dtype=dtype)


def load_state(path, config) -> dict:
    """Read an llm.c debug state file for `config`: x, y, logits, loss, grads (llm.c names)."""
    fam = family.of(config)
    return read_state(path, fam.name, fam.llmc_header(config))


@dataclasses.dataclass(frozen=True)
class Row:
    tensor: str
    max_abs_diff: float
    max_abs_ref: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= ATOL


def verify(config, params, state) -> list[Row]:
    """Run the model on the state's batch; compare logits, loss and every gradient with the state's."""
    fam = family.of(config)
    x, y = jnp.asarray(state["x"]), jnp.asarray(state["y"])
    model = fam.model_cls(config)

    # NOTE: logits come from a call without targets: with `loss_chunk` the loss never builds them.
    @jax.jit
    def run(params):
        loss, grads = jax.value_and_grad(lambda p: model.apply({"params": p}, x, y)[1])(params)
        return loss, model.apply({"params": params}, x)[0], grads

    loss, logits, grads = run(params)
    ref_logits = np.asarray(state["logits"])
    width = min(ref_logits.shape[-1], config.vocab_size)
    rows = [Row("logits", float(np.max(np.abs(np.asarray(logits)[..., :width] - ref_logits[..., :width]))),
                float(np.max(np.abs(ref_logits[..., :width])))),
            Row("loss", abs(float(loss) - float(state["loss"])), abs(float(state["loss"])))]
    ours = fam.to_llmc(config, grads)
    for name, ref in state["grads"].items():
        ref = np.asarray(ref)
        got = ours[name][: ref.shape[0]] if name == "wte" else ours[name]
        rows.append(Row(name, float(np.max(np.abs(got - ref))), float(np.max(np.abs(ref)))))
    return rows
