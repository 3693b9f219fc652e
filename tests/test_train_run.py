"""Training runs in-process: the acceptance commands, identical first losses across recompute
settings, exact resume, NaN stop, gradient accumulation, --init_from, --memory_report, --dry_run.

Runs share compilations through the per-process caches in remat_lm/training/compile.py, so parametrized
settings that compile the same program pay once.
"""
import json
import math
import pathlib
import re
import os

import jax
import numpy as np
import pytest

from remat_lm.models import gpt2, llama3
from remat_lm.models.llmc import save as save_llmc
from remat_lm.training import TrainingDiverged, config_from_args, prepare
from remat_lm.training import saving
from remat_lm.training.resume import initial_state
from trainhelp import COMMON, _run, text_file  # noqa: F401 (text_file is a fixture)

# The acceptance commands (each also run with --model llama3 below).
BASE = "--model gpt2 --preset tiny --num_iterations 3 --activation_recompute --recompute_method uniform " \
       "--recompute_num_layers 2"
VARIANTS = {
    "uniform": "",
    "block": "--recompute_method block --recompute_num_layers 1",
    "selective": "--recompute_granularity selective --recompute_method none --recompute_num_layers 1",
    "use_reentrant": "--use_reentrant",
    "scan_layers": "--scan_layers",
    "bfloat16": "--dtype bfloat16",
}
# Fast: GPT-2's uniform, scan and bf16 commands and LLaMA-3's uniform and selective ones; the rest
# with the slow set (block and reentrant reach the same stack: test_models compares each with no
# remat, test_first_loss_identical_for_more_settings runs reentrant under scan through train.py).
FAST = {("gpt2", "uniform"), ("llama3", "selective")}  # scan: tests/test_flag_to_program.py
QUIET = ["--val_every", "0", "--no-progress"]
# Most tests share these flags so that they share compilations with the acceptance runs.
TINY = ["--preset", "tiny", "--num_iterations", "3"] + QUIET


@pytest.fixture(scope="module")
def baseline(text_file):
    """First-step loss with recompute off, per model (float32)."""
    out = {}
    for model in ("gpt2", "llama3"):
        res, _ = _run(["--model", model] + TINY + ["--data", text_file])
        out[model] = res.history[0]["loss"]
    return out


def _params():
    return [pytest.param(m, v, marks=() if (m, v) in FAST else pytest.mark.slow)
            for m in ("gpt2", "llama3") for v in VARIANTS]


@pytest.mark.parametrize("model,variant", _params())
def test_acceptance_command_runs_with_finite_losses(model, variant, baseline, text_file):
    argv = (BASE.replace("gpt2", model) + " " + VARIANTS[variant]).split() + ["--data", text_file] + QUIET
    res, out = _run(argv + ["--log_every", "1"])
    losses = [h["loss"] for h in res.history]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert out.count("\nstep ") + out.startswith("step ") == 3
    if variant != "bfloat16":
        # remat never changes the forward pass: the first loss is bitwise that of no remat
        assert losses[0] == baseline[model], (losses[0], baseline[model])
    else:
        assert abs(losses[0] - baseline[model]) < 2e-2  # bf16 compute rounding (~3 significant digits)


@pytest.mark.parametrize("extra", [
    pytest.param(["--recompute_granularity", "selective", "--recompute_modules", "core_attn,mlp"],
                 marks=pytest.mark.slow),
    pytest.param(["--activation_recompute", "--use_reentrant", "--scan_layers", "--recompute_method", "uniform",
                  "--recompute_num_layers", "2"], marks=pytest.mark.slow),
    pytest.param(["--activation_recompute"], marks=pytest.mark.slow),
    pytest.param(["--activation_recompute", "--remat_policy", "dots"], marks=pytest.mark.slow),
    pytest.param(["--activation_recompute", "--remat_policy", "save_names:qkv,attn_context"], marks=pytest.mark.slow),
])
def test_first_loss_identical_for_more_settings(extra, baseline, text_file):
    res, _ = _run(TINY + ["--data", text_file] + extra)
    assert res.history[0]["loss"] == baseline["gpt2"]


