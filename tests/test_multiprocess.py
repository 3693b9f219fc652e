"""train.py as 2 processes x 4 CPU devices on jax.distributed (coordinator on localhost), against 1 process x 8.

# NOTE: what "the same" means across process counts. Between CPU processes XLA's collectives run
# on gloo; inside one ordinary process they are XLA's in-process ones, which sum in another order.
# So a 1-process run of the same job differs from the 2-process one by rounding: its losses agree
# within 2 ulp, but AdamW turns a rounding-level difference of a near-zero gradient (e.g. the key
# bias, whose true gradient is 0) into a full step, so its parameters do not. A 1-process run
# through jax.distributed (JAX_NUM_PROCESSES=1) uses gloo too: with it, the 2-process run is
# reproduced bit for bit, parameters and optimizer state included. That is the comparison that
# shows the data feeding, sharding and checkpoints of several processes exact.
"""
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
import tty

import jax
import numpy as np
import pytest

from remat_lm.training import saving as ckpt
from trainhelp import ours
from remat_lm.training.data import default_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 5
ARGS = ["--preset", "tiny", "--n_layer", "2", "--n_embd", "32", "--sequence_length", "16", "--batch_size", "8",
        "--num_iterations", str(STEPS), "--val_every", "0", "--no-progress", "--mesh", "data=2,fsdp=4",
        "--checkpoint_every", "3", "--no-preflight"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        env.pop(k, None)
    env.update(extra)
    return env


def _launch(n: int, devices: int, argv: list, out_dir, tag: str, distributed=True, tty0=False):
    """Start `n` processes of `argv` (train.py args, or ["-c", code]); stdout/stderr go to files.

    tty0: process 0's stderr is a terminal (a pty copied into its file), as tqdm needs to show its bar.
    """
    port, procs = _port(), []
    for i in range(n):
        env = _env(devices, **(dict(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES=str(n),
                                    JAX_PROCESS_ID=str(i)) if distributed else {}))
        cmd = [sys.executable, *(argv if argv[0] == "-c" else [os.path.join(ROOT, "train.py"), *argv])]
        out = open(out_dir / f"{tag}.{i}.out", "w")
        err = _pty_into(out_dir / f"{tag}.{i}.err") if tty0 and i == 0 else open(out_dir / f"{tag}.{i}.err", "w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err))
        if not hasattr(err, "write"):
            os.close(err)
    return procs


_copiers = []


def _pty_into(path) -> int:
    """A pty's slave end (raw: bytes pass unchanged, 100 columns); a thread copies what is written to it
    into `path` until every slave end has closed."""
    master, slave = os.openpty()
    tty.setraw(slave)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))

    def copy():
        with open(path, "wb", buffering=0) as f:
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the process has closed it
                    break
                if not data:
                    break
                f.write(data)
        os.close(master)

    _copiers.append(threading.Thread(target=copy, daemon=True))
    _copiers[-1].start()
    return slave


def _wait(procs, timeout=600):
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    while _copiers:  # every pty copied into its file (they end with their processes)
        _copiers.pop().join(timeout=max(1.0, deadline - time.monotonic()))
    return [p.returncode for p in procs]


def _read(path) -> str:
    return open(path).read() if os.path.exists(path) else ""


def _losses(path) -> list:
    return [json.loads(line)["loss"] for line in open(path)]


def _state(directory, step):
    """The saved train state of `step`, restored onto one device of this (1-process) pytest."""
    tree = ckpt._read_only(str(directory)).item_metadata(step)["state"]
    tree = getattr(tree, "tree", tree)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree,
                            is_leaf=lambda x: hasattr(x, "shape"))
    state, meta = ckpt.restore(str(directory), step, abstract)  # checks the digest written with it
    return {k: np.asarray(v) for k, v in ckpt_flat(state).items()}, meta


def ckpt_flat(tree) -> dict:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _bitwise_equal(a: dict, b: dict) -> list:
    return [k for k in a if a[k].tobytes() != b[k].tobytes()]


