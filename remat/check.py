"""The forward-vs-recompute check: CheckpointError and trace-time aval comparison.

# NOTE: why this costs nothing at run time. The forward emits, for every output leaf, a zero-size
# array `zeros((0,) + shape, dtype)` as an extra residual. Its aval carries the forward's shape and
# dtype into the backward, where the recomputation's avals are compared at trace time; the arrays
# themselves are never read, so XLA removes them (the optimized HLO is the same with the check on
# and off: tests/test_checkpoint.py). Shardings (explicit-axes meshes) are compared from the
# avals' `.sharding` the same way. `"structure"` also fingerprints the traced jaxpr of both traces
# (primitives and avals, in order), which catches a change that keeps output avals identical. The
# fingerprinted traces are the ones that run (`trace`): the forward evaluates its own jaxpr (the
# same equations, so the same compiled program) and the backward differentiates its own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import jaxprs_in_params as _jaxprs_in_params


class CheckpointError(RuntimeError):
    """The recomputation of a checkpointed region does not match its forward pass."""


def _sharding_spec(x):
    try:
        s = jax.typeof(x).sharding
    except Exception:
        return None
    spec = getattr(s, "spec", None)
    mesh = getattr(s, "mesh", None)
    if spec is None or mesh is None or getattr(mesh, "empty", False):
        return None
    return tuple(spec)


def describe(shape, dtype, spec=None) -> str:
    s = f"{jnp.dtype(dtype).name}{list(shape)}"
    return s if spec is None else f"{s} sharded {spec}"


def fingerprint_outputs(out):
    """Zero-size markers for every output leaf, plus their sharding specs (Python side)."""
    leaves = jax.tree.leaves(out)
    marks = tuple(jnp.zeros((0,) + tuple(jnp.shape(l)), jnp.result_type(l)) for l in leaves)
    specs = tuple(_sharding_spec(l) for l in leaves)
    return marks, specs


def compare_outputs(region: str, out_tree, marks, specs, recomputed) -> None:
    """Raise CheckpointError if `recomputed` differs from the forward in tree, shape, dtype, sharding."""
    paths_leaves, tree2 = jax.tree_util.tree_flatten_with_path(recomputed)
    if tree2 != out_tree:
        raise CheckpointError(f"checkpoint region {region!r}: recomputation returned a different output "
                              f"structure: forward {out_tree}, recompute {tree2}. The function must be "
                              f"deterministic given its inputs (no Python-side state that changes between calls).")
    for (path, leaf), mark, spec in zip(paths_leaves, marks, specs):
        fwd = (tuple(mark.shape[1:]), jnp.dtype(mark.dtype))
        rec = (tuple(jnp.shape(leaf)), jnp.dtype(jnp.result_type(leaf)))
        rspec = _sharding_spec(leaf)
        if fwd != rec or (spec is not None and rspec is not None and spec != rspec):
            where = jax.tree_util.keystr(path) or "<output>"
            raise CheckpointError(
                f"checkpoint region {region!r}, output {where}: forward produced "
                f"{describe(*fwd, spec)} but the recomputation produced {describe(*rec, rspec)}. "
                f"The function must trace identically every time it is called (no Python-side state "
                f"or flags that change between the forward and the backward).")


def fingerprint(closed) -> tuple:
    """Primitive names and output avals of a traced program (a ClosedJaxpr), in order (names ignored)."""

    def walk(jaxpr):
        out = []
        for eqn in jaxpr.eqns:
            out.append((eqn.primitive.name, tuple(str(v.aval) for v in eqn.outvars)))
            for sub in _jaxprs_in_params(eqn.params):
                out.extend(walk(sub))
        return out

    return tuple(walk(closed.jaxpr))


def trace(fn, *args):
    """Trace `fn(*args)` once: (its ClosedJaxpr, a function evaluating exactly that program).

    The check compares fingerprints of the programs that really ran: the forward evaluates the
    jaxpr it fingerprinted, and the recomputation differentiates the jaxpr it fingerprinted, so a
    function that traces differently each time cannot slip a third, unchecked trace in between.
    """
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    tree = jax.tree.structure(shape)

    def run(*a):
        return jax.tree.unflatten(tree, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(a)))

    return closed, run


def jaxpr_fingerprint(fn, *args) -> tuple:
    """`fingerprint` of a fresh trace of `fn(*args)`."""
    return fingerprint(jax.make_jaxpr(fn)(*args))


def compare_structure(region: str, fwd: tuple, rec: tuple) -> None:
    if fwd == rec:
        return
    i = next((i for i, (a, b) in enumerate(zip(fwd, rec)) if a != b), min(len(fwd), len(rec)))
    a = fwd[i] if i < len(fwd) else "<end>"
    b = rec[i] if i < len(rec) else "<end>"
    raise CheckpointError(f"checkpoint region {region!r}: the recomputation traced to a different program "
                          f"than the forward ({len(fwd)} vs {len(rec)} equations; first difference at "
                          f"equation {i}: forward {a}, recompute {b}). Gradients would be wrong.")


def compare_values(region: str, forward, recomputed, *, tolerance: float) -> None:
    """At run time (debug callback): raise CheckpointError when a recomputed output leaf differs
    from the forward's by more than `tolerance` relative to the leaf's max |forward|."""
    diffs = [jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) if a.size else jnp.zeros(())
             for a, b in zip(forward, recomputed)]
    scales = [jnp.max(jnp.abs(a.astype(jnp.float32))) if a.size else jnp.zeros(()) for a in forward]

    def report(diffs, scales):
        for i, (d, s) in enumerate(zip(diffs, scales)):
            if not float(d) <= tolerance * max(float(s), 1e-30):  # also catches NaN
                raise CheckpointError(
                    f"checkpoint region {region!r}, output leaf {i}: recomputed values differ from the "
                    f"forward's by max |Δ| = {float(d):.3e} (max |forward| = {float(s):.3e}, allowed "
                    f"{tolerance:g} relative). A nondeterministic op or an RNG key that changes between "
                    f"the forward and the recomputation (pass keys as arguments) would do this.")

    jax.debug.callback(report, diffs, scales)
