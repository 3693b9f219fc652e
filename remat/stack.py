"""apply_layers(): run a stack of layers grouped and rematerialized per a RecomputeConfig.

This is the one place where layers are grouped into recompute regions; the Linen and NNX helpers
and plain-JAX users all call it.

# NOTE: scan layout. With `scan=True` the parameters carry a leading layer axis. Segments from
# `plan()` are split into runs of equal size and kind (for `uniform` N: ⌊L/N⌋ regions of N layers,
# then one of L mod N), and each run is one `lax.scan` whose body is a region of `size` layers.
# So every method keeps its meaning under scan, and the traced program grows with the number of
# runs (at most 3), not with depth.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from remat.checkpoint import checkpoint
from remat.config import RecomputeConfig
from remat.plan import plan


def _runs(n_layers: int, cfg: RecomputeConfig):
    """(start, count, size, checkpointed, policy) runs of equal segments, for the scan layout."""
    units = []
    for s in plan(n_layers, cfg):
        if s.checkpointed:
            units.append((s.start, s.stop - s.start, True, cfg.effective_policy(s.start)))
        else:
            units += [(i, 1, False, None) for i in range(s.start, s.stop)]
    runs = []
    for start, size, ck, pol in units:
        if runs and tuple(runs[-1][2:]) == (size, ck, pol):
            runs[-1][1] += 1
        else:
            runs.append([start, 1, size, ck, pol])
    return [tuple(r) for r in runs]


def apply_layers(apply_layer: Callable, params, x, cfg: RecomputeConfig, *, keys=None, args: tuple = (),
                 scan: bool = False, prevent_cse: bool = True):
    """Apply `apply_layer` layer after layer, with regions rematerialized per `cfg`.

    Args:
      apply_layer: `(layer_params, x, key, *args) -> x`; `key` is None when `keys` is None.
      params: a sequence of per-layer parameter pytrees, or (`scan=True`) one pytree whose leaves
        have a leading layer axis.
      x: the input activation (any pytree carried from layer to layer).
      cfg: the recompute config.
      keys: optional per-layer PRNG keys (leading layer axis), e.g. for dropout.
      args: extra arguments given to every layer (arrays are traced; other values are constants).
      scan: run the layers under `lax.scan` (constant compile time in depth).
    Example:
      >>> y = apply_layers(lambda p, h, k: h + jnp.tanh(h @ p), [w1, w2, w3], x,
      ...                  RecomputeConfig(granularity="full"))
    """
    n_layers = jax.tree.leaves(params)[0].shape[0] if scan else len(params)

    def run(ps, h, ks, *a):
        for i, p in enumerate(ps):
            h = apply_layer(p, h, None if ks is None else ks[i], *a)
        return h

    shard = None
    if cfg.shard_saved_axis:  # the carried activation (argument 1 of `run`/`run_stacked`) is (B, T, C)
        U = P.UNCONSTRAINED
        shard = {1: (P(U, cfg.shard_saved_axis, U), P(U, None, U))}

    def region(start, stop, ps, h, ks):
        return checkpoint(run, ps, h, ks, *args, use_reentrant=cfg.use_reentrant, policy=cfg.effective_policy(start),
                          determinism_check=cfg.determinism_check, prevent_cse=prevent_cse,
                          name=f"layers[{start}:{stop}]", shard_saved=shard)

    if not scan:
        for s in plan(n_layers, cfg):
            ps = list(params[s.start:s.stop])
            ks = None if keys is None else keys[s.start:s.stop]
            x = region(s.start, s.stop, ps, x, ks) if s.checkpointed else run(ps, x, ks, *args)
        return x

    def run_stacked(p, h, k, *a):  # p: params with a leading axis of `size` layers
        size = jax.tree.leaves(p)[0].shape[0]
        return run([jax.tree.map(lambda t: t[j], p) for j in range(size)], h,
                   None if k is None else [k[j] for j in range(size)], *a)

    # NOTE: each scan step hands its xs slice (the group's stacked params) to the region as is, so
    # the residual is the scan's own input, which JAX forwards instead of saving a stacked copy of
    # every layer's parameters. Groups of one layer are scanned without a unit group axis: XLA:CPU
    # copies (L, 1, ...)-shaped loop inputs into temp memory (24 MiB, 7% of the no-remat peak, for
    # GPT-2 8L C=256), while (L, ...) and (L/N, N, ...) are read in place.
    for start, count, size, ck, policy in _runs(n_layers, cfg):
        stop = start + count * size
        group = lambda a: (a if (start, stop) == (0, n_layers) else a[start:stop]).reshape(
            ((count, size) if size > 1 else (count,)) + a.shape[1:])
        grouped = jax.tree.map(group, params)
        kgrouped = None if keys is None else group(keys)

        def body(h, pk, start=start, size=size, ck=ck, policy=policy):
            p, k = pk
            fn = run_stacked if size > 1 else apply_layer  # a group of one: that layer's params
            if not ck:
                return fn(p, h, k, *args), None
            return checkpoint(fn, p, h, k, *args, use_reentrant=cfg.use_reentrant, policy=policy,
                              determinism_check=cfg.determinism_check, prevent_cse=prevent_cse,
                              name=f"layers[{start}:{start + size}] (scanned)", shard_saved=shard), None

        x, _ = lax.scan(body, x, (grouped, kgrouped))
    return x
