"""Attention cores at long sequences: compiled temp and step time, the xla core against the tiled core.

    python -m remat_lm.bench.attention                                  # T = 1024, 2048, 4096
    python -m remat_lm.bench.attention --seqs 1024 --steps 3 --json out/bench/attention.json
    python -m remat_lm.bench.attention --tile_sweep 64,128,256 --shapes 8x256,1x1024   # the default tile
    python -m remat_lm.bench.attention --target h200 --dtype bfloat16 --cores xla,tiled,cudnn
    python -m remat_lm.bench.attention --target v5e --cores xla,tiled,pallas

GPT-2, 8 layers, C=256, 4 heads, B=1, vocabulary 1024, float32 (the reference width at long
sequences). Per T, the settings none / full / selective core_attn, each with `attention="xla"`
(the whole (T, T) scores, `remat_lm.models.attention.xla_causal_attention`) and `attention="tiled"`
(the online-softmax kernel, `remat_lm.models.attention.tiled_causal_attention`, tile `--tile`), are
compiled first and then timed round-robin
(`remat_lm.bench.common.interleaved_ms`), one warm-up step and `--steps` timed ones, the median reported.
A step is jitted `jax.value_and_grad(loss_fn)`; temp is XLA's compiled temp buffer of that step
(`remat.memory.compiled_stats`). The layers run under `lax.scan` (`--no-scan` for the Python
loop): the layer body compiles once, so T=4096 compiles in seconds rather than minutes.
`--target` (a `remat.planning.targets` name) compiles with that target's compiler, no device needed, and adds
the fused kernels to `--cores` (`cudnn` on a GPU, bf16; `pallas` on a TPU); built for a target this
host is not, nothing runs: the step-time columns and the time target are left out.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

from remat_lm.bench import common, policies
from remat_lm.bench.common import MiB, Target, fmt, interleaved_ms, machine, markdown_table, median, targets_markdown, cli
from remat_lm.models.attention import DEFAULT_TILE
from remat import RecomputeConfig
from remat.memory import compiled_stats
from remat_lm.argtypes import Parser, int_list, integer

_REF = common.REFERENCE["gpt2"]
SHAPE = dict(n_layer=_REF["n_layer"], n_embd=_REF["n_embd"], n_head=_REF["n_head"], vocab=_REF["vocab_size"])
SEQS = (1024, 2048, 4096)
SETTINGS = {"none": RecomputeConfig(), "full": RecomputeConfig(granularity="full"),
            "selective core_attn": RecomputeConfig(granularity="selective", modules=("core_attn",))}
CORES = ("xla", "tiled")
KERNELS = {"cuda": "cudnn", "tpu": "pallas"}  # the fused kernel `--cores` may add on that platform


def run(seqs=SEQS, *, batch: int = 1, steps: int = 3, tile: int = DEFAULT_TILE, scan: bool = True,
        n_layer: int = SHAPE["n_layer"], n_embd: int = SHAPE["n_embd"], n_head: int = SHAPE["n_head"],
        vocab: int = SHAPE["vocab"], cores=CORES, dtype: str = "float32", target: str = "cpu", log=None) -> dict:
    """Every (T, setting, core) row, timed per T in one interleaved round-robin.

    Example:
      >>> res = run((64,), n_layer=2, n_embd=32, steps=1, tile=16)
      >>> [(r["setting"], r["attention"]) for r in res["rows"]][:2]
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    info = machine()
    rows = []
    for T in seqs:
        base, _ = policies.build_config("gpt2", "ref", n_layer=n_layer, n_embd=n_embd, n_head=n_head, seq=T,
                                        vocab=vocab)
        base = dataclasses.replace(base, scan_layers=scan, attention_tile=tile, dtype=dtype)
        params, idx, targets = policies.inputs(base, batch, T)
        cases = {}
        for name, rc in SETTINGS.items():
            for core in cores:
                log(f"T={T}: compiling {name} / {core} ...")
                cfg = dataclasses.replace(base, attention=core)
                cases[(name, core)] = policies.prepare("gpt2", cfg, policies.Setting(f"{name} {core}", rc, dtype),
                                                       params, idx, targets, target)
        times = {}
        if common.timed(target):
            log(f"T={T}: timing {len(cases)} settings, {steps} interleaved rounds after 1 warm-up ...")
            times = interleaved_ms({f"{n} {c}": case.step for (n, c), case in cases.items()}, n=steps, warmup=1)
        for (name, core), case in cases.items():
            xla = cases[(name, "xla")]
            ms = median(times[f"{name} {core}"]) if times else None
            xla_ms = median(times[f"{name} xla"]) if times else None
            rows.append(dict(seq=T, setting=name, attention=core, saved_bytes=case.saved, temp_bytes=case.temp,
                             flops=case.flops, step_ms=ms, step_ms_all=times.get(f"{name} {core}"), loss=case.loss,
                             temp_vs_xla=case.temp / xla.temp if xla.temp else None,
                             time_vs_xla=None if ms is None else ms / xla_ms))
    meta = dict(info, batch=batch, steps=steps, tile=tile, scan=scan, seqs=list(seqs), cores=list(cores),
                dtype=dtype, source=common.source(target),
                shape=dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=vocab), command=None)
    return {"meta": meta, "rows": rows, "targets": [dataclasses.asdict(t) for t in evaluate(rows)]}


