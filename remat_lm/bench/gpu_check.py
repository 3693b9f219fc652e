"""GPU check: GPT-2 d12, T=1024, bf16 compute, chunked loss; memory, speed, MFU and the largest batch per setting.

    bash remat_lm/bench/gpu_check.sh                      # on the GPU machine (make gpu-check)
    python -m remat_lm.bench.gpu_check --smoke --out /tmp/gc   # tiny shape, any backend (the test runs this)

For none / full / uniform 2 / block L/2 (6 for d12) / selective core_attn / offload mlp, each in its
own process (so that `peak_bytes_in_use`, which only ever grows, belongs to that setting alone),
all with the chunked LM head and loss (`--loss_chunk 128`: the (B, T, V) float32 logits, 196 MiB
per sequence, would otherwise bound every setting alike):
  1. compile the step (`jax.value_and_grad(loss_fn)`, jitted) at `--batch`, run 2 warm-up steps
     and `--steps` timed ones: median step ms, tokens/s, MFU against `--peak_tflops` (H200 bf16
     dense: 989) with `remat_lm.models.gpt2.flops_per_token`, and the device's `peak_bytes_in_use`;
  2. the largest batch that fits, searched from the analytic model's prediction for the device's
     `bytes_limit` (`analytic`, `predicted_batch`): 0.9× the prediction, then ×1.25 until a step
     fails with XLA's RESOURCE_EXHAUSTED (or ×0.7 until one fits), then `--bisect` bisections for
     none and full (the batch target's rows; 2: within ~6%), `--bisect_other` (0) for the others,
     whose largest batch is then bracketed within 25%. Without a `bytes_limit` (CPU) it doubles
     from `--batch`. A search that runs out of its time share stops and reports a lower bound.
Results go to `$OUT` if set, else out/gpu_check (`--out` overrides): gpu_check.md (the table and
the targets) and gpu_check.json, rewritten after every setting so a cut-off run keeps what it has.

Sizing (default flags): the settings share a 400 s budget in proportion to their predicted cost
(`predicted_cost`: compilations at an assumed 15 s each, one for timing plus 2 + bisections for the
search, and the steps at 35% MFU): ~80 s for none and full, ~50 s for the others, 362 s in all. A
worker past its share plus 30 s is killed, so the whole run stays under 8 minutes on one H200
(budget + grace + JAX start-up). The .sh sets XLA_PYTHON_CLIENT_PREALLOCATE=false so peak
statistics are the program's own.

Targets, restated from what the analytic model says is possible (`targets_from_model`; each asks
90% of the model's figure, in place of the fixed goals 45% / 0.72× / 4×):
  - MFU without remat ≥ 41%: 45% discounted by the FLOPs executed beyond the model's (the chunked
    head's second forward, 2·Vp·C per token: 0.876 vs 0.799 GFLOP/token).
  - full remat throughput ≥ 0.74× none: 90% of the executed-FLOPs ratio 0.876 / 1.065 (full
    recomputes every layer's forward, 24·C² + 2·C·T per token and layer).
  - full remat fits ≥ 2.2× the batch of none: 90% of the ratio of bytes per sequence, 411.8 vs
    165.1 MiB: what the backward keeps (none 291.8, full 21.0 MiB, remat_lm/models/memory_model.py) plus
    its largest transient, which both share: the attention core's rebuilt (12, 1024, 1024)
    probabilities and their float32 gradient with the bf16 scores' gradient (120 MiB), and for full
    the recomputed layer (24 MiB). Not 4×: without the chunked loss the float32 logits (196 MiB
    per sequence saved, and the backward's (T, Vp) working set of 491 MiB) give 979.5 vs 732.8 MiB,
    1.34×; with it, the attention core's T² backward scratch, which no layer remat removes, caps
    the ratio at 2.49×. Predicted largest batches at a 132 GiB limit: none 325, full 813 (unchunked:
    136 and 183).

Attention rows (`attention_settings`): the tiled core against cuDNN flash attention, none and
full remat, timed and MFU only (no batch search: a compile and 12 steps each), run first so that
the time they leave unused goes to the searches. Where cuDNN cannot run (CPU, float32) its rows
say so ("unavailable") instead of failing the run. Two more rows: `attn tiled@512 full` (the tile
`auto` gives the tiled core on a GPU) and `cpu_checkpointing` (timed only as well: its peak bytes in
use at --batch against `full`'s shows whether the offloaded region inputs stay on the host until
the backward reaches them).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import time

from remat_lm.bench.common import GiB, Target, fmt, markdown_table, targets_markdown, cli
from remat.memory import compiled_stats
from remat_lm.training.checks import is_oom
from remat_lm.argtypes import Parser, integer, real

H200_BF16_TFLOPS = 989.0  # dense bf16 peak (NVIDIA H200 SXM datasheet)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the workers run from the repository root


def settings(n_layer: int) -> dict:
    """{name: RecomputeConfig kwargs}: none, full, uniform 2, block L/2, selective core_attn, and an
    offload row (the MLP's tagged activations to pinned host memory) whose device peak should fall."""
    u, b = min(2, n_layer), max(1, n_layer // 2)
    return {"none": {}, "full": dict(granularity="full"),
            f"uniform {u}": dict(granularity="full", method="uniform", num_layers=u),
            f"block {b}": dict(granularity="full", method="block", num_layers=b),
            "selective core_attn": dict(granularity="selective", modules=("core_attn",)),
            "offload mlp": dict(granularity="full", policy="custom:qkv=device,attn_context=device,"
                                                          "mlp_up=offload,mlp_act=offload")}


def attention_settings() -> dict:
    """{name: (attention core, RecomputeConfig kwargs)}: tiled vs cudnn, none and full remat, and
    the tiled core at the tile `auto` gives it on a GPU ("tiled@512": core@tile)."""
    from remat_lm.models.attention import GPU_TILE
    rows = {f"attn {core} {rc}": (core, {} if rc == "none" else dict(granularity="full"))
            for core in ("tiled", "cudnn") for rc in ("none", "full")}
    return {**rows, f"attn tiled@{GPU_TILE} full": (f"tiled@{GPU_TILE}", dict(granularity="full"))}


def timed_settings() -> dict:
    """{name: (attention core, RecomputeConfig kwargs)} of the rows timed at --batch without a batch
    search: the attention rows, and `cpu_checkpointing`, full remat with the region
    inputs in pinned host memory, copied back only once the backward reaches them
    (remat/checkpoint.py `_load`): its peak bytes in use should fall below `full`'s."""
    return {**attention_settings(), "cpu_checkpointing": ("auto", dict(granularity="full", offload_inputs=True))}


def _all_settings(n_layer: int) -> dict:
    """{name: (attention core, RecomputeConfig kwargs)} of every row, the timed-only rows first."""
    return {**timed_settings(), **{k: ("auto", v) for k, v in settings(n_layer).items()}}


def largest_batch(fits, start: int, cap: int, *, bisect: int = 3, deadline: float | None = None,
                  clock=time.monotonic, guess: int | None = None) -> dict:
    """Doubling from `start` (known to fit), then bisection; stops at `cap` or `deadline`.

    With a `guess` (the analytic model's largest batch), the first trial is 0.9·guess and each
    next one grows by 1.25× until one fails (or shrinks by 0.7× until one fits, when the first
    fails): about 2 trials + `bisect` when the guess is good, instead of log2(guess/start) + `bisect`.

    Args:
      fits: batch -> bool (False when the step runs out of memory).
      start: a batch known to fit; cap: the largest batch tried.
      bisect: bisection steps after the first failure.
      deadline: a `clock()` time after which no new trial starts (the result is then a lower bound).
      guess: a predicted largest batch, or None to double from `start`.
    Returns:
      {"max_batch": largest batch seen to fit, "first_fail": smallest seen to fail (or None),
       "capped": reached `cap`, "complete": the search ran to its end, "tried": [(batch, fit)]}.
    Example:
      >>> largest_batch(lambda b: b <= 40, 8, 512)["max_batch"]
      40
    """
    tried, lo, hi = [], start, None
    out_of_time = lambda: deadline is not None and clock() >= deadline
    b = start
    seeded = guess is not None and int(0.9 * guess) > start
    while hi is None and b < cap:
        if out_of_time():
            return dict(max_batch=lo, first_fail=None, capped=False, complete=False, tried=tried)
        if seeded:
            b = min(int(0.9 * guess) if not tried else max(b + 1, int(1.25 * b)), cap)
        else:
            b = min(2 * b, cap)
        ok = fits(b)
        tried.append((b, ok))
        if ok:
            lo = b
        else:
            hi = b
    if hi is None:
        return dict(max_batch=lo, first_fail=None, capped=lo >= cap, complete=True, tried=tried)
    while seeded and lo == start and int(0.7 * hi) > start:  # the guess was too high: step down
        if out_of_time():
            return dict(max_batch=lo, first_fail=hi, capped=False, complete=False, tried=tried)
        b = int(0.7 * hi)
        ok = fits(b)
        tried.append((b, ok))
        lo, hi = (b, hi) if ok else (lo, b)
    for _ in range(bisect):
        if hi - lo <= 1:
            break
        if out_of_time():
            return dict(max_batch=lo, first_fail=hi, capped=False, complete=False, tried=tried)
        mid = (lo + hi) // 2
        ok = fits(mid)
        tried.append((mid, ok))
        lo, hi = (mid, hi) if ok else (lo, mid)
    return dict(max_batch=lo, first_fail=hi, capped=False, complete=True, tried=tried)


# ------------------------------------------------------------------------------------------------
# Sizing: what the analytic model says each setting keeps, needs at its peak, costs and fits.

COMPILE_S = 15.0      # assumed seconds per compilation of the d12 step on the H200 host (time shares)
TARGET_ROWS = ("none", "full")  # the rows the batch target compares: searched with --bisect, others --bisect_other
ASSUMED_MFU = 0.35    # assumed for the step-time estimates of the time shares (not a target)
TARGET_SHARE = 0.9    # each target asks 90% of what the analytic model says is possible
NOMINAL_LIMIT = 0.95 * 139 * GiB  # the H200's allocator limit at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (shares only)


def analytic(a, recompute_kwargs) -> dict:
    """Per-sequence and fixed bytes of one jitted `value_and_grad` step, and its executed FLOPs.

    saved_per_seq: what the backward keeps per sequence (remat_lm/models/memory_model.py, `predict_saved`;
      for an offload policy what stays on the device). work_per_seq: the largest transient of the
      backward per sequence: the attention core's rebuilt (H, T, T) probabilities and their
      gradient in float32 plus the scores' gradient in the compute dtype, or the LM head's
      (chunk or T, Vp) logits, their gradient and its cast, whichever is larger, plus the
      activations of the largest rematerialized region while it is recomputed. fixed: float32
      parameters and gradients, and what the saved bytes hold whatever the batch (bf16 weight
      casts). flops_per_token: `remat_lm.models.gpt2.flops_per_token` plus what is executed again: the
      head's forward per chunked token (2·Vp·C) and the forward of every rematerialized layer
      (24·C² + 2·C·T per token).
    """
    import jax
    import jax.numpy as jnp

    from remat_lm.models import gpt2, memory_model
    from remat import RecomputeConfig, policies, regions
    from remat.memory import predict_saved

    cfg = _model_config(a, recompute_kwargs)
    rc, L, T, C = cfg.recompute, cfg.n_layer, a.seq, cfg.n_embd
    rule = policies.by_name(rc.effective_policy()) if rc.enabled and not isinstance(rc.layers, regions.PerLayer) else None
    if rule is not None and rule.offload:  # the device keeps what the policy saves
        rc = RecomputeConfig(**{**recompute_kwargs, "policy": policies.Policy(save=rule.save)})
    saved = []
    for b in (1, 2):
        layer, head = memory_model.activation_bytes(cfg, b, T)
        saved.append(predict_saved(layer, L, rc, head - b * T * 4))  # token ids are arguments
    per_seq = saved[1] - saved[0]
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    attn = cfg.n_head * T * T * (4 + 4 + itemsize)
    head_rows = min(cfg.loss_chunk, T) if cfg.loss_chunk else T
    head = head_rows * cfg.padded_vocab_size * (4 + 4 + itemsize)
    layer_total = memory_model.activation_bytes(cfg, 2, T)[0].total - memory_model.activation_bytes(cfg, 1, T)[0].total
    segs = [sg for sg in cfg.recompute.split(L) if sg.checkpointed] if cfg.recompute.enabled else []
    full_layers = [sg.stop - sg.start for sg in segs] if cfg.recompute.granularity == "full" else []
    region = max(full_layers, default=0) * layer_total
    flops = gpt2.flops_per_token(cfg, T) + (2 * cfg.padded_vocab_size * C if cfg.loss_chunk else 0)
    flops += sum(full_layers) * (24 * C * C + 2 * C * T)
    return dict(saved_per_seq=per_seq, work_per_seq=max(attn, head) + region,
                per_seq=per_seq + max(attn, head) + region,
                fixed=8 * gpt2.num_params(cfg) + saved[0] - per_seq, flops_per_token=flops,
                model_flops_per_token=gpt2.flops_per_token(cfg, T))


def predicted_batch(model: dict, limit: float) -> int:
    """The largest batch the analytic model fits in `limit` bytes."""
    return max(1, int((limit - model["fixed"]) // model["per_seq"]))


def bisections(a, name: str) -> int:
    return a.bisect if name in TARGET_ROWS else a.bisect_other


def predicted_cost(a, name: str, model: dict, limit: float) -> float:
    """Seconds one worker needs: its compilations (timing + seeded search) and its steps."""
    step = lambda b: b * a.seq * model["flops_per_token"] / (ASSUMED_MFU * a.peak_tflops * 1e12)
    if name in timed_settings():  # timed only, no batch search
        # NOTE: two compilations' worth: the tiled core unrolls T/tile query blocks per layer in
        # the forward and the backward, so its compile is the slowest of any row.
        return 2 * COMPILE_S + (2 + a.steps) * step(a.batch)
    guess = predicted_batch(model, limit)
    trials = [int(0.9 * guess), int(1.125 * guess)] + [guess] * bisections(a, name)
    return (1 + len(trials)) * COMPILE_S + (2 + a.steps) * step(a.batch) + sum(step(b) for b in trials)


# ------------------------------------------------------------------------------------------------
# Worker: one setting, in its own process.

def _model_config(a, recompute_kwargs):
    from remat_lm.models import gpt2
    from remat import RecomputeConfig
    over = dict(dtype=a.dtype, recompute=RecomputeConfig(**recompute_kwargs), loss_chunk=a.loss_chunk)
    if a.n_layer:
        over["n_layer"] = a.n_layer
    if a.n_embd:
        over.update(n_embd=a.n_embd)
    if a.n_head:
        over.update(n_head=a.n_head)
    cfg = gpt2.GPT2Config.preset(a.preset, **over)
    if a.seq > cfg.block_size:
        cfg = dataclasses.replace(cfg, block_size=a.seq)
    return cfg


def worker(a) -> dict:
    """Measure one setting (`a.worker`) and return its row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from remat_lm.models import gpt2

    t_start = time.monotonic()
    deadline = t_start + a.seconds if a.seconds else None
    n_layer = a.n_layer or gpt2.PRESETS[a.preset]["n_layer"]
    core, recompute = _all_settings(n_layer)[a.worker]
    attention_row = a.worker in attention_settings()
    timed_row = a.worker in timed_settings()
    core, _, tile = core.partition("@")
    cfg = dataclasses.replace(_model_config(a, recompute), attention=core)
    if tile:
        cfg = dataclasses.replace(cfg, attention_tile=int(tile))
    dev = jax.local_devices()[0]
    T = a.seq
    # parameters do not depend on the attention core: initialize with one that runs everywhere
    params = jax.jit(lambda k: gpt2.init_params(dataclasses.replace(cfg, attention="tiled"), k))(jax.random.key(0))
    step = jax.jit(jax.value_and_grad(lambda p, i, t: gpt2.loss_fn(p, cfg, i, t)))

    def tokens(b):
        toks = jax.random.randint(jax.random.key(b), (b, T + 1), 0, cfg.vocab_size, jnp.int32)
        return toks[:, :-1], toks[:, 1:]

    row = dict(setting=a.worker, batch=a.batch, seq=T, device=str(dev), platform=dev.platform,
               jax=jax.__version__, error=None, loss_chunk=a.loss_chunk)
    limit = (dev.memory_stats() or {}).get("bytes_limit")
    model = analytic(a, recompute)
    row["predicted_batch"] = predicted_batch(model, limit) if limit else None  # seeds the search
    idx, tgt = tokens(a.batch)
    t0 = time.monotonic()
    try:
        lowered = step.lower(params, idx, tgt)
    except ValueError as e:  # an attention core that cannot run here (cuDNN on a CPU)
        if not attention_row:
            raise
        return dict(row, unavailable=str(e), wall_s=time.monotonic() - t_start)
    compiled = lowered.compile()
    row["compile_s"] = time.monotonic() - t0
    stats = compiled_stats(compiled)
    row["temp_bytes"], flops = stats.temp, stats.flops
    for _ in range(2):
        jax.block_until_ready(compiled(params, idx, tgt))
    ms = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, idx, tgt))
        ms.append((time.perf_counter() - t0) * 1e3)
    stats = dev.memory_stats() or {}
    row.update(step_ms=float(np.median(ms)), step_ms_all=ms,
               peak_bytes_in_use=stats.get("peak_bytes_in_use"), bytes_limit=stats.get("bytes_limit"))
    row["tokens_per_s"] = a.batch * T / (row["step_ms"] / 1e3)
    row["flops_per_token"] = gpt2.flops_per_token(cfg, T)
    row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / (a.peak_tflops * 1e12)
    row["xla_flops_per_token"] = flops / (a.batch * T)
    del compiled, idx, tgt

    def fits(b):
        i, t = tokens(b)
        try:
            c = step.lower(params, i, t).compile()
            jax.block_until_ready(c(params, i, t))
            return True
        except Exception as e:  # XLA raises XlaRuntimeError / ValueError subclasses
            if not is_oom(e):
                raise
            return False
        finally:
            del i, t
            gc.collect()

    # NOTE: no new trial starts once less time is left than the slowest trial so far (a compile
    # plus one step), so the worker ends inside its share of the budget.
    trial_s = [row["compile_s"]]

    def timed_fits(b):
        t0 = time.monotonic()
        ok = fits(b)
        trial_s.append(time.monotonic() - t0)
        return ok

    clock = lambda: time.monotonic() + max(trial_s)
    if timed_row:  # timed only: no batch search
        row.update(search=None, max_batch=None, wall_s=time.monotonic() - t_start)
        return row
    row["search"] = largest_batch(timed_fits, a.batch, a.max_batch, bisect=bisections(a, a.worker), deadline=deadline,
                                  clock=clock,
                                  guess=row["predicted_batch"])
    row["max_batch"] = row["search"]["max_batch"]
    row["wall_s"] = time.monotonic() - t_start
    return row


# ------------------------------------------------------------------------------------------------
# Parent: runs the workers, writes the table and the JSON.

def targets_from_model(models: dict) -> dict:
    """The targets, each TARGET_SHARE of what the analytic model says is possible (see `analytic`):
    MFU without remat: 45% of peak discounted by the FLOPs executed beyond the model's (the chunked
    head's second forward); full remat's throughput: the ratio of executed FLOPs per token, none
    over full; full remat's largest batch over none's: the ratio of their bytes per sequence (the
    limit → ∞ form of `predicted_batch`, within 1% of it at the H200's limit)."""
    n, f = models.get("none"), models.get("full")
    if not (n and f):
        return {}
    return {"mfu": 0.45 * n["model_flops_per_token"] / n["flops_per_token"],
            "throughput": TARGET_SHARE * n["flops_per_token"] / f["flops_per_token"],
            "batch": TARGET_SHARE * n["per_seq"] / f["per_seq"]}


def evaluate(rows: dict, goals: dict | None = None) -> list[Target]:
    """MFU without remat, full remat's throughput and largest batch relative to none, against
    `goals` (`targets_from_model`; the fixed goals 45%, 0.72× and 4× when None)."""
    goals = goals or {"mfu": 0.45, "throughput": 0.72, "batch": 4.0}
    n, f = rows.get("none"), rows.get("full")
    out = []
    if n and n.get("mfu") is not None:
        out.append(Target(f"MFU ≥ {100 * goals['mfu']:.0f}% without remat", f"{100 * n['mfu']:.1f}%",
                          n["mfu"] >= goals["mfu"]))
    if n and f and n.get("tokens_per_s") and f.get("tokens_per_s"):
        r = f["tokens_per_s"] / n["tokens_per_s"]
        out.append(Target(f"full remat throughput ≥ {goals['throughput']:.2f}× none", f"{r:.2f}×",
                          r >= goals["throughput"]))
    if n and f and n.get("max_batch") and f.get("max_batch"):
        r = f["max_batch"] / n["max_batch"]
        bound = ""
        if f["search"]["capped"] or not f["search"]["complete"]:
            bound = "full's search stopped at its cap or time budget: a lower bound"
        if not n["search"]["complete"] or n["search"]["capped"]:
            bound = (bound + "; " if bound else "") + "none's largest batch is a lower bound"
        out.append(Target(f"full remat fits ≥ {goals['batch']:.1f}× the batch of none",
                          f"{f['max_batch']} vs {n['max_batch']} ({r:.2f}×)", r >= goals["batch"], bound))
    return out


def report(meta: dict, rows: dict) -> str:
    lim = next((r.get("bytes_limit") for r in rows.values() if r.get("bytes_limit")), None)
    limit = "" if lim is None else f" (allocator limit {lim / GiB:.1f} GiB)"
    header = ["setting", "peak GiB", "temp GiB", "step ms", "tokens/s", "MFU", "largest batch", "predicted",
              "compile s"]
    body = []
    for name, r in rows.items():
        if r.get("error"):
            body.append([name, "—", "—", "—", "—", "—", "—", "—", f"error: {r['error'][:80]}"])
            continue
        if r.get("unavailable"):
            body.append([name, "—", "—", "—", "—", "—", "—", f"unavailable: {r['unavailable'][:100]}"])
            continue
        s = r["search"]
        mb = "— (not searched)" if s is None else (
            f"{r['max_batch']}" + (" (cap)" if s["capped"] else "" if s["complete"] else " (≥, out of time)"))
        if s is not None and s["complete"] and not s["capped"] and s.get("first_fail") and s["first_fail"] > r["max_batch"] + 1:
            mb += f" (< {s['first_fail']})"
        body.append([name, fmt(None if r["peak_bytes_in_use"] is None else r["peak_bytes_in_use"] / GiB),
                     fmt(r["temp_bytes"] / GiB), fmt(r["step_ms"], ".1f"), fmt(r["tokens_per_s"], ",.0f"),
                     f"{100 * r['mfu']:.1f}%", mb, r.get("predicted_batch") or "—", fmt(r["compile_s"], ".1f")])
    lines = [f"GPT-2 {meta['preset']} ({meta['n_layer']} layers), T={meta['seq']}, B={meta['batch']}, "
             f"{meta['dtype']} compute, loss_chunk {meta.get('loss_chunk', 0)}; {meta['steps']} timed steps after 2 warm-up; MFU against "
             f"{meta['peak_tflops']:g} TFLOP/s; largest batch searched up to {meta['max_batch']}; "
             f"device {meta.get('device', '?')}{limit}; {meta['date']}", "",
             markdown_table(header, body), "",
             "peak = `device.memory_stats()['peak_bytes_in_use']` of the setting's own process (params, grads, "
             "activations, workspace); temp = XLA's compiled temp buffer; a step is jitted "
             "`value_and_grad(loss_fn)` (no optimizer); predicted = the analytic model's largest batch at the "
             "device's limit (`analytic`), where the search starts.", "",
             "Targets: (90% of what the analytic model says is possible; the fixed goals 45% / 0.72× / 4× "
             "restated, see the module docstring)",
             targets_markdown(evaluate(rows, meta.get("goals"))) or "- (no rows)"]
    return "\n".join(lines)


def _last_error(text: str, returncode: int) -> str:
    """The last `SomethingError: message` line of a worker's output (JAX appends notes after it)."""
    lines = [l.strip() for l in text.strip().splitlines()]
    hits = [l for l in lines if re.match(r"^[\w.]+(Error|Exception|Exhausted)\b.*:", l)]
    return (hits or lines or [f"exit {returncode}"])[-1]


def _write(out_dir: str, meta: dict, rows: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "targets": [dataclasses.asdict(t) for t in evaluate(rows, meta.get("goals"))]}, f, indent=1)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(report(meta, rows) + "\n")


def parent(a) -> int:
    import datetime
    out_dir = os.path.abspath(a.out or os.environ.get("OUT") or os.path.join("out", "gpu_check"))
    from remat_lm.models.gpt2 import PRESETS  # models/ imports no device: the parent leaves the GPU to the workers
    n_layer = a.n_layer or PRESETS[a.preset]["n_layer"]
    names = list(_all_settings(n_layer))
    if a.settings:
        names = [s.strip() for s in a.settings.split(",") if s.strip()]
        bad = [s for s in names if s not in _all_settings(n_layer)]
        if bad:
            raise SystemExit(f"unknown setting(s) {bad}; valid: {', '.join(_all_settings(n_layer))}")
    meta = dict(preset=a.preset, n_layer=n_layer, seq=a.seq, batch=a.batch, dtype=a.dtype, steps=a.steps,
                max_batch=a.max_batch, bisect=a.bisect, bisect_other=a.bisect_other, peak_tflops=a.peak_tflops,
                budget_s=a.budget_s, loss_chunk=a.loss_chunk,
                date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                command="bash remat_lm/bench/gpu_check.sh " + " ".join(sys.argv[1:]),
                env={k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                    "XLA_CLIENT_MEM_FRACTION", "XLA_FLAGS", "JAX_PLATFORMS")})
    every = _all_settings(n_layer)
    models = {name: analytic(a, every[name][1]) for name in names}
    meta["analytic"] = {name: dict(m, predicted_batch=predicted_batch(m, NOMINAL_LIMIT),
                                   predicted_cost_s=predicted_cost(a, name, m, NOMINAL_LIMIT)) for name, m in models.items()}
    meta["goals"] = targets_from_model(models) or None
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    rows = {}
    t_end = time.monotonic() + a.budget_s
    costs = [meta["analytic"][name]["predicted_cost_s"] for name in names]
    passthrough = ["--preset", a.preset, "--seq", str(a.seq), "--batch", str(a.batch), "--dtype", a.dtype,
                   "--steps", str(a.steps), "--max_batch", str(a.max_batch), "--bisect", str(a.bisect),
                   "--peak_tflops", str(a.peak_tflops), "--loss_chunk", str(a.loss_chunk),
                   "--bisect_other", str(a.bisect_other)]
    for k in ("n_layer", "n_embd", "n_head"):
        if getattr(a, k):
            passthrough += [f"--{k}", str(getattr(a, k))]
    for i, name in enumerate(names):
        # NOTE: each setting's share of the time left is its predicted cost over the cost of the
        # settings left, so a setting whose batch search is longer (larger batches) gets more.
        share = max(1.0, (t_end - time.monotonic()) * costs[i] / sum(costs[i:]))
        res_path = os.path.join(out_dir, f".worker-{i}.json")
        os.makedirs(out_dir, exist_ok=True)
        cmd = [sys.executable, "-m", "remat_lm.bench.gpu_check", "--worker", name, "--seconds", f"{share:.1f}",
               "--result", res_path] + passthrough
        print(f"[{name}] {share:.0f} s budget ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            # NOTE: the grace covers the worker's start and its last trial, which may begin just
            # before its own deadline.
            p = subprocess.run(cmd, env=env, cwd=ROOT, timeout=share + a.grace_s, capture_output=True, text=True)
            if p.returncode == 0 and os.path.exists(res_path):
                with open(res_path) as f:
                    rows[name] = json.load(f)
                os.remove(res_path)
            else:
                rows[name] = dict(setting=name, error=_last_error(p.stderr or p.stdout or "", p.returncode))
                sys.stderr.write(p.stderr[-4000:])
        except subprocess.TimeoutExpired:
            rows[name] = dict(setting=name, error=f"timed out after {share + a.grace_s:.0f} s")
        meta["device"] = meta.get("device") or rows[name].get("device")
        print(f"[{name}] done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        _write(out_dir, meta, rows)
    print(report(meta, rows))
    print(f"\nwrote {os.path.join(out_dir, 'gpu_check.md')} and gpu_check.json", file=sys.stderr)
    return 0 if rows and not any(r.get("error") for r in rows.values()) else 1


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m remat_lm.bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny shape for a CPU test: preset tiny, T=32, B=2, 2 steps, batch search up to 4")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else out/gpu_check)")
    p.add_argument("--preset", default="d12")
    p.add_argument("--n_layer", type=integer(1), default=None)
    p.add_argument("--n_embd", type=integer(1), default=None)
    p.add_argument("--n_head", type=integer(1), default=None)
    p.add_argument("--seq", type=integer(1), default=1024)
    p.add_argument("--batch", type=integer(1), default=32, help="batch for timing; the search starts here")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--steps", type=integer(1), default=8, help="timed steps (median reported)")
    p.add_argument("--max_batch", type=integer(1), default=4096, help="cap of the batch search")
    p.add_argument("--bisect", type=integer(0), default=2,
                   help="bisection steps after the first failing batch, for the rows of the batch target "
                        "(none, full)")
    p.add_argument("--bisect_other", type=integer(0), default=0,
                   help="bisection steps for the other rows (their largest batch is then bracketed "
                        "within 25%%)")
    p.add_argument("--loss_chunk", type=integer(0), default=128, help="the chunked LM head and loss (0: off)")
    p.add_argument("--peak_tflops", type=real(above=0), default=H200_BF16_TFLOPS, help="device peak for MFU")
    p.add_argument("--budget_s", type=real(above=0), default=400.0, help="seconds for all settings together")
    p.add_argument("--grace_s", type=real(0), default=30.0, help="extra seconds before a worker is killed")
    p.add_argument("--settings", default=None, help="comma-separated subset of the settings")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=real(0), default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.smoke:
        a.preset, a.seq, a.batch, a.steps, a.max_batch, a.bisect, a.loss_chunk = "tiny", 32, 2, 2, 4, 1, 8
        a.budget_s = min(a.budget_s, 120.0)
    if a.worker:
        row = worker(a)
        with open(a.result, "w") as f:
            json.dump(row, f)
        return 0
    return parent(a)


if __name__ == "__main__":
    sys.exit(cli(main, "gpu_check"))
