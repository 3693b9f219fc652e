"""The planner's front on a target: plans per tag for budgets between full remat's and no remat's
compiled peaks, with the baselines priced and compiled the same way, as JSON and a plot.

    python -m remat_lm.bench.planner --target h200 --model gpt2 --preset d12 --batch_size 8 \
        --sequence_length 1024 --dtype bfloat16 --json out/front_d12.json
    python -m remat_lm.bench.planner --target h200x8 --mesh fsdp=8 --model llama3 --preset 8b \
        --batch_size 8 --sequence_length 8192 --dtype bfloat16 --json out/front_8b.json
    python -m remat_lm.bench.planner --target cpu --time_steps 7 --json out/front_cpu.json

The step is train.py's (`remat_lm.training`: forward, backward, AdamW update) built for the
target's compile-only devices, layers under `lax.scan`; with `--target cpu` it is the compiled
`value_and_grad` of the loss on this host (GPT-2 reference shape unless given), and `--time_steps`
times every plan and baseline that fits the largest budget in one process, interleaved
(remat_lm.bench.common.interleaved_ms), to check the predicted order against the measured one.

JSON: `front` (each: budget_bytes, plan, compiled_peak_bytes, predicted_peak_bytes,
predicted_step_s, notes), `baselines` (each: name — none, full, "uniform N", "block N", the preset
names, greedy (one per budget, with its budget_bytes) — compiled_peak_bytes, predicted_step_s),
`checks` (the acceptance checks of docs/planner.md), `planning_s`, `compiles`, `model`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax

import remat
import remat.planning.targets
from remat.planning import tagplan
from remat.memory import compiled_stats, format_bytes
from remat.planning.planner import front
from remat_lm.argtypes import Parser, integer

MiB, GiB = 2 ** 20, 2 ** 30
MEGATRON = ("uniform", "block", "full")


def _hooks_train(args):
    """(compile_step, trace_step, n_layers, target, runner=None) for train.py's step on an accelerator."""
    from remat_lm.training import compile as cc
    from remat_lm.training.config import TrainConfig
    from remat_lm.training.prepare import prepare

    kw = dict(model=args.model, preset=args.preset, batch_size=args.batch_size, sequence_length=args.sequence_length,
              dtype=args.dtype, target=args.target, scan_layers=True, dry_run=True, mesh=args.mesh)
    setup = prepare(TrainConfig(**{k: v for k, v in kw.items() if v is not None}))
    base = setup.base_mcfg
    cs = lambda rc: cc.step_stats(setup, dataclasses.replace(base, recompute=rc))
    ts = lambda rc: cc.step_jaxpr(setup, dataclasses.replace(base, recompute=rc))
    return cs, ts, base.n_layer, setup.target, None


def _hooks_cpu(args):
    """The same for the host: the loss's value_and_grad, compiled by XLA:CPU, runnable."""
    from remat_lm.bench.common import REFERENCE_BATCH, reference_config
    from remat_lm.models import family

    fam = family.get(args.model)
    over = {k: v for k, v in (("dtype", args.dtype),) if v}
    cfg0 = (reference_config(args.model, **over) if args.preset is None
            else fam.config_cls.preset(args.preset, **over))
    if args.sequence_length:
        cfg0 = dataclasses.replace(cfg0, block_size=max(cfg0.block_size, args.sequence_length))
    cfg0 = dataclasses.replace(cfg0, scan_layers=True)
    B, T = args.batch_size or REFERENCE_BATCH, args.sequence_length or cfg0.block_size
    params = fam.init_params(cfg0, jax.random.PRNGKey(0))
    V = cfg0.vocab_size
    idx = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, V)
    tgt = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, V)
    compiled = {}

    def fn(rc):
        cfg = dataclasses.replace(cfg0, recompute=rc)
        return jax.jit(jax.value_and_grad(lambda p, x, y: fam.loss_fn(p, cfg, x, y)))

    def cs(rc):
        if rc not in compiled:
            compiled[rc] = fn(rc).lower(params, idx, tgt).compile()
        return compiled[rc]

    ts = lambda rc: fn(rc).trace(params, idx, tgt).jaxpr
    run = lambda rc: (lambda c=cs(rc): jax.block_until_ready(c(params, idx, tgt)))
    return cs, ts, cfg0.n_layer, remat.planning.targets.get("cpu"), run


