"""One set of recompute rules: the library (`RecomputeConfig`) and train.py's flags accept and refuse
exactly the same combinations of recompute settings, because the CLI only maps flags to the library.

The grid (648 settings) is every combination of a granularity, which layers are regions (method and
num_layers, segments, every, DeepSpeed's number_checkpoints, and two of them at once), what a region
saves (policy, modules, use_reentrant) and where region inputs wait (offload_inputs,
shard_inputs), each built through the Python API and through train.py's parser in-process, with
two spellings of the granularity (configs only: nothing is compiled; about 2 s). train.py has no flag
for determinism_check; its rule is checked on the library's two entry points below.
"""
import dataclasses
import itertools
import json

import jax.numpy as jnp
import pytest

import remat

from remat import RecomputeConfig
from remat.config import RecomputeConfigError
from remat_lm.training import UsageError
from remat_lm.training.config import TrainConfig, build_parser
from remat_lm.training.flags import FIELD_FLAGS, flag_error

GRANULARITIES = ("none", "full", "selective")
# which layers are regions: Megatron's method/num_layers or one other spelling (and two at once)
LAYERS = (dict(), dict(num_layers=2), dict(method="uniform", num_layers=2), dict(method="block", num_layers=1),
          dict(method="uniform", num_layers=0), dict(layers=remat.segments("0-2")), dict(layers=remat.every(2)),
          dict(layers=remat.count(2)), dict(layers=remat.every(2), method="uniform", num_layers=2))
# what a region saves
SAVES = (dict(), dict(policy="dots"), dict(modules="mlp"), dict(modules="mlp", policy="dots"),
         dict(use_reentrant=True), dict(use_reentrant=True, policy="dots"))
# where region inputs wait
WAITS = (dict(), dict(offload_inputs=True), dict(shard_inputs="tensor"),
         dict(offload_inputs=True, shard_inputs="tensor"))


def grid():
    """RecomputeConfig keyword dicts: granularity x LAYERS x SAVES x WAITS (648)."""
    for g, layers, saves, waits in itertools.product(GRANULARITIES, LAYERS, SAVES, WAITS):
        yield dict(granularity=g, **layers, **saves, **waits)


def argv(kw: dict, ds_path: str, spelled: bool) -> list:
    """The train.py flags that ask for the setting `kw` (`spelled`: with --recompute_granularity, else
    through --activation_recompute where that means the same)."""
    g = kw["granularity"]
    out = ["--recompute_granularity", g] if spelled or g == "none" else ["--activation_recompute"]
    if not spelled and g == "selective":
        out += ["--recompute_granularity", "selective"]
    flags = dict(method="--recompute_method", num_layers="--recompute_num_layers", policy="--remat_policy",
                 modules="--recompute_modules", segments="--recompute_segments", every="--recompute_every")
    layers = kw.get("layers")
    values = {**kw, **({layers.field: layers.value()} if layers is not None else {})}
    out += [a for k, f in flags.items() if k in values
            for a in (f, ",".join(f"{a}-{b}" for a, b in values[k]) if k == "segments" else str(values[k]))]
    if kw.get("use_reentrant"):
        out.append("--use_reentrant")
    if kw.get("offload_inputs"):
        out.append("--cpu_checkpointing")
    if "regions" in values:
        out += ["--deepspeed_config", ds_path]
    if "shard_inputs" in kw:
        out += ["--distribute_saved_activations", "--mesh", "tensor=2", "--no-sequence_parallel"]
    return out


def api(kw):
    """None if the library accepts `kw`, else its RecomputeConfigError."""
    try:
        RecomputeConfig(**kw)
    except RecomputeConfigError as e:
        return e
    return None


def cli(parser, args):
    """None if train.py accepts `args`, else its one-line message: `config_from_args` with the parser
    built once (argparse exits 2 for a value outside a flag's choices)."""
    try:
        TrainConfig(**vars(parser.parse_args(args)))
    except UsageError as e:
        return str(e)
    except SystemExit as e:
        assert e.code == 2
        return f"exit {e.code}"
    return None


# The flag that sets each field in the grid's argv (the library's error names the field).
FLAG_OF = {**FIELD_FLAGS, "regions": "--deepspeed_config", "shard_inputs": "--distribute_saved_activations"}


def test_library_and_train_py_accept_and_refuse_the_same_settings(tmp_path):
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps({"activation_checkpointing": {"number_checkpoints": 2}}))
    parser = build_parser()
    differ, unnamed, counts = [], [], {True: 0, False: 0}
    for kw in grid():
        err = api(kw)
        counts[err is None] += 1
        for spelled in (True, False):
            args = argv(kw, str(ds_path), spelled)
            msg = cli(parser, args)
            if (err is None) != (msg is None):
                differ.append(f"{kw}: library {'accepts' if err is None else f'refuses ({err})'}, train.py "
                              f"{'accepts' if msg is None else f'refuses ({msg})'}")
            elif err is not None:
                assert "\n" not in msg and msg.startswith("--"), msg  # one line, led by a flag
                fields = [err.value.field if err.field == "layers" else err.field, *err.fields[1:]]
                flags = [FLAG_OF[f] for f in fields if f in FLAG_OF]
                # it names a flag of the setting the library refused (or train.py's own rule fired
                # first: a DeepSpeed block means granularity full)
                if not any(f in msg for f in flags) and not msg.startswith("--deepspeed_config checkpoints"):
                    unnamed.append(f"{' '.join(args)}: {msg} (library: {err})")
    assert counts[True] > 50 and counts[False] > 300, counts  # the grid holds both kinds
    assert not differ, f"{len(differ)} settings differ, e.g.\n" + "\n".join(differ[:5])
    assert not unnamed, f"{len(unnamed)} messages name none of the flags at fault, e.g.\n" + "\n".join(unnamed[:5])


