"""The compiled peak of the gradient per remat setting, by the compiler of a target: GPT-2 and LLaMA-3
at the reference shape, compiled (not run) for this host, an H200 or a TPU v5e.

    python -m remat_lm.bench.peaks                          # XLA:CPU, this host
    python -m remat_lm.bench.peaks --target h200 --json out/peaks_h200.json
    python -m remat_lm.bench.peaks --target v5e --json out/peaks_v5e.json
    python -m remat_lm.bench.peaks --merge out/peaks_cpu.json out/peaks_h200.json out/peaks_v5e.json

Each row is XLA's memory analysis of `jax.grad` of the model's loss (`remat_lm.bench.offload.gradient`)
compiled by the target's compiler (`remat_lm.bench.common.compile_for`): device temp, host bytes,
and the ratio to the row it is compared with (`base`). The rows, float32 unless named:
  loop layers: none, full, uniform 2, block 4, selective core_attn, core_attn+mlp, full + loss_chunk 64;
  scan layers: none, full;
  attention, bf16: none and full with the tiled core, and with the platform's fused kernel (cudnn on a
    GPU, pallas on a TPU; XLA:CPU has none);
  offload, bf16 (the bench's offload rows): full remat saving `qkv,mlp_up` on the device, offloading them
    (`offload_names`), and the layer inputs in host memory (`offload_inputs`), each against full;
  sharded saved inputs: full remat on 4 devices (h200x4, v5e:2x2, cpux4: mesh data=2 x fsdp=2, batch
    over data), region inputs kept whole, then split along T over fsdp (`shard_inputs`).
`--merge` prints the runs of several targets as one table, a column per compiler.

# NOTE: XLA:TPU places small buffers in the TPU core's VMEM (128 MiB on a v5e) and its
# `temp_size_in_bytes` counts HBM only: a program whose temp fits there reads 0.0 MiB. Run with
# LIBTPU_INIT_ARGS=--xla_vf_vmem_memory_space_assignment=false (in a fresh process: libtpu reads it
# when it loads) for the temp with nothing placed in VMEM; the run records the variable it ran under.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts: cpux4
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from remat import RecomputeConfig  # noqa: E402
from remat.planning import targets
from remat.memory import MiB, compiled_stats  # noqa: E402
from remat_lm.argtypes import Parser, integer  # noqa: E402
from remat_lm.bench import common, offload  # noqa: E402
from remat_lm.models import family  # noqa: E402

MODELS = ("gpt2", "llama3")
KERNEL = {"cuda": "cudnn", "tpu": "pallas"}  # the platform's fused attention kernel
MESH = {"data": 2, "fsdp": 2}
FULL = RecomputeConfig(granularity="full")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row: a recompute config and model overrides, compared with the row whose `key` is `base`;
    `mesh`: compiled on the 4-device target (`mesh_target`), batch over data."""
    name: str
    group: str
    recompute: RecomputeConfig
    base: str = "none"
    overrides: tuple = ()
    mesh: bool = False


