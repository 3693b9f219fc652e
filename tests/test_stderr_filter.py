"""remat_lm/training/stderr_filter.py: JAX's abort on a dead peer becomes one line; everything else streams through.

The aborts below are the text jax 0.10.2 wrote in tests/test_multiprocess.py's kill runs (stack
traces shortened); the slow tests there produce them for real, through train.py. Here the filter
is fed them in random chunk sizes, and its process is checked to pass a partial line at once.
"""
import os
import random
import select
import subprocess
import sys
import time

import pytest

from remat_lm.training import distributed
from remat_lm.training.stderr_filter import HOLD_S, Filter

STACK = (b"*** Check failure stack trace: ***\n"
         b"    @     0x7f5b68840634  absl::lts_20260107::log_internal::LogMessage::SendToLog()\n"
         b"    @     0x7f5b6fea71f5  (unknown)\n")
# process 0: the coordination service (in process 0) saw no heartbeat from process 1
HEARTBEAT_ABORT = (
    b"E1201 02:48:01.487264    1550 coordination_service.cc:1549] [5794564554893355680] Use error polling to "
    b"propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped "
    b"sending heartbeats):\n1\nThe tasks have crashed. Check the task logs for an earlier error, or scheduler "
    b"events (e.g. preemption, eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationService"
    b"Error='']\n"
    b"E1201 02:48:01.487722    1561 coordination_service_agent.cc:289] Polled an error from coordination "
    b"service (this can be an error from this or another task).\n"
    b"F1201 02:48:01.487850    1561 client.h:80] Terminating process because the JAX distributed service "
    b"detected fatal errors. This most likely indicates that another task died; see the other task logs for "
    b"more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. "
    b"absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n1\nThe "
    b"tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, "
    b"eviction) to debug further.\n\nRPC: /xla.coordination.CoordinationService/PollForError "
    b"[type.googleapis.com/tensorflow.CoordinationServiceError='']\n" + STACK)
# process 1: process 0, and the coordination service with it, was killed
SERVICE_GONE_ABORT = (
    b"W1201 02:49:01.657347    2144 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from "
    b"coordination service: UNAVAILABLE: Socket closed\nAdditional GRPC error information from remote target "
    b"coordination_service while calling /xla.coordination.CoordinationService/GetKeyValue:\n:UNKNOWN:Error "
    b"received from peer  {grpc_message:\"Socket closed\", grpc_status:14}. This is only expected if one of "
    b"the tasks is unhealthy. Check the logs for the actual root cause.\n"
    b"E1201 02:49:01.657450    2144 coordination_service_agent.cc:289] Polled an error from coordination "
    b"service (this can be an error from this or another task).\n"
    b"F1201 02:49:01.657457    2144 client.h:80] Terminating process because the JAX distributed service "
    b"detected fatal errors. This most likely indicates that another task died; see the other task logs for "
    b"more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. "
    b"absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was "
    b"preempted/died/restarted unexpectedly or this task is experiencing network issues.\nAdditional GRPC "
    b"error information from remote target coordination_service while calling /xla.coordination."
    b"CoordinationService/PollForError:\n:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"
    b"\"Socket closed\"}\n" + STACK)
BEFORE = (b"compile  the train step\nW1201 02:47:00.000001    1500 cpu_client.cc:123] some XLA warning\n"
          b"\r" + b"train:  10%|#         | 1/10\r" + b"train:  20%|##        | 2/10")


def _run(f: Filter, data: bytes, seed: int) -> bytes:
    rng, out, i = random.Random(seed), b"", 0
    while i < len(data):
        k = rng.randint(1, 97)
        out += f.feed(data[i:i + k], now=0.0)
        i += k
    return out + f.close()


@pytest.mark.parametrize("seed", range(4))
def test_heartbeat_abort_in_process_0_is_one_line(seed):
    out = _run(Filter("train.py", 0, 2, 30), BEFORE + b"\n" + HEARTBEAT_ABORT, seed)
    ours = (b"train.py: error: process 0 of 2: another process of this run stopped (the coordination service in "
            b"process 0 heard no heartbeat from process 1 for 30 s); stopping too; restart all 2 processes with "
            b"--resume to continue from the last checkpoint\n")
    assert out == BEFORE + b"\n" + ours


@pytest.mark.parametrize("seed", range(4))
def test_service_gone_abort_in_process_1_is_one_line(seed):
    out = _run(Filter("train.py", 1, 2, 30), SERVICE_GONE_ABORT, seed)
    assert out == (b"train.py: error: process 1 of 2: another process of this run stopped (process 0, which runs the "
                   b"coordination service, is gone); stopping too; restart all 2 processes with --resume to continue "
                   b"from the last checkpoint\n")


