"""Manual segments, every-k and N regions: plan(), validation, gradients on every stack, saved bytes.

`layers=remat.segments((0, 3), (3, 5))` is the tutorial's ManualCheckpoint (layers [0,3) and [3,5));
gaps are not rematerialized. `remat.every(k)`: layers 0, k, 2k, ... are regions of one layer, the
rest plain. `remat.count(N)` (DeepSpeed's number_checkpoints): N contiguous regions of near-equal size.
"""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import remat
from remat import RecomputeConfig, Segment
from remat import linen as rlinen
from remat import nnx as rnnx
from remat.stack import _runs
from tinyblocks import B, C, T, LinenBlock, NNXBlock, block, init_block, rel_err

L = 5
KEY = jax.random.PRNGKey(0)
X = jax.random.normal(KEY, (B, T, C))
PS = [init_block(k) for k in jax.random.split(KEY, L)]
full = lambda **kw: RecomputeConfig(granularity="full", **kw)


@pytest.mark.parametrize("cfg,n,want", [
    (full(layers=remat.segments((0, 3), (3, 5))), 5, [(0, 3, True), (3, 5, True)]),
    (full(layers=remat.segments("1-2,3-4")), 6,
     [(0, 1, False), (1, 2, True), (2, 3, False), (3, 4, True), (4, 6, False)]),
    (full(layers=remat.every(2)), 5, [(0, 1, True), (1, 2, False), (2, 3, True), (3, 4, False), (4, 5, True)]),
    (full(layers=remat.every(3)), 4, [(0, 1, True), (1, 3, False), (3, 4, True)]),
    (full(layers=remat.every(1)), 3, [(0, 1, True), (1, 2, True), (2, 3, True)]),
    (full(layers=remat.count(2)), 5, [(0, 3, True), (3, 5, True)]),
    (full(layers=remat.count(4)), 6, [(0, 2, True), (2, 4, True), (4, 5, True), (5, 6, True)]),
])
def test_plan(cfg, n, want):
    assert cfg.split(n) == tuple(Segment(*w) for w in want)


@pytest.mark.parametrize("build,needle", [
    (lambda: remat.segments("0-3,2-5"), "segments: (2, 5) is not valid"),
    (lambda: remat.segments("3-1"), "start < stop"),
    (lambda: remat.segments("0-3;3-5"), "'0-3;3-5' is not START-STOP"),
    (lambda: remat.segments("²-3"), "'²-3' is not START-STOP"),  # '²'.isdigit() is True
    (lambda: remat.segments(), "empty"),
    (lambda: remat.segments((0, "a")), "is not valid"),
    (lambda: RecomputeConfig(layers=remat.segments("0-3")), "applies to granularity full only"),
    (lambda: full(method="uniform", num_layers=2, layers=remat.every(2)), "pass only one"),
    (lambda: RecomputeConfig(granularity="selective", layers=remat.every(2)), "applies to granularity full only"),
    (lambda: remat.every(0), "every: must be an integer >= 1 (got 0)"),
    (lambda: remat.count(-1), "regions: must be an integer >= 1 (got -1)"),
    (lambda: full(layers=(0, 3)), "is not a region spec"),
])
def test_bad_settings_name_the_field_and_what_is_valid(build, needle):
    with pytest.raises(ValueError) as e:
        build()
    assert needle in str(e.value)


@pytest.mark.parametrize("cfg,needle", [
    (full(layers=remat.segments("0-3,3-6")),
     "segments: 0-3,3-6 reaches layer 6 but n_layer=5; stops must be <= 5"),
    (full(layers=remat.every(6)), "every: 6 exceeds n_layer=5; use 1..5"),
    (full(layers=remat.count(6)), "exceeds n_layer=5; use 1..5"),
])
def test_validate_for_the_depth(cfg, needle):
    with pytest.raises(ValueError) as e:
        cfg.split(L)
    assert needle in str(e.value)


def plain_loss(ps, x, cfg, scan=False):
    if scan:
        ps = jax.tree.map(lambda *a: jnp.stack(a), *ps)
    return jnp.mean(remat.apply_layers(lambda p, h, k: block(p, h), ps, x, cfg, scan=scan) ** 2)


