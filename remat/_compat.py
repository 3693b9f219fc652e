"""The one module of the library that touches JAX internals (every `jax._src` import of remat/ is here;
remat_lm's one, the cuDNN attention module, is in remat_lm/models/attention.py).

Tested with jax 0.10.2 (what CI installs from PyPI); `pyproject.toml` pins `jax>=0.10.2,<0.11` so
that a new minor release, which may move any of these, cannot silently break `import remat`.
Upgrading JAX: widen that bound only after `tests/test_jax_policies.py`, `tests/test_memory.py`,
`tests/test_checkpoint.py` and `tests/test_attention.py` pass on the new version, and add it to the
list of tested versions below.

What is used, and why there is no public equivalent (jax 0.10.2):

- `jax._src.interpreters.partial_eval.dce_jaxpr` (remat/checkpoint.py, reentrant backward: keep
  only the equations the cotangents need, "early stop"). `jax.extend.core` offers jaxprs but no
  dead-code elimination of one.
- `jax._src.ad_checkpoint.saved_residuals` (remat/residuals.py `saved_residuals`): the rows
  (aval, description) of what `jax.vjp` keeps. The public `jax.ad_checkpoint.print_saved_residuals`
  only prints them.
- `jax._src.interpreters.ad.JVPTrace` / `LinearizeTrace` (and its `is_vjp`),
  `jax._src.interpreters.partial_eval.DynamicJaxprTrace`, `jax._src.core.EvalTrace`
  (remat/checkpoint.py, `ad_mode`): how the trace a region is called under will differentiate it:
  forward mode (`jax.jvp`, `jacfwd`, `jax.linearize`: `is_vjp` False), reverse mode (`jax.vjp`,
  `jax.grad`: `is_vjp` True), staged for later (jit, scan and loop bodies), or eagerly. The
  cotangent tie is a custom_vjp, which only reverse mode can run. JAX exposes no public test for
  the mode; `jax.extend.core.find_top_trace` gives the current trace.
- `jax._src.lax.lax._convert_element_type` (remat/checkpoint.py `_tie`, `weak_like`): the
  cotangent tie adds a strongly typed zero, which would make a weakly typed input (a Python scalar,
  traced as `jax.checkpoint` traces it) strong, and so change dtype promotion in the recomputation;
  JAX's public `convert_element_type` cannot set the weak type back.
- `jax._src.config.trace_context` (remat/checkpoint.py): the configuration JAX's own trace caches
  key on (x64, default device, user contexts such as `remat.memory.building_for`), so that a
  region traced once per call signature is traced again when one of them changes.

Tested JAX versions: 0.10.2.
"""
from __future__ import annotations

import jax
from jax._src.ad_checkpoint import saved_residuals  # noqa: F401  (remat/residuals.py)
from jax._src import config as _config
from jax._src import core as _core
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax
from jax._src.interpreters.partial_eval import dce_jaxpr  # noqa: F401  (remat/checkpoint.py)

JAX_TESTED = ("0.10.2",)

def ad_mode() -> str:
    """How the current trace treats a region called now: "forward" (`jax.jvp`, `jacfwd`,
    `jax.linearize`), "reverse" (`jax.vjp`, `jax.grad`), "staged" (traced into a jaxpr, e.g. a jit,
    scan or loop body, whose differentiation is decided later) or "eager" (run now, no AD).

    Walks from the current trace to its parents through the traces that do not differentiate
    (vmap's and the like); the first one that does, or the staging/eager one at the bottom, decides.

    Example:
      >>> ad_mode()
      'eager'
    """
    trace = _core.find_top_trace(())
    while trace is not None:
        if isinstance(trace, _ad.JVPTrace):
            return "forward"
        if isinstance(trace, _ad.LinearizeTrace):
            return "reverse" if trace.is_vjp else "forward"
        if isinstance(trace, _pe.DynamicJaxprTrace):
            return "staged"
        if isinstance(trace, _core.EvalTrace):
            return "eager"
        trace = getattr(trace, "parent_trace", None)
    return "staged"  # an unknown trace: the form that serves every later mode


def forward_mode(leaves=()) -> bool:
    """True when a region called now is differentiated in forward mode (`ad_mode() == "forward"`)."""
    return ad_mode() == "forward"


def trace_context():
    """The configuration JAX keys its trace caches on (hashable)."""
    return _config.trace_context()


def weak_like(y, x):
    """`y` weakly typed when `x` is (same dtype), else `y`."""
    if getattr(jax.typeof(x), "weak_type", False) and not getattr(jax.typeof(y), "weak_type", False):
        return _lax._convert_element_type(y, jax.typeof(x).dtype, weak_type=True)
    return y
