"""Multi-process runs on `jax.distributed`: start-up, who prints, each process's batch rows, a peer's death.

train.py runs as N processes (one per host, or one per GPU) when the environment says so:
`JAX_COORDINATOR_ADDRESS` with `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`, or a SLURM / Open MPI
job of more than one task (detected by JAX). Every process runs the same program over one global
mesh; XLA inserts the collectives (gloo between CPU processes, NCCL on GPUs).

- Start-up: `initialize()` calls `jax.distributed.initialize` once, before any computation.
- Output: process 0 prints, logs (`--log_jsonl`) and profiles; the others are quiet (`quiet_others`).
  Checkpoints are written by all processes together (orbax: each writes the shards it holds).
- Data: batch `i` is a function of `(seed, i)` alone; `put_rows` builds the global batch from the
  rows this process's devices hold, reading only those (the same global batch for any process count).
- A peer's death: every survivor exits non-zero with one line on stderr ("process I of N: another
  process of this run stopped (...)"). A collective with a dead peer fails at once ("Connection
  closed by peer"): `peer_failure`, `exit_on_peer_failure`, exit 1. A peer that dies while the
  others are not in a collective (compiling, waiting in the key-value store) is found by the
  coordination service in process 0 when its heartbeat stops (`HEARTBEAT_S`), and JAX aborts the
  survivors (SIGABRT); so it does in processes 1..N-1 when process 0 (which runs the service)
  dies. `tidy_stderr` routes every process's fd 2 through a filter (`remat_lm/training/stderr_filter.py`)
  that turns that abort into the same one line, naming the peer; `sys.stderr` (tracebacks,
  tqdm's bar) keeps the original stderr.

Example:
    >>> initialize()                              # no-op in a single-process environment
    >>> x, y = put_rows(lambda rows: ds.batch(0, 1337, 8, 64, rows=rows), (1, 8, 64), sharding, 1)
"""
from __future__ import annotations

import os
import sys

import jax

# NOTE: bounds on a dead peer. JAX's defaults wait 100 s for a missed heartbeat and 300 s at the
# shutdown barrier; a survivor of a killed peer then sat ~90 s in the barrier of an exiting
# interpreter before JAX aborted it. With 30 s each, a survivor stops within ~35 s in every case
# measured (tests/test_multiprocess.py). A slow compilation does not miss heartbeats: they are
# sent by a C++ thread. Start-up waits up to INIT_S for every process to connect.
HEARTBEAT_S = 30
SHUTDOWN_S = 30
INIT_S = 300

_ENV = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")
_state = {"initialized": False}


def requested() -> bool:
    """True when the environment asks for a multi-process run (see the module docstring)."""
    multi = any(os.environ.get(k) for k in _ENV)
    multi |= int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1
    multi |= int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
    return multi


def initialize() -> bool:
    """Call `jax.distributed.initialize()` when `requested()`; idempotent. Returns True when initialized.

    `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`
    are passed on; without them JAX detects SLURM and Open MPI jobs itself.
    """
    if _state["initialized"]:
        return True
    if not requested():
        return False
    kw = dict(heartbeat_timeout_seconds=HEARTBEAT_S, shutdown_timeout_seconds=SHUTDOWN_S,
              initialization_timeout=INIT_S)
    addr = os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("COORDINATOR_ADDRESS")
    if addr:
        kw["coordinator_address"] = addr
        for key, env in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID")):
            if os.environ.get(env):
                kw[key] = int(os.environ[env])
    jax.distributed.initialize(**kw)
    _state["initialized"] = True
    return True


def is_primary() -> bool:
    """True in process 0 (the one that prints and logs)."""
    return jax.process_index() == 0


def quiet_others() -> None:
    """Process 0 prints; the others' stdout goes to /dev/null (stderr keeps their errors).

    On CPU, gloo announces each new communicator on the C-level stdout ("[Gloo] Rank 0 is connected
    to 3 peer ranks"); those lines are dropped in every process of a `jax.distributed` run, a
    one-process one included (it runs on gloo too), and Python's `sys.stdout` keeps writing to the
    original stdout of process 0. A no-op in an ordinary process.
    """
    if jax.process_count() == 1 and not _state["initialized"]:
        return
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    if is_primary():
        if jax.default_backend() == "cpu":
            keep = os.dup(1)
            os.dup2(devnull, 1)
            sys.stdout = os.fdopen(keep, "w", buffering=1)
    else:
        os.dup2(devnull, 1)
        sys.stdout = open(os.devnull, "w")
    os.close(devnull)


