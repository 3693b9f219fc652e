"""Per-layer side outputs (`side=`) of remat.linen.LayerStack and remat.nnx.LayerStack.

Layers return `(x, attention probabilities)`, as a Hugging Face layer asked for
`output_attentions` does; the stacks return `(x, probs)` with the probabilities stacked along a
leading layer axis. Compared with a plain loop of the same layers without remat: the side outputs
(which leave the checkpointed regions as outputs) and the gradients of a loss reading them.
"""
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from remat import RecomputeConfig
from remat import linen as rlinen
from remat import nnx as rnnx

L, T, C = 4, 6, 8
X = jax.random.normal(jax.random.key(0), (2, T, C))
CFGS = [RecomputeConfig(), RecomputeConfig(granularity="full"),
        RecomputeConfig(granularity="full", method="uniform", num_layers=2)]
IDS = ["none", "full", "uniform2"]
C_SIDE = jax.random.normal(jax.random.key(1), (L, 2, T, T))  # weights the loss gives the side outputs


def loss(y, probs):
    return jnp.mean(jnp.sin(y) * y) + jnp.sum(probs * C_SIDE)


def close(got, ref, rel):
    got, ref = jax.tree.leaves(got), jax.tree.leaves(ref)
    assert len(got) == len(ref) > 0
    scale = max(float(jnp.max(jnp.abs(r))) for r in ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        assert float(jnp.max(jnp.abs(g - r))) <= rel * scale


def attention(q, k, v):
    probs = jax.nn.softmax(q @ k.swapaxes(-1, -2) / math.sqrt(C))
    return probs @ v, probs


class LinenAttn(nn.Module):
    @nn.compact
    def __call__(self, x):
        a, probs = attention(nn.Dense(C)(x), nn.Dense(C)(x), nn.Dense(C)(x))
        return x + jnp.tanh(a), probs


class NNXAttn(nnx.Module):
    def __init__(self, rngs):
        self.q, self.k, self.v = (nnx.Linear(C, C, rngs=rngs) for _ in range(3))

    def __call__(self, x):
        a, probs = attention(self.q(x), self.k(x), self.v(x))
        return x + jnp.tanh(a), probs


def pick(y):
    return y[0]


def probs_of(y):
    return y[1]


# Linen ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("cfg", CFGS, ids=IDS)
def test_linen_side_outputs_equal_a_plain_loop(cfg, scan):
    stack = rlinen.LayerStack(LinenAttn, L, cfg, scan=scan, out=pick, side=probs_of)
    params = stack.init(jax.random.key(2), X)["params"]
    per_layer = [jax.tree.map(lambda a, i=i: a[i], params["h"]) for i in range(L)] if scan else \
        [params[f"h_{i}"] for i in range(L)]

    def plain(per_layer):
        h, probs = X, []
        for p in per_layer:
            h, pr = LinenAttn().apply({"params": p}, h)
            probs.append(pr)
        return h, jnp.stack(probs)

    y, probs = stack.apply({"params": params}, X)
    ref_y, ref_probs = plain(per_layer)
    assert probs.shape == (L, 2, T, T)
    close(probs, ref_probs, 1e-6)
    close(y, ref_y, 1e-6)
    g = jax.grad(lambda p: loss(*stack.apply({"params": p}, X)))(params)
    ref_g = jax.grad(lambda ps: loss(*plain(ps)))(per_layer)
    g = [jax.tree.map(lambda a, i=i: a[i], g["h"]) for i in range(L)] if scan else [g[f"h_{i}"] for i in range(L)]
    close(g, ref_g, 1e-5)


def test_linen_init_returns_the_side_outputs_and_hidden_states_need_no_out():
    stack = rlinen.LayerStack(LinenAttn, L, RecomputeConfig(granularity="full"), out=pick, side=probs_of)
    (y, probs), variables = stack.init_with_output(jax.random.key(2), X)
    assert y.shape == X.shape and probs.shape == (L, 2, T, T)

    class Plain(nn.Module):  # returns x only: side= sees each layer's x
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(C)(x)
    hidden = rlinen.LayerStack(Plain, L, RecomputeConfig(granularity="full"), side=lambda x: x)
    v = hidden.init(jax.random.key(3), X)
    y, hs = hidden.apply(v, X)
    np.testing.assert_array_equal(hs[-1], y)
    np.testing.assert_allclose(hs[0], Plain().apply({"params": v["params"]["h_0"]}, X), rtol=1e-6, atol=1e-6)


def test_linen_side_misuse_is_named():
    with pytest.raises(TypeError, match=r"remat.linen.LayerStack: side= must be a function"):
        rlinen.LayerStack(LinenAttn, L, side=1)

    class OnlyX(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(C)(x)
    with pytest.raises(ValueError, match=r"remat.linen.LayerStack: side= and out= were given, but layer 0 "
                                         r"\(OnlyX.*returns only x"):
        rlinen.LayerStack(OnlyX, L, out=pick, side=probs_of).init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"with side=, out= picks x"):  # (x, probs) but no out=
        rlinen.LayerStack(LinenAttn, L, side=probs_of).init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"side= must return arrays"):
        rlinen.LayerStack(LinenAttn, L, out=pick, side=lambda y: None).init(jax.random.key(0), X)