def settings(platform: str, n_layer: int = common.REFERENCE["gpt2"]["n_layer"]) -> list[Setting]:
    """The rows for a target of `platform` (no fused-kernel rows on cpu); block L/2 of `n_layer`."""
    sel = lambda *m: RecomputeConfig(granularity="selective", modules=m)  # noqa: E731
    bf16 = (("dtype", "bfloat16"),)
    out = [
        Setting("none", "loop", RecomputeConfig()),
        Setting("full", "loop", FULL),
        Setting("uniform 2", "loop", RecomputeConfig(granularity="full", method="uniform", num_layers=2)),
        Setting(f"block {max(1, n_layer // 2)}", "loop",
                RecomputeConfig(granularity="full", method="block", num_layers=max(1, n_layer // 2))),
        Setting("selective core_attn", "loop", sel("core_attn")),
        Setting("selective core_attn+mlp", "loop", sel("core_attn", "mlp")),
        Setting("full + loss_chunk 64", "loop", FULL, "full", (("loss_chunk", 64),)),
        Setting("none", "scan", RecomputeConfig(), "none scan", (("scan_layers", True),)),
        Setting("full", "scan", FULL, "none scan", (("scan_layers", True),)),
    ]
    cores = ["tiled"] + ([KERNEL[platform]] if platform in KERNEL else [])
    for rc_name, rc in (("none", RecomputeConfig()), ("full", FULL)):
        for core in cores:
            out.append(Setting(f"{rc_name}, {core}", "attention bf16", rc, f"{rc_name}, tiled attention bf16",
                               bf16 + (("attention", core),)))
    for name in ("full", "save_names", "offload_names", "offload_inputs"):
        out.append(Setting(name if name == "full" else f"full + {name}", "offload bf16", offload.SETTINGS[name],
                           "full offload bf16", bf16))
    out += [Setting("full", "sharded", FULL, "full sharded", mesh=True),
            Setting("full + shard_inputs fsdp", "sharded", RecomputeConfig(granularity="full", shard_inputs="fsdp"),
                    "full sharded", mesh=True)]
    return out


def key(s: Setting) -> str:
    """A row's name within its model: `full scan`, `none, cudnn attention bf16`, ..."""
    return s.name if s.group == "loop" else f"{s.name} {s.group}"


def mesh_target(target: str) -> str:
    """The 4-device target of the sharded rows: h200 -> h200x4, v5e -> v5e:2x2, cpu -> cpux4."""
    t = targets.get(target)
    if t.platform == "cpu":
        return "cpux4"
    return f"{t.spec.kind}x4" if t.platform == "cuda" else f"{t.spec.kind}:2x2"


def measure(model: str, s: Setting, target: str, *, batch: int = common.REFERENCE_BATCH, seq: int | None = None,
            **shape) -> dict:
    """Compile the gradient of one row for `target` and read XLA's memory analysis.

    `seq` (default the reference block size) and `shape` (model config fields: n_layer, n_embd, ...)
    change the reference shape; tests/test_target_peaks.py takes tiny ones.
    """
    seq = seq or common.REFERENCE[model]["block_size"]
    mcfg = common.reference_config(model, **{**shape, "block_size": seq, "recompute": s.recompute,
                                             **dict(s.overrides)})
    fn, args = offload.gradient(mcfg, batch, seq)
    t0 = time.perf_counter()
    if s.mesh:
        where = mesh_target(target)
        compiled = common.compile_for(fn, *args, target=where, mesh=MESH, specs=(P(), P("data"), P("data")))
    else:
        where = target
        compiled = common.compile_for(fn, *args, target=target)
    cm = compiled_stats(compiled)
    return dict(model=model, row=key(s), group=s.group, setting=s.name, base=s.base, target=where, temp=cm.temp,
                host=cm.host_temp + cm.host_argument + cm.host_output, seconds=time.perf_counter() - t0)


def run(target: str = "cpu", models=MODELS, *, batch: int = common.REFERENCE_BATCH, seq: int | None = None,
        groups=None, rows=None, shape=None, log=None) -> dict:
    """Every row of `settings` for each model (only `groups` / row keys `rows` when given), the
    reference shape changed by `seq` and `shape` (config fields); ratios to each row's base.

    Example:
      >>> res = run("cpu", ("gpt2",), groups=("scan",))
      >>> [r["row"] for r in res["rows"]]
      ['none scan', 'full scan']
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t = targets.get(target)
    shape = dict(shape or {})
    wanted, out = rows, []
    for model in models:
        by = {}
        for s in settings(t.platform, shape.get("n_layer", common.REFERENCE[model]["n_layer"])):
            if groups and s.group not in groups or wanted and key(s) not in wanted:
                continue
            r = measure(model, s, t.name, batch=batch, seq=seq, **shape)
            by[r["row"]] = r
            base = by.get(r["base"])
            r["ratio"] = r["temp"] / base["temp"] if base and base["temp"] else None
            out.append(r)
            log(f"{model} {r['row']}: temp {r['temp'] / MiB:.1f} MiB, host {r['host'] / MiB:.1f} MiB "
                f"({r['seconds']:.1f} s)")
    meta = dict(common.machine(), source=common.source(t.name), models=list(models), batch=batch, seq=seq,
                shape=shape, mesh=MESH, mesh_target=mesh_target(t.name), command=None)
    return {"meta": meta, "rows": out}


def _mib(x) -> str:
    return common.fmt(None if x is None else x / MiB, ".1f")


def report(res: dict) -> str:
    m = res["meta"]
    changed = {**m.get("shape", {}), **({"seq": m["seq"]} if m.get("seq") else {})}
    head = (f"jax.grad of the loss at the reference shape (B={m['batch']}{', ' if changed else ''}"
            f"{', '.join(f'{k}={v}' for k, v in changed.items())}), {common.source_line(m['source'])}; "
            f"sharded rows on {m['mesh_target']} (mesh {m['mesh']}); {m['date']}, jax {m['jax']}")
    body = [[r["model"], r["group"], r["setting"], _mib(r["temp"]), common.fmt(r["ratio"]), r["base"],
             _mib(r["host"]), common.fmt(r["seconds"], ".1f")] for r in res["rows"]]
    return "\n".join([head, "", common.markdown_table(
        ["model", "group", "setting", "temp MiB", "× base", "base", "host MiB", "compile s"], body)])


def merge(runs: list[dict]) -> str:
    """One table of several runs (one per target): temp MiB and × base per compiler."""
    by_source = {}
    for r in runs:  # runs of one target (e.g. one per model) make one column
        src = r["meta"]["source"]
        col = f"{src['compiler']} {src['target']}" + (" (no VMEM)" if "vmem_memory_space_assignment=false" in
                                                     src.get("libtpu_args", "") else "")
        if col in by_source:
            by_source[col] = {"meta": by_source[col]["meta"], "rows": by_source[col]["rows"] + r["rows"]}
        else:
            by_source[col] = r
    cols, runs = list(by_source), list(by_source.values())
    keys = []
    for r in runs:
        keys += [(x["model"], x["row"]) for x in r["rows"] if (x["model"], x["row"]) not in keys]
    groups, first = list(dict.fromkeys(s.group for s in settings("cuda"))), list(keys)
    order = lambda k: (MODELS.index(k[0]) if k[0] in MODELS else len(MODELS),  # noqa: E731
                       next((groups.index(g) for g in groups if k[1] == g or k[1].endswith(" " + g)), 0),
                       "pallas" in k[1], first.index(k))
    keys.sort(key=order)
    index = [{(x["model"], x["row"]): x for x in r["rows"]} for r in runs]
    header = ["model", "row", "base"] + [f"{c}: temp MiB (× base)" for c in cols]
    body = []
    for k in keys:
        base = next(ix[k]["base"] for ix in index if k in ix)
        cells = [f"{_mib(ix[k]['temp'])} ({common.fmt(ix[k]['ratio'])})" if k in ix else "—" for ix in index]
        body.append([k[0], k[1], base, *cells])
    dates = ", ".join(f"{c}: {r['meta']['date']}" for c, r in zip(cols, runs))
    return "\n".join([common.markdown_table(header, body), "", f"Runs: {dates}."])


def _shape(text: str) -> dict:
    """`--shape n_layer=4,n_embd=64` -> {"n_layer": 4, "n_embd": 64}: positive ints."""
    out = {}
    for part in str(text).split(","):
        k, _, v = part.partition("=")
        if not k.strip() or not v.strip().isascii() or not v.strip().isdigit() or int(v) < 1:
            raise argparse.ArgumentTypeError(f"expected name=N pairs separated by ',' (N a positive integer), "
                                             f"e.g. n_layer=4,n_embd=64; got {text!r}")
        out[k.strip()] = int(v)
    return out


def main(argv=None) -> int:
    p = Parser(prog="python -m remat_lm.bench.peaks", description=__doc__.split("\n\n")[0])
    common.add_target(p)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--groups", default=None, help="comma-separated: loop, scan, attention bf16, offload bf16, sharded")
    p.add_argument("--rows", default=None, help="comma-separated row names (e.g. none,full,full scan): only these")
    p.add_argument("--batch", type=integer(1), default=common.REFERENCE_BATCH)
    p.add_argument("--seq", type=integer(1), default=None, help="sequence length (default the reference 256)")
    p.add_argument("--shape", type=_shape, default=None, help="config fields changed, e.g. n_layer=4,n_embd=64")
    p.add_argument("--json", default=None, help="also write meta and rows here")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="instead: one table of these runs")
    a = p.parse_args(argv)
    if a.merge:
        runs = []
        for path in a.merge:
            try:
                with open(path) as f:
                    runs.append(json.load(f))
            except (OSError, ValueError) as e:
                raise SystemExit(f"--merge {path}: cannot read a peaks JSON ({e}); write one with --json")
        print(merge(runs))
        return 0
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        p.error(f"--models: unknown {', '.join(bad) or 'empty'}; use {', '.join(MODELS)}")
    for m in models:
        fields = {f.name for f in dataclasses.fields(family.get(m).config_cls)}
        unknown = sorted(set(a.shape or {}) - fields)
        if unknown:
            p.error(f"--shape: {', '.join(unknown)} is not a {family.get(m).config_cls.__name__} field; "
                    f"use e.g. n_layer=4,n_embd=64")
    groups = None if a.groups is None else tuple(g.strip() for g in a.groups.split(",") if g.strip())
    known = {s.group for s in settings("cuda")}
    if groups is not None and (not groups or set(groups) - known):
        p.error(f"--groups: use some of {', '.join(sorted(known))}")
    rows = None if a.rows is None else tuple(r.strip() for r in a.rows.split(",") if r.strip())
    names = {key(s) for pl in ("cpu", "cuda", "tpu") for s in settings(pl, (a.shape or {}).get("n_layer", 8))}
    if rows is not None and (not rows or set(rows) - names):
        p.error(f"--rows: unknown {', '.join(sorted(set(rows) - names)) or 'empty'}; rows are named as the "
                f"report's (none, full, full scan, full + offload_names offload bf16, ...)")
    res = run(a.target, models, batch=a.batch, seq=a.seq, groups=groups, rows=rows, shape=a.shape)
    return common.publish(res, report, "remat_lm.bench.peaks", argv, a.json)


if __name__ == "__main__":
    sys.exit(common.cli(main, "peaks"))
