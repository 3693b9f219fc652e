"""The platform a program is built for: `building_for`, `target_platform`, `lowered_for`."""
from __future__ import annotations

import contextlib

import jax

__all__ = ["ACCELERATORS", "PLATFORMS", "building_for", "host_platform", "lowered_for", "target_platform"]

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
ACCELERATORS = ("cuda", "rocm", "tpu")
# a jit-cache-sensitive context: the same function traced for two platforms is traced twice
_TARGET = jax.make_user_context(None)


def host_platform() -> str:
    """This process's default backend in lowering words: cpu, cuda, rocm or tpu."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
    return "rocm" if "rocm" in version else "cuda"


def target_platform() -> str:
    """The platform the program being traced is built for: `building_for`'s, else the host's.

    Example:
      >>> with building_for("tpu"):
      ...     target_platform()
      'tpu'
    """
    return _TARGET.value or host_platform()


@contextlib.contextmanager
def building_for(platform: str):
    """Trace for `platform` (cpu | cuda | rocm | tpu): the platform-dependent pieces (attention
    core, offload fence) take that platform's form, whatever this host is."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} is not valid; use one of {', '.join(PLATFORMS)}")
    with _TARGET(platform):
        yield


def lowered_for(fn, platform: str, *args, **kwargs) -> jax.stages.Lowered:
    """`fn(*args, **kwargs)` jitted, traced and lowered for `platform` from any host (no compile).

    `fn` may be jitted already (its shardings and donation are kept). Read the program with
    `.as_text()` (StableHLO): e.g. the cuDNN attention call `__cudnn$fmha...` on cuda, the Pallas
    kernel `tpu_custom_call` on tpu, `_xla_buffer_placement = "pinned_host"` for offloaded values.
    `python -m remat_lm.bench.lower` does it for the train step.
    Example:
      >>> "stablehlo.sine" in lowered_for(jax.numpy.sin, "tpu", jax.numpy.ones(4)).as_text()
      True
    """
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    with building_for(platform):
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,))