def _within_ulps(a, b, n=2) -> bool:
    a, b = np.float32(a), np.float32(b)
    return abs(float(a) - float(b)) <= n * float(np.spacing(max(abs(a), abs(b))))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mpdata") / "code.txt"
    path.write_bytes(b"".join(open(f, "rb").read() for f in default_corpus()[:3])[:60000])
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_file):
    """The job as 2 processes x 4 devices and as 1 jax.distributed process x 8 devices, run side by side."""
    d = tmp_path_factory.mktemp("mp")
    t0 = time.monotonic()
    two = _launch(2, 4, ARGS + ["--data", data_file, "--checkpoint_dir", str(d / "ck2"), "--log_jsonl",
                                str(d / "two.jsonl"), "--progress"], d, "two", tty0=True)
    one = _launch(1, 8, ARGS + ["--data", data_file, "--checkpoint_dir", str(d / "ck1"), "--log_jsonl",
                                str(d / "one.jsonl")], d, "one")
    rcs = _wait(two + one)
    wall = time.monotonic() - t0
    assert rcs == [0, 0, 0], "\n".join(_read(d / f"{t}.err")[-2000:] for t in ("two.0", "two.1", "one.0"))
    return d, wall


@pytest.mark.slow  # two training processes and one, ~70 s; test_put_rows_reads_each_held_row_range_once stays fast
def test_two_processes_equal_one(runs, data_file):
    """2 processes x 4 devices: only process 0 prints and logs; the losses and the final train state
    (written by both processes into one orbax checkpoint) equal those of 1 process x 8 devices."""
    d, wall = runs
    out0, out1 = _read(d / "two.0.out"), _read(d / "two.1.out")
    assert f"step {STEPS}/{STEPS}" in out0 and "mesh     data=2,fsdp=4 over 8 cpu device(s)" in out0, out0
    assert out1 == "" and ours(_read(d / "two.1.err")) == [], (out1, _read(d / "two.1.err"))
    # process 0's stderr is a terminal: tqdm's bar draws there ('\r' updates; a pipe would turn it off)
    err0 = open(d / "two.0.err", "rb").read().decode()
    assert len(re.findall(r"\rtrain: +\d+%\|", err0)) >= 2, err0[-2000:]
    assert [l for l in ours(err0) if "\r" not in l] == [], err0[-2000:]
    assert "[Gloo]" not in out0  # gloo's C-level announcements are dropped
    one0 = _read(d / "one.0.out")  # in a 1-process jax.distributed run too (it runs on gloo as well)
    assert "[Gloo]" not in one0 and f"step {STEPS}/{STEPS}" in one0, one0
    two, one = _losses(d / "two.jsonl"), _losses(d / "one.jsonl")
    assert len(two) == STEPS and two == one  # bit for bit (same collectives: see the NOTE above)
    s2, meta2 = _state(d / "ck2", STEPS)
    s1, _ = _state(d / "ck1", STEPS)
    assert meta2["data_position"] == STEPS
    assert not _bitwise_equal(s2, s1), _bitwise_equal(s2, s1)[:5]

    # an ordinary 1-process run (in-process collectives): the same losses within 2 ulp
    from remat_lm.training import TrainConfig, run
    cfg = TrainConfig(preset="tiny", n_layer=2, n_embd=32, sequence_length=16, batch_size=8, num_iterations=STEPS,
                      val_every=0, progress=False, mesh="data=2,fsdp=4", preflight=False, data=(data_file,))
    plain = [h["loss"] for h in run(cfg, out=open(os.devnull, "w")).history]
    assert all(_within_ulps(a, b) for a, b in zip(two, plain)), list(zip(two, plain))
    print(f"2x4 + 1x8 (distributed) processes side by side: {wall:.1f} s wall")


ROWS_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from remat_lm.training import distributed, sharding as sh
    from remat_lm.training.data import load
    assert distributed.initialize()
    mesh = sh.make_mesh({"data": 2, "fsdp": 4}, 8)
    ds, read = load([sys.argv[1]]), []
    def rows(r):
        read.append((r.start, r.stop))
        return ds.batch(7, 1337, 8, 16, 2, rows=r)
    x, y = distributed.put_rows(rows, (2, 8, 16), sh.batch_sharding(mesh, 3, 1), 1)
    total = jax.jit(lambda a, b: (a.astype(np.int64).sum(), (a * 3 + b).astype(np.int64).sum()),
                    out_shardings=sh.replicated(mesh))(x, y)
    print(json.dumps({"rows": sorted(read), "sums": [int(t) for t in total]}))
