"""Tensor parallelism on 8 CPU devices: per-device compiled peak and step-time ratios by `tensor` size.

    python -m remat_lm.bench.scaling                  # d12, T=1024, B=8: compile only (peaks), then timed steps
    python -m remat_lm.bench.scaling --small          # peaks of a small shape too (a quick check, ~1 min)
    python -m remat_lm.bench.scaling --json out.json
    JAX_PLATFORMS=cpu python -m remat_lm.bench.scaling --target h200 --no-time   # XLA:GPU, 1-8 H200s, no device

Mesh `tensor=t` (data = fsdp = 1: the same batch on every device, so per-device memory can only
fall through tensor/sequence parallelism) for t = 1, 2, 4, 8. Settings per t:
  - `none`: no remat; `full`: full remat (each layer a region), both with sequence parallelism;
  - `full, no SP`: full remat, activations between attention and MLP whole on every device;
  - `full, no SP, distributed`: that plus distributed saved activations (region inputs split
    along T over tensor, `RecomputeConfig.shard_inputs="tensor"`), Megatron's pair.
The LM head and loss run in chunks of T/8 positions (`loss_chunk`): otherwise the (B, T, V) float32
logits (1.5 GiB at d12, whole on every device without sequence parallelism) set every peak and hide
what tensor parallelism and the recompute settings change.
Peaks are compile-only (`jax.jit(jax.grad(loss_fn)).lower(...).compile()` on abstract, sharded
inputs): XLA's per-device arguments + outputs + temp − aliased and its temp. Step times run a
smaller shape (`TIME_SHAPE`, printed) because a d12 step at T=1024 takes tens of seconds on 2
shared cores; they are medians of interleaved rounds (`remat_lm.bench.common.interleaved_ms`), as ratios to
t=1 of the same setting. On CPU the 8 "devices" share the same cores, so a step-time ratio shows the
collectives' and partitioning's overhead, not a speed-up.

`--target NAME` compiles the peaks for that accelerator (its first t devices of an 8-device target:
h200x8, v5e:2x4) with its compiler and no device (`remat.plan.targets`); the timed steps then do not run.

d12 has 12 heads: with t=8 XLA splits the 768 attention features 96 per device, inside heads
(train.py refuses that mesh: `remat_lm.training.sharding.check_tensor`); the row is marked.
"""
from __future__ import annotations

import argparse
import sys
import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np

from remat_lm.bench import common
from remat_lm.bench.common import MiB, fmt, interleaved_ms, machine, markdown_table, median, publish, cli
from remat_lm.models import gpt2
from remat import RecomputeConfig
from remat.plan import targets
from remat.memory import building_for
from remat_lm.argtypes import Parser, integer
from remat_lm.training import sharding as sh

TENSOR = (1, 2, 4, 8)
SETTINGS = {  # name: (recompute, sequence parallel)
    "none": (RecomputeConfig(), True),
    "full": (RecomputeConfig(granularity="full"), True),
    "full, no SP": (RecomputeConfig(granularity="full"), False),
    "full, no SP, distributed": (RecomputeConfig(granularity="full", shard_inputs="tensor"), False),
}
PEAK_SHAPE = dict(preset="d12", seq=1024, batch=8, overrides=dict(loss_chunk=128))
SMALL_SHAPE = dict(preset="d12", seq=256, batch=8, overrides=dict(n_layer=4, n_embd=256, n_head=8, loss_chunk=64))
TIME_SHAPE = dict(preset="d12", seq=128, batch=8, overrides=dict(n_layer=2, n_embd=256, n_head=8))


def devices(target: str = "cpu"):
    """The devices the meshes take their first t of: this host's (cpu), else the compile-only
    devices of the target's 8-device form (h200 -> h200x8, v5e -> v5e:2x4)."""
    t = targets.get(target)
    if t.platform == "cpu":
        return None
    return targets.get(f"{t.spec.kind}x8" if t.platform == "cuda" else f"{t.spec.kind}:2x4").devices()


def _build(shape: dict, t: int, setting: str, devs=None):
    rc, seq_par = SETTINGS[setting]
    cfg = gpt2.GPT2Config.preset(shape["preset"], recompute=rc, block_size=max(shape["seq"], 64),
                                 **shape["overrides"])
    mesh = sh.make_mesh(dict(data=1, fsdp=1, tensor=t), shape["batch"], devices=devs)
    params = jax.eval_shape(lambda: gpt2.init_params(cfg, jax.random.PRNGKey(0)))
    ps, xs = sh.state_shardings(mesh, params), sh.batch_sharding(mesh, 2, 0)
    mcfg = sh.model_sharding(cfg, mesh, seq_par)
    f = jax.jit(jax.grad(lambda p, x, y: gpt2.loss_fn(p, mcfg, x, y)), in_shardings=(ps, xs, xs))
    return cfg, mesh, params, ps, xs, f


def peak(shape: dict, t: int, setting: str, target: str = "cpu") -> dict:
    """Compile one (t, setting) for `target` and read XLA's per-device memory analysis."""
    cfg, mesh, params, ps, xs, f = _build(shape, t, setting, devices(target))
    idx = jax.ShapeDtypeStruct((shape["batch"], shape["seq"]), jnp.int32, sharding=xs)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, ps)
    t0 = time.perf_counter()
    with building_for(targets.get(target).platform), jax.set_mesh(mesh):
        ma = f.lower(abstract, idx, idx).compile().memory_analysis()
    g = lambda k: int(getattr(ma, k, 0) or 0)
    return dict(tensor=t, setting=setting, temp=g("temp_size_in_bytes"),
                peak=g("argument_size_in_bytes") + g("output_size_in_bytes") + g("temp_size_in_bytes")
                - g("alias_size_in_bytes"), compile_s=time.perf_counter() - t0,
                heads_split=cfg.n_head % t == 0)