def parser() -> Parser:
    """The command line of the per-tag front (`python -m remat_lm.bench.planner --target NAME ...`)."""
    ap = Parser(prog="python -m remat_lm.bench.planner", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="a remat.planning.targets name: h200, h200x8, v5e, cpu, ...")
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama3"))
    ap.add_argument("--preset", default=None, help="model preset (default: d12 on an accelerator, the bench "
                    "reference shape on cpu)")
    ap.add_argument("--batch_size", type=integer(1), default=None, help="micro-batch (global, over the mesh)")
    ap.add_argument("--sequence_length", type=integer(1), default=None)
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    ap.add_argument("--mesh", default=None, help="train.py's --mesh, e.g. fsdp=8")
    ap.add_argument("--budgets", type=integer(1), default=5, help="budgets between full's and none's peaks")
    ap.add_argument("--time_steps", type=integer(0), default=0, help="cpu only: timed rounds per program (0: none)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write the front's plot (PNG) here (default: beside --json)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.target != "cpu" and args.time_steps:
        ap.error("--time_steps measures on this host; use it with --target cpu")
    load = os.getloadavg()[0]
    if args.target == "cpu":
        cs, ts, L, target, run = _hooks_cpu(args)
    else:
        args.preset = args.preset or "d12"
        cs, ts, L, target, run = _hooks_train(args)
    say = lambda s: print(f"  {s}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    measured: dict = {}
    f0 = front(cs, ts, L, [], target=target, log=say, measured=measured)
    model = f0.model
    pk = lambda cm: cm.peak_estimate
    p_none, p_full = pk(measured[(None,) * L]), model.p_full
    t_cal = time.perf_counter() - t0
    budgets = [int(p_full + k * (p_none - p_full) / (args.budgets + 1)) for k in range(1, args.budgets + 1)]
    f = front(cs, ts, L, budgets, target=target, log=say, model=model, measured=measured)
    t_plan = time.perf_counter() - t0
    print(f"planning: {t_plan:.0f} s, {f0.compiles + f.compiles} compilations", file=sys.stderr, flush=True)

    res = {"command": "python -m remat_lm.bench.planner " + " ".join(argv if argv is not None else sys.argv[1:]),
           "target": target.name, "compiler": target.compiler, "n_layers": L, "load_average": load,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "planning_s": t_plan,
           "full_peak_bytes": p_full, "none_peak_bytes": p_none, "model": dataclasses.asdict(model)}

    def save(rows, base_rows, partial):
        """Write what is known so far (a long run leaves its front even when stopped)."""
        res.update(front=rows, baselines=base_rows, compiles=len(measured), partial=partial)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1, default=str)

    # train.py's step is planned with its layers under scan (_hooks_train, _hooks_cpu): the plan text says so
    row = lambda p: {"budget_bytes": p.budget, "plan": dataclasses.replace(p, scan=True).text,
                     "compiled_peak_bytes": p.compiled_peak,
                     "predicted_peak_bytes": p.predicted_peak, "predicted_step_s": p.predicted_step_s,
                     "notes": list(p.notes)}
    save([row(p) for p in f.plans], [], True)
    # Baselines, compiled and priced the same way (Megatron's first: the middle-budget check needs them).
    base_rows, rcs = [], {}
    full_step = model.predict((remat.policies.NOTHING,) * L)[1]
    plans0 = tagplan.baseline_plans(L)
    order = sorted(plans0, key=lambda n: (n.split()[0] not in ("none", "full", "block", "uniform"), n))
    for name in order:
        rc = plans0[name]
        lp = tagplan.config_policies(rc, L)
        if lp is not None:
            cm = measured.get(lp) or compiled_stats(cs(rc))
            measured.setdefault(lp, cm)
            step = model.predict(lp)[1]
        else:   # multi-layer regions: every layer's forward rerun, as full remat
            cm, step = compiled_stats(cs(rc)), full_step
        say(f"baseline {name}: peak {format_bytes(pk(cm))}")
        rcs[name] = rc
        base_rows.append({"name": name, "compiled_peak_bytes": pk(cm), "predicted_step_s": step})
        save([row(p) for p in f.plans], base_rows, True)
    measure = lambda lp: pk(measured.get(tuple(lp)) or measured.setdefault(
        tuple(lp), compiled_stats(cs(tagplan.recompute_config(lp)))))
    greedy = {}
    for b in budgets:
        lp, steps = tagplan.greedy(model, b, measure)
        greedy[b] = lp
        base_rows.append({"name": "greedy", "budget_bytes": b, "plan": tagplan.format_plan(lp, scan=True), "steps": steps,
                          "compiled_peak_bytes": measure(lp), "predicted_step_s": model.predict(lp)[1]})
        rcs[f"greedy {b}"] = tagplan.recompute_config(lp)
    # the front again with every baseline known: a fitting baseline predicted faster is taken
    known = {lp: cm for lp, cm in measured.items() if len(lp) == L}
    f = front(cs, ts, L, budgets, target=target, log=say, model=model, measured=measured, known=known)
    rows = [row(p) for p in f.plans]
    res["checks"] = checks = _checks(rows, base_rows, p_full, p_none, model)
    if run is not None and args.time_steps:
        res["timing"] = _time(run, rows, base_rows, rcs, max(budgets), args.time_steps)
    for c in checks:
        print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['what']}: {c['value']}")
    for r in rows:
        print(f"budget {r['budget_bytes'] / GiB:.3f} GiB: peak {r['compiled_peak_bytes'] / GiB:.3f} GiB, "
              f"predicted {r['predicted_step_s'] * 1e3:.3f} ms  plan: {r['plan']}")
    save(rows, base_rows, False)
    png = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if png:
        plot(res, png)
    return 0