def test_log_line_and_jsonl(tmp_path, text_file):
    log = tmp_path / "sub" / "log.jsonl"
    res, out = _run(TINY + ["--data", text_file, "--log_jsonl", str(log), "--val_every", "3", "--val_steps", "2"])
    recs = [json.loads(l) for l in log.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        for k in ("step", "loss", "grad_norm", "lr", "step_ms", "tokens_per_s", "mfu", "memory_bytes"):
            assert k in r
        assert r["mfu"] is None and r["memory_source"] == "compiled_estimate" and r["memory_bytes"] > 0  # CPU
    np.testing.assert_allclose([r["lr"] for r in recs], [1e-4, 2e-4, 3e-4], rtol=1e-6)  # warmup 30, peak 3e-3
    assert "val_loss" in recs[-1] and math.isfinite(recs[-1]["val_loss"])
    line = next(l for l in out.splitlines() if l.startswith("step 3/3"))  # the last step always has its line
    assert all(p in line for p in ("| loss ", "| norm ", "| lr ", " ms |", " tok/s |", "mfu n/a", "(compiled est.)"))
    assert "first step excluded" in out


def test_schedule_warmup_then_cosine_to_a_fraction():
    from remat_lm.training.optim import make_schedule
    f = make_schedule(1e-3, 2, 10, 0.1)
    lrs = [float(f(i)) for i in range(12)]
    np.testing.assert_allclose(lrs[:3], [5e-4, 1e-3, 1e-3], rtol=1e-6)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    np.testing.assert_allclose(lrs[10:], [1e-4, 1e-4], rtol=1e-6)


def test_weight_decay_mask_skips_norms_and_biases():
    from remat_lm.training.model import decay_mask
    cfg = gpt2.GPT2Config.preset("tiny")
    mask = decay_mask(jax.eval_shape(lambda: gpt2.init_params(cfg, jax.random.PRNGKey(0))))
    assert mask["wte"] and mask["blocks"]["h_0"]["attn"]["c_attn"]["kernel"]
    assert not mask["blocks"]["h_0"]["attn"]["c_attn"]["bias"] and not mask["blocks"]["h_1"]["ln_2"]["scale"]
    assert not mask["ln_f"]["scale"] and not mask["ln_f"]["bias"]


@pytest.mark.slow  # ~20 s; tests/test_resume_integrity.py keeps a bit-identical resume fast
def test_resume_is_bit_identical(tmp_path, text_file):
    """6 steps straight vs 3 + resume + 3: identical JSONL losses (float32, CPU)."""
    common = ["--preset", "tiny", "--data", text_file, "--lr_decay_iters", "6", "--warmup_iters", "2",
              "--dropout", "0.1"] + QUIET
    a, b, ck = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "ck"
    _run(common + ["--num_iterations", "6", "--log_jsonl", str(a)])
    _run(common + ["--num_iterations", "3", "--log_jsonl", str(b), "--checkpoint_dir", str(ck)])
    res, out = _run(common + ["--num_iterations", "6", "--log_jsonl", str(b), "--checkpoint_dir", str(ck),
                              "--resume"])
    assert "resume   from step 3" in out
    la = [json.loads(l) for l in a.read_text().splitlines()]
    lb = [json.loads(l) for l in b.read_text().splitlines()]
    assert [r["step"] for r in lb] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]
    assert [r["grad_norm"] for r in la] == [r["grad_norm"] for r in lb]
    info = saving.inspect_dir(str(ck))
    assert info.step == 6 and info.meta["data_position"] == 6 and set(info.steps) == {3, 6}


