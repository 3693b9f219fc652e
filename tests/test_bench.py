"""bench/: the policy table, the PyTorch peer and the GPU check, on tiny shapes (structure, not speed)."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

from remat_lm.bench import gpu_check, policies
from remat_lm.argtypes import config_label
from remat_lm.bench.common import REFERENCE_BATCH, Target, interleaved_ms, reference_config
from remat_lm.models import gpt2
from remat.memory import compiled_memory
from targethelp import GPU, need

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(n_layer=2, n_embd=32, n_head=4, seq=32, batch=2, vocab=256)
# Five of the nine default rows: each is one XLA:CPU compile, and the pairs that carry the logic
# (ratios to `none`, the bf16 rows' own base) are all here.
SUBSET = ("none", "full", "selective core_attn", "none (bf16)", "policy bf16 (bf16)")


@pytest.fixture(scope="module")
def table():
    settings = [s for s in policies.default_settings(TINY["n_layer"]) if s.name in SUBSET]
    return policies.run("gpt2", "ref", steps=2, settings=settings, log=lambda _: None, **TINY)


def test_default_rows_are_the_issues_settings():
    got = [(s.name, config_label(s.recompute), s.dtype, s.base) for s in policies.default_settings(8)]
    assert got == [
        ("none", "none", "float32", "none"),
        ("full", "full/none", "float32", "none"),
        ("uniform 2", "full/uniform/2", "float32", "none"),
        ("block 4", "full/block/4", "float32", "none"),
        ("selective core_attn", "selective core_attn", "float32", "none"),
        ("selective core_attn+mlp", "selective core_attn+mlp", "float32", "none"),
        ("policy dots", "full/none policy=dots", "float32", "none"),
        ("none (bf16)", "none", "bfloat16", "none (bf16)"),
        ("policy bf16 (bf16)", "full/none policy=bf16", "bfloat16", "none (bf16)"),
    ]


def test_reference_shape_is_the_default():
    cfg, seq = policies.build_config()
    assert cfg == reference_config("gpt2") and seq == cfg.block_size
    assert policies.build_config("llama3")[0] == reference_config("llama3")
    # the one place the figures' shape is pinned: the bench reference shape, 8 layers, C=256, 4 heads, T=256, B=8, V=1024
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size, REFERENCE_BATCH) == \
        (8, 256, 4, 1024, 256, 8)
    assert cfg.dtype == "float32" and not cfg.recompute.enabled


def test_policy_table_rows_columns_and_ratios(table):
    rows = {r["setting"]: r for r in table["rows"]}
    assert list(rows) == list(SUBSET)
    for r in rows.values():
        for k in ("saved_bytes", "temp_bytes", "step_ms", "flops", "saved_ratio", "temp_ratio", "time_ratio",
                  "flops_ratio", "loss"):
            assert r[k] is not None and r[k] > 0, (r["setting"], k)
        assert len(r["step_ms_all"]) == 2
        base = rows[r["base"]]
        assert r["saved_ratio"] == pytest.approx(r["saved_bytes"] / base["saved_bytes"])
        assert r["time_ratio"] == pytest.approx(r["step_ms"] / base["step_ms"])
    bf16, bf16_none = rows["policy bf16 (bf16)"], rows["none (bf16)"]
    assert bf16["base"] == "none (bf16)"  # against the bf16 no-remat row, not the float32 one
    assert bf16["temp_ratio"] == pytest.approx(bf16["temp_bytes"] / bf16_none["temp_bytes"])
    assert bf16["flops_ratio"] == pytest.approx(bf16["flops"] / bf16_none["flops"])
    assert rows["full"]["saved_bytes"] < rows["none"]["saved_bytes"]
    assert rows["full"]["flops"] > rows["none"]["flops"]  # the recomputation is in the compiled program
    assert rows["full"]["loss"] == pytest.approx(rows["none"]["loss"], rel=1e-6)  # remat never changes the forward


def test_policy_table_report_and_targets(table):
    names = [t["name"] for t in table["targets"]]
    assert names == ["full remat step time ≤ 1.30× none", "selective core_attn step time ≤ 1.05× none",
                     "selective core_attn saves ≥ 40% fewer bytes than none"]
    text = policies.report(table)
    assert "| setting | recompute | dtype | saved MiB (XLA:CPU) |" in text and "| step ms (XLA:CPU, this host) |" in text
    assert "| none (bf16) |" in text
    for t in table["targets"]:  # each verdict printed is the one evaluate() reached
        assert Target(**t).line() in text
    json.dumps(table)  # the --json payload is serializable


@pytest.mark.parametrize("full_time, core_time, core_saved, verdicts", [
    (1.30, 1.05, 0.60, [True, True, True]),     # on every bound: met
    (1.31, 1.06, 0.61, [False, False, False]),  # just past every bound: missed
    (0.90, 1.20, 0.10, [True, False, True]),    # 90% fewer saved bytes
])
def test_policy_targets_on_both_sides(full_time, core_time, core_saved, verdicts):
    rows = [dict(setting="full", time_ratio=full_time),
            dict(setting="selective core_attn", time_ratio=core_time, saved_ratio=core_saved)]
    got = policies.evaluate(rows)
    assert [t.met for t in got] == verdicts
    assert [bool(t.note) for t in got] == [False, False, not verdicts[2]]  # a missed saving says why


def test_gpu_check_targets_on_both_sides():
    search = dict(capped=False, complete=True)
    row = lambda mfu, tps, mb: dict(mfu=mfu, tokens_per_s=tps, max_batch=mb, search=search)
    goals = {"mfu": 0.45, "throughput": 0.72, "batch": 4.0}
    met = gpu_check.evaluate({"none": row(0.45, 1000, 10), "full": row(0.3, 720, 40)}, goals)
    assert [t.met for t in met] == [True, True, True]
    missed = gpu_check.evaluate({"none": row(0.44, 1000, 10), "full": row(0.3, 719, 39)}, goals)
    assert [t.met for t in missed] == [False, False, False]
    capped = gpu_check.evaluate({"none": row(0.5, 1000, 10), "full": dict(row(0.3, 800, 39),
                                                                            search=dict(capped=True, complete=True))},
                                goals)
    assert not capped[2].met and "lower bound" in capped[2].note


@pytest.mark.slow  # ~12 s; test_policy_table_rows_columns_and_ratios keeps the table fast
def test_temp_column_equals_compiled_memory_of_grad():
    """The table reads temp bytes off the value_and_grad executable it compiles (the one it times on
    this host); they are jax.grad's. Compiled by XLA:GPU for an H200 (`--target h200`), the full
    remat row: returning the loss too adds at most one buffer of XLA:GPU's 256-byte alignment
    (measured: 192,104 vs 191,848 B, +256; on XLA:CPU the two are equal)."""
    need("cuda")
    full = [s for s in policies.default_settings(TINY["n_layer"]) if s.name == "full"]
    res = policies.run("gpt2", "ref", steps=1, settings=full, target=GPU, log=lambda _: None, **TINY)
    cfg, seq = policies.build_config("gpt2", "ref", **{k: TINY[k] for k in ("n_layer", "n_embd", "n_head", "seq")},
                                     vocab=TINY["vocab"])
    cfg = dataclasses.replace(cfg, recompute=full[0].recompute)
    params, idx, tgt = policies.inputs(cfg, TINY["batch"], seq)  # the table's inputs (fixed seed)
    f = lambda p, i, t: gpt2.loss_fn(p, cfg, i, t)
    assert res["rows"][0]["step_ms"] is None  # built for the target, not run here
    grad_temp = compiled_memory(jax.grad(f), params, idx, tgt, target=GPU).temp
    assert 0 < grad_temp <= res["rows"][0]["temp_bytes"] <= grad_temp + 256, (res["rows"][0]["temp_bytes"], grad_temp)


def test_interleaved_ms_rotates_and_skips_warmup():
    calls = []
    out = interleaved_ms({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, n=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert [len(v) for v in out.values()] == [3, 3]


def test_largest_batch_doubles_then_bisects():
    r = gpu_check.largest_batch(lambda b: b <= 40, 8, 512, bisect=10)
    assert (r["max_batch"], r["first_fail"], r["capped"], r["complete"]) == (40, 41, False, True)
    assert [b for b, _ in r["tried"]][:3] == [16, 32, 64]
    r = gpu_check.largest_batch(lambda b: True, 8, 100)
    assert (r["max_batch"], r["capped"], [b for b, _ in r["tried"]]) == (100, True, [16, 32, 64, 100])
    r = gpu_check.largest_batch(lambda b: b <= 40, 8, 512, bisect=1)
    assert (r["max_batch"], r["first_fail"]) == (32, 48)
    t = iter(range(100))
    r = gpu_check.largest_batch(lambda b: True, 8, 512, deadline=2, clock=lambda: next(t))
    assert (r["max_batch"], r["complete"]) == (32, False)


def test_largest_batch_seeded_at_a_guess():
    # A good guess: 0.9·guess fits, 1.25× that fails, then bisection: 4 trials instead of doubling's 7.
    r = gpu_check.largest_batch(lambda b: b <= 800, 32, 4096, bisect=2, guess=820)
    assert [b for b, _ in r["tried"]] == [738, 922, 830, 784] and (r["max_batch"], r["first_fail"]) == (784, 830)
    # A guess too high: step down by 0.7× until one fits, then bisect.
    r = gpu_check.largest_batch(lambda b: b <= 300, 32, 4096, bisect=1, guess=820)
    assert [b for b, _ in r["tried"]] == [738, 516, 361, 252, 306] and r["max_batch"] == 252


def test_gpu_check_targets_and_sizing_from_the_analytic_model():
    """The restated targets are 90% of the analytic figures, and the default run's predicted cost fits
    its budget, which with the grace of the last worker stays under the 8 minutes."""
    a = gpu_check._parser().parse_args([])
    names = list(gpu_check.settings(12))
    models = {n: gpu_check.analytic(a, gpu_check.settings(12)[n]) for n in names}
    goals = gpu_check.targets_from_model(models)
    n, f = models["none"], models["full"]
    assert goals["batch"] == pytest.approx(0.9 * n["per_seq"] / f["per_seq"]) and 2.0 < goals["batch"] < 4.0
    assert 0.7 < goals["throughput"] < 0.8 and 0.4 < goals["mfu"] < 0.45
    # The chunked loss is what makes full remat worth its batch: without it the logits dominate.
    plain = gpu_check._parser().parse_args(["--loss_chunk", "0"])
    assert gpu_check.analytic(plain, {})["per_seq"] / gpu_check.analytic(plain, dict(granularity="full"))[
        "per_seq"] < 0.6 * n["per_seq"] / f["per_seq"]
    costs = [gpu_check.predicted_cost(a, m, models[m], gpu_check.NOMINAL_LIMIT) for m in names]
    assert sum(costs) <= a.budget_s and a.budget_s + a.grace_s + 30 <= 8 * 60
    guesses = {m: gpu_check.predicted_batch(models[m], gpu_check.NOMINAL_LIMIT) for m in names}
    assert guesses["full"] > 2 * guesses["none"] and 1.25 * 0.9 * guesses["full"] < a.max_batch


def test_is_oom():
    assert gpu_check.is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB"))
    assert not gpu_check.is_oom(ValueError("shapes do not match"))


def test_gpu_check_settings():
    assert list(gpu_check.settings(12)) == ["none", "full", "uniform 2", "block 6", "selective core_attn",
                                            "offload mlp"]


@pytest.mark.slow
def test_gpu_check_smoke_writes_table_and_json(tmp_path):
    # Two of the five settings: each runs in its own process (JAX start, two compiles), ~10 s on
    # a busy 2-core machine. `--smoke` alone runs all five.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "remat_lm.bench.gpu_check", "--smoke", "--settings", "none,full",
                        "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(res["rows"]) == ["none", "full"]
    for r in res["rows"].values():
        assert r["error"] is None and r["step_ms"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
        assert r["max_batch"] >= 2 and r["search"]["tried"]
    goals = res["meta"]["goals"]
    assert [t["name"] for t in res["targets"]] == [
        f"MFU ≥ {100 * goals['mfu']:.0f}% without remat", f"full remat throughput ≥ {goals['throughput']:.2f}× none",
        f"full remat fits ≥ {goals['batch']:.1f}× the batch of none"]
    assert all(r["loss_chunk"] == 8 for r in res["rows"].values())  # the chunked loss is on
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| setting | peak GiB |" in md and "Targets:" in md
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".worker")]


def test_gpu_check_sh_environment_and_arguments(tmp_path):
    """Run the script with a stand-in Python that records what it was given: the allocator
    settings, the working directory, and the arguments passed through to remat_lm.bench.gpu_check."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    f"echo \"$PWD|$XLA_PYTHON_CLIENT_PREALLOCATE|$XLA_PYTHON_CLIENT_MEM_FRACTION|"
                    f"$XLA_CLIENT_MEM_FRACTION|$*\" >> {log}\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env["PYTHON"] = str(fake)
    sh = os.path.join(ROOT, "remat_lm", "bench", "gpu_check.sh")
    p = subprocess.run(["bash", sh, "--settings", "none,full"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    probe, main, validate = log.read_text().splitlines()
    assert probe.startswith(f"{ROOT}|false|0.95|0.95|-c import jax")
    assert main == f"{ROOT}|false|0.95|0.95|-m remat_lm.bench.gpu_check --settings none,full"
    # then the planner's validation on the GPU, results beside gpu_check's
    assert validate.startswith(f"{ROOT}|false|0.95|0.95|-m remat_lm.bench.planner --target h200 ")
    assert "--validate" in validate and validate.endswith("--json out/gpu_check/planner_validate.json")
    # a caller's memory fraction is kept, and the XLA client follows it
    log.unlink()
    subprocess.run(["bash", sh], env=dict(env, XLA_PYTHON_CLIENT_MEM_FRACTION="0.5"), check=True, timeout=60)
    assert log.read_text().splitlines()[1] == f"{ROOT}|false|0.5|0.5|-m remat_lm.bench.gpu_check"


def test_torch_peer_without_torch_exits_2(monkeypatch, capsys):
    from remat_lm.bench import torch_peer
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert torch_peer.main([]) == 2
    assert "pip install -e '.[peer]'" in capsys.readouterr().err


@pytest.mark.slow  # the PyTorch side-by-side (make bench prints it); ~25 s
def test_torch_peer_tiny():
    pytest.importorskip("torch")  # the optional `peer` extra
    from remat_lm.bench import torch_peer
    res = torch_peer.run(steps=2, torch_threads=(1, 2), log=lambda _: None, **TINY)
    rows = {r["impl"]: r for r in res["rows"]}
    assert list(rows) == ["JAX none", "JAX full", "PyTorch eager, 1 thread", "PyTorch eager, 2 threads",
                          "PyTorch checkpoint per block, 1 thread", "PyTorch checkpoint per block, 2 threads"]
    # Same weights, same math: the initial losses agree (float32, different summation orders).
    losses = [r["loss"] for r in rows.values()]
    assert max(losses) - min(losses) < 1e-4
    assert rows["PyTorch checkpoint per block, 1 thread"]["saved_bytes"] < rows["PyTorch eager, 1 thread"]["saved_bytes"]
    # At equal activations the two frameworks keep the same bytes, up to two (B, T) arrays.
    assert abs(rows["JAX none"]["saved_bytes"] - rows["PyTorch eager, 1 thread"]["saved_bytes"]) <= \
        2 * 4 * TINY["batch"] * TINY["seq"]
    # "× own no-remat": each remat row against its own framework's (and thread count's) plain row
    assert rows["JAX full"]["time_ratio"] == pytest.approx(rows["JAX full"]["step_ms"] / rows["JAX none"]["step_ms"])
    ck, eager = rows["PyTorch checkpoint per block, 2 threads"], rows["PyTorch eager, 2 threads"]
    assert ck["time_ratio"] == pytest.approx(ck["step_ms"] / eager["step_ms"])
    assert len(res["targets"]) == 3 and "thread" in res["targets"][0]["measured"]
    assert "| PyTorch eager, 1 thread |" in torch_peer.report(res)
    assert torch_peer.thread_counts(None, 2) == [1, 2] and torch_peer.thread_counts("2", 2) == [2]


@pytest.mark.slow  # ~12 s of compiles
def test_loss_chunk_bench_rows_and_target():
    from remat_lm.bench import loss_chunk
    res = loss_chunk.run("tiny", seq=32, batch=2, chunks=(8,), log=lambda _: None)
    rows = {(r["setting"], r["loss_chunk"]): r for r in res["rows"]}
    assert list(rows) == [("none", 0), ("none", 8), ("full", 0), ("full", 8)]
    for (name, chunk), r in rows.items():
        assert r["temp_ratio"] == pytest.approx(r["temp_bytes"] / rows[(name, 0)]["temp_bytes"])
        assert r["saved_bytes"] < rows[(name, 0)]["saved_bytes"] or not chunk  # the logits are not kept
    (t,) = res["targets"]
    assert t["name"].startswith("full remat + loss_chunk 8 temp ≤ 0.5×") and t["met"] == (
        rows[("full", 8)]["temp_bytes"] <= 0.5 * rows[("full", 0)]["temp_bytes"])
    assert "| full | 8 |" in loss_chunk.report(res)


def test_gpu_check_attention_rows():
    assert list(gpu_check.attention_settings()) == ["attn tiled none", "attn tiled full", "attn cudnn none",
                                                    "attn cudnn full", "attn tiled@512 full"]
    # timed-only rows run first: the attention rows and cpu_checkpointing
    assert list(gpu_check._all_settings(12))[:6] == list(gpu_check.attention_settings()) + ["cpu_checkpointing"]
    assert gpu_check.timed_settings()["cpu_checkpointing"] == ("auto", dict(granularity="full", offload_inputs=True))
    # A cuDNN row where cuDNN cannot run (this CPU) is reported unavailable, in-process worker.
    a = gpu_check._parser().parse_args(["--smoke", "--worker", "attn cudnn none"])
    a.preset, a.seq, a.batch, a.steps, a.max_batch, a.bisect = "tiny", 32, 2, 2, 4, 1
    row = gpu_check.worker(a)
    if jax.default_backend() != "gpu":
        assert "cannot run" in row["unavailable"] and "tiled" in row["unavailable"]
        meta = dict(preset="tiny", n_layer=2, seq=32, batch=2, dtype="bfloat16", steps=2, peak_tflops=989.0,
                    max_batch=4, date="-")
        assert "| attn cudnn none | — |" in gpu_check.report(meta, {"attn cudnn none": row})


@pytest.mark.slow
def test_gpu_check_smoke_attention_rows(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "remat_lm.bench.gpu_check", "--smoke", "--settings", "attn tiled full,attn cudnn full",
                        "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    tiled = rows["attn tiled full"]
    assert tiled["error"] is None and tiled["step_ms"] > 0 and 0 < tiled["mfu"] < 1 and tiled["search"] is None
    assert "unavailable" in rows["attn cudnn full"] and "| attn cudnn full |" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow  # six compilations (three settings × two cores)
def test_attention_bench_tiny():
    from remat_lm.bench import attention as bench_attention
    res = bench_attention.run((48,), n_layer=1, n_embd=32, n_head=4, vocab=256, steps=1, tile=16, log=lambda _: None)
    rows = {(r["setting"], r["attention"]): r for r in res["rows"]}
    assert list(rows) == [(s, c) for s in bench_attention.SETTINGS for c in bench_attention.CORES]
    for (s, c), r in rows.items():
        assert r["temp_vs_xla"] == pytest.approx(r["temp_bytes"] / rows[(s, "xla")]["temp_bytes"])
        assert r["loss"] == pytest.approx(rows[("none", "xla")]["loss"], rel=1e-6)  # same model, any core
    # the tiled rows really compile the other core
    xla, tiled = rows[("none", "xla")], rows[("none", "tiled")]
    assert (xla["temp_bytes"], xla["flops"]) != (tiled["temp_bytes"], tiled["flops"])
    assert [t["name"] for t in res["targets"]] == ["T=48: full-remat compiled temp, tiled ≤ 0.5× xla's",
                                                   "T=48: no-remat step time, tiled ≤ xla's"]
    assert "| 48 | full | tiled |" in bench_attention.report(res)


@pytest.mark.parametrize("argv", [["remat_lm.bench.attention", "--cores", "tiled"]])
def test_bench_bad_input_exits_2_with_one_line(argv):
    """Bad input found after argument parsing is a usage error (2), like argparse's own, not rc 1."""
    p = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[-1].startswith(f"python -m {argv[0]}: error: {argv[1]} ") and argv[2] in lines[-1]


# --- --target: the compiler a figure comes from

@pytest.mark.parametrize("argv,words", [
    (["remat_lm.bench.policies", "--target", "h300"], "argument --target: target 'h300' is not known"),
    (["remat_lm.bench.attention", "--cores", "xla,cudnn", "--target", "h200"], "add --dtype bfloat16"),
    (["remat_lm.bench.attention", "--cores", "xla,pallas"], "optionally tiled for --target cpu"),
    (["remat_lm.bench.peaks", "--models", "gpt3"], "--models: unknown gpt3")])
def test_bench_target_bad_input_exits_2_with_one_line(argv, words):
    p = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    last = [l for l in p.stderr.splitlines() if l.strip()][-1]
    assert last.startswith(f"python -m {argv[0]}: error: ") and words in last, last


@pytest.mark.slow  # ~9 s; tests/test_target_peaks.py keeps the bench's compile for a GPU fast
def test_policies_for_a_gpu_target_report_its_compiler_and_skip_timing():
    from targethelp import need
    need("cuda")
    settings = [s for s in policies.default_settings(TINY["n_layer"]) if s.name in ("none", "full")]
    res = policies.run("gpt2", "ref", steps=2, settings=settings, target="h200", log=lambda _: None, **TINY)
    assert res["meta"]["source"]["compiler"] == "XLA:GPU" and not res["meta"]["source"]["timed"]
    assert all(r["step_ms"] is None and r["loss"] is None for r in res["rows"])
    assert res["rows"][1]["temp_bytes"] < res["rows"][0]["temp_bytes"]
    assert "time" not in " ".join(t["name"] for t in res["targets"])  # no time verdict without a run
    text = policies.report(res)
    assert "compiled by XLA:GPU for NVIDIA H200" in text and "not run" in text


@pytest.mark.slow  # ~20 s: a second process starts JAX and compiles; the `table` fixture keeps the host timing fast
def test_policies_time_a_gpu_targets_settings_on_this_host_from_a_second_process():
    """Memory from XLA:GPU (compiled here, no device), step times and losses from the same settings
    compiled for this host by a spawned process (make bench's default)."""
    need("cuda")
    settings = [s for s in policies.default_settings(TINY["n_layer"]) if s.name in ("none", "full")]
    res = policies.run("gpt2", "ref", steps=2, settings=settings, target="h200", time_here=True,
                       log=lambda _: None, **TINY)
    assert res["meta"]["source"]["compiler"] == "XLA:GPU" and res["meta"]["time_source"]["compiler"] == "XLA:CPU"
    none, full = res["rows"]
    assert all(len(r["step_ms_all"]) == 2 and r["step_ms"] > 0 for r in (none, full))
    assert full["temp_bytes"] < none["temp_bytes"]  # XLA:GPU's figures, not the host's
    assert none["loss"] == pytest.approx(full["loss"], rel=1e-6) and none["loss"] > 0  # remat leaves the loss alone


@pytest.mark.slow  # ~15 s; tests/test_target_peaks.py keeps the per-compiler peaks fast
def test_peaks_rows_and_merge_one_column_per_compiler(tmp_path):
    from remat_lm.bench import peaks
    import targethelp
    targethelp.need("cuda")
    shape = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=256)
    run = lambda target: peaks.run(target, ("gpt2",), batch=2, seq=32, rows=("none", "full"), shape=shape,  # noqa: E731
                                   log=lambda _: None)
    res = run("h200")
    none, full = res["rows"]
    assert (none["row"], full["row"]) == ("none", "full") and full["base"] == "none"
    assert full["ratio"] == full["temp"] / none["temp"] < 1
    assert res["meta"]["source"]["compiler"] == "XLA:GPU"
    other = run("cpu")
    assert other["meta"]["source"]["compiler"] == "XLA:CPU"
    table = peaks.merge([other, res])
    assert "XLA:CPU cpu: temp MiB (× base)" in table and "XLA:GPU h200: temp MiB (× base)" in table
