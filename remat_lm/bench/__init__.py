"""Benchmarks: the policy table (`python -m remat_lm.bench.policies`), the PyTorch peer
(`python -m remat_lm.bench.torch_peer`), and the GPU check (`bash remat_lm/bench/gpu_check.sh`).

Measured figures live in docs/BENCHMARKS.md with date, machine and command.
"""
