"""train.py --target NAME (remat_lm/training/target.py): the train step, the memory report, the
preflight and the planner built by the target's compiler with no device present; bad input is one
line and exit 2; a host that is the target trains as without the flag.

The fast cases compile the tiny model (a few compilations for XLA:GPU and XLA:TPU); the acceptance
commands (GPT-2 d12 on an H200, LLaMA-3 8B on 8 H200s) and the longer searches are slow."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import types

import pytest

import remat
from remat import names
from remat.planning import targets
from remat.memory import compiled_stats, format_bytes
from remat_lm.training import config_from_args, prepare
from remat_lm.training import target as run_target
from remat_lm.training.compile import compile_train_step, step_stats
from targethelp import need
from trainhelp import ROOT, _env, _main, _one_line, _run, ours

TINY = ["--preset", "tiny", "--val_every", "0", "--no-progress", "--num_iterations", "2"]
# bfloat16 for the cuDNN core, T a multiple of 128 for the Pallas one
BF16 = TINY + ["--dtype", "bfloat16", "--sequence_length", "128", "--batch_size", "8"]
MEMORY = re.compile(r"memory\s+(.*) per device \(compiled est\.\) by (XLA:\w+) for (.*)")
H200 = "NVIDIA H200 141GB HBM3e"


@pytest.mark.parametrize("args,match", [
    (["--target", "h900", "--dry_run"], "--target 'h900' is not known; use one of h100, h200, a100-80g, b200, v5e"),
    (["--target", "", "--dry_run"], "--target '' is empty"),
    (["--target", "h200", "--mesh", "fsdp=8", "--dry_run"],
     "--mesh fsdp=8 spans 8 devices but --target h200 has 1; pass --target h200x8 for that mesh"),
    (["--target", "h200x8", "--dry_run"],
     "--target h200x8 has 8; pass --target h200 for that mesh, or a mesh over all 8 (e.g. --mesh fsdp=8)"),
    (["--target", "v5e", "--mesh", "data=2,fsdp=4", "--dry_run"], "pass --target v5e:2x4 for that mesh"),
    (["--target", "cpux99", "--dry_run"], "--target 'cpux99': this host has 8 CPU device(s)"),
    (["--target", "h200"], "--target h200 is NVIDIA H200 141GB HBM3e, which this host has not got (it has 8 cpu "
                           "devices), so nothing can train on it; add --dry_run"),
    (["--target", "h200x8", "--mesh", "fsdp=8", "--recompute_method", "auto"],
     "nothing can train on it; add --dry_run (compile and check the train step for it, with the planned setting)"),
])
def test_bad_target_input_is_one_line_exit_2(args, match, capsys, tmp_path):
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    rc, out, err = _main(TINY + args + ["--log_jsonl", str(log), "--checkpoint_dir", str(ck)], capsys)
    assert rc == 2
    line = _one_line(err)
    assert line.startswith("train.py: error: ") and match in line, line
    assert out == "" and not log.exists() and not ck.exists()


def test_missing_compiler_is_one_line_exit_2(capsys, monkeypatch):
    """Without the CUDA plugin (as without the `targets` extra) the run stops before reading data,
    naming the install."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax_plugins.xla_cuda12" else real(name, *a))
    targets._topology_devices.cache_clear()
    try:
        rc, out, err = _main(TINY + ["--target", "b200", "--dry_run"], capsys)
    finally:
        monkeypatch.undo()
        targets._topology_devices.cache_clear()
    assert rc == 2 and out == ""
    line = _one_line(err)
    assert ("--target b200: compiling for b200 needs XLA:GPU's compiler (jax-cuda12-pjrt), which is not "
            "installed: pip install 'remat[targets]'") in line, line


