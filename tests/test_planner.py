"""remat.plan_for_budget: the chosen plan compiles under the budget and recomputes no more than any
hand setting that fits; the budget-too-small error; gradients; `train.py --recompute_method auto`.

The compiled tests use a tiny GPT-2 (4 layers, C=64, 4 heads, T=64, B=4, vocab 256, float32) and
the `jax.grad` of its loss compiled by XLA:GPU for an H200 (deviceless, `remat.planning.targets`; on
XLA:CPU a Python loop of rematerialized layers compiles to the temp of no remat, so no budget lies
between them); "peak" is XLA's arguments + outputs + temp − aliased (`CompiledMemory.peak_estimate`),
the planner's default, and FLOPs are the traced program's matrix products (XLA:GPU gives no cost
analysis without a device). Every program is compiled once per module (`_COMPILED`), shared by the
planner and the hand settings; gradients are compared on this host (`run_grad`).
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
from remat.memory import compiled_stats, format_bytes
from remat.planning.planner import plan_for_budget
from remat_lm.argtypes import parse_size
from remat_lm.training.config import UsageError, config_from_args
from remat.planning import targets
from targethelp import GPU, need
from trainhelp import ours

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
        return remat.planning.planner.recompute_config(("+".join(rc.modules),) * L)
    if rc.granularity == "full" and not isinstance(rc.layers, remat.regions.PerLayer) and rc.policy is None and not rc.use_reentrant:
        if rc.method == "block":
            return remat.planning.planner.recompute_config(("full",) * rc.num_layers + (None,) * (L - rc.num_layers))
        if rc.method == "none" or rc.num_layers == 1:
            return remat.planning.planner.recompute_config(("full",) * L)
    return rc


def _grad_fn(rc: RecomputeConfig):
    cfg = dataclasses.replace(CFG, recompute=rc)
    _, idx, tgt = _data()
    return jax.grad(lambda p: gpt2.loss_fn(p, cfg, idx, tgt))


def compile_grad(rc: RecomputeConfig, canonical: bool = True) -> CompiledMemory:
    """XLA:GPU's memory analysis (h200, deviceless) of the `jax.grad` of the loss under `rc` (cached)."""
    need("cuda")
    rc = _canonical(rc) if canonical else rc
    if rc not in _COMPILED:
        _COMPILED[rc] = targets.compiled_memory(_grad_fn(rc), _data()[0], target=GPU)
    return _COMPILED[rc]


def run_grad(rc: RecomputeConfig):
    """The gradients under `rc`, computed on this host."""
    return jax.jit(_grad_fn(rc))(_data()[0])


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


@pytest.mark.slow  # ~45 s each; the per-tag planner's fast cases (tagplan, front on a synthetic model) stay fast
@pytest.mark.parametrize("frac", [0.15, 0.45, 0.8])
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


@pytest.mark.slow  # ~55 s; the per-tag planner's fast cases stay fast
def test_plans_are_not_just_a_hand_setting():
    """Somewhere in between, the planner finds a mixed plan strictly cheaper than every fitting hand setting."""
    strictly = []
    for frac in (0.15, 0.45, 0.8):
        budget, plan = planned(frac)
        none_flops = stats(RecomputeConfig()).flops
        hand = [stats(rc).flops - none_flops for rc in HAND.values() if stats(rc).peak_estimate <= budget]
        strictly.append(plan.compiled_recompute_flops < min(hand) * (1 - 1e-3))
    assert any(strictly)


@pytest.mark.slow  # ~35 s (two XLA:GPU compiles of the step); test_cli_exit_2_one_line keeps the planner's refusals fast
def test_budget_too_small_states_the_minimum():
    lo, _ = _bounds()
    with pytest.raises(ValueError) as e:
        plan_for_budget(compile_grad, L, lo - 1)
    msg = str(e.value)
    assert f"minimum of {format_bytes(lo, up=True)} ({lo:,} bytes" in msg and "(full on every layer)" in msg
    assert parse_size(format_bytes(lo, up=True).replace(" ", "")) >= lo
    assert "smaller micro-batch" in msg


