"""Saved runs (`--checkpoint_dir`, orbax): asynchronous, atomic saves of the whole train state
plus JSON metadata. (Named `saving`, not `checkpoint`: in this project "checkpoint" means remat's
activation checkpointing, `remat.checkpoint`.)

A checkpoint directory holds one sub-directory per saved step with two items:
  state  the train state pytree: params, opt_state, step, rng (see remat_lm/training/step.py)
  meta   JSON: format tag, step, data position, model family and config, the TrainConfig, a
         digest of every array of the state (`state_digest`), checked on restore, and a digest of
         the metadata itself (`meta_digest`), checked whenever it is read

orbax writes each step into a temporary directory and renames it when complete, so a process
killed mid-save leaves the earlier steps intact and the partial one invisible to `latest_step`.
One run at a time holds a directory (`DirLock`: an flock on `train.lock` in it, naming the holder).
Saves are asynchronous: `save` returns once the arrays are copied off the device, and the files
are written by a background thread while training continues.

Example:
    >>> ck = Checkpointer("runs/a", keep=3)
    >>> ck.save(100, state, meta); ck.close()
    >>> info = inspect_dir("runs/a")           # read-only: latest step and its metadata
    >>> state, meta = restore("runs/a", info.step, abstract_state)
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging as _logging
import os
import socket
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from remat_lm.training.config import UsageError

FORMAT = "remat-train/1"
# Model config fields that do not change the parameters: a run may resume with other values.
RUNTIME_FIELDS = ("dtype", "dropout", "attention", "attention_tile")

# orbax logs through absl at WARNING for routine events (read-only managers, async threads), and
# logs a failed asynchronous save at ERROR with every chained traceback (hundreds of lines for a
# full disk). Every save error is re-raised by `Checkpointer.check`/`close` and reported as one
# line, so stderr is kept for the run's own messages.
_logging.getLogger("absl").setLevel(_logging.CRITICAL)
_logging.getLogger("asyncio").setLevel(_logging.CRITICAL)  # orbax's futures of a failed save
warnings.filterwarnings("ignore", module="orbax")


@dataclasses.dataclass(frozen=True)
class DirInfo:
    """What a checkpoint directory holds: its latest intact step and that step's metadata, every
    complete step, and the newer steps found damaged on the way ((step, reason), newest first)."""
    step: int | None
    meta: dict | None
    steps: tuple = ()
    damaged: tuple = ()


def _read_only(directory: str, handlers: bool = True) -> ocp.CheckpointManager:
    kw = dict(item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
              ) if handlers else {}
    return ocp.CheckpointManager(os.path.abspath(directory),
                                 options=ocp.CheckpointManagerOptions(read_only=True, create=False), **kw)


def _key_name(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_shapes(tree, is_leaf=None) -> dict:
    """{'a.b.0.c': shape} for the array leaves of a pytree (the naming orbax's metadata uses)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {".".join(_key_name(k) for k in path): tuple(leaf.shape) for path, leaf in flat if leaf is not None}


def inspect_dir(directory: str, flag: str = "--checkpoint_dir") -> DirInfo:
    """The latest step whose metadata reads back intact, and that metadata, without writing anything.

    Newer steps with missing items or unreadable metadata are listed in `damaged`. Returns
    DirInfo(step=None) when the directory is missing or holds no complete step; raises UsageError
    when it holds steps that are not this script's checkpoints, or only damaged ones.
    """
    if not os.path.isdir(directory):
        return DirInfo(None, None)
    mngr = _read_only(directory)
    try:
        steps = tuple(mngr.all_steps())
        if not steps:
            return DirInfo(None, None)
        damaged = []
        for step in sorted(steps, reverse=True):
            try:
                meta = read_meta(mngr, directory, step, flag)
            except CheckpointDamaged as e:
                damaged.append((step, str(e)))
                continue
            return DirInfo(step, meta, steps, tuple(damaged))
        raise UsageError(f"{flag} {directory}: no step is intact ({damaged[0][1]}); pass a directory train.py "
                         f"--checkpoint_dir wrote")
    finally:
        mngr.close()


def read_meta(mngr, directory: str, step: int, flag: str) -> dict:
    """The metadata of `step`. CheckpointDamaged when items are missing or unreadable; UsageError
    when the step is not a train.py checkpoint."""
    path = os.path.join(directory, str(step))
    items = set(os.listdir(path)) if os.path.isdir(path) else set()
    if not {"state", "meta"} <= items:
        if not items & {"state", "meta"}:
            raise UsageError(f"{flag} {directory}: step {step} is not a checkpoint written by train.py (it has "
                             f"{sorted(items) or 'no items'}, expected state and meta); pass the directory "
                             f"train.py --checkpoint_dir wrote")
        raise CheckpointDamaged(f"step {step} has lost its {'state' if 'meta' in items else 'meta'} item")
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # a truncated or corrupt meta item
        raise CheckpointDamaged(f"step {step}: its metadata cannot be read ({_first_line(e)})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UsageError(f"{flag} {directory}: step {step} is not a train.py checkpoint (format "
                         f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r}); "
                         f"pass a directory train.py --checkpoint_dir wrote")
    verify_meta(meta, f"step {step}")
    return meta


