"""The three outside-style models in examples/ (Flax Linen lm1b-style, Flax NNX Gemma-style, plain-JAX
GPT), each adopting remat in a few lines: gradients equal the original's (float32, max|dg| <= 1e-5
max|g|), the library's setting saves what the plain JAX/Flax remat of the same setting saves (fewer
bytes than the original) and compiles to the plain remat's temp on XLA:GPU (h200; below the
original's) and on XLA:CPU, and decoding/sampling gives the original's tokens.
"""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from examples import jax_gpt, linen_lm, nnx_gemma
from targethelp import need
from tinyblocks import rel_err

CASES = {  # example: (original, plain framework remat, the library's setting)
    "linen_lm": (linen_lm, "original", "nn.remat", "remat_module"),
    "nnx_gemma": (nnx_gemma, "original", "nnx.remat", "LayerStack"),
    "jax_gpt": (jax_gpt, "original", "jax.checkpoint", "remat.checkpoint"),
}


# tests/test_linen_remat.py, tests/test_nnx_remat.py and tests/test_checkpoint_conformance.py keep remat_module,
# remat.nnx and remat.checkpoint against the originals fast.
@pytest.mark.slow  # ~20-50 s each; tests/test_outside_models.py keeps outside-style models fast
@pytest.mark.parametrize("name", list(CASES))
def test_example_adopts_remat(name):
    need("cuda")
    mod, orig, plain, lib = CASES[name]
    res = mod.measure(labels=(orig, plain, lib))
    (g0, saved0, gpu0, cpu0), (_, saved_p, gpu_p, cpu_p), (g, saved, gpu, cpu) = res[orig], res[plain], res[lib]
    assert rel_err(g, g0) <= 1e-5
    assert saved == saved_p < saved0
    assert gpu == gpu_p < gpu0, (gpu, gpu_p, gpu0)
    assert cpu == cpu_p, (cpu, cpu_p)  # the plain remat's program


@pytest.mark.slow  # ~40 s; the stacks' decode caches stay fast in tests/test_linen_remat.py
def test_linen_decode_with_remat_matches_the_original():
    cfg = linen_lm.Config()
    params = linen_lm.init(cfg, jax.random.key(0))
    prompt = jnp.array([[1, 2, 3], [4, 5, 6]])
    ref = linen_lm.generate(params, cfg, prompt, 3)
    out = linen_lm.generate(params, linen_lm.Config(remat=linen_lm.SETTINGS["remat_module"]), prompt, 3)
    assert (out == ref).all()
    full = linen_lm.Decoder(cfg).apply({"params": params}, ref[:, :-1])  # the cache agrees with a full pass
    assert (jnp.argmax(full[:, 2:], -1) == ref[:, 3:]).all()


@pytest.mark.slow  # ~6 s; test_linen_decode_with_remat_matches_the_original keeps decoding fast
def test_nnx_and_jax_sampling_with_remat_match_the_original():
    prompt = jnp.array([[1, 2, 3]])
    make = lambda r: nnx_gemma.Transformer(nnx_gemma.Config(remat=r), nnx.Rngs(0))  # noqa: E731
    assert (nnx_gemma.sample(make(nnx_gemma.SETTINGS["LayerStack"]), prompt, 3)
            == nnx_gemma.sample(make(None), prompt, 3)).all()
    params = jax_gpt.init(jax.random.key(0))
    assert jax_gpt.sample(params, prompt, 3).shape == (1, 6)