def test_no_remat_when_it_fits():
    _, hi = _bounds()
    plan = plan_for_budget(compile_grad, L, hi)
    assert plan.layer_policies == (None,) * L and plan.recompute_config() == RecomputeConfig()
    assert plan.total_recompute_flops == 0 and plan.compiles == 1


@pytest.mark.slow  # ~45 s; tests/test_stacks.py and tests/test_models.py keep gradients against no remat fast
def test_gradients_equal_no_remat():
    _, plan = planned(0.45)
    assert len(set(plan.layer_policies)) > 1 or plan.layer_policies[0] is not None, plan.table()
    ref = run_grad(RecomputeConfig())
    got = run_grad(plan.recompute_config())
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


# Each case is two XLA:GPU compiles; `block 2` stays fast, `selective mlp+norm` is slow.
@pytest.mark.parametrize("name", ["block 2", pytest.param("selective mlp+norm", marks=pytest.mark.slow)])
def test_hand_settings_compile_like_their_per_layer_form(name):
    """The cache's assumption: block N and selective presets compile to the per-layer form's program."""
    rc = HAND[name]
    a, b = stats(rc, canonical=False), stats(rc)
    assert (a.peak_estimate, a.temp, a.flops) == (b.peak_estimate, b.temp, b.flops)


# ------------------------------------------------------------------------------------------------
# The search itself, on a synthetic step (no compilation): exact against brute force, refinement.

SYN = {None: (0, 0, 0.0), "norm": (30, 10, 1.0), "mlp": (55, 12, 4.0), "core_attn+mlp+norm": (60, 14, 4.5),
       "full": (90, 20, 9.0)}   # candidate: (interior bytes freed, last-layer bytes freed, FLOPs)


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


@pytest.mark.parametrize("target", [None, "h200"])
def test_when_no_remat_fits_the_answer_comes_after_one_compile(target):
    """Both planners compile no remat first; where it fits the budget nothing is traced or calibrated."""
    compiled, traced = [], []
    step = _syn_step()
    plan = plan_for_budget(lambda rc: compiled.append(rc) or step(rc), 6, 1000, target=target,
                           trace_step=None if target is None else lambda rc: traced.append(rc))
    assert plan.layer_policies == (None,) * 6 and plan.compiles == 1 and plan.fits
    assert [rc.enabled for rc in compiled] == [False] and traced == []
    assert "no remat fits the budget" in plan.table()


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
    (["--recompute_method", "auto", "--memory_budget", "1GiB", "--remat_policy", "full"], "drop --remat_policy"),
])
def test_cli_usage_errors(args, match):
    with pytest.raises(UsageError, match=match):
        config_from_args(args)


@pytest.mark.parametrize("layout", [[], ["--scan_layers"]])
def test_cli_accepts_auto_with_a_budget(layout):
    """Either layout plans: the FLOPs of a scanned program count every layer (remat.compiled.hlo_matmul_flops)."""
    cfg = config_from_args(["--recompute_method", "auto", "--memory_budget", "512MiB", *layout])
    label, auto = cfg.recompute_configs()[0]
    assert label == "auto" and auto.budget == 512 * 2**20


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
    lines = ours(p.stderr)
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
    assert hs["block 2"] == remat.planning.planner.recompute_config(("full", "full", None, None))
    a = 'HloModule m\n\nFileNames\n1 "a.py"\n\nENTRY %e {\n  %p = f32[] parameter(0), metadata={op_name="x"}\n}'
    b = 'HloModule m\n\nFileNames\n1 "b.py"\n\nENTRY %e {\n  %p = f32[] parameter(0), metadata={op_name="y"}\n}'
    assert bp._fingerprint(a) == bp._fingerprint(b) != bp._fingerprint(a.replace("f32", "s32"))


# ------------------------------------------------------------------------------------------------
# The planner per tag (target=...): remat.planning.cost, remat.planning.tagplan, remat.planning.planner.front, --recompute_plan

from remat.planning import cost as _cost
from remat.planning import tagplan


