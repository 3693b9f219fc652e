"""What a prepared run is: `memory_report` (what the backward keeps, by tagged name, and XLA's
compiled memory, one column per recompute setting; `--memory_report`) and `describe` (the
summary printed at the start and by `--dry_run`).

Example:
    >>> setup = prepare(TrainConfig(preset="tiny", activation_recompute=True, memory_report=True))
    >>> print(memory_report(setup))
"""
from __future__ import annotations

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import remat
from remat_lm.training import log as log_lib
from remat_lm.training import target as run_target
from remat_lm.training.compile import compile_train_step

# NOTE: XLA:CPU has one memory space: pinned host memory is the same host RAM as "device" memory, so
# offloading (--cpu_checkpointing, an offload_names policy) compiles and runs but moves nothing and
# saves nothing. The run says so rather than let a CPU run look like it tested the offload.
CPU_OFFLOAD = "on a cpu backend pinned host memory is the same host RAM: nothing moves"


def _policy_offloads(rc, n_layers: int) -> bool:
    """Whether some layer's policy under `rc` offloads saved values to host memory."""
    return any(remat.policies.offloads(rc.effective_policy(i)) for i in range(n_layers))


def _saved_cell(res, name: str) -> str:
    """One cell of the saved table: `count x bytes of each`, or `count, total` where sizes differ."""
    count, total = res.by_name().get(name, (0, 0))
    if not count:
        return "-"
    # by_name's own key of each row (one-row SavedResiduals), so the grouping cannot drift from it
    sizes = {r.bytes for r in res.rows if next(iter(type(res)((r,)).by_name())) == name}
    fmt = remat.memory.format_bytes
    return f"{count} x {fmt(total // count)}" if len(sizes) == 1 else f"{count}, {fmt(total)} total"


NO_REMAT = "no remat"  # the column of the same run with nothing recomputed, always in the report
PARTS = ("parameters", "optimizer state", "gradients", "activations", "the rest")


def _settings(setup) -> list:
    """The report's columns: `no remat` (the run with nothing recomputed: the flags' own `none`
    setting, or one added) and then the flags' settings."""
    out = [(NO_REMAT if not m.recompute.enabled else label, m) for label, m in setup.mcfgs]
    if all(m.recompute.enabled for _, m in setup.mcfgs):
        out.insert(0, (NO_REMAT, dataclasses.replace(setup.mcfg, recompute=remat.RecomputeConfig())))
    return out


def _per_device(tree, shardings) -> int:
    """Bytes of `tree` (abstract arrays) on one device under `shardings`."""
    sizes = jax.tree.map(lambda a, sh: int(np.prod(sh.shard_shape(a.shape))) * a.dtype.itemsize, tree, shardings)
    return int(sum(jax.tree.leaves(sizes)))


def _parts(setup, res, peak) -> dict | None:
    """The peak per device split into PARTS: the parameters and the optimizer state as the state's
    shardings place them, gradients as large as the parameters (float32, alive together in the
    update), the activations the backward keeps (`res.intermediates` of one micro-batch over the
    batch's devices), and the rest (the batch, XLA's temporaries, what the estimates miss)."""
    if peak is None:
        return None
    state, shard = setup.abstract_state, setup.state_sharding
    p = _per_device(state["params"], shard["params"])
    o = _per_device({k: v for k, v in state.items() if k != "params"}, {k: v for k, v in shard.items() if k != "params"})
    batch_devices = setup.mesh.shape.get("data", 1) * setup.mesh.shape.get("fsdp", 1)
    a = res.intermediates // batch_devices
    return dict(zip(PARTS, (p, o, p, a, max(0, peak - 2 * p - o - a))))


