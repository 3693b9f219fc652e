"""What offloading to host memory frees on a target's compiler: the model's gradient compiled
(not run) for a GPU or TPU, device temp and host bytes per setting (docs/offload.md).

    python -m remat_lm.bench.offload --target h200
    python -m remat_lm.bench.offload --target v5e --scan

The settings: no remat, full remat, full remat saving `qkv,mlp_up` on the device, full remat
offloading them (`offload_names:qkv,mlp_up`), and full remat with the layer inputs in host memory
(`offload_inputs`, train.py's `--cpu_checkpointing`). Each line is XLA's memory analysis of
`jax.grad` of the model's loss for the target (remat.planning.targets), with what should move to host
memory computed from the model's shapes (`activation_bytes`), and whether the offload meets its
bar: `offload_names` at most midway between full remat and saving on the device, `offload_inputs`
at most full remat, each with >= 90% of what it moves in host memory. `copies to host` counts the
copy-starts to host memory in XLA's scheduled program, `late` those that start only in the backward
(their device buffers live through the forward).
"""
from __future__ import annotations

import dataclasses
import re
import sys
import time

import jax
import jax.numpy as jnp

from remat import RecomputeConfig
from remat.planning import targets
from remat.memory import MiB, compiled_stats
from remat_lm.argtypes import Parser, integer
from remat_lm.bench import common
from remat_lm.models import family

NAMES = ("qkv", "mlp_up")  # what `offload_names` moves, and `save_names` keeps on the device
FULL = dict(granularity="full")
SETTINGS = {
    "none": RecomputeConfig(),
    "full": RecomputeConfig(**FULL),
    "save_names": RecomputeConfig(**FULL, policy="save_names:" + ",".join(NAMES)),
    "offload_names": RecomputeConfig(**FULL, policy="offload_names:" + ",".join(NAMES)),
    "offload_inputs": RecomputeConfig(**FULL, offload_inputs=True),
}
HOST_SHARE = 0.9  # of what an offload moves, at least this much must be in host memory


@dataclasses.dataclass(frozen=True)
class Row:
    """One compiled setting: device temp, host bytes, copies to host memory in the scheduled program
    (`to_host`) and how many of them start only in the backward (`late`), compile seconds."""
    setting: str
    temp: int
    host: int
    seconds: float
    to_host: int = 0
    late: int = 0


