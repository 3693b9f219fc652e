"""remat.linen.remat_module behaves as nn.remat (every form it takes, Flax's static_argnums, dropout,
setup, refusals), and the Linen LayerStack in the models' conventions: a decode cache initialized the
way Flax's lm1b/wmt examples initialize it, a layer given as an instance."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors

from remat import RecomputeConfig
from remat import linen as rlinen
from remat.memory import saved_residuals

C = 8
X = jax.random.normal(jax.random.key(1), (4, C))


class Block(nn.Module):
    rate: float = 0.5

    @nn.compact
    def __call__(self, x, deterministic=False):
        return x + nn.Dropout(self.rate, deterministic=deterministic)(jnp.tanh(nn.Dense(C)(x)))


class Net(nn.Module):
    wrap: object = None

    @nn.compact
    def __call__(self, x):
        blk = Block if self.wrap is None else self.wrap(Block)
        for i in range(3):
            x = blk(name=f"b_{i}")(x)
        return x


def _grad(wrap, v):
    return jax.grad(lambda v: jnp.sum(Net(wrap).apply(v, X, rngs={"dropout": jax.random.key(2)}) ** 2))(v)


def test_gradients_and_dropout_masks_equal_nn_remat_and_no_remat():
    v = Net().init(jax.random.key(0), X)
    ref = _grad(None, v)
    nested = lambda b: rlinen.remat_module(rlinen.remat_module(b))  # noqa: E731
    for wrap in (nn.remat, rlinen.remat_module, functools.partial(rlinen.remat_module, policy="dots"), nested):
        assert jax.tree.structure(Net(wrap).init(jax.random.key(0), X)) == jax.tree.structure(v)
        got = _grad(wrap, v)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same masks: bit for bit


def test_method_decorator_forms_remat_and_keep_flax_static_argnums():
    seen = {}

    class Bare(nn.Module):
        @rlinen.remat_module
        @nn.compact
        def __call__(self, x):
            return jnp.sin(jnp.sin(nn.Dense(C)(x)))

    class Static(nn.Module):
        @functools.partial(rlinen.remat_module, static_argnums=(2,))
        @nn.compact
        def __call__(self, x, train: bool):
            seen["static"] = type(train)
            return nn.Dense(C)(x) * (2.0 if train else 1.0)

    class Dynamic(nn.Module):
        @functools.partial(rlinen.remat_module, static_argnums=())
        @nn.compact
        def __call__(self, x, train: bool):
            seen["dynamic"] = type(train)
            return nn.Dense(C)(x)

    v = Bare().init(jax.random.key(0), X)
    plain = lambda v, x: jnp.sum(jnp.sin(jnp.sin(x @ v["params"]["Dense_0"]["kernel"]  # noqa: E731
                                                 + v["params"]["Dense_0"]["bias"])))
    bare = saved_residuals(lambda v, x: jnp.sum(Bare().apply(v, x)), v, X).intermediates
    assert bare < saved_residuals(plain, v, X).intermediates  # the decorator rematerializes
    Static().apply(Static().init(jax.random.key(0), X, True), X, False)
    Dynamic().apply(Dynamic().init(jax.random.key(0), X, True), X, False)
    assert seen["static"] is bool and issubclass(seen["dynamic"], jax.core.Tracer)  # not static: traced, as Flax


def test_a_module_instance_is_refused_as_flax_refuses_it():
    class Foo(nn.Module):
        @nn.compact
        def __call__(self, x):
            return rlinen.remat_module(nn.Dense(2))(x)

    with pytest.raises(errors.TransformTargetError):
        Foo().init(jax.random.key(0), X)


def test_setup_runs_inside_each_region_as_in_nn_remat():
    counts = {}

    def make(wrap):
        class A(nn.Module):
            def setup(self):
                counts[wrap] = counts.get(wrap, 0) + 1
                self.d = nn.Dense(2)

            @wrap
            def foo(self, x):
                return self.d(x)

            @wrap
            def bar(self, x):
                return self.d(x)

        class B(nn.Module):
            def setup(self):
                self.a = A()

            def __call__(self, x):
                return self.a.foo(x), self.a.bar(x)
        return B

    for wrap in (nn.remat, rlinen.remat_module):
        (y1, y2), _ = make(wrap)().init_with_output(jax.random.key(0), jnp.ones((2,)))
        np.testing.assert_array_equal(y1, y2)
    assert counts[rlinen.remat_module] == counts[nn.remat]


def test_a_policy_name_saves_what_the_jax_policy_saves_under_nn_remat():
    v = Net().init(jax.random.key(0), X)
    saved = lambda wrap: saved_residuals(  # noqa: E731
        lambda v: jnp.sum(Net(wrap).apply(v, X, rngs={"dropout": jax.random.key(2)})), v)
    ours = saved(functools.partial(rlinen.remat_module, policy="dots"))
    flax = saved(functools.partial(nn.remat, policy=jax.checkpoint_policies.dots_saveable))
    assert [(r.shape, r.dtype) for r in ours.rows] == [(r.shape, r.dtype) for r in flax.rows]
    assert ours.total == flax.total < saved(None).total
    callable_ = saved(functools.partial(rlinen.remat_module, policy=jax.checkpoint_policies.dots_saveable))
    assert callable_.total == flax.total


def test_function_form_and_methods_as_nn_remat():
    def body(mdl, x):
        return jnp.tanh(nn.Dense(C)(x))

    class Fn(nn.Module):
        wrap: object

        @nn.compact
        def __call__(self, x):
            return self.wrap(body)(self, x)

    class Two(nn.Module):
        def setup(self):
            self.d = nn.Dense(C)

        def __call__(self, x):
            return self.d(x)

        def twice(self, x):
            return self.d(self.d(x))

    for wrap in (nn.remat, rlinen.remat_module):
        v = Fn(wrap).init(jax.random.key(0), X)
        g = jax.grad(lambda v: jnp.sum(Fn(wrap).apply(v, X)))(v)
        if wrap is nn.remat:
            ref = g
    np.testing.assert_array_equal(jax.tree.leaves(g)[0], jax.tree.leaves(ref)[0])
    M = rlinen.remat_module(Two, methods=["twice"], policy="full")
    v = M().init(jax.random.key(0), X)
    grad = lambda m: jax.grad(lambda v: jnp.sum(m().apply(v, X, method="twice")))(v)  # noqa: E731
    for a, b in zip(jax.tree.leaves(grad(M)), jax.tree.leaves(grad(Two))):
        np.testing.assert_array_equal(a, b)
    assert saved_residuals(lambda v: jnp.sum(M().apply(v, X, method="twice")), v).intermediates < \
        saved_residuals(lambda v: jnp.sum(Two().apply(v, X, method="twice")), v).intermediates


def test_recompute_config_gives_the_policy_and_what_nn_remat_cannot_run_is_refused():
    assert rlinen.remat_module(Block, recompute=RecomputeConfig()) is Block
    v = Net().init(jax.random.key(0), X)
    sel = functools.partial(rlinen.remat_module, recompute=RecomputeConfig(granularity="full", policy="dots"))
    pol = functools.partial(rlinen.remat_module, policy="dots")
    for a, b in zip(jax.tree.leaves(_grad(sel, v)), jax.tree.leaves(_grad(pol, v))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="LayerStack"):
        rlinen.remat_module(Block, recompute=RecomputeConfig(granularity="full", method="uniform", num_layers=2))
    with pytest.raises(ValueError, match="use_reentrant=True .*LayerStack"):
        rlinen.remat_module(Block, recompute=RecomputeConfig(granularity="full", use_reentrant=True))
    with pytest.raises(TypeError, match="policy"):
        rlinen.remat_module(Block, recompute=RecomputeConfig(granularity="full"), policy="dots")
    with pytest.raises(TypeError, match="recompute="):  # the second argument is nn.remat's `variables`
        rlinen.remat_module(Block, RecomputeConfig(granularity="full"))
    with pytest.raises(ValueError, match="unknown policy .no_such_policy."):
        rlinen.remat_module(Block, policy="no_such_policy")


# The LayerStack in the conventions of models written elsewhere ------------------------------------

T, L = 6, 3


class Attn(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, x, mask=None):
        h = nn.MultiHeadDotProductAttention(num_heads=2, decode=self.decode, deterministic=True)(nn.LayerNorm()(x),
                                                                                                  mask=mask)
        return x + h + nn.Dense(C)(nn.gelu(nn.Dense(2 * C)(x)))


class Decoder(nn.Module):
    decode: bool = False
    stack: object = None  # None: a plain loop of blocks (the original model)

    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(16, C)(tok)
        mask = None if self.decode else nn.make_causal_mask(tok)
        if self.stack is None:
            for i in range(L):
                x = Attn(self.decode, name=f"h_{i}")(x, mask)
        else:
            x = rlinen.LayerStack(functools.partial(Attn, self.decode), L, self.stack, name="stack")(x, mask)
        return nn.Dense(16)(x)


def _decode(stack, params, init_len=T):
    model = Decoder(decode=True, stack=stack)
    # as lm1b/wmt: the cache is made by an init on a full-length input with decode=True
    cache = model.init(jax.random.key(0), jnp.zeros((2, init_len), jnp.int32))["cache"]
    outs = []
    for t in range(T):
        logits, upd = model.apply({"params": params, "cache": cache}, TOK[:, t:t + 1], mutable=["cache"])
        cache = upd["cache"]
        outs.append(logits)
    return jnp.concatenate(outs, 1)


TOK = jax.random.randint(jax.random.key(3), (2, T), 0, 16)


@pytest.mark.parametrize("cfg", [RecomputeConfig(), RecomputeConfig(granularity="full")])
def test_stack_decode_cache_initialized_the_lm1b_way_matches_the_original(cfg):
    p0 = Decoder().init(jax.random.key(0), TOK)["params"]
    ref = _decode(None, p0)
    np.testing.assert_allclose(ref, Decoder().apply({"params": p0}, TOK), atol=1e-5)  # the reference decodes right
    p = {**{k: v for k, v in p0.items() if not k.startswith("h_")},
         "stack": rlinen.stack_layers([p0[f"h_{i}"] for i in range(L)])}
    np.testing.assert_array_equal(_decode(cfg, p), ref)


@pytest.mark.slow  # the lm1b-way sibling above stays fast (and fails on a stack that re-ran its fresh layers)
def test_stack_decode_cache_initialized_on_one_token_matches_the_original_so_initialized():
    # Flax sizes the cache from the init input: one token makes a one-slot cache, which the original
    # model decodes with as well; the stack must decode as the original does, whatever the init
    p0 = Decoder().init(jax.random.key(0), TOK)["params"]
    p = {**{k: v for k, v in p0.items() if not k.startswith("h_")},
         "stack": rlinen.stack_layers([p0[f"h_{i}"] for i in range(L)])}
    cache = Decoder(decode=True, stack=RecomputeConfig(granularity="full")).init(jax.random.key(0), TOK[:, :1])["cache"]["stack"]
    assert jax.tree.map(jnp.shape, cache) == jax.tree.map(jnp.shape, rlinen.stack_layers(
        [Decoder(decode=True).init(jax.random.key(0), TOK[:, :1])["cache"][f"h_{i}"] for i in range(L)]))
    assert all(int(c["MultiHeadDotProductAttention_0"]["cache_index"]) == 0 for c in cache.values())
    np.testing.assert_array_equal(_decode(RecomputeConfig(granularity="full"), p, init_len=1), _decode(None, p0, init_len=1))


def test_stack_takes_a_layer_instance():
    stack = rlinen.LayerStack(Block(0.0), 2, RecomputeConfig(granularity="full"))
    v = stack.init(jax.random.key(0), X)
    assert sorted(v["params"]) == ["h_0", "h_1"]
    assert stack.apply(v, X, rngs={"dropout": jax.random.key(1)}).shape == X.shape
