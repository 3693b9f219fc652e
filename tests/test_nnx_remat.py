"""remat.nnx.remat behaves as nnx.remat (decorator and call forms, static_argnums, policy, graph and
tree mode, state updates, RNG streams, refusals), and the NNX LayerStack in the models' conventions:
blocks drawing dropout from an `Rngs` passed per call (Gemma's way), a stack stored as the model's
`self.layers` whose checkpoint without the stack must load."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from remat import RecomputeConfig
from remat import nnx as rnnx
from remat.memory import saved_residuals

N, L = 8, 4
X = jax.random.normal(jax.random.key(1), (2, N))
FULL = RecomputeConfig(granularity="full")


def equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


class Block(nnx.Module):
    """Gemma's convention: dropout draws from the `rngs` given to each call."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(N, N, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return x + self.drop(jnp.tanh(self.lin(x)), rngs=rngs)


def test_forms_gradients_state_updates_and_rngs_as_nnx_remat():
    def run(remat):
        class M(nnx.Module):
            def __init__(self):
                self.block = Block(nnx.Rngs(0))
                self.count = nnx.BatchStat(jnp.array(0))

            @remat(graph=True, graph_updates=True)
            def __call__(self, x, rngs):
                self.count[...] += 1
                return self.block(x, rngs=rngs)

        m, rngs = M(), nnx.Rngs(dropout=3)
        loss = lambda m, rngs: jnp.sum(m(X, rngs) ** 2)  # noqa: E731
        g = nnx.grad(loss, graph=True, graph_updates=True)(m, rngs)
        return nnx.state(g, nnx.Param), int(m.count[...]), int(rngs.dropout.count[...])

    ref = run(nnx.remat)
    got = run(rnnx.remat)
    equal(got[0], ref[0])
    assert got[1:] == ref[1:] == (1, 1)  # the BatchStat and the Rngs counter advanced, as nnx.remat's


def test_call_form_static_argnums_and_policy():
    def f(m, x, scale):
        return jnp.sum(m(x) * (2.0 if scale > 0 else 1.0))

    lin = nnx.Linear(N, N, rngs=nnx.Rngs(0))
    for remat in (nnx.remat, rnnx.remat):
        g = nnx.grad(remat(f, static_argnums=(2,), policy=jax.checkpoint_policies.dots_saveable))(lin, X, 1)
        equal(nnx.state(g), nnx.state(nnx.grad(f)(lin, X, 1)))
    g = nnx.grad(rnnx.remat(f, static_argnums=(2,), policy="full"))(lin, X, 1)  # a registry name too
    equal(nnx.state(g), nnx.state(nnx.grad(f)(lin, X, 1)))


