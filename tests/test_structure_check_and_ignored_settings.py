"""Trust at the edges of the library: the structure check and settings that would be ignored.

The planted faults are real mechanisms: Python counters and iterators that make a function trace
differently the second time (a changed constant, op, shape, dtype, closed-over array or wiring).
Nothing is flipped by the test between the forward and the backward.
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat
import train
from remat import RecomputeConfig, apply_layers
from remat.config import RecomputeConfigError
from remat_lm.training.config import UsageError, config_from_args

X = jnp.linspace(-2.0, 2.0, 32)
STRUCTURE = dict(use_reentrant=True, determinism_check="structure")


def _grad(f, x=X, jit=False, **opts):
    loss = lambda x: jnp.sum(remat.checkpoint(f, name="blk", **{**STRUCTURE, **opts})(x))
    return (jax.jit(jax.grad(loss)) if jit else jax.grad(loss))(x)


# ------------------------------------------------------------------------------------------------
# 1. The structure check sees every kind of change, on both paths that use it.

def _counter_fn():
    counter = itertools.count(1)
    return lambda x: jnp.sin(x) * float(next(counter))  # the second trace multiplies by 2


@pytest.mark.parametrize("check", ["structure", True])
@pytest.mark.parametrize("jit", [False, True])
def test_the_counter_function_raises_under_structure(jit, check):
    # A check that ignored literal values would return 2·cos x for cos x here.
    with pytest.raises(remat.CheckpointError, match=r"'blk'.*different program.*1\.0.*2\.0"):
        _grad(_counter_fn(), jit=jit, determinism_check=check)


@pytest.mark.parametrize("scan", [False, True])
def test_the_counter_function_raises_on_the_layer_stack(scan):
    # The stack path: apply_layers → remat.checkpoint once per region, with the config's check.
    counter = itertools.count(1)
    layer = lambda w, h, key: jnp.sin(h @ w) * float(next(counter))
    ws = jnp.stack([jnp.eye(4) * 0.5] * 2) if scan else [jnp.eye(4) * 0.5] * 2
    cfg = RecomputeConfig(granularity="full", use_reentrant=True, determinism_check="structure")
    loss = lambda ws: jnp.sum(apply_layers(layer, ws, jnp.ones((2, 4)), cfg, scan=scan))
    with pytest.raises(remat.CheckpointError, match="different program"):
        jax.grad(loss)(ws)


def _second_trace_differs(first, second):
    """A function whose first trace is `first` and every later one `second` (a counter)."""
    traces = itertools.count()
    return lambda x: (first if next(traces) == 0 else second)(x)


CONST_A, CONST_B = np.arange(32.0, dtype=np.float32), np.arange(32.0, dtype=np.float32)[::-1].copy()
KINDS = {  # each change keeps the output's shape and dtype: only the structure check can see it
    "op": (jnp.tanh, jnp.sin, ["tanh", "sin"]),
    "shape": (lambda x: jnp.sin(x.reshape(4, 8)).reshape(32), lambda x: jnp.sin(x.reshape(8, 4)).reshape(32),
              ["float32[4,8]", "float32[8,4]"]),
    "dtype": (lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
              lambda x: x.astype(jnp.float16).astype(jnp.float32), ["bfloat16[32]", "float16[32]"]),
    "literal": (lambda x: jnp.sin(x) * 1.0, lambda x: jnp.sin(x) * 2.0, ["1.0", "2.0"]),
    "closed-over constant array": (lambda x: x * CONST_A, lambda x: x * CONST_B, ["const", "float32[32]#"]),
    "wiring": (lambda x: jnp.sin(x) - jnp.cos(x), lambda x: (lambda s, c: c - s)(jnp.sin(x), jnp.cos(x)),
               ["sub"]),
}


@pytest.mark.parametrize("kind", KINDS)
def test_structure_check_sees_each_kind_of_change(kind):
    first, second, needles = KINDS[kind]
    f = _second_trace_differs(first, second)
    with pytest.raises(remat.CheckpointError) as e:
        _grad(f)
    for n in needles:
        assert n in str(e.value), str(e.value)
    # ...which the aval check alone (the default) lets through; an explicit True is the structure check
    _grad(_second_trace_differs(first, second), determinism_check=None)
    with pytest.raises(remat.CheckpointError):
        _grad(_second_trace_differs(first, second), determinism_check=True)


def test_what_the_structure_check_cannot_see_still_gets_the_forwards_gradient():
    # A closed-over tracer of an enclosing jit: its value is unknown at trace time, so two different
    # tracers of the same shape look alike. No error, and the gradient is still the forward's:
    # cos(x)·a, not cos(x)·b. The structure check differentiates the forward's own program; without
    # it the closed-over values are hoisted from the forward's trace (as jax.closure_convert
    # does), so the backward sees the same `a`.
    def grad_of(check):
        @jax.jit
        def g(x, a, b):
            pick = iter([a, b, b])
            f = lambda x: jnp.sin(x) * next(pick)
            return _grad(f, x, determinism_check=check)
        return g(X, jnp.full(32, 1.0), jnp.full(32, 3.0))

    want = jnp.cos(X)
    np.testing.assert_allclose(grad_of("structure"), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad_of(True), want, rtol=1e-6, atol=1e-6)  # hoisted: the forward's `a`


def test_structure_check_passes_deterministic_layer_stacks_with_exact_gradients():
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 8)) * 0.3
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8))
    layer = lambda w, h, key: h + jnp.tanh(h @ w) * 0.5
    for scan in (False, True):
        ws = w if scan else list(w)
        loss = lambda ws, cfg: jnp.sum(apply_layers(layer, ws, x, cfg, scan=scan) ** 2)
        ref = jax.grad(loss)(ws, RecomputeConfig())
        got = jax.grad(loss)(ws, RecomputeConfig(granularity="full", use_reentrant=True,
                                                 determinism_check="structure"))
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
            # float32 rounding only: the same program, evaluated once more
            assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(a)))


@pytest.mark.parametrize("check", ["structure", "values"])
def test_a_check_that_cannot_apply_on_the_default_path_is_refused(check):
    # jax.checkpoint traces once and recomputes that program: there is no second trace to compare.
    with pytest.raises(RecomputeConfigError, match="needs use_reentrant=True"):
        remat.checkpoint(jnp.sin, determinism_check=check)(X)
    with pytest.raises(RecomputeConfigError, match="needs use_reentrant=True"):
        RecomputeConfig(granularity="full", determinism_check=check)
    RecomputeConfig(granularity="full", use_reentrant=True, determinism_check=check)
    assert remat.checkpoint(jnp.sin, use_reentrant=True, determinism_check=check)(X).shape == X.shape


def test_the_default_check_still_works_on_both_paths():
    for reentrant in (False, True):
        g = jax.grad(lambda x: jnp.sum(remat.checkpoint(jnp.sin, use_reentrant=reentrant)(x)))(X)
        np.testing.assert_allclose(g, jnp.cos(X), rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# 4. A setting that would be ignored is refused, by the library and by train.py's flags alike.

R = dict
# (RecomputeConfig kwargs, the same setting as train.py flags, words both errors must contain)
IGNORED = [
    (R(granularity="none", policy="dots"), ["--remat_policy", "dots"], ["policy", "dots"]),
    (R(granularity="none", use_reentrant=True), ["--use_reentrant"], ["reentrant"]),
    (R(granularity="none", modules="mlp"), ["--recompute_modules", "mlp"], ["modules", "mlp"]),
    (R(granularity="full", modules=("mlp",)), ["--activation_recompute", "--recompute_modules", "mlp"],
     ["modules", "mlp", "selective"]),
    (R(granularity="selective", modules=("mlp",), policy="dots"),
     ["--recompute_granularity", "selective", "--recompute_modules", "mlp", "--remat_policy", "dots"],
     ["modules", "mlp", "policy", "dots"]),
    (R(granularity="none", num_layers=2), ["--recompute_num_layers", "2"], ["num_layers", "2", "method"]),
    (R(granularity="full", num_layers=2), ["--activation_recompute", "--recompute_num_layers", "2"],
     ["num_layers", "2", "method"]),
    (R(granularity="full", method="none", num_layers=3),
     ["--activation_recompute", "--recompute_method", "none", "--recompute_num_layers", "3"],
     ["num_layers", "3", "method"]),
    (R(granularity="none", method="uniform"), ["--recompute_method", "uniform"], ["method", "uniform"]),
    (R(granularity="none", offload_inputs=True), ["--cpu_checkpointing"], ["offload", "checkpointing"]),
]
WHERE = {"policy": "--remat_policy", "modules": "--recompute_modules", "num_layers": "--recompute_num_layers",
         "method": "--recompute_method", "reentrant": "--use_reentrant", "offload": "--cpu_checkpointing"}
ids = [" ".join(argv) for _, argv, _ in IGNORED]


@pytest.mark.parametrize("kwargs,argv,words", IGNORED, ids=ids)
def test_the_library_refuses_a_setting_it_would_ignore(kwargs, argv, words):
    with pytest.raises(RecomputeConfigError) as e:
        RecomputeConfig(**kwargs)
    assert str(e.value).startswith(e.value.field + ": "), e.value
    assert all(w in str(e.value) for w in words if w not in ("checkpointing",)), e.value


@pytest.mark.parametrize("kwargs,argv,words", IGNORED, ids=ids)
def test_train_py_refuses_the_same_flags_in_flag_words(kwargs, argv, words):
    with pytest.raises(UsageError) as e:
        config_from_args(argv)
    msg = str(e.value)
    assert "\n" not in msg
    flags = {a for a in argv if a.startswith("--") and a not in ("--activation_recompute", "--recompute_granularity")}
    assert len(flags) >= 1 and all(f in msg for f in flags), msg  # names every flag it was given...
    assert "drop" in msg or "add" in msg or "choose" in msg or "pass one" in msg, msg  # ...and the fix


@pytest.mark.parametrize("argv", [
    ["--recompute_num_layers", "2"],
    ["--recompute_granularity", "selective", "--recompute_modules", "mlp", "--remat_policy", "dots"],
])
def test_train_py_exits_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith("train.py: error: ") and "Traceback" not in err[0], err


@pytest.mark.parametrize("kwargs,match", [
    (R(granularity="full", use_reentrant="no"), r"use_reentrant: must be True or False \(got 'no'\)"),
    (R(granularity="full", use_reentrant=1), r"use_reentrant: must be True or False \(got 1\)"),
    (R(granularity="full", offload_inputs="yes"), r"offload_inputs: must be True or False \(got 'yes'\)"),
    (R(granularity="full", use_reentrant=True, determinism_check=1), "determinism_check: 1 is not valid"),
    (R(granularity="none", determinism_check="structure"), "with granularity none"),
])
def test_values_of_the_wrong_type_are_refused_not_reinterpreted(kwargs, match):
    with pytest.raises(RecomputeConfigError, match=match):
        RecomputeConfig(**kwargs)


def test_plan_refuses_a_bool_as_the_layer_count():
    with pytest.raises(ValueError, match="n_layers=True"):
        RecomputeConfig(granularity="full").split(True)


@pytest.mark.parametrize("kwargs", [
    R(), R(granularity="full"), R(granularity="selective"), R(granularity="selective", policy="dots"),
    R(granularity="selective", modules="mlp"), R(granularity="full", policy="dots"),
    R(granularity="full", method="uniform", num_layers=2), R(granularity="full", method="block", num_layers=3),
    R(granularity="full", num_layers=1), R(granularity="full", use_reentrant=True),
    R(granularity="full", use_reentrant=True, determinism_check="structure"),
    R(granularity="none", determinism_check=False), R(granularity="full", determinism_check=False),
])
def test_consistent_settings_are_still_accepted(kwargs):
    rc = RecomputeConfig(**kwargs)
    if rc.granularity == "selective":  # modules default to core_attn there, and only there
        assert rc.modules == (("mlp",) if "modules" in kwargs else ("core_attn",))
    else:
        assert rc.modules is None


@pytest.mark.parametrize("argv,label", [
    ([], "none"),
    (["--activation_recompute"], "full/none"),
    (["--recompute_num_layers", "1"], "none"),  # the default value, given explicitly: nothing ignored
    (["--activation_recompute", "--recompute_method", "uniform", "--recompute_num_layers", "2"], "full/uniform/2"),
    (["--recompute_granularity", "selective", "--remat_policy", "dots"], "selective policy=dots"),
    (["--recompute_granularity", "selective", "--recompute_modules", "mlp"], "selective mlp"),
    (["--activation_recompute", "--remat_policy", "dots"], "full/none policy=dots"),
    (["--activation_recompute", "--use_reentrant"], "full/none"),
    (["--recompute_every", "2"], "full/every/2"),  # a region choice turns recompute on (granularity full)
    (["--recompute_segments", "0-1"], "full/segments/0-1"),
])
def test_train_py_still_accepts_consistent_flags(argv, label):
    assert config_from_args(argv).recompute_configs()[0][0] == label


def test_a_method_list_applies_num_layers_to_the_methods_that_take_it():
    cfg = config_from_args(["--activation_recompute", "--recompute_method", "none,uniform,block",
                            "--recompute_num_layers", "2", "--memory_report"])
    assert [(rc.method, rc.num_layers) for _, rc in cfg.recompute_configs()] == [
        ("none", 1), ("uniform", 2), ("block", 2)]


def test_help_says_segments_and_every_turn_recompute_on(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for entry in ("--recompute_segments A-B,C-D", "--recompute_every K"):
        i = text.rindex(entry)  # the help entry, after the usage line
        assert "turns recompute on (granularity full)" in text[i:i + 400], text[i:i + 400]
