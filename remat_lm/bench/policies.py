"""The policy table: saved bytes, compiled temp bytes, step time and matmul FLOPs per remat setting.

    python -m remat_lm.bench.policies                                   # GPT-2, reference shape
    python -m remat_lm.bench.policies --model llama3 --preset ref --steps 7 --json out/policies.json
    python -m remat_lm.bench.policies --preset ref --n_layer 4 --seq 128 --batch 4
    python -m remat_lm.bench.policies --target cpu     # every column from this host (XLA:CPU)

The reference shape (`--preset ref`, `remat_lm.bench.common.REFERENCE`): 8 layers, C=256, 4 heads,
T=256, B=8, vocabulary 1024, float32. Other presets are the models' own (`d12`, `tiny`, `1b`, ...).
The memory columns (saved, temp) and the FLOPs come from `--target`'s compiler (default `h200`: XLA:GPU
for an H200, compiled with no device, `remat_lm.bench.common.compile_for`); the step times and the
losses from the same program compiled for this host and run here (`--no-time` leaves them out). Each
column's header says which compiler it is from. A progress bar on stderr counts the compiles and the
timed steps, with an estimate of what is left.

Every setting is compiled first and run once (its loss, which warms it up); then `--steps` timed
rounds, the settings round-robin (remat_lm.bench.common.interleaved_ms); the median is reported.
Where the target is not this host, a second process compiles the host's programs while this one
compiles the target's, and times them once both are done.
A step is the jitted `jax.value_and_grad(loss_fn)` on fixed random tokens, to
`block_until_ready`. Columns:
  saved      `remat.memory.saved_residuals(loss).intermediates`: what the backward keeps (no params)
  temp       XLA's temp buffer of the compiled step (`remat.memory.compiled_memory(jax.grad(loss)).temp`, give or take one buffer)
  step ms    median step time
  GFLOPs     the compiled step's matrix products (`remat.compiled.hlo_matmul_flops`, every loop iteration)
each also as a ratio to the `none` row; the bf16 rows are relative to the bf16 no-remat row.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from remat_lm.bench import common
from remat_lm.bench.common import (REFERENCE, REFERENCE_BATCH, MiB, Target, fmt, interleaved_ms, machine,
                          markdown_table, median, ratio, targets_markdown, cli)
from remat_lm.models import family
from remat import RecomputeConfig
from remat.planning import targets as rtargets
from remat.memory import building_for, compiled_stats, saved_residuals
from remat_lm.argtypes import Parser, config_label, integer

@dataclasses.dataclass(frozen=True)
class Setting:
    """One row: a recompute config in a compute dtype, its ratios taken against row `base`."""
    name: str
    recompute: RecomputeConfig
    dtype: str = "float32"
    base: str = "none"


def default_settings(n_layer: int) -> list[Setting]:
    """none, full, uniform 2, block L/2, selective core_attn, core_attn+mlp, dots, and bf16."""
    u, b = min(2, n_layer), max(1, n_layer // 2)
    full = lambda **kw: RecomputeConfig(granularity="full", **kw)
    return [
        Setting("none", RecomputeConfig()),
        Setting("full", full()),
        Setting(f"uniform {u}", full(method="uniform", num_layers=u)),
        Setting(f"block {b}", full(method="block", num_layers=b)),
        Setting("selective core_attn", RecomputeConfig(granularity="selective", modules=("core_attn",))),
        Setting("selective core_attn+mlp", RecomputeConfig(granularity="selective", modules=("core_attn", "mlp"))),
        Setting("policy dots", full(policy="dots")),
        Setting("none (bf16)", RecomputeConfig(), "bfloat16", base="none (bf16)"),
        Setting("policy bf16 (bf16)", full(policy="bf16"), "bfloat16", base="none (bf16)"),
    ]


def build_config(model: str = "gpt2", preset: str = "ref", *, n_layer=None, n_embd=None, n_head=None,
                 seq=None, vocab=None):
    """The model config for a preset (`ref` or one of the model's PRESETS) with overrides.

    Returns (config, seq): `seq` defaults to 256 for `ref`, else min(block_size, 1024).
    Example:
      >>> cfg, T = build_config("gpt2", "ref", n_layer=2, n_embd=32, seq=32)
    """
    fam = family.get(model)
    if preset == "ref":
        fields = dict(REFERENCE[model])
    elif preset in fam.presets:
        fields = dict(fam.presets[preset])
    else:
        raise SystemExit(f"unknown preset {preset!r} for {model}; use ref or one of {', '.join(fam.presets)}")
    for k, v in dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab).items():
        if v is not None:
            fields[k] = v
    if "n_kv_head" in fields and n_head is not None and fields["n_head"] % fields["n_kv_head"]:
        fields["n_kv_head"] = fields["n_head"]
    if seq is None:
        seq = 256 if preset == "ref" else min(fields["block_size"], 1024)
    fields["block_size"] = max(fields["block_size"], seq) if preset != "ref" else seq
    return fam.config_cls(**fields), seq


@dataclasses.dataclass
class Case:
    """A compiled setting: static memory figures and a `step()` that runs one timed step."""
    setting: Setting
    config: object
    saved: int | None
    temp: int | None
    flops: float | None
    step: object  # () -> None
    loss: float


def prepare(model: str, config, setting: Setting, params, idx, targets, target: str = "cpu",
            measure: bool = True) -> Case:
    """Trace, compile and measure one setting (saved residuals, compiled grad, the timed step) for
    `target` (a `remat.planning.targets` name); `step` and `loss` are None where the program cannot
    run here; without `measure` only the step and its loss (saved, temp and flops None)."""
    fam = family.get(model)
    cfg = dataclasses.replace(config, recompute=setting.recompute, dtype=setting.dtype)
    f = lambda p, i, t: fam.loss_fn(p, cfg, i, t)
    saved = None
    if measure:
        with building_for(rtargets.get(target).platform):
            saved = saved_residuals(f, params, idx, targets).intermediates
    compiled = common.compile_for(jax.value_and_grad(f), params, idx, targets, target=target)
    # NOTE: the timed step's own executable is measured, so that the memory and the time in a row
    # belong to one program and each setting compiles once (XLA:CPU compiles dominate this
    # benchmark's run time). The loss output adds at most one aligned buffer to the temp of
    # `compiled_memory(jax.grad(loss))` (tests/test_bench.py checks it on XLA:GPU).
    temp = flops = None
    if measure:
        stats = compiled_stats(compiled)
        temp, flops = stats.temp, stats.flops
    if not common.timed(target):
        return Case(setting, cfg, saved, temp, flops, None, None)
    loss = float(compiled(params, idx, targets)[0])

    def step():
        jax.block_until_ready(compiled(params, idx, targets))

    return Case(setting, cfg, saved, temp, flops, step, loss)


def inputs(config, batch: int, seq: int, seed: int = 0):
    """Float32 parameters and fixed random (idx, targets) of shape (batch, seq)."""
    params = family.of(config).init_params(config, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, config.vocab_size, size=(batch, seq + 1), dtype=np.int32)
    return params, jnp.asarray(toks[:, :-1]), jnp.asarray(toks[:, 1:])


def rows_from(cases: list[Case], times: dict) -> list[dict]:
    """One dict per setting with absolute figures and ratios to its base row."""
    by = {c.setting.name: c for c in cases}
    out = []
    for c in cases:
        ms = median(times[c.setting.name]) if c.setting.name in times else None
        base = by.get(c.setting.base, c)
        base_ms = median(times[base.setting.name]) if base.setting.name in times else None
        out.append(dict(setting=c.setting.name, recompute=config_label(c.setting.recompute),
                        dtype=c.setting.dtype, base=base.setting.name, loss=c.loss,
                        saved_bytes=c.saved, temp_bytes=c.temp, step_ms=ms, flops=c.flops,
                        step_ms_all=times.get(c.setting.name),
                        saved_ratio=ratio(c.saved, base.saved), temp_ratio=ratio(c.temp, base.temp),
                        time_ratio=ratio(ms, base_ms), flops_ratio=ratio(c.flops, base.flops)))
    return out


def table(rows: list[dict], memory: str = "", time: str = "") -> str:
    """The rows as markdown; `memory` and `time` name the compilers of the memory and the time
    columns in their headers ("XLA:GPU", "XLA:CPU, this host")."""
    m, t = (f" ({memory})" if memory else ""), (f" ({time})" if time else "")
    header = ["setting", "recompute", "dtype", f"saved MiB{m}", "× none", f"temp MiB{m}", "× none",
              f"step ms{t}", "× none", f"GFLOPs{m}", "× none"]
    body = [[r["setting"], r["recompute"], r["dtype"], fmt(r["saved_bytes"] / MiB, ".1f"),
             fmt(r["saved_ratio"]), fmt(r["temp_bytes"] / MiB, ".1f"), fmt(r["temp_ratio"]),
             fmt(r["step_ms"], ".0f"), fmt(r["time_ratio"]), fmt(None if r["flops"] is None else r["flops"] / 1e9, ".1f"),
             fmt(r["flops_ratio"])] for r in rows]
    return markdown_table(header, body)


def evaluate(rows: list[dict]) -> list[Target]:
    """The targets: full ≤ 1.30× time; selective core_attn ≤ 1.05× time and ≥ 40% fewer saved bytes."""
    by = {r["setting"]: r for r in rows}
    out = []
    if "full" in by and by["full"]["time_ratio"] is not None:
        t = by["full"]["time_ratio"]
        out.append(Target("full remat step time ≤ 1.30× none", f"{t:.2f}×", t <= 1.30))
    if "selective core_attn" in by:
        r = by["selective core_attn"]
        if r["time_ratio"] is not None:
            out.append(Target("selective core_attn step time ≤ 1.05× none", f"{r['time_ratio']:.2f}×",
                              r["time_ratio"] <= 1.05))
        fewer = 1.0 - r["saved_ratio"]
        met = fewer >= 0.40
        # NOTE: Megatron's 40% comes from dropping the (B, H, T, T) softmax probabilities (and
        # their dropout mask), 5as/h of its 34+5as/h bytes per token. remat_lm/models/layers.py's attention
        # is flash-style: even with no remat it keeps q, k, v and the log-sum-exp, never the
        # probabilities, so there is nothing of that size left for core_attn to drop.
        note = "" if met else ("the models' flash-style attention never saves the (B,H,T,T) probabilities, even "
                               "without remat; core_attn has only the small untagged values (norm statistics, "
                               "log-sum-exp) left to recompute")
        out.append(Target("selective core_attn saves ≥ 40% fewer bytes than none",
                          f"{100 * fewer:.1f}% fewer", met, note))
    return out


def run(model: str = "gpt2", preset: str = "ref", *, n_layer=None, n_embd=None, n_head=None, seq=None,
        batch=None, vocab=None, steps: int = 5, settings: list[Setting] | None = None, target: str = "cpu",
        time_here: bool = False, log=None, progress: bool = False) -> dict:
    """Measure every setting in one process, interleaved; returns {"meta", "rows", "targets"}.

    Memory figures and FLOPs are `target`'s compiler's; step times and losses are this host's, from
    the program built for `target` when it runs here, else (with `time_here`) from the same
    setting compiled for this host; `progress` shows a tqdm bar.

    Example:
      >>> res = run("gpt2", "ref", n_layer=2, n_embd=32, seq=32, batch=2, steps=2)
      >>> res["rows"][0]["saved_ratio"]
      1.0
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    info = machine()  # date and load average at the start
    config, seq = build_config(model, preset, n_layer=n_layer, n_embd=n_embd, n_head=n_head, seq=seq, vocab=vocab)
    batch = batch or REFERENCE_BATCH
    settings = settings or default_settings(config.n_layer)
    params, idx, targets = inputs(config, batch, seq)
    here = common.timed(target)
    hosted = here or time_here  # step times from this host
    bar = tqdm(total=len(settings) * (1 + (time_here and not here)) + (len(settings) * steps if hosted else 0),
               desc="bench", unit="step", file=sys.stderr, disable=not progress, dynamic_ncols=True, leave=False)
    # The host's programs are compiled by a second process while this one compiles for the target;
    # it times them once both are done, this process idle (`_host_worker`).
    worker = _HostWorker(model, config, settings, batch, seq, steps) if time_here and not here else None
    cases = []
    for s in settings:
        bar.set_postfix_str(f"compiling {s.name}", refresh=True)
        if not progress:
            log(f"compiling {s.name} ...")
        cases.append(prepare(model, config, s, params, idx, targets, target))
        bar.update(1 + (worker.progress() if worker else 0))
    times = {}
    if worker:
        bar.set_postfix_str("compiling for this host", refresh=True)
        if not progress:
            log(f"timing {len(cases)} settings on this host, {steps} interleaved rounds ...")
        times, losses = worker.finish(lambda n: bar.update(n), lambda: bar.set_postfix_str(
            f"timing, {steps} interleaved rounds", refresh=True))
        cases = [dataclasses.replace(c, loss=losses[c.setting.name]) for c in cases]
    elif here:
        bar.set_postfix_str(f"timing, {steps} interleaved rounds", refresh=True)
        if not progress:
            log(f"timing {len(cases)} settings, {steps} interleaved rounds ...")
        # NOTE: no warm-up round: `prepare` ran each program once already (its loss), so every timed
        # step is a second or later run of its executable.
        times = interleaved_ms({c.setting.name: c.step for c in cases}, n=steps, warmup=0,
                               tick=lambda: bar.update(1))
    bar.close()
    rows = rows_from(cases, times)
    meta = dict(info, model=model, preset=preset, seq=seq, batch=batch, steps=steps, source=common.source(target),
                time_source=common.source(target if here else "cpu") if hosted else None,
                config={k: v for k, v in dataclasses.asdict(config).items() if k != "recompute"}, command=None)
    return {"meta": meta, "rows": rows, "targets": [dataclasses.asdict(t) for t in evaluate(rows)]}


class _HostWorker:
    """Compile every setting for this host (XLA:CPU) and time them, in a spawned process."""

    def __init__(self, model, config, settings, batch, seq, steps):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_host_worker, args=(child, model, config, settings, batch, seq, steps),
                                daemon=True)
        self.proc.start()
        child.close()
        self.ready = False

    def _handle(self, msg) -> int:
        """Take one message; returns the host compiles or steps it reports finished (0 or 1)."""
        if msg[0] == "error":
            raise RuntimeError(f"timing on this host failed: {msg[1]}")
        self.ready = self.ready or msg[0] == "ready"
        return int(msg[0] == "tick")

    def progress(self) -> int:
        """The host compiles and steps finished since the last call, without waiting."""
        n = 0
        while self.conn.poll():
            n += self._handle(self.conn.recv())
        return n

    def finish(self, tick, timing) -> tuple[dict, dict]:
        """Wait for the host's compiles, then let it time: ({name: [ms]}, {name: loss})."""
        try:
            while not self.ready:
                tick(self._handle(self._recv()))
            timing()
            self.conn.send("go")
            while (msg := self._recv())[0] != "done":
                tick(self._handle(msg))
            return msg[1], msg[2]
        finally:
            self.proc.join(timeout=10)

    def _recv(self):
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(f"timing on this host failed: its process exited with {self.proc.exitcode}") from None