def step_meta(directory: str, step: int, flag: str) -> dict:
    """read_meta of one step (opens and closes a read-only manager)."""
    mngr = _read_only(directory)
    try:
        return read_meta(mngr, directory, step, flag)
    finally:
        mngr.close()


def check_compatible(info: DirInfo, directory: str, model: str, model_config: dict, flag: str) -> None:
    """Raise UsageError unless the checkpoint's model family and config equal the run's (the
    recompute settings, dtype and dropout may differ: they do not change the parameters)."""
    meta = info.meta
    if meta.get("model") != model:
        raise UsageError(f"{flag} {directory}: the checkpoint is a {meta.get('model')} model but this run is "
                         f"--model {model}; pass --model {meta.get('model')} with its preset")
    saved = meta.get("model_config", {})
    diff = [k for k in sorted(set(saved) | set(model_config))
            if k not in RUNTIME_FIELDS and saved.get(k) != model_config.get(k)]
    if diff:
        what = ", ".join(f"{k}={saved.get(k)!r} (run: {model_config.get(k)!r})" for k in diff)
        raise UsageError(f"{flag} {directory}: the checkpoint's model differs from this run's: {what}; pass the "
                         f"preset and flags it was trained with")


class CheckpointDamaged(RuntimeError):
    """A saved step cannot be read back as it was written (missing or truncated files, changed bytes)."""


# NOTE: the digest. orbax 0.12 / tensorstore checksum only the zarr3 shard index (crc32c), not the
# array data, so bytes overwritten in a data file restore silently (64 bytes: 304 wrong values).
# Each save therefore stores, beside the step, two 32-bit sums per array of its raw words weighted
# by odd multipliers of the position: any change of one word changes the first sum (an odd weight
# is invertible mod 2**32), and a random change of many words goes unnoticed with probability
# ~2**-64. It is one jitted reduction on the device (no host copy), and restore recomputes it.
_GOLD = 0x9E3779B1


