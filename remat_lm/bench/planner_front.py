"""The planner's front on a target: plans per tag for budgets between full remat's and no remat's
compiled peaks, and beside it the hand settings (never fed to the planner), as JSON and a plot.

    python -m remat_lm.bench.planner --target h200 --model gpt2 --preset d12 --batch_size 8 \
        --sequence_length 1024 --dtype bfloat16 --json out/front_d12.json
    python -m remat_lm.bench.planner --target h200x8 --mesh fsdp=8 --model llama3 --preset 8b \
        --batch_size 8 --sequence_length 8192 --dtype bfloat16 --json out/front_8b.json
    python -m remat_lm.bench.planner --target cpu --batch_size 4 --sequence_length 256 --dtype float32 \
        --budgets 5 --validate --json out/validate_cpu.json

Where the target is this machine (`cpu`, or the GPU the bench runs on) the step is the compiled
`value_and_grad` of the loss here (GPT-2 reference shape unless --preset) and the planner measures
its step times; elsewhere it is train.py's step (`remat_lm.training`: forward, backward, AdamW
update) built for the target's compile-only devices, priced from the target compiler's optimized
programs. Layers are under `lax.scan` either way. `--validate` times every plan and hand setting
interleaved in one process, with a second compilation of no remat as the noise floor.

JSON: `front` (each: budget_bytes, plan, compiled_peak_bytes, predicted_peak_bytes,
predicted_step_s, notes), `baselines` (each: name as train.py spells it — none, full, "uniform N",
"block N", "selective MODULES", greedy (one per budget) — compiled_peak_bytes, predicted_step_s),
`checks` (docs/planner.md), `planning_s`, `compiles`, `model`, `time_source`, `spread_s`; with
--validate, `validation`: `settings` (name, predicted_step_s, measured_step_s (median),
measured_iqr_s, compiled_peak_bytes, same_program_as), `noise_floor_s`, `kendall_tau`,
`concordance` (on the pairs whose measured difference exceeds the noise floor), `checks`.
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


@dataclasses.dataclass
class Hooks:
    """What the bench needs of a model: compile / trace a step per RecomputeConfig, the layer count,
    the target; `run(rc)` and `fresh(rc)` (a second compilation of the same program) where the step
    runs on this machine, else None."""
    compile: object
    trace: object
    n_layers: int
    target: object
    run: object = None
    fresh: object = None


def _hooks_train(args) -> Hooks:
    """train.py's step built for the target's compile-only devices (nothing runs)."""
    from remat_lm.training import compile as cc
    from remat_lm.training.config import TrainConfig
    from remat_lm.training.prepare import prepare

    kw = dict(model=args.model, preset=args.preset, batch_size=args.batch_size, sequence_length=args.sequence_length,
              dtype=args.dtype, target=args.target, scan_layers=True, dry_run=True, mesh=args.mesh)
    setup = prepare(TrainConfig(**{k: v for k, v in kw.items() if v is not None}))
    base = setup.base_mcfg
    cs = lambda rc: cc.step_stats(setup, dataclasses.replace(base, recompute=rc))
    ts = lambda rc: cc.step_jaxpr(setup, dataclasses.replace(base, recompute=rc))
    return Hooks(cs, ts, base.n_layer, setup.target)


def _hooks_local(args) -> Hooks:
    """The loss's value_and_grad on this machine's default device (the bench's reference GPT-2
    unless --preset), compiled and runnable: the planner measures its step times."""
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
    fresh = lambda rc: (lambda c=fn(rc).lower(params, idx, tgt).compile(): jax.block_until_ready(c(params, idx, tgt)))
    target = remat.planning.targets.get(args.target)
    return Hooks(cs, ts, cfg0.n_layer, target, run, fresh)


def parser() -> Parser:
    """The command line of the per-tag front (`python -m remat_lm.bench.planner --target NAME ...`)."""
    ap = Parser(prog="python -m remat_lm.bench.planner", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="a remat.planning.targets name: h200, h200x8, v5e, cpu, ...")
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama3"))
    ap.add_argument("--preset", default=None, help="model preset (default: d12 on an accelerator, the bench "
                    "reference shape on cpu and with --validate)")
    ap.add_argument("--batch_size", type=integer(1), default=None, help="micro-batch (global, over the mesh)")
    ap.add_argument("--sequence_length", type=integer(1), default=None)
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    ap.add_argument("--mesh", default=None, help="train.py's --mesh, e.g. fsdp=8")
    ap.add_argument("--budgets", type=integer(1), default=5, help="budgets between full's and none's peaks")
    ap.add_argument("--validate", action="store_true",
                    help="time every plan and every hand setting interleaved on this machine (the target must be "
                         "this machine: cpu, or the GPU it runs on) and write predicted against measured step times")
    ap.add_argument("--validate_seconds", type=integer(10), default=300,
                    help="--validate: stop adding timed rounds after this many seconds of timing")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write the front's plot (PNG) here (default: beside --json)")
    return ap


def _local(target) -> bool:
    """Whether the target is this machine (its step times can be measured here)."""
    if target.platform == "cpu":
        return True
    kind = getattr(jax.devices()[0], "device_kind", "").lower()
    here = jax.default_backend()
    same = here == target.platform or (here == "gpu" and target.platform in ("cuda", "rocm"))
    return same and target.spec.kind.lower() in kind.replace(" ", "")


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        target0 = remat.planning.targets.get(args.target)
    except ValueError as e:
        ap.error(f"--target {args.target!r}: {e}")
    if args.validate and not _local(target0):
        ap.error(f"--validate measures on this machine, which is not {args.target} ({jax.default_backend()}, "
                 f"{jax.devices()[0].device_kind}); use --target cpu here, or run on the target")
    if _local(target0) and args.mesh:
        ap.error(f"--mesh {args.mesh} shards train.py's step for a compile-only target; where the step runs here "
                 f"(--target {args.target}) it is one device's: drop --mesh, or plan for a target such as h200x8")
    load = os.getloadavg()[0]
    if _local(target0):
        h = _hooks_local(args)
    else:
        args.preset = args.preset or "d12"
        h = _hooks_train(args)
    L, target = h.n_layers, h.target
    pk = lambda cm: cm.peak_estimate
    bar = _bar(args)
    say = lambda s: (bar.set_postfix_str(s[:60]) if bar is not None else print(f"  {s}", file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    measured: dict = {}
    cs = _counting(h.compile, bar)
    f0 = front(cs, h.trace, L, [], target=target, log=say, measured=measured, run_step=h.run)
    model = f0.model
    p_none, p_full = pk(measured[(None,) * L]), model.p_full
    budgets = [int(p_full + k * (p_none - p_full) / (args.budgets + 1)) for k in range(1, args.budgets + 1)]
    f = front(cs, h.trace, L, budgets, target=target, log=say, model=model, measured=measured)
    t_plan = time.perf_counter() - t0
    print(f"planning: {t_plan:.0f} s, {len(measured)} compilations; step times {model.time_source}",
          file=sys.stderr, flush=True)

    res = {"command": "python -m remat_lm.bench.planner " + " ".join(argv if argv is not None else sys.argv[1:]),
           "target": target.name, "compiler": target.compiler, "n_layers": L, "load_average": load,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "planning_s": t_plan,
           "time_source": model.time_source, "spread_s": model.spread_s,
           "full_peak_bytes": p_full, "none_peak_bytes": p_none, "model": _model_json(model)}

    def save(rows, base_rows, partial):
        """Write what is known so far (a long run leaves its front even when stopped)."""
        res.update(front=rows, baselines=base_rows, compiles=len(measured) + len(other), partial=partial)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1, default=str)

    # the step is planned with its layers under scan (_hooks_train, _hooks_local): the plan text says so
    row = lambda p: {"budget_bytes": p.budget, "plan": dataclasses.replace(p, scan=True).text,
                     "compiled_peak_bytes": p.compiled_peak,
                     "predicted_peak_bytes": p.predicted_peak, "predicted_step_s": p.predicted_step_s,
                     "notes": list(p.notes)}
    rows = [row(p) for p in f.plans]
    other: dict = {}   # the baselines' compiled programs: reported beside the front, never fed into it
    save(rows, [], True)
    def stat(rc, lp=None):
        if lp is not None and lp in measured:
            return measured[lp]
        if rc not in other:
            other[rc] = compiled_stats(cs(rc))
        return other[rc]
    plans0 = tagplan.baseline_plans(L)
    order = sorted(plans0, key=lambda n: (n.split()[0] not in ("none", "full", "block", "uniform"), n))
    multi = [n for n in order if tagplan.config_policies(plans0[n], L) is None]
    priced = _price_programs(h, model, {n: plans0[n] for n in multi}, stat)
    base_rows, rcs = [], {}
    for name in order:
        rc = plans0[name]
        lp = tagplan.config_policies(rc, L)
        cm = stat(rc, lp)
        step = model.predict(lp)[1] if lp is not None else priced[name]
        say(f"baseline {name}: peak {format_bytes(pk(cm))}")
        rcs[name] = rc
        base_rows.append({"name": _spelled(name), "compiled_peak_bytes": pk(cm), "predicted_step_s": step})
        save(rows, base_rows, True)
    for b in budgets:
        lp, steps = tagplan.greedy(model, b, lambda lp: pk(stat(tagplan.recompute_config(lp), tuple(lp))))
        base_rows.append({"name": "greedy", "budget_bytes": b, "plan": tagplan.format_plan(lp, scan=True),
                          "steps": steps, "compiled_peak_bytes": pk(stat(tagplan.recompute_config(lp), tuple(lp))),
                          "predicted_step_s": model.predict(lp)[1]})
    res["checks"] = checks = _checks(rows, base_rows, p_full, p_none, model)
    if args.validate:
        res["validation"] = v = validate(h, rows, base_rows, rcs, model, args.validate_seconds, stat, bar)
        checks += v["checks"]
    if bar is not None:
        bar.close()
    for c in checks:
        print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['what']}: {c['value']}")
    for r in rows:
        print(f"budget {r['budget_bytes'] / GiB:.3f} GiB: peak {r['compiled_peak_bytes'] / GiB:.3f} GiB, "
              f"predicted {r['predicted_step_s'] * 1e3:.3f} ms  plan: {r['plan']}")
    if args.validate:
        print(validation_table(res["validation"]))
    save(rows, base_rows, False)
    png = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if png:
        plot(res, png)
    return 0


def _bar(args):
    """A progress bar on stderr over the compiles (and, with --validate, the timed steps)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(desc="planner", unit=" step", file=sys.stderr, dynamic_ncols=True, mininterval=1.0)


