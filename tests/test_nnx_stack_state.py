"""remat.nnx.LayerStack carries the state its layers update, as nnx.scan and nnx.remat do.

Flax's NNX scan-over-layers recipe (layers made under `nnx.vmap` with `nnx.split_rngs`, run by
`nnx.scan` over an `nnx.remat` body), with `nnx.BatchNorm` in train mode and an `nnx.Dropout`
owning its `Rngs`, against the same layers through `LayerStack(..., scan=True)`; and a list of
such layers against a Python loop of `nnx.remat` layers. Two training steps each, so the batch
statistics and RNG counters written back by the first are the second's.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from remat import RecomputeConfig
from remat import nnx as rnnx

L, W, B = 4, 8, 16
X = jax.random.normal(jax.random.key(0), (B, W))
CFGS = [RecomputeConfig(), RecomputeConfig(granularity="full"),
        RecomputeConfig(granularity="full", method="uniform", num_layers=2)]
IDS = ["none", "full", "uniform2"]


class Block(nnx.Module):
    """Flax's scan-over-layers block: Linear, BatchNorm (batch statistics), Dropout (its own Rngs)."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(W, W, rngs=rngs)
        self.bn = nnx.BatchNorm(W, use_running_average=False, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.relu(self.dropout(self.bn(self.linear(x))))


def stacked_blocks(seed=0):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs):
        return Block(rngs)
    return create(nnx.Rngs(params=seed, dropout=seed + 1))


@nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
@nnx.remat
def flax_forward(block, x):  # Flax's own recipe
    return block(x)


def listed_blocks(seed=0):
    return [Block(nnx.Rngs(params=seed + i, dropout=100 + i)) for i in range(L)]


remat_layer = nnx.remat(lambda block, x: block(x))


def loop_forward(blocks, x):
    for b in blocks:
        x = remat_layer(b, x)
    return x


def loss_of(forward, reads_stats):
    def loss(model, x):
        y = forward(model, x)
        out = jnp.mean(jnp.sin(y) * y)
        if reads_stats:  # the updated running means, differentiated as nnx.scan's outputs are
            out = out + sum(jnp.sum(v[...]) for v in jax.tree.leaves(nnx.state(model, nnx.BatchStat)))
        return out
    return loss


def train(model, forward, reads_stats=False, steps=2):
    """Gradients (one State of Params per step) after SGD steps on `model`, which is updated in place."""
    @nnx.jit
    def step(model, x):
        grads = nnx.grad(loss_of(forward, reads_stats))(model, x)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads))
        return grads
    return [step(model, X) for _ in range(steps)]


def leaves(state):
    return [np.asarray(v) for v in jax.tree.leaves(state)]


