"""remat on models it did not write: the breaks found adopting it in outside Linen, NNX and JAX code.

One test (or a few) per break: remat_module's remat and its "no remat"; name-based
policies on untagged regions; the stacks' collections, keyword arguments and layer outputs;
checkpoint on closures, pytree callables and keyword arguments; user tag names. Gradients are
compared with the same model without remat (float32, max|dg| <= 1e-5 max|g|).
"""
import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import remat
from remat import RecomputeConfig, names, policies
from remat import linen as rlinen
from remat import nnx as rnnx
from remat.memory import compiled_memory, saved_residuals
from targethelp import GPU, need
from tinyblocks import rel_err

B, T, C, L = 2, 16, 32, 4
KEY = jax.random.key(0)
X = jax.random.normal(KEY, (B, T, C))
FULL = RecomputeConfig(granularity="full")


class Block(nn.Module):  # an untagged outside block: norm, attention-like mixing, MLP
    @nn.compact
    def __call__(self, x, scale: float = 1.0):
        h = nn.LayerNorm()(x)
        a = jax.nn.softmax(jnp.einsum("btc,bsc->bts", h, nn.Dense(C, use_bias=False)(h)) / C ** 0.5, axis=-1)
        x = x + nn.Dense(C)(jnp.einsum("bts,bsc->btc", a, h))
        return x + scale * nn.Dense(C)(nn.gelu(nn.Dense(4 * C)(nn.LayerNorm()(x))))


class Net(nn.Module):
    wrap: object = None  # None | "nn.remat" | remat_module's recompute= (a RecomputeConfig) or policy=

    @nn.compact
    def __call__(self, x):
        kind = "recompute" if isinstance(self.wrap, RecomputeConfig) else "policy"
        blk = Block if self.wrap is None else nn.remat(Block) if self.wrap == "nn.remat" else \
            rlinen.remat_module(Block, **{kind: self.wrap})
        for _ in range(L):
            x = blk()(x)
        return x


def _loss(net):
    return lambda v: jnp.mean(net.apply(v, X) ** 2)


# 1. remat_module ------------------------------------------------------------------------------

def test_remat_module_no_remat_is_the_class_itself():
    assert rlinen.remat_module(Block, recompute=RecomputeConfig()) is Block


@pytest.mark.slow  # ~20 s; tests/test_linen_remat.py keeps remat_module's gradients fast
def test_remat_module_keeps_parameter_paths_and_gradients():
    v, plain = Net(FULL).init(KEY, X), Net().init(KEY, X)
    assert jax.tree.structure(v) == jax.tree.structure(plain)  # Block_0 ... Block_3, as without remat
    ref = jax.grad(_loss(Net()))(plain)
    for wrap in (FULL, "full", jax.checkpoint_policies.dots_saveable):
        assert rel_err(jax.grad(_loss(Net(wrap)))(plain), ref) <= 1e-5


@pytest.mark.slow  # ~10 s; tests/test_linen_remat.py keeps remat_module against nn.remat fast
def test_remat_module_saves_and_compiles_as_nn_remat():
    need("cuda")  # the temps are XLA:GPU's for an H200 (deviceless)
    vs = {w: Net(w).init(KEY, X) for w in (None, "nn.remat", "full")}  # nn.remat renames: CheckpointBlock_0
    temp = {w: compiled_memory(jax.grad(_loss(Net(w))), v, target=GPU).temp for w, v in vs.items()}
    saved = {w: saved_residuals(_loss(Net(w)), v).intermediates for w, v in vs.items()}
    assert saved["full"] == saved["nn.remat"] < saved[None]
    assert temp["full"] == temp["nn.remat"], temp


