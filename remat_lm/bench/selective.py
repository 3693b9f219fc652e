"""The compiled temp of the gradient for every selective preset, loop and scan layouts, by a target's
compiler: the reference models (remat_lm.bench.common.REFERENCE), compiled, not run.

    python -m remat_lm.bench.selective --target h200 --json out/selective_h200.json

Rows: none, full, selective core_attn / mlp / norm / core_attn+mlp / core_attn+mlp+norm, policies
dots and dots_no_batch, in the loop and the scan layout; uniform 2 and block 4 (loop); none and full
in bfloat16 with the platform's attention (`auto`), loop and scan. Each row is
`remat_lm.bench.peaks.measure` (device temp), compared with none of its layout.
"""
from __future__ import annotations

import sys

from remat import RecomputeConfig
from remat.memory import MiB
from remat.planning import targets
from remat_lm.argtypes import Parser
from remat_lm.bench import common, peaks

__all__ = ["settings", "run", "main"]

_PRESETS = (("none", RecomputeConfig()), ("full", RecomputeConfig(granularity="full")),
            *((f"selective {'+'.join(m)}", RecomputeConfig(granularity="selective", modules=m))
              for m in (("core_attn",), ("mlp",), ("norm",), ("core_attn", "mlp"), ("core_attn", "mlp", "norm"))),
            *((f"selective {p}", RecomputeConfig(granularity="selective", policy=p)) for p in ("dots", "dots_no_batch")))


def settings() -> list[peaks.Setting]:
    """Every row, as `remat_lm.bench.peaks.Setting`s (row key: `peaks.key`)."""
    out = []
    for layout, over in (("loop", ()), ("scan", (("scan_layers", True),))):
        base = "none" if layout == "loop" else "none scan"
        out += [peaks.Setting(name, layout, rc, base, over) for name, rc in _PRESETS]
        if layout == "loop":
            out += [peaks.Setting("uniform 2", "loop", RecomputeConfig(granularity="full", method="uniform", num_layers=2)),
                    peaks.Setting("block 4", "loop", RecomputeConfig(granularity="full", method="block", num_layers=4))]
    for group, over in (("bf16", (("dtype", "bfloat16"),)), ("bf16 scan", (("dtype", "bfloat16"), ("scan_layers", True)))):
        out += [peaks.Setting(name, group, rc, f"none {group}", over) for name, rc in _PRESETS[:2]]
    return out


def run(target: str, models=peaks.MODELS, rows=None, log=None) -> dict:
    """Measure every row (only the keys in `rows` when given) of each model for `target`."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = []
    for model in models:
        by = {}
        for s in settings():
            if rows and peaks.key(s) not in rows:
                continue
            r = peaks.measure(model, s, target)
            by[r["row"]] = r
            base = by.get(r["base"])
            r["ratio"] = r["temp"] / base["temp"] if base and base["temp"] else None
            out.append(r)
            log(f"{model} {r['row']}: temp {r['temp'] / MiB:.1f} MiB ({r['seconds']:.1f} s)")
    return {"meta": dict(common.machine(), source=common.source(target), models=list(models), command=None),
            "rows": out}


def report(res: dict) -> str:
    body = [[r["model"], r["row"], common.fmt(r["temp"] / MiB, ".1f"), common.fmt(r["ratio"])] for r in res["rows"]]
    return common.markdown_table(["model", "row", "temp MiB", "× none"], body)


def main(argv=None) -> int:
    p = Parser(prog="python -m remat_lm.bench.selective", description=__doc__.splitlines()[0])
    common.add_target(p)
    p.add_argument("--models", default="gpt2", help="comma-separated, of gpt2, llama3 (default gpt2)")
    p.add_argument("--rows", default=None, help="semicolon-separated row keys (e.g. 'none;full scan'): only these")
    p.add_argument("--json", default=None, help="also write meta and rows here")
    a = p.parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    if not models or set(models) - set(peaks.MODELS):
        p.error(f"--models: use some of {', '.join(peaks.MODELS)}")
    targets.get(a.target)
    rows = None if a.rows is None else {r.strip() for r in a.rows.split(";") if r.strip()}
    return common.publish(run(a.target, models, rows), report, "remat_lm.bench.selective", argv, a.json)


if __name__ == "__main__":
    sys.exit(common.cli(main, "selective"))