def close(got, ref, rel=1e-5):
    got, ref = leaves(got), leaves(ref)
    assert len(got) == len(ref) > 0
    scale = max(float(np.max(np.abs(r))) for r in ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype == np.float32
        assert float(np.max(np.abs(g - r))) <= rel * scale


def same_rng(got, ref):
    for kind in (nnx.RngCount, nnx.RngKey):
        a, b = nnx.state(got, kind), nnx.state(ref, kind)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            if kind is nnx.RngKey:
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            np.testing.assert_array_equal(x, y)


def test_dropout_is_active():
    det = stacked_blocks()
    det.set_attributes(deterministic=True)
    assert float(jnp.max(jnp.abs(flax_forward(stacked_blocks(), X) - flax_forward(det, X)))) > 1e-3


@pytest.mark.parametrize("reads_stats", [False, True], ids=["loss", "loss_reads_stats"])
@pytest.mark.parametrize("cfg", CFGS, ids=IDS)
def test_scan_over_layers_equals_flax_nnx_scan_with_nnx_remat(cfg, reads_stats):
    ref_model = stacked_blocks()
    ref = train(ref_model, flax_forward, reads_stats)
    stack = rnnx.LayerStack(stacked_blocks(), cfg, scan=True)
    got = train(stack, lambda s, x: s(x), reads_stats)
    for g, r in zip(got, ref):
        close(g["layers"], r)
    assert not np.allclose(leaves(ref[0])[0], leaves(ref[1])[0])  # step 2 saw other masks / stats
    close(nnx.state(stack.layers, nnx.BatchStat), nnx.state(ref_model, nnx.BatchStat))
    same_rng(stack.layers, ref_model)
    assert np.asarray(stack.layers.dropout.rngs.count[...]).tolist() == [2] * L  # one draw per layer and step


@pytest.mark.parametrize("cfg", CFGS, ids=IDS)
def test_loop_layout_equals_a_loop_of_nnx_remat_layers(cfg):
    ref_blocks = nnx.List(listed_blocks())
    ref = train(ref_blocks, loop_forward)
    stack = rnnx.LayerStack(listed_blocks(), cfg)
    got = train(stack, lambda s, x: s(x))
    for g, r in zip(got, ref):
        close(g["layers"], r)
    close(nnx.state(stack.layers, nnx.BatchStat), nnx.state(ref_blocks, nnx.BatchStat))
    same_rng(stack.layers, ref_blocks)
    assert [int(b.dropout.rngs.count[...]) for b in stack] == [2] * L


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_batch_statistics_are_written_back_when_the_stack_owns_the_randomness(scan):
    def run(cfg):
        layers = stacked_blocks() if scan else listed_blocks()
        stack = rnnx.LayerStack(layers, cfg, scan=scan, rngs=nnx.Rngs(dropout=5))
        return stack, train(stack, lambda s, x: s(x))
    ref_stack, ref = run(RecomputeConfig())
    stack, got = run(RecomputeConfig(granularity="full"))
    for g, r in zip(got, ref):
        close(g, r)
    close(nnx.state(stack.layers, nnx.BatchStat), nnx.state(ref_stack.layers, nnx.BatchStat))
    assert float(np.max(np.abs(leaves(nnx.state(stack.layers, nnx.BatchStat))[0]))) > 0  # they moved
    counts = np.asarray(leaves(nnx.state(stack.layers, nnx.RngCount))).ravel().tolist()
    assert counts == [0] * L  # the stack reseeds the layers' streams; their counters are not written back


class Noise(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.rngs = rngs  # stored, not forked: layers made with one Rngs share it

    def __call__(self, x):
        return x + jax.random.normal(self.rngs.noise(), x.shape)


def test_layers_sharing_state_that_changes_are_refused():
    shared = nnx.Rngs(noise=0)
    with pytest.raises(ValueError, match=r"layers 0 and 1 share one RngCount .*rngs/noise/count"):
        rnnx.LayerStack([Noise(shared), Noise(shared)], RecomputeConfig(granularity="full"))(X)
    # with the stack's own randomness each layer is reseeded, nothing is written back: allowed
    stack = rnnx.LayerStack([Noise(shared), Noise(shared)], RecomputeConfig(granularity="full"),
                            rngs=nnx.Rngs(dropout=1))
    assert stack(X).shape == X.shape


def test_a_layer_changing_a_param_or_adding_state_is_refused():
    class Grows(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(()))

        def __call__(self, x):
            self.w[...] = self.w[...] + 1
            return x

    class Sows(nnx.Module):
        def __call__(self, x):
            self.sow(nnx.Intermediate, "h", x)
            return x

    for scan in (False, True):
        with pytest.raises(ValueError, match=r"changed its nnx.Param state during the call \(w\)"):
            rnnx.LayerStack([Grows(), Grows()], RecomputeConfig(granularity="full"), scan=scan)(X)
    with pytest.raises(ValueError, match="layer 0 added state during the call"):
        rnnx.LayerStack([Sows(), Sows()], RecomputeConfig(granularity="full"))(X)
