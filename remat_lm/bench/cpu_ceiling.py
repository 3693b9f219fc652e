"""What one and two CPU cores give JAX and PyTorch here: matmul throughput and the reference step.

    python -m remat_lm.bench.cpu_ceiling --json out/bench/cpu_ceiling.json

The PyTorch-peer target (`remat_lm.bench.torch_peer`: JAX no-remat step ≤ PyTorch eager's at its fastest
thread count) is decided by how each framework uses the second core, not by the model code. This
measures that directly, each figure in a fresh process so that nothing is shared but the machine:

- float32 matmul (M, K) @ (K, N) (default 2048 × 256 @ 256 × 1024, the reference GPT-2's MLP
  up-projection for B·T = 2048 tokens): JAX (XLA:CPU) in one process, then two JAX processes at
  once; PyTorch at 1 and 2 threads, then two 1-thread PyTorch processes at once. GFLOP/s per
  process and their sum, and "2 cores / 1 core", the throughput the second core adds.
- the reference GPT-2 no-remat forward + backward (remat_lm.bench.common.REFERENCE, batch 8) in JAX on 1
  host device and data-parallel over 2 host devices (`--xla_force_host_platform_device_count=2`,
  the batch split in two): XLA:CPU's way to run one step on two cores.

Without torch (the `peer` extra) the PyTorch rows are left out and say so.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from remat_lm.bench.common import machine, median, publish
from remat_lm.argtypes import Parser, int_list, integer, real

WORKER = "remat_lm.bench.cpu_ceiling"


def _matmul_jax(m, k, n, seconds):
    import jax
    import jax.numpy as jnp
    import numpy as np
    a = jnp.asarray(np.random.default_rng(0).random((m, k), np.float32))
    b = jnp.asarray(np.random.default_rng(1).random((k, n), np.float32))
    f = jax.jit(lambda a, b: a @ b)
    return _rate(lambda: f(a, b).block_until_ready(), 2 * m * k * n, seconds)


def _matmul_torch(m, k, n, seconds, threads):
    import torch
    torch.set_num_threads(threads)
    a, b = torch.rand(m, k), torch.rand(k, n)
    return _rate(lambda: a @ b, 2 * m * k * n, seconds)


def _rate(fn, flops, seconds):
    """GFLOP/s of `fn` run back to back for `seconds` after a warm-up."""
    for _ in range(3):
        fn()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        count += 1
    return flops * count / (time.perf_counter() - t0) / 1e9


def _step_jax(devices, steps):
    """Median ms of the reference GPT-2 no-remat value_and_grad, batch split over `devices`."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from remat_lm.bench import common, policies
    from remat_lm.models import family
    cfg, seq = policies.build_config("gpt2", "ref")
    params, idx, tgt = policies.inputs(cfg, common.REFERENCE_BATCH, seq)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    idx, tgt = (jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (idx, tgt))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    step = jax.jit(jax.value_and_grad(lambda p, i, t: family.get("gpt2").loss_fn(p, cfg, i, t)))
    loss = float(jax.block_until_ready(step(params, idx, tgt))[0])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, idx, tgt))
        times.append(1000 * (time.perf_counter() - t0))
    return {"ms": median(times), "ms_all": times, "loss": loss}


