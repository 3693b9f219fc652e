"""Every docstring example in `remat/` and `models/` runs, and prints what it says it prints.

Each module's examples run with the module's globals (as `python -m doctest` would) plus the few
names below, the way NumPy's docs assume `np`: `jax`, `jnp`, `np`, and for the model modules a
tiny model (`cfg`, `params`, `idx`, `targets`) and arrays of matching shapes. The llm.c examples
read and write files in a fresh directory that holds a tiny `model.bin`, `state.bin`,
`tokens.bin` and `tokenizer.bin` (written here with the project's own writers). Examples that
would compile a real training step are prose (`Usage:`), not `>>>`. The whole-model modules run
with the slow set (see SLOW).
"""
from __future__ import annotations

import doctest
import functools
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat
import remat_lm.models

MODULES = sorted(
    [m.name for m in pkgutil.iter_modules(remat.__path__, "remat.")] + ["remat"]
    + [m.name for m in pkgutil.iter_modules(remat_lm.models.__path__, "remat_lm.models.")]
    + ["remat_lm.argtypes", "remat_lm.sample", "remat_lm.training.flags", "remat_lm.training.deepspeed"])
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
B, T = 2, 8
TOKENS = np.array([50256, 464, 3290, 287, 262, 995, 13, 50256], np.uint16)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A directory with tiny llm.c files: a GPT-2 model and its debug state, a shard, a tokenizer."""
    from remat_lm.models import llmc, llmc_io, tokenizer
    d = tmp_path_factory.mktemp("llmc")
    cfg, params = _tiny("gpt2")
    llmc.save(d / "model.bin", cfg, params)
    header = llmc.header_for(cfg)
    x = np.arange(B * T, dtype=np.int32).reshape(B, T) % cfg.vocab_size
    logits = np.zeros((B, T, cfg.vocab_size), np.float32)
    grads = {k: np.zeros(s, np.float32) for k, s in header.tensor_shapes()}
    llmc_io.write_state(d / "state.bin", "gpt2", header, x, x, logits, 5.5, grads)
    llmc_io.write_tokens(d / "tokens.bin", TOKENS)
    tokenizer.save(d / "tokenizer.bin", [bytes([i]) for i in range(256)] + [b"Hello", b", world"], eot_token=0)
    return d


@functools.lru_cache(maxsize=None)
def _tiny(model: str):
    """(config, parameters) of the family's tiny preset, made once per session from NumPy draws
    through the llm.c table (no JAX compilation: the examples' own cost is what is timed)."""
    from remat_lm.models import family
    fam = family.get(model)
    cfg = fam.config("tiny")
    rng = np.random.default_rng(0)
    tensors = {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in fam.llmc_shapes(cfg).items()}
    return cfg, fam.from_llmc(cfg, tensors)


def _model_namespace(module: str) -> dict:
    """The tiny model of the module's family (GPT-2 unless the module is LLaMA-3's)."""
    cfg, params = _tiny("llama3" if module == "remat_lm.models.llama3" else "gpt2")
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    idx = rng.integers(0, cfg.vocab_size, (B, T + 1), dtype=np.int32)
    return dict(cfg=cfg, params=params, idx=jnp.asarray(idx[:, :-1]), targets=jnp.asarray(idx[:, 1:]),
                prompt=jnp.asarray(idx[:1, :4]),
                x=normal(B, T, 32),  # (B, T, C) with C = 32, 4 heads of 8
                q=normal(B, T, 4 * 8), k=normal(B, T, 2 * 8), v=normal(B, T, 2 * 8),  # 4 query, 2 key/value heads
                wte=normal(256, 32) * 0.02)


# NOTE: each module's examples compile their own small programs (~1 s each on 2 cores). The three
# whole-model modules cost ~14 s CPU together and what they show (init, loss, gradients, decoding)
# is tested in depth by test_models.py / test_sample.py, so they run with the slow set
# (`make test-all`); the default set runs the rest in ~15 s.
SLOW = {"remat_lm.models.gpt2", "remat_lm.models.llama3", "remat_lm.models.sample", "remat_lm.sample",
        "remat_lm.models.attention"}  # attention: ~10 s (tested in depth by test_attention.py)


@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in MODULES])
def test_docstring_examples(name, files, monkeypatch):
    module = importlib.import_module(name)
    globs = dict(vars(module), jax=jax, jnp=jnp, np=np)
    if name.startswith("remat_lm.models."):
        globs.update(_model_namespace(name))
    monkeypatch.chdir(files)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    tests = [t for t in finder.find(module, name, globs=globs) if t.examples]
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
    if name in WITH_EXAMPLES:
        assert result.attempted > 0, f"{name} lost its examples"


# Modules whose public functions carry examples (names.py and check.py have none to run).
WITH_EXAMPLES = set(MODULES) - {"remat.names", "remat.check", "remat_lm.models.__init__"}
