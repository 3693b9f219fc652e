"""UntaggedRegionWarning: a name-based policy on a region that tags none of its names is full remat.
The warning names the region (a Linen module by class and path, an NNX module by class, a function
by name) and is said once per region and program: init, apply, grad and jit traces of one program
say it once; another shape or policy is another program."""
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import remat
from remat import RecomputeConfig, names, policies
from remat import linen as rlinen
from remat import nnx as rnnx

X = jnp.ones((2, 8))


def said(run) -> list[str]:
    """The UntaggedRegionWarning messages `run()` gives."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in got if issubclass(w.category, policies.UntaggedRegionWarning)]


class Block(nn.Module):  # tags nothing
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(8)(jnp.tanh(x))


class TaggedBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(8)(jnp.tanh(checkpoint_name(x, names.QKV)))


def model(block, policy):
    Rematted = rlinen.remat_module(block, policy=policy)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(2):
                x = Rematted(name=f"blocks_{i}")(x)
            return x
    return Model()


def linen_runs(m, x):
    v = m.init(jax.random.key(0), x)
    m.apply(v, x)
    loss = lambda v: jnp.sum(m.apply(v, x))  # noqa: E731
    jax.grad(loss)(v)
    jax.jit(jax.grad(loss))(v)
    jax.jit(jax.grad(loss))(v)  # a second call of the compiled step: no trace


def test_linen_module_warns_once_per_block_and_program_naming_class_and_path():
    m = model(Block, "save_names:qkv")
    msgs = said(lambda: linen_runs(m, X))
    assert len(msgs) == 2, msgs
    assert "region 'Block at Model/blocks_0'" in msgs[0] and "region 'Block at Model/blocks_1'" in msgs[1], msgs
    assert all("it has no tagged activations: it is full remat" in s and "core_fn" not in s for s in msgs), msgs
    # the same program again: quiet; another shape, another policy: other programs
    assert said(lambda: linen_runs(m, X)) == []
    assert len(said(lambda: linen_runs(m, jnp.ones((4, 8))))) == 2
    assert len(said(lambda: linen_runs(model(Block, "core_attn"), X))) == 2


def test_linen_partitioning_remat_and_methods_name_the_module():
    class Named(nn.Module):
        @nn.compact
        def __call__(self, x):
            return rlinen.partitioning_remat(Block, policy="save_names:qkv")(name="layer")(x)
    msgs = said(lambda: jax.grad(lambda v: jnp.sum(Named().apply(v, X)))(Named().init(jax.random.key(0), X)))
    assert len(msgs) == 1 and "region 'Block at Named/layer'" in msgs[0], msgs


def test_tagged_regions_never_warn():
    def run():
        linen_runs(model(TaggedBlock, "save_names:qkv"), X)
        f = remat.checkpoint(lambda w, x: jnp.tanh(checkpoint_name(x @ w, names.QKV)), policy="core_attn")
        jax.grad(lambda w: jnp.sum(f(w, X)))(jnp.eye(8))
        nnx_runs(nnx_block("save_names:qkv", tag=True), X)
    assert said(run) == []


def nnx_block(policy, tag=False):
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(8, 8, rngs=rngs)

        @rnnx.remat(policy=policy)
        def __call__(self, x):
            return x + self.dense(jnp.tanh(checkpoint_name(x, names.QKV) if tag else x))
    return Block


def nnx_runs(block, x):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([block(rngs) for _ in range(2)])

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x
    m = Model(nnx.Rngs(0))
    m(x)
    loss = lambda m: jnp.sum(m(x))  # noqa: E731
    nnx.grad(loss)(m)
    nnx.jit(nnx.grad(loss))(m)
    nnx.jit(nnx.grad(loss))(m)


def test_nnx_remat_warns_once_per_class_and_program():
    # NNX modules know no path: the two blocks (one class, one shape) are one region to the warning
    block = nnx_block("save_names:qkv")
    msgs = said(lambda: nnx_runs(block, X))
    assert len(msgs) == 1 and "region 'Block'" in msgs[0], msgs
    assert len(said(lambda: nnx_runs(block, jnp.ones((3, 8))))) == 1


def test_checkpoint_warns_once_per_function_and_program():
    def mlp(w, x):
        return jnp.tanh(x @ w)
    f, w = remat.checkpoint(mlp, policy="save_names:qkv"), jnp.eye(8)

    def runs(x):
        f(w, x)
        jax.grad(lambda w: jnp.sum(f(w, x)))(w)
        jax.jit(jax.grad(lambda w: jnp.sum(f(w, x))))(w)
        jax.grad(lambda w: jnp.sum(remat.checkpoint(mlp, policy="save_names:qkv")(w, x)))(w)  # wrapped again
    msgs = said(lambda: runs(X))
    assert len(msgs) == 1 and "region 'mlp'" in msgs[0], msgs
    assert len(said(lambda: runs(jnp.ones((5, 8))))) == 1


def test_layer_stack_regions_name_the_layer_and_the_stack():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return rlinen.LayerStack(Block, 2, RecomputeConfig(granularity="full", policy="save_names:qkv"),
                                     name="stack")(x)
    v = Model().init(jax.random.key(0), X)
    msgs = said(lambda: [jax.grad(lambda v: jnp.sum(Model().apply(v, X)))(v) for _ in range(2)])
    assert [m.split("remat: region ")[1].split(": the policy")[0] for m in msgs] == [
        "'Block at Model/stack, layers[0:1]'", "'Block at Model/stack, layers[1:2]'"], msgs


def test_the_check_leaves_the_program_as_nn_remat_makes_it():
    # the check traces the body on the side: the jaxpr of the caller's program is nn.remat's
    def program(block):
        class Model(nn.Module):
            @nn.compact
            def __call__(self, x):
                return block(name="blocks_0")(x)
        v = Model().init(jax.random.key(0), X)
        return str(jax.make_jaxpr(jax.grad(lambda v: jnp.sum(Model().apply(v, X))))(v))
    ours = []
    assert len(said(lambda: ours.append(program(rlinen.remat_module(Block, policy="save_names:qkv"))))) == 1
    assert ours[0] == program(nn.remat(Block, policy=policies.get("save_names:qkv")))