def test_heartbeat_names_every_dead_process():
    """Older JAX names tasks by their full name, one per line; several may be gone."""
    names = b"):\n/job:jax_worker/replica:0/task:3\n/job:jax_worker/replica:0/task:5\n"
    text = HEARTBEAT_ABORT.replace(b"):\n1\n", names)
    out = _run(Filter("train.py", 1, 8, 30), text, 0)
    assert out.count(b"\n") == 1 and b"heard no heartbeat from processes 3, 5 for 30 s" in out, out


@pytest.mark.parametrize("first", ["ours", "abort"])
def test_our_line_and_the_abort_make_one_line(first):
    """A failed collective (our line from Python) racing JAX's abort: one line, the first one."""
    ours = (b"train.py: error: process 1 of 2: another process of this run stopped (Gloo: Connection closed by "
            b"peer); stopping too; restart all 2 processes with --resume to continue from the last checkpoint\n")
    data = ours + SERVICE_GONE_ABORT if first == "ours" else SERVICE_GONE_ABORT + ours
    out = _run(Filter("train.py", 1, 2, 30), data, 1)
    assert out.count(b"\n") == 1 and (b"Gloo" in out) == (first == "ours"), out


def test_traceback_and_other_lines_pass_unchanged():
    text = (b"Traceback (most recent call last):\n  File \"train.py\", line 1, in <module>\nValueError: x\n"
            b"I1201 02:47:00.000001    1500 checkpointer.py:99] [process=0] saved\n"
            b"E1201 02:47:00.000002    1500 pjrt_client.cc:12] unrelated\nno newline at the end")
    assert _run(Filter("train.py", 0, 2, 30), text, 2) == text


def test_service_lines_without_an_abort_are_kept():
    """The service's own warnings are held back while an abort may follow, then written unchanged."""
    warn = (b"W1201 02:47:00.000001    1500 coordination_service.cc:1] a warning\n  its second line\n")
    f = Filter("train.py", 0, 2, 30)
    assert f.feed(warn, now=0.0) == b""
    assert f.feed(b"after\n", now=1.0) == b""  # held behind it, in order
    assert f.tick(now=HOLD_S - 0.1) == b""
    assert f.tick(now=HOLD_S) == warn + b"after\n"
    assert f.feed(b"later\n", now=HOLD_S + 1) == b"later\n"
    g = Filter("train.py", 0, 2, 30)  # the process ends first: written at its end
    g.feed(warn, now=0.0)
    assert g.close() == warn


def test_partial_lines_stream_and_a_glog_prefix_waits():
    f = Filter("train.py", 0, 2, 30)
    assert f.feed(b"\rtrain:  10%|#", now=0.0) == b"\rtrain:  10%|#"  # a bar update, no terminator
    assert f.feed(b"   | 1/10\rtrain", now=0.0) == b"   | 1/10\rtrain"
    assert f.feed(b"\nE12", now=0.0) == b"\n"                       # may become a glog line
    glog = b"E1201 02:47:00.000001    1500 pjrt.cc:1] x\n"
    assert f.feed(glog[3:], now=0.0) == glog
    assert f.feed(b"Exit", now=0.0) == b"Exit"                      # cannot: passes at once
    assert f.feed(b"E1", now=1.0) == b"E1"                          # the rest of that line
    assert f.feed(b"\nW", now=2.0) == b"\n" and f.tick(now=2.0 + HOLD_S) == b"W"  # not held forever


def test_filter_process_streams_and_ends_with_its_input():
    """The real filter process (as tidy_stderr starts it): a partial line arrives without waiting for
    its end; the process ends, having written everything, when its input closes."""
    proc = subprocess.Popen([sys.executable, "-I", distributed._FILTER_SCRIPT, "train.py", "0", "2", "30"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        proc.stdin.write(b"\rtrain:  10%|#")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        assert ready and os.read(proc.stdout.fileno(), 100) == b"\rtrain:  10%|#"
        t0 = time.monotonic()
        proc.stdin.write(b"\nlast words\n" + HEARTBEAT_ABORT)
        proc.stdin.close()
        rest = proc.stdout.read()
        assert proc.wait(timeout=10) == 0 and time.monotonic() - t0 < HOLD_S
        assert rest.startswith(b"\nlast words\ntrain.py: error: process 0 of 2") and rest.count(b"\n") == 3, rest
    finally:
        if proc.poll() is None:
            proc.kill()
