"""remat.plan_for_budget: the chosen plan compiles under the budget and recomputes no more than any
hand setting that fits; the budget-too-small error; gradients; `train.py --recompute_method auto`.

The compiled tests use a tiny GPT-2 (4 layers, C=64, 4 heads, T=64, B=4, vocab 256, float32) and
the compiled `jax.grad` of its loss; "peak" is XLA's arguments + outputs + temp − aliased
(`CompiledMemory.peak_estimate`), the planner's default. Every program is compiled once per module
(`_compiled`), shared by the planner and the hand settings.
"""
import dataclasses
import functools
import itertools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import remat
from remat_lm.models import gpt2
from remat_lm.models.memory_model import activation_bytes
from remat import RecomputeConfig
from remat.memory import CompiledMemory
from remat.planner import compiled_stats, format_bytes, plan_for_budget
from remat_lm.argtypes import parse_size
from remat_lm.training.config import UsageError, config_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L, B, T = 4, 4, 64
CFG = gpt2.GPT2Config(block_size=T, vocab_size=256, n_layer=L, n_head=4, n_embd=64)


@functools.cache
def _data():
    """(params, idx, targets), made on first use (not while the test files are collected)."""
    return (gpt2.init_params(CFG, jax.random.PRNGKey(0)), jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, 256),
            jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, 256))
MODULE_PRESETS = ["+".join(c) for r in (1, 2, 3) for c in itertools.combinations(("core_attn", "mlp", "norm"), r)]
_COMPILED: dict = {}


def _canonical(rc: RecomputeConfig) -> RecomputeConfig:
    """The per-layer form of a hand setting whose program is the same (checked by
    test_hand_settings_compile_like_their_per_layer_form): selective c = c on every layer, block N =
    full on the first N layers, uniform 1 = full. Uniform N > 1 (multi-layer regions) stays as is."""
    if rc.granularity == "selective":
        return remat.planner.recompute_config(("+".join(rc.modules),) * L)
    if rc.granularity == "full" and not isinstance(rc.layers, remat.regions.PerLayer) and rc.policy is None and not rc.use_reentrant:
        if rc.method == "block":
            return remat.planner.recompute_config(("full_remat",) * rc.num_layers + (None,) * (L - rc.num_layers))
        if rc.method == "none" or rc.num_layers == 1:
            return remat.planner.recompute_config(("full_remat",) * L)
    return rc


def compile_grad(rc: RecomputeConfig, canonical: bool = True):
    """The compiled `jax.grad` of the loss under `rc` (cached)."""
    rc = _canonical(rc) if canonical else rc
    if rc not in _COMPILED:
        cfg = dataclasses.replace(CFG, recompute=rc)
        params, idx, tgt = _data()
        fn = jax.grad(lambda p: gpt2.loss_fn(p, cfg, idx, tgt))
        _COMPILED[rc] = jax.jit(fn).lower(params).compile()
    return _COMPILED[rc]


def stats(rc: RecomputeConfig, canonical: bool = True) -> CompiledMemory:
    return compiled_stats(compile_grad(rc, canonical))


HAND = {
    **{f"uniform {n}": RecomputeConfig(granularity="full", method="uniform", num_layers=n) for n in range(1, L + 1)},
    **{f"block {n}": RecomputeConfig(granularity="full", method="block", num_layers=n) for n in range(1, L + 1)},
    **{f"selective {m}": RecomputeConfig(granularity="selective", modules=tuple(m.split("+")))
       for m in MODULE_PRESETS},
    "full": RecomputeConfig(granularity="full"),
}


def _bounds():
    return stats(RecomputeConfig(granularity="full")).peak_estimate, stats(RecomputeConfig()).peak_estimate


_PLANS: dict = {}


def planned(frac: float):
    lo, hi = _bounds()
    budget = int(lo + frac * (hi - lo))
    if budget not in _PLANS:
        _PLANS[budget] = plan_for_budget(compile_grad, L, budget, layer_bytes=activation_bytes(CFG, B, T)[0])
    return budget, _PLANS[budget]


@pytest.mark.parametrize("frac", [pytest.param(0.15, marks=pytest.mark.slow), 0.45, 0.8])  # 0.15: ~45 s
def test_plan_fits_and_beats_every_hand_setting(frac):
    budget, plan = planned(frac)
    lo, hi = _bounds()
    assert lo < budget < hi
    # Verified independently: compile the plan's RecomputeConfig and read XLA's memory analysis.
    got = stats(plan.recompute_config())
    assert got.peak_estimate == plan.compiled_peak <= budget, plan.table()
    none_flops = stats(RecomputeConfig()).flops
    plan_flops = got.flops - none_flops
    fitting = {}
    for name, rc in HAND.items():
        s = stats(rc)
        if s.peak_estimate <= budget:
            fitting[name] = s.flops - none_flops
    assert "full" in fitting
    worse = {k: v for k, v in fitting.items() if plan_flops > v * (1 + 1e-6)}
    assert not worse, (plan.table(), plan_flops, worse)
    # The plan's table: one row per layer, and predicted vs compiled peak.
    text = plan.table()
    assert len([l for l in text.splitlines() if l.strip()[:1].isdigit()]) == L
    assert "predicted" in text and "compiled" in text and "fits" in text
    assert len(plan.layer_policies) == L and plan.recompute_config().validate_for(L)


