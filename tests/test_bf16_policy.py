"""`bf16:<policy>` on both models in bf16: never more saved bytes than `<policy>`, only bf16 floats.

Parametrized over the registry (`remat.policies.examples()`: one concrete name per row and form),
so a new policy is checked by adding it. Saved values come from `remat.memory.saved_residuals`.
"""
import collections
import functools

import jax
import jax.numpy as jnp
import pytest

import models.gpt2 as gpt2
import models.llama3 as llama3
from remat import RecomputeConfig, memory, policies

MODELS = {"gpt2": (gpt2, gpt2.GPT2Config), "llama3": (llama3, llama3.Llama3Config)}
FLOATS = ("float16", "bfloat16", "float32", "float64")


@functools.lru_cache(maxsize=None)
def _saved(model, policy):
    mod, cls = MODELS[model]
    cfg = cls.preset("tiny", n_layer=1, dtype="bfloat16", recompute=RecomputeConfig(granularity="full", policy=policy))
    params = mod.init_params(cfg, jax.random.PRNGKey(0))
    idx = jnp.zeros((2, cfg.block_size), jnp.int32)  # T = 64: the (T, T) masks are already larger than a row
    return memory.saved_residuals(lambda p: mod.loss_fn(p, cfg, idx, idx), params)


def _inside_regions(model, policy):
    """The saved rows a policy adds to `full` (which keeps only region inputs and what lies outside
    the regions: the head's float32 logits, the final norm's statistics)."""
    key = lambda r: (r.source, r.shape, r.dtype)
    base = collections.Counter(key(r) for r in _saved(model, "full").rows)
    out = []
    for r in _saved(model, policy).rows:
        if base[key(r)]:
            base[key(r)] -= 1
        else:
            out.append(r)
    return out


@pytest.mark.parametrize("policy", policies.examples())
@pytest.mark.parametrize("model", MODELS)
def test_bf16_wrapper_never_keeps_more_and_keeps_only_bf16(model, policy):
    plain, wrapped = _saved(model, policy), _saved(model, f"bf16:{policy}")
    assert wrapped.total <= plain.total, (wrapped.table(), plain.table())
    wide = [(r.name, r.shape, r.dtype) for r in _inside_regions(model, f"bf16:{policy}")
            if r.dtype in FLOATS and r.dtype != "bfloat16" and r.bytes > 0]
    assert not wide, wide


@pytest.mark.parametrize("model", MODELS)
def test_the_assertions_can_fail(model):
    # `everything` itself keeps float32 values inside the regions (log-sum-exp, norm statistics),
    # and the attention's boolean causal mask (B, K, G·T, T) is what the old wrapper added on top.
    assert any(r.dtype == "float32" for r in _inside_regions(model, "everything"))
    assert not any(r.dtype == "bool" for r in _inside_regions(model, "bf16:everything"))