""")


@pytest.mark.slow
def test_each_process_reads_only_its_rows(tmp_path, data_file):
    """With data=2,fsdp=4 over 2 processes, process 0's devices hold rows 0-3 and process 1's rows
    4-7: each process reads exactly those rows, once each, and the global batch is the whole one."""
    procs = _launch(2, 4, ["-c", ROWS_SCRIPT, data_file], tmp_path, "rows")
    assert _wait(procs, 300) == [0, 0], _read(tmp_path / "rows.0.err")[-2000:] + _read(tmp_path / "rows.1.err")[-2000:]
    got = [json.loads(_read(tmp_path / f"rows.{i}.out").strip().splitlines()[-1]) for i in range(2)]
    assert [g["rows"] for g in got] == [[[r, r + 1] for r in range(4)], [[r, r + 1] for r in range(4, 8)]]
    from remat_lm.training.data import load
    x, y = load([data_file]).batch(7, 1337, 8, 16, 2)
    want = [int(x.astype(np.int64).sum()), int((x * 3 + y).astype(np.int64).sum())]
    assert got[0]["sums"] == got[1]["sums"] == want


@pytest.mark.slow
def test_resume_in_one_process_from_two(runs, tmp_path, data_file):
    """Step 3 of the 2-process checkpoint restored in 1 process (8 devices) and trained to step 5:
    the same steps 4-5 and final state as the uninterrupted 2-process run, bit for bit (1 process
    on jax.distributed), and within 2 ulp in an ordinary process."""
    d, _ = runs
    two = _losses(d / "two.jsonl")
    final2, _ = _state(d / "ck2", STEPS)
    for tag, distributed in (("gloo", True), ("plain", False)):
        ck = tmp_path / f"ck_{tag}"
        shutil.copytree(d / "ck2", ck)
        shutil.rmtree(ck / str(STEPS))  # as if the job had stopped after step 3
        shutil.copy(d / "two.jsonl", tmp_path / f"{tag}.jsonl")
        args = ARGS + ["--data", data_file, "--checkpoint_dir", str(ck), "--resume", "--log_jsonl",
                       str(tmp_path / f"{tag}.jsonl")]
        p = _launch(1, 8, args, tmp_path, tag, distributed=distributed)
        assert _wait(p) == [0], _read(tmp_path / f"{tag}.0.err")[-2000:]
        assert "resume   from step 3" in _read(tmp_path / f"{tag}.0.out")
        resumed = _losses(tmp_path / f"{tag}.jsonl")
        assert len(resumed) == STEPS and resumed[:3] == two[:3]
        final, _ = _state(ck, STEPS)
        if distributed:
            assert resumed == two and not _bitwise_equal(final, final2), _bitwise_equal(final, final2)[:5]
        else:
            assert all(_within_ulps(a, b) for a, b in zip(resumed[3:], two[3:])), (resumed, two)


# The three ways a survivor learns of a dead peer, each made certain by when the kill comes.
# - "collective": process 1 killed while training; process 0's next collective fails at once
#   (gloo: the peer's socket closed) and train.py prints its one line (exit 1).
# - "heartbeat": process 1 killed when process 0 starts compiling the train step, before any
#   collective has run: process 0's first collective waits for the dead process in the coordination
#   service's key-value store, so only the service's heartbeat (HEARTBEAT_S) finds it, and JAX
#   aborts process 0 (SIGABRT) with its own log lines.
# - "service": process 0 killed while training; process 1's failed collective gives train.py's one
#   line, or, when the lost coordination service is found first, JAX aborts it with its own lines.
KILLS = {"collective": (1, "training"), "heartbeat": (1, "compiling"), "service": (0, "training")}
OURS = "process {me} of 2: another process of this run stopped"
JAX_ABORT = "Terminating process because the JAX distributed service detected fatal errors"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(KILLS))
def test_killed_process_stops_the_other(tmp_path, data_file, case):
    """SIGKILL one of 2 training processes: the other exits non-zero within 120 s, with train.py's one
    line when a collective found the dead peer, else with JAX's own abort on stderr.

    Process 0's stderr is a terminal (where tqdm would draw its bar), with `--no-progress`: no bar.
    """
    victim, when = KILLS[case]
    log = tmp_path / "log.jsonl"
    args = ARGS[:ARGS.index("--num_iterations")] + ["--num_iterations", "100000", "--val_every", "0", "--no-progress",
                                                    "--mesh", "data=2,fsdp=4", "--data", data_file, "--log_jsonl", str(log)]
    procs = _launch(2, 4, args, tmp_path, "kill", tty0=True)
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and len(log.read_text().splitlines()) >= 3 if when == "training"
                   else "compile  the train step" in _read(tmp_path / "kill.0.out")):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "training did not start"
            time.sleep(0.1)
        procs[victim].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        survivor = procs[1 - victim]
        rc = survivor.wait(timeout=120)
        elapsed = time.monotonic() - t0
        assert when == "training" or not _read(log).strip(), "process 0 trained a step with a dead peer"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    _wait(procs, 30)
    err = _read(tmp_path / f"kill.{1 - victim}.err")
    ours = [l for l in err.splitlines() if OURS.format(me=1 - victim) in l]
    print(f"{case}: survivor exit {rc} after {elapsed:.1f} s: {err.strip()[-3000:]}")
    assert rc != 0 and elapsed <= 120 and "Traceback" not in err, err
    if case == "collective":
        assert rc == 1 and len(ours) == 1 and ours[0].startswith("train.py: error: "), err
    elif case == "heartbeat":
        assert rc == -signal.SIGABRT and not ours and JAX_ABORT in err and "stopped sending heartbeats" in err, err
    else:
        assert (rc == 1 and len(ours) == 1) or (rc == -signal.SIGABRT and JAX_ABORT in err), (rc, err)


def test_put_rows_reads_each_held_row_range_once():
    """In one process with 8 devices: the batch split 4 ways (each part on 2 devices) is read as 4
    row ranges, once each, and assembles the whole batch."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from remat_lm.training.distributed import put_rows

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("rows", "copies"))
    full = np.arange(2 * 8 * 3).reshape(2, 8, 3)
    read = []

    def rows(r):
        read.append((r.start, r.stop))
        return full[:, r], -full[:, r]

    x, y = put_rows(rows, full.shape, NamedSharding(mesh, P(None, "rows", None)), 1)
    assert sorted(read) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    np.testing.assert_array_equal(np.asarray(x), full)
    np.testing.assert_array_equal(np.asarray(y), -full)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["ck2", "ck1"])
