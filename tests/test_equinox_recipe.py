"""An Equinox model adopting remat: docs/library.md's "An Equinox model" recipe, run.

A small GPT written the usual Equinox way (`eqx.Module` blocks of `eqx.nn` layers, a list of
blocks, `eqx.filter_jit(eqx.filter_grad(loss))`); the adoption is the lines marked `# remat:` in
`GPT.__call__` (its `policy` / `recompute` arguments choose the setting here): each block's arrays
(`eqx.partition` / `eqx.combine`) through `remat.checkpoint`, or the blocks grouped into regions
by `remat.apply_layers` and a `RecomputeConfig`. Gradients equal the original's (float32,
max|dg| <= 1e-5 max|g|) and what the backward keeps falls. The block itself cannot be the
checkpointed function under `eqx.filter_grad`: JAX hashes the function, and an `eqx.Module`
hashes its fields, tracers included (test_block_itself_as_the_function_is_refused).
"""
import functools
import os
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

try:
    import equinox as eqx
except ImportError:  # the dev extra installs it; CI installs the dev extra, so there it is a failure
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("equinox is not installed: pip install -e '.[dev]'", allow_module_level=True)

import remat
from remat import RecomputeConfig, memory, policies
from tinyblocks import rel_err

VOCAB, WIDTH, HEADS, LAYERS, T, B = 64, 32, 4, 4, 16, 2


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(WIDTH), eqx.nn.LayerNorm(WIDTH)
        self.attn = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=k1)
        self.fc, self.out = eqx.nn.Linear(WIDTH, 4 * WIDTH, key=k2), eqx.nn.Linear(4 * WIDTH, WIDTH, key=k3)

    def __call__(self, x):  # x: (T, C)
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool)))
        h = checkpoint_name(jax.nn.gelu(jax.vmap(self.fc)(jax.vmap(self.ln2)(x))), "mlp_act")  # remat: tag
        return x + jax.vmap(self.out)(h)


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: list
    ln_f: eqx.nn.LayerNorm

    def __init__(self, key):
        k1, k2, *ks = jax.random.split(key, 2 + LAYERS)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=k1)
        self.pos = jax.random.normal(k2, (T, WIDTH)) * 0.1
        self.blocks = [Block(k) for k in ks]
        self.ln_f = eqx.nn.LayerNorm(WIDTH)

    # remat: `policy` (one region per block) or `recompute` (grouped); neither: the original
    def __call__(self, tokens, policy=None, recompute=None):  # tokens: (T,)
        x = jax.vmap(self.embed)(tokens) + self.pos[:tokens.shape[0]]
        if recompute is not None:  # remat: the blocks grouped into regions
            params, static = eqx.partition(self.blocks, eqx.is_array)
            x = remat.apply_layers(lambda p, h, _: eqx.combine(p, static[0])(h), params, x, recompute)
        for block in self.blocks if recompute is None else ():
            if policy is None:
                x = block(x)
            else:  # remat: one region per block, its arrays the region's inputs
                params, static = eqx.partition(block, eqx.is_array)
                x = remat.checkpoint(lambda p, x: eqx.combine(p, static)(x), policy=policy)(params, x)
        return jax.vmap(self.ln_f)(x) @ self.embed.weight.T


def loss(model, tokens, **setting):  # tokens: (B, T + 1)
    logits = jax.vmap(lambda t: model(t, **setting))(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))


SETTINGS = {"original": {},
            "block full": dict(policy="full"),
            "block save_names:mlp_act": dict(policy="save_names:mlp_act"),
            "grouped uniform 2": dict(recompute=RecomputeConfig(granularity="full", method="uniform", num_layers=2))}
TOKENS = jax.random.randint(jax.random.key(1), (B, T + 1), 0, VOCAB)


@functools.lru_cache(maxsize=None)
def run(setting: str):
    """The gradients of `loss` under `setting` and the bytes its backward keeps."""
    model = gpt()
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model, TOKENS, **SETTINGS[setting])
    params, static = eqx.partition(model, eqx.is_array)
    saved = memory.saved_residuals(lambda p, t: loss(eqx.combine(p, static), t, **SETTINGS[setting]), params, TOKENS)
    return grads, saved.total


@functools.lru_cache(maxsize=None)
def gpt():
    return GPT(jax.random.key(0))


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "original"])
def test_equinox_model_adopts_remat(setting):
    g0, saved0 = run("original")
    with warnings.catch_warnings():
        warnings.simplefilter("error", policies.UntaggedRegionWarning)  # mlp_act is tagged: no warning
        g, saved = run(setting)
    assert rel_err(g, g0) <= 1e-5
    assert saved < saved0 / 2, (saved, saved0)


def test_block_itself_as_the_function_is_refused():
    # why the recipe partitions: jax.checkpoint (and so remat.checkpoint) hashes the function it is
    # given, and an eqx.Module hashes its fields, here tracers
    block, x = gpt().blocks[0], jnp.ones((T, WIDTH))
    for ck in (jax.checkpoint, remat.checkpoint):
        with pytest.raises(TypeError, match="unhashable type"):
            eqx.filter_grad(lambda b: jnp.sum(ck(b)(x)))(block)
    static = eqx.partition(block, eqx.is_array)[1]
    grad = lambda f: eqx.filter_jit(eqx.filter_grad(f))(block)  # noqa: E731
    g = grad(lambda b: jnp.sum(remat.checkpoint(lambda p, x: eqx.combine(p, static)(x))(
        eqx.partition(b, eqx.is_array)[0], x)))
    assert rel_err(jax.tree.leaves(g), jax.tree.leaves(grad(lambda b: jnp.sum(b(x))))) <= 1e-5