# NNX --------------------------------------------------------------------------------------------

def nnx_layers():
    return [NNXAttn(nnx.Rngs(i)) for i in range(L)]


def nnx_plain(layers, x):
    h, probs = x, []
    for layer in layers:
        h, pr = layer(h)
        probs.append(pr)
    return h, jnp.stack(probs)


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("cfg", CFGS, ids=IDS)
def test_nnx_side_outputs_equal_a_plain_loop(cfg, scan):
    stack = rnnx.LayerStack(nnx_layers(), cfg, scan=scan, out=pick, side=probs_of)
    plain = nnx.List(nnx_layers())
    y, probs = stack(X)
    ref_y, ref_probs = nnx_plain(plain, X)
    assert probs.shape == (L, 2, T, T)
    close(probs, ref_probs, 1e-6)
    close(y, ref_y, 1e-6)
    g = nnx.grad(lambda s: loss(*s(X)))(stack)["layers"]
    ref_g = nnx.grad(lambda ls: loss(*nnx_plain(ls, X)))(plain)
    ref_g = [ref_g[i] for i in range(L)]
    g = [jax.tree.map(lambda a, i=i: a[i], g) for i in range(L)] if scan else [g[i] for i in range(L)]
    close(g, ref_g, 1e-5)


def test_nnx_side_outputs_with_the_stacks_randomness_and_jit():
    class Drop(nnx.Module):
        def __init__(self, rngs):
            self.lin, self.drop = nnx.Linear(C, C, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return x + self.drop(self.lin(x))
    layers = lambda: [Drop(nnx.Rngs(i)) for i in range(L)]  # noqa: E731
    stack = rnnx.LayerStack(layers(), RecomputeConfig(granularity="full"), side=lambda x: x)
    ref = rnnx.LayerStack(layers(), RecomputeConfig())
    y, hs = nnx.jit(lambda s, k: s(X, key=k))(stack, jax.random.key(4))
    np.testing.assert_array_equal(hs[-1], y)
    np.testing.assert_allclose(y, ref(X, key=jax.random.key(4)), rtol=1e-6, atol=1e-6)


def test_nnx_side_misuse_is_named():
    with pytest.raises(TypeError, match=r"remat.nnx.LayerStack: side= must be a function"):
        rnnx.LayerStack(nnx_layers(), side="attn")

    class OnlyX(nnx.Module):
        def __init__(self, n=T):
            self.n = n

        def __call__(self, x):
            return x
    with pytest.raises(ValueError, match=r"remat.nnx.LayerStack: side= and out= were given, but layer 0 "
                                         r"\(OnlyX.*returns only x"):
        rnnx.LayerStack([OnlyX(), OnlyX()], out=pick, side=probs_of)(X)

    class Shaped(nnx.Module):  # side outputs of another shape per layer cannot be stacked
        def __init__(self, n):
            self.n = n

        def __call__(self, x):
            return x, jnp.zeros((self.n,))
    with pytest.raises(ValueError, match=r"remat.nnx.LayerStack: side= gave layer 1 .*same structure, shapes"):
        rnnx.LayerStack([Shaped(2), Shaped(3)], out=pick, side=probs_of)(X)