def _host_worker(conn, model, config, settings, batch, seq, steps) -> None:
    try:
        params, idx, targets = inputs(config, batch, seq)
        cases = []
        for s in settings:
            cases.append(prepare(model, config, s, params, idx, targets, "cpu", measure=False))
            conn.send(("tick",))
        conn.send(("ready",))
        conn.recv()  # "go": the other process is done compiling
        # no warm-up round: `prepare` ran each program once already (its loss)
        times = interleaved_ms({c.setting.name: c.step for c in cases}, n=steps, warmup=0,
                               tick=lambda: conn.send(("tick",)))
        conn.send(("done", times, {c.setting.name: c.loss for c in cases}))
    except Exception as e:  # reported by the parent, which exits with its message
        conn.send(("error", f"{type(e).__name__}: {e}"))


def report(res: dict) -> str:
    m = res["meta"]
    c = m["config"]
    src = m.get("source") or common.source("cpu")
    tsrc = m.get("time_source") or (src if src["timed"] else None)
    timing = (f"; step times on this host ({tsrc['compiler']}), median of {m['steps']} interleaved steps after "
              f"one untimed run each" if tsrc else "")
    where = common.source_line(src, timed_elsewhere=tsrc is not None)
    shape = (f"{m['model']} preset {m['preset']}: {c['n_layer']} layers, C={c['n_embd']}, {c['n_head']} heads, "
             f"T={m['seq']}, B={m['batch']}, vocab {c['vocab_size']}; memory {where}{timing}; "
             f"jax {m['jax']} on {m['backend']} ({m['nproc']} CPUs, "
             f"{common.load_note(m)})")
    mem = src["compiler"]
    tim = f"{tsrc['compiler']}, this host" if tsrc else "not run"
    return "\n".join([shape, "", table(res["rows"], mem, tim), "",
                      "bf16 rows are relative to `none (bf16)` (bfloat16 compute, float32 parameters).", "",
                      "Targets:", targets_markdown([Target(**t) for t in res["targets"]])])


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m remat_lm.bench.policies", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=family.NAMES, default="gpt2")
    p.add_argument("--preset", default="ref", help="ref (the reference shape) or a model preset (d12, tiny, 1b, ...)")
    for k in ("n_layer", "n_embd", "n_head", "seq", "batch", "vocab"):
        p.add_argument(f"--{k}", type=integer(1), default=None, help=f"override {k}")
    p.add_argument("--steps", type=integer(1), default=5,
                   help="timed interleaved rounds (median reported; >= 5 for a report)")
    p.add_argument("--json", default=None, help="also write meta, rows and targets here")
    p.add_argument("--time", action=argparse.BooleanOptionalAction, default=True,
                   help="also time each setting on this host (compiled for it) when --target is not this host")
    common.add_target(p, default="h200")
    return p


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    res = run(a.model, a.preset, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head, seq=a.seq,
              batch=a.batch, vocab=a.vocab, steps=a.steps, target=a.target, time_here=a.time,
              progress=True)
    return common.publish(res, report, "remat_lm.bench.policies", argv, a.json)


if __name__ == "__main__":
    sys.exit(cli(main, "policies"))
