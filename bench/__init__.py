"""Benchmarks: the policy table (`python -m bench.policies`), the PyTorch peer
(`python -m bench.torch_peer`), and the GPU check (`bash bench/gpu_check.sh`).

Measured figures live in docs/BENCHMARKS.md with date, machine and command.
"""
