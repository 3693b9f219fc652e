"""Chunked LM head and loss: compiled temp of GPT-2 d12 at T=1024, B=4, no remat and full remat,
with the plain head and with `loss_chunk` N.

    python -m remat_lm.bench.loss_chunk                       # d12, T=1024, B=4, chunks 128 and 256 (~1 min CPU)
    python -m remat_lm.bench.loss_chunk --chunks 64,128 --json out.json
    python -m remat_lm.bench.loss_chunk --target h200 --dtype bfloat16   # XLA:GPU's figures

Compile only: every row is `jax.jit(jax.grad(loss_fn)).lower(...).compile()` on abstract inputs
(`remat_lm.bench.common.compile_for`), nothing runs, so the d12 shape is fine on a small CPU
machine; `--target` (cpu, h200, v5e, ...) names the compiler.
Columns: XLA's compiled temp buffer and peak estimate (arguments + outputs + temp − aliased) and
the analytic saved bytes (remat_lm/models/memory_model.py), each also over the same recompute setting
without chunking, and the FLOPs chunking adds: the head's forward matmul once more in the backward,
2·B·T·Vp·C. Target: full remat + chunked loss ≤ 0.5× full remat's temp without
chunking, at the first chunk size of `--chunks`.
"""
from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from remat_lm.bench import common
from remat_lm.bench.common import MiB, Target, fmt, machine, markdown_table, publish, targets_markdown, cli
from remat_lm.models import gpt2, memory_model
from remat import RecomputeConfig
from remat.memory import compiled_stats
from remat.memory import predict_saved
from remat_lm.argtypes import Parser, int_list, integer

SETTINGS = {"none": RecomputeConfig(), "full": RecomputeConfig(granularity="full")}
TARGET = 0.5


def measure(preset: str, seq: int, batch: int, recompute: RecomputeConfig, chunk: int, dtype: str,
            target: str = "cpu") -> dict:
    """One row: compiled temp/peak/FLOPs of `jax.grad(loss_fn)` and the analytic saved bytes."""
    cfg = gpt2.GPT2Config.preset(preset, recompute=recompute, loss_chunk=chunk, dtype=dtype)
    params = jax.eval_shape(lambda: gpt2.init_params(cfg, jax.random.PRNGKey(0)))
    idx = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    t0 = time.perf_counter()
    cm = compiled_stats(common.compile_for(jax.grad(lambda p, x, y: gpt2.loss_fn(p, cfg, x, y)), params, idx, idx,
                                          target=target))
    layer, head = memory_model.activation_bytes(cfg, batch, seq)
    extra = 2 * batch * seq * cfg.padded_vocab_size * cfg.n_embd if chunk else 0
    return dict(temp_bytes=cm.temp, peak_bytes=cm.peak_estimate, recompute_flops=extra,
                saved_bytes=predict_saved(layer, cfg.n_layer, recompute, head - batch * seq * 4),
                compile_s=time.perf_counter() - t0, vocab=cfg.padded_vocab_size)


def run(preset: str = "d12", seq: int = 1024, batch: int = 4, chunks=(128, 256), dtype: str = "float32",
        log=print, target: str = "cpu") -> dict:
    """Every (setting, chunk) row, ratios to the same setting unchunked, and the target."""
    rows = []
    for name, rc in SETTINGS.items():
        base = None
        for chunk in (0, *chunks):
            r = dict(setting=name, loss_chunk=chunk, **measure(preset, seq, batch, rc, chunk, dtype, target))
            base = base or r
            for k in ("temp", "peak", "saved"):
                r[f"{k}_ratio"] = r[f"{k}_bytes"] / base[f"{k}_bytes"]
            rows.append(r)
            log(f"{name} loss_chunk={chunk}: temp {r['temp_bytes'] / MiB:,.1f} MiB ({r['compile_s']:.1f} s)")
    full0 = next(r for r in rows if r["setting"] == "full" and r["loss_chunk"] == 0)
    fullc = next(r for r in rows if r["setting"] == "full" and r["loss_chunk"] == chunks[0])
    ratio = fullc["temp_bytes"] / full0["temp_bytes"]
    targets = [Target(f"full remat + loss_chunk {chunks[0]} temp ≤ {TARGET}× full remat's without chunking",
                      f"{fullc['temp_bytes'] / MiB:,.1f} vs {full0['temp_bytes'] / MiB:,.1f} MiB ({ratio:.2f}×)",
                      ratio <= TARGET)]
    meta = dict(machine(), source=common.source(target), preset=preset, seq=seq, batch=batch, dtype=dtype,
                chunks=list(chunks),
                vocab=rows[0]["vocab"])
    return {"meta": meta, "rows": rows, "targets": [t.__dict__ for t in targets]}


def report(res: dict) -> str:
    m = res["meta"]
    header = ["recompute", "loss_chunk", "temp MiB", "temp × unchunked", "peak est. MiB", "saved MiB (analytic)",
              "saved × unchunked", "head recompute GFLOP", "compile s"]
    body = [[r["setting"], r["loss_chunk"] or "off", fmt(r["temp_bytes"] / MiB, ",.1f"), fmt(r["temp_ratio"]),
             fmt(r["peak_bytes"] / MiB, ",.1f"), fmt(r["saved_bytes"] / MiB, ",.1f"), fmt(r["saved_ratio"]),
             fmt(r["recompute_flops"] / 1e9, ",.1f"), fmt(r["compile_s"], ".1f")]
            for r in res["rows"]]
    return "\n".join([
        f"GPT-2 {m['preset']}, T={m['seq']}, B={m['batch']}, vocab {m['vocab']} (padded), {m['dtype']}; "
        f"`jax.grad(loss_fn)` {common.source_line(m.get('source') or common.source('cpu'))}; nothing run; "
        f"{m['date']}, {m['cpu']} ({m['nproc']} cores), jax {m['jax']}", "",
        markdown_table(header, body), "", "Targets:",
        targets_markdown([Target(**t) for t in res["targets"]])])


def main(argv=None) -> int:
    p = Parser(prog="python -m remat_lm.bench.loss_chunk", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="d12")
    p.add_argument("--seq", type=integer(1), default=1024)
    p.add_argument("--batch", type=integer(1), default=4)
    p.add_argument("--chunks", type=int_list(1), default="128,256",
                   help="comma list of loss_chunk sizes; the first is the target's")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--json", default=None, help="also write the rows here")
    common.add_target(p)
    a = p.parse_args(argv)
    res = run(a.preset, a.seq, a.batch, a.chunks, a.dtype, log=lambda s: print(s, flush=True), target=a.target)
    return publish(res, report, "remat_lm.bench.loss_chunk", argv, a.json)


if __name__ == "__main__":
    sys.exit(cli(main, "loss_chunk"))