@pytest.mark.slow  # ~12 s; tests/test_linen_remat.py keeps Flax's static_argnums fast
def test_remat_module_static_argnums_count_self_as_zero():
    with pytest.raises(ValueError, match="Flax counts `self` as argument 0"):
        rlinen.remat_module(Block, policy="full", static_argnums=(0,))
    blk = rlinen.remat_module(Block, policy="full", static_argnums=(2,))  # self, x, scale
    v = blk().init(KEY, X, 0.5)
    g = jax.grad(lambda v: jnp.sum(blk().apply(v, X, 0.5)))(v)
    assert rel_err(g, jax.grad(lambda v: jnp.sum(Block().apply(v, X, 0.5)))(v)) <= 1e-5


# 2. name-based policies on untagged regions ---------------------------------------------------

@pytest.mark.parametrize("cfg", [RecomputeConfig(granularity="selective"),
                                 RecomputeConfig(granularity="full", policy="save_names:qkv"),
                                 RecomputeConfig(granularity="full", policy="offload_names:mlp_up"),
                                 RecomputeConfig(granularity="full", policy="custom:qkv=device")])
def test_name_policy_on_untagged_stack_warns(cfg):
    stack = rlinen.LayerStack(Block, 2, cfg)
    v = stack.init(KEY, X)
    with pytest.warns(policies.UntaggedRegionWarning, match="has no tagged activations: it is full remat"):
        jax.grad(lambda v: jnp.sum(stack.apply(v, X)))(v)


def test_name_policy_on_tagged_region_is_quiet():
    f = lambda w, x: jnp.sum(jnp.tanh(checkpoint_name(x @ w, names.QKV)))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.grad(lambda w: remat.checkpoint(f, policy="core_attn")(w, X[0]))(jnp.eye(C))


# 3. collections through LayerStack ------------------------------------------------------------

class CachedLayer(nn.Module):  # a decode cache: appends its input's sum per call
    @nn.compact
    def __call__(self, x):
        seen = self.variable("cache", "cached_key", lambda: jnp.zeros((), jnp.float32))
        y = x + nn.Dense(C)(x) * 0.1 + seen.value
        if not self.is_initializing():
            seen.value = seen.value + jnp.sum(x)
        return y


class Free(nn.Module):  # no parameters at all
    def __call__(self, x):
        return jnp.tanh(x)


class Normed(nn.Module):  # batch_stats and sow
    @nn.compact
    def __call__(self, x):
        y = nn.BatchNorm(use_running_average=False)(nn.Dense(C)(x))
        self.sow("intermediates", "act", y)
        return x + y


def _unrolled(layer_cls, stack_vars):
    """The same layers applied one by one with the stack's variables (no remat)."""
    def run(v, x, mutable):
        outs = {}
        for i in range(L):
            vi = {c: t[f"h_{i}"] for c, t in v.items() if f"h_{i}" in t}
            x, upd = layer_cls().apply(vi, x, mutable=mutable)
            outs[i] = upd
        return x, outs
    return run


@pytest.mark.parametrize("cfg", [RecomputeConfig(), FULL])
def test_stack_decode_cache_is_read_and_written(cfg):
    stack = rlinen.LayerStack(CachedLayer, L, cfg)
    v = stack.init(KEY, X)
    assert set(v) == {"params", "cache"}
    y, upd = stack.apply(v, X, mutable=["cache"])
    y2, upd2 = stack.apply({**v, **upd}, X, mutable=["cache"])
    ref, ref_upd = _unrolled(CachedLayer, v)(v, X, ["cache"])
    assert rel_err(y, ref) <= 1e-6
    for i in range(L):
        assert rel_err(upd["cache"][f"h_{i}"], ref_upd[i]["cache"]) <= 1e-6
    assert float(upd2["cache"]["h_1"]["cached_key"]) != float(upd["cache"]["h_1"]["cached_key"])


def test_stack_of_layers_without_parameters():
    stack = rlinen.LayerStack(Free, L, FULL)
    v = stack.init(KEY, X)
    g = jax.grad(lambda x: jnp.sum(stack.apply(v, x)))(X)
    ref = jax.grad(lambda x: jnp.sum(jnp.tanh(jnp.tanh(jnp.tanh(jnp.tanh(x))))))(X)
    assert rel_err(g, ref) <= 1e-5


