"""`bf16:<policy>` on both models in bf16: never more saved bytes than `<policy>`, only bf16 floats.

Parametrized over the registry (`remat.policies.examples()`: one concrete name per row and form),
so a new policy is checked by adding it, at T = 64 (one attention tile of the default 128) and
T = 256 (two tiles: the tiled core's loops then slice tiles out of q, k and v, which the wrapper
must recompute rather than keep; it once kept them and came out 48 KiB above `everything`). Saved
values come from `remat.memory.saved_residuals`.
"""
import collections
import functools

import jax
import jax.numpy as jnp
import pytest

import remat_lm.models.attention as attention
import remat_lm.models.gpt2 as gpt2
import remat_lm.models.llama3 as llama3
from remat import RecomputeConfig, memory, policies

MODELS = {"gpt2": (gpt2, gpt2.GPT2Config), "llama3": (llama3, llama3.Llama3Config)}
FLOATS = ("float16", "bfloat16", "float32", "float64")


TS = (64, 256)  # one tile (the (T, T) masks are already larger than a row), two tiles
assert [-(-T // attention.DEFAULT_TILE) for T in TS] == [1, 2]  # query tiles of the tiled core


@functools.lru_cache(maxsize=None)
def _saved(model, policy, T=64):
    mod, cls = MODELS[model]
    cfg = cls.preset("tiny", n_layer=1, dtype="bfloat16", block_size=T,
                     recompute=RecomputeConfig(granularity="full", policy=policy))
    params = mod.init_params(cfg, jax.random.PRNGKey(0))
    idx = jnp.zeros((2, T), jnp.int32)
    return memory.saved_residuals(lambda p: mod.loss_fn(p, cfg, idx, idx), params)


def _inside_regions(model, policy, T=64):
    """The saved rows a policy adds to `full` (which keeps only region inputs and what lies outside
    the regions: the head's float32 logits, the final norm's statistics)."""
    key = lambda r: (r.source, r.shape, r.dtype)
    base = collections.Counter(key(r) for r in _saved(model, "full", T).rows)
    out = []
    for r in _saved(model, policy, T).rows:
        if base[key(r)]:
            base[key(r)] -= 1
        else:
            out.append(r)
    return out


def _cases():
    # Every policy at one tile (T=64) and at two; at two tiles only `everything` (the case that
    # showed the extra slices and pads) stays in the fast set.
    fast_at_two = {"everything"}
    return [pytest.param(model, policy, T, marks=() if T == TS[0] or policy in fast_at_two else pytest.mark.slow)
            for model in MODELS for policy in policies.examples() for T in TS]


@pytest.mark.parametrize("model,policy,T", _cases())
def test_bf16_wrapper_never_keeps_more_and_keeps_only_bf16(model, policy, T):
    plain, wrapped = _saved(model, policy, T), _saved(model, f"bf16:{policy}", T)
    assert wrapped.total <= plain.total, (wrapped.table(), plain.table())
    wide = [(r.name, r.shape, r.dtype) for r in _inside_regions(model, f"bf16:{policy}", T)
            if r.dtype in FLOATS and r.dtype != "bfloat16" and r.bytes > 0]
    assert not wide, wide


@pytest.mark.parametrize("model", MODELS)
def test_the_assertions_can_fail(model):
    # `everything` itself keeps float32 values inside the regions (log-sum-exp, norm statistics),
    # and the attention's boolean causal mask (B, K, G·T, T) is what a wrapper that casts everything would add on top.
    assert any(r.dtype == "float32" for r in _inside_regions(model, "everything"))
    assert not any(r.dtype == "bool" for r in _inside_regions(model, "bf16:everything"))


@pytest.mark.parametrize("model", MODELS)
def test_two_tiles_with_padding_too(model):
    # T = 200: two tiles, the second padded (q, k, v are padded before the loops: `_pad_seq`).
    assert _saved(model, "bf16:everything", 200).total <= _saved(model, "everything", 200).total
