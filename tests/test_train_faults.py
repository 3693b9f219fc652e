"""Bad input and faults in training: each case exits 2 (bad input) or 130/143 (a real
signal) with one line, before anything is written where that is knowable up front.

Faults are real: files truncated, deleted or overwritten on disk, a FIFO, /proc and /dev/full,
read-only and full filesystems mounted in a user namespace (`unshare -rm`), signals sent to a
train.py process. In-process calls of `remat_lm.training.prepare`/`run` are used where the join is the same.
"""
import glob
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from remat_lm.models import gpt2, llama3
from remat_lm import llmc as llmc_cli
from remat_lm.models import llmc
from remat_lm.models.llmc_io import LlmcFormatError, read_model
from remat_lm.training import UsageError, config_from_args, prepare
from remat_lm.training import saving
from remat_lm.training.data import default_corpus
from remat_lm.training.resume import initial_state
from trainhelp import ROOT, _env, _one_line, _run, ours, text_file, two_steps  # noqa: F401 (text_file is a fixture)

QUIET = ["--val_every", "0", "--no-progress"]
TINY = ["--preset", "tiny", "--num_iterations", "3"] + QUIET
# A fixed schedule length, so that runs of 3, 4 and 6 steps share one compiled train step.
COMMON = ["--preset", "tiny", "--lr_decay_iters", "6"] + QUIET


# ------------------------------------------------------------------------------------------------
# seed and sizes


@pytest.mark.parametrize("seed", ["-1", "4294967296", "2147483648"])
def test_seed_out_of_range_names_the_range(seed):
    with pytest.raises(UsageError, match=rf"--seed {seed} is out of range; use an integer in 0\.\.2147483647"):
        config_from_args(["--seed", seed])
    assert config_from_args(["--seed", "2147483647"]).seed == 2**31 - 1


def test_model_too_large_for_the_devices_is_a_usage_error(text_file, tmp_path):
    """--n_embd 2147483648 --n_head 1 (which XLA would abort on, an int64 extent overflow, rc -6) is refused
    by its int32 bound (tests/test_train_paths.py), and 2^30 is a model no device holds."""
    with pytest.raises(UsageError, match=r"parameters: its parameters and AdamW state need .* GiB .* but a cpu "
                                         r"device has .*--mesh fsdp=N"):
        prepare(config_from_args(TINY + ["--data", text_file, "--n_embd", str(2**30), "--n_head", "1",
                                         "--checkpoint_dir", str(tmp_path / "ck")]))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flags, match", [
    (["--recompute_granularity", "full", "--recompute_method", "uniform", "--recompute_num_layers", "99"],
     r"^--recompute_num_layers: 99 exceeds n_layer=2; use 1\.\.2$"),
    (["--recompute_granularity", "full", "--recompute_every", "5"], r"^--recompute_every: 5 exceeds n_layer=2"),
])
def test_recompute_layers_beyond_the_model_are_named_by_flag(flags, match, text_file):
    """Only the model knows its layer count: the config's error reaches the user in flag words."""
    with pytest.raises(UsageError, match=match):
        prepare(config_from_args(TINY + ["--data", text_file] + flags))


def _big_text(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"".join(pathlib.Path(f).read_bytes() for f in default_corpus()[:60])[:250000])
    return str(path)


@pytest.mark.slow
# --attention xla: its (T, T) scores need ~900 GiB at T=100000; the default tiled core keeps
# O(T·tile) and really trains the tiny model at that length (found when the core became the
# online-softmax kernel), so it would not run out of memory at all.
@pytest.mark.parametrize("flags", [["--sequence_length", "100000", "--batch_size", "1", "--attention", "xla"],
                                   ["--batch_size", "4000000"]])
def test_resource_exhausted_is_one_line_and_writes_nothing(flags, tmp_path, text_file):
    """The compiled step needs ~900 GiB / ~3000 GiB: XLA's RESOURCE_EXHAUSTED becomes a UsageError."""
    data = _big_text(tmp_path) if "100000" in flags else text_file
    log = tmp_path / "out" / "log.jsonl"
    with pytest.raises(UsageError, match=r"out of memory (at step 1|compiling).*RESOURCE_EXHAUSTED.*lower "
                                         r"--batch_size"):
        # --no-preflight: the preflight (tests/test_preflight.py) would stop these first, with advice;
        # here XLA's own RESOURCE_EXHAUSTED is the fault under test.
        _run(TINY + ["--data", data, "--log_jsonl", str(log), "--checkpoint_dir", str(tmp_path / "ck"),
                     "--no-preflight"] + flags)
    assert not log.parent.exists() and not (tmp_path / "ck").exists()