@pytest.mark.slow  # ~7 s; tests/test_linen_remat.py keeps mutable collections fast
def test_stack_batch_stats_and_sow_under_remat():
    stack = rlinen.LayerStack(Normed, L, FULL)
    v = stack.init(KEY, X)
    loss = lambda p, m: (lambda out: (jnp.mean(out[0] ** 2), out[1]))(  # noqa: E731
        stack.apply({**v, "params": p}, X, mutable=m))
    (l, upd), g = jax.value_and_grad(loss, has_aux=True)(v["params"], ["batch_stats", "intermediates"])
    ref_run = _unrolled(Normed, v)

    def ref_loss(p):
        y, outs = ref_run({**v, "params": p}, X, ["batch_stats", "intermediates"])
        return jnp.mean(y ** 2), outs
    (l0, outs), g0 = jax.value_and_grad(ref_loss, has_aux=True)(v["params"])
    assert rel_err(g, g0) <= 1e-5
    for i in range(L):
        assert rel_err(upd["batch_stats"][f"h_{i}"], outs[i]["batch_stats"]) <= 1e-6
        assert rel_err(upd["intermediates"][f"h_{i}"], outs[i]["intermediates"]) <= 1e-6
    with pytest.raises(ValueError, match="scan=True.*mutable"):
        sc = rlinen.LayerStack(Normed, L, FULL, scan=True)
        sc.apply(sc.init(KEY, X), X, mutable=["batch_stats"])


