"""The library's one module importing JAX internals (`jax._src`), each with the public API it waits for.

Tested with jax 0.10.2; `pyproject.toml` bounds `jax>=0.10.2,<0.11` so that a release that moves one
of these cannot break `import remat` silently.

| internal | used by | public API it waits for |
|---|---|---|
| `jax._src.interpreters.partial_eval.dce_jaxpr` | `remat.checkpoint`'s reentrant backward: only the equations the cotangents need (early stop) | a dead-code elimination of a jaxpr in `jax.extend` |
| `jax._src.ad_checkpoint.saved_residuals` | `remat.residuals.saved_residuals` | a public form of `jax.ad_checkpoint.print_saved_residuals` that returns its rows instead of printing them |
| `jax._src.config.enable_compilation_cache` (as a context manager) | `remat.planning.targets.compile`: a compile for an absent device skips the persistent compilation cache, whose entries need that device's client to load (JAX warns at every read); `jax.experimental.compilation_cache`'s `reset_cache()` around it, since JAX decides once per process | a scoped form of `jax.config.update("jax_enable_compilation_cache", ...)` |

Example:
    >>> import jax.numpy as jnp
    >>> [aval.shape for aval, _ in saved_residuals(jnp.sin, jnp.ones(3))]
    [(3,)]
"""
from __future__ import annotations

from jax._src.ad_checkpoint import saved_residuals
from jax._src.config import enable_compilation_cache
from jax._src.interpreters.partial_eval import dce_jaxpr

__all__ = ["JAX_TESTED", "dce_jaxpr", "enable_compilation_cache", "saved_residuals"]

JAX_TESTED = ("0.10.2",)
