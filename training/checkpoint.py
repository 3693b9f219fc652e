"""orbax checkpoints: asynchronous, atomic saves of the whole train state plus JSON metadata.

A checkpoint directory holds one sub-directory per saved step with two items:
  state  the train state pytree: params, opt_state, step, rng (see training/step.py)
  meta   JSON: format tag, step, data position, model family and config, the TrainConfig

orbax writes each step into a temporary directory and renames it when complete, so a process
killed mid-save leaves the earlier steps intact and the partial one invisible to `latest_step`.
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
import logging as _logging
import os
import warnings

import jax
import orbax.checkpoint as ocp

from training.config import UsageError

FORMAT = "remat-train/1"
# Model config fields that do not change the parameters: a run may resume with other values.
RUNTIME_FIELDS = ("dtype", "dropout", "attention", "attention_tile")

# orbax logs through absl at WARNING for routine events (read-only managers, async threads):
# keep stderr for the run's own messages.
_logging.getLogger("absl").setLevel(_logging.ERROR)
warnings.filterwarnings("ignore", module="orbax")


@dataclasses.dataclass(frozen=True)
class DirInfo:
    """What a checkpoint directory holds: its latest complete step and that step's metadata."""
    step: int | None
    meta: dict | None
    steps: tuple = ()


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
    """The latest complete step and its metadata, without writing anything.

    Returns DirInfo(step=None) when the directory is missing or holds no complete step; raises
    UsageError when it holds steps that are not this script's checkpoints.
    """
    if not os.path.isdir(directory):
        return DirInfo(None, None)
    mngr = _read_only(directory)
    try:
        steps = tuple(mngr.all_steps())
        if not steps:
            return DirInfo(None, None)
        step = max(steps)
        items = set(os.listdir(os.path.join(directory, str(step)))) if os.path.isdir(
            os.path.join(directory, str(step))) else set()
        if not {"state", "meta"} <= items:
            raise UsageError(f"{flag} {directory}: step {step} is not a checkpoint written by train.py (it has "
                             f"{sorted(items) or 'no items'}, expected state and meta); pass the directory "
                             f"train.py --checkpoint_dir wrote")
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:  # a corrupt or foreign meta item
            raise UsageError(f"{flag} {directory}: step {step}: cannot read its metadata ({type(e).__name__}); pass a "
                             f"directory train.py --checkpoint_dir wrote") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise UsageError(f"{flag} {directory}: step {step} is not a train.py checkpoint (format "
                             f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r}); "
                             f"pass a directory train.py --checkpoint_dir wrote")
        return DirInfo(step, meta, steps)
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


def restore(directory: str, step: int, abstract_state, partial: bool = False):
    """Restore (state, meta) of `step`; `abstract_state` gives shapes, dtypes and shardings.

    With `partial=True` only the subtrees present in `abstract_state` are read (e.g. params).
    """
    mngr = _read_only(directory, handlers=not partial)
    try:
        state_args = (ocp.args.PyTreeRestore(item=abstract_state, partial_restore=True,
                                             restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))
                      if partial else ocp.args.StandardRestore(abstract_state))
        out = mngr.restore(step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore()))
        return out.state, out.meta
    finally:
        mngr.close()


def saved_shapes(directory: str, step: int) -> dict:
    """{'params.wte': shape, ...} of a saved state, from orbax's metadata (no array is read)."""
    mngr = _read_only(directory)
    try:
        tree = mngr.item_metadata(step)["state"]
        tree = getattr(tree, "tree", tree)
        return leaf_shapes(tree, is_leaf=lambda x: hasattr(x, "shape"))
    finally:
        mngr.close()


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

    def save(self, step: int, state, meta: dict) -> None:
        """Start saving `state` and `meta` (with the format tag) as `step`; returns before the write."""
        meta = {"format": FORMAT, **meta}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        self.manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