def tile_sweep(shapes, tiles, *, steps: int = 5, n_head: int = 4, head_dim: int = 64, log=None) -> dict:
    """One attention core's forward + backward (the reference width: 4 heads of 64), per (B, T):
    compiled temp and step time of the xla core and of the tiled core at each tile (rows "tiled t"),
    interleaved.

    Example:
      >>> res = tile_sweep([(1, 64)], [16, 32], steps=1)
    """
    import jax
    import jax.numpy as jnp

    from remat_lm.models import attention
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    info, rows = machine(), []
    for B, T in shapes:
        x = jnp.full((B, T, n_head * head_dim), 0.01, jnp.float32)
        cores = {"xla": lambda q, k, v: attention.xla_causal_attention(q, k, v, n_head, n_head)}
        for t in tiles:
            if t <= T:
                cores[f"tiled {t}"] = functools.partial(
                    lambda q, k, v, t: attention.tiled_causal_attention(q, k, v, n_head, n_head, tile=t), t=t)
        steps_by, temps = {}, {}
        for name, fn in cores.items():
            log(f"B={B} T={T}: compiling {name} ...")
            c = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).sum(), argnums=(0, 1, 2))).lower(x, x, x).compile()
            temps[name] = compiled_stats(c).temp
            steps_by[name] = functools.partial(lambda c: jax.block_until_ready(c(x, x, x)), c)
        times = interleaved_ms(steps_by, n=steps, warmup=1)
        for name in cores:
            rows.append(dict(batch=B, seq=T, core=name, temp_bytes=temps[name], step_ms=median(times[name]),
                             temp_vs_xla=temps[name] / temps["xla"],
                             time_vs_xla=median(times[name]) / median(times["xla"])))
    return {"meta": dict(info, steps=steps, n_head=n_head, head_dim=head_dim, command=None),
            "rows": rows}


def sweep_report(res: dict) -> str:
    m = res["meta"]
    head = (f"One attention layer ({m['n_head']} heads of {m['head_dim']}), forward + backward, float32; median of "
            f"{m['steps']} interleaved steps after 1 warm-up; jax {m['jax']} on {m['backend']} ({m['nproc']} CPUs, "
            f"{common.load_note(m)})")
    body = [[r["batch"], r["seq"], r["core"], fmt(r["temp_bytes"] / MiB, ".1f"), fmt(r["temp_vs_xla"]),
             fmt(r["step_ms"], ".1f"), fmt(r["time_vs_xla"])] for r in res["rows"]]
    return "\n".join([head, "", markdown_table(["B", "T", "core", "temp MiB", "temp × xla", "step ms", "time × xla"],
                                               body)])


def evaluate(rows: list[dict]) -> list[Target]:
    """At the longest T: tiled full-remat temp ≤ 0.5× xla's; tiled no-remat step no slower than xla's."""
    T = max(r["seq"] for r in rows)
    by = {(r["setting"], r["attention"]): r for r in rows if r["seq"] == T}
    full, none = by[("full", "tiled")], by[("none", "tiled")]
    out = [Target(f"T={T}: full-remat compiled temp, tiled ≤ 0.5× xla's",
                  f"{full['temp_bytes'] / MiB:.1f} vs {by[('full', 'xla')]['temp_bytes'] / MiB:.1f} MiB "
                  f"({fmt(full['temp_vs_xla'])}×)", full["temp_vs_xla"] is not None and full["temp_vs_xla"] <= 0.5)]
    if none["time_vs_xla"] is not None:
        out.append(Target(f"T={T}: no-remat step time, tiled ≤ xla's",
                          f"{none['step_ms']:.0f} vs {by[('none', 'xla')]['step_ms']:.0f} ms "
                          f"({none['time_vs_xla']:.2f}×)", none["time_vs_xla"] <= 1.0))
    return out