_INSTR = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) ([a-z][a-z0-9-]*)\(")


def host_copies(text: str) -> tuple[int, int]:
    """(copies to host memory, those that start in the backward) in the entry computation of a
    compiled, scheduled HLO module (`Compiled.as_text()`): instructions are listed in schedule order;
    a `copy-start` whose destination (first tuple element) is in memory space 5 (host) moves a value
    to host memory; the backward begins at the first instruction JAX named `transpose(...)`.

    # NOTE: a copy to host that starts in the backward means its device buffer lived through the
    # forward: XLA:GPU's scheduler places a copy-start just far enough before its one use (the copy
    # back) to hide the copy's latency, unless something in the forward needs the copy done.
    """
    lines = text.splitlines()
    try:
        start = next(i for i, l in enumerate(lines) if l.startswith("ENTRY"))
    except StopIteration:
        return 0, 0
    backward, n, late = False, 0, 0
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        backward = backward or "transpose(" in line.split('op_name="', 1)[-1].split('"', 1)[0] and "op_name=" in line
        if m.group(2) == "copy-start" and ":S(5)" in m.group(1).split("}, ", 1)[0]:
            n += 1
            late += backward
    return n, late


def model_config(model: str = "gpt2", preset: str = "d12", *, recompute: RecomputeConfig, **overrides):
    """The bench's model: bf16, chunked loss (128) unless overridden."""
    return family.get(model).config(preset, recompute=recompute, **{"dtype": "bfloat16", "loss_chunk": 128,
                                                                    **overrides})


def gradient(mcfg, batch: int, seq: int):
    """(`jax.grad` of the loss, its argument structs) for `mcfg` at (batch, seq)."""
    fam = family.of(mcfg)
    params = jax.eval_shape(lambda: fam.init_params(mcfg, jax.random.key(0)))
    x = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return jax.grad(lambda p, x, y: fam.loss_fn(p, mcfg, x, y)), (params, x, x)


def measure(setting: str, target: str, *, model: str = "gpt2", preset: str = "d12", batch: int = 8,
            seq: int = 1024, **overrides) -> Row:
    """Compile the gradient of `setting` for `target` and read device temp and host temp."""
    mcfg = model_config(model, preset, recompute=SETTINGS[setting], **overrides)
    fn, args = gradient(mcfg, batch, seq)
    t = time.perf_counter()
    compiled = targets.compile(fn, *args, target=target)
    seconds = time.perf_counter() - t
    cm = compiled_stats(compiled)
    n, late = host_copies(compiled.as_text())
    return Row(setting, cm.temp, cm.host_temp + cm.host_argument + cm.host_output, seconds, n, late)


def moved_bytes(setting: str, *, model: str = "gpt2", preset: str = "d12", batch: int = 8, seq: int = 1024,
                **overrides) -> int:
    """Bytes `setting` should keep in host memory, from the model's shapes: every layer's `qkv` and
    `mlp_up` (offload_names) or every layer's input (offload_inputs); 0 otherwise."""
    mcfg = model_config(model, preset, recompute=SETTINGS["full"], **overrides)
    layer, _ = family.of(mcfg).activation_bytes(mcfg, batch, seq)
    per_layer = {"offload_names": sum(layer.tagged[n] for n in NAMES),
                 "offload_inputs": layer.tagged["block_input"]}.get(setting, 0)
    return mcfg.n_layer * per_layer


def verdicts(rows: dict, moved: dict) -> dict:
    """{offload setting: (meets its bar?, why)} from measured rows {setting: Row}."""
    out = {}
    full, saved = rows["full"].temp, rows["save_names"].temp
    if "offload_names" in rows:
        r, bar = rows["offload_names"], (full + saved) / 2
        ok = r.temp <= bar and r.host >= HOST_SHARE * moved["offload_names"]
        out["offload_names"] = (ok, f"temp {r.temp / MiB:.1f} MiB vs midway {bar / MiB:.1f} MiB, host "
                                    f"{r.host / MiB:.1f} of {moved['offload_names'] / MiB:.1f} MiB")
    if "offload_inputs" in rows:
        r = rows["offload_inputs"]
        ok = r.temp <= full and r.host >= HOST_SHARE * moved["offload_inputs"]
        out["offload_inputs"] = (ok, f"temp {r.temp / MiB:.1f} MiB vs full {full / MiB:.1f} MiB, host "
                                     f"{r.host / MiB:.1f} of {moved['offload_inputs'] / MiB:.1f} MiB")
    return out


def main(argv=None) -> int:
    p = Parser(prog="python -m remat_lm.bench.offload", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="h200", type=common.target_name, help="a remat.planning.targets name: h200, a100-80g, v5e, ...")
    p.add_argument("--model", default="gpt2", choices=family.NAMES)
    p.add_argument("--preset", default="d12")
    p.add_argument("--batch", type=integer(1), default=8)
    p.add_argument("--seq", type=integer(1), default=1024)
    p.add_argument("--scan", action="store_true", help="scan over layers (scan_layers=True)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    a = p.parse_args(argv)
    wanted = [s.strip() for s in a.settings.split(",") if s.strip()]
    bad = [s for s in wanted if s not in SETTINGS]
    if bad:
        p.error(f"--settings: unknown {', '.join(bad)}; use {', '.join(SETTINGS)}")
    shape = dict(model=a.model, preset=a.preset, batch=a.batch, seq=a.seq, scan_layers=a.scan)
    t = targets.get(a.target)
    print(f"{a.model} {a.preset}, B={a.batch} T={a.seq}, bf16, loss_chunk 128, "
          f"{'scan' if a.scan else 'loop'} layers; jax.grad of the loss compiled by {t.compiler} for {t.hardware()}")
    print(f"{'setting':<16}{'device temp MiB':>17}{'host MiB':>11}{'moves MiB':>11}{'copies to host':>16}"
          f"{'late':>6}{'compile':>11}")
    rows, moved = {}, {}
    for s in wanted:
        rows[s], moved[s] = measure(s, a.target, **shape), moved_bytes(s, **shape)
        r = rows[s]
        print(f"{s:<16}{r.temp / MiB:>17.1f}{r.host / MiB:>11.1f}{moved[s] / MiB:>11.1f}{r.to_host:>16}{r.late:>6}"
              f"{f'{r.seconds:.1f} s':>11}", flush=True)
    if {"full", "save_names"} <= set(rows):
        for s, (ok, why) in verdicts(rows, moved).items():
            print(f"{s}: {'frees device memory' if ok else 'DOES NOT free device memory'} ({why})")
    return 0


if __name__ == "__main__":
    from remat_lm.bench.common import cli
    sys.exit(cli(main, "offload"))