def test_plan_text_round_trip_and_bad_text():
    lp = ("save_names:mlp_up,qkv",) * 3 + ("custom:qkv=device,mlp_up=offload", None)
    text = tagplan.format_plan(lp)
    assert text == "save_names:mlp_up,qkv x3; custom:qkv=device,mlp_up=offload x1; none x1"
    assert tagplan.parse_plan(text, 5) == lp
    for bad, match in (("full", "not 'POLICY xN'"), ("bogus x2", "bogus"), ("none x2", "covers 2 layers")):
        with pytest.raises(ValueError, match=match) as e:
            tagplan.parse_plan(bad, 3)
        assert "POLICY xN" in str(e.value) or "bogus" in str(e.value)


def test_cost_profile_splits_the_forward_by_tag():
    from jax.ad_checkpoint import checkpoint_name

    def layer(w1, w2, x):
        h = checkpoint_name(x @ w1, "mlp_up")
        return checkpoint_name(jnp.tanh(h) @ w2, "mlp_out")

    jp = jax.make_jaxpr(layer)(jnp.ones((64, 256)), jnp.ones((256, 64)), jnp.ones((32, 64)))
    roof = _cost.Roofline(1e9, {"float32": 1e9})
    p = _cost.profile(jp, roof)
    assert p.order == ("mlp_up", "mlp_out")
    assert p.tags["mlp_up"].bytes == 32 * 256 * 4 and p.tags["mlp_out"].bytes == 32 * 64 * 4
    # each share holds its matmul (2·M·N·K FLOPs at 1 GFLOP/s); tanh's output is read by the second
    assert p.tags["mlp_up"].recompute_s == pytest.approx(2 * 32 * 64 * 256 / 1e9)
    assert p.tags["mlp_out"].recompute_s > 2 * 32 * 256 * 64 / 1e9
    assert p.forward_s == pytest.approx(p.tags["mlp_up"].recompute_s + p.tags["mlp_out"].recompute_s)


def _syn_model(L=6, offload=True):
    return tagplan.Model(
        n_layers=L, tags=("qkv", "mlp_up", "attn_out"), bytes={"qkv": 100, "mlp_up": 300, "attn_out": 50},
        share={"qkv": 5.0, "mlp_up": 6.0, "attn_out": 4.0},
        untagged_s=1.0, forward_s=2.0, base_step_s=10.0, host_link=40.0 if offload else None, p_full=1000,
        m_none=600, a_save=1.0, a_off=0.1 if offload else None, c_mix=30)


@pytest.mark.parametrize("budget", [1000, 1100, 1500, 2200, 3000, 4700])
def test_solver_is_exact_over_its_family(budget):
    """scipy.optimize.milp's plan against every plan of the family (policy P on n layers, none after)."""
    m = _syn_model()
    got = m.solve(budget)
    choices = [tagplan.SAVE, tagplan.OFFLOAD, tagplan.RECOMPUTE]
    best = None
    for n in range(m.n_layers + 1):
        for combo in itertools.product(choices, repeat=3):
            lp = (tagplan.tag_policy(dict(zip(m.tags, combo))),) * n + (None,) * (m.n_layers - n)
            pk, step = m.predict(lp)
            if pk <= budget and (best is None or step < best - 1e-9):
                best = step
    assert got is not None and m.predict(got)[0] <= budget
    assert m.predict(got)[1] == pytest.approx(best)


def test_solver_never_offloads_when_offload_is_dropped():
    m = _syn_model(offload=False)
    for b in (1100, 1500, 2200):
        lp = m.solve(b)
        assert lp is not None and not any(p and "offload" in p for p in lp)


@functools.cache
def _scan_data():
    cfg = dataclasses.replace(CFG, scan_layers=True)
    return cfg, gpt2.init_params(cfg, jax.random.PRNGKey(0)), *_data()[1:]


def _tiny_scan():
    cfg, params, idx, tgt = _scan_data()
    compiled = {}

    def fn(rc):
        c = dataclasses.replace(cfg, recompute=rc)
        return jax.jit(jax.grad(lambda p: gpt2.loss_fn(p, c, idx, tgt)))

    def cs(rc):
        if rc not in compiled:
            compiled[rc] = fn(rc).lower(params).compile()
        return compiled[rc]

    return cs, (lambda rc: fn(rc).trace(params).jaxpr), compiled