def report(res: dict) -> str:
    m, s = res["meta"], res["meta"]["shape"]
    src = m.get("source") or common.source("cpu")
    timing = f"; median of {m['steps']} interleaved steps after 1 warm-up" if src["timed"] else ""
    head = (f"GPT-2 {s['n_layer']} layers, C={s['n_embd']}, {s['n_head']} heads, B={m['batch']}, vocab {s['vocab']}, "
            f"{m.get('dtype', 'float32')}, {'scan' if m['scan'] else 'loop'} layers, tile {m['tile']}; "
            f"{common.source_line(src)}{timing}; jax {m['jax']} on {m['backend']} ({m['nproc']} CPUs, "
            f"{common.load_note(m)})")
    body = [[r["seq"], r["setting"], r["attention"], fmt(r["saved_bytes"] / MiB, ".1f"), fmt(r["temp_bytes"] / MiB, ".1f"),
             fmt(r["temp_vs_xla"]), fmt(r["step_ms"], ".0f"), fmt(r["time_vs_xla"]),
             fmt(None if r["flops"] is None else r["flops"] / 1e9, ".1f")]
            for r in res["rows"]]
    table = markdown_table(["T", "setting", "attention", "saved MiB", "temp MiB", "temp × xla", "step ms",
                            "time × xla", "GFLOPs"], body)
    return "\n".join([head, "", table, "", "Targets:", targets_markdown([Target(**t) for t in res["targets"]])])


def _shapes(text: str) -> tuple:
    """`--shapes 8x256,1x1024` → ((8, 256), (1, 1024)): positive BxT pairs."""
    pair = int_list(1, sep="x", example="8x256")
    try:
        shapes = tuple(pair(s) for s in str(text).split(","))
    except argparse.ArgumentTypeError:
        shapes = ()
    if not shapes or any(len(s) != 2 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected positive BxT shapes separated by ',', e.g. 8x256,1x1024; "
                                         f"got {text!r}")
    return shapes


def main(argv=None) -> int:
    p = Parser(prog="python -m remat_lm.bench.attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int_list(1, example="1024,2048"), default=",".join(map(str, SEQS)),
                   help="comma-separated sequence lengths")
    p.add_argument("--batch", type=integer(1), default=1)
    p.add_argument("--steps", type=integer(1), default=3, help="timed interleaved rounds (median reported)")
    p.add_argument("--tile", type=integer(1), default=DEFAULT_TILE, help="the tiled core's query tile")
    p.add_argument("--scan", action=argparse.BooleanOptionalAction, default=True, help="layers under lax.scan")
    for k, v in SHAPE.items():
        p.add_argument(f"--{k}", type=integer(1), default=v)
    p.add_argument("--tile_sweep", type=int_list(1, example="64,128,256"), default=None,
                   help="instead: one attention layer at these tiles, e.g. 64,128,256")
    p.add_argument("--shapes", type=_shapes, default="8x256,1x1024,1x4096", help="with --tile_sweep: BxT shapes")
    p.add_argument("--cores", default=",".join(CORES),
                   help=f"comma-separated, from {', '.join(CORES + tuple(KERNELS.values()))} (xla needed; cudnn with "
                        f"--target on a GPU and --dtype bfloat16, pallas with --target on a TPU)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    p.add_argument("--json", default=None, help="also write meta, rows and targets here")
    common.add_target(p)
    a = p.parse_args(argv)
    if a.tile_sweep:
        tiles, shapes = list(a.tile_sweep), list(a.shapes)
        return common.publish(tile_sweep(shapes, tiles, steps=a.steps), sweep_report,
                              "remat_lm.bench.attention", argv, a.json)
    cores = tuple(c for c in a.cores.split(",") if c)
    from remat.planning import targets as rtargets
    kernel = KERNELS.get(rtargets.get(a.target).platform)
    valid = CORES + ((kernel,) if kernel else ())
    if "xla" not in cores or any(c not in valid for c in cores):
        raise SystemExit(f"--cores {a.cores!r}: give xla and optionally {', '.join(valid[1:])} for --target "
                         f"{a.target}, e.g. --cores {','.join(valid)}")
    if "cudnn" in cores and a.dtype != "bfloat16":
        raise SystemExit("--cores cudnn: cuDNN flash attention computes in bfloat16; add --dtype bfloat16")
    res = run(a.seqs, batch=a.batch, steps=a.steps, tile=a.tile, scan=a.scan, n_layer=a.n_layer, n_embd=a.n_embd,
              n_head=a.n_head, vocab=a.vocab, cores=cores, dtype=a.dtype, target=a.target)
    return common.publish(res, report, "remat_lm.bench.attention", argv, a.json)


if __name__ == "__main__":
    sys.exit(cli(main, "attention"))
