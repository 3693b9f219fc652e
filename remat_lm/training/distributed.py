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
- A peer's death: a collective with a dead peer fails at once ("Connection closed by peer"); the
  survivor prints one line naming itself and the failure and exits 1 (`peer_failure`,
  `exit_on_peer_failure`). When no collective is running, JAX's coordination service finds the
  dead peer by its missing heartbeat (`HEARTBEAT_S`), or the survivors lose the service with
  process 0, and JAX aborts them with its own log lines, which reach stderr as JAX writes them.

Example:
    >>> initialize()                              # no-op in a single-process environment
    >>> x, y = put_rows(lambda rows: ds.batch(0, 1337, 8, 64, rows=rows), (1, 8, 64), sharding, 1)
"""
from __future__ import annotations

import os
import sys

import jax

__all__ = ["HEARTBEAT_S", "INIT_S", "SHUTDOWN_S", "exit_on_peer_failure", "initialize", "is_primary", "peer_failure",
           "put_rows", "quiet_others", "requested"]

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
    """Print one line naming this process and the failure, and leave with status 1 at once."""
    me, n = jax.process_index(), jax.process_count()
    line = (f"{prog}: error: process {me} of {n}: another process of this run stopped ({reason}); "
            f"stopping too; restart all {n} processes with --resume to continue from the last checkpoint\n")
    sys.stdout.flush()
    sys.stderr.write(line)
    sys.stderr.flush()
    os._exit(1)  # not sys.exit: a normal exit waits in JAX's shutdown barrier for the dead process


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
