"""SIGINT and SIGTERM for train.py: exit 130 / 143 with one line, no traceback, no segfault.

# NOTE: why a watcher thread. Python runs signal handlers only in the main thread, between
# bytecodes, so a Ctrl-C during XLA compilation (a long C++ call) would surface as a
# KeyboardInterrupt when the compile returned, and the interpreter would then shut down while XLA's
# compile threads still run: a segfault (rc -11). So the C-level handler
# writes the signal number to a pipe (`signal.set_wakeup_fd`) and a daemon thread reads it at
# once, whatever the main thread is doing:
#   - before training writes anything (preparing, compiling, restoring): print one line and leave
#     with `os._exit` (no interpreter teardown racing XLA's threads; nothing to clean up);
#   - while training: set a flag; the loop stops at the next step boundary, waits for an
#     in-flight checkpoint save to complete, and train.py exits 130 / 143 with one line;
#   - a second signal while training: leave at once; orbax writes a step into a temporary
#     directory and renames it when complete, so the abandoned save leaves every earlier step
#     intact and is removed by the next run.

Example:
    >>> signals.install("train.py")        # train.py's main, before remat_lm.training.run
    >>> signals.set_phase("training")      # the loop: from here on, stop at a step boundary
    >>> if signals.pending(): ...          # checked after every step
"""
from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
WORDS = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}

_lock = threading.Lock()
_state = {"installed": False, "prog": "train.py", "phase": "preparing", "pending": None}
_on_leave = []  # callables run before a signal ends the process at once (see `on_leave`)


def install(prog: str = "train.py") -> None:
    """Route SIGINT and SIGTERM through the watcher thread (main thread only; idempotent)."""
    if _state["installed"]:
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    for sig in EXIT_CODES:
        signal.signal(sig, _python_handler)
    _state.update(installed=True, prog=prog)
    threading.Thread(target=_watch, args=(r,), name="signal-watcher", daemon=True).start()


def _python_handler(signum, frame) -> None:
    """The Python-level handler: nothing to do, the watcher thread has acted on the signal."""


def set_phase(phase: str) -> None:
    """'preparing', 'compiling', ... (a signal exits at once) or 'training' (stop at a step boundary)."""
    with _lock:
        _state["phase"] = phase


def pending() -> int | None:
    """The signal that asked the training loop to stop, or None."""
    return _state["pending"]


def exit_code(sig: int) -> int:
    return EXIT_CODES.get(sig, 128 + int(sig))


def stop_words(sig: int) -> str:
    return WORDS.get(sig, f"stopped by signal {int(sig)}")


def on_leave(fn) -> None:
    """Run `fn()` before a signal ends the process at once (e.g. let go of the --checkpoint_dir lock and
    remove what it created, so that "nothing was written" stays true); `forget(fn)` undoes it."""
    _on_leave.append(fn)


def forget(fn) -> None:
    if fn in _on_leave:
        _on_leave.remove(fn)


def _leave(line: str, code: int) -> None:
    for fn in list(_on_leave):
        try:
            fn()
        except Exception:
            pass
    try:
        sys.stdout.flush()
    except Exception:
        pass
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        pass
    os._exit(code)


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        if not data:
            return
        for sig in data:
            if sig not in EXIT_CODES:
                continue
            prog = _state["prog"]
            with _lock:
                phase, first = _state["phase"], _state["pending"]
                if phase == "training" and first is None:
                    _state["pending"] = sig
                    continue
            if phase == "training":
                _leave(f"{prog}: {stop_words(sig)} again: exiting now; a checkpoint save in flight is abandoned "
                       f"(the earlier steps are intact; continue with --resume)", exit_code(sig))
            _leave(f"{prog}: {stop_words(sig)} while {phase}; nothing was written", exit_code(sig))

