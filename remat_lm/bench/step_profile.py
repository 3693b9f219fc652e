"""Where one compiled training step spends its time: matmuls against everything else, from a trace.

    python -m remat_lm.bench.step_profile --json out/bench/step_profile.json

Compiles the reference GPT-2 forward + backward (remat_lm.bench.common.REFERENCE, batch 8; `--setting` one
of remat_lm.bench.policies' settings, default `none`), times `--steps` steps, then traces as many with
`jax.profiler` and reads XLA's per-operation events back from the trace. Each operation that XLA
runs (a thunk: a matmul, a fused elementwise loop, a copy) is a "matmul" when its HLO instruction
carries a `dot_general` (YNNPACK's fused dots included) and "other" otherwise; loops and calls are
containers, not counted. Over every traced step it reports how the wall time divides: no
operation running, one matmul alone, one other operation alone, two at once (XLA runs independent
operations concurrently on its threads), and the matmuls' rate over the wall time in which at least
one runs (XLA's cost analysis of the step, nearly all of it dots). Then the costliest
operations, grouped by where they come from (their op_name, the layers folded together).

On a CPU this is what decides how far the step is from the matmul ceiling (remat_lm.bench.cpu_ceiling):
"other alone" is time in which the second core helps little.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import re
import sys
import tempfile
import time

from remat_lm.bench import policies
from remat_lm.models import family
from remat_lm.bench.common import REFERENCE_BATCH, machine, markdown_table, median, publish, cli
from remat_lm.argtypes import Parser, integer

WORKER = "remat_lm.bench.step_profile"
STEP = "remat_step"  # the TraceAnnotation around each traced step
CONTAINERS = ("while", "conditional", "call")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) (\S+?)\(")


def hlo_index(text: str) -> dict:
    """{instruction: (opcode, op_name metadata)} of a compiled HLO module's text."""
    ops = {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            meta = re.search(r'op_name="([^"]*)"', line)
            ops[m.group(1)] = (m.group(3), meta.group(1) if meta else "")
    return ops


def is_matmul(name: str, ops: dict) -> bool:
    opcode, op_name = ops.get(name, ("", ""))
    return op_name.endswith("dot_general") and opcode in ("fusion", "dot", "custom-call")


def where(op_name: str) -> str:
    """An op_name made short: fwd/bwd for jvp/transpose(jvp), one `block/` for every layer."""
    w = re.sub(r"^jit\([^/]*\)/", "", op_name)
    w = re.sub(r"^transpose\(jvp\([^)]*\)\)", "bwd", w)
    w = re.sub(r"^jvp\([^)]*\)", "fwd", w)
    w = re.sub(r"blocks/Block(_\d+)?/|layers_\d+/", "block/", w)
    return re.sub(r"/[\w.]+\._apply/", "/", w)


def read_trace(trace_dir: str) -> list[dict]:
    """The complete ("X") events of the perfetto trace that jax.profiler wrote under `trace_dir`."""
    (path,) = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        evs = json.load(f)
    evs = evs["traceEvents"] if isinstance(evs, dict) else evs
    return [e for e in evs if e.get("ph") == "X" and "dur" in e]


def split_steps(events: list[dict], ops: dict) -> list[dict]:
    """Per traced step: wall ms divided into idle / matmul alone / other alone / concurrent, and
    the summed duration of every operation name (ms)."""
    out = []
    for st in (e for e in events if e["name"] == STEP):
        a, b = st["ts"], st["ts"] + st["dur"]
        leaf = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                if a <= e["ts"] < b and e["name"] in ops and ops[e["name"]][0] not in CONTAINERS]
        cuts = sorted({a, b, *(min(max(s, a), b) for s, _, _ in leaf), *(min(max(t, a), b) for _, t, _ in leaf)})
        buckets = collections.Counter()
        for x, y in zip(cuts, cuts[1:]):
            on = [is_matmul(n, ops) for s, t, n in leaf if s <= x and t >= y]
            key = ("idle" if not on else ("matmul alone" if on[0] else "other alone") if len(on) == 1
                   else "two matmuls at once" if all(on) else "matmul + other" if any(on) else "others at once")
            buckets[key] += (y - x) / 1e3
        by_name, runs = collections.Counter(), collections.Counter()
        for s, t, n in leaf:
            by_name[n] += (t - s) / 1e3
            runs[n] += 1
        out.append(dict(wall_ms=st["dur"] / 1e3, buckets=dict(buckets), by_name=dict(by_name), runs=dict(runs)))
    return out


BUCKETS = ("idle", "matmul alone", "two matmuls at once", "matmul + other", "other alone", "others at once")


