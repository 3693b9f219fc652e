"""What `jax.vjp` keeps for the backward pass (`saved_residuals`), grouped by tag.

Example:
    >>> import jax.numpy as jnp
    >>> saved_residuals(lambda x: jnp.sin(jnp.sin(x)), jnp.ones(3)).total
    24
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import jax
import numpy as np

from remat import policies as _policies  # noqa: F401  (the doctest uses it)
from remat._compat import saved_residuals as _jax_saved_residuals
from remat.compiled import MiB

__all__ = ["Residual", "SavedResiduals", "saved_residuals"]

_NAMED = re.compile(r"named '([^']+)'")


@dataclasses.dataclass(frozen=True)
class Residual:
    """One saved value: tag name (or its source), shape, dtype, bytes, JAX's description, kind."""
    name: str
    shape: tuple
    dtype: str
    bytes: int
    source: str
    kind: str  # "argument", "named", "intermediate", "constant"
    host: bool = False  # offloaded to host memory (a policy's `offload` choice)


@dataclasses.dataclass(frozen=True)
class SavedResiduals:
    """Rows of saved values with totals. `total` counts arguments too; `intermediates` does not."""
    rows: tuple

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def intermediates(self) -> int:
        return sum(r.bytes for r in self.rows if r.kind != "argument")

    @property
    def offloaded(self) -> int:
        """Bytes kept in host memory (offloaded); the rest stay on the device."""
        return sum(r.bytes for r in self.rows if r.host)

    def by_name(self) -> dict:
        """{tag name or source kind: (count, bytes)}, largest first."""
        acc = defaultdict(lambda: [0, 0])
        for r in self.rows:
            key = r.name if r.kind == "named" else f"<{r.kind}:{r.name}>" if r.kind != "argument" else "<arguments>"
            key += " (host)" if r.host else ""
            acc[key][0] += 1
            acc[key][1] += r.bytes
        return dict(sorted(((k, tuple(v)) for k, v in acc.items()), key=lambda kv: -kv[1][1]))

    def __getitem__(self, key):  # dict-style access for programs: res["total"], res["rows"]
        return self.as_dict()[key]

    def as_dict(self) -> dict:
        return {"rows": [dataclasses.asdict(r) for r in self.rows], "by_name": self.by_name(),
                "total": self.total, "intermediates": self.intermediates}

    def table(self) -> str:
        """A pretty-printed table grouped by tag name."""
        lines = [f"{'saved value':<36} {'count':>5} {'MiB':>10}"]
        for k, (c, b) in self.by_name().items():
            lines.append(f"{k[:36]:<36} {c:>5} {b / MiB:>10.2f}")
        lines.append(f"{'total (intermediates)':<36} {'':>5} {self.intermediates / MiB:>10.2f}")
        lines.append(f"{'total (with arguments)':<36} {'':>5} {self.total / MiB:>10.2f}")
        if self.offloaded:
            lines.append(f"{'of which offloaded to host':<36} {'':>5} {self.offloaded / MiB:>10.2f}")
            if jax.default_backend() == "cpu":
                lines.append("note: on CPU, offloading moves nothing (host and device memory are the same): "
                             "no device memory is saved; it does on GPU/TPU")
        return "\n".join(lines)


def _nbytes(aval) -> int:
    try:
        return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        return int(np.prod(aval.shape, dtype=np.int64)) * 8


def saved_residuals(fn, *args) -> SavedResiduals:
    """List what `jax.vjp(fn, *args)` keeps for the backward pass.

    Args:
      fn: a function of arrays/pytrees (closed-over constants allowed).
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`s are not accepted: use arrays).
    Returns:
      SavedResiduals with `.rows`, `.total`, `.intermediates`, `.by_name()`, `.table()`.
    Example:
      >>> import jax.numpy as jnp
      >>> from jax.ad_checkpoint import checkpoint_name
      >>> f = lambda w, x: jnp.sum(jnp.sin(checkpoint_name(x @ w, "mlp_up")))
      >>> saved_residuals(f, jnp.ones((8, 8)), jnp.ones((4, 8))).by_name()   # {name: (count, bytes)}
      {'<arguments>': (2, 384), '<intermediate:cos>': (1, 128)}
      >>> g = jax.checkpoint(f, policy=_policies.get("save_names:mlp_up"))  # keep the tagged product instead
      >>> saved_residuals(g, jnp.ones((8, 8)), jnp.ones((4, 8))).by_name()
      {'<arguments>': (2, 384), 'mlp_up': (1, 128)}
    """
    rows = []
    for aval, src in _jax_saved_residuals(fn, *args):
        m = _NAMED.search(src)
        if m:
            kind, name = "named", m.group(1)
        elif src.startswith("from the argument"):
            kind, name = "argument", src.removeprefix("from the argument ").strip()
        elif src.startswith("from a") :
            kind, name = "constant", src.removeprefix("from ").strip()
        else:
            kind = "intermediate"
            name = src.split(" from ")[0].removeprefix("output of ").strip()
        dtype = str(aval.dtype) if hasattr(aval, "dtype") else "?"
        host = "host" in str(getattr(aval, "memory_space", "")).lower()
        rows.append(Residual(name, tuple(getattr(aval, "shape", ())), dtype, _nbytes(aval), src, kind, host))
    inter = {r.name for r in rows if r.kind == "intermediate"}
    if "scan" in inter and inter & _VIEW_PRIMITIVES:
        views = _argument_views(fn, args, rows)
        if views is not None:
            rows = [dataclasses.replace(r, kind="argument", name=f"{r.name} of an argument") if v else r
                    for r, v in zip(rows, views)]
    return SavedResiduals(tuple(rows))


# A saved value made from an argument by these shape-only primitives alone counts as the argument
# (docs/architecture.md, Design notes: `residuals.py` argument views).
_VIEW_PRIMITIVES = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose", "slice",
                              "dynamic_slice", "copy", "copy_p", "reduce_precision"})


def _argument_views(fn, args, rows):
    """Per row of `rows` (JAX's saved-residual order): whether it is a shape-only view of an
    argument; None when the program traced here does not line up with the rows."""
    from jax.extend.core import Literal
    leaves, tree = jax.tree.flatten(args)
    closed, out_shape = jax.make_jaxpr(lambda *a: jax.vjp(lambda *b: fn(*jax.tree.unflatten(tree, b)), *a),
                                       return_shape=True)(*leaves)
    jaxpr = closed.jaxpr
    outs = jaxpr.outvars[len(jaxpr.outvars) - len(jax.tree.leaves(out_shape[1])):]
    subst = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive.name == "reduce_precision"}
    res = {subst.get(v, v) for v in outs if not isinstance(v, Literal)}
    views = set(jaxpr.invars)
    for e in jaxpr.eqns:
        first, *rest = e.invars or [None]
        if (e.primitive.name in _VIEW_PRIMITIVES and not isinstance(first, Literal) and first in views
                and all(isinstance(v, Literal) or v.aval.shape == () for v in rest)):
            views.update(e.outvars)
    flags = [False] * sum(isinstance(v, Literal) for v in outs)
    flags += [False for v in list(jaxpr.constvars) + list(jaxpr.invars) if v in res]
    flags += [v in views for e in jaxpr.eqns for v in e.outvars if v in res]
    shapes = [tuple(v.aval.shape) for e in jaxpr.eqns for v in e.outvars if v in res]
    if len(flags) != len(rows) or shapes != [r.shape for r in rows[len(rows) - len(shapes):]]:
        return None
    return flags
