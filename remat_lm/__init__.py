"""remat_lm: the application around the `remat` library: GPT-2 and LLaMA-3 models (`remat_lm.models`),
the trainer behind `train.py` (`remat_lm.training`) and the benchmarks (`remat_lm.bench`).

A Flax or JAX user who only wants activation checkpointing imports `remat`; this package is what the
repository's own commands run. Imports run one way: `train.py` and the CLIs -> `remat_lm.training`
-> `remat_lm.models` -> `remat`.
"""
import glob as _glob
import os as _os

# The commands start JAX on the host they run on. A host without an NVIDIA or TPU device gets the
# CPU platform unless JAX_PLATFORMS says otherwise, so that the installed GPU/TPU plugins (the
# `targets` extra, which `--target` compiles with) do not fail to initialize before the command's
# own output; compiling for a target needs no device.
if "JAX_PLATFORMS" not in _os.environ and not (_glob.glob("/dev/nvidia[0-9]*") or _glob.glob("/dev/accel*")
                                               or _glob.glob("/dev/vfio/[0-9]*")):
    _os.environ["JAX_PLATFORMS"] = "cpu"