def _spawn(args: list, devices: int = 1) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return subprocess.Popen([sys.executable, "-m", WORKER, "--worker", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _together(*jobs) -> list:
    """Start every job (argument lists), wait for all; their JSON results in order."""
    procs = [_spawn(*j) if isinstance(j, tuple) else _spawn(j) for j in jobs]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        if p.returncode:
            raise SystemExit(f"remat_lm.bench.cpu_ceiling: a worker failed:\n{stderr.strip()[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def run(m=2048, k=256, n=1024, seconds=3.0, steps=5, step=True) -> dict:
    """Every row, each measured in fresh processes (see the module docstring).

    Example:
      >>> res = run(m=64, k=64, n=64, seconds=0.2, step=False)
      >>> [r["impl"] for r in res["rows"]][:2]
      ['JAX matmul, 1 process', 'JAX matmul, 2 processes at once']
    """
    mm = ["matmul", m, k, n, seconds]
    rows = []

    def add(impl, results, base=None):
        rate = [r["gflops"] for r in results]
        rows.append(dict(impl=impl, kind="matmul", gflops_each=rate, gflops=sum(rate),
                         scaling=None if base is None else sum(rate) / base))
        return sum(rate)

    one = add("JAX matmul, 1 process", _together(mm + ["jax", 1]))
    add("JAX matmul, 2 processes at once", _together(mm + ["jax", 1], mm + ["jax", 1]), one)
    if has_torch():
        one = add("PyTorch matmul, 1 thread", _together(mm + ["torch", 1]))
        add("PyTorch matmul, 2 threads", _together(mm + ["torch", 2]), one)
        add("PyTorch matmul, 2 processes of 1 thread at once", _together(mm + ["torch", 1], mm + ["torch", 1]), one)
    if step:
        one = None
        for d in (1, 2):
            r = _together((["step", d, steps], d))[0]
            rows.append(dict(impl=f"JAX reference step, {d} host device{'s' if d > 1 else ''}", kind="step",
                             ms=r["ms"], ms_all=r["ms_all"], loss=r["loss"],
                             scaling=None if one is None else one / r["ms"]))
            one = one or r["ms"]
    meta = dict(machine(), matmul=[m, k, n], seconds=seconds, steps=steps, torch=has_torch())
    return {"meta": meta, "rows": rows}


def report(res: dict) -> str:
    lines = ["| measurement | GFLOP/s per process | GFLOP/s total | step ms | 2 cores / 1 core |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        each = ", ".join(f"{x:.0f}" for x in r.get("gflops_each", [])) or "—"
        total = f"{r['gflops']:.0f}" if "gflops" in r else "—"
        ms = f"{r['ms']:.0f}" if "ms" in r else "—"
        sc = "—" if r["scaling"] is None else f"{r['scaling']:.2f}×"
        lines.append(f"| {r['impl']} | {each} | {total} | {ms} | {sc} |")
    if not res["meta"]["torch"]:
        lines.append("\n(PyTorch rows left out: torch is not installed; `pip install -e '.[peer]'`)")
    return "\n".join(lines)


def _worker(argv) -> None:
    kind = argv[0]
    if kind == "matmul":
        m, k, n, seconds, lib, threads = int(argv[1]), int(argv[2]), int(argv[3]), float(argv[4]), argv[5], int(argv[6])
        g = _matmul_jax(m, k, n, seconds) if lib == "jax" else _matmul_torch(m, k, n, seconds, threads)
        print(json.dumps({"gflops": g}))
    else:
        print(json.dumps(_step_jax(int(argv[1]), int(argv[2]))))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(argv[1:])
        return 0
    p = Parser(prog="python -m remat_lm.bench.cpu_ceiling", description=__doc__.split("\n")[0])
    p.add_argument("--matmul", type=int_list(1, example="2048,256,1024"), default="2048,256,1024",
                   help="M,K,N of the matmul (default 2048,256,1024)")
    p.add_argument("--seconds", type=real(above=0), default=3.0, help="seconds each matmul worker runs (default 3)")
    p.add_argument("--steps", type=integer(1), default=5, help="timed reference steps per device count (default 5)")
    p.add_argument("--no-step", dest="step", action="store_false", help="matmul rows only")
    p.add_argument("--json", default=None, help="also write the rows and metadata here")
    a = p.parse_args(argv)
    if len(a.matmul) != 3:
        p.error(f"argument --matmul: expected M,K,N (three integers), e.g. 2048,256,1024; "
                f"got {','.join(map(str, a.matmul))!r}")
    m, k, n = a.matmul
    return publish(run(m, k, n, a.seconds, a.steps, a.step), report, WORKER, argv, a.json)


if __name__ == "__main__":
    sys.exit(main())