# ------------------------------------------------------------------------------------------------
# output paths


@pytest.mark.parametrize("flag,path,match", [
    ("--checkpoint_dir", "{file}", "it is a regular file, not a directory"),
    ("--checkpoint_dir", "{file}/sub", "is a regular file, so no directory can be created under it"),
    ("--checkpoint_dir", "/proc/remat_ck", "cannot create anything in /proc"),
    ("--log_jsonl", "{tmp}", "it is a directory, not a regular file"),
    ("--log_jsonl", "{file}/log.jsonl", "is a regular file, so no file can be created under it"),
    ("--log_jsonl", "/dev/full", "it is a character device, not a regular file"),
])
def test_unusable_output_path_is_refused_before_compiling(flag, path, match, tmp_path, text_file):
    (tmp_path / "f.txt").write_text("x")
    before = sorted(os.listdir(tmp_path))
    path = path.format(file=tmp_path / "f.txt", tmp=tmp_path)
    with pytest.raises(UsageError, match=f"{flag} {path}: .*{match}"):
        prepare(config_from_args(TINY + ["--data", text_file, flag, path]))
    assert sorted(os.listdir(tmp_path)) == before and not os.path.exists("/proc/remat_ck")


READ_ONLY_SCRIPT = r"""
import os, subprocess, sys
ro, data = sys.argv[1], sys.argv[2]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", ro], check=True)
open(os.path.join(ro, "old.jsonl"), "w").write("{}\n")
subprocess.run(["mount", "-o", "remount,ro", ro], check=True)
from remat_lm.training import UsageError, config_from_args, prepare
for flag, path in (("--checkpoint_dir", ro + "/ck"), ("--log_jsonl", ro + "/new.jsonl"),
                   ("--log_jsonl", ro + "/old.jsonl")):
    try:
        prepare(config_from_args(["--data", data, "--no-progress", flag, path]))
        print("accepted", flag, path)
    except UsageError as e:
        print(e)
"""


