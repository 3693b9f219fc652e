"""The host JAX starts on: a machine with no accelerator device gets JAX's CPU platform.

`import remat` calls `prepare_host()` first thing, before any JAX backend starts. On a host with no
NVIDIA, AMD or TPU device node, and with `JAX_PLATFORMS` unset, JAX would try the installed GPU and
TPU plugins (the `targets` extra) and print their start-up tracebacks before falling back to the
CPU; asking for the CPU platform there changes nothing else. Compiling for a target
(`remat.planning.targets`) needs no device, so it works the same. This module imports no JAX.
"""
from __future__ import annotations

import glob
import os
import sys

__all__ = ["ACCELERATOR_NODES", "has_accelerator", "prepare_host"]

# device nodes that mean an accelerator JAX can use: NVIDIA GPUs, AMD GPUs (ROCm), TPUs
ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel*", "/dev/vfio/[0-9]*")


def has_accelerator() -> bool:
    """True when this host has a GPU or TPU device node."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def prepare_host() -> str | None:
    """Give JAX the CPU platform on a host without an accelerator, unless `JAX_PLATFORMS` is set.

    Returns the platform it chose ("cpu") or None when it left JAX as it was. Call it before the
    first JAX computation; `import remat` does.
    Example:
      >>> import remat
      >>> remat.prepare_host() in (None, "cpu")
      True
    """
    if "JAX_PLATFORMS" in os.environ or has_accelerator():
        return None
    if "jax" in sys.modules:  # imported already: JAX reads its config when the first backend starts
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"
    return "cpu"