@pytest.mark.parametrize("graph,graph_updates", [(True, False), (False, False)])
def test_tree_mode_writes_state_updates_back_as_nnx_remat(graph, graph_updates):
    class Counted(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(N, N, rngs=nnx.Rngs(0))
            self.count = nnx.BatchStat(jnp.array(0))

        def __call__(self, x):
            self.count[...] += 1
            return jnp.tanh(self.lin(x))

    for remat in (nnx.remat, rnnx.remat):
        m = Counted()
        y = remat(lambda m, x: m(x), graph=graph, graph_updates=graph_updates, policy="dots" if remat is rnnx.remat
                  else jax.checkpoint_policies.dots_saveable)(m, X)
        np.testing.assert_array_equal(y, Counted()(X))
        assert int(m.count[...]) == 1


def test_a_policy_name_saves_what_the_jax_policy_saves():
    lin = nnx.Linear(N, N, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(lin)
    f = lambda m, x: jnp.sum(jnp.sin(m(jnp.sin(m(x)))))  # noqa: E731

    def saved(remat, policy):
        g = remat(f, policy=policy)
        return saved_residuals(lambda s, x: g(nnx.merge(graphdef, s), x), state, X)

    ours, flax = saved(rnnx.remat, "dots"), saved(nnx.remat, jax.checkpoint_policies.dots_saveable)
    assert [(r.shape, r.dtype) for r in ours.rows] == [(r.shape, r.dtype) for r in flax.rows]
    assert saved(rnnx.remat, "full").intermediates < ours.intermediates


def test_under_nnx_scan_over_vmapped_layers_as_nnx_remat():
    def grads(remat):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=0, axis_size=3)
        def create(rngs):
            return nnx.Linear(N, N, rngs=rngs)

        layers = create(nnx.Rngs(0))

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        @remat(policy=None)
        def forward(layer, x):
            return jnp.tanh(layer(x))

        return nnx.state(nnx.grad(lambda m: jnp.sum(forward(m, X) ** 2))(layers), nnx.Param)

    equal(grads(rnnx.remat), grads(nnx.remat))


def test_tree_mode_and_a_bound_method_refused():
    lin = nnx.Linear(N, N, rngs=nnx.Rngs(0))
    fwd = rnnx.remat(lambda m, x: m(x), graph=False)
    g = nnx.grad(lambda m: jnp.sum(fwd(m, X)), graph=False)(lin)
    assert g.kernel.shape == (N, N)
    with pytest.raises(ValueError, match="bound method"):
        rnnx.remat(lin.__call__)


# The NNX stack with blocks that take `rngs` per call ------------------------------------------------

class Model(nnx.Module):
    def __init__(self, cfg, rngs, stack_rngs=None):
        blocks = [Block(rngs) for _ in range(L)]
        self.cfg = cfg
        self.layers = nnx.List(blocks) if cfg is None else rnnx.LayerStack(blocks, cfg, rngs=stack_rngs)

    def __call__(self, x, rngs=None):
        if self.cfg is None:
            for block in self.layers:
                x = block(x, rngs=rngs)
            return x
        return self.layers(x) if rngs is None else self.layers(x, rngs=rngs)


def _two_steps(cfg, stack_rngs=False):
    """Parameter gradients of two steps, and the dropout counter after them."""
    seed = nnx.Rngs(dropout=7)
    model = Model(cfg, nnx.Rngs(0), stack_rngs=seed if stack_rngs else None)
    rngs = None if stack_rngs else seed
    grads = [nnx.state(nnx.grad(lambda m, r: jnp.sum(m(X, r) ** 2))(model, rngs), nnx.Param) for _ in range(2)]
    return grads, int(seed.dropout.count[...])


@pytest.mark.parametrize("cfg", [FULL, RecomputeConfig(granularity="full", method="uniform", num_layers=2)])
def test_dropout_from_per_call_rngs_equals_the_model_without_remat(cfg):
    ref, count = _two_steps(None)
    got, got_count = _two_steps(cfg)
    assert got_count == count == 2 * L  # every layer drew once per step, as in the plain loop
    for a, b in zip(got, ref):
        equal(nnx.state(a), nnx.state(b))  # paths differ (layers/layers/i): compare the leaves


def test_the_stacks_own_rngs_reach_blocks_that_take_rngs_per_call():
    ref, count = _two_steps(None)
    got, got_count = _two_steps(FULL, stack_rngs=True)
    assert got_count == count
    for a, b in zip(got, ref):
        equal(nnx.state(a), nnx.state(b))


def test_stored_stack_len_indexing_and_an_original_checkpoint_loads_both_ways():
    plain, stacked = Model(None, nnx.Rngs(0)), Model(FULL, nnx.Rngs(1))
    assert len(stacked.layers) == L and stacked.layers[1] is list(stacked.layers)[1]
    nnx.update(stacked, rnnx.stack_layers(nnx.state(plain)))  # the checkpoint without the stack loads
    np.testing.assert_array_equal(stacked(X, nnx.Rngs(dropout=2)), plain(X, nnx.Rngs(dropout=2)))
    back = rnnx.unstack_layers(nnx.state(stacked))
    assert jax.tree.structure(back) == jax.tree.structure(nnx.state(plain))
    equal(back, nnx.state(plain))


# Decode caches through the stack -------------------------------------------------------------------

F, TD = 16, 4


class AttnBlock(nnx.Module):
    """NNX's own MultiHeadAttention in decode mode: its nnx.Cache changes on every call."""

    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=F, decode=True, rngs=rngs)
        self.lin = nnx.Linear(F, F, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(x)
        return x + jnp.tanh(self.lin(x))


def _attn_blocks():
    blocks = [AttnBlock(nnx.Rngs(i)) for i in range(L)]
    for b in blocks:
        b.attn.init_cache((2, TD, F))
    return blocks


XD = jax.random.normal(jax.random.key(4), (2, TD, F))


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("cfg", [RecomputeConfig(), RecomputeConfig(granularity="full", method="uniform", num_layers=2)])
def test_decode_through_the_stack_is_token_identical_to_the_layers_without_it(cfg, scan):
    plain, stack = _attn_blocks(), rnnx.LayerStack(_attn_blocks(), cfg, scan=scan)
    step = nnx.jit(lambda m, x: m(x))
    ref, got = [], []
    for t in range(TD):
        h = XD[:, t:t + 1]
        for b in plain:
            h = b(h)
        ref.append(h)
        got.append(step(stack, XD[:, t:t + 1]))
    np.testing.assert_array_equal(jnp.concatenate(got, 1), jnp.concatenate(ref, 1))
    assert int(stack[L - 1].attn.cache_index[...]) == TD  # every layer's cache was written back
    for i in range(L):
        equal(nnx.state(stack[i], nnx.Cache), nnx.state(plain[i], nnx.Cache))
