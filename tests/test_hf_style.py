"""remat.linen.remat_module adopted the way Hugging Face's Flax models call their layers: keyword
Python bools (`deterministic=`, `init_cache=`, `output_attentions=`), `static_argnums` in
`flax.linen.partitioning.remat`'s numbering (BERT's `remat(FlaxBertLayer, static_argnums=(5, 6, 7))`),
a `gradient_checkpointing` flag; the calls stay as they are. Gradients against the model without
remat in float32 (max|Δg| ≤ 1e-5·max|g|), dropout on: the masks must be the same.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax.linen import partitioning as nn_partitioning

from remat import linen as rlinen

B, T, C, L = 2, 8, 16, 3
X = jax.random.normal(jax.random.key(1), (B, T, C))
MASK = jnp.ones((B, T))


class GPT2Block(nn.Module):  # the call convention of FlaxGPT2Block: keyword bools
    @nn.compact
    def __call__(self, hidden_states, attention_mask=None, deterministic: bool = True, init_cache: bool = False,
                 output_attentions: bool = False):
        h = nn.LayerNorm()(hidden_states)
        scores = jnp.einsum("btc,bsc->bts", nn.Dense(C)(h), nn.Dense(C)(h)) / C ** 0.5
        if attention_mask is not None:
            scores = jnp.where(attention_mask[:, None, :] > 0, scores, -1e9)
        probs = nn.Dropout(0.1)(jax.nn.softmax(scores), deterministic=deterministic)
        out = hidden_states + nn.Dense(C)(jnp.einsum("bts,bsc->btc", probs, h))
        out = out + nn.Dropout(0.1)(nn.Dense(C)(nn.gelu(nn.Dense(4 * C)(nn.LayerNorm()(out)))),
                                    deterministic=deterministic)
        return (out, probs) if output_attentions else (out,)


class GPT2Stack(nn.Module):  # FlaxGPT2BlockCollection, with the one swapped line marked
    gradient_checkpointing: bool = False
    remat: object = nn.remat

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        block = self.remat(GPT2Block) if self.gradient_checkpointing else GPT2Block  # the swapped line
        for i in range(L):
            x = block(name=str(i))(x, MASK, deterministic=deterministic, init_cache=False,
                                   output_attentions=False)[0]
        return x


class BertLayer(nn.Module):  # FlaxBertLayer's positional signature
    @nn.compact
    def __call__(self, hidden_states, attention_mask, layer_head_mask, encoder_hidden_states,
                 encoder_attention_mask, init_cache, deterministic, output_attentions):
        h = nn.Dense(C)(hidden_states)
        if layer_head_mask is not None:
            h = h * layer_head_mask
        h = nn.Dropout(0.1)(jnp.tanh(h), deterministic=deterministic)
        out = nn.LayerNorm()(hidden_states + nn.Dense(C)(h) * attention_mask[..., None])
        return (out, h) if output_attentions else (out,)


class BertEncoder(nn.Module):
    remat: object = None  # None: no remat; else called as BERT calls nn_partitioning.remat

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        layer = BertLayer if self.remat is None else self.remat(BertLayer, static_argnums=(5, 6, 7))
        for i in range(L):
            x = layer(name=str(i))(x, MASK, None, None, None, False, deterministic, False)[0]
        return x


def rel_err(a, b) -> float:
    """max|a - b| / max|b| over all the parameters (the project's gradient tolerance)."""
    diff = max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return diff / max(float(jnp.max(jnp.abs(v))) for v in jax.tree.leaves(b))


def _grads(module, *, deterministic=False):
    v = module.init(jax.random.key(0), X)
    loss = lambda p: jnp.mean(module.apply(p, X, deterministic=deterministic,  # noqa: E731
                                           rngs={"dropout": jax.random.key(2)}) ** 2)
    return jax.jit(jax.grad(loss))(v)


def test_keyword_bools_are_static_and_gradients_equal_the_model_without_remat():
    ref = _grads(GPT2Stack())
    with pytest.raises(jax.errors.TracerBoolConversionError):  # what nn.remat does with keyword bools
        _grads(GPT2Stack(gradient_checkpointing=True, remat=nn.remat))
    got = _grads(GPT2Stack(gradient_checkpointing=True, remat=lambda m: rlinen.remat_module(m, policy="full")))
    assert jax.tree.structure(got) == jax.tree.structure(ref)  # the same parameter paths
    assert rel_err(got, ref) <= 1e-5  # dropout on: the same masks, else the gradients would differ


def test_bert_numbering_through_partitioning_remat():
    ref = _grads(BertEncoder())
    flax = _grads(BertEncoder(remat=nn_partitioning.remat))
    ours = _grads(BertEncoder(remat=rlinen.partitioning_remat))  # HF's call, unchanged
    assert rel_err(flax, ref) <= 1e-5 and rel_err(ours, ref) <= 1e-5


def test_bert_numbering_in_remat_module_names_the_convention_and_the_fix():
    with pytest.raises(TypeError, match=r"static_argnums=\(5, 6, 7\) count `self`.*partitioning_remat or static_argnums=\(6, 7, 8\)"):
        _grads(BertEncoder(remat=rlinen.remat_module))


def test_static_argnames_for_a_keyword_that_is_not_a_bool():
    seen = []

    class Scaled(nn.Module):
        @nn.compact
        def __call__(self, x, *, power=1):
            seen.append(type(power))
            return nn.Dense(C)(x) ** power if power > 1 else nn.Dense(C)(x)

    for names, kind in (((), jax.core.Tracer), (("power",), int)):
        seen.clear()
        f = rlinen.remat_module(Scaled, static_argnames=names)
        v = f().init(jax.random.key(0), X, power=2) if names else None
        if names:
            assert jnp.allclose(f().apply(v, X, power=2), Scaled().apply(v, X, power=2))
            assert all(t is kind for t in seen)
        else:
            with pytest.raises(jax.errors.TracerBoolConversionError):
                f().init(jax.random.key(0), X, power=2)


def test_an_unhashable_static_keyword_is_named():
    class Takes(nn.Module):
        @nn.compact
        def __call__(self, x, *, opts=None):
            return nn.Dense(C)(x)

    f = rlinen.remat_module(Takes, static_argnames="opts")
    with pytest.raises(TypeError, match=r"remat_module: static keyword opts=\[1\] is not hashable"):
        f().init(jax.random.key(0), X, opts=[1])