def _checks(rows, base, p_full, p_none, model) -> list:
    out = []
    inside = [r for r in rows if p_full < r["budget_bytes"] < p_none]
    out.append({"what": "budgets strictly between full's and none's compiled peaks", "value": len(inside),
                "ok": len(inside) >= 5})
    over = [r for r in rows if r["compiled_peak_bytes"] > r["budget_bytes"]]
    out.append({"what": "plans whose compiled peak exceeds the budget", "value": len(over), "ok": not over})
    steps = [r["predicted_step_s"] for r in rows]
    out.append({"what": "front monotone (predicted step never rises with the budget)",
                "value": all(b <= a + 1e-12 for a, b in zip(steps, steps[1:])), "ok": all(
                    b <= a + 1e-12 for a, b in zip(steps, steps[1:]))})
    faster = []
    for r in rows:
        for b in base:
            if b["compiled_peak_bytes"] <= r["budget_bytes"] and b["predicted_step_s"] < r["predicted_step_s"] - 1e-12:
                faster.append(f"{b['name']} at {r['budget_bytes'] / GiB:.3f} GiB")
    out.append({"what": "fitting baselines predicted faster than the plan", "value": faster or 0, "ok": not faster})
    mid = rows[len(rows) // 2]
    none_s = next(b["predicted_step_s"] for b in base if b["name"] == "none")
    meg = [b for b in base if b["name"].split()[0] in MEGATRON and b["compiled_peak_bytes"] <= mid["budget_bytes"]]
    best = min(meg, key=lambda b: b["predicted_step_s"])
    ratio = (mid["predicted_step_s"] - none_s) / max(best["predicted_step_s"] - none_s, 1e-15)
    out.append({"what": f"middle budget {mid['budget_bytes'] / GiB:.3f} GiB: the plan's recompute overhead over "
                        f"that of the best fitting Megatron setting ({best['name']})", "value": round(ratio, 3),
                "ok": ratio <= 0.9, "plan": mid["plan"], "plan_overhead_s": mid["predicted_step_s"] - none_s,
                "megatron": best["name"], "megatron_overhead_s": best["predicted_step_s"] - none_s})
    return out


def _time(run, rows, base, rcs, top, n) -> dict:
    """Measured ms (median of n interleaved rounds) of every front plan and fitting baseline; whether
    the predicted and measured orders agree (Kendall's tau over the pairs)."""
    from scipy.stats import kendalltau

    from remat_lm.bench.common import interleaved_ms, median

    progs = {}
    for r in rows:
        progs[f"plan {r['budget_bytes']}"] = (tagplan.recompute_config(tagplan.parse_plan(r["plan"])),
                                              r["predicted_step_s"])
    for b in base:
        if b["compiled_peak_bytes"] <= top and b["name"] != "greedy":
            progs[b["name"]] = (rcs[b["name"]], b["predicted_step_s"])
    fns = {k: run(rc) for k, (rc, _) in progs.items()}
    ms = interleaved_ms(fns, n=n, warmup=1)
    med = {k: median(v) for k, v in ms.items()}
    names = list(progs)
    tau = kendalltau([progs[k][1] for k in names], [med[k] for k in names])
    return {"ms": med, "samples": ms, "predicted_s": {k: progs[k][1] for k in names},
            "kendall_tau": float(tau.statistic), "p_value": float(tau.pvalue), "rounds": n,
            "load_average_end": os.getloadavg()[0]}


def plot(res: dict, path: str) -> None:
    """The front (compiled peak against predicted step) with the baselines, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    fr = res["front"]
    ax.plot([r["compiled_peak_bytes"] / GiB for r in fr], [r["predicted_step_s"] * 1e3 for r in fr], "o-",
            color="C3", lw=2, label="planner (per tag)", zorder=3)
    for b in [r["budget_bytes"] / GiB for r in fr]:
        ax.axvline(b, color="C3", alpha=0.15, lw=1)
    groups = {"uniform": ("s", "C0"), "block": ("^", "C1"), "greedy": ("D", "C2")}
    seen = set()
    for b in res["baselines"]:
        kind = b["name"].split()[0]
        marker, color = groups.get(kind, ("x", "C7") if kind not in ("none", "full") else ("*", "k"))
        label = kind if kind in groups else ("none / full" if kind in ("none", "full") else "selective presets")
        ax.plot(b["compiled_peak_bytes"] / GiB, b["predicted_step_s"] * 1e3, marker, color=color, alpha=0.8,
                label=None if label in seen else label)
        seen.add(label)
        if kind in ("none", "full"):
            ax.annotate(kind, (b["compiled_peak_bytes"] / GiB, b["predicted_step_s"] * 1e3), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
    # the y range of the front and the hand settings; slower points (greedy's offloads) are drawn at the top
    ys = [r["predicted_step_s"] * 1e3 for r in fr] + [b["predicted_step_s"] * 1e3 for b in res["baselines"]
                                                       if b["name"] != "greedy"]
    lo, hi = min(ys), max(ys)
    top = hi + 0.15 * (hi - lo)
    off = [b for b in res["baselines"] if b["predicted_step_s"] * 1e3 > top]
    if off:
        ax.set_ylim(lo - 0.05 * (hi - lo), top)
        for b in off:
            ax.annotate(f"{b['predicted_step_s'] * 1e3:.0f} ms", (b["compiled_peak_bytes"] / GiB, top), fontsize=7,
                        xytext=(0, -10), textcoords="offset points", ha="center", color="C2", annotation_clip=False)
            ax.plot(b["compiled_peak_bytes"] / GiB, top, "D", color="C2", clip_on=False)
    ax.set_xlabel(f"compiled peak per device, GiB ({res['compiler']}, {res['target']})")
    ax.set_ylabel("predicted step, ms (roofline)")
    ax.set_title(f"recompute plans against the memory budget ({res['n_layers']} layers)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    from remat_lm.bench.common import cli
    sys.exit(cli(main, "planner"))
