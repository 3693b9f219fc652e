"""The planner's step times: measured where the target is this machine (interleaved, repeated until
the spread is known), the target compiler's optimized program elsewhere (every loop iteration
counted), ties broken toward memory, and the bench's validation mode."""
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

import remat
from remat.compiled import hlo_kernels, hlo_matmul_flops
from remat.memory import compiled_stats
from remat.planning import tagplan, timing
from remat.planning.cost import Roofline, program_seconds
from jax.ad_checkpoint import checkpoint_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L = 4


def _sleep(s):
    def f():
        t = time.perf_counter() + s
        while time.perf_counter() < t:   # busy: sleeping rounds up to the scheduler's tick
            pass
    return f


def test_time_programs_orders_programs_and_repeats_until_the_spread_is_known():
    t = timing.time_programs({"slow": _sleep(3e-3), "fast": _sleep(1e-3), "fast again": _sleep(1e-3)},
                             min_rounds=5, max_rounds=30, rel=0.05)
    assert t["slow"].median_s > t["fast"].median_s + 1.5e-3
    assert 5 <= t["fast"].rounds <= 30 and t["fast"].rounds == t["slow"].rounds
    floor = timing.noise_floor(t["fast"], t["fast again"])
    assert floor >= abs(t["fast"].median_s - t["fast again"].median_s) and floor < 1.5e-3
    # a program whose spread never settles stops at max_rounds
    jitter = iter([1e-4, 4e-3] * 50)
    t = timing.time_programs({"noisy": lambda: _sleep(next(jitter))()}, min_rounds=3, max_rounds=8, rel=0.001)
    assert t["noisy"].rounds == 8


def _scan(n):
    return jax.jit(lambda c: jax.lax.scan(lambda c, _: (jnp.tanh(c @ c), c), c, None, length=n)).lower(
        jnp.ones((64, 64))).compile()


def test_the_compiled_program_time_counts_every_loop_iteration_and_moves_only_the_slice_it_updates():
    roof = Roofline(1e10, {"float32": 1e9})
    one, eight = program_seconds(_scan(1), roof), program_seconds(_scan(8), roof)
    assert 7.0 <= eight / one <= 8.5, (one, eight)
    assert hlo_matmul_flops(_scan(8).as_text()) == 8 * hlo_matmul_flops(_scan(1).as_text())
    # the stacked output (64 x 64 x 64 floats) is written a slice per iteration: read whole each
    # time, the 64 iterations would move 64 times its size
    ks = hlo_kernels(_scan(64).as_text())
    stacked = 64 * 64 * 64 * 4
    assert sum(b * n for _, b, n, _ in ks) < 16 * stacked


def test_a_loop_whose_carry_prints_index_markers_is_counted_every_iteration():
    """XLA prints a tuple of more than five elements with /*index=5*/ markers; the loop is still read."""
    def body(c, _):
        a, *rest = c
        return (jnp.tanh(a @ a), *[r + 1 for r in rest]), None

    text = lambda n: jax.jit(lambda c: jax.lax.scan(body, c, None, length=n)[0]).lower(
        tuple(jnp.ones((32, 32)) for _ in range(7))).compile().as_text()
    assert "/*index=5*/" in text(8)
    assert hlo_matmul_flops(text(8)) == 8 * hlo_matmul_flops(text(1)) == 8 * 2 * 32 ** 3


@pytest.fixture(scope="module")
def tiny():
    """compile_step / trace_step of the gradient of a scanned stack of 4 MLP layers, tagged `ln_1`,
    `mlp_up` and `mlp_act` (XLA:CPU compiles it in well under a second)."""
    D = 32
    ws = {"up": jnp.full((L, D, 4 * D), 0.01), "down": jnp.full((L, 4 * D, D), 0.01)}
    x = jnp.ones((512, D))   # activations, not weights, fill the peak

    def layer(w, h, key):
        n = checkpoint_name(h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6), "ln_1")
        up = checkpoint_name(n @ w["up"], "mlp_up")
        return h + checkpoint_name(jnp.tanh(up), "mlp_act") @ w["down"]

    fn = lambda rc: jax.jit(jax.grad(lambda ws: remat.apply_layers(layer, ws, x, rc, scan=True).sum()))
    compiled = {}

    def cs(rc):
        if rc not in compiled:
            compiled[rc] = fn(rc).lower(ws).compile()
        return compiled[rc]

    return cs, (lambda rc: fn(rc).trace(ws).jaxpr)


def _remat_layers(rc) -> int:
    lp = tagplan.config_policies(rc, L)
    return sum(p is not None for p in lp)


def test_measured_step_times_drive_the_plan_and_ties_go_to_memory(tiny):
    """run_step makes the planner time the calibration programs: a step whose every rematerialized
    layer costs 6 ms is predicted so, and the plan at block L/2's peak recomputes as few layers as
    fit; when every program takes the same time, the plan is the one of least compiled peak."""
    cs, ts = tiny
    measured: dict = {}
    costly = lambda rc: _sleep(2e-3 + 6e-3 * _remat_layers(rc))
    f0 = remat.planning.planner.front(cs, ts, L, [], target="cpu", measured=measured, run_step=costly)
    m = f0.model
    assert "measured" in m.time_source and m.spread_s > 0
    overhead = m.predict(("full",) * L)[1] - m.predict((None,) * L)[1]
    assert abs(overhead - 6e-3 * L) < 0.25 * 6e-3 * L, (overhead, m.program_s)
    mid = measured[("full",) * (L // 2) + (None,) * (L - L // 2)].peak_estimate   # block L/2 fits it
    assert m.p_full < mid < measured[(None,) * L].peak_estimate
    plan = remat.planning.planner.front(cs, ts, L, [mid], target="cpu", model=m, measured=measured).plans[0]
    assert plan.compiled_peak <= mid and plan.time_source == m.time_source
    n = sum(p is not None for p in plan.layer_policies)
    assert 0 < n < L, (plan.text, plan.notes, m.spread_s)   # the fewest rematerialized layers that fit

    flat = remat.planning.planner.front(cs, ts, L, [], target="cpu", measured=dict(measured),
                                        run_step=lambda rc: _sleep(3e-3)).model
    tied = remat.planning.planner.front(cs, ts, L, [mid], target="cpu", model=flat, measured=dict(measured)).plans[0]
    fitting = [cm.peak_estimate for lp, cm in measured.items() if len(lp) == L and cm.peak_estimate <= mid]
    assert tied.compiled_peak == min(fitting + [tied.compiled_peak]), tied.text
    assert tied.compiled_peak < plan.compiled_peak


@pytest.mark.slow  # ~25 compilations of the tiny model and a timed round-robin of them: ~2 minutes
def test_validation_mode_writes_predicted_against_measured(tmp_path):
    out = tmp_path / "v.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "remat_lm.bench.planner", "--target", "cpu", "--preset", "tiny",
                        "--batch_size", "4", "--sequence_length", "64", "--budgets", "5", "--validate",
                        "--validate_seconds", "20", "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    v = json.load(open(out))["validation"]
    names = {s["name"] for s in v["settings"]}
    assert {"none", "full", "uniform 2", "block 1", "selective mlp", "plan 1", "plan 5"} <= names
    for s in v["settings"]:
        assert s["measured_step_s"] > 0 and s["measured_iqr_s"] >= 0 and s["compiled_peak_bytes"] > 0
        assert s["predicted_step_s"] > 0
    assert v["noise_floor_s"] > 0 and -1 <= v["kendall_tau"] <= 1 and len(v["checks"]) == 5
