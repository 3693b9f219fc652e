"""Generation is token-identical to the recorded outputs of the pure-JAX decode it replaced.

tests/data/sample_golden.json holds, per case, the tokens `remat_lm.models.sample.generate` produced
at revision 1b29334 (before generation ran the Flax models' own decode path): GPT-2 (padded
vocabulary) and LLaMA-3 tiny models, loop and scan layouts, float32 and bfloat16, greedy and
sampled (temperature, top-k, seeds), prompts shorter and longer than block_size (16), and 30 new
tokens, so every case runs past the context (the window steps of the module NOTE).

The weights come from NumPy's seeded generator over the parameter tree's paths (not from the
models' initializers), so the fixture depends only on the parameter layout. They are scaled so the
logits are decisive (std ~1): a float-rounding change would not flip a token, a decode error would.

Regenerate (only on purpose, e.g. after a deliberate change of the numerics):
    PYTHONPATH=$PWD python tests/test_sample_golden.py --write
"""
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remat_lm.models import gpt2, llama3
from remat_lm.models.sample import generate

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sample_golden.json")
CONFIGS = {"gpt2": lambda: gpt2.GPT2Config.preset("tiny", block_size=16, vocab_size=250),
           "llama3": lambda: llama3.Llama3Config.preset("tiny", block_size=16)}
INIT = {"gpt2": gpt2.init_params, "llama3": llama3.init_params}

# (family, layout, dtype, prompt length, temperature, top_k, seed); each case is a batch of 2
# prompts and 30 new tokens. The first runs in the fast set (LLaMA-3 decoding is checked fast against
# the full forward by tests/test_sample.py), the rest are slow.
CASES = [
    ("gpt2", "scan", "bfloat16", 20, 1.0, 5, 1),
    ("llama3", "loop", "float32", 20, 0.8, None, 0),
    ("gpt2", "loop", "float32", 5, 0.0, None, 0),
    ("gpt2", "loop", "float32", 20, 0.8, None, 3),
    ("gpt2", "scan", "float32", 5, 1.0, 5, 2),
    ("gpt2", "loop", "bfloat16", 5, 0.0, None, 0),
    ("llama3", "loop", "float32", 5, 0.0, None, 0),
    ("llama3", "scan", "bfloat16", 5, 0.8, 5, 2),
    ("llama3", "scan", "float32", 20, 0.0, None, 0),
    ("llama3", "loop", "bfloat16", 20, 1.2, 20, 7),
]
N_NEW = 30


def _case_id(case) -> str:
    fam, layout, dtype, plen, temp, top_k, seed = case
    mode = "greedy" if temp == 0 else f"t{temp:g}" + (f"-k{top_k}" if top_k else "") + f"-s{seed}"
    return f"{fam}-{layout}-{dtype}-p{plen}-{mode}"


@functools.cache
def _loop_params(fam):
    """Seeded NumPy weights for the loop layout: norm scales 1 + N(0, 0.1²), biases N(0, 0.1²),
    embeddings N(0, 1/C), other matrices N(0, 4/fan_in) (weaker blocks let GPT-2's tied head repeat
    one token greedily), each leaf from its own seed (its index in the tree)."""
    cfg = CONFIGS[fam]()
    abstract = jax.eval_shape(lambda: INIT[fam](cfg, jax.random.PRNGKey(0)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for i, (path, leaf) in enumerate(leaves):
        kernel = path[-1].key == "kernel"  # drawn (out, in), as llm.c stores it, then transposed
        shape = leaf.shape[::-1] if kernel else leaf.shape
        z = np.random.default_rng(1000 + i).standard_normal(shape).astype(np.float32)
        if len(shape) == 1:
            z = (1.0 + 0.1 * z) if path[-1].key == "scale" else 0.1 * z
        else:
            z = z * ((1.0 if path[0].key in ("wte", "wpe") else 2.0) / np.sqrt(shape[-1]))
        out.append(jnp.asarray(z.T if kernel else z, jnp.float32))
    return jax.tree_util.tree_unflatten(treedef, out)


def _model(fam, layout, dtype):
    cfg, params = CONFIGS[fam](), _loop_params(fam)
    cfg = dataclasses.replace(cfg, dtype=dtype, scan_layers=layout == "scan")
    if layout == "scan":
        layers = [params["blocks"][f"h_{i}"] for i in range(cfg.n_layer)]
        params = {**params, "blocks": {"h": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}}
    return cfg, params


def _prompt(case, vocab):
    """(2, P) token ids, seeded by the case's index in CASES."""
    return np.random.default_rng(CASES.index(case)).integers(0, vocab, (2, case[3])).astype(np.int32)


def _generate(case):
    fam, layout, dtype, plen, temp, top_k, seed = case
    cfg, params = _model(fam, layout, dtype)
    return generate(params, cfg, _prompt(case, cfg.vocab_size), N_NEW, temperature=temp, top_k=top_k, seed=seed)


def _recorded():
    with open(FIXTURE) as f:
        return json.load(f)


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c), marks=[pytest.mark.slow] if i >= 1 else [])
                                  for i, c in enumerate(CASES)])
def test_generation_is_token_identical_to_the_recorded_outputs(case):
    want = _recorded()[_case_id(case)]
    got = _generate(case)
    assert got.shape == (2, case[3] + N_NEW)
    assert got.tolist() == want, f"{_case_id(case)}: generated {got.tolist()}, recorded {want}"


def test_the_fixture_covers_every_case_and_its_tokens_vary():
    """The recorded sequences are not degenerate: sampled cases differ from greedy ones, rows differ."""
    rec = _recorded()
    assert sorted(rec) == sorted(_case_id(c) for c in CASES)
    for case in CASES:
        rows = np.asarray(rec[_case_id(case)])
        assert rows.shape == (2, case[3] + N_NEW)
        assert len(np.unique(rows[:, case[3]:])) > 5, _case_id(case)  # not one repeated token


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: PYTHONPATH=$PWD python tests/test_sample_golden.py --write")
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    data = {_case_id(c): _generate(c).tolist() for c in CASES}
    with open(FIXTURE, "w") as f:
        f.write("{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items()) + "\n}\n")
    print(f"wrote {len(data)} cases to {FIXTURE}")
