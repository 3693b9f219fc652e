"""Up-front checks of the run's output paths and sizes, so that bad input fails before compiling.

`prepare` calls these before anything is compiled or written; each raises UsageError with one
line naming the problem and the fix, and creates nothing (a writability probe is removed at once).

Example:
    >>> check_output_dir("runs/a", "--checkpoint_dir")   # a new or existing writable directory
    >>> check_output_file("runs/a.jsonl", "--log_jsonl")  # a new or existing regular file
"""
from __future__ import annotations

import glob
import os
import stat
import tempfile

from remat.memory import format_bytes
from remat.planning.targets import host_memory_available
from remat_lm.argtypes import UsageError

# AdamW keeps the parameters, two moments and (transiently) the gradients, all float32.
STATE_BYTES_PER_PARAM = 16

_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM when allocating")


def is_oom(err: BaseException) -> bool:
    """True for an out-of-memory error: XLA's (at compile or run time, any backend) or Python's.

    Example:
      >>> is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB"))
      True
    """
    return isinstance(err, MemoryError) or any(s in str(err) for s in _OOM_MARKERS)


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


# NOTE: JAX and XLA count elements and bytes in int64: a micro-batch whose (B, T, vocab) logits hold
# 2^63 elements overflowed while tracing (an OverflowError traceback for --batch_size 2^62). 2^60
# elements leaves room for the byte count of float32/float64 arrays.
MAX_ELEMENTS = 1 << 60


def check_batch_size(cfg, mcfg) -> None:
    """UsageError when the step's largest arrays (the (B, T, vocab) logits, the (B, T, 4·width) MLP
    activations, the (accum, B, T) tokens) would hold more elements than JAX can count; what fits
    within that is the preflight's to judge."""
    widest = max(mcfg.vocab_size, 4 * mcfg.n_embd)
    n = cfg.batch_size * cfg.sequence_length * max(widest, cfg.grad_accum_steps)
    if n >= MAX_ELEMENTS:
        raise UsageError(f"--batch_size {cfg.batch_size} x --sequence_length {cfg.sequence_length}: the step's "
                         f"largest array would hold {float(n):.3g} elements, beyond what JAX can index "
                         f"(2^60); lower --batch_size (and add --grad_accum_steps for more tokens per step)")


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


def host_available() -> int | None:
    """Available host RAM in bytes (None where it cannot be read): `remat.planning.targets.host_memory_available`."""
    return host_memory_available()


def check_model_size(n_params: int, fsdp: int, devices, limit: int | None = None, what: str | None = None) -> None:
    """UsageError when the parameters and AdamW state alone cannot fit the devices (`limit` bytes per
    device, and `what` they are, for `--target`'s compile-only devices; default: the devices' own).

    Checked before JAX traces anything: an absurd shape (say --n_embd 2147483648) otherwise aborts
    inside XLA (an int64 overflow of an array's extent) instead of failing with a message.
    """
    dev = devices[0]
    if limit is None:
        limit = device_memory_limit(dev)
    if limit is None:
        return
    per_device = STATE_BYTES_PER_PARAM * n_params / max(1, fsdp)
    # CPU devices all draw on the one host's memory.
    need = per_device * (len(devices) if dev.platform == "cpu" else 1)
    if need > limit:
        raise UsageError(f"the model has {n_params:,} parameters: its parameters and AdamW state need "
                         f"{format_bytes(need)} ({STATE_BYTES_PER_PARAM} bytes per parameter, sharded over fsdp={fsdp}) but "
                         f"{what or 'a ' + dev.platform + ' device has'} {format_bytes(limit)}; use a smaller model (--n_embd, --n_layer) "
                         f"or shard it over more devices (--mesh fsdp=N)")


# ------------------------------------------------------------------------------------------------
# Input files: special files, permissions, sizes; outputs kept apart from inputs.

# NOTE: byte-level text is read whole into memory (and copied once more when several files are
# concatenated), so a text corpus beyond a few GiB belongs in llm.c token shards, which are read
# through a memory map; without the cap a large (even sparse) text file was read until memory ran out.
TEXT_MAX_BYTES = 4 << 30
_DATA_FIX = "pass token shards (*.bin) or text files"


