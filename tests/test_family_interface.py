"""The model-family interface (remat_lm/models/family.py): every family provides the same parts, and
nothing outside the model files and the registry tells the families apart.

The scan reads the package sources with `ast` (no imports, well under a second): a comparison
(==, !=, in, not in, is) with a family's name, config or header class name or title, a `match`
case on one, `isinstance`/`issubclass` against a family's own class, and attribute probes that
tell families apart (`hasattr(cfg, ...)`, `getattr(cfg, "...", default)`, or either with a
family-specific attribute such as "n_kv_head" or "padded_vocab_size").
"""
from __future__ import annotations

import ast
import dataclasses
import os

import pytest

from remat_lm.models import family, llmc_io
from remat_lm.models.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("remat", "remat_lm", "train.py")
# The model files and the registry: the places that may name a family.
ALLOWED = {"remat_lm/models/gpt2.py", "remat_lm/models/llama3.py", "remat_lm/models/family.py"}
# A file that still switches on the family while its fix is under way can be listed here; the test
# fails once it is clean, so the list cannot go stale.
PENDING: set = set()  # files still to clean; empty: none

FAMILIES = family.families()
CONFIG_NAMES = {"cfg", "config", "mcfg", "model_config", "base", "header", "shaped"}


def _attrs(cls) -> set[str]:
    """Public attributes and fields (a field without a default is no class attribute)."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return {a for a in dir(cls) if not a.startswith("_")} | fields | set(getattr(cls, "__annotations__", {}))


# Attributes some family's config or header has beyond what every config / header has.
SPECIFIC = (set().union(*(_attrs(f.config_cls) | _attrs(f.header_cls) for f in FAMILIES))
            - _attrs(ModelConfig) - _attrs(llmc_io.Header))
WORDS = set(family.NAMES) | {w for f in FAMILIES for w in
                             (f.title, f.config_cls.__name__, f.header_cls.__name__, f.model_cls.__name__)}
CLASSES = {c.__name__ for f in FAMILIES for c in (f.config_cls, f.header_cls, f.model_cls)}


def _sources():
    for top in SCANNED:
        path = os.path.join(ROOT, top)
        if path.endswith(".py"):
            yield top
            continue
        for dirpath, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, name), ROOT).replace(os.sep, "/")


def _names_a_family(node) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in WORDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_family(e) for e in node.elts)
    return False


def _is_config(node) -> bool:
    return ((isinstance(node, ast.Name) and node.id in CONFIG_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr in CONFIG_NAMES))


def _class_names(node) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def switches(source: str) -> list[str]:
    """`line: what` for every family switch or attribute probe in `source`.

    Example:
      >>> switches('if family.of(config).name == "gpt2": pass\\nk = getattr(cfg, "n_kv_head", 1)')
      ['1: compares with a family name', '2: probes a config attribute']
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_names_a_family(x) for x in [node.left, *node.comparators]):
            found.append((node.lineno, "compares with a family name"))
        elif isinstance(node, ast.match_case) and _names_a_family(getattr(node.pattern, "value", None)):
            found.append((node.pattern.lineno, "matches a family name"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            fn, args = node.func.id, node.args
            if fn in ("isinstance", "issubclass") and len(args) == 2 and _class_names(args[1]) & CLASSES:
                found.append((node.lineno, f"{fn} against a family's class"))
            elif fn == "hasattr" and len(args) == 2 or fn == "getattr" and len(args) == 3:
                attr = args[1].value if isinstance(args[1], ast.Constant) else None
                if _is_config(args[0]) and (fn == "hasattr" or attr is not None) or attr in SPECIFIC:
                    found.append((node.lineno, "probes a config attribute"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_no_family_switch_outside_the_model_files_and_the_registry():
    found, pending_clean = {}, []
    for rel in _sources():
        if rel in ALLOWED:
            continue
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            hits = switches(f.read())
        if rel in PENDING:
            if not hits:
                pending_clean.append(rel)
        elif hits:
            found[rel] = hits
    assert not found, ("family switches outside the model files and remat_lm/models/family.py (ask the family "
                       f"interface instead): {found}")
    assert not pending_clean, f"{pending_clean} do not switch on the family: remove them from PENDING"


@pytest.mark.parametrize("src, n", [
    ('kind == "llama3"', 1), ('"gpt2" != fam.name', 1), ('name in ("gpt2", "x")', 1),
    ('isinstance(h, GPT2Header)', 1), ('hasattr(cfg, "anything")', 1), ('getattr(x, "rope_theta", 0)', 1),
    ('getattr(mcfg, "n_kv_head", 4)', 1), ('match k:\n    case "llama3": pass', 1),
    # not switches: a name as data, a dynamic or two-argument getattr, a shared attribute
    ('TOKEN = {"gpt2": 1}', 0), ('getattr(cfg, k)', 0), ('getattr(cfg, "n_layer")', 0),
    ('hasattr(a, "dtype")', 0), ('x == "gpt"', 0),
])
def test_the_scan_sees_switches(src, n):
    assert len(switches(src)) == n, switches(src)


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_every_family_provides_the_interface(fam):
    assert isinstance(fam, family.Family) and family.get(fam.name) is fam
    for f in dataclasses.fields(family.Family):
        assert getattr(fam, f.name) is not None, f.name
    cfg = fam.config("tiny")
    assert isinstance(cfg, ModelConfig) and type(cfg) is fam.config_cls and set(fam.presets) == set(cfg.PRESETS)
    assert fam.tokenizer_preset in fam.presets
    # the questions every config answers, whatever the family
    assert cfg.head_dim * cfg.n_head == cfg.n_embd and cfg.n_head % cfg.n_kv_head == 0 and cfg.ffn_hidden > 0
    # the llm.c format: the header names the family, maps back to the config and carries the tensor table
    header = fam.llmc_header(cfg)
    assert isinstance(header, fam.header_cls) and issubclass(fam.header_cls, llmc_io.Header)
    assert (header.kind, header.title) == (fam.name, fam.title) and family.of(header) is family.of(cfg) is fam
    assert fam.config_from_llmc(header) == cfg
    assert header.tensor_shapes() == list(fam.llmc_shapes(cfg).items())
    assert header.n_params() == fam.num_params(cfg)
    assert header.problem() is None and llmc_io._header_problem(header) is None
    layer, head = fam.activation_bytes(cfg, 2, 8)
    assert layer.total > 0 and head > 0


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_the_configs_share_their_fields_and_checks(fam):
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    assert shared <= {f.name for f in dataclasses.fields(fam.config_cls)}
    name = fam.config_cls.__name__
    with pytest.raises(ValueError, match=rf"^{name}\.dropout=1\.5 must be in \[0, 1\)$"):
        fam.config("tiny", dropout=1.5)
    with pytest.raises(ValueError, match=rf"^{name}\.n_layer=0 must be a positive int$"):
        fam.config("tiny", n_layer=0)
    with pytest.raises(ValueError, match=rf"unknown {fam.title} preset 'nope'"):
        fam.config("nope")