def test_resume_in_two_processes(runs, tmp_path, data_file, source):
    """Step 3 of a checkpoint restored in 2 processes x 4 devices and trained to step 5: the same
    count (written by 2 processes) and another count (written by 1 process x 8 devices) both give
    the uninterrupted 2-process run's steps 4-5 and final state, bit for bit."""
    d, _ = runs
    two = _losses(d / "two.jsonl")
    final2, _ = _state(d / "ck2", STEPS)
    ck = tmp_path / "ck"
    shutil.copytree(d / source, ck)
    shutil.rmtree(ck / str(STEPS))  # as if the job had stopped after step 3
    shutil.copy(d / "two.jsonl", tmp_path / "resumed.jsonl")
    args = ARGS + ["--data", data_file, "--checkpoint_dir", str(ck), "--resume", "--log_jsonl",
                   str(tmp_path / "resumed.jsonl")]
    procs = _launch(2, 4, args, tmp_path, "resume")
    assert _wait(procs) == [0, 0], _read(tmp_path / "resume.0.err")[-2000:] + _read(tmp_path / "resume.1.err")[-2000:]
    assert "resume   from step 3" in _read(tmp_path / "resume.0.out")
    resumed = _losses(tmp_path / "resumed.jsonl")
    assert len(resumed) == STEPS and resumed == two, (resumed, two)
    final, _ = _state(ck, STEPS)
    assert not _bitwise_equal(final, final2), _bitwise_equal(final, final2)[:5]