def check_input_file(path: str, flag: str, fix: str, allow_dir: bool = False) -> None:
    """UsageError unless `path` is a regular file (or, with `allow_dir`, a directory) this process
    can read. Checked before anything opens it: opening a FIFO blocks, /dev/zero never ends. A
    missing path is left to the loader (whose message names the fix for that)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot reach it ({e.strerror}); {fix}") from None
    if allow_dir and stat.S_ISDIR(mode):
        if not os.access(path, os.R_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: cannot read the directory (permission denied); {fix}")
        return
    if not stat.S_ISREG(mode):
        raise UsageError(f"{flag} {path}: it is {_kind(path)}, not a regular file; {fix}")
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e.strerror}); {fix}") from None


def expand_inputs(paths) -> list[str]:
    """The files `--data`/`--val_data` name (glob patterns expanded); patterns that match nothing
    and missing files are left to `remat_lm.training.data.load`, which names them."""
    out = []
    for p in paths:
        out += sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
    return out


def check_data_files(paths, flag: str) -> list[str]:
    """UsageError for a `--data`/`--val_data` file that is special, unreadable, or text too large to
    read into memory; returns the expanded file list."""
    files = expand_inputs(paths)
    text = 0
    for p in files:
        check_input_file(p, flag, _DATA_FIX)
        if os.path.exists(p) and not p.endswith(".bin"):
            text += os.path.getsize(p)  # st_size: a sparse file counts its full length, as reading it would
            limit = text_limit()
            if text > limit:
                raise UsageError(f"{flag} {p}: the text data is {format_bytes(text)}, too large to read into memory "
                                 f"(byte-level text is read whole; the limit here is {format_bytes(limit)}); tokenize "
                                 f"it into llm.c token shards (*.bin, read through a memory map) and pass those")
    return files


def text_limit() -> int:
    """The most bytes of text `--data` may hold: TEXT_MAX_BYTES, or a quarter of the host's RAM if less
    (the bytes, their concatenation and the run itself)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return TEXT_MAX_BYTES
    return min(TEXT_MAX_BYTES, ram // 4)


def _same(a: str, b: str) -> bool:
    """True when `a` and `b` name one file: the same inode where both exist (hard links, symlinks,
    `./x` and `x`), else the same resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _inside(path: str, directory: str) -> str | None:
    """The first component of `path` below `directory` (resolved), or None when it is not inside."""
    p, d = os.path.realpath(path), os.path.realpath(directory)
    if p == d or not p.startswith(d.rstrip(os.sep) + os.sep):
        return None
    return p[len(d.rstrip(os.sep)) + 1:].split(os.sep)[0]


def _written_by_checkpoints(name: str, profiling: bool) -> bool:
    """True for an entry of --checkpoint_dir the run creates, replaces or deletes: step folders (old ones
    go beyond --keep_checkpoints), orbax's temporaries, set-aside damaged steps, the profile folder."""
    return (name.isdigit() or "tmp" in name or name.startswith("damaged_step_")
            or (profiling and name == "profile"))


def check_outputs_apart(outputs: list[tuple[str, str]], inputs: list[tuple[str, str]],
                        checkpoint_dir: str | None = None, profiling: bool = False) -> None:
    """UsageError when an output would overwrite, or write into, an input (or another output).

    Args:
      outputs: (flag, path) for every path the run writes (files and directories).
      inputs: (flag, path) for every file or directory the run reads (existing ones matter).
      checkpoint_dir: --checkpoint_dir, whose step folders the run creates and deletes.
      profiling: the trace goes to <checkpoint_dir>/profile.

    Example:
      >>> check_outputs_apart([("--log_jsonl", "a.txt")], [("--data", "a.txt")])  # UsageError
    """
    # NOTE: what is refused, and why. An output equal to an input (the same inode, or the same
    # resolved path) is overwritten: --log_jsonl opened for writing truncated --data, and a
    # memory-mapped shard then died by SIGBUS. An output inside an input directory (--init_from DIR)
    # writes into what is read. An input inside --checkpoint_dir is refused only where the run
    # writes or deletes (step folders, temporaries, damaged_step_*, profile): a text file beside the
    # checkpoints is never touched, so it stays allowed. The same rules keep outputs apart (a log
    # inside a step folder would go with the step when --keep_checkpoints drops it).
    for i, (oflag, opath) in enumerate(outputs):
        fix = f"pass another path for {oflag}"
        for iflag, ipath in [(f, p) for f, p in inputs if os.path.lexists(p)] + outputs[i + 1:]:
            if _same(opath, ipath):
                raise UsageError(f"{oflag} {opath} is the same file as {iflag} {ipath}: the run would overwrite it; "
                                 f"{fix}")
        for iflag, ipath in inputs:
            if os.path.isdir(ipath) and _inside(opath, ipath) is not None:
                raise UsageError(f"{oflag} {opath} is inside {iflag} {ipath}: the run would write into its input; "
                                 f"{fix}")
    if not checkpoint_dir:
        return
    kept = [(f, p) for f, p in inputs if os.path.lexists(p)]
    kept += [(f, p) for f, p in outputs if f not in ("--checkpoint_dir", "--profile_steps")]
    for flag, path in kept:
        name = _inside(path, checkpoint_dir)
        if name is not None and _written_by_checkpoints(name, profiling):
            raise UsageError(f"{flag} {path} is inside --checkpoint_dir {checkpoint_dir}, in {name}, which the run "
                             f"writes or deletes; move it out of --checkpoint_dir or pass another --checkpoint_dir")