# ------------------------------------------------------------------------------------------------
# determinism_check: a value that cannot apply is refused, on both entry points alike.

CHECKS = (None, False, True, "structure", "values")


@pytest.mark.parametrize("granularity", ["none", "full", "selective"])
def test_determinism_check_is_accepted_exactly_where_it_applies(granularity):
    x = jnp.ones(3)
    for reentrant, check in itertools.product((False, True), CHECKS):
        kw = dict(granularity=granularity, use_reentrant=reentrant, determinism_check=check)
        can_reenter = granularity == "full" or not reentrant
        # None (the check that applies) and False (none) fit every path; the others only the reentrant one
        applies = check in (None, False) or (reentrant and granularity != "none")
        err = api(kw)
        assert (err is None) == (can_reenter and applies), (kw, err)
        if can_reenter and not applies:
            assert err.field == "determinism_check" and err.value == check, err
            assert ("use_reentrant=True" in str(err)) == (granularity != "none"), err
            assert str(err).startswith("determinism_check: "), err
        if granularity == "full":  # remat.checkpoint: the same rule for one region
            try:
                remat.checkpoint(jnp.sin, use_reentrant=reentrant, determinism_check=check)(x)
            except RecomputeConfigError as e:
                assert not applies and e.field == "determinism_check", e
            else:
                assert applies, kw


# ------------------------------------------------------------------------------------------------
# Which layers are regions: one value, however it is spelled.

SPECS = [  # (layers=..., Megatron's spelling of it if any, a depth, the plan's regions)
    (remat.uniform(2), dict(method="uniform", num_layers=2), 5, [(0, 2), (2, 4), (4, 5)]),
    (remat.block(2), dict(method="block", num_layers=2), 5, [(0, 1), (1, 2)]),
    (remat.every(2), None, 5, [(0, 1), (2, 3), (4, 5)]),
    (remat.segments((0, 3), (3, 5)), None, 6, [(0, 3), (3, 5)]),
    (remat.count(2), None, 5, [(0, 3), (3, 5)]),
    (remat.per_layer((None, "core_attn", "mlp")), None, 3, [(1, 2), (2, 3)]),
]


@pytest.mark.parametrize("spec,megatron,n,regions", SPECS, ids=[repr(s[0]) for s in SPECS])
def test_the_regions_are_one_value(spec, megatron, n, regions):
    by_spec = RecomputeConfig(granularity="full", layers=spec)
    assert by_spec.layers == spec
    if megatron is not None:  # Megatron's method/num_layers is the same value, read back from either
        by_method = RecomputeConfig(granularity="full", **megatron)
        assert by_spec == by_method and by_method.layers == spec
        assert (by_spec.method, by_spec.num_layers) == (megatron["method"], megatron["num_layers"])
    else:
        assert (by_spec.method, by_spec.num_layers) == ("none", 1)
    assert [(s.start, s.stop) for s in by_spec.split(n) if s.checkpointed] == regions
    # dataclasses.replace passes every field back: the repeated spellings agree, so it works...
    assert dataclasses.replace(by_spec, offload_inputs=True).layers == spec
    # ...and a change of granularity that the spec cannot follow is refused, not dropped
    with pytest.raises(RecomputeConfigError, match="applies to granularity full only"):
        dataclasses.replace(by_spec, granularity="selective")
    # two choices of the regions are refused
    with pytest.raises(RecomputeConfigError, match="pass only one") as e:
        RecomputeConfig(granularity="full", layers=spec, method="uniform", num_layers=3)
    assert e.value.fields[0] == "layers"


def test_a_region_spec_validates_itself_naming_its_field():
    with pytest.raises(RecomputeConfigError) as e:
        remat.every(0)
    assert (e.value.field, e.value.value) == ("every", 0)
    assert str(e.value) == "every: must be an integer >= 1 (got 0): every k-th layer is a region"
    with pytest.raises(RecomputeConfigError) as e:
        RecomputeConfig(granularity="full", layers=remat.uniform(4)).validate_for(3)
    assert (e.value.field, e.value.value, e.value.message) == ("num_layers", 4, "4 exceeds n_layer=3; use 1..3")
    with pytest.raises(RecomputeConfigError, match="not a region spec"):
        RecomputeConfig(granularity="full", layers=2)
    with pytest.raises(RecomputeConfigError, match="applies to granularity full only"):
        RecomputeConfig(layers=remat.uniform(2))


def test_the_cli_puts_the_flags_of_the_fields_before_the_library_message():
    with pytest.raises(RecomputeConfigError) as e:
        RecomputeConfig(granularity="full", method="uniform", num_layers=2, layers=remat.every(2))
    err = e.value
    assert err.fields == ("layers", "method") and err.value == remat.every(2)
    assert str(err) == "layers: every(2) and method uniform each say which layers are regions; pass only one"
    assert flag_error(err) == ("--recompute_every and --recompute_method: every(2) and method uniform each say "
                               "which layers are regions; pass only one")
    with pytest.raises(RecomputeConfigError) as e:
        remat.uniform(0)
    assert flag_error(e.value) == ("--recompute_num_layers: must be >= 1 (got 0): the number of layers per region "
                                   "of method uniform")
