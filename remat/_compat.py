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
- `jax._src.interpreters.ad.JVPTracer` (remat/checkpoint.py, `forward_mode`): whether a region
  is called under forward-mode AD (`jax.jvp`, `jacfwd`), where the cotangent tie (a custom_vjp)
  cannot run and plain `jax.checkpoint` is what applies. `jax.grad` and `jax.linearize` trace with
  another tracer type; JAX exposes no public test for the mode.
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
from jax._src.interpreters.ad import JVPTracer as _JVPTracer
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


def forward_mode(leaves) -> bool:
    """True when any leaf is traced for forward-mode AD at the innermost level (`jax.jvp`, `jacfwd`)."""
    return any(isinstance(x, _JVPTracer) for x in leaves)