def memory_report(setup, progress=None) -> str:
    """What the backward keeps (by tagged name) and XLA's compiled memory, one column per config,
    `no remat` first; the peak split into PARTS; with --target, one verdict per setting. A line per
    compile goes to `progress` (default stderr) as it starts."""
    cfg, progress = setup.cfg, progress or sys.stderr
    params = setup.abstract_state["params"]
    xy = jax.ShapeDtypeStruct((cfg.batch_size, cfg.sequence_length), jnp.int32)
    cols, refused = [], {}
    settings = _settings(setup)
    by = run_target.words(setup.target) if setup.target is not None else "XLA"
    for i, (label, mcfg) in enumerate(settings):
        t0 = time.perf_counter()
        print(f"memory report: compiling {i + 1}/{len(settings)} ({label}) by {by} ...", file=progress, flush=True)
        # the mesh: --distribute_saved_activations constrains with PartitionSpecs; --target: traced for its
        # platform (its attention core), as the compiled step below is
        with run_target.building(setup):
            res = remat.memory.saved_residuals(lambda p, x, y, m=mcfg: setup.fam.loss_fn(p, m, x, y), params, xy, xy)
        try:
            cm = remat.memory.compiled_stats(compile_train_step(setup, mcfg))
            comp = {"temp": cm.temp, "arguments": cm.argument, "outputs": cm.output, "aliased": cm.alias,
                    "peak estimate": cm.peak_estimate}
        except run_target.Refused as e:  # XLA:TPU: too large for the target; a verdict, not a crash
            refused[label] = e
            comp = dict.fromkeys(("temp", "arguments", "outputs", "aliased", "peak estimate"))
        cols.append((label, res, comp))
        print(f"memory report: {label} compiled in {time.perf_counter() - t0:.1f} s", file=progress, flush=True)
    names = []
    for _, res, _ in cols:
        names += [k for k in res.by_name() if k not in names]
    fmt = remat.memory.format_bytes
    mib = lambda n: "refused" if n is None else fmt(n)  # noqa: E731  (a column the target's compiler refused)
    table = [[_saved_cell(res, n) for _, res, _ in cols] for n in names]
    w0, w = 46, max(18, *(len(c[0]) + 2 for c in cols), *(len(x) + 2 for row in table for x in row))
    dev = setup.mesh.devices.flat[0]
    t = setup.target
    on = (f"{t.hardware()} ({t.compiler}{', compile-only: no device here' if setup.deviceless else ''})"
          if t is not None else f"{setup.mesh.size} {dev.platform} device(s)")
    lines = [f"memory report: {cfg.model} {cfg.preset} ({setup.fam.num_params(setup.mcfg):,} params), micro-batch "
             f"{cfg.batch_size}x{cfg.sequence_length}, {cfg.dtype}, mesh {cfg.mesh} on {on}",
             "", "saved for the backward of one micro-batch, by tagged name: count x bytes of each "
                 "(count, total where their sizes differ)",
             "".ljust(w0) + "".join(c[0].rjust(w) for c in cols)]
    for n, cells in zip(names, table):
        lines.append(f"  {n[:w0 - 2]}".ljust(w0) + "".join(x.rjust(w) for x in cells))
    lines.append("  total (intermediates)".ljust(w0) + "".join(mib(r.intermediates).rjust(w) for _, r, _ in cols))
    lines.append("  total (with arguments)".ljust(w0) + "".join(mib(r.total).rjust(w) for _, r, _ in cols))
    if dev.platform == "cpu" and any(res.offloaded for _, res, _ in cols):
        lines.append(f"  (host) rows: {CPU_OFFLOAD}")
    compiled_by = f"{run_target.words(t)}: its" if t is not None else "XLA's"
    lines += ["", f"{compiled_by} compiled train step, per device", "".ljust(w0) + "".join(c[0].rjust(w) for c in cols)]
    for k in ("temp", "arguments", "outputs", "aliased", "peak estimate"):
        lines.append(f"  {k}".ljust(w0) + "".join(mib(comp[k]).rjust(w) for _, _, comp in cols))
    wl = max(len(c[0]) for c in cols) + 2
    lines += ["", "summary, one row per setting",
              "  " + "setting".ljust(wl) + "saved (intermediates)".rjust(22) + "compiled temp".rjust(16)
              + "peak estimate".rjust(16)]
    for label, res, comp in cols:
        lines.append("  " + label.ljust(wl) + mib(res.intermediates).rjust(22) + mib(comp["temp"]).rjust(16)
                     + mib(comp["peak estimate"]).rjust(16))
    lines += _breakdown(setup, cols, w0, w)
    if t is not None:
        lines += _verdicts(setup, cols, refused, wl)
    return "\n".join(lines)


