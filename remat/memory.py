"""The memory API: what is saved for the backward pass (`remat.residuals`), what XLA compiled
(`remat.compiled`; `compiled_memory`, on this host or for a target, from `remat.planning.targets`), the
platform a program is built for (`remat.platform`), all re-exported here, and the analytic model of
saved bytes (`LayerBytes`, `predict_saved`).
"""
from __future__ import annotations

import dataclasses

from remat import names as _names
from remat import policies as _policies
from remat.compiled import GiB, MiB, CompiledMemory, compiled_stats, format_bytes
from remat.config import RecomputeConfig
from remat.planning.targets import compiled_memory
from remat.platform import ACCELERATORS, PLATFORMS, building_for, host_platform, lowered_for, target_platform
from remat.residuals import Residual, SavedResiduals, saved_residuals

__all__ = ["ACCELERATORS", "PLATFORMS", "CompiledMemory", "GiB", "LayerBytes", "MiB", "Residual", "SavedResiduals",
           "building_for", "compiled_memory", "compiled_stats", "format_bytes", "host_platform", "lowered_for",
           "predict_saved", "saved_residuals", "target_platform"]


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """What one layer keeps for its backward pass without remat, in bytes.

    `tagged` maps remat.names tags to bytes (block_input included); `untagged` counts the values
    with no tag (norm statistics, the mid-layer residual sum, the attention log-sum-exp, bf16
    casts of weights); `constants` are closed-over tables (RoPE) that `jax.checkpoint` keeps too;
    `swaps` are tagged values that no-remat does not keep but a tag-saving policy does, in place
    of an untagged value it then recomputes (the attention output instead of the residual sum);
    `internals` are what the layer's own `jax.checkpoint`s recompute and only a policy that saves
    everything keeps.
    """
    tagged: dict
    untagged: int
    constants: int = 0
    swaps: dict = dataclasses.field(default_factory=dict)
    internals: int = 0

    @property
    def total(self) -> int:
        return sum(self.tagged.values()) + self.untagged + self.constants


def predict_saved(layer: LayerBytes, n_layers: int, cfg: RecomputeConfig, head: int = 0) -> int | None:
    """Analytic saved bytes of a layer stack under `cfg`, plus `head` bytes kept outside the stack.

    A checkpointed region keeps its input (`block_input`) and, per layer, the tagged values its
    policy saves; untagged values are recomputed. Policies are registry names or policy callables;
    returns None for those that do not save by tag name (`dots`, `dots_no_batch`, offloading ones,
    a JAX policy callable other than `nothing_saveable`/`everything_saveable`, a callable of your
    own: `remat.policies.by_name` says which do). Derivation: docs/memory-model.md.

    Example:
      >>> layer = LayerBytes({_names.BLOCK_INPUT: 100, _names.QKV: 300}, untagged=50)
      >>> predict_saved(layer, 8, RecomputeConfig()), predict_saved(layer, 8, RecomputeConfig(granularity="full"))
      (3600, 800)
    """
    inp = layer.tagged.get(_names.BLOCK_INPUT, 0)
    if cfg.granularity == "none":
        return n_layers * layer.total + head
    total = head
    for seg in cfg.split(n_layers):
        k = seg.stop - seg.start
        if not seg.checkpointed:
            total += k * layer.total
            continue
        per = _region_bytes(layer, cfg.effective_policy(seg.start), cfg.use_reentrant)
        if per is None:
            return None
        inner, inner_inputs = per
        total += inp + k * inner + (k - 1) * inner_inputs
    return total


def _region_bytes(layer: LayerBytes, policy, reentrant: bool):
    """(bytes kept per layer inside a region besides its input, bytes per inner layer input)."""
    inp = layer.tagged.get(_names.BLOCK_INPUT, 0)
    untagged = 0
    pol = _policies.resolve(policy)
    op = _policies.by_op(pol)
    everything = op == "everything"
    if pol is None or op == "nothing":  # reentrant, or nothing saved in a region
        saved = frozenset()
    elif everything:
        saved, untagged = frozenset(layer.tagged), layer.untagged + layer.internals
    else:
        rule = _policies.by_name(pol)
        if rule is None or rule.offload:
            return None  # not by name, or offloading: not modelled
        saved = frozenset(n for n in (*layer.tagged, *layer.swaps) if rule.saves(n))
    inner = sum(b for n, b in layer.tagged.items() if n in saved and n != _names.BLOCK_INPUT) + untagged
    inner += sum(b for n, b in layer.swaps.items() if n in saved) if not everything else 0
    inner += 0 if reentrant else layer.constants
    return inner, (inp if _names.BLOCK_INPUT in saved else 0)