class NNXSow(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(C, C, rngs=rngs)

    def __call__(self, x):
        y = self.lin(x)
        self.sow(nnx.Intermediate, "act", y)
        return x + y


def test_nnx_stack_names_sow_not_rng():
    stack = rnnx.LayerStack([NNXSow(nnx.Rngs(i)) for i in range(2)], FULL)
    with pytest.raises(ValueError, match="layer 0 added state.*sow") as e:
        stack(X)
    assert "Rngs" not in str(e.value)


# 4. keyword arguments and what a layer returns ------------------------------------------------

class KwLayer(nn.Module):
    @nn.compact
    def __call__(self, x, *, bias, train: bool = True):
        return x + nn.Dense(C)(x) * (0.5 if train else 1.0) + bias


class CacheOut(nn.Module):  # returns (cache, x), as many decoders do
    @nn.compact
    def __call__(self, x):
        return jnp.sum(x), x + nn.Dense(C)(x)


def test_linen_stack_forwards_keyword_arguments():
    stack = rlinen.LayerStack(KwLayer, L, FULL)
    v = stack.init(KEY, X, bias=1.0, train=False)
    g = jax.grad(lambda v, b: jnp.sum(stack.apply(v, X, bias=b, train=False) ** 2), argnums=(0, 1))(v, 1.0)
    ref = jax.grad(lambda v, b: jnp.sum(rlinen.LayerStack(KwLayer, L).apply(v, X, bias=b, train=False) ** 2),
                   argnums=(0, 1))(v, 1.0)
    assert rel_err(g, ref) <= 1e-5


def test_linen_stack_layer_output_selector_and_error():
    bad = rlinen.LayerStack(CacheOut, 2, FULL)
    with pytest.raises(ValueError, match=r"layer 0 \(CacheOut.__call__\(self, x\)\) returned .* out=lambda y: y\[1\]"):
        bad.init(KEY, X)
    good = rlinen.LayerStack(CacheOut, 2, FULL, out=lambda y: y[1])
    v = good.init(KEY, X)
    ref = X
    for i in range(2):
        ref = CacheOut().apply({"params": v["params"][f"h_{i}"]}, ref)[1]
    assert rel_err(good.apply(v, X), ref) <= 1e-6


@pytest.mark.parametrize("out", [None, lambda y: y[1]], ids=["plain", "selector"])
def test_linen_stack_reentrant_backward_after_the_call_returns(out):
    # The reentrant backward re-runs the layers after the stack's call has returned: a name the
    # layer closure reads (the `out` selector) must still be the selector then, not the result.
    layer = CacheOut if out is not None else KwLayer
    kw = {} if out is not None else {"bias": 1.0, "train": False}
    reentrant = RecomputeConfig(granularity="full", use_reentrant=True)
    stack = rlinen.LayerStack(layer, 2, reentrant, out=out)
    v = stack.init(KEY, X, **kw)
    g = jax.grad(lambda v: jnp.sum(stack.apply(v, X, **kw) ** 2))(v)
    plain = rlinen.LayerStack(layer, 2, out=out)
    ref = jax.grad(lambda v: jnp.sum(plain.apply(v, X, **kw) ** 2))(v)
    assert rel_err(g, ref) <= 1e-5


class NNXKw(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(C, C, rngs=rngs)

    def __call__(self, x, *, scale):
        return scale, x + scale * self.lin(x)


def test_nnx_stack_keyword_arguments_and_output_selector():
    layers = lambda: [NNXKw(nnx.Rngs(i)) for i in range(L)]  # noqa: E731
    with pytest.raises(ValueError, match=r"layer 0 \(NNXKw.__call__\(self, x, \*, scale\)\) returned"):
        rnnx.LayerStack(layers(), FULL)(X, scale=0.5)
    loss = lambda m: jnp.mean(m(X, scale=0.5) ** 2)  # noqa: E731
    g = nnx.grad(loss)(rnnx.LayerStack(layers(), FULL, out=lambda y: y[1]))
    ref = nnx.grad(loss)(rnnx.LayerStack(layers(), RecomputeConfig(), out=lambda y: y[1]))
    assert rel_err(nnx.state(g), nnx.state(ref)) <= 1e-5


# 5. checkpoint on closures, pytree callables, keyword arguments -------------------------------

W = jax.random.normal(KEY, (C, C)) / C ** 0.5


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_of_a_closure_over_weights(reentrant):
    def loss(w):
        block = lambda x: jnp.tanh(x @ w)  # noqa: E731  (w closed over, the PyTorch habit)
        return jnp.sum(remat.checkpoint(block, use_reentrant=reentrant)(X) ** 2)
    ref = jax.grad(lambda w: jnp.sum(jnp.tanh(X @ w) ** 2))(W)
    assert rel_err(jax.grad(loss)(W), ref) <= 1e-5
    assert rel_err(jax.jit(jax.grad(loss))(W), ref) <= 1e-5


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Linear:  # an Equinox-style module: a callable pytree carrying its weights
    w: jax.Array

    def __call__(self, x, *, train=True):
        return jnp.tanh(x @ self.w) * (0.9 if train else 1.0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_of_pytree_callables_with_keywords(reentrant):
    ref = jax.grad(lambda m: jnp.sum(m(X, train=False) ** 2))(Linear(W))
    g = jax.grad(lambda m: jnp.sum(remat.checkpoint(m, use_reentrant=reentrant, static_argnames="train")(X, train=False) ** 2))(Linear(W))
    assert rel_err(g.w, ref.w) <= 1e-5
    lin = nnx.Linear(C, C, rngs=nnx.Rngs(0))  # an NNX module is a pytree too
    g = nnx.grad(lambda m: jnp.sum(remat.checkpoint(m, use_reentrant=reentrant)(X) ** 2))(lin)
    ref = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(lin)
    assert rel_err(nnx.state(g), nnx.state(ref)) <= 1e-5


# 7. user tag names ----------------------------------------------------------------------------

def test_user_tag_names_register_and_save():
    with pytest.raises(ValueError, match=r"remat.names.register\('my_query'\)"):
        policies.get("save_names:my_query")
    names.register("my_query")
    f = lambda w, x: jnp.sum(jnp.sin(checkpoint_name(x @ w, "my_query")))  # noqa: E731
    saved = saved_residuals(jax.checkpoint(f, policy=policies.get("save_names:my_query")), W, X[0]).by_name()
    assert "my_query" in saved
    assert policies.by_name("custom:my_query=offload").offload == frozenset({"my_query"})


# 6. NNX scan, parameter paths, layer axis -----------------------------------------------------

class NNXBlk(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(C, 2 * C, rngs=rngs), nnx.Linear(2 * C, C, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x, *, scale=1.0):
        return x + scale * self.drop(self.b(jax.nn.gelu(self.a(x))))


@pytest.mark.parametrize("cfg", [RecomputeConfig(), FULL,
                                 pytest.param(RecomputeConfig(granularity="full", method="uniform", num_layers=2),
                                              marks=pytest.mark.slow)])
@pytest.mark.slow  # ~6 s each; tests/test_nnx_stack_scan.py keeps scan against loop fast
def test_nnx_stack_scan_matches_loop(cfg):
    make = lambda scan: rnnx.LayerStack([NNXBlk(nnx.Rngs(i)) for i in range(L)], cfg, scan=scan)  # noqa: E731
    key = jax.random.key(3)
    loss = lambda m: jnp.mean(m(X, key=key, scale=0.5) ** 2)  # noqa: E731
    g_loop, g_scan = nnx.grad(loss)(make(False)), nnx.grad(loss)(make(True))
    # the scanned stack holds its layers stacked (layers/... of shape (L, ...)): sliced per layer
    g_scan = rnnx.unstack_layers({"s": nnx.state(g_scan, nnx.Param)}, stack="s", scan=True)["s"]
    assert rel_err(jax.tree.leaves(g_scan), jax.tree.leaves(nnx.state(g_loop, nnx.Param)["layers"])) <= 1e-5
    ref = nnx.grad(loss)(rnnx.LayerStack([NNXBlk(nnx.Rngs(i)) for i in range(L)], RecomputeConfig()))
    assert rel_err(jax.tree.leaves(g_scan), jax.tree.leaves(nnx.state(ref, nnx.Param)["layers"])) <= 1e-5


class Named(nn.Module):  # the user's own model: blocks named block_i
    @nn.compact
    def __call__(self, x):
        for i in range(L):
            x = KwLayer(name=f"block_{i}")(x, bias=0.0)
        return x


class Stacked(nn.Module):
    scan: bool

    @nn.compact
    def __call__(self, x):
        return rlinen.LayerStack(KwLayer, L, FULL, scan=self.scan, name="blocks")(x, bias=0.0)


@pytest.mark.parametrize("scan", [False, True])
def test_existing_parameters_map_to_a_stack_and_back(scan):
    old = Named().init(KEY, X)["params"]
    new = {"blocks": rlinen.stack_layers([old[f"block_{i}"] for i in range(L)], scan=scan)}
    assert jax.tree.structure(new) == jax.tree.structure(Stacked(scan).init(KEY, X)["params"])
    assert rel_err(Stacked(scan).apply({"params": new}, X), Named().apply({"params": old}, X)) <= 1e-6
    back = rlinen.unstack_layers(new["blocks"])
    assert rel_err({f"block_{i}": b for i, b in enumerate(back)}, old) == 0.0


class Sharded(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")), (C, C))
        return x + jnp.tanh(x @ w)


def test_scan_adds_the_layer_axis_to_partitioning_metadata():
    v = rlinen.LayerStack(Sharded, L, FULL, scan=True).init(KEY, X)
    box = v["params"]["h"]["w"]
    assert box.names == ("layers", "embed", "mlp") and box.value.shape == (L, C, C)
    assert nn.get_partition_spec(v)["params"]["h"]["w"] == jax.sharding.PartitionSpec("layers", "embed", "mlp")
    loop = rlinen.LayerStack(Sharded, L, FULL).init(KEY, X)
    g = jax.grad(lambda p: jnp.sum(rlinen.LayerStack(Sharded, L, FULL, scan=True).apply(p, X)))(v)
    g0 = jax.grad(lambda p: jnp.sum(rlinen.LayerStack(Sharded, L).apply(p, X)))(loop)
    assert rel_err(nn.unbox(g)["params"]["h"]["w"][2], nn.unbox(g0)["params"]["h_2"]["w"]) <= 1e-5