@pytest.mark.slow  # 8 compilations of the tiny model: 165 s on the shared 2-core machine
def test_front_on_xla_cpu_fits_every_budget_and_is_monotone():
    """The tiny GPT-2 (scan) on XLA:CPU: every plan compiled within its budget, the front monotone,
    each plan's text parses back to the program that was compiled."""
    cs, ts, compiled = _tiny_scan()
    measured: dict = {}
    f0 = remat.planning.planner.front(cs, ts, L, [], target="cpu", measured=measured)
    hi = measured[(None,) * L].peak_estimate
    budgets = [int(f0.model.p_full + k * (hi - f0.model.p_full) / 3) for k in (1, 2)]
    f = remat.planning.planner.front(cs, ts, L, budgets, target="cpu", model=f0.model, measured=measured)
    steps = [p.predicted_step_s for p in f.plans]
    assert all(p.compiled_peak <= p.budget for p in f.plans)
    assert steps[1] <= steps[0] and steps[0] <= f0.model.predict(("full",) * L)[1]
    for p in f.plans:
        rc = tagplan.recompute_config(tagplan.parse_plan(p.text, L))
        assert compiled_stats(cs(rc)).peak_estimate == p.compiled_peak
    with pytest.raises(ValueError, match="below the minimum"):
        remat.planning.planner.front(cs, ts, L, [f0.model.p_full // 2], target="cpu", model=f0.model, measured=measured)


@pytest.mark.slow  # 9 XLA:GPU compilations: 250 s on the shared 2-core machine
def test_front_on_h200():
    """The same tiny model built by XLA:GPU for an H200 (no device): the plan fits what XLA:GPU compiled."""
    need("cuda")
    import remat.planning.targets as rt

    cfg, params, idx, tgt = _scan_data()
    t = rt.get("h200")

    def fn(rc):
        c = dataclasses.replace(cfg, recompute=rc)
        return lambda p: jax.grad(lambda p: gpt2.loss_fn(p, c, idx, tgt))(p)

    cs = lambda rc: rt.compiled_memory(fn(rc), params, target=t)
    ts = lambda rc: jax.jit(fn(rc)).trace(params).jaxpr
    measured: dict = {}
    f0 = remat.planning.planner.front(cs, ts, L, [], target=t, measured=measured)
    hi = measured[(None,) * L].peak_estimate
    b = int((f0.model.p_full + hi) / 2)
    plan = remat.plan_for_budget(cs, L, b, target=t, trace_step=ts)
    assert plan.compiled_peak <= b and plan.predicted_step_s > 0 and "plan: " in plan.table()


def test_recompute_plan_flag():
    cfg = config_from_args(["--recompute_plan", "save_names:qkv x2; none x2", "--scan_layers"])
    label, rc = cfg.recompute_configs()[0]
    assert label == "plan" and rc == tagplan.recompute_config(("save_names:qkv",) * 2 + (None,) * 2)
    # the way a Megatron user writes it: --activation_recompute agrees with a plan
    with_flag = config_from_args(["--activation_recompute", "--recompute_plan", "save_names:qkv x2; none x2",
                                  "--scan_layers"]).recompute_configs()[0]
    assert with_flag == (label, rc)
    for bad, match in ((["--recompute_plan", "save_names:qkv"], "expected POLICY xN"),
                       (["--recompute_plan", "none x2", "--remat_policy", "dots"], "drop --remat_policy"),
                       # conflicts given at their default value are conflicts too
                       (["--recompute_plan", "none x2", "--no-activation_recompute"], "drop --no-activation_recompute"),
                       (["--recompute_plan", "none x2", "--recompute_num_layers", "1"], "drop --recompute_num_layers"),
                       (["--recompute_method", "auto", "--memory_budget", "1GiB", "--recompute_num_layers", "1"],
                        "drop --recompute_num_layers")):
        with pytest.raises(UsageError, match=match):
            config_from_args(bad).recompute_configs()


def test_recompute_plan_cli_exit_2_one_line(text_file):
    p = _train(["--recompute_plan", "full"] + SMALL + ["--data", text_file])
    lines = ours(p.stderr)
    assert p.returncode == 2 and len(lines) == 1 and "POLICY xN" in lines[0], p.stderr


@pytest.mark.slow  # the acceptance runs: minutes each (docs/planner.md)
@pytest.mark.parametrize("args", [
    ["--target", "h200", "--model", "gpt2", "--preset", "d12", "--batch_size", "8", "--sequence_length", "1024",
     "--dtype", "bfloat16"],
    ["--target", "h200x8", "--mesh", "fsdp=8", "--model", "llama3", "--preset", "8b", "--batch_size", "8",
     "--sequence_length", "8192", "--dtype", "bfloat16"]])
def test_acceptance_front(args, tmp_path):
    need("cuda")
    out = tmp_path / "front.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "remat_lm.bench.planner", *args, "--json", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stderr[-3000:]
    import json
    res = json.load(open(out))
    assert all(c["ok"] for c in res["checks"]), res["checks"]


@pytest.mark.slow  # ~35 s: five XLA:GPU compilations of the tiny model
def test_cli_auto_with_a_target_plans_per_tag():
    need("cuda")
    # a budget between full remat's compiled peak (1.81 MiB) and no remat's (2.47 MiB): a plan is needed
    p = _train(["--preset", "tiny", "--batch_size", "4", "--sequence_length", "64", "--recompute_method", "auto",
                "--target", "h200", "--dry_run", "--scan_layers", "--memory_budget", "2.2MiB"])
    assert p.returncode == 0, p.stderr
    plan = re.search(r"^plan: (.+)$", p.stdout, re.M)
    assert plan and "predicted step" in p.stdout and tagplan.parse_plan(plan.group(1), 2)


def test_a_plan_carries_its_layout_and_train_py_follows_it():
    """The planner's plan text names the layout it was planned for; train.py runs that layout (the
    peak the plan was verified at is that layout's) or refuses a flag that contradicts it."""
    from remat.planning.tagplan import format_plan, parse_plan, plan_layout
    from remat_lm.training.prepare import prepare
    text = format_plan(("full", "full", None), scan=True)
    assert text == "full x2; none x1; scan" and plan_layout(text) is True
    assert parse_plan(text, 3) == parse_plan("full x2; none x1", 3) == ("full", "full", None)
    assert plan_layout(format_plan((None, "full"), scan=False)) is False and plan_layout("full x2") is None
    tiny = ["--preset", "tiny", "--dry_run"]
    cfg = config_from_args(tiny + ["--recompute_plan", "full x1; none x1; scan"])
    assert cfg.scan_layers and prepare(cfg).base_mcfg.scan_layers  # the model is built with scanned layers
    assert not config_from_args(tiny + ["--recompute_plan", "full x1; none x1"]).scan_layers
    with pytest.raises(UsageError, match=r"planned with the layers under scan; drop --no-scan_layers"):
        config_from_args(tiny + ["--recompute_plan", "full x2; scan", "--no-scan_layers"])
    with pytest.raises(UsageError, match=r"planned for a loop of layers; drop --scan_layers"):
        config_from_args(tiny + ["--recompute_plan", "full x2; loop", "--scan_layers"])
    with pytest.raises(UsageError, match=r"is not 'POLICY xN'"):
        config_from_args(tiny + ["--recompute_plan", "scan; full x2"]).recompute_configs()


def test_a_plan_count_is_bounded_before_any_list_is_built():
    """`full x1000000000` or a 30-digit count: refused from the counts alone (no MemoryError, no
    OverflowError), naming the layers it covers."""
    from remat.planning.tagplan import parse_plan
    with pytest.raises(ValueError, match="covers 1,000,000,000 layers but the model has 4"):
        parse_plan("full x1000000000", 4)
    with pytest.raises(ValueError, match="but a stack has at most 2,147,483,647"):
        parse_plan("full x" + "9" * 30)