def test_target_changes_the_compiled_program(capsys):
    """The join: the same run with --target h200 is another program (cuDNN attention, another compiled
    temp) whose figure the dry run prints, with a verdict against the H200's memory_limit; with
    --target v5e the Pallas kernel."""
    need("cuda", "tpu")
    args = BF16 + ["--target", "h200", "--dry_run"]
    rc, out, err = _main(args, capsys)
    assert rc == 0, err
    figure, compiler, what = MEMORY.search(out).groups()
    assert (compiler, what) == ("XLA:GPU", H200), out
    gpu = prepare(config_from_args(args))
    compiled = compile_train_step(gpu)  # the dry run's own program (cached in this process)
    stats = compiled_stats(compiled)
    assert figure == format_bytes(stats.peak_estimate)
    assert "__cudnn$fmha" in compiled.as_text()
    assert f"over {H200} (compile-only" in out and f"compiled in" in out and f"s by XLA:GPU for {H200}" in out

    host = compile_train_step(prepare(config_from_args(BF16 + ["--dry_run"])))
    assert "__cudnn" not in host.as_text() and compiled_stats(host).temp != stats.temp

    limit = targets.get("h200").memory_limit
    fits = re.search(rf"preflight the train step needs (\S+ \S+) per device \(XLA:GPU's figure\) of (\S+ \S+) "
                     rf"\(JAX's share \((\d+)%\) of an NVIDIA H200's 141.00 GiB\): fits on {H200} with (\d+)% "
                     rf"headroom at batch 8$", out, re.M)
    assert fits, out
    assert fits.group(1) == figure and fits.group(2) == format_bytes(limit)
    assert int(fits.group(3)) == round(100 * targets.mem_fraction())
    assert int(fits.group(4)) == math.floor(100 * (1 - stats.peak_estimate / limit))

    # the planner's cost on a GPU target: the optimized program's matmul FLOPs (XLA:GPU's cost
    # analysis gives none without a device), as many as the traced program's matrix products
    cm = step_stats(gpu)
    traced = remat.planning.targets.matmul_flops(compiled_jaxpr(gpu))
    assert cm.flops_source == "optimized HLO matmuls" and 0.9 * traced <= cm.flops <= 1.1 * traced, (cm.flops, traced)

    tpu = compile_train_step(prepare(config_from_args(BF16 + ["--target", "v5e", "--dry_run"])))
    assert "tpu_custom_call" in tpu.as_text() and "__cudnn" not in tpu.as_text()
    assert compiled_stats(tpu).temp not in (stats.temp, compiled_stats(host).temp)


def compiled_jaxpr(setup):
    """The traced train step the compile cache holds for `setup` (what step_stats counted)."""
    from remat_lm.training import compile as compile_lib
    return compile_lib._compiled(setup)[1]


@pytest.mark.slow  # ~20 s; test_target_changes_the_compiled_program stays fast
def test_memory_report_gives_a_verdict_per_method(capsys, monkeypatch):
    """--memory_report --target h200 over two methods: the saved table is traced for cuda (the cuDNN
    core's tagged residuals), the compiled table is XLA:GPU's, and each method gets its verdict. The
    memory fraction is set between the two compiled peaks, so one fits and one does not."""
    need("cuda")
    args = TINY + ["--dtype", "bfloat16", "--sequence_length", "128", "--batch_size", "512", "--n_layer", "4",
                   "--activation_recompute", "--recompute_method", "uniform,block", "--recompute_num_layers", "1",
                   "--target", "h200", "--memory_report"]
    rc, out, err = _main(args, capsys)
    assert rc == 0, err
    assert f"mesh data=1,fsdp=1 on {H200} (XLA:GPU, compile-only: no device here)" in out
    assert re.search(rf"^  {names.ATTN_PROBS}\s", out, re.M), out  # cuDNN's residuals: traced for cuda
    assert f"XLA:GPU for {H200}: its compiled train step, per device" in out
    peaks = re.search(r"^  peak estimate\s+\S+ \S+\s+(\S+ \S+)\s+(\S+ \S+)$", out, re.M).groups()  # after no remat
    setup = prepare(config_from_args(args))
    got = [compiled_stats(compile_train_step(setup, m)).peak_estimate for _, m in setup.mcfgs]
    assert list(peaks) == [format_bytes(p) for p in got]
    uniform, block = got
    assert uniform < block

    memory = targets.get("h200").memory
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", str((uniform + block) / 2 / memory))
    rc, out, err = _main(args, capsys)  # the same programs (cached), another capacity
    assert rc == 0, err
    limit = targets.get("h200").memory_limit
    assert uniform < limit < block
    assert f"verdict against {format_bytes(limit)} per device, JAX's share (" in out
    head = math.floor(100 * (1 - uniform / limit))
    assert re.search(rf"^  full/uniform/1\s+fits on {H200} with {head}% headroom at batch 512 \(needs "
                     rf"{re.escape(format_bytes(uniform))}\)$", out, re.M), out
    assert re.search(rf"^  full/block/1\s+does not fit on {H200} at batch 512 \(needs "
                     rf"{re.escape(format_bytes(block))}\)$", out, re.M), out
    verdicts = out[out.index("verdict against"):].splitlines()[1:]
    assert [v.split()[0] for v in verdicts] == ["no", "full/uniform/1", "full/block/1"], verdicts  # one each


