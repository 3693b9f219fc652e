"""Up-front checks of the run's output paths and sizes, so that bad input fails before compiling.

`prepare` calls these before anything is compiled or written; each raises UsageError with one
line naming the problem and the fix, and creates nothing (a writability probe is removed at once).

Example:
    >>> check_output_dir("runs/a", "--checkpoint_dir")   # a new or existing writable directory
    >>> check_output_file("runs/a.jsonl", "--log_jsonl")  # a new or existing regular file
"""
from __future__ import annotations

import os
import stat
import tempfile

from remat.memory import format_bytes
from training.config import UsageError

# AdamW keeps the parameters, two moments and (transiently) the gradients, all float32.
STATE_BYTES_PER_PARAM = 16


def _kind(path: str) -> str:
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return f"unreadable ({e.strerror})"
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _nearest_existing(path: str) -> str:
    """The deepest ancestor of `path` (or `path` itself) that exists."""
    p = path
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _writable_dir(d: str, flag: str, given: str) -> None:
    """UsageError unless files can be created in directory `d`."""
    fix = f"pass a path on a writable disk for {flag}"
    if os.statvfs(d).f_flag & os.ST_RDONLY:
        raise UsageError(f"{flag} {given}: {d} is on a read-only filesystem; {fix}")
    if not os.access(d, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {given}: {d} is not writable (permission denied); {fix}")
    # NOTE: access() says yes to root everywhere and knows nothing of pseudo-filesystems (/proc,
    # /sys): creating (and at once removing) an empty directory is the only sure answer.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".train-probe-", dir=d))
    except OSError as e:
        raise UsageError(f"{flag} {given}: cannot create anything in {d} ({e.strerror}); {fix}") from None


def check_output_dir(path: str, flag: str) -> None:
    """UsageError unless `path` is a writable directory or can be created as one (creates nothing)."""
    p = os.path.abspath(path)
    if os.path.lexists(p):
        if not os.path.isdir(p):
            raise UsageError(f"{flag} {path}: it is {_kind(p)}, not a directory; pass a directory path")
        _writable_dir(p, flag, path)
        return
    anc = _nearest_existing(p)
    if not os.path.isdir(anc):
        raise UsageError(f"{flag} {path}: {anc} is {_kind(anc)}, so no directory can be created under it; "
                         f"pass a path under a directory")
    _writable_dir(anc, flag, path)


def check_output_file(path: str, flag: str) -> None:
    """UsageError unless `path` is a writable regular file or can be created as one (creates nothing,
    changes nothing: an existing file is only opened for appending)."""
    p = os.path.abspath(path)
    if os.path.lexists(p):
        if not os.path.isfile(p):
            raise UsageError(f"{flag} {path}: it is {_kind(p)}, not a regular file; pass a file path")
        try:
            open(p, "ab").close()
        except OSError as e:
            raise UsageError(f"{flag} {path}: cannot write it ({e.strerror}); pass a writable file path") from None
        return
    anc = _nearest_existing(os.path.dirname(p))
    if not os.path.isdir(anc):
        raise UsageError(f"{flag} {path}: {anc} is {_kind(anc)}, so no file can be created under it; "
                         f"pass a path under a directory")
    _writable_dir(anc, flag, path)


def device_memory_limit(device) -> int | None:
    """Bytes one device can hold: `memory_stats()['bytes_limit']`, or the host's RAM for CPU devices
    (all of them share it); None when unknown."""
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def check_model_size(n_params: int, fsdp: int, devices) -> None:
    """UsageError when the parameters and AdamW state alone cannot fit the devices.

    Checked before JAX traces anything: an absurd shape (say --n_embd 2147483648) otherwise aborts
    inside XLA (an int64 overflow of an array's extent) instead of failing with a message.
    """
    dev = devices[0]
    limit = device_memory_limit(dev)
    if limit is None:
        return
    per_device = STATE_BYTES_PER_PARAM * n_params / max(1, fsdp)
    # CPU devices all draw on the one host's memory.
    need = per_device * (len(devices) if dev.platform == "cpu" else 1)
    if need > limit:
        raise UsageError(f"the model has {n_params:,} parameters: its parameters and AdamW state need "
                         f"{format_bytes(need)} ({STATE_BYTES_PER_PARAM} bytes per parameter, sharded over fsdp={fsdp}) but "
                         f"a {dev.platform} device has {format_bytes(limit)}; use a smaller model (--n_embd, --n_layer) "
                         f"or shard it over more devices (--mesh fsdp=N)")
