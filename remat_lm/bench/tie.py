"""The cotangent tie per compiler: compiled temp of GPT-2's gradient at the reference shape with
`remat.checkpoint`'s tie forced on and off, on each target's compiler (docs/targets.md).

    python -m remat_lm.bench.tie                               # cpu, h200, v5e (~6 min on 2 cores)
    python -m remat_lm.bench.tie --targets h200 --json tie.json

Compile only (`remat.memory.compiled_memory`); nothing runs. Needs the `targets` extra for the GPU
and TPU columns. The library ties only where a column shows the tie lowering temp
(`remat.checkpoint.tie_needed`).
"""
from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp

import remat.memory
from remat import RecomputeConfig
from remat.plan import targets
from remat.checkpoint import tie_needed
from remat_lm.argtypes import Parser, run as run_cli
from remat_lm.bench.common import REFERENCE_BATCH, reference_config, write_json
from remat_lm.models import family

SETTINGS = {"full": RecomputeConfig(granularity="full"),
            "uniform 2": RecomputeConfig(granularity="full", method="uniform", num_layers=2),
            "selective core_attn": RecomputeConfig(granularity="selective")}
MiB = 2 ** 20


def temp(target: str, rc: RecomputeConfig, scan: bool, tie: bool | None) -> int:
    """Compiled temp bytes of the reference GPT-2 gradient, with the stack's checkpoints tied as `tie`."""
    fam = family.get("gpt2")
    mcfg = reference_config("gpt2", recompute=rc, scan_layers=scan)
    params = jax.eval_shape(lambda: fam.init_params(mcfg, jax.random.PRNGKey(0)))
    x = jax.ShapeDtypeStruct((REFERENCE_BATCH, mcfg.block_size), jnp.int32)
    stack = sys.modules["remat.stack"]
    orig = stack.checkpoint
    stack.checkpoint = functools.partial(orig, tie_to_cotangent=tie)
    try:
        grad = jax.grad(lambda p, x, y: fam.loss_fn(p, mcfg, x, y))
        return remat.memory.compiled_memory(grad, params, x, x, target=target).temp
    finally:
        stack.checkpoint = orig


def run(names=("cpu", "h200", "v5e"), log=print) -> list[dict]:
    rows = []
    for name in names:
        t = targets.get(name)
        for scan in (False, True):
            none = temp(name, RecomputeConfig(), scan, None)
            for label, rc in SETTINGS.items():
                t0 = time.perf_counter()
                tied, untied = temp(name, rc, scan, True), temp(name, rc, scan, False)
                rows.append(dict(target=t.name, compiler=t.compiler, layout="scan" if scan else "loop",
                                 setting=label, none_bytes=none, tied_bytes=tied, untied_bytes=untied,
                                 default_ties=tie_needed(t.platform)))
                log(f"{t.compiler} {rows[-1]['layout']} {label}: tied {tied / MiB:.1f} MiB, untied "
                    f"{untied / MiB:.1f} MiB, none {none / MiB:.1f} MiB ({time.perf_counter() - t0:.1f} s)")
    return rows


def report(rows) -> str:
    lines = ["| compiler | layout | setting | none | tied | untied | default |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['compiler']} ({r['target']}) | {r['layout']} | {r['setting']} | "
                     f"{r['none_bytes'] / MiB:.1f} | {r['tied_bytes'] / MiB:.1f} | {r['untied_bytes'] / MiB:.1f} | "
                     f"{'tied' if r['default_ties'] else 'untied'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = Parser(prog="python -m remat_lm.bench.tie", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="cpu,h200,v5e", help="comma list of remat.plan.targets names")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    try:
        names = [targets.get(n).name for n in a.targets.split(",") if n.strip()]
    except ValueError as e:
        raise SystemExit(f"--targets: {e}")
    try:
        rows = run(names, log=lambda s: print(s, file=sys.stderr))
    except targets.TargetUnavailable as e:
        raise SystemExit(str(e))
    print(report(rows))
    write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, "python -m remat_lm.bench.tie"))
