"""remat.nnx.LayerStack with stateful NNX dropout: per-layer, per-call keys; remat changes nothing.

The layers share one `nnx.Rngs` (the usual NNX pattern), which run as pure functions of their
state would repeat one mask in every layer; the stack reseeds them per layer and per call from its
own `rngs`. Layers drawing from their own `Rngs` without the stack's have their counters written
back (tests/test_nnx_stack_state.py).
"""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import remat
from remat import RecomputeConfig
from remat import nnx as rnnx

L, N = 4, 4  # Block: |values| <= (1 + 2N)^L = 6561, gradients < 2^24


class Drop(nnx.Module):
    """Dropout alone: y = x * mask / keep."""

    def __init__(self, rngs: nnx.Rngs):
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(x)


class Block(nnx.Module):
    """x + dropout(x @ w), rate 1/2, with small-integer weights and inputs: every value of the forward
    and the backward is an integer below 2^24, exact in float32 whatever order XLA sums in, so
    gradients can be compared bit for bit and differ only if a dropout mask does."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(N, N, use_bias=False, rngs=rngs)
        self.lin.kernel[...] = jax.random.randint(rngs.params(), (N, N), -1, 2).astype(jnp.float32)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.lin(x))


def _stack(layer, cfg, seed=1):
    shared = nnx.Rngs(params=0, dropout=0)  # one Rngs for all layers
    return rnnx.LayerStack([layer(shared) for _ in range(L)], cfg, rngs=nnx.Rngs(dropout=seed))


def test_masks_differ_between_layers_and_between_calls():
    stack = _stack(Drop, RecomputeConfig(granularity="full"))
    x = jnp.ones((64, 64))
    y1, y2 = stack(x), stack(x)
    # L independent masks of keep 0.5 keep 1/16 of the entries; one mask repeated would keep 1/2.
    assert abs(float(jnp.mean(y1 != 0)) - 0.5 ** L) < 0.02
    assert bool(jnp.any((y1 != 0) != (y2 != 0)))  # the second call (step) draws new masks
    # an explicit key (raw or typed) gives the same masks every time it is passed
    k = jax.random.PRNGKey(5)
    assert bool(jnp.array_equal(stack(x, key=k), stack(x, key=jax.random.wrap_key_data(k))))


def _grads(cfg, x):
    stack = _stack(Block, cfg)
    c = jnp.arange(N, dtype=jnp.float32) - 1  # a linear loss keeps the cotangents small integers
    loss = lambda m: jnp.sum(m(x) * c)
    return [nnx.state(nnx.grad(loss)(stack)) for _ in range(2)]  # two steps: the stack's key advances


@pytest.mark.parametrize("cfg", [
    RecomputeConfig(granularity="full"),
    RecomputeConfig(granularity="full", method="uniform", num_layers=2, use_reentrant=True),
    RecomputeConfig(granularity="full", layers=remat.segments((0, 3))),
], ids=["full", "uniform2-reentrant", "segments0-3"])
def test_gradients_bit_equal_with_and_without_remat(cfg):
    x = jax.random.randint(jax.random.PRNGKey(3), (4, N), -1, 2).astype(jnp.float32)
    ref = _grads(RecomputeConfig(), x)
    got = _grads(cfg, x)
    for r, g in zip(ref, got):
        for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(g)):
            assert bool(jnp.array_equal(a, b))  # bit-equal: exact arithmetic, same masks
    # the two steps really used different masks (the gradients differ)
    assert not all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(ref[0]), jax.tree.leaves(ref[1])))


def test_a_layer_drawing_from_its_own_rngs_without_stack_rngs_advances_them_as_a_loop_does():
    layers = lambda: [Drop(nnx.Rngs(i)) for i in range(2)]  # noqa: E731
    stack, plain = rnnx.LayerStack(layers(), RecomputeConfig(granularity="full")), layers()
    x = jnp.ones((16, 16))
    for _ in range(2):  # the second call draws new masks from the counters the first wrote back
        h = x
        for layer in plain:
            h = layer(h)
        assert bool(jnp.array_equal(stack(x), h))
    assert [int(layer.drop.rngs.count[...]) for layer in stack] == [2, 2]
    # without dropout (deterministic), the same layers need no keys
    det = rnnx.LayerStack(layers(), RecomputeConfig(granularity="full"))
    det.layers[0].drop.deterministic = det.layers[1].drop.deterministic = True
    assert bool(jnp.all(det(jnp.ones((4, 4))) == 1))


def test_a_layer_changing_other_state_has_it_written_back():
    class Counter(nnx.Module):
        def __init__(self):
            self.calls = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x):
            self.calls[...] = self.calls[...] + 1
            return x

    stack = rnnx.LayerStack([Counter(), Counter()], RecomputeConfig(granularity="full"), rngs=nnx.Rngs(dropout=0))
    stack(jnp.ones((2,)))
    stack(jnp.ones((2,)))
    assert [float(layer.calls[...]) for layer in stack] == [2.0, 2.0]  # written back, the stack's rngs or not