@pytest.mark.slow  # ~27 s (five XLA:GPU compiles); tests/test_planner.py keeps the per-tag planner's pieces fast
def test_auto_budget_defaults_to_the_targets_memory(capsys):
    """--recompute_method auto with --target and no --memory_budget: the budget is the target's
    memory_limit (no remat fits it here, so the plan recomputes nothing); without a target the flag is
    still required."""
    need("cuda")
    # BF16's shapes: the planner's first program (no remat) is the join test's, compiled once per process
    rc, out, err = _main(BF16 + ["--target", "h200", "--recompute_method", "auto", "--dry_run"], capsys)
    assert rc == 0, err
    limit = format_bytes(targets.get("h200").memory_limit)
    assert (f"planner  fitting the train step into {limit}, the memory of --target h200 (JAX's share") in out
    assert f"compiling candidate settings by XLA:GPU for {H200})" in out
    both = out + err  # the planner's table and the summary go to stderr, the progress lines to stdout
    # the per-tag planner (docs/planner.md): none fits the budget, so the plan recomputes nothing
    assert "plan: none x2" in both and "(fits)" in both and MEMORY.search(both).group(2) == "XLA:GPU"
    rc, out, err = _main(TINY + ["--recompute_method", "auto", "--dry_run"], capsys)
    assert rc == 2 and "needs --memory_budget SIZE" in _one_line(err)


def test_the_host_as_target_trains_as_without_the_flag():
    """--target cpux1 on this CPU host is the host: it trains (no --dry_run needed), the same program
    and the same losses as without the flag."""
    with_flag, out = _run(BF16 + ["--target", "cpux1"])
    without, _ = _run(BF16)
    assert [h["loss"] for h in with_flag.history] == [h["loss"] for h in without.history]
    assert len(with_flag.history) == 2 and not with_flag.setup.deviceless
    assert with_flag.setup.target.name == "cpux1" and "compile-only" not in out


@pytest.mark.parametrize("name,kind,platform,expected", [
    ("h200", "NVIDIA H200", "gpu", True),
    ("h200", "NVIDIA H100 80GB HBM3", "gpu", False),
    ("h200", "NVIDIA GH200 480GB", "gpu", False),
    ("h100", "NVIDIA H100 80GB HBM3", "gpu", True),
    ("a100-80g", "NVIDIA A100-SXM4-80GB", "gpu", True),
    ("a100-80g", "NVIDIA A100-SXM4-40GB", "gpu", False),
    ("v5e", "TPU v5 lite", "tpu", True),
    ("v5p", "TPU v5 lite", "tpu", False),
    ("v6e", "TPU v6 lite", "tpu", True),
    ("h200", "cpu", "cpu", False),
])
def test_a_host_device_is_the_target_by_platform_and_kind(name, kind, platform, expected):
    device = types.SimpleNamespace(platform=platform, device_kind=kind)
    assert targets.get(name).spec.is_device(device) is expected