# NOTE: why a filter process on file descriptor 2. When the distributed service finds a peer gone
# (process 0, where the coordination service runs, saw no heartbeat from process K for
# HEARTBEAT_S; or, in processes 1..N-1, process 0 and the service died), JAX's agent aborts the
# process from a C++ thread: a LOG(FATAL) line, glog error lines and a C++ stack trace on fd 2,
# then SIGABRT. That often comes before a failed collective reaches Python (and comes with no
# collective at all, e.g. while a process compiles or waits in the key-value store), so no code in
# the process can replace it. A small filter process (`remat_lm/training/stderr_filter.py`), which outlives the abort,
# reads fd 2 through a pipe and writes one line in place of the abort and the service's lines
# that led to it; every other byte passes through unchanged, as it arrives.
# Python's own `sys.stderr` (tracebacks, our messages, tqdm's bar in process 0) keeps writing to
# the original stderr, not through the filter: tqdm's '\r' updates and its terminal check
# (`disable=None` turns the bar off on a non-terminal) see the real stderr, and their order
# against stdout is unchanged. Our own peer-failure line goes through the filter
# (`exit_on_peer_failure`), so it is written once when the abort says the same.
_filter = []
_FILTER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stderr_filter.py")


def tidy_stderr(prog: str) -> None:
    """In a multi-process run: route fd 2 through `remat_lm/training/stderr_filter.py` (see the NOTE above).

    `sys.stderr` is given the original stderr; C-level output (JAX's glog lines, XLA) goes through
    the filter. A no-op in a single process.
    """
    import io
    import subprocess

    if jax.process_count() == 1 or _filter:
        return
    sys.stderr.flush()
    original = os.dup(2)
    # -I: no PYTHON* variables, no user site, and not training/ on sys.path (its profile.py would shadow the stdlib's)
    proc = subprocess.Popen([sys.executable, "-I", _FILTER_SCRIPT, prog, str(jax.process_index()),
                             str(jax.process_count()), str(HEARTBEAT_S)],
                            stdin=subprocess.PIPE, stdout=original, close_fds=True)
    os.dup2(proc.stdin.fileno(), 2)
    proc.stdin.close()  # fd 2 is now the pipe's only write end: the filter ends when it closes
    sys.stderr = io.TextIOWrapper(io.FileIO(original, "w"), encoding=sys.stderr.encoding,
                                  errors="backslashreplace", line_buffering=True, write_through=True)
    _filter.append(proc)


# Words in the errors a collective or the coordination service raises when another process is gone.
_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Gloo", "heartbeat", "coordination service",
               "Socket closed", "Broken pipe", "barrier")


def peer_failure(e: BaseException) -> str | None:
    """A one-line reason when `e` says another process of a multi-process run is gone, else None."""
    if jax.process_count() == 1 or not isinstance(e, Exception):
        return None
    text = " ".join(str(e).split())
    if not any(w.lower() in text.lower() for w in _PEER_WORDS):
        return None
    return text if len(text) <= 200 else text[:197] + "..."


def exit_on_peer_failure(reason: str, prog: str) -> None:
    """Print one line naming this process and the failure, and leave with status 1 at once.

    # NOTE: `os._exit`, not `sys.exit`: a normal exit runs JAX's shutdown barrier, which waits for
    # the dead process (SHUTDOWN_S, then an abort with a C++ stack trace).
    """
    me, n = jax.process_index(), jax.process_count()
    line = (f"{prog}: error: process {me} of {n}: another process of this run stopped ({reason}); "
            f"stopping too; restart all {n} processes with --resume to continue from the last checkpoint\n")
    sys.stdout.flush()
    sys.stderr.flush()
    if not _filter:
        sys.stderr.write(line)
        sys.stderr.flush()
        os._exit(1)
    # Through the filter, which writes it once if JAX's abort says the same; then close fd 2 (an
    # abort from here on writes to /dev/null) and wait for the filter, so that the line is
    # written before this process's exit status is.
    os.write(2, line.encode())
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        _filter[0].wait(timeout=10)
    except Exception:
        pass
    os._exit(1)


def put_rows(read, shape: tuple, sharding, batch_axis: int) -> tuple:
    """Global arrays of `shape` placed with `sharding`, built from the rows this process's devices hold.

    Args:
      read: `read(rows: slice) -> tuple of np arrays` holding those rows of the batch axis (e.g.
        `lambda rows: ds.batch(i, seed, B, T, accum, rows=rows)`); called once per distinct row
        range held by this process's devices, so a process never reads another's rows.
      shape: the global shape of each array.
      sharding: the arrays' sharding (the batch axis split over data x fsdp).
      batch_axis: the axis of `shape` that `rows` indexes.
    Returns:
      one jax.Array per array `read` returns.
    Example:
      >>> x, y = put_rows(lambda r: ds.eval_batch(0, 8, 64, rows=r), (8, 64), sharding, 0)
    """
    n = shape[batch_axis]
    cache = {}

    def local(k):
        def cb(index):
            lo, hi, _ = index[batch_axis].indices(n)
            if (lo, hi) not in cache:
                cache[(lo, hi)] = read(slice(lo, hi))
            rest = tuple(slice(None) if a == batch_axis else s for a, s in enumerate(index))
            return cache[(lo, hi)][k][rest]
        return cb

    first = jax.make_array_from_callback(shape, sharding, local(0))
    count = len(next(iter(cache.values()))) if cache else 1
    return (first,) + tuple(jax.make_array_from_callback(shape, sharding, local(k)) for k in range(1, count))