def _counting(compile_step, bar):
    """compile_step, with each first compilation counted on the bar."""
    seen = set()

    def cs(rc):
        if rc not in seen and bar is not None:
            seen.add(rc)
            bar.update(1)
        return compile_step(rc)
    return cs


def _spelled(name: str) -> str:
    """A hand setting as train.py spells it: none, full, uniform N, block N, selective MODULES."""
    return name if name.split()[0] in ("none", "full", "uniform", "block", "greedy") else f"selective {name}"


def _model_json(model) -> dict:
    d = dataclasses.asdict(model)
    d["program_s"] = {tagplan.format_plan(lp): t for lp, t in model.program_s.items()}
    return d


def _price_programs(h: Hooks, model, rcs: dict, stat) -> dict:
    """Step seconds of settings outside the per-layer family (uniform N > 1: several layers in one
    region): on this machine measured against no remat in one interleaved run, else the target
    compiler's optimized program on the roofline; either way as a difference added to the model's
    no-remat step."""
    from remat.planning import cost, timing

    if not rcs:
        return {}
    if h.run is not None:
        steps = {"none": h.run(tagplan.recompute_config((None,) * model.n_layers))}
        steps.update({n: h.run(rc) for n, rc in rcs.items()})
        t = timing.time_programs(steps)
        return {n: model.base_step_s + t[n].median_s - t["none"].median_s for n in rcs}
    roof = cost.of_target(h.target)
    t_none = cost.program_seconds(stat(tagplan.recompute_config((None,) * model.n_layers), (None,) * model.n_layers),
                                  roof)
    return {n: model.base_step_s + cost.program_seconds(stat(rc), roof) - t_none for n, rc in rcs.items()}