@pytest.mark.slow  # ~12 s
def test_refused_by_the_tpu_compiler_is_a_verdict_in_one_line(tmp_path):
    """A real train.py process: XLA:TPU refuses a step too large for a v5e; the run says it does not
    fit, with the compiler's figure, in one line on stderr (its last, after what libtpu prints when it
    loads), exit 2, nothing written."""
    need("tpu")
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *TINY, "--batch_size", "400000",
                        "--target", "v5e", "--dry_run", "--no-preflight", "--log_jsonl", str(log),
                        "--checkpoint_dir", str(ck)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    line = ours(p.stderr)[-1]
    m = re.search(r"the train step does not fit on TPU v5e at batch 400000: XLA:TPU cannot fit the program on TPU "
                  r"v5e: RESOURCE_EXHAUSTED: .*HLO temporaries \(([\d.]+)G\)", line)
    assert m and float(m.group(1)) * 2 ** 30 > targets.get("v5e").memory, line
    assert p.stdout.startswith("compile  the train step") and not log.exists() and not ck.exists()


# ------------------------------------------------------------------------------------------------
# The acceptance commands and the longer searches (slow).

@pytest.mark.slow  # ~30 s: GPT-2 d12 at 16 x 1024 for one H200
def test_d12_on_an_h200(capsys):
    need("cuda")
    args = ["--preset", "d12", "--target", "h200", "--dry_run", "--batch_size", "16", "--sequence_length", "1024",
            "--dtype", "bfloat16", "--no-progress"]
    rc, out, err = _main(args, capsys)
    assert rc == 0, err
    figure, compiler, what = MEMORY.search(out).groups()
    assert (compiler, what) == ("XLA:GPU", H200)
    compiled = compile_train_step(prepare(config_from_args(args)))
    assert figure == format_bytes(compiled_stats(compiled).peak_estimate)
    assert "__cudnn$fmha" in compiled.as_text() and "vocab 50257" in out
    assert re.search(rf"fits on {H200} with \d+% headroom at batch 16", out)


@pytest.mark.slow  # ~35 s: two compilations of LLaMA-3 8B for 8 H200s (scanned layers)
def test_llama3_8b_on_8_h200s(capsys):
    """One 8192-token sequence per device: the full train step (parameters and AdamW state sharded
    over fsdp=8, the batch, the activations) per device, with and without full remat."""
    need("cuda")
    args = ["--model", "llama3", "--preset", "8b", "--target", "h200x8", "--mesh", "fsdp=8", "--dry_run",
            "--batch_size", "8", "--sequence_length", "8192", "--dtype", "bfloat16", "--scan_layers", "--no-progress"]
    peaks = {}
    for label, extra in (("none", []), ("full", ["--activation_recompute"])):
        rc, out, err = _main(args + extra, capsys)
        assert rc == 0, err
        figure, compiler, what = MEMORY.search(out).groups()
        assert (compiler, what) == ("XLA:GPU", "8 x " + H200)
        setup = prepare(config_from_args(args + extra))
        cm = compiled_stats(compile_train_step(setup))
        assert figure == format_bytes(cm.peak_estimate)
        n = setup.fam.num_params(setup.mcfg)
        # the arguments: float32 parameters and AdamW's two moments, an eighth of each per device
        assert cm.argument == pytest.approx(12 * n / 8, rel=0.02)
        assert "vocab 128256" in out and re.search(rf"(fits|does not fit) on 8 x {H200}", out)
        peaks[label] = cm.peak_estimate
    assert peaks["full"] < peaks["none"]


