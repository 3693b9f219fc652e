"""The stderr filter of a multi-process run: JAX's abort on a dead peer becomes one line.

Run as its own process (`remat_lm.training.distributed.tidy_stderr` starts it with `python -I`): it reads
a training process's file descriptor 2 through a pipe and writes to the original stderr. Standard
library only, no project imports: it must start in a few milliseconds and outlive the process.

What it changes (everything else passes through unchanged, at once, partial lines included):
- JAX's fatal abort when the distributed service finds a peer gone (a `client.h` "Terminating
  process because the JAX distributed service detected fatal errors" line, its status lines and
  the C++ stack trace) becomes the one peer-failure line, naming the situation:
    "the coordination service in process 0 heard no heartbeat from process K for S s"
        (in any process: the service found K gone while this one was not in a collective)
    "process 0, which runs the coordination service, is gone"
        (in processes 1..N-1: the service died with process 0)
    "JAX's distributed service: STATUS" (any other fatal status, its first line)
- The coordination service's and preemption manager's own glog lines that lead up to that abort
  are dropped with it. They are held back (at most `HOLD_S`, or until the process ends) and
  written unchanged when no abort follows.
- A one-line peer-failure message written by the process itself (`exit_on_peer_failure`) is
  written once, whichever of it and the abort comes first.

Example:
    >>> f = Filter("train.py", 0, 2, 30)
    >>> f.feed(b"step 1/10 | loss 3.1\\n", now=0.0)
    b'step 1/10 | loss 3.1\\n'
"""
from __future__ import annotations

import os
import re
import select
import signal
import sys
import time

# NOTE: what a glog line looks like (absl / tsl logging): severity, MMDD, time, thread id,
# file:line]. A partial line is held back only while it can still become one (or our own
# message); anything else, e.g. a progress bar's '\r' update, passes through as it arrives.
GLOG = re.compile(rb"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ (\S+):\d+\] ")
MAYBE_GLOG = re.compile(rb"[IWEF]\d{0,4}\Z|[IWEF]\d{4} ")
SERVICE = (b"coordination_service", b"client.h", b"preemption_")
FATAL = b"Terminating process because the JAX distributed service"
STACK = b"*** Check failure stack trace"
HEARTBEATS = b"stopped sending heartbeats"
SERVICE_GONE = (b"Failed to send RPC to coordination service", b"leader task", b"Leader incarnation")
HOLD_S = 5.0