def _words(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    if size in (1, 2, 4):
        u = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
        return jax.lax.bitcast_convert_type(x, u).astype(jnp.uint32).ravel()
    return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()  # 8-byte dtypes: (..., 2) words


@jax.jit
def _digest_leaves(leaves):
    out = []
    for x in leaves:
        w = _words(x)
        i = jnp.arange(w.size, dtype=jnp.uint32)
        out.append(jnp.stack([jnp.sum(w * (2 * i + 1), dtype=jnp.uint32),
                              jnp.sum(w * (i * jnp.uint32(_GOLD) | jnp.uint32(1)) + i, dtype=jnp.uint32)]))
    return out


def state_digest(tree) -> dict:
    """{'params.wte': 'xxxxxxxx-xxxxxxxx', ...}: a content digest of every array leaf of `tree`.

    Example:
      >>> state_digest({"w": jnp.ones(3)})
      {'w': '...'}
    """
    flat = [(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if leaf is not None]
    sums = jax.device_get(_digest_leaves([leaf for _, leaf in flat]))
    return {".".join(_key_name(k) for k in path): f"{int(a):08x}-{int(b):08x}"
            for (path, _), (a, b) in zip(flat, np.asarray(sums).reshape(-1, 2) if sums else [])}


# NOTE: the metadata digest. A restore reads two things that decide the resumed run: the arrays
# (checked by `state_digest`) and the meta item, whose `data_position` says which batch comes next
# and whose train config and array digests the resume checks rely on. A changed `data_position`
# (valid JSON, arrays untouched) would resume with exit 0 and train on other batches, so the
# meta item carries a digest of its own content, checked wherever it is read. orbax's own
# metadata needs no digest: the OCDBT manifest and b-tree nodes (where the arrays' file offsets
# and lengths live) carry tensorstore's crc32c, and `_METADATA`, `_sharding` and
# `array_metadatas` do not change what a restore against this run's abstract state returns
# (tests/test_resume_integrity.py changes each and compares).
def meta_digest(meta: dict) -> str:
    """A sha256 (hex, 16 digits) of `meta` without its own `meta_digest` field, as JSON reads it back."""
    body = json.loads(json.dumps({k: v for k, v in meta.items() if k != "meta_digest"}))
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def verify_meta(meta: dict, where: str) -> None:
    """Raise CheckpointDamaged when `meta` differs from the digest written into it (steps written
    before metadata digests existed are not checked)."""
    saved = (meta or {}).get("meta_digest")
    if saved is not None and saved != meta_digest(meta):
        raise CheckpointDamaged(f"{where}: its metadata does not match the digest written with it (its bytes "
                                f"changed after the save)")


def verify_digest(tree, meta: dict, where: str) -> None:
    """Raise CheckpointDamaged when an array of `tree` differs from the digest saved in `meta`
    (steps written before digests existed are not checked)."""
    saved = (meta or {}).get("digest")
    if not saved:
        return
    for name, d in state_digest(tree).items():
        if name in saved and saved[name] != d:
            raise CheckpointDamaged(f"{where}: array {name} does not match the digest written with it (its bytes "
                                    f"changed after the save)")


def restore(directory: str, step: int, abstract_state, partial: bool = False, verify: bool = True):
    """Restore (state, meta) of `step`; `abstract_state` gives shapes, dtypes and shardings.

    With `partial=True` only the subtrees present in `abstract_state` are read (e.g. params).
    Raises CheckpointDamaged (one line) when the step's files are missing, truncated or unreadable,
    or (with `verify`) its arrays differ from the digest saved with them.
    """
    mngr = _read_only(directory, handlers=not partial)
    try:
        state_args = (ocp.args.PyTreeRestore(item=abstract_state, partial_restore=True,
                                             restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))
                      if partial else ocp.args.StandardRestore(abstract_state))
        failure = None
        try:
            out = mngr.restore(step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore()))
        except Exception as e:  # tensorstore / orbax errors of missing, truncated or corrupt files
            failure = _first_line(e)
        if failure is not None:
            _finish_abandoned_reads()
            raise CheckpointDamaged(f"step {step} cannot be read ({failure})")
        if verify:
            verify_meta(out.meta, f"step {step}")
            verify_digest(out.state, out.meta, f"step {step}")
        return out.state, out.meta
    finally:
        mngr.close()


_READS_QUIETED = False


def _finish_abandoned_reads() -> None:
    """Keep the array reads orbax abandoned in a failed restore from printing tracebacks.

    # NOTE: orbax reads every array in its own coroutine; when one read fails, the others are
    # abandoned and each reports the same damage again when it is finalized, through
    # sys.unraisablehook: a 60-line "Exception ignored in: <coroutine ...>" traceback per array,
    # printed after the run's one-line error or at exit, whenever orbax's threads let go of them.
    # The failure is already reported as CheckpointDamaged, so from the first failed restore on,
    # unraisable reports of orbax's own coroutines are dropped, and what can be finalized now is
    # collected.
    """
    global _READS_QUIETED
    import gc
    if not _READS_QUIETED:
        _drop_unraisable(lambda u: "orbax" in getattr(getattr(u.object, "cr_code", None), "co_filename", ""))
        _READS_QUIETED = True
    gc.collect()


def _drop_unraisable(drop) -> None:
    """Chain a sys.unraisablehook that drops the reports for which `drop(u)` is true; every other
    unraisable exception is printed as before."""
    previous = sys.unraisablehook

    def hook(u):
        if not drop(u):
            previous(u)

    sys.unraisablehook = hook


_OS_ERRORS = ("No space left on device", "Disk quota exceeded", "Read-only file system", "Permission denied",
              "Input/output error", "File too large")