@pytest.mark.slow  # ~70 s: the advice's candidates compiled for the H200
def test_preflight_advice_on_a_target_fits_there(capsys):
    """A step too large for an H200: exit 2, the verdict and advice found by compiling for the H200;
    the advice run as given fits there."""
    need("cuda")
    base = TINY + ["--n_layer", "4", "--target", "h200", "--dry_run"]
    rc, out, err = _main(base + ["--batch_size", "4000000"], capsys)
    assert rc == 2
    line = _one_line(err)
    assert f"(XLA:GPU's figure) but JAX's share" in line and f"does not fit on {H200} at batch 4000000" in line
    advice = re.search(r"e\.g\. (--batch_size \d+(?: --grad_accum_steps \d+)? --activation_recompute "
                       r"--loss_chunk \d+)", line) or re.search(r"try (--recompute_method auto --memory_budget \S+"
                                                                r"(?: --loss_chunk \d+)?)", line)
    assert advice, line
    rc, out, err = _main(base + ["--batch_size", "4000000"] + advice.group(1).split(), capsys)
    assert rc == 0, err
    assert re.search(rf"fits on {H200} with \d+% headroom", out)


@pytest.mark.slow  # ~4 min on 2 loaded cores: the planner's calibration and verification, compiled by XLA:GPU
def test_planner_on_a_target_fits_its_budget(capsys):
    need("cuda")
    base = TINY + ["--n_layer", "4", "--batch_size", "4096", "--target", "h200"]
    full = compile_train_step(prepare(config_from_args(base + ["--activation_recompute", "--dry_run"])))
    none = compile_train_step(prepare(config_from_args(base + ["--dry_run"])))
    lo, hi = compiled_stats(full).peak_estimate, compiled_stats(none).peak_estimate
    budget = (lo + hi) // 2
    rc, out, err = _main(base + ["--recompute_method", "auto", "--memory_budget", str(budget), "--dry_run"], capsys)
    assert rc == 0, err
    peak = re.search(r"memory\s+(.*) per device", out).group(1)
    setup = prepare(config_from_args(base + ["--recompute_method", "auto", "--memory_budget", str(budget), "--dry_run"]))
    from remat_lm.training.compile import plan_memory
    import io
    planned, plan = plan_memory(setup, io.StringIO())
    cm = compiled_stats(compile_train_step(planned))
    assert format_bytes(cm.peak_estimate) == peak and cm.peak_estimate <= budget


@pytest.mark.slow  # ~80 s: XLA:TPU refuses the step and the first candidates; a smaller batch fits
def test_tpu_refusal_advice_fits(capsys):
    need("tpu")
    base = TINY + ["--target", "v5e", "--dry_run"]
    rc, out, err = _main(base + ["--batch_size", "400000"], capsys)
    assert rc == 2
    line = _one_line(err)
    assert "does not fit on TPU v5e at batch 400000: XLA:TPU cannot fit the program" in line
    advice = re.search(r"e\.g\. (--batch_size \d+(?: --grad_accum_steps \d+)? --activation_recompute "
                       r"--loss_chunk \d+)", line)
    assert advice and "is refused by XLA:TPU (needs" in line, line
    rc, out, err = _main(base + advice.group(1).split(), capsys)
    assert rc == 0, err
    assert re.search(r"fits on TPU v5e with \d+% headroom", out)


@pytest.mark.parametrize("value", ["half", "7"])
def test_a_bad_gpu_memory_fraction_is_one_line_exit_2(value):
    """XLA_PYTHON_CLIENT_MEM_FRACTION is read by the CUDA plugin as it builds a deviceless GPU and by
    the budget: a value that is not a fraction is named, not replaced by the default or a traceback."""
    need("cuda")
    env = _env(XLA_PYTHON_CLIENT_MEM_FRACTION=value)
    env.pop("JAX_PLATFORMS")  # as a user's shell
    p = subprocess.run([sys.executable, "train.py", "--preset", "tiny", "--dry_run", "--target", "h200"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    line = _one_line(p.stderr)
    assert p.returncode == 2 and f"XLA_PYTHON_CLIENT_MEM_FRACTION={value}: not a fraction in (0, 1]" in line, p.stderr
