"""Gradient equality for every recompute setting on a 4-layer stack: plain JAX, Flax Linen, Flax NNX.

Every granularity x method x N in {1,2,3} x reentrant x policy name, against the same stack with no
remat, float32, max|dg| <= 1e-5 max|g|. Run eagerly (fast for tiny shapes), plus a jitted subset.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import remat
from remat import RecomputeConfig, policies
from remat import linen as rlinen
from remat import nnx as rnnx
from tinyblocks import B, C, T, LinenBlock, NNXBlock, block, init_block, rel_err

L = 4
KEY = jax.random.PRNGKey(0)
X = jax.random.normal(KEY, (B, T, C))
PS = [init_block(k) for k in jax.random.split(KEY, L)]


def _settings():
    out = [RecomputeConfig()]
    methods = [("none", 1)] + [(m, n) for m in ("uniform", "block") for n in (1, 2, 3)]
    for m, n in methods:
        out.append(RecomputeConfig(granularity="full", method=m, num_layers=n, use_reentrant=True))
        for pol in (None,) + policies.examples():
            out.append(RecomputeConfig(granularity="full", method=m, num_layers=n, policy=pol))
    for mods in ("core_attn", "mlp", "norm", "core_attn,mlp,norm"):
        out.append(RecomputeConfig(granularity="selective", modules=mods))
    return out


SETTINGS = _settings()
# The fast default runs, on plain functions, every method with the default policy and every policy
# with method none, and on Linen and NNX every method with the default policy; the full product
# runs with `-m slow` (make test-all). All of them go through the same code path (apply_layers).
CORE = [c for c in SETTINGS if c.policy is None]
REST = [c for c in SETTINGS if c.policy is not None]
IDS = [f"{c.granularity}-{c.method}{c.num_layers}-{'re' if c.use_reentrant else c.policy or 'default'}"
       f"{'-' + '+'.join(c.modules) if c.granularity == 'selective' else ''}" for c in SETTINGS]


def plain_loss(ps, x, cfg, scan=False):
    if scan:
        ps = jax.tree.map(lambda *a: jnp.stack(a), *ps)
    return jnp.mean(remat.apply_layers(lambda p, h, k: block(p, h), ps, x, cfg, scan=scan) ** 2)


PLAIN_REF = jax.grad(plain_loss)(PS, X, RecomputeConfig())


_NO_REMAT_SAVED = {}  # stack -> bytes saved without remat (traced once per stack)


def _falls(stack: str, saved, cfg):
    """What JAX saves for the backward (`remat.memory.saved_residuals`) under `cfg` is less than
    without remat: a stack that ignored its config would keep as much."""
    if cfg.enabled:
        if stack not in _NO_REMAT_SAVED:
            _NO_REMAT_SAVED[stack] = saved(RecomputeConfig())
        assert saved(cfg) < _NO_REMAT_SAVED[stack], cfg


def _plain_saved(cfg, scan=False):
    return remat.memory.saved_residuals(lambda ps, x: plain_loss(ps, x, cfg, scan), PS, X).total


def _plain_params():
    # fast: every method with the default policy, every policy with method none; the rest slow
    # (offload_names with the slow set too: tests/test_offload_targets.py keeps offload fast)
    fast = lambda c: (c.policy is None or c.method == "none") and not str(c.policy).startswith("offload_names")
    return [pytest.param(c, id=i, marks=() if fast(c) else pytest.mark.slow) for c, i in zip(SETTINGS, IDS)]


@pytest.mark.parametrize("cfg", _plain_params())
def test_plain_functions(cfg):
    assert rel_err(jax.grad(plain_loss)(PS, X, cfg), PLAIN_REF) <= 1e-5
    _falls("plain", _plain_saved, cfg)


def _linen(cfg, scan=False):
    return rlinen.LayerStack(LinenBlock, L, cfg, scan=scan)


LINEN_VARS = _linen(RecomputeConfig()).init(KEY, X)
LINEN_SCAN_VARS = {"params": {"h": jax.tree.map(lambda *a: jnp.stack(a),
                                                *[LINEN_VARS["params"][f"h_{i}"] for i in range(L)])}}


def _linen_grad(cfg, scan=False):
    v = LINEN_SCAN_VARS if scan else LINEN_VARS
    return jax.grad(lambda v: jnp.mean(_linen(cfg, scan).apply(v, X) ** 2))(v)


LINEN_REF = _linen_grad(RecomputeConfig())


def _params(cfgs):
    # fast: CORE without num_layers 3 (1 and 2 exercise the same grouping code) and without the
    # reentrant path (test_plain_functions and test_jitted run it fast); the rest slow
    fast = lambda c: c.num_layers != 3 and not c.use_reentrant
    return [pytest.param(c, id=IDS[SETTINGS.index(c)], marks=() if fast(c) else pytest.mark.slow) for c in CORE] + \
        [pytest.param(c, id=IDS[SETTINGS.index(c)], marks=pytest.mark.slow) for c in REST]


def _linen_saved(cfg, scan=False):
    v = LINEN_SCAN_VARS if scan else LINEN_VARS
    return remat.memory.saved_residuals(lambda v: jnp.mean(_linen(cfg, scan).apply(v, X) ** 2), v).total


@pytest.mark.parametrize("cfg", _params(SETTINGS))
def test_linen_stack(cfg):
    assert rel_err(_linen_grad(cfg), LINEN_REF) <= 1e-5
    _falls("linen", _linen_saved, cfg)


SCAN_SETTINGS = [c for c in SETTINGS if c.policy in (None, "core_attn")]


def _scan_params():
    # fast: method none and every method at num_layers 2 with the default policy (non-reentrant), and
    # the three selective presets together; num_layers 1 and 3, the reentrant path, each preset alone
    # and core_attn run with `-m slow`
    # (of the selective presets only all three together: each alone is the same stack with fewer names)
    fast = lambda c: (c.policy is None and not c.use_reentrant and (c.num_layers == 2 or c.method == "none")
                      and (c.granularity != "selective" or len(c.modules) == 3) and c.method != "block")
    return [pytest.param(c, id=IDS[SETTINGS.index(c)], marks=() if fast(c) else pytest.mark.slow) for c in SCAN_SETTINGS]


@pytest.mark.parametrize("cfg", _scan_params())
def test_linen_stack_scan(cfg):
    g = _linen_grad(cfg, scan=True)["params"]["h"]
    ref = jax.tree.map(lambda *a: jnp.stack(a), *[LINEN_REF["params"][f"h_{i}"] for i in range(L)])
    assert rel_err(g, ref) <= 1e-5
    _falls("linen-scan", lambda c: _linen_saved(c, scan=True), cfg)


def test_linen_param_tree_does_not_depend_on_the_recompute_setting():
    shapes = lambda cfg: jax.tree.map(jnp.shape, _linen(cfg).init(KEY, X))
    base = shapes(RecomputeConfig())
    for cfg in SETTINGS[::7]:
        assert shapes(cfg) == base


def _nnx_model(cfg):
    return rnnx.LayerStack([NNXBlock(nnx.Rngs(i)) for i in range(L)], cfg)


NNX_REF = nnx.grad(lambda m: jnp.mean(m(X) ** 2))(_nnx_model(RecomputeConfig()))


@pytest.mark.parametrize("cfg", _params(SETTINGS))
def test_nnx_stack(cfg):
    g = nnx.grad(lambda m: jnp.mean(m(X) ** 2))(_nnx_model(cfg))
    assert rel_err(nnx.state(g), nnx.state(NNX_REF)) <= 1e-5

    def saved(c):
        graphdef, state = nnx.split(_nnx_model(c))
        return remat.memory.saved_residuals(lambda s: jnp.mean(nnx.merge(graphdef, s)(X) ** 2), state).total
    _falls("nnx", saved, cfg)


JIT_SETTINGS = [RecomputeConfig(granularity="full", method=m, num_layers=n, use_reentrant=r)
                for m, n in (("none", 1), ("uniform", 3), ("block", 2)) for r in (False, True)]


def _jit_params():
    # fast: one case per method, covering the loop and scan and both paths: none non-reentrant in the
    # loop, uniform (a remainder region) reentrant under scan, block non-reentrant under scan; the
    # rest slow (test_plain_functions runs every method on both paths eagerly)
    picks = {("none", False, False)}  # uniform and block under scan: with the slow set (test_linen_stack_scan)
    for c in JIT_SETTINGS:
        for scan in (False, True):
            fast = (c.method, c.use_reentrant, scan) in picks
            yield pytest.param(c, scan, id=f"{c.method}{c.num_layers}-re{int(c.use_reentrant)}-{scan}",
                               marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("cfg, scan", list(_jit_params()))
def test_jitted(cfg, scan):
    g = jax.jit(jax.grad(plain_loss), static_argnums=(2, 3))(PS, X, cfg, scan)
    assert rel_err(g, PLAIN_REF) <= 1e-5


def test_remat_module_counts_self_as_argument_zero():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, square: bool):
            y = nn.Dense(C)(x)
            return jnp.tanh(y) ** 2 if square else jnp.tanh(y)

    class Stack(nn.Module):
        policy: str | None

        @nn.compact
        def __call__(self, x):
            blk = rlinen.remat_module(Block, policy=self.policy, static_argnums=(2,)) if self.policy else Block
            for i in range(L):
                x = blk(name=f"b{i}")(x, i % 2 == 0)  # a Python bool: must be static
            return x

    v = Stack(None).init(KEY, X)
    ref = jax.grad(lambda v: jnp.sum(Stack(None).apply(v, X)))(v)
    for pol in ("full", "dots"):
        g = jax.jit(jax.grad(lambda v: jnp.sum(Stack(pol).apply(v, X))))(v)
        assert rel_err(g, ref) <= 1e-5


def test_uniform_keeps_fewer_region_inputs_than_method_none():
    saved = lambda cfg: remat.memory.saved_residuals(lambda ps, x: plain_loss(ps, x, cfg), PS, X).total
    assert saved(RecomputeConfig(granularity="full", method="uniform", num_layers=2)) < \
        saved(RecomputeConfig(granularity="full")) < saved(RecomputeConfig())


@pytest.mark.slow  # ~7 s; tests/test_models.py test_scan_matches_loop stays fast
def test_loop_and_scan_layouts_initialize_the_same_weights():
    loop = _linen(RecomputeConfig()).init(KEY, X)["params"]
    scan = _linen(RecomputeConfig(granularity="full"), scan=True).init(KEY, X)["params"]["h"]
    for i in range(L):
        assert rel_err(jax.tree.map(lambda a: a[i], scan), loop[f"h_{i}"]) == 0.0


MIXED = RecomputeConfig(granularity="full", layers=remat.per_layer((None, "full", "mlp", "core_attn+mlp")))


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])  # scan: ~11 s
def test_per_layer_policies(scan):
    assert [s.checkpointed for s in MIXED.split(L)] == [False, True, True, True]
    assert rel_err(jax.grad(plain_loss)(PS, X, MIXED, scan), PLAIN_REF) <= 1e-5
    with pytest.raises(ValueError, match="one per layer"):
        MIXED.validate_for(L + 1)
    with pytest.raises(ValueError, match="pass only one"):
        RecomputeConfig(granularity="full", method="uniform", num_layers=2, layers=remat.per_layer((None,) * 4))