def _save_reason(e: BaseException) -> str:
    """The OS error behind a failed save (tensorstore wraps it in a long spec), else the first line."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e)
    for reason in _OS_ERRORS:
        if reason in text:
            return reason
    return _first_line(e)


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split()).split(" See full TensorStore details")[0] or type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def set_aside(directory: str, step: int) -> str:
    """Rename a damaged step directory out of orbax's sight (`damaged_step_<N>`), so that the run
    can save that step again; returns the new path. Nothing is deleted. In a multi-process run
    process 0 renames and every process waits for it."""
    from jax.experimental.multihost_utils import sync_global_devices

    sync = (lambda what: sync_global_devices(f"set_aside_{step}_{what}")) if jax.process_count() > 1 else None
    if sync:
        sync("look")  # every process picks the same name before process 0 renames
    src = os.path.join(directory, str(step))
    dst = os.path.join(directory, f"damaged_step_{step}")
    k = 1
    while os.path.lexists(dst):
        k += 1
        dst = os.path.join(directory, f"damaged_step_{step}.{k}")
    if jax.process_index() == 0:
        os.rename(src, dst)
    if sync:
        sync("renamed")
    return dst


def saved_shapes(directory: str, step: int) -> dict:
    """{'params.wte': shape, ...} of a saved state, from orbax's metadata (no array is read)."""
    mngr = _read_only(directory)
    try:
        try:
            tree = mngr.item_metadata(step)["state"]
        except Exception as e:  # a truncated or missing manifest
            raise CheckpointDamaged(f"step {step}: its array metadata cannot be read ({_first_line(e)})") from None
        tree = getattr(tree, "tree", tree)
        if tree is None:
            raise CheckpointDamaged(f"step {step}: its array metadata is missing")
        return leaf_shapes(tree, is_leaf=lambda x: hasattr(x, "shape"))
    finally:
        mngr.close()


# NOTE: one run per directory. Two train.py processes on one --checkpoint_dir would race (both
# saving the same steps, one dying with a misleading "No such file or directory ... free space"),
# so a run holds the directory with fcntl.flock on LOCK_FILE inside it, from before it
# compiles to its end; the kernel drops the lock when the process ends however it ends, so a killed
# run leaves no stale lock (at most the file, which the next run takes). The file names its holder
# (pid, host, start time) for the refusal. A run unlinks the file before it lets go; a taker checks
# that the file it locked is still the one at the path (same inode), else it takes the new one.
# In a multi-process run process 0 holds it (orbax needs a shared directory anyway) and tells the
# others (`hold_directory`). Not for NFS without lock support, where flock may not exclude.
LOCK_FILE = "train.lock"


def _held(directory: str, flag: str) -> UsageError:
    try:
        with open(os.path.join(directory, LOCK_FILE)) as f:
            holder = " ".join(f.read().split())
    except OSError:
        holder = ""
    return UsageError(f"{flag} {directory} is in use by another train.py run ({holder or 'holder unknown'}); wait "
                      f"for it to end or stop it, or pass another {flag}")


def check_free(directory: str, flag: str = "--checkpoint_dir") -> None:
    """UsageError naming the holder when another run holds `directory`; writes nothing."""
    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return  # no lock file: nobody holds it (an unusable directory is checks.check_output_dir's)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # only conflicts with a holder's exclusive lock
    except BlockingIOError:
        raise _held(directory, flag) from None
    except OSError:
        pass  # a filesystem without flock: no check
    finally:
        os.close(fd)