def test_plans_are_not_just_a_hand_setting():
    """Somewhere in between, the planner finds a mixed plan strictly cheaper than every fitting hand setting."""
    strictly = []
    for frac in (0.15, 0.45, 0.8):
        budget, plan = planned(frac)
        none_flops = stats(RecomputeConfig()).flops
        hand = [stats(rc).flops - none_flops for rc in HAND.values() if stats(rc).peak_estimate <= budget]
        strictly.append(plan.compiled_recompute_flops < min(hand) * (1 - 1e-3))
    assert any(strictly)


def test_budget_too_small_states_the_minimum():
    lo, _ = _bounds()
    with pytest.raises(ValueError) as e:
        plan_for_budget(compile_grad, L, lo - 1)
    msg = str(e.value)
    assert f"minimum of {format_bytes(lo, up=True)} ({lo:,} bytes" in msg and "(full_remat on every layer)" in msg
    assert parse_size(format_bytes(lo, up=True).replace(" ", "")) >= lo
    assert "smaller micro-batch" in msg


def test_no_remat_when_it_fits():
    _, hi = _bounds()
    plan = plan_for_budget(compile_grad, L, hi)
    assert plan.layer_policies == (None,) * L and plan.recompute_config() == RecomputeConfig()
    assert plan.total_recompute_flops == 0 and plan.compiles == 1


def test_gradients_equal_no_remat():
    _, plan = planned(0.45)
    assert len(set(plan.layer_policies)) > 1 or plan.layer_policies[0] is not None, plan.table()
    ref = compile_grad(RecomputeConfig())(_data()[0])
    got = compile_grad(plan.recompute_config())(_data()[0])
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_hand_settings_compile_like_their_per_layer_form():
    """The cache's assumption: block N and selective presets compile to the per-layer form's program."""
    for rc in (HAND["block 2"], HAND["selective mlp+norm"]):
        a, b = stats(rc, canonical=False), stats(rc)
        assert (a.peak_estimate, a.temp, a.flops) == (b.peak_estimate, b.temp, b.flops)


# ------------------------------------------------------------------------------------------------
# The search itself, on a synthetic step (no compilation): exact against brute force, refinement.

SYN = {None: (0, 0, 0.0), "norm": (30, 10, 1.0), "mlp": (55, 12, 4.0), "core_attn+mlp+norm": (60, 14, 4.5),
       "full_remat": (90, 20, 9.0)}   # candidate: (interior bytes freed, last-layer bytes freed, FLOPs)


def _syn_step(penalty=0):
    def step(rc: RecomputeConfig) -> CompiledMemory:
        lp = rc.layers.policies if isinstance(rc.layers, remat.regions.PerLayer) else (None,) * 6
        peak = 1000 - sum(SYN[c][0] for c in lp[:-1]) - SYN[lp[-1]][1]
        if len(set(lp)) > 2:  # a mixed plan the additive model underestimates
            peak += penalty
        return CompiledMemory(temp=peak, argument=0, output=0, alias=0, generated_code=0, host_temp=0,
                              flops=100.0 + sum(SYN[c][2] for c in lp))
    return step


@pytest.mark.parametrize("budget", [600, 700, 777, 850, 905, 960])
def test_exact_against_brute_force(budget):
    plan = plan_for_budget(_syn_step(), 6, budget)
    best = min(sum(SYN[c][2] for c in lp) for lp in itertools.product(SYN, repeat=6)
               if 1000 - sum(SYN[c][0] for c in lp[:-1]) - SYN[lp[-1]][1] <= budget)
    assert plan.compiled_peak <= budget and plan.iterations == 1
    assert plan.total_recompute_flops == pytest.approx(best)
    assert plan.predicted_peak == plan.compiled_peak


def test_deep_stacks_are_planned_in_groups():
    plan = plan_for_budget(_syn_step_n(120), 120, 1000 * 120 - 40 * 120)
    assert plan.fits and len(plan.layer_policies) == 120 and any("groups of" in n for n in plan.notes)


def _syn_step_n(n):
    def step(rc: RecomputeConfig) -> CompiledMemory:
        lp = rc.layers.policies if isinstance(rc.layers, remat.regions.PerLayer) else (None,) * n
        peak = 1000 * n - sum(SYN[c][0] for c in lp[:-1]) - SYN[lp[-1]][1]
        return CompiledMemory(temp=peak, argument=0, output=0, alias=0, generated_code=0, host_temp=0,
                              flops=100.0 + sum(SYN[c][2] for c in lp))
    return step