def test_read_only_mount_is_refused(tmp_path, text_file):
    """A real read-only tmpfs (as root, chmod would not stop a write): mounted in a user namespace."""
    ro = tmp_path / "ro"
    ro.mkdir()
    p = subprocess.run(["unshare", "-rm", sys.executable, "-c", READ_ONLY_SCRIPT, str(ro), text_file], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 3, p.stdout
    assert "--checkpoint_dir" in lines[0] and "is on a read-only filesystem" in lines[0]
    assert "--log_jsonl" in lines[1] and "is on a read-only filesystem" in lines[1]
    assert "old.jsonl: cannot write it (Read-only file system)" in lines[2]


# ------------------------------------------------------------------------------------------------
# model files: FIFO, non-finite weights, shapes from the llm.c header


@pytest.fixture()
def alarm():
    """Turn a hang (a FIFO opened for reading blocks forever) into a failure."""
    def on_alarm(signum, frame):
        raise TimeoutError("hung on a FIFO")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_fifo_model_file_exits_2(tmp_path, text_file, alarm, capsys):
    fifo = tmp_path / "model.bin"
    os.mkfifo(fifo)
    with pytest.raises(LlmcFormatError, match="is a FIFO .named pipe., not a regular file"):
        read_model(fifo)
    assert llmc_cli.main(["verify", str(fifo), str(fifo)]) == 2
    assert "FIFO" in _one_line(capsys.readouterr().err)
    with pytest.raises(UsageError, match=f"--init_from {fifo}: it is a FIFO .named pipe., not a regular file"):
        prepare(config_from_args(TINY + ["--data", text_file, "--init_from", str(fifo)]))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_exit_2_naming_file_and_tensor(bad, tmp_path, text_file, capsys):
    cfg = gpt2.GPT2Config.preset("tiny")
    params = gpt2.init_params(cfg, jax.random.PRNGKey(0))
    params["blocks"]["h_1"]["mlp"]["c_fc"]["kernel"] = params["blocks"]["h_1"]["mlp"]["c_fc"]["kernel"].at[3, 5].set(bad)
    path = tmp_path / "bad.bin"
    llmc.save(str(path), cfg, params)
    assert llmc_cli.main(["verify", str(path), str(tmp_path / "unused_state.bin")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(path) in line and "tensor mlp.c_fc.w holds 1 non-finite values" in line, line
    with pytest.raises(UsageError, match=f"--init_from {path}: tensor mlp.c_fc.w holds 1 non-finite"):
        prepare(config_from_args(TINY + ["--data", text_file, "--init_from", str(path)]))


# Shapes no preset has: LLaMA-3 with ffn_dim_multiplier 1.3 / multiple_of 48 / GQA 4:2 / rope_theta
# 1e4, and a 3-layer GPT-2 of width 48; both with a 300-token vocabulary.
CUSTOM = {
    "llama3": llama3.Llama3Config(block_size=32, vocab_size=300, n_layer=3, n_head=4, n_kv_head=2, n_embd=48,
                                  ffn_dim_multiplier=1.3, multiple_of=48, norm_eps=1e-6, rope_theta=10000.0,
                                  use_scaled_rope=False),
    "gpt2": gpt2.GPT2Config(block_size=48, vocab_size=300, n_layer=3, n_head=6, n_embd=48),
}


@pytest.mark.parametrize("model", [pytest.param("llama3", marks=pytest.mark.slow), "gpt2"])
def test_init_from_takes_every_shape_field_from_the_header(model, tmp_path, text_file):
    mod = llama3 if model == "llama3" else gpt2
    cfg = CUSTOM[model]
    params = mod.init_params(cfg, jax.random.PRNGKey(3))
    path = tmp_path / f"{model}.bin"
    llmc.save(str(path), cfg, params)
    argv = ["--model", model, "--init_from", str(path), "--data", text_file, "--sequence_length", "32",
            "--batch_size", "4", "--num_iterations", "2"] + QUIET
    setup = prepare(config_from_args(argv))
    got = llmc.config_for(model, llmc.header_for(setup.mcfg))
    assert got == llmc.config_for(model, llmc.header_for(cfg))  # every header field, e.g. multiple_of 48
    state, _, _ = initial_state(setup)
    for k, v in mod.to_llmc(cfg, params).items():
        np.testing.assert_array_equal(mod.to_llmc(setup.mcfg, state["params"])[k], v)
    with pytest.raises(UsageError, match=r"--n_layer 2 but the file has n_layer 3; --n_embd 64 but the file has "
                                         r"n_embd 48"):
        prepare(config_from_args(argv + ["--n_embd", "64", "--n_layer", "2"]))
    with pytest.raises(UsageError, match="--vocab_size 256 but the file has vocab_size 300"):
        prepare(config_from_args(argv + ["--vocab_size", "256"]))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama3", "gpt2"])
def test_init_from_a_non_preset_file_trains(model, tmp_path, text_file):
    mod = llama3 if model == "llama3" else gpt2
    cfg = CUSTOM[model]
    path = tmp_path / f"{model}.bin"
    llmc.save(str(path), cfg, mod.init_params(cfg, jax.random.PRNGKey(3)))
    res, out = _run(["--model", model, "--init_from", str(path), "--data", text_file, "--sequence_length", "32",
                     "--batch_size", "4", "--num_iterations", "2"] + QUIET)
    assert len(res.history) == 2 and all(math.isfinite(h["loss"]) for h in res.history)
    assert f"model    {model} from {path}: {mod.num_params(cfg):,} params, 3 layers, width 48, vocab 300" in out


# ------------------------------------------------------------------------------------------------
# damaged checkpoints


def _data_file(step_dir):
    return max(glob.glob(f"{step_dir}/state/ocdbt.process_0/d/*"), key=os.path.getsize)


def _overwrite_64(step_dir, offset=None):
    f = _data_file(step_dir)
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) // 2 if offset is None else offset)
        old = fh.read(64)
        fh.seek(-64, 1)
        fh.write(bytes(range(64)))
    return f, old


def _overwrite_64_silently(step_dir, abstract):
    """Overwrite 64 bytes of the step's array data where orbax restores without an error (values
    silently wrong: what the digest is for); offsets whose bytes break decompression are undone."""
    directory, step = os.path.split(step_dir)
    clean = saving.restore(directory, int(step), abstract, verify=False)[0]
    size = os.path.getsize(_data_file(step_dir))
    for offset in range(size // 2, size - 64, 1009):
        f, old = _overwrite_64(step_dir, offset)
        try:
            got = saving.restore(directory, int(step), abstract, verify=False)[0]
        except saving.CheckpointDamaged:
            got = None
        if got is not None and any(not np.array_equal(np.asarray(a), np.asarray(b))
                                   for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(got))):
            return
        with open(f, "r+b") as fh:
            fh.seek(offset)
            fh.write(old)
    raise AssertionError("no offset restores silently")


DAMAGE = {
    "truncated data": (lambda s: os.truncate(_data_file(s), os.path.getsize(_data_file(s)) // 2), "cannot be read"),
    "deleted data": (lambda s: [os.remove(f) for f in glob.glob(f"{s}/state/ocdbt.process_0/d/*")], "cannot be read"),
    "truncated manifest": (lambda s: os.truncate(f"{s}/state/manifest.ocdbt", 40), "array metadata cannot be read"),
    "64 overwritten bytes": (_overwrite_64_silently, "does not match the digest written with it"),
    "truncated meta": (lambda s: os.truncate(f"{s}/meta/metadata", 100), "its metadata cannot be read"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_latest_step_falls_back_to_the_newest_intact_one(kind, two_steps, tmp_path, capsys):
    src, common, straight = two_steps
    d = str(tmp_path / "ck")
    shutil.copytree(src, d)
    damage, match = DAMAGE[kind]
    if kind == "64 overwritten bytes":
        damage(os.path.join(d, "4"), prepare(config_from_args(common + ["--num_iterations", "6"])).abstract_state)
    else:
        damage(os.path.join(d, "4"))
    res, out = _run(common + ["--num_iterations", "6", "--checkpoint_dir", d, "--resume"])
    warning = _one_line(capsys.readouterr().err)
    assert warning.startswith(f"warning: --resume {d}: step 4") and match in warning, warning
    assert "falling back to step 2, the newest intact one" in warning
    assert "resume   from step 2" in out and "damaged step 4 moved to" in out
    # steps 3..6 trained again from step 2: the losses of an uninterrupted run, bit for bit
    assert [h["step"] for h in res.history] == [3, 4, 5, 6]
    assert [h["loss"] for h in res.history] == [h["loss"] for h in straight.history][2:]
    assert saving.inspect_dir(d).steps == (2, 6) and os.path.isdir(os.path.join(d, "damaged_step_4"))


def test_no_intact_step_is_a_usage_error(two_steps, tmp_path):
    src, common, _ = two_steps
    d = str(tmp_path / "ck")
    shutil.copytree(src, d)
    for s in ("2", "4"):
        _overwrite_64(os.path.join(d, s))
    with pytest.raises(UsageError, match=r"step 2(: array .* does not match the digest| cannot be read).*and no older "
                                         r"step is intact"):
        _run(common + ["--num_iterations", "6", "--checkpoint_dir", d, "--resume"])


@pytest.mark.slow  # ~8 s; the in-process unreadable-step cases stay fast
def test_unreadable_steps_in_a_real_process_print_two_lines_and_exit_2(two_steps, tmp_path):
    """Both steps' array data truncated, in a real train.py process: the fallback warning and the
    error, nothing else: no "Exception ignored in: <coroutine ...>" traceback from orbax's abandoned
    reads of the other arrays when they are collected (at exit)."""
    src, common, _ = two_steps
    d = str(tmp_path / "ck")
    shutil.copytree(src, d)
    for s in ("2", "4"):
        DAMAGE["truncated data"][0](os.path.join(d, s))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *common, "--num_iterations", "6",
                        "--checkpoint_dir", d, "--resume"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    lines = ours(p.stderr)
    assert p.returncode == 2 and len(lines) == 2, p.stderr[:3000]
    assert lines[0].startswith(f"warning: --resume {d}: step 4 cannot be read") and "falling back to step 2" in lines[0]
    assert "step 2 cannot be read" in lines[1] and "no older step is intact" in lines[1]


# ------------------------------------------------------------------------------------------------
# resuming: the log holds each step once; training flags must not change


def test_resume_log_holds_each_step_once(tmp_path, text_file):
    """A run killed after step 3 with its last checkpoint at step 2 logged step 3 already; the
    resumed run logs it again, so the log is cut back to step 2 first (and a torn line dropped)."""
    common = COMMON + ["--data", text_file]
    log, ck = tmp_path / "log.jsonl", str(tmp_path / "ck")
    _run(common + ["--num_iterations", "3", "--checkpoint_every", "2", "--checkpoint_dir", ck + "_full",
                   "--log_jsonl", str(log)])
    shutil.copytree(ck + "_full", ck)
    shutil.rmtree(os.path.join(ck, "3"))  # as if killed before saving step 3
    first = [json.loads(l) for l in log.read_text().splitlines()]
    with open(log, "a") as fh:
        fh.write('{"step": 4, "lo')  # torn by the kill
    res, out = _run(common + ["--num_iterations", "4", "--checkpoint_dir", ck, "--resume", "--log_jsonl", str(log)])
    recs = [json.loads(l) for l in log.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[2]["loss"] == first[2]["loss"]  # step 3 again, bit-identical


def test_resume_with_changed_training_flags_exits_2_naming_them(tmp_path, text_file):
    ck = str(tmp_path / "ck")
    base = COMMON + ["--num_iterations", "3", "--data", text_file, "--checkpoint_dir", ck]
    _run(base)
    resume = base[:] + ["--resume", "--num_iterations", "4"]
    with pytest.raises(UsageError, match=r"step 3 was trained with other settings: --batch_size 8 \(checkpoint: 16\), "
                                         r"--learning_rate 0.0001 \(checkpoint: 0.003\)"):
        prepare(config_from_args(resume + ["--batch_size", "8", "--learning_rate", "1e-4"]))
    for flags in (["--seed", "1"], ["--sequence_length", "32"], ["--data", text_file, text_file], ["--dtype", "bfloat16"]):
        with pytest.raises(UsageError, match=f"--{flags[0][2:]} .* \\(checkpoint: "):
            prepare(config_from_args(resume + flags))
    # recompute settings, logging and --num_iterations may change; the change is logged
    setup = prepare(config_from_args(resume + ["--activation_recompute", "--remat_policy", "dots"]))
    assert setup.start_step == 3 and "--remat_policy 'dots' (checkpoint: None)" in setup.resume_changes
    res, out = _run(resume + ["--log_jsonl", str(tmp_path / "l.jsonl")])
    assert [h["step"] for h in res.history] == [4]
    line = next(l for l in out.splitlines() if l.startswith("resume"))
    assert "--num_iterations 4 (checkpoint: 3)" in line and "--log_jsonl" in line


# ------------------------------------------------------------------------------------------------
# signals and save errors, in real train.py processes


def _popen(args):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _signal_at(proc, needle, sig, timeout=240):
    """Send `sig` once a stdout line containing `needle` appears; return (rc, stdout seen, stderr)."""
    seen, deadline = [], time.time() + timeout
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            proc.send_signal(sig)
            break
        assert time.time() < deadline
    rest, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + rest, err


def test_sigint_during_compilation_exits_130(tmp_path, text_file):
    """Ctrl-C while XLA compiles (GPT-2 d12: tens of seconds on CPU) exits 130, not a segfault (rc -11)."""
    log = tmp_path / "log.jsonl"
    proc = _popen(["--preset", "d12", "--batch_size", "1", "--data", text_file, "--log_jsonl", str(log),
                   "--checkpoint_dir", str(tmp_path / "ck")] + QUIET)
    t = time.time()
    rc, out, err = _signal_at(proc, "compile  the train step", signal.SIGINT)
    assert rc == 130, (rc, err[-3000:])
    assert "interrupted (SIGINT) while compiling the train step; nothing was written" in _one_line(err)
    assert "\nstep " not in out and time.time() - t < 30  # it stopped at once, not after the compile
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # ~11 s; tests/test_train_cli.py keeps a real kill during a save fast
def test_sigterm_completes_the_save_in_flight_and_exits_143(tmp_path, text_file):
    ck = tmp_path / "ck"
    proc = _popen(["--preset", "tiny", "--num_iterations", "400", "--checkpoint_every", "1", "--data", text_file,
                   "--checkpoint_dir", str(ck), "--log_jsonl", str(tmp_path / "log.jsonl")] + QUIET)
    rc, out, err = _signal_at(proc, "  5/400", signal.SIGTERM)
    assert rc == 143, (rc, err[-3000:])
    line = _one_line(err)
    assert line.startswith("train.py: terminated (SIGTERM) after step ") and "is complete; continue with --resume" in line
    step = int(line.split("checkpoint step ")[1].split()[0])
    info = saving.inspect_dir(str(ck))
    assert info.step == step >= 5 and not [n for n in os.listdir(ck) if "tmp" in n]
    setup = prepare(config_from_args(TINY + ["--data", text_file]))
    state, meta = saving.restore(str(ck), step, setup.abstract_state)  # complete, and its digest matches
    assert int(state["step"]) == step == meta["data_position"]


@pytest.mark.slow
def test_full_disk_save_error_is_one_line_at_the_failed_save(tmp_path, text_file):
    """A real 800 KiB tmpfs (a user namespace): one step (~550 KiB) fits, the next does not."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    cmd = (f"mount -t tmpfs -o size=800k tmpfs {mnt} && exec {sys.executable} {ROOT}/train.py --data {text_file} "
           f"--num_iterations 12 --checkpoint_every 2 --checkpoint_dir {mnt}/ck --no-progress --val_every 0")
    p = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    line = _one_line(p.stderr)
    assert (f"saving step 4 to {mnt}/ck failed: No space left on device; step 2 is the last complete checkpoint"
            in line), line
    assert "step  7/12" not in p.stdout  # stopped at the next save at the latest, not later


# ------------------------------------------------------------------------------------------------
# the bad-input sweep over every path flag: empty, special files, output = input

SWEEP_DRIVER = r"""
import contextlib, io, json, resource, signal, sys, traceback
import train

# a case that reads /dev/zero to its end fails with MemoryError at 8 GiB, not by filling the host
resource.setrlimit(resource.RLIMIT_DATA, (8 << 30, 8 << 30))

def on_alarm(signum, frame):
    raise TimeoutError("hung")

signal.signal(signal.SIGALRM, on_alarm)
results = []
for argv in json.load(open(sys.argv[1])):
    out, err = io.StringIO(), io.StringIO()
    signal.alarm(60)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = train.main(argv)
    except SystemExit as e:
        rc = e.code
    except BaseException:
        rc, err = "traceback", io.StringIO(err.getvalue() + traceback.format_exc())
    signal.alarm(0)
    results.append({"rc": rc, "err": err.getvalue()})
json.dump(results, open(sys.argv[2], "w"))
"""
PATH_FLAGS = ("data", "val_data", "init_from", "deepspeed_config", "tokenizer", "checkpoint_dir", "log_jsonl")
SPECIAL = {"fifo": "{fifo}", "directory": "{dir}", "/dev/zero": "/dev/zero", "/dev/null": "/dev/null"}


def _sweep_cases():
    """(name, argv template, what the one line must say): every path flag empty and given each special
    file, and every output path equal to an input."""
    cases = []
    for flag in PATH_FLAGS:
        # --tokenizer is for llm.c token data (with text it is refused before it is opened)
        data = ["--data", "{shard}", "--vocab_size", "256", "--sample_every", "1"] if flag == "tokenizer" else \
            ["--data", "{text}"]
        cases.append((f"--{flag} ''", data + [f"--{flag}", ""], f"--{flag} '' is an empty path"))
        for kind, path in SPECIAL.items():
            if kind == "directory" and flag == "checkpoint_dir":
                continue  # a directory is what --checkpoint_dir takes
            msg = "holds no complete checkpoint" if (kind, flag) == ("directory", "init_from") else f"--{flag} "
            cases.append((f"--{flag} {kind}", data + [f"--{flag}", path], msg))
    tok = ["--data", "{shard}", "--vocab_size", "256", "--sample_every", "1", "--tokenizer", "{tok}"]
    for name, argv in [("text", ["--data", "{text}", "--log_jsonl", "{text}"]),
                       ("shard", ["--data", "{shard}", "--vocab_size", "256", "--log_jsonl", "{shard}"]),
                       ("val", ["--data", "{text}", "--val_data", "{val}", "--log_jsonl", "{val}"]),
                       ("model", ["--data", "{text}", "--init_from", "{model}", "--log_jsonl", "{model}"]),
                       ("deepspeed", ["--data", "{text}", "--deepspeed_config", "{ds}", "--log_jsonl", "{ds}"]),
                       ("tokenizer", tok + ["--log_jsonl", "{tok}"]),
                       ("symlink", ["--data", "{text}", "--log_jsonl", "{link}"]),
                       ("checkpoints", ["--data", "{text}", "--init_from", "{dir}", "--checkpoint_dir", "{dir}"])]:
        cases.append((f"output = {name}", argv, "the run would overwrite it"))
    return cases


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, text_file):
    """Every case run through train.main in one process (one JAX import; a case that hangs fails at
    60 s), on real files: FIFOs, /dev/zero, a symlink to the data."""
    from remat_lm.models import tokenizer as tk
    from remat_lm.models.llmc_io import write_tokens

    tmp = tmp_path_factory.mktemp("sweep")
    files = {"text": tmp / "train.txt", "val": tmp / "val.txt", "shard": tmp / "shard.bin",
             "model": tmp / "model.bin", "ds": tmp / "ds.json", "tok": tmp / "tok.bin"}
    shutil.copy(text_file, files["text"])
    shutil.copy(text_file, files["val"])
    write_tokens(str(files["shard"]), np.arange(5000, dtype=np.uint16) % 256)
    cfg = gpt2.GPT2Config(block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=32)
    llmc.save(str(files["model"]), cfg, gpt2.init_params(cfg, jax.random.PRNGKey(0)))
    files["ds"].write_text('{"activation_checkpointing": {}}')
    tk.save(str(files["tok"]), [bytes([i]) for i in range(256)], eot_token=0)
    os.mkfifo(tmp / "fifo")
    (tmp / "dir").mkdir()
    os.symlink(files["text"], tmp / "link.txt")
    names = {k: str(v) for k, v in files.items()}
    names.update(fifo=str(tmp / "fifo"), dir=str(tmp / "dir"), link=str(tmp / "link.txt"))
    cases = _sweep_cases()
    argvs = [["--preset", "tiny", "--num_iterations", "2"] + QUIET + [a.format(**names) for a in argv]
             for _, argv, _ in cases]
    before = {p: pathlib.Path(p).read_bytes() for p in map(str, files.values())}
    listing = sorted(os.listdir(tmp))
    io_dir = tmp_path_factory.mktemp("sweep_io")
    (io_dir / "cases.json").write_text(json.dumps(argvs))
    p = subprocess.run([sys.executable, "-c", SWEEP_DRIVER, str(io_dir / "cases.json"), str(io_dir / "out.json")],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((io_dir / "out.json").read_text())
    after = {p: pathlib.Path(p).read_bytes() for p in before}
    return {name: (r, msg.format(**names)) for (name, _, msg), r in zip(cases, results)}, before == after, \
        sorted(os.listdir(tmp)) == listing and os.listdir(tmp / "dir") == []


@pytest.mark.parametrize("name", [c[0] for c in _sweep_cases()])
def test_bad_path_flag_exits_2_with_one_line(name, sweep):
    """Each path flag, empty, a FIFO, a directory, /dev/zero or /dev/null, or an output naming an input:
    exit 2, one line naming the flag, no traceback, no hang."""
    results, _, _ = sweep
    r, msg = results[name]
    assert r["rc"] == 2, (name, r)
    line = _one_line(r["err"])
    assert line.startswith("train.py: error: ") and msg in line, (name, line)


def test_bad_path_flags_write_nothing_and_destroy_nothing(sweep):
    _, unchanged, same_listing = sweep
    assert unchanged, "an input file changed"
    assert same_listing, "a refused run wrote something"


@pytest.mark.parametrize("flags, match", [
    (["--data", "{shard}", "--vocab_size", "256", "--log_jsonl", "{shard}"], "is the same file as --data"),
    (["--data", "{text}", "--deepspeed_config", "{fifo}"], "it is a FIFO (named pipe), not a regular file"),
])
def test_bad_path_flag_in_a_real_process(flags, match, tmp_path, text_file):
    """In a real train.py process: the log named the shard it memory-mapped (truncated, then SIGBUS);
    a FIFO as --deepspeed_config hung."""
    from remat_lm.models.llmc_io import write_tokens

    shard = tmp_path / "shard.bin"
    write_tokens(str(shard), np.arange(5000, dtype=np.uint16) % 256)
    os.mkfifo(tmp_path / "fifo")
    before = shard.read_bytes()
    argv = [a.format(shard=shard, text=text_file, fifo=tmp_path / "fifo") for a in flags]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *TINY, *argv], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and match in _one_line(p.stderr), p.stderr[-3000:]
    assert shard.read_bytes() == before
