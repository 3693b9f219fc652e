"""remat_lm: the application around the `remat` library: GPT-2 and LLaMA-3 models (`remat_lm.models`),
the trainer behind `train.py` (`remat_lm.training`) and the benchmarks (`remat_lm.bench`).

A Flax or JAX user who only wants activation checkpointing imports `remat`; this package is what the
repository's own commands run. Imports run one way: `train.py` and the CLIs -> `remat_lm.training`
-> `remat_lm.models` -> `remat`. JAX starts on the CPU platform on a host without an accelerator
(`remat.prepare_host`, which `import remat` calls).
"""
