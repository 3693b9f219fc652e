"""Saved runs that must not change a run silently.

- A step whose metadata bytes were changed (its `data_position`: valid JSON, arrays untouched) is
  set aside like any damaged step, and the run resumes from the previous intact step bit-identically.
- A resume with a raised --num_iterations keeps the saved learning-rate schedule.
- One run per --checkpoint_dir: a second train.py exits 2 naming the holder; a SIGKILLed holder
  leaves no stale lock.

Faults are real: bytes of a saved step's files changed on disk, real train.py processes, a real kill.
"""
import glob
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from remat_lm.training import UsageError, config_from_args, prepare
from remat_lm.training import saving
from trainhelp import ROOT, _env, _run, ours, text_file, two_steps  # noqa: F401 (text_file is a fixture)

QUIET = ["--val_every", "0", "--no-progress"]
COMMON = ["--preset", "tiny", "--lr_decay_iters", "6"] + QUIET


def _train(args, **kw):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300, **kw)


def _lines(text: str) -> list:
    return [l for l in text.splitlines() if l.strip()]


def _leaves(tree) -> list:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ------------------------------------------------------------------------------------------------
# item 3: changed metadata bytes


def _replace_bytes(path: str, old: bytes, new: bytes) -> None:
    """Replace every occurrence of `old` in the file (there is at least one)."""
    data = pathlib.Path(path).read_bytes()
    assert old in data, (path, old)
    pathlib.Path(path).write_bytes(data.replace(old, new))


@pytest.mark.parametrize("old, new", [(b'"data_position": 4', b'"data_position": 5'),
                                      pytest.param(b'"data_position": 4', b'"data_position": 0', marks=pytest.mark.slow),
                                      pytest.param(b'"step": 4', b'"step": 6', marks=pytest.mark.slow)])
def test_changed_metadata_is_set_aside_and_the_resume_is_bit_identical(old, new, two_steps, tmp_path, capsys):
    """The data position in the meta item of step 4 changed on disk (the arrays untouched): it used to
    resume from step 4 with rc 0, no warning, on other batches (another final state)."""
    src, common, straight = two_steps
    d = str(tmp_path / "ck")
    shutil.copytree(src, d)
    _replace_bytes(os.path.join(d, "4", "meta", "metadata"), old, new)
    res, out = _run(common + ["--num_iterations", "6", "--checkpoint_dir", d, "--resume"])
    warning = _lines(capsys.readouterr().err)
    assert len(warning) == 1, warning
    assert warning[0] == (f"warning: --resume {d}: step 4: its metadata does not match the digest written with it "
                          f"(its bytes changed after the save); falling back to step 2, the newest intact one")
    assert "resume   from step 2" in out and "damaged step 4 moved to" in out
    assert [h["step"] for h in res.history] == [3, 4, 5, 6]
    assert [h["loss"] for h in res.history] == [h["loss"] for h in straight.history[2:]]
    bad = [i for i, (a, b) in enumerate(zip(_leaves(res.state), _leaves(straight.state))) if a.tobytes() != b.tobytes()]
    assert not bad, bad
    assert saving.inspect_dir(d).steps == (2, 6) and os.path.isdir(os.path.join(d, "damaged_step_4"))


@pytest.fixture(scope="module")
def abstract(text_file):
    return prepare(config_from_args(COMMON + ["--data", text_file, "--num_iterations", "6"])).abstract_state


def _sub(rel, old, new):
    return lambda step: _replace_bytes(os.path.join(step, rel), old, new)