def step_times(shape: dict, rounds: int, log=print) -> dict:
    """{(t, setting): [ms]} for one gradient step of `shape`, interleaved."""
    steps = {}
    for t in TENSOR:
        for setting in SETTINGS:
            if t == 1 and setting.startswith("full, no SP"):
                continue
            cfg, mesh, params, ps, xs, f = _build(shape, t, setting)
            p = jax.device_put(gpt2.init_params(cfg, jax.random.PRNGKey(0)), ps)
            x = jax.device_put(np.zeros((shape["batch"], shape["seq"]), np.int32), xs)
            with jax.set_mesh(mesh):
                c = f.lower(p, x, x).compile()
            steps[(t, setting)] = (lambda c=c, p=p, x=x: jax.block_until_ready(c(p, x, x)))
            log(f"compiled t={t} {setting}")
    return interleaved_ms(steps, rounds)


def run(shape: dict, rounds: int = 5, timed: bool = True, peaks: bool = True, log=print, target: str = "cpu") -> dict:
    rows = []
    timed = timed and common.timed(target)
    for t in TENSOR if peaks else ():
        for setting in SETTINGS:
            if t == 1 and setting.startswith("full, no SP"):
                continue  # no tensor axis: nothing to split
            r = peak(shape, t, setting, target)
            rows.append(r)
            log(f"t={t} {setting}: peak {r['peak'] / MiB:,.1f} MiB, temp {r['temp'] / MiB:,.1f} MiB "
                f"({r['compile_s']:.1f} s)")
    res = {"meta": dict(machine(), source=common.source(target)), "shape": shape, "rows": rows}
    if timed:
        ms = step_times(TIME_SHAPE, rounds, log)
        res["time_shape"] = TIME_SHAPE
        res["times"] = [dict(tensor=t, setting=s, ms=median(v)) for (t, s), v in ms.items()]
    return res


def report(res: dict) -> str:
    m, shape = res["meta"], res["shape"]
    base = {r["setting"]: r for r in res["rows"] if r["tensor"] == 1}
    if not res["rows"]:
        base = {}
    lines = [f"# remat_lm.bench.scaling: {shape['preset']} {shape['overrides'] or ''} T={shape['seq']} B={shape['batch']}, "
             f"mesh tensor=t, float32", "",
             f"{m['date']}, {m['nproc']} CPUs ({m['cpu']}), jax {m['jax']}, {len(m['devices'])} {m['backend']} devices, "
             f"load {m['loadavg']}; {common.source_line(m.get('source') or common.source('cpu'))}",
             f"command: `{m.get('command', '')}`"]
    if res["rows"]:
        lines += ["", "Per-device compiled peak (arguments + outputs + temp − aliased) and temp; ratios to t=1 of "
                      "the same remat (`none` or `full`).", ""]
    rows = []
    for r in res["rows"] if base else ():
        ref = base["none" if r["setting"] == "none" else "full"]
        rows.append([r["tensor"], r["setting"] + ("" if r["heads_split"] else " †"), fmt(r["peak"] / MiB, ",.1f"),
                     fmt(r["peak"] / ref["peak"], ".3f"), fmt(r["temp"] / MiB, ",.1f"),
                     fmt(r["temp"] / ref["temp"], ".3f")])
    if rows:
        lines.append(markdown_table(["tensor", "setting", "peak MiB", "peak / t=1", "temp MiB", "temp / t=1"], rows))
    if any(not r["heads_split"] for r in res["rows"]):
        lines += ["", "† the heads do not split evenly over t: XLA splits inside heads (train.py refuses this mesh)."]
    if "times" in res:
        ts = res["time_shape"]
        tb = {r["setting"]: r["ms"] for r in res["times"] if r["tensor"] == 1}
        lines += ["", f"Step time (forward + backward) of {ts['preset']} {ts['overrides']} T={ts['seq']} "
                      f"B={ts['batch']}: median ms of interleaved rounds, ratio to t=1 of the same remat.", ""]
        lines.append(markdown_table(["tensor", "setting", "ms", "ms / t=1"], [
            [r["tensor"], r["setting"], fmt(r["ms"], ",.1f"),
             fmt(r["ms"] / tb["none" if r["setting"] == "none" else "full"], ".2f")] for r in res["times"]]))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = Parser(prog="python -m remat_lm.bench.scaling", description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help=f"peaks of {SMALL_SHAPE} instead of d12 T=1024 B=8")
    ap.add_argument("--no-time", dest="timed", action="store_false", help="compile-only: skip the timed steps")
    ap.add_argument("--time-only", action="store_true", help="only the timed steps (no peaks)")
    ap.add_argument("--rounds", type=integer(1), default=5, help="timed rounds per setting")
    ap.add_argument("--json", help="also write the results here")
    common.add_target(ap)
    args = ap.parse_args(argv)
    if targets.get(args.target).platform == "cpu" and len(jax.devices()) < 8:
        raise SystemExit("remat_lm.bench.scaling needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    if args.time_only and not common.timed(args.target):
        raise SystemExit(f"--time-only: a program built for {args.target} does not run on this host; drop --time-only")
    res = run(SMALL_SHAPE if args.small else PEAK_SHAPE, args.rounds, args.timed, not args.time_only,
              target=args.target)
    return publish(res, report, "remat_lm.bench.scaling", argv, args.json)


if __name__ == "__main__":
    sys.exit(cli(main, "scaling"))
