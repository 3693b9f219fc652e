"""The forward-vs-recompute check of the reentrant path: CheckpointError, aval, program and value comparison.

The rules of `determinism_check` (`remat.checkpoint` and `RecomputeConfig`; `remat.config.check_region`
enforces them): only the reentrant path (`use_reentrant=True`) traces the region again, so only it
can recompute something else than the forward ran; `jax.checkpoint` traces once.
- None (default): on the reentrant path, the recomputation's output shapes, dtypes and shardings
  against the forward's, at trace time (free at run time); nothing on `jax.checkpoint`.
- False: no check.
- With `use_reentrant=True` only: True or `"structure"` (also the traced programs, `fingerprint`;
  the backward differentiates the forward's own program) or `"values"` (the forward's
  outputs kept and compared with the recomputed values at run time, above
  `remat.checkpoint.VALUES_RTOL`).

Example:
    >>> import jax.numpy as jnp
    >>> closed, tree, run = trace(lambda x: x * 2.0, jnp.ones(2))
    >>> fingerprint(closed, tree) == fingerprint(*trace(lambda x: x * 2.0, jnp.ones(2))[:2])
    True
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal
import numpy as np

__all__ = ["CheckpointError", "aval_text", "compare_outputs", "compare_structure", "compare_values",
           "fingerprint", "fingerprint_outputs", "trace"]


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


def aval_text(shape, dtype, spec=None) -> str:
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
                f"{aval_text(*fwd, spec)} but the recomputation produced {aval_text(*rec, rspec)}. "
                f"The function must trace identically every time it is called (no Python-side state "
                f"or flags that change between the forward and the backward).")


def fingerprint(closed, out_tree=None) -> tuple:
    """A traced program (a ClosedJaxpr) as a tuple of lines that are equal exactly when the programs
    are, variable names aside.

    A line per closed-over constant (shape, dtype and value: small ones written out, larger ones by
    a digest of their bytes; a constant that is itself a tracer of an enclosing trace by shape and
    dtype only), then per equation, in order: the primitive, its parameters (sub-programs are
    expanded below their equation, the same way; functions by name), its inputs (variables numbered
    by first appearance, so the wiring counts; literals with their values) and its outputs'
    shapes and dtypes (with shardings where the aval has them); then the returned variables and,
    when given, the output pytree `out_tree`.
    """
    lines = [] if out_tree is None else [f"outputs {out_tree}"]
    _walk(closed.jaxpr, closed.consts, lines, "")
    return tuple(lines)


def _walk(jaxpr, consts, lines: list, indent: str) -> None:
    ids: dict = {}

    def var(v) -> str:
        if isinstance(v, Literal):
            return _value(v.val)
        if isinstance(v, DropVar):
            return "_"
        return ids.setdefault(v, f"%{len(ids)}")

    consts = list(consts) + [None] * (len(jaxpr.constvars) - len(consts))
    for v, c in zip(jaxpr.constvars, consts):
        lines.append(f"{indent}const {var(v)}:{_aval(v)} = {'?' if c is None else _value(c)}")
    lines.append(f"{indent}in {' '.join(f'{var(v)}:{_aval(v)}' for v in jaxpr.invars)}")
    for eqn in jaxpr.eqns:
        params = ", ".join(f"{k}={_param(p)}" for k, p in sorted(eqn.params.items()))
        ins = " ".join(var(v) for v in eqn.invars)
        outs = " ".join(f"{var(v)}:{_aval(v)}" for v in eqn.outvars)
        lines.append(f"{indent}{eqn.primitive.name}[{params}] {ins} -> {outs}")
        for sub, sub_consts in _subprograms(eqn.params):
            _walk(sub, sub_consts, lines, indent + "  ")
    lines.append(f"{indent}return {' '.join(var(v) for v in jaxpr.outvars)}")


def _aval(v) -> str:
    return str(v.aval)


def _value(x) -> str:
    """A literal or constant: its aval, and its value (written out when small, else a digest)."""
    if isinstance(x, jax.core.Tracer):  # a value of an enclosing trace: not known yet
        return f"traced {x.aval}"
    try:
        a = np.asarray(jax.random.key_data(x) if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key) else x)
    except Exception:  # not an array (a token, an opaque object): its type is all we can compare
        return f"<{type(x).__name__}>"
    if a.size <= 8:
        return f"{a.dtype.name}{list(a.shape)}{a.tolist()!r}"
    return f"{a.dtype.name}{list(a.shape)}#{hashlib.sha256(a.tobytes()).hexdigest()[:16]}"


def _param(p) -> str:
    """A parameter of an equation as text that does not depend on the trace (no object ids)."""
    if isinstance(p, (Jaxpr, ClosedJaxpr)):
        return "{program}"  # expanded below the equation
    if isinstance(p, (tuple, list)):
        return "(" + ", ".join(_param(q) for q in p) + ")"
    if isinstance(p, (np.ndarray, np.generic, jax.Array)):
        return _value(p)
    if isinstance(p, (bool, int, float, complex, str, type(None), np.dtype)):
        return repr(p)
    text = repr(p)
    if " at 0x" in text or "object at" in text:  # a function or an object without a value repr
        return f"<{getattr(p, '__qualname__', type(p).__qualname__)}>"
    return text


def _subprograms(params):
    """(Jaxpr, consts) of every sub-program among an equation's parameters (cond branches, a scan or
    while body, a pjit, a custom_vjp's primal), in parameter order."""
    for k in sorted(params):
        for p in params[k] if isinstance(params[k], (tuple, list)) else (params[k],):
            if isinstance(p, ClosedJaxpr):
                yield p.jaxpr, p.consts
            elif isinstance(p, Jaxpr):
                yield p, ()


def trace(fn, *args):
    """Trace `fn(*args)` once: (its ClosedJaxpr, its output pytree, a function evaluating exactly
    that program).

    The forward evaluates the program it fingerprinted, and the backward differentiates that same
    program once a fresh trace was found equal to it, so the gradient is always the gradient of the
    forward that ran.
    """
    # a fresh wrapper per call: make_jaxpr caches traces per function object
    closed, shape = jax.make_jaxpr(lambda *a: fn(*a), return_shape=True)(*args)
    tree = jax.tree.structure(shape)

    def run(*a):
        return jax.tree.unflatten(tree, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(a)))

    return closed, tree, run


def compare_structure(region: str, fwd: tuple, rec: tuple) -> None:
    """Raise CheckpointError naming the first line where two `fingerprint`s differ."""
    if fwd == rec:
        return
    i = next((i for i, (a, b) in enumerate(zip(fwd, rec)) if a != b), min(len(fwd), len(rec)))
    short = lambda t: t.strip() if len(t.strip()) <= 300 else t.strip()[:297] + "..."
    a = short(fwd[i]) if i < len(fwd) else "<end>"
    b = short(rec[i]) if i < len(rec) else "<end>"
    raise CheckpointError(f"checkpoint region {region!r}: the recomputation traced to a different program "
                          f"than the forward ({len(fwd)} vs {len(rec)} lines; first difference at line {i}: "
                          f"forward `{a}`, recompute `{b}`). The function must trace identically every time it "
                          f"is called (no Python-side state, counters or flags that change between the forward "
                          f"and the backward); its gradient would be another program's.")


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