REF = jax.grad(plain_loss)(PS, X, RecomputeConfig())
SETTINGS = [full(layers=remat.segments("0-3,3-5")), full(layers=remat.segments("1-2,3-4")),
            full(layers=remat.every(2)), full(layers=remat.count(2)), full(layers=remat.every(2), use_reentrant=True)]
IDS = ["seg0-3,3-5", "seg1-2,3-4", "every2", "regions2", "every2-reentrant"]
FAST = {("seg1-2,3-4", False)}  # a gap in the loop; the grouped every-k scan: test_gradients_jitted


@pytest.mark.parametrize("scan,cfg", [
    pytest.param(scan, cfg, id=f"{i}-{'scan' if scan else 'loop'}",
                 marks=() if (i, scan) in FAST else pytest.mark.slow)
    for scan in (False, True) for cfg, i in zip(SETTINGS, IDS)])
def test_gradients_plain_loop_and_scan(cfg, scan):
    g = jax.grad(plain_loss)(PS, X, cfg, scan)  # eager: fast for tiny shapes
    assert rel_err(g, REF) <= 1e-5
    saved = lambda cfg: remat.memory.saved_residuals(lambda ps, x: plain_loss(ps, x, cfg, scan), PS, X).total
    assert saved(cfg) < saved(RecomputeConfig())  # the regions keep less than no remat


def test_gradients_jitted():
    g = jax.jit(jax.grad(plain_loss), static_argnums=(2, 3))(PS, X, full(layers=remat.every(2)), True)
    assert rel_err(g, REF) <= 1e-5


def test_scan_layout_of_every_k_is_one_scanned_group_not_one_run_per_layer():
    # a region and the k-1 plain layers after it are one group: two runs (the tail) for any depth
    assert _runs(8, full(layers=remat.every(2))) == [(0, 4, ((1, True, "full"), (1, False, None)))]
    assert _runs(5, full(layers=remat.every(2))) == [(0, 2, ((1, True, "full"), (1, False, None))), (4, 1, ((1, True, "full"),))]
    assert len(_runs(64, full(layers=remat.every(4)))) == 1


@pytest.mark.parametrize("scan,cfg", [
    pytest.param(True, full(layers=remat.every(2)), id="scan-every2", marks=pytest.mark.slow),
    pytest.param(False, full(layers=remat.segments("0-3,3-5")), id="loop-seg0-3,3-5"),
    pytest.param(True, full(layers=remat.segments("0-3,3-5")), id="scan-seg0-3,3-5", marks=pytest.mark.slow)])
def test_linen_stack(scan, cfg):
    stack = lambda cfg: rlinen.LayerStack(LinenBlock, L, cfg, scan=scan)
    v = stack(RecomputeConfig()).init(KEY, X)
    grad = lambda cfg: jax.grad(lambda v: jnp.mean(stack(cfg).apply(v, X) ** 2))(v)
    assert rel_err(grad(cfg), grad(RecomputeConfig())) <= 1e-5


def test_nnx_stack():
    model = lambda cfg: rnnx.LayerStack([NNXBlock(nnx.Rngs(i)) for i in range(L)], cfg)
    grad = lambda cfg: nnx.state(nnx.grad(lambda m: jnp.mean(m(X) ** 2))(model(cfg)))
    ref = grad(RecomputeConfig())
    assert rel_err(grad(full(layers=remat.segments("1-2,3-4"))), ref) <= 1e-5


def test_saved_bytes_follow_the_regions():
    saved = lambda cfg: remat.memory.saved_residuals(lambda ps, x: plain_loss(ps, x, cfg), PS, X).total
    none, every1, every2, seg = (saved(c) for c in (RecomputeConfig(), full(layers=remat.every(1)),
                                                   full(layers=remat.every(2)), full(layers=remat.segments("0-3,3-5"))))
    # every 2: layers 1 and 3 keep everything, so between full remat (every 1) and none;
    # two regions keep two inputs, fewer than five one-layer regions
    assert seg < every1 < every2 < none
    # a gap keeps exactly what no remat keeps for those layers: [1,2) and [3,4) as regions equal every=2 here
    assert saved(full(layers=remat.segments("0-1,2-3,4-5"))) == every2