class Filter:
    """The filter's state machine over the bytes of one process's stderr (no I/O: `main` does it).

    Args:
      prog: the program name that starts our messages ("train.py").
      me, n: this process's index and the process count.
      heartbeat_s: the heartbeat timeout the run was started with (named in the message).
    """

    def __init__(self, prog: str, me: int, n: int, heartbeat_s: float):
        self.prog, self.me, self.n, self.beat = prog, int(me), int(n), heartbeat_s
        self.ours = f"{prog}: error: process {me} of {n}: another process of this run stopped".encode()
        self.keep = (prog.encode() + b":", b"Traceback", b"warning:")
        self.pending = b""    # an unfinished line held back (it may become a glog line or ours)
        self.mid = False      # part of the current line was written: the rest follows unchanged
        self.held = []        # (is_service, segment): the service's lines and what came after them
        self.held_until = None
        self.block = False    # the last held line was a service glog line: continuation lines are its
        self.state = "pass"   # "pass" | "fatal" (collecting the abort's status) | "drop" (after it)
        self.fatal, self.fatal_until = b"", 0.0
        self.said = False
        self.pending_since = 0.0
        self.out = []

    # -- input -----------------------------------------------------------------------------
    def feed(self, data: bytes, now: float) -> bytes:
        """Bytes read from the process; returns the bytes to write now."""
        had, buf = bool(self.pending), self.pending + data
        self.pending = b""
        start = 0
        for m in re.finditer(rb"[\r\n]", buf):
            self._segment(buf[start:m.end()], now)
            start = m.end()
        tail = buf[start:]
        if tail:
            if self.mid or (self.state == "pass" and not self.held and not self.block and not self._may_hold(tail)):
                self._write(tail)
                self.mid = True
            else:
                self.pending = tail
                if start or not had:
                    self.pending_since = now
        return self._flush()

    def tick(self, now: float) -> bytes:
        """Called when nothing arrived for a while: releases what was held too long."""
        if self.held_until is not None and now >= self.held_until:
            self._release(keep_service=True)
        if self.state == "fatal" and now >= self.fatal_until:
            self._announce()
            self.state = "drop"
        if self.pending and self.state == "pass" and not self.held and now >= self.pending_until:
            self._write(self.pending)
            self.pending, self.mid = b"", True
        return self._flush()

    def deadline(self):
        """When `tick` has something to do (None: nothing is waiting)."""
        times = []
        if self.held_until is not None:
            times.append(self.held_until)
        if self.state == "fatal":
            times.append(self.fatal_until)
        if self.pending and self.state == "pass" and not self.held:
            times.append(self.pending_until)
        return min(times) if times else None

    def close(self) -> bytes:
        """The process's stderr closed: writes what is left (our line if an abort was cut short)."""
        if self.pending:
            seg, self.pending = self.pending, b""
            self._segment(seg, 0.0, final=True)
        if self.state == "fatal":
            self._announce()
            self.state = "drop"
        if self.held:
            self._release(keep_service=not self.said)
        return self._flush()

    # -- one line (or '\r'-terminated segment) -------------------------------------------------
    def _segment(self, seg: bytes, now: float, final: bool = False) -> None:
        if self.mid:  # the rest of a line whose start was written
            self.mid = not seg.endswith((b"\n", b"\r"))
            self._write(seg)
            return
        if self.state == "fatal":
            if seg.startswith(STACK):
                self._announce()
                self.state = "drop"
                return
            if not (seg.startswith(self.keep) or self._other_glog(seg)):
                self.fatal += seg
                return
            self._announce()
            self.state = "pass"
        elif self.state == "drop":
            if not (seg.startswith(self.keep) and not seg.startswith(self.ours) or self._other_glog(seg)):
                return
            self.state = "pass"
        m = GLOG.match(seg)
        if m and any(s in m.group(1) for s in SERVICE):
            if FATAL in seg:
                self._release(keep_service=False)
                self.state, self.fatal, self.fatal_until = "fatal", seg, now + HOLD_S
            else:
                self._hold(True, seg, now)
                self.block = True
            return
        if seg.startswith(self.ours):
            self._release(keep_service=False)  # the service's lines were about the same peer
            if not self.said:
                self._write(seg)
            self.said = True
            return
        if self.block and not m and not seg.startswith(self.keep):
            self._hold(True, seg, now)  # a continuation line of the service's message
            return
        self.block = False
        if self.held:
            self._hold(False, seg, now)
        else:
            self._write(seg)

    def _may_hold(self, tail: bytes) -> bool:
        # our own line (`exit_on_peer_failure` writes it in one write) once its "PROG:" has come
        ours = len(tail) > len(self.prog) and self.ours.startswith(tail[:len(self.ours)])
        return bool(MAYBE_GLOG.match(tail)) or ours

    def _other_glog(self, seg: bytes) -> bool:
        m = GLOG.match(seg)
        return bool(m) and not any(s in m.group(1) for s in SERVICE)

    def _hold(self, service: bool, seg: bytes, now: float) -> None:
        self.held.append((service, seg))
        if self.held_until is None:
            self.held_until = now + HOLD_S

    def _release(self, keep_service: bool) -> None:
        for service, seg in self.held:
            if keep_service or not service:
                self._write(seg)
        self.held, self.held_until, self.block = [], None, False

    def _announce(self) -> None:
        if not self.said:
            self._write(self.ours + b" (" + self.reason(self.fatal).encode() + b"); stopping too; restart all "
                        + str(self.n).encode() + b" processes with --resume to continue from the last checkpoint\n")
        self.said = True

    def reason(self, text: bytes) -> str:
        """The peer situation JAX's fatal status describes, in a few words."""
        if HEARTBEATS in text:
            after = text.split(HEARTBEATS, 1)[1].split(b"\n")[1:]
            ids = []
            for line in after:
                m = re.fullmatch(rb"\s*(?:\S*task:)?(\d+)\s*", line)
                if not m:
                    break
                ids.append(m.group(1).decode())
            who = (f"process {ids[0]}" if len(ids) == 1 else f"processes {', '.join(ids)}") if ids \
                else "a process"
            return f"the coordination service in process 0 heard no heartbeat from {who} for {self.beat:g} s"
        if self.me != 0 and any(s in text for s in SERVICE_GONE):
            return "process 0, which runs the coordination service, is gone"
        status = text.split(b"absl::Status: ", 1)[-1].split(b"\n", 1)[0].decode(errors="replace").strip()
        return "JAX's distributed service: " + (status if len(status) <= 160 else status[:157] + "...")

    def _write(self, b: bytes) -> None:
        self.out.append(b)

    def _flush(self) -> bytes:
        b, self.out = b"".join(self.out), []
        return b

    @property
    def pending_until(self) -> float:
        return self.pending_since + HOLD_S


def _write_all(fd: int, b: bytes) -> None:
    while b:
        try:
            b = b[os.write(fd, b):]
        except InterruptedError:
            continue
        except OSError:  # the destination is gone: nothing to do but keep draining the pipe
            return


def main(argv=None) -> None:
    """`python -I stderr_filter.py PROG ME N HEARTBEAT_S`: filter stdin to stdout until stdin closes."""
    # Ctrl-C and a scheduler's SIGTERM go to the whole process group: the filter stays to write
    # the process's last words and ends when its stderr closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    prog, me, n, beat = (argv or sys.argv[1:])[:4]
    f = Filter(prog, int(me), int(n), float(beat))
    while True:
        due = f.deadline()
        wait = None if due is None else max(0.0, due - time.monotonic())
        ready, _, _ = select.select([0], [], [], wait)
        now = time.monotonic()
        if not ready:
            _write_all(1, f.tick(now))
            continue
        try:
            data = os.read(0, 65536)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        if not data:
            break
        _write_all(1, f.feed(data, now))
    _write_all(1, f.close())


if __name__ == "__main__":
    main()