def run(model="gpt2", setting="none", *, n_layer=None, n_embd=None, n_head=None, seq=None, batch=None,
        vocab=None, steps=3, top=12) -> dict:
    """Compile, time and trace the step; return rows of the wall-time split and the costliest ops.

    Example:
      >>> res = run(n_layer=2, n_embd=32, seq=32, batch=2, steps=1)
      >>> [r["part"] for r in res["split"]][:2]
      ['idle', 'matmul alone']
    """
    import jax
    info = machine()
    config, seq = policies.build_config(model, "ref", n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                                        seq=seq, vocab=vocab)
    batch = batch or REFERENCE_BATCH
    (s,) = [s for s in policies.default_settings(config.n_layer) if s.name == setting] or [None]
    if s is None:
        raise SystemExit(f"--setting {setting!r}: use one of "
                         f"{', '.join(x.name for x in policies.default_settings(config.n_layer))}")
    cfg = dataclasses.replace(config, recompute=s.recompute, dtype=s.dtype)
    params, idx, targets = policies.inputs(config, batch, seq)
    f = lambda p, i, t: family.get(model).loss_fn(p, cfg, i, t)
    compiled = jax.jit(jax.value_and_grad(f)).lower(params, idx, targets).compile()
    ops = hlo_index(compiled.as_text())
    step = lambda: jax.block_until_ready(compiled(params, idx, targets))
    step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                with jax.profiler.TraceAnnotation(STEP):
                    step()
        traced = split_steps(read_trace(d), ops)
    if not traced:
        raise RuntimeError("the trace holds no step annotation; jax.profiler wrote no perfetto trace")
    n = len(traced)
    wall = sum(t["wall_ms"] for t in traced) / n
    split = [dict(part=k, ms=sum(t["buckets"].get(k, 0.0) for t in traced) / n) for k in BUCKETS]
    for r in split:
        r["share"] = r["ms"] / wall
    names, runs = collections.Counter(), collections.Counter()
    for t in traced:
        names.update(t["by_name"])
        runs.update(t["runs"])
    groups, count = collections.Counter(), collections.Counter()
    for k, v in names.items():
        g = ("matmul" if is_matmul(k, ops) else "other", ops[k][0], where(ops[k][1]))
        groups[g] += v / n
        count[g] += runs[k] / n
    costly = [dict(kind=g[0], opcode=g[1], where=g[2], ops=count[g], ms=v) for g, v in groups.most_common(top)]
    busy = sum(r["ms"] for r in split if "matmul" in r["part"])
    flops = compiled.cost_analysis()
    flops = (flops[0] if isinstance(flops, list) else flops or {}).get("flops", 0.0)
    summary = dict(step_ms=median(times), traced_wall_ms=wall, step_gflops=flops / 1e9,
                   matmul_busy_ms=busy, matmul_thread_ms=sum(v for k, v in names.items() if is_matmul(k, ops)) / n,
                   other_thread_ms=sum(v for k, v in names.items() if not is_matmul(k, ops)) / n)
    summary["gflops_per_s_over_matmul_busy"] = flops / 1e9 / (busy / 1e3) if busy else None
    meta = dict(info, model=model, setting=setting, seq=seq, batch=batch, steps=steps, command=None)
    return dict(meta=meta, summary=summary, split=split, costly=costly)


def report(res: dict) -> str:
    m, s = res["meta"], res["summary"]
    rate = s["gflops_per_s_over_matmul_busy"]
    lines = [f"{m['model']} `{m['setting']}`, T={m['seq']}, B={m['batch']}; jax {m.get('jax', '?')}, "
             f"load average {(m.get('loadavg') or ['?'])[0]} at the start",
             f"step {s['step_ms']:.0f} ms untraced, {s['traced_wall_ms']:.0f} ms traced; "
             f"{s['step_gflops']:.1f} GFLOPs (XLA cost analysis)", "",
             markdown_table(["part of the traced step", "ms", "share"],
                            [[r["part"], f"{r['ms']:.0f}", f"{100 * r['share']:.0f}%"] for r in res["split"]]), "",
             f"matmuls: {s['matmul_thread_ms']:.0f} ms summed over threads, at least one running for "
             f"{s['matmul_busy_ms']:.0f} ms of wall"
             + (f" ({rate:.0f} GFLOP/s of the step's FLOPs over that time)" if rate else "")
             + f"; other operations {s['other_thread_ms']:.0f} ms summed", "",
             markdown_table(["where (op_name)", "kind", "opcode", "runs per step", "ms (summed over threads)"],
                            [[r["where"], r["kind"], r["opcode"], f"{r['ops']:.0f}", f"{r['ms']:.1f}"] for r in res["costly"]])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = Parser(prog="python -m remat_lm.bench.step_profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2", choices=family.NAMES)
    p.add_argument("--setting", default="none", help="a remat_lm.bench.policies setting name (default none)")
    for k in ("n_layer", "n_embd", "n_head", "seq", "batch", "vocab"):
        p.add_argument(f"--{k}", type=integer(1), default=None, help=f"override the reference shape's {k}")
    p.add_argument("--steps", type=integer(1), default=3, help="timed and traced steps (default 3)")
    p.add_argument("--top", type=integer(1), default=12, help="operations listed (default 12)")
    p.add_argument("--json", default=None, help="also write the rows and metadata here")
    a = p.parse_args(argv)
    res = run(a.model, a.setting, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head, seq=a.seq,
              batch=a.batch, vocab=a.vocab, steps=a.steps, top=a.top)
    return publish(res, report, WORKER, argv, a.json)


if __name__ == "__main__":
    sys.exit(cli(main, "step_profile"))