def test_refines_when_the_compiled_plan_does_not_fit():
    plan = plan_for_budget(_syn_step(penalty=25), 6, 777)
    assert plan.compiled_peak <= 777 and plan.iterations > 1
    assert any("over the budget" in n for n in plan.notes) and "note:" in plan.table()


def test_parse_size():
    assert parse_size("12GiB") == 12 * 2**30 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("4096") == 4096 and parse_size("2 kib") == 2048
    for bad in ("", "12 parsecs", "-1GiB", "0", "GiB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_size(bad)


# ------------------------------------------------------------------------------------------------
# train.py --recompute_method auto --memory_budget


@pytest.mark.parametrize("args,match", [
    (["--memory_budget", "1GiB"], "needs --recompute_method auto"),
    (["--activation_recompute", "--recompute_method", "uniform", "--memory_budget", "1GiB"],
     "needs --recompute_method auto"),
    (["--recompute_method", "auto"], "needs --memory_budget SIZE"),
    (["--recompute_method", "auto", "--memory_budget", "12 parsecs"], "e.g. 12GiB"),
    (["--recompute_method", "auto,none", "--memory_budget", "1GiB", "--memory_report"], "auto alone"),
    (["--recompute_method", "auto", "--memory_budget", "1GiB", "--remat_policy", "full_remat"], "drop --remat_policy"),
    (["--recompute_method", "auto", "--memory_budget", "1GiB", "--scan_layers"], "drop --scan_layers"),
])
def test_cli_usage_errors(args, match):
    with pytest.raises(UsageError, match=match):
        config_from_args(args)


def test_cli_accepts_auto_with_a_budget():
    cfg = config_from_args(["--recompute_method", "auto", "--memory_budget", "512MiB"])
    assert cfg.memory_budget_bytes == 512 * 2**20 and cfg.recompute_configs()[0][0] == "auto"


def _train(args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_bytes(open(os.path.join(ROOT, "README.md"), "rb").read() * 4)
    return str(path)


SMALL = ["--n_layer", "1", "--batch_size", "2", "--sequence_length", "16", "--num_iterations", "2",
         "--val_every", "0", "--no-progress"]


def test_cli_exit_2_one_line(text_file):
    p = _train(["--memory_budget", "1GiB"] + SMALL + ["--data", text_file])
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "add --recompute_method auto" in lines[0], p.stderr


@pytest.mark.slow  # ~18 s: two planner runs through the CLI
def test_cli_budget_too_small_states_the_minimum(text_file):
    """In process (train.py turns this UsageError into one line and exit 2, as above)."""
    from remat_lm import training

    cfg = config_from_args(["--recompute_method", "auto", "--memory_budget", "1KiB", "--data", text_file] + SMALL)
    with pytest.raises(UsageError, match=r"--memory_budget 1KiB: .*below the minimum of [0-9.]+ [KMG]iB") as e:
        training.run(cfg)
    assert "smaller micro-batch" in str(e.value)


@pytest.mark.slow
def test_cli_trains_with_the_plan(text_file):
    """Plan between the minimum and no remat (read from the too-small error), then train 2 steps."""
    args = ["--recompute_method", "auto", "--n_layer", "3", "--batch_size", "8", "--sequence_length", "64",
            "--num_iterations", "2", "--val_every", "0", "--no-progress", "--data", text_file]
    p = _train(args + ["--memory_budget", "1KiB"])
    lo = int(re.search(r"minimum of [0-9.]+ [KMG]iB \(([0-9,]+) bytes", p.stderr).group(1).replace(",", ""))
    hi = parse_size(re.search(r"no remat needs ([0-9.]+ [KMG]iB)", p.stderr).group(1))
    assert lo < 0.9 * hi, p.stderr
    p = _train(args + ["--memory_budget", str((lo + hi) // 2)])
    assert p.returncode == 0, p.stderr
    assert "recompute MFLOP" in p.stdout and "predicted" in p.stdout and "(fits)" in p.stdout
    assert "step 2/2" in p.stdout and "policy per layer" in p.stdout


def test_bench_helpers():
    from remat_lm.bench import planner as bp

    hs = bp.hand_settings(4)
    assert {"full", "uniform 2", "uniform 4", "block 1", "block 3", "selective core_attn+mlp+norm"} <= set(hs)
    assert hs["block 2"] == remat.planner.recompute_config(("full_remat", "full_remat", None, None))
    a = 'HloModule m\n\nFileNames\n1 "a.py"\n\nENTRY %e {\n  %p = f32[] parameter(0), metadata={op_name="x"}\n}'
    b = 'HloModule m\n\nFileNames\n1 "b.py"\n\nENTRY %e {\n  %p = f32[] parameter(0), metadata={op_name="y"}\n}'
    assert bp._fingerprint(a) == bp._fingerprint(b) != bp._fingerprint(a.replace("f32", "s32"))