def _breakdown(setup, cols, w0, w) -> list[str]:
    """The peak estimate per device split into PARTS, a column per setting, and a line where the
    activations (what remat changes) are not its largest part."""
    fmt = remat.memory.format_bytes
    parts = [(label, _parts(setup, res, comp["peak estimate"])) for label, res, comp in cols]
    lines = ["", "the peak estimate per device, by part (gradients: as large as the parameters; the rest: "
                 "the batch and XLA's temporaries)", "".ljust(w0) + "".join(label.rjust(w) for label, _ in parts)]
    for k in PARTS:
        lines.append(f"  {k}".ljust(w0) + "".join(("refused" if d is None else fmt(d[k])).rjust(w) for _, d in parts))
    base = dict(parts).get(NO_REMAT)
    if base is not None:
        top = max(PARTS, key=base.get)
        if top != "activations":
            lines.append(f"  with no remat the activations are {fmt(base['activations'])} of a {fmt(sum(base.values()))} "
                         f"peak and {top} ({fmt(base[top])}) the largest part: remat lowers only the activations")
    return lines


def _verdicts(setup, cols, refused, wl) -> list[str]:
    """With --target: one verdict per setting against the capacity (`preflight.capacity_of`)."""
    from remat_lm.training import preflight

    cap = preflight.capacity_of(setup)
    if cap is None:
        return []
    fmt = remat.memory.format_bytes
    lines = ["", f"verdict against {fmt(cap.bytes)} per device, {cap.what}"]
    for label, _, comp in cols:
        peak = comp["peak estimate"]
        err = refused.get(label)
        v = preflight.verdict(setup, None if peak is None else peak * cap.sharing, cap, err)
        why = (f" ({err})" if err is not None else
               f" (needs {fmt(peak * cap.sharing)})")
        lines.append("  " + label.ljust(wl) + v + why)
    return lines


def run_summary(setup, compiled=None) -> str:
    """A summary of the run (printed at the start and by --dry_run)."""
    cfg, m = setup.cfg, setup.mcfg
    rc = m.recompute
    segs = rc.split(m.n_layer) if rc.enabled else ()
    regions = sum(1 for s in segs if s.checkpointed)
    lines = [
        f"model    {cfg.model} {cfg.preset if setup.init_params is None else 'from ' + str(cfg.init_from)}: "
        f"{setup.fam.num_params(m):,} params, {m.n_layer} layers, "
        f"width {m.n_embd}, vocab {m.vocab_size}, block {m.block_size}, {m.dtype}"
        + (", scan" if m.scan_layers else ""),
        f"remat    {setup.mcfgs[0][0]}" + (f" ({regions} recompute regions, policy {remat.policies.describe(rc.effective_policy()) if not isinstance(rc.layers, remat.regions.PerLayer) else 'per layer'}"
                                            f"{', reentrant' if rc.use_reentrant else ''})" if rc.enabled else "")
        + (f"; loss over chunks of {m.loss_chunk} positions" if m.loss_chunk else ""),
        f"data     {setup.train_ds.description}: {setup.train_ds.n_tokens:,} tokens"
        + (f"; val {setup.val_ds.description}: {setup.val_ds.n_tokens:,} tokens" if setup.val_ds else ""),
        f"batch    {cfg.batch_size} x {cfg.sequence_length} x {cfg.grad_accum_steps} accum = "
        f"{cfg.tokens_per_step:,} tokens/step, {setup.fam.flops_per_token(m, cfg.sequence_length) / 1e6:,.1f} "
        f"MFLOP/token",
        f"mesh     {cfg.mesh} over " + (f"{setup.target.hardware()} (compile-only: {setup.target.compiler} builds "
                                         f"for it, no device here)" if setup.deviceless else
                                         f"{setup.mesh.size} {setup.mesh.devices.flat[0].platform} device(s)"),
    ]
    lines[2:2] = [f"deepspeed {note}" for note in cfg.deepspeed_notes()]
    ds = cfg.deepspeed
    on_cpu = setup.mesh.devices.flat[0].platform == "cpu"
    if rc.offload_inputs and on_cpu and not (ds and ds.cpu_checkpointing):
        lines.insert(2, f"offload  region inputs wait in pinned host memory (--cpu_checkpointing); {CPU_OFFLOAD}")
    elif on_cpu and _policy_offloads(rc, m.n_layer):
        lines.insert(2, f"offload  the recompute policy offloads saved values to pinned host memory; {CPU_OFFLOAD}")
    if compiled is not None:
        by = f" by {run_target.words(setup.target)}" if setup.target is not None else ""
        lines.append(f"memory   {remat.memory.format_bytes(log_lib.compiled_estimate(compiled))} per device "
                     f"(compiled est.){by}")
    return "\n".join(lines)