def validate(h: Hooks, rows, base_rows, rcs, model, seconds: float, stat, bar=None) -> dict:
    """Time every front plan and hand setting interleaved on this machine, with a second compilation
    of no remat as the noise floor; compare with the predicted step times (docs/planner.md)."""
    from scipy.stats import kendalltau

    from remat.planning import timing
    from remat.compiled import hlo_fingerprint

    settings = {}   # name -> (rc, predicted_s, peak)
    for i, r in enumerate(rows):
        settings[f"plan {i + 1}"] = (tagplan.recompute_config(tagplan.parse_plan(r["plan"])), r["predicted_step_s"],
                                     r["compiled_peak_bytes"])
    for b in base_rows:
        if b["name"] != "greedy":
            n = next(k for k in rcs if _spelled(k) == b["name"])
            settings[b["name"]] = (rcs[n], b["predicted_step_s"], b["compiled_peak_bytes"])
    programs: dict = {}   # fingerprint -> names (settings that compile to one program are timed once)
    for name, (rc, _, _) in settings.items():
        programs.setdefault(hlo_fingerprint(h.compile(rc).as_text()), []).append(name)
    steps = {names[0]: h.run(settings[names[0]][0]) for names in programs.values()}
    steps["none (second compilation)"] = h.fresh(settings["none"][0])
    if bar is not None:
        bar.set_description("validation: timing")
    t = timing.time_programs(steps, min_rounds=9, max_rounds=41, rel=0.01, max_seconds=seconds,
                             tick=(lambda: bar.update(1)) if bar is not None else None)
    floor = timing.noise_floor(t["none"], t["none (second compilation)"])
    out = []
    for names in programs.values():
        m = t[names[0]]
        for n in names:
            rc, pred, peak = settings[n]
            out.append({"name": n, "predicted_step_s": pred, "measured_step_s": m.median_s, "measured_iqr_s": m.iqr_s,
                        "compiled_peak_bytes": peak, "rounds": m.rounds,
                        "same_program_as": [x for x in names if x != n]})
    by = {r["name"]: r for r in out}
    firsts = [by[names[0]] for names in programs.values()]
    pairs = conc = 0
    for i, a in enumerate(firsts):
        for b in firsts[i + 1:]:
            dm = a["measured_step_s"] - b["measured_step_s"]
            if abs(dm) > floor:
                pairs += 1
                dp = a["predicted_step_s"] - b["predicted_step_s"]
                conc += dp != 0 and (dp > 0) == (dm > 0)
    tau = kendalltau([r["predicted_step_s"] for r in firsts], [r["measured_step_s"] for r in firsts])
    none, full = by["none"], by["full"]
    over = lambda r, k: r[k] / none[k] - 1
    checks = []
    worst = max(out, key=lambda r: abs(r["predicted_step_s"] / r["measured_step_s"] - 1))
    err = worst["predicted_step_s"] / worst["measured_step_s"] - 1
    checks.append({"what": "every setting's predicted step within ±15% of its measured one (worst)",
                   "value": f"{worst['name']}: {err:+.1%}", "ok": abs(err) <= 0.15})
    c = conc / pairs if pairs else float("nan")
    checks.append({"what": "concordance of predicted and measured order on the pairs the noise floor separates",
                   "value": f"{conc}/{pairs} = {c:.3f}", "ok": pairs > 0 and c >= 0.9})
    d = over(full, "predicted_step_s") - over(full, "measured_step_s")
    checks.append({"what": "full remat's predicted overhead over none against its measured one",
                   "value": f"predicted {over(full, 'predicted_step_s'):+.1%}, measured {over(full, 'measured_step_s'):+.1%}",
                   "ok": abs(d) <= 0.05})
    hand = [r for r in out if not r["name"].startswith("plan ")]
    slow, smaller = [], []
    for i, row in enumerate(rows):
        p = by[f"plan {i + 1}"]
        fit = [r for r in hand if r["compiled_peak_bytes"] <= row["budget_bytes"]]
        best = min(fit, key=lambda r: r["measured_step_s"])
        if p["measured_step_s"] > best["measured_step_s"] + floor:
            slow.append(f"plan {i + 1} {p['measured_step_s'] * 1e3:.1f} ms vs {best['name']} "
                        f"{best['measured_step_s'] * 1e3:.1f} ms")
        for r in fit:
            if r["measured_step_s"] <= p["measured_step_s"] + floor and r["compiled_peak_bytes"] <= 0.9 * p["compiled_peak_bytes"]:
                smaller.append(f"plan {i + 1}: {r['name']}")
    checks.append({"what": "budgets where the plan measures slower than the fastest fitting hand setting beyond "
                           "the noise floor", "value": slow or 0, "ok": not slow and len(rows) >= 5})
    checks.append({"what": "fitting hand settings within the noise floor of the plan's time with a peak >= 10% "
                           "smaller", "value": smaller or 0, "ok": not smaller})
    return {"settings": out, "noise_floor_s": floor, "noise_pair": ["none", "none (second compilation)"],
            "noise_pair_s": [t["none"].median_s, t["none (second compilation)"].median_s],
            "kendall_tau": float(tau.statistic), "kendall_p": float(tau.pvalue),
            "concordance": c, "concordant_pairs": conc, "separated_pairs": pairs,
            "rounds": t["none"].rounds, "load_average_end": os.getloadavg()[0], "checks": checks}


