"""The one module that touches JAX internals (every `jax._src` import of remat/ and remat_lm/ is here).

Tested with jax 0.10.2 (what CI installs from PyPI); `pyproject.toml` pins `jax>=0.10.2,<0.11` so
that a new minor release, which may move any of these, cannot silently break `import remat`.
Upgrading JAX: widen that bound only after `tests/test_jax_policies.py`, `tests/test_memory.py`,
`tests/test_checkpoint.py` and `tests/test_attention.py` pass on the new version, and add it to the
list of tested versions below.

What is used, and why there is no public equivalent (jax 0.10.2):

- `jax._src.interpreters.partial_eval.dce_jaxpr` (remat/checkpoint.py, reentrant backward: keep
  only the equations the cotangents need, "early stop"). `jax.extend.core` offers jaxprs but no
  dead-code elimination of one.
- `jax._src.ad_checkpoint.saved_residuals` (remat/memory.py `saved_residuals`): the rows
  (aval, description) of what `jax.vjp` keeps. The public `jax.ad_checkpoint.print_saved_residuals`
  only prints them.
- `jax._src.cudnn.fused_attention_stablehlo` (remat_lm/models/attention.py): the cuDNN version
  check JAX runs while tracing cuDNN attention (replaced so a CPU host can build a cuda program)
  and its compute-capability check (the largest head size cuDNN takes). No public API exposes
  either.
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
- The shape of JAX's policy objects (`policy_parts`; no import, but implementation details):
  which `jax.checkpoint_policies` factory built a policy and with which arguments, for
  `remat.policies.describe` and the name-based reports. No public API says; JAX's objects are
  recognized by comparison with probes built from the public factories (the class of a dataclass
  policy, the code object of a closure) and read through their fields or closure cells. A JAX that
  changes them makes `policy_parts` answer None: reports then show the callable's qualified name
  and treat it as not name-based (tests/test_jax_policies.py fails, loudly, on such a JAX).

Tested JAX versions: 0.10.2.
"""
from __future__ import annotations

import dataclasses
import inspect

import jax
from jax._src.ad_checkpoint import saved_residuals  # noqa: F401  (re-exported for remat.memory)
from jax._src.cudnn import fused_attention_stablehlo  # noqa: F401  (remat_lm/models/attention.py)
from jax._src import config as _config
from jax._src import core as _core
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax
from jax._src.interpreters.partial_eval import dce_jaxpr  # noqa: F401  (remat/checkpoint.py)

JAX_TESTED = ("0.10.2",)

_cp = jax.checkpoint_policies
_NO = ()  # probe arguments

# {factory name: (kind, key)}: kind "fields" (a dataclass policy: its class) or "cells" (a closure:
# its code object), built once from the public factories.
_PROBES = {}
for _name, _probe in (
        ("save_only_these_names", lambda: _cp.save_only_these_names()),
        ("save_any_names_but_these", lambda: _cp.save_any_names_but_these()),
        ("save_and_offload_only_these_names", lambda: _cp.save_and_offload_only_these_names(
            names_which_can_be_saved=_NO, names_which_can_be_offloaded=_NO, offload_src="device",
            offload_dst="pinned_host")),
        ("save_from_both_policies", lambda: _cp.save_from_both_policies(_cp.nothing_saveable, _cp.nothing_saveable)),
        ("offload_dot_with_no_batch_dims", lambda: _cp.offload_dot_with_no_batch_dims("device", "pinned_host"))):
    try:
        p = _probe()
    except Exception:  # pragma: no cover - a JAX without this factory
        continue
    if dataclasses.is_dataclass(p):
        _PROBES[_name] = ("fields", type(p))
    elif getattr(p, "__closure__", None) is not None:
        _PROBES[_name] = ("cells", p.__code__)


def policy_name(policy) -> str | None:
    """The `jax.checkpoint_policies` attribute that `policy` is (`nothing_saveable`, ...), or None."""
    for name, obj in vars(_cp).items():
        try:
            if obj is policy:
                return name
        except Exception:  # pragma: no cover
            continue
    return None


def policy_parts(policy):
    """(factory name, positional args, keyword args) of a policy a `jax.checkpoint_policies`
    factory built, e.g. `("save_only_these_names", ("qkv",), {})`; None for anything else.

    Example:
      >>> policy_parts(jax.checkpoint_policies.save_only_these_names("qkv"))
      ('save_only_these_names', ('qkv',), {})
    """
    for name, (kind, key) in _PROBES.items():
        if kind == "fields" and type(policy) is key:
            values = [getattr(policy, f.name) for f in dataclasses.fields(policy)]
            if len(values) == 1 and isinstance(values[0], (frozenset, set, tuple)):
                return name, tuple(sorted(values[0])), {}
            return name, tuple(values), {}
        if kind == "cells" and getattr(policy, "__code__", None) is key:
            cells = dict(zip(key.co_freevars, (c.cell_contents for c in policy.__closure__)))
            args, kwargs = [], {}
            for param in inspect.signature(getattr(_cp, name)).parameters.values():
                if param.name not in cells:
                    return None
                v = cells[param.name]
                v = tuple(sorted(v)) if isinstance(v, (set, frozenset)) else v
                if param.kind is param.KEYWORD_ONLY:
                    kwargs[param.name] = v
                else:
                    args.append(v)
            return name, tuple(args), kwargs
    return None


def ad_mode() -> str:
    """How the current trace treats a region called now: "forward" (`jax.jvp`, `jacfwd`,
    `jax.linearize`), "reverse" (`jax.vjp`, `jax.grad`), "staged" (traced into a jaxpr, e.g. a jit,
    scan or loop body, whose differentiation is decided later) or "eager" (run now, no AD).

    Walks from the current trace to its parents through the traces that do not differentiate
    (vmap's and the like); the first one that does, or the staging/eager one at the bottom, decides.
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