class DirLock:
    """This process's hold on a checkpoint directory (see the NOTE above).

    Example:
      >>> lock = DirLock.acquire("runs/a")   # UsageError naming the holder if another run has it
      >>> lock.release()
    """

    def __init__(self, directory: str, fd: int, made: list):
        self.directory, self.fd, self.made = directory, fd, made

    @classmethod
    def acquire(cls, directory: str, flag: str = "--checkpoint_dir", wait_s: float = 1.0) -> "DirLock":
        """Create `directory` if needed and hold it; UsageError naming the holder after `wait_s`
        (a `check_free` of another process holds the lock for microseconds: not a refusal)."""
        shown, directory = directory, os.path.abspath(directory)
        path, made = os.path.join(directory, LOCK_FILE), []
        deadline = time.monotonic() + wait_s
        while True:
            if not os.path.isdir(directory):
                new, p = [], directory
                while not os.path.isdir(p):  # the directories this run creates, innermost first
                    new.append(p)
                    p = os.path.dirname(p)
                os.makedirs(directory, exist_ok=True)
                made = made or new
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # the holder removed the directory it had made as it let go
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise _held(shown, flag) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the file was unlinked by the holder that let go: take the new one
        holder = (f"pid {os.getpid()} on host {socket.gethostname()}, since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
        os.ftruncate(fd, 0)
        os.write(fd, (holder + "\n").encode())
        return cls(directory, fd, made)

    def release(self) -> None:
        """Let go: remove the lock file (and the directory, if this run made it and wrote nothing
        else there), then drop the lock. Idempotent."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            os.unlink(os.path.join(self.directory, LOCK_FILE))
            for d in self.made:
                os.rmdir(d)  # only when empty: a run that saved anything keeps its directory
        except OSError:
            pass
        os.close(fd)


def hold_directory(directory: str, flag: str = "--checkpoint_dir") -> DirLock | None:
    """Process 0 holds `directory` (DirLock); in a multi-process run every process learns whether it
    did and raises the same UsageError if not. Returns the lock in process 0, None elsewhere."""
    lock = error = None
    if jax.process_count() > 1:
        from jax.experimental.multihost_utils import sync_global_devices

        # NOTE: every process first finishes preparing: a directory process 0 creates here would
        # make another process's `inspect_dir` open an orbax manager, whose start-up barrier
        # would then meet process 0's broadcast below (a deadlock, seen in tests/test_multiprocess.py).
        sync_global_devices("hold_directory")
    if jax.process_index() == 0:
        try:
            lock = DirLock.acquire(directory, flag)
        except UsageError as e:
            error = e
    if jax.process_count() > 1:
        from jax.experimental.multihost_utils import broadcast_one_to_all

        held = bool(broadcast_one_to_all(np.int32(error is None)))
        if not held and error is None:
            error = _held(directory, flag)
    if error is not None:
        raise error
    return lock


class Checkpointer:
    """Asynchronous saves into `directory`, keeping the `keep` latest steps.

    Example:
      >>> ck = Checkpointer("runs/a", keep=2)
      >>> ck.save(10, state, {"data_position": 10}); ck.wait(); ck.close()
    """

    def __init__(self, directory: str, keep: int):
        self.directory = os.path.abspath(directory)
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True,
                                            cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=opts)
        self.in_flight: int | None = None   # the step being written in the background
        self.saved: int | None = None       # the last step known complete on disk

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `state` and `meta` (with the format tag, the state's digest and its own) as `step`;
        returns before the write. Raises CheckpointSaveError if the previous save failed."""
        if self.in_flight is not None:
            self.wait()  # orbax waits for the previous save anyway; this names it if it failed
        meta = {"format": FORMAT, **meta, "digest": state_digest(state)}
        meta["meta_digest"] = meta_digest(meta)
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:
            raise CheckpointSaveError(step, self.directory, e, self.saved) from None
        self.in_flight = step

    def check(self) -> None:
        """Raise CheckpointSaveError (one line) if the last asynchronous save has failed; cheap, so
        the training loop calls it after every step and the error surfaces at the save that failed."""
        try:
            self.manager.check_for_errors()
        except Exception as e:
            raise CheckpointSaveError(self.in_flight, self.directory, e, self.saved) from None
        if self.in_flight is not None and not self.manager.is_saving_in_progress():
            self.saved, self.in_flight = self.in_flight, None

    def wait(self) -> None:
        """Block until every started save is complete on disk (CheckpointSaveError if one failed)."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise CheckpointSaveError(self.in_flight, self.directory, e, self.saved) from None
        self.check()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def close(self) -> None:
        """Wait for the save in flight (CheckpointSaveError if it failed), then release the manager."""
        # NOTE: after a failed save the manager is left open: closing it stops the event loop its
        # failed threads still post to ("Event loop is closed" tracebacks); train.py exits at once.
        self.wait()
        self.manager.close()


class CheckpointSaveError(RuntimeError):
    """An asynchronous save failed (a full disk, say); the message is one line naming the step."""

    def __init__(self, step, directory: str, error: BaseException, saved=None):
        self.step = step
        kept = (f"step {saved} is the last complete checkpoint there" if saved is not None
                else "no checkpoint of this run is complete there")
        super().__init__(f"saving step {step} to {directory} failed: {_save_reason(error)}; {kept} (free space or "
                         f"pass another --checkpoint_dir, then continue with --resume)")


def quiet_failed_save_threads() -> None:
    """Drop the "RuntimeError: Event loop is closed" tracebacks that tensorstore's I/O threads report
    (through sys.unraisablehook) after orbax gave up on a failed asynchronous save: dozens of them
    for a full disk. The failure itself is reported once, as one line, by the training loop; every
    other unraisable exception is printed as before."""
    _drop_unraisable(lambda u: u.exc_type is RuntimeError and str(u.exc_value) == "Event loop is closed")