def test_checkpoint_holds_the_whole_state(tmp_path, text_file):
    ck = tmp_path / "ck"
    res, _ = _run(TINY + ["--data", text_file, "--checkpoint_dir", str(ck), "--checkpoint_every", "1",
                          "--keep_checkpoints", "1"])
    info = saving.inspect_dir(str(ck))
    assert info.steps == (3,)  # keep_checkpoints 1
    setup = prepare(config_from_args(TINY + ["--data", text_file]))
    state, meta = saving.restore(str(ck), 3, setup.abstract_state)
    assert set(state) == {"params", "opt_state", "step", "rng"} and int(state["step"]) == 3
    assert meta["data_position"] == 3 and meta["model"] == "gpt2" and meta["format"] == saving.FORMAT
    for x, y in zip(jax.tree.leaves(res.state), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_existing_checkpoints_need_resume(tmp_path, text_file):
    ck = tmp_path / "ck"
    _run(TINY + ["--data", text_file, "--checkpoint_dir", str(ck)])
    with pytest.raises(ValueError, match="pass --resume to continue"):
        _run(TINY + ["--data", text_file, "--checkpoint_dir", str(ck), "--num_iterations", "4"])
    with pytest.raises(ValueError, match="differs from this run's: n_embd"):
        _run(TINY + ["--data", text_file, "--n_embd", "64", "--num_iterations", "4", "--checkpoint_dir", str(ck),
                     "--resume"])
    with pytest.raises(ValueError, match="already at step 3"):
        _run(TINY + ["--data", text_file, "--checkpoint_dir", str(ck), "--resume"])
    # training flags must not change on resume (tests/test_train_faults.py checks more); the step count may
    with pytest.raises(ValueError, match=r"other settings: --learning_rate 0.0001 \(checkpoint: 0.003\)"):
        _run(TINY + ["--data", text_file, "--checkpoint_dir", str(ck), "--resume", "--num_iterations", "4",
                     "--learning_rate", "1e-4"])
    res, _ = _run(TINY + ["--data", text_file, "--checkpoint_dir", str(ck), "--resume", "--num_iterations", "4"])
    assert [h["step"] for h in res.history] == [4]


def test_nan_stops_and_keeps_the_last_good_checkpoint(tmp_path, text_file):
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    argv = ["--preset", "tiny", "--num_iterations", "6", "--data", text_file, "--learning_rate", "1e30",
            "--warmup_iters", "0", "--grad_clip", "0", "--checkpoint_dir", str(ck), "--checkpoint_every", "1",
            "--log_jsonl", str(log)] + QUIET
    with pytest.raises(TrainingDiverged, match=r"step 2: loss is nan.*last good checkpoint is step 1") as e:
        _run(argv)
    assert "\n" not in str(e.value)
    assert saving.inspect_dir(str(ck)).steps == (1,)
    setup = prepare(config_from_args(TINY + ["--data", text_file]))
    state, _ = saving.restore(str(ck), 1, setup.abstract_state)  # intact: restores completely
    assert int(state["step"]) == 1
    assert [json.loads(l)["step"] for l in log.read_text().splitlines()] == [1]


@pytest.mark.slow  # ~10 s
def test_grad_accumulation_matches_one_big_batch(text_file):
    """4 micro-batches of 2 == one batch of 8 made of the same rows (float32 summation order only)."""
    common = ["--preset", "tiny", "--num_iterations", "2", "--data", text_file, "--sequence_length", "32"] + QUIET
    acc, _ = _run(common + ["--batch_size", "2", "--grad_accum_steps", "4"])
    cfg = config_from_args(common + ["--batch_size", "8"])
    setup = prepare(cfg)
    x, y = setup.train_ds.batch(0, cfg.seed, 2, 32, 4)
    from remat_lm.training.step import make_train_step
    step = jax.jit(make_train_step(setup.fam, setup.mcfg, setup.tx, setup.schedule, 0.0))
    state, _, _ = initial_state(setup)
    _, m = step(state, x.reshape(1, 8, 32), y.reshape(1, 8, 32))
    # NOTE: mean of 4 means vs one mean over the same 256 tokens: equal up to float32 rounding
    np.testing.assert_allclose(acc.history[0]["loss"], float(m["loss"]), rtol=1e-6)
    np.testing.assert_allclose(acc.history[0]["grad_norm"], float(m["grad_norm"]), rtol=1e-5)


@pytest.mark.parametrize("model,scan", [("gpt2", False), ("gpt2", True), ("llama3", False)])
def test_init_from_llmc_file(model, scan, tmp_path, text_file):
    mod = gpt2 if model == "gpt2" else llama3
    cfg = (mod.GPT2Config if model == "gpt2" else mod.Llama3Config).preset("tiny")
    params = mod.init_params(cfg, jax.random.PRNGKey(7))
    path = tmp_path / "tiny.bin"
    save_llmc(str(path), cfg, params)
    setup = prepare(config_from_args(TINY + ["--model", model, "--init_from", str(path), "--data", text_file]
                                     + (["--scan_layers"] if scan else [])))
    state, position, _ = initial_state(setup)
    assert position == 0 and int(state["step"]) == 0
    got = mod.to_llmc(setup.mcfg, state["params"])
    for k, v in mod.to_llmc(cfg, params).items():
        np.testing.assert_array_equal(got[k], v)


def test_init_from_checkpoint_directory(tmp_path, text_file):
    ck = tmp_path / "ck"
    first, _ = _run(TINY + ["--data", text_file, "--checkpoint_dir", str(ck)])
    setup = prepare(config_from_args(TINY + ["--init_from", str(ck), "--data", text_file]))
    state, _, _ = initial_state(setup)
    assert int(state["step"]) == 0  # fresh optimizer, weights from the checkpoint
    for x, y in zip(jax.tree.leaves(first.state["params"]), jax.tree.leaves(state["params"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="parameter shapes do not match"):
        prepare(config_from_args(TINY + ["--scan_layers", "--init_from", str(ck), "--data", text_file]))


@pytest.mark.slow  # ~12 s; test_memory_report_names_tagged_activations stays fast
def test_memory_report_one_column_per_method(text_file, tmp_path):
    res, out = _run(TINY + ["--data", text_file, "--memory_report", "--activation_recompute",
                     "--recompute_method", "none,uniform", "--recompute_num_layers", "2", "--checkpoint_dir",
                     str(tmp_path / "ck"), "--log_jsonl", str(tmp_path / "l.jsonl")])
    assert res.stopped == "memory_report" and res.history == []
    header = next(l for l in out.splitlines() if "full/none" in l)
    assert "full/uniform/2" in header
    for row in ("total (intermediates)", "temp", "peak estimate", "<arguments>"):
        assert row in out
    assert os.listdir(tmp_path) == []


def test_memory_report_has_no_remat_beside_and_the_peak_by_part(text_file, capsys):
    """`no remat` is a column whatever the flags ask; the peak splits into parameters, optimizer state,
    gradients, activations and the rest, which add up to the peak estimate; a line per compile goes
    to stderr as it starts; the activations of no remat are what it saves (its intermediates)."""
    from remat.memory import format_bytes
    from remat_lm.training.report import PARTS
    _, out = _run(TINY + ["--data", text_file, "--memory_report", "--activation_recompute"])
    err = capsys.readouterr().err
    assert "memory report: compiling 1/2 (no remat)" in err and "memory report: compiling 2/2 (full/none)" in err
    header = next(l for l in out.splitlines() if "full/none" in l and "no remat" in l)
    assert header.split().index("no") < header.split().index("full/none")
    section = out[out.index("the peak estimate per device, by part"):].splitlines()
    rows = {k: section[i + 2] for i, k in enumerate(PARTS)}
    assert all(rows[k].split()[0] == k.split()[0] for k in PARTS), section
    saved = re.search(r"^  total \(intermediates\)\s+(\S+ \S+)", out, re.M).group(1)
    assert rows["activations"].split()[1:3] == saved.split(), (rows["activations"], saved)
    assert rows["parameters"].split()[1:3] == rows["gradients"].split()[1:3]


def test_memory_report_names_tagged_activations(text_file):
    """With a policy that saves tagged values, the report groups them by tag name."""
    _, out = _run(TINY + ["--data", text_file, "--memory_report", "--activation_recompute",
                          "--recompute_granularity", "selective", "--recompute_method", "none"])
    assert "block_input" in out and "qkv" in out


def test_dry_run_writes_nothing(text_file, tmp_path):
    res, out = _run(TINY + ["--data", text_file, "--dry_run", "--checkpoint_dir", str(tmp_path / "ck"),
                            "--log_jsonl", str(tmp_path / "l.jsonl")])
    assert res.stopped == "dry_run" and "nothing was trained or written" in out and "35,712 params" in out
    assert os.listdir(tmp_path) == []


def test_token_shards_train(tmp_path):
    from remat_lm.models.llmc_io import write_tokens
    rng = np.random.default_rng(0)
    for i in range(2):
        write_tokens(tmp_path / f"shard_{i}.bin", rng.integers(0, 256, 3000))
    res, out = _run(TINY + ["--data", str(tmp_path / "shard_*.bin"), "--val_data", str(tmp_path / "shard_1.bin"),
                            "--val_every", "3", "--val_steps", "1"])
    assert "2 token shards" in out and math.isfinite(res.history[-1]["val_loss"])


def test_log_every_chooses_the_step_lines(text_file):
    """--log_every N prints every N-th step plus the first and the last; the default (0) prints the
    first and the last of a run of fast steps, whose lines would otherwise scroll by faster than read;
    the JSONL log keeps every step either way."""
    def printed(extra, tmp):
        argv = COMMON + ["--data", text_file, "--num_iterations", "5", "--log_jsonl", str(tmp)] + extra
        res, out = _run(argv)
        lines = [int(l.split()[1].split("/")[0]) for l in out.splitlines() if l.startswith("step ")]
        return lines, len(pathlib.Path(tmp).read_text().splitlines())
    assert printed(["--log_every", "2"], text_file + ".a.jsonl") == ([1, 2, 4, 5], 5)
    assert printed([], text_file + ".b.jsonl") == ([1, 5], 5)  # tiny steps: far under LOG_SECONDS apart
