"""Trace + compile seconds of the GPT-2 train step as depth grows, loop vs scan layout.

    python -m remat_lm.bench.compile_time [--layers 12 48] [--json out.json]

Shape: the reference shape (`remat_lm.bench.common.REFERENCE`: C=256, 4 heads, T=256, B=8, vocab 1024), deeper. Each setting is traced
and compiled once in this process (`jax.jit(...).lower(...).compile()`); nothing is executed.
"""
from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from remat_lm.bench.common import REFERENCE_BATCH, reference_config, cli, write_json
from remat_lm.models import gpt2
from remat import RecomputeConfig
from remat_lm.argtypes import Parser, integer

SETTINGS = {"none": RecomputeConfig(), "full": RecomputeConfig(granularity="full")}


def measure(n_layer: int, scan: bool, recompute: RecomputeConfig) -> tuple[float, float]:
    """(trace seconds, compile seconds) for one configuration."""
    cfg = reference_config("gpt2", n_layer=n_layer, scan_layers=scan, recompute=recompute)
    params = jax.eval_shape(lambda: gpt2.init_params(cfg, jax.random.PRNGKey(0)))
    idx = jax.ShapeDtypeStruct((REFERENCE_BATCH, cfg.block_size), jnp.int32)
    step = jax.jit(jax.value_and_grad(lambda p, x: gpt2.loss_fn(p, cfg, x, x)))
    t0 = time.perf_counter()
    lowered = step.lower(params, idx)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def main(argv=None) -> int:
    p = Parser(prog="python -m remat_lm.bench.compile_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=integer(1), nargs="+", default=[12, 48], help="depths to compile (default: 12 48)")
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    rows = []
    print("| layers | layout | recompute | trace s | compile s | total s |\n|---|---|---|---|---|---|")
    for n in a.layers:
        for scan in (False, True):
            for name, rc in SETTINGS.items():
                tr, co = measure(n, scan, rc)
                rows.append(dict(layers=n, scan=scan, recompute=name, trace_s=tr, compile_s=co))
                print(f"| {n} | {'scan' if scan else 'loop'} | {name} | {tr:.2f} | {co:.2f} | {tr + co:.2f} |", flush=True)
    write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(cli(main, "compile_time"))