def _flip_middle(pattern):
    def f(step):
        (path,) = glob.glob(os.path.join(step, pattern))
        data = bytearray(pathlib.Path(path).read_bytes())
        data[len(data) // 2] ^= 0x10
        pathlib.Path(path).write_bytes(bytes(data))
    return f


# orbax's own metadata of a step: where the arrays' offsets live (the OCDBT manifest and b-tree
# node, crc32c-checked by tensorstore), and JSON that a restore against this run's abstract state
# does not use for the values. None of them can change the restored state silently.
ORBAX_METADATA = {
    "OCDBT manifest": (_flip_middle("state/manifest.ocdbt"), "cannot be read"),
    "OCDBT b-tree node (offsets, lengths)": (_flip_middle("state/d/*"), "cannot be read"),
    "_METADATA write_shape": (_sub("state/_METADATA", b'"write_shape": [96, 32]', b'"write_shape": [32, 96]'), None),
    "_sharding partition spec": (_sub("state/_sharding", b'\\"partition_spec\\": [], \\"device_mesh',
                                      b'\\"partition_spec\\": [\\"data\\"], \\"device_mesh'), None),
    "array_metadatas chunk_shape": (_sub("state/array_metadatas/process_0", b'"chunk_shape": [96, 32]',
                                         b'"chunk_shape": [48, 32]'), None),
}


@pytest.mark.parametrize("kind", [k if i == 0 else pytest.param(k, marks=pytest.mark.slow)  # one fast: they only document
                                  for i, k in enumerate(ORBAX_METADATA)])
def test_orbax_metadata_changes_are_refused_or_harmless(kind, two_steps, abstract, tmp_path):
    src, _, _ = two_steps
    d = str(tmp_path / "ck")
    shutil.copytree(src, d)
    clean = saving.restore(d, 4, abstract)
    damage, match = ORBAX_METADATA[kind]
    damage(os.path.join(d, "4"))
    if match:
        with pytest.raises(saving.CheckpointDamaged, match=match):
            saving.restore(d, 4, abstract)
    else:
        state, meta = saving.restore(d, 4, abstract)
        assert meta == clean[1]
        assert [a.tobytes() for a in _leaves(state)] == [a.tobytes() for a in _leaves(clean[0])]


def test_meta_digest_covers_every_field():
    meta = {"format": saving.FORMAT, "step": 4, "data_position": 4, "train_config": {"data": ("a", "b")},
            "digest": {"params.w": "0-0"}}
    meta["meta_digest"] = saving.meta_digest(meta)
    back = json.loads(json.dumps(meta))  # as orbax's JSON handler reads it back (tuples as lists)
    saving.verify_meta(back, "step 4")
    for key, value in (("data_position", 5), ("step", 6), ("digest", {"params.w": "0-1"}), ("extra", 1)):
        with pytest.raises(saving.CheckpointDamaged, match="step 4: its metadata does not match the digest"):
            saving.verify_meta({**back, key: value}, "step 4")


# ------------------------------------------------------------------------------------------------
# item 8: the learning-rate schedule on resume


@pytest.mark.slow  # ~17 s
def test_resume_with_more_iterations_keeps_the_saved_schedule(tmp_path, text_file):
    """A finished 6-step run resumed with --num_iterations 12 (as the "already at step" error advises)
    in a real train.py process: steps 7..12 follow the saved schedule (--lr_decay_iters 6: its
    floor), bit for bit an uninterrupted 12-step run with --lr_decay_iters 6, not a cosine stretched to
    12 steps (whose learning rate at step 7 would jump from 7e-4 at step 6 to 2.1e-3)."""
    ck, log = str(tmp_path / "ck"), str(tmp_path / "log.jsonl")
    base = ["--preset", "tiny", "--warmup_iters", "2", "--data", text_file, "--checkpoint_dir", ck,
            "--log_jsonl", log] + QUIET
    _run(base + ["--num_iterations", "6"])
    p = _train(base + ["--num_iterations", "12", "--resume"])  # a real train.py process
    assert p.returncode == 0 and ours(p.stderr) == [], p.stderr[-3000:]
    recs = [json.loads(l) for l in open(log)]
    assert [r["step"] for r in recs] == list(range(1, 13))
    straight, _ = _run(["--preset", "tiny", "--warmup_iters", "2", "--data", text_file, "--num_iterations", "12",
                        "--lr_decay_iters", "6"] + QUIET)
    assert [r["lr"] for r in recs] == [h["lr"] for h in straight.history]
    assert [r["loss"] for r in recs] == [h["loss"] for h in straight.history]
    assert recs[6]["lr"] <= recs[5]["lr"]  # step 7 continues the decay (a stretched schedule goes x3 up)
    with pytest.raises(UsageError) as e:  # the advice that leads to the resume above says so
        prepare(config_from_args(base + ["--num_iterations", "6", "--resume"]))
    assert str(e.value) == (f"--resume: {ck} is already at step 12 >= --num_iterations 6; raise --num_iterations to "
                            f"train on (the learning rate keeps the saved schedule, --lr_decay_iters 6, unless you "
                            f"pass --lr_decay_iters)")
    line = next(l for l in p.stdout.splitlines() if l.startswith("resume"))
    assert line == (f"resume   from step 6 of {ck} (data position 6); changed: --num_iterations 12 (checkpoint: 6); "
                    f"the learning-rate schedule stays the saved run's: --lr_decay_iters 6 (it would follow "
                    f"--num_iterations 12; pass --lr_decay_iters to change it)"), line


@pytest.mark.slow  # ~12 s
def test_lr_decay_iters_on_resume_is_compared_as_the_effective_value(tmp_path, text_file):
    """Passing the saved schedule length explicitly is no change (not refused as "checkpoint: None");
    another length is a deliberate change, allowed and listed."""
    ck = str(tmp_path / "ck")
    base = ["--preset", "tiny", "--data", text_file] + QUIET
    _run(base + ["--num_iterations", "3", "--checkpoint_dir", ck])
    resume = base + ["--num_iterations", "5", "--checkpoint_dir", ck, "--resume"]
    kept = prepare(config_from_args(resume))
    assert kept.cfg.lr_decay_iters == 3 and "--lr_decay_iters 3 (it would follow" in kept.schedule_note
    assert kept.resume_changes == ("--num_iterations 5 (checkpoint: 3)",)
    fresh = prepare(config_from_args(base + ["--num_iterations", "5", "--lr_decay_iters", "3"]))
    assert [float(kept.schedule(i)) for i in range(5)] == [float(fresh.schedule(i)) for i in range(5)]
    same = prepare(config_from_args(resume + ["--lr_decay_iters", "3"]))
    assert same.schedule_note is None and same.resume_changes == ("--num_iterations 5 (checkpoint: 3)",)
    longer = prepare(config_from_args(resume + ["--lr_decay_iters", "5"]))
    assert longer.schedule_note is None and longer.cfg.lr_decay_iters == 5
    assert longer.resume_changes == ("--num_iterations 5 (checkpoint: 3)", "--lr_decay_iters 5 (checkpoint: 3)")


# ------------------------------------------------------------------------------------------------
# item 8: one run per --checkpoint_dir


def _popen(args):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # ~10 s (two train.py processes); fast sibling: test_dir_lock_in_process (the same flock)
def test_a_second_run_on_a_held_directory_exits_2_naming_the_holder(tmp_path, text_file):
    """Two train.py on one --checkpoint_dir: the second exits 2 with one line naming the first (pid,
    host); once the first is SIGKILLed, a new run takes the directory (no stale lock)."""
    ck = str(tmp_path / "ck")
    args = ["--preset", "tiny", "--data", text_file, "--checkpoint_dir", ck] + QUIET
    first = _popen(args + ["--num_iterations", "100000"])
    try:
        deadline = time.time() + 240
        for line in first.stdout:  # training: the directory is held (from before compiling)
            if line.startswith("step "):
                break
            assert time.time() < deadline
        assert first.poll() is None, first.stderr.read()[-3000:]
        p = _train(args + ["--num_iterations", "4"])
        (line,) = _lines(p.stderr)
        assert p.returncode == 2 and "Traceback" not in p.stderr
        assert line.startswith(f"train.py: error: --checkpoint_dir {ck} is in use by another train.py run "
                               f"(pid {first.pid} on host "), line
        assert line.endswith(f"; wait for it to end or stop it, or pass another --checkpoint_dir"), line
        assert os.listdir(ck) == [saving.LOCK_FILE]  # the first run has saved nothing; nothing added
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    assert os.listdir(ck) == [saving.LOCK_FILE]  # the killed run's file is left; its lock is not
    res, _ = _run(args + ["--num_iterations", "2"])  # a new run takes the directory
    assert [h["step"] for h in res.history] == [1, 2]
    assert sorted(os.listdir(ck)) == ["2"]  # the lock file goes with the run that held it


def test_dir_lock_in_process(tmp_path):
    """DirLock: a second hold is refused naming the holder (after a short wait), release lets the
    next one in and removes the directories the hold created."""
    d = str(tmp_path / "a" / "b")
    lock = saving.DirLock.acquire(d)
    assert os.listdir(d) == [saving.LOCK_FILE]
    t = time.monotonic()
    with pytest.raises(UsageError, match=rf"--checkpoint_dir {d} is in use by another train.py run \(pid "
                                         rf"{os.getpid()} on host .*, since .* UTC\)"):
        saving.DirLock.acquire(d, wait_s=0.2)
    assert time.monotonic() - t >= 0.2
    with pytest.raises(UsageError, match="is in use by another train.py run"):
        saving.check_free(d)
    lock.release()
    lock.release()  # idempotent
    assert os.listdir(tmp_path) == []  # a/ and a/b/ were made by the hold: removed with it
    saving.check_free(d)
    again = saving.DirLock.acquire(d)
    again.release()


def _out(path) -> str:
    """A process's stdout without gloo's C-level "[Gloo] Rank ..." announcements."""
    return "".join(l for l in open(path).readlines() if not l.startswith("[Gloo]"))


HOLD_SCRIPT = textwrap.dedent("""
    import sys, time
    import jax
    from remat_lm.training import config_from_args, distributed, prepare, saving
    from remat_lm.training.config import UsageError
    assert distributed.initialize()
    d, data = sys.argv[1:3]
    if jax.process_index() == 1:
        time.sleep(3)  # process 1 prepares late: after process 0 could have created the directory
    # as remat_lm.training.run does: prepare, then hold the directory
    prepare(config_from_args(["--preset", "tiny", "--data", data, "--checkpoint_dir", d, "--num_iterations", "2",
                              "--mesh", "data=2", "--batch_size", "2", "--val_every", "0"]))
    try:
        lock = saving.hold_directory(d)
    except UsageError as e:
        print("refused:", e)
        sys.exit(2)
    print("holds it:", lock is not None)
""")


def _launch_hold(tmp_path, d, text_file, tag):
    from test_multiprocess import _launch, _wait  # its launcher: N processes on jax.distributed

    procs = _launch(2, 1, ["-c", HOLD_SCRIPT, d, text_file], tmp_path, tag)
    try:
        rcs = _wait(procs, timeout=180)
    finally:
        for p in procs:  # a deadlock would leave them running
            if p.poll() is None:
                p.kill()
    return rcs, [_out(tmp_path / f"{tag}.{i}.out") for i in range(2)]


@pytest.mark.slow  # ~12 s: two jax.distributed processes; the lock itself is tested fast above
def test_two_processes_hold_the_directory_through_process_0(tmp_path, text_file):
    """jax.distributed with 2 processes, each preparing and then holding as remat_lm.training.run does: when
    another run holds the directory, both processes raise the same error (process 1 learns it from
    process 0); when it is free, process 0 holds it. Process 1 must neither take process 0's hold for
    another run's while preparing (exit 2) nor deadlock: the directory process 0 creates must not make
    process 1's `inspect_dir` start an orbax manager, whose barrier would meet process 0's broadcast."""
    from test_multiprocess import _read

    d = str(tmp_path / "ck")
    other = saving.DirLock.acquire(d)
    try:
        rcs, outs = _launch_hold(tmp_path, d, text_file, "held")
    finally:
        other.release()
    assert rcs == [2, 2], [_read(tmp_path / f"held.{i}.err")[-2000:] for i in range(2)]
    assert all(o.startswith(f"refused: --checkpoint_dir {d} is in use by another train.py run (pid {os.getpid()}")
               for o in outs), outs
    rcs, outs = _launch_hold(tmp_path, d, text_file, "free")
    assert rcs == [0, 0], [_read(tmp_path / f"free.{i}.err")[-2000:] for i in range(2)]
    assert outs == ["holds it: True\n", "holds it: False\n"], outs