def validation_table(v: dict) -> str:
    """The validation as a markdown table (predicted, measured, IQR in ms; peak in MiB)."""
    lines = [f"noise floor {v['noise_floor_s'] * 1e3:.1f} ms (none and its second compilation: "
             f"{v['noise_pair_s'][0] * 1e3:.1f} / {v['noise_pair_s'][1] * 1e3:.1f} ms); Kendall's tau "
             f"{v['kendall_tau']:.2f}; concordance {v['concordant_pairs']}/{v['separated_pairs']} separated pairs; "
             f"{v['rounds']} interleaved rounds", "",
             "| setting | predicted ms | measured ms | IQR ms | pred/meas | compiled peak MiB | same program as |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in v["settings"]:
        lines.append(f"| {r['name']} | {r['predicted_step_s'] * 1e3:.1f} | {r['measured_step_s'] * 1e3:.1f} | "
                     f"{r['measured_iqr_s'] * 1e3:.1f} | {r['predicted_step_s'] / r['measured_step_s']:.3f} | "
                     f"{r['compiled_peak_bytes'] / MiB:.1f} | {', '.join(r['same_program_as'])} |")
    return "\n".join(lines)


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
            if (b["compiled_peak_bytes"] <= r["budget_bytes"]
                    and b["predicted_step_s"] < r["predicted_step_s"] - model.spread_s - 1e-12):
                faster.append(f"{b['name']} at {r['budget_bytes'] / GiB:.3f} GiB")
    out.append({"what": f"fitting baselines (never fed to the planner) predicted faster than the plan beyond the "
                        f"spread ({model.spread_s * 1e3:.2f} ms)", "value": faster or 0, "ok": not faster})
    mid = rows[len(rows) // 2]
    none_s = next(b["predicted_step_s"] for b in base if b["name"] == "none")
    meg = [b for b in base if b["name"].split()[0] in MEGATRON and b["compiled_peak_bytes"] <= mid["budget_bytes"]]
    best = min(meg, key=lambda b: b["predicted_step_s"])
    po, mo = mid["predicted_step_s"] - none_s, best["predicted_step_s"] - none_s
    ratio = po / mo if mo > model.spread_s else None
    out.append({"what": f"middle budget {mid['budget_bytes'] / GiB:.3f} GiB: the plan's recompute overhead over "
                        f"that of the best fitting Megatron setting ({best['name']})",
                "value": round(ratio, 3) if ratio is not None else
                f"plan {po * 1e3:+.2f} ms, {best['name']} {mo * 1e3:+.2f} ms over none: within the spread",
                "ok": (ratio is not None and ratio <= 0.9) or mid["predicted_step_s"] <= best["predicted_step_s"] + model.spread_s,
                "plan": mid["plan"], "plan_overhead_s": mid["predicted_step_s"] - none_s,
                "megatron": best["name"], "megatron_overhead_s": best["predicted_step_s"] - none_s})
    return out


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
    ax.set_ylabel(f"predicted step, ms ({res.get('time_source', 'the time model')})"[:80])
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
