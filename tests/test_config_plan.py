"""RecomputeConfig validation and plan() semantics (Megatron-Core, with InfiniTrain's `none`)."""
import pytest
from hypothesis import given, settings, strategies as st

from remat import RecomputeConfig, Segment
from remat.config import GRANULARITIES, METHODS


def regions(segs):
    return [(s.start, s.stop) for s in segs if s.checkpointed]


def per_layer(segs):
    return [s.checkpointed for s in segs for _ in range(s.stop - s.start)]


def test_megatron_methods_split_layers_into_regions():
    assert RecomputeConfig(granularity="full", method="uniform", num_layers=3).split(8) == (
        Segment(0, 3, True), Segment(3, 6, True), Segment(6, 8, True))
    assert RecomputeConfig(granularity="full", method="block", num_layers=3).split(8) == (
        Segment(0, 1, True), Segment(1, 2, True), Segment(2, 3, True), Segment(3, 8, False))
    assert RecomputeConfig().split(4) == (Segment(0, 4, False),)
    assert regions(RecomputeConfig(granularity="full").split(5)) == [(i, i + 1) for i in range(5)]
    assert regions(RecomputeConfig(granularity="selective").split(3)) == [(0, 1), (1, 2), (2, 3)]
    assert RecomputeConfig(granularity="full", method="block", num_layers=4).split(4)[-1] == Segment(3, 4, True)


configs = st.one_of(
    st.just(RecomputeConfig()),
    st.just(RecomputeConfig(granularity="full")),
    st.just(RecomputeConfig(granularity="selective")),
    st.builds(lambda m, n: RecomputeConfig(granularity="full", method=m, num_layers=n),
              st.sampled_from(["uniform", "block"]), st.integers(1, 64)),
)


@settings(max_examples=300, deadline=None)
@given(n_layers=st.integers(1, 64), cfg=configs)
def test_segments_tile_layers_and_follow_the_rules(n_layers, cfg):
    if cfg.method in ("uniform", "block") and cfg.num_layers > n_layers:
        with pytest.raises(ValueError, match=f"exceeds n_layer={n_layers}"):
            cfg.split(n_layers)
        return
    segs = cfg.split(n_layers)
    # tiling: contiguous, in order, non-empty, covering 0..n_layers
    assert segs[0].start == 0 and segs[-1].stop == n_layers
    assert all(a.stop == b.start for a, b in zip(segs, segs[1:]))
    assert all(s.stop > s.start for s in segs)
    flags = per_layer(segs)
    if cfg.granularity == "none":
        assert segs == (Segment(0, n_layers, False),)
    elif cfg.granularity == "selective" or cfg.method == "none":
        assert all(s.stop - s.start == 1 and s.checkpointed for s in segs)
    elif cfg.method == "uniform":
        n = cfg.num_layers
        assert all(flags)
        assert [s.stop - s.start for s in segs] == [n] * (n_layers // n) + ([n_layers % n] if n_layers % n else [])
    else:  # block
        n = cfg.num_layers
        assert flags == [True] * n + [False] * (n_layers - n)
        assert all(s.stop - s.start == 1 for s in segs if s.checkpointed)


BAD = [
    (dict(granularity="bogus"), ["granularity: 'bogus'", "none, full, selective"]),
    (dict(granularity="full", method="zigzag"), ["method: 'zigzag'", "none, uniform, block"]),
    (dict(granularity="full", method="uniform", num_layers=0), ["num_layers: ", ">= 1 (got 0)"]),
    (dict(granularity="full", method="block", num_layers=-2), ["num_layers: ", ">= 1 (got -2)"]),
    (dict(granularity="selective", use_reentrant=True), ["use_reentrant", "selective", "saves only"]),
    (dict(granularity="none", method="uniform", num_layers=2), ["granularity none", "granularity full"]),
    (dict(granularity="selective", method="block", num_layers=1), ["applies to granularity full only"]),
    (dict(granularity="full", policy="nope"), ["unknown policy 'nope'", "core_attn"]),
    (dict(granularity="selective", modules=("attention",)), ["attention", "core_attn, mlp, norm"]),
    (dict(granularity="selective", modules=()), ["empty", "core_attn"]),
    (dict(granularity="full", use_reentrant=True, policy="dots"), ["policy 'dots'", "reentrant"]),
    (dict(granularity="full", determinism_check="maybe"), ["determinism_check: 'maybe'"]),
    (dict(granularity="full", determinism_check="values"), ["needs use_reentrant=True"]),
    (dict(granularity="full", policy="save_names:nope"), ["nope", "block_input"]),
]


@pytest.mark.parametrize("kw,needles", BAD, ids=[str(k) for k, _ in BAD])
def test_bad_config_message_names_field_value_and_fix(kw, needles):
    with pytest.raises(ValueError) as e:
        RecomputeConfig(**kw)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_validate_for_rejects_num_layers_above_depth():
    with pytest.raises(ValueError, match=r"num_layers: 5 exceeds n_layer=4; use 1..4"):
        RecomputeConfig(granularity="full", method="uniform", num_layers=5).validate_for(4)
    assert RecomputeConfig(granularity="full", method="block", num_layers=4).validate_for(4)


def test_modules_accept_comma_string_and_effective_policy():
    cfg = RecomputeConfig(granularity="selective", modules="core_attn, mlp")
    assert cfg.modules == ("core_attn", "mlp")
    assert cfg.effective_policy() == "core_attn+mlp"
    assert RecomputeConfig(granularity="full").effective_policy() == "full"
    assert RecomputeConfig(granularity="full", policy="dots").effective_policy() == "dots"
    assert RecomputeConfig().effective_policy() is None
    assert RecomputeConfig(granularity="full", use_reentrant=True).effective_policy() is None


def test_config_is_frozen_and_hashable():
    cfg = RecomputeConfig(granularity="full")
    with pytest.raises(Exception):
        cfg.granularity = "none"
    assert hash(cfg) == hash(RecomputeConfig(granularity="full"))
    assert set(GRANULARITIES) == {"none", "full", "selective"} and set(METHODS) == {"none", "uniform", "block"}
