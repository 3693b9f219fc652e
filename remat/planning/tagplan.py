"""The planner per tag: save on the device, offload to host or recompute each tagged activation of
each layer, under a budget on the target's compiled peak, at the least predicted step time.

`remat.plan_for_budget(..., target=..., trace_step=...)` and `remat.planning.planner.front` use it. The
caller hands in two model-specific hooks: `compile_step(recompute_config)` (the target's compiler's
`CompiledMemory` of the train step) and `trace_step(recompute_config)` (its jaxpr, not compiled).
docs/planner.md states the cost model, the solver and what they assume.

Plans print as one line, `POLICY xN; POLICY xN; ...` (runs of equal layers, first layer first),
e.g. `save_names:mlp_up,qkv x5; none x7`; `parse_plan` reads that line back.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from remat.planning import cost as _cost
from remat import names as _names
from remat import policies as _policies
from remat.config import RecomputeConfig
from remat.memory import format_bytes
from remat.regions import PerLayer, per_layer

__all__ = ["MODULE_PRESETS", "OFFLOAD", "PLAN_FORM", "RECOMPUTE", "SAVE", "Model", "baseline_plans", "calibrate",
           "config_policies", "format_plan", "greedy", "parse_plan", "recompute_config", "tag_policy"]

SAVE, OFFLOAD, RECOMPUTE = "device", "offload", "remat"
MODULE_PRESETS = tuple("+".join(c) for r in (1, 2, 3) for c in
                       __import__("itertools").combinations(("core_attn", "mlp", "norm"), r))


def recompute_config(layer_policies: Sequence) -> RecomputeConfig:
    """The RecomputeConfig of a per-layer plan: one policy (or None, or "none": not rematerialized)
    per layer; `RecomputeConfig()` when no layer is rematerialized.

    Example:
      >>> recompute_config([None, "mlp"]).layers
      per_layer((None, 'mlp'))
    """
    lp = tuple(None if p is None or (isinstance(p, str) and p == "none") else p for p in layer_policies)
    if all(p is None for p in lp):
        return RecomputeConfig()
    return RecomputeConfig(granularity="full", layers=per_layer(lp))


def format_plan(layer_policies: Sequence, scan: bool | None = None) -> str:
    """The one-line text of a per-layer plan: runs of equal policies, `POLICY xN` joined by '; ',
    then the layout it was planned for when known (`scan`: '; scan' or '; loop').

    Example:
      >>> format_plan(["full", "full", None]), format_plan(["full", None], scan=True)
      ('full x2; none x1', 'full x1; none x1; scan')
    """
    runs = []
    for p in layer_policies:
        p = "none" if p is None else p
        if not isinstance(p, str):
            p = _policies.describe(p)
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    layout = [] if scan is None else [LAYOUTS[bool(scan)]]
    return "; ".join([f"{p} x{n}" for p, n in runs] + layout)


PLAN_FORM = ("POLICY xN[; POLICY xN...][; scan|loop], e.g. 'save_names:qkv,mlp_up x6; none x6; scan' (one run per "
             "group of layers, then the layout it was planned for)")
LAYOUTS = {True: "scan", False: "loop"}


def plan_layout(text: str) -> bool | None:
    """The layout a plan's text names (True: layers under scan, False: a loop), None when it names none.

    Example:
      >>> plan_layout("full x2; scan"), plan_layout("full x2")
      (True, None)
    """
    last = str(text).rsplit(";", 1)[-1].strip()
    return {v: k for k, v in LAYOUTS.items()}.get(last)
_RUN = re.compile(r"^\s*(\S+)\s+x(\d+)\s*$", re.ASCII)


_MAX_LAYERS = 2**31 - 1  # layer indices are int32


def parse_plan(text: str, n_layers: int | None = None) -> tuple:
    """The per-layer policies of a plan's one-line text (`format_plan`'s), checked: every policy a
    `remat.policies` name (or `none`), the counts adding up to `n_layers` when given.

    Example:
      >>> parse_plan("full x2; none x1", 3)
      ('full', 'full', None)
    """
    runs, total = [], 0
    parts = str(text).split(";")
    for part in parts[:-1] if plan_layout(text) is not None else parts:
        m = _RUN.match(part)
        if not m or int(m.group(2)) < 1:
            raise ValueError(f"recompute plan {text!r}: {part.strip()!r} is not 'POLICY xN'; expected {PLAN_FORM}")
        p = m.group(1)
        if p != "none":
            try:
                _policies.validate(p)
            except ValueError as e:
                raise ValueError(f"recompute plan {text!r}: {e}") from None
        runs.append((None if p == "none" else p, int(m.group(2))))
        total += runs[-1][1]
    if (n_layers is not None and total != n_layers) or total > _MAX_LAYERS:  # counted before any list is built
        has = f"the model has {n_layers}" if n_layers is not None else f"a stack has at most {_MAX_LAYERS:,}"
        raise ValueError(f"recompute plan {text!r} covers {total:,} layers but {has}; expected {PLAN_FORM}")
    return tuple(p for p, n in runs for _ in range(n))


def tag_policy(choice: dict) -> str | None:
    """The policy name of one layer's choices {tag: device|offload|remat} (unlisted tags recompute)."""
    dev = sorted(t for t, c in choice.items() if c == SAVE)
    off = sorted(t for t, c in choice.items() if c == OFFLOAD)
    if not dev and not off:
        return _policies.NOTHING
    if not off:
        return "save_names:" + ",".join(dev)
    return "custom:" + ",".join([f"{t}=device" for t in dev] + [f"{t}=offload" for t in off])


@dataclasses.dataclass(frozen=True)
class Model:
    """The calibrated model of one train step on one target (docs/planner.md states it)."""
    n_layers: int
    tags: tuple                 # the tags the solver chooses for (recomputing them costs time)
    bytes: dict                 # tag -> bytes per layer per device
    share: dict                 # tag -> recompute seconds per layer
    untagged_s: float
    forward_s: float            # one layer's forward, seconds (the overlap window of offloads)
    base_step_s: float          # the step without remat, seconds (roofline of its jaxpr)
    host_link: float | None
    p_full: int
    m_none: float               # peak bytes one layer without remat adds over full remat
    a_save: float               # peak bytes per saved byte
    a_off: float | None         # peak bytes per offloaded byte; None: offload not allowed
    c_mix: float = 0.0          # peak bytes a stack of rematerialized and plain layers adds (two scans)
    notes: tuple = ()
    t_mix: float = 0.0          # seconds such a split adds (two loops over the layers instead of one)
    spread_s: float = 0.0       # step times closer than this are a tie (the measurement's noise; 0 when analysed)
    time_source: str = "roofline of the traced step"   # what the step times come from
    program_s: dict = dataclasses.field(default_factory=dict, repr=False)  # layer policies -> timed/analysed s

    def layer_choice(self, policy) -> dict | None:
        """{tag: choice} of a policy (None for `none`); full recomputes everything."""
        if policy is None:
            return None
        if policy == _policies.NOTHING:
            return {t: RECOMPUTE for t in self.tags}
        by = _policies.by_name(policy)
        if by is None:
            raise ValueError(f"policy {policy!r} is not name-based; the tag model cannot price it")
        return {t: SAVE if by.saves(t) else OFFLOAD if t in by.offload else RECOMPUTE for t in self.tags}

    def layer_cost(self, policy) -> tuple:
        """(peak bytes over full remat, recompute seconds, host-link bytes) of one layer."""
        ch = self.layer_choice(policy)
        if ch is None:
            return self.m_none, 0.0, 0.0
        mem = sum(self.a_save * self.bytes[t] for t in self.tags if ch[t] == SAVE)
        off = sum(self.bytes[t] for t in self.tags if ch[t] == OFFLOAD)
        mem += (self.a_off or 0.0) * off
        return mem, self.untagged_s + sum(self.share[t] for t in self.tags if ch[t] == RECOMPUTE), off

    def exposed_offload_s(self, off_bytes: float) -> float:
        """Host-link time of `off_bytes` not hidden behind compute: what exceeds the layers' forward
        (copies to host) or their backward (copies back)."""
        if not off_bytes:
            return 0.0
        t = off_bytes / self.host_link
        return max(0.0, t - self.n_layers * self.forward_s) + max(0.0, t - 2 * self.n_layers * self.forward_s)

    def predict(self, layer_policies: Sequence) -> tuple:
        """(predicted peak bytes, predicted step seconds) of a per-layer plan."""
        mem = rec = off = 0.0
        lp = [None if p in (None, "none") else p for p in layer_policies]
        for p in lp:
            m, r, o = self.layer_cost(p)
            mem, rec, off = mem + m, rec + r, off + o
        split = None in lp and any(p is not None for p in lp)
        if split:
            mem += self.c_mix
        return (int(round(self.p_full + mem)),
                self.base_step_s + rec + self.exposed_offload_s(off) + (self.t_mix if split else 0.0))

    def solve(self, budget: float, time_limit: float = 60.0):
        """The plan of least predicted step time whose predicted peak ≤ budget (None when none is
        predicted to fit), exact over its family (`_solve`): every layer rematerialized, none, or a
        split (which adds `c_mix`)."""
        best = None
        if self.m_none * self.n_layers + self.p_full <= budget:
            best = (None,) * self.n_layers
        for lo, hi, extra in ((self.n_layers, self.n_layers, 0.0), (1, self.n_layers - 1, self.c_mix)):
            if lo > hi:
                continue
            lp = self._solve(budget - extra, lo, hi, time_limit)
            if lp is not None and (best is None or self.predict(lp)[1] < self.predict(best)[1]):
                best = lp
        return best

    def _solve(self, budget: float, n_lo: int, n_hi: int, time_limit: float):
        """The plan of least predicted step time whose predicted peak ≤ budget (None when none is
        predicted to fit), exact over its family: one tag policy P (each tag saved, offloaded or
        recomputed) on the first n layers, no remat on the rest, both chosen by an integer program.
        """
        L, T = self.n_layers, len(self.tags)
        offload = self.a_off is not None and bool(self.host_link)
        S, O, R = (lambda k: 1 + k), (lambda k: 1 + T + k), (lambda k: 1 + 2 * T + k)
        YS, YO, YR = (lambda k: 1 + 3 * T + k), (lambda k: 1 + 4 * T + k), (lambda k: 1 + 5 * T + k)
        nv = 1 + 6 * T + 2
        EF, EB = nv - 2, nv - 1
        c = np.zeros(nv)
        c[0] = self.untagged_s
        c[EF] = c[EB] = 1.0
        rows, lo, hi = [], [], []

        def add(coef: dict, lb, ub):
            row = np.zeros(nv)
            for i, v in coef.items():
                row[i] += v
            rows.append(row), lo.append(lb), hi.append(ub)

        mem = {0: -self.m_none}
        link = {}
        for k, t in enumerate(self.tags):
            c[YR(k)] = self.share[t]
            add({S(k): 1, O(k): 1, R(k): 1}, 1, 1)
            for x, y in ((S(k), YS(k)), (O(k), YO(k)), (R(k), YR(k))):   # y = n·x
                add({y: 1, x: -L}, -np.inf, 0)
                add({y: 1, 0: -1}, -np.inf, 0)
                add({y: 1, 0: -1, x: -L}, -L, np.inf)
            mem[YS(k)] = self.a_save * self.bytes[t]
            mem[YO(k)] = (self.a_off or 0.0) * self.bytes[t]
            if offload:
                link[YO(k)] = self.bytes[t] / self.host_link
        add(mem, -np.inf, budget - self.p_full - L * self.m_none)
        if offload:
            add({**link, EF: -1}, -np.inf, L * self.forward_s)
            add({**link, EB: -1}, -np.inf, 2 * L * self.forward_s)
        ub = np.full(nv, 1.0)
        ub[0] = n_hi
        ub[1 + 3 * T:1 + 6 * T] = L
        ub[EF] = ub[EB] = np.inf
        if not offload:
            for k in range(T):
                ub[O(k)] = ub[YO(k)] = 0
        integ = np.zeros(nv)
        integ[:1 + 3 * T] = 1
        res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integ,
                   bounds=Bounds(np.r_[n_lo, np.zeros(nv - 1)], ub), options={"time_limit": time_limit})
        if res.x is None:
            return None
        n = int(round(res.x[0]))
        ch = {t: SAVE if res.x[S(k)] > 0.5 else OFFLOAD if res.x[O(k)] > 0.5 else RECOMPUTE
              for k, t in enumerate(self.tags)}
        return (tag_policy(ch),) * n + (None,) * (L - n)


def calibrate(compile_step: Callable, trace_step: Callable, n_layers: int, target, *, peak: Callable,
              measure: Callable, roof: _cost.Roofline | None = None, program_time: Callable | None = None,
              time_source: str = "") -> Model:
    """Build the Model: trace full remat (the layer's program), compile the uniform plans full,
    none, full and every tag saved on the first k layers (and offloaded, with a host link), and
    take their step times from `program_time` (docs/planner.md: measured on the host, else the
    target compiler's optimized programs on a roofline).

    Args:
      compile_step, trace_step: the model's hooks (see `remat.planning.planner.front`).
      n_layers: layers in the stack.
      target: a `remat.planning.targets.Target`.
      peak: CompiledMemory -> the peak the budget bounds.
      measure: layer policies -> CompiledMemory (compiles once, cached by the caller).
      roof: the target's roofline (default: its table's figures).
      program_time: {layer policies: (seconds, spread seconds)} of a list of layer-policy tuples;
        None: each compiled program's `cost.program_seconds` on `roof`, spread 0.
      time_source: words for where the times come from (the plan's notes say it).
    """
    L = n_layers
    roof = roof or _cost.of_target(target)
    div = getattr(target, "count", 1) or 1
    full_lp = (_policies.NOTHING,) * L
    region = _cost.layer_region(trace_step(recompute_config(full_lp)))
    if region is None:
        raise ValueError("the planner found no rematerialized layer carrying checkpoint_name tags in the traced "
                         "step; tag the layer's activations (docs/tagging.md) or plan without trace_step")
    prof = _cost.profile(region, roof, div)
    known = set(_names.known())
    tags = tuple(t for t in prof.order if t in known and prof.tags[t].recompute_s > 0)
    notes = []
    skipped = [t for t in prof.order if t not in known]
    if skipped:
        notes.append(f"tags {', '.join(skipped)} are not registered (remat.names.register): always recomputed")
    none_lp = (None,) * L
    p_full, p_none = peak(measure(full_lp)), peak(measure(none_lp))
    saved = sum(prof.tags[t].bytes for t in tags)
    # a, a_off are fitted in the solver's layout, a tag policy on the first k = ceil(L/2) layers
    # (docs/architecture.md, Design notes: `tagplan.py` calibration).
    k = max(1, (L + 1) // 2)
    m_none = (p_none - p_full) / L
    rest = (L - k) * m_none
    c_mix = 0.0
    block_lp = (_policies.NOTHING,) * k + (None,) * (L - k)
    if 0 < k < L:   # the split's own cost: full remat on k layers, none on the rest (block k)
        c_mix = peak(measure(block_lp)) - p_full - rest
    fit = lambda p: max(0.0, (p - p_full - rest - c_mix) / (k * saved)) if saved else 0.0
    save_lp = (tag_policy({t: SAVE for t in tags}),) * k + (None,) * (L - k)
    p_save = peak(measure(save_lp))
    a_save, a_off = fit(p_save), None
    link = roof.host_link
    if link and tags:
        p_off = peak(measure((tag_policy({t: OFFLOAD for t in tags}),) * k + (None,) * (L - k)))
        if p_off < p_save:
            a_off = fit(p_off)
        else:
            notes.append(f"offload dropped: offloading every tag on {k} layers does not lower the compiled peak on "
                         f"this compiler ({format_bytes(p_off)} against {format_bytes(p_save)} keeping them on the "
                         f"device)")
    # Step times of the calibration programs; the recompute of a layer is what full remat adds per
    # layer, split into the untagged work (what full remat still adds with every tag saved) and the
    # tags' shares (in the proportions of the traced layer's roofline).
    lps = list(dict.fromkeys([none_lp, full_lp, block_lp, save_lp]))
    if program_time is None and all(measure(lp).kernels for lp in lps):
        times = {lp: (_cost.program_seconds(measure(lp), roof), 0.0) for lp in lps}
        time_source = time_source or f"{target.compiler}'s optimized programs on {roof.source or 'its roofline'}"
    elif program_time is None:   # no optimized program came with the compiled steps: the traced layer's roofline
        source = (f"the roofline of the traced layer on {roof.source or 'the target'} (no optimized program was "
                  f"given)")
        notes.append(f"step times: {source}")
        return Model(L, tags, {t: prof.tags[t].bytes for t in tags}, {t: prof.tags[t].recompute_s for t in tags},
                     prof.untagged_s, prof.forward_s, _cost.jaxpr_seconds(trace_step(recompute_config(none_lp)), roof)
                     / div, link, p_full, m_none, a_save, a_off, c_mix, tuple(notes), 0.0, 0.0, source)
    else:
        times = program_time(lps)
    # Signed: where a rematerialized program measures faster (a smaller working set), the model says so.
    t_none, t_full = times[none_lp][0], times[full_lp][0]
    r_full = (t_full - t_none) / L
    r_tags = (times[block_lp][0] - times[save_lp][0]) / k if tags else 0.0
    roof_tags = sum(prof.tags[t].recompute_s for t in tags)
    share = {t: r_tags * (prof.tags[t].recompute_s / roof_tags if roof_tags else 1 / len(tags)) for t in tags}
    t_mix = times[block_lp][0] - t_none - k * r_full if 0 < k < L else 0.0
    spread = max((2 * sp for _, sp in times.values()), default=0.0)
    notes.append(f"step times: {time_source}")
    return Model(L, tags, {t: prof.tags[t].bytes for t in tags}, share, r_full - r_tags, prof.forward_s, t_none, link,
                 p_full, m_none, a_save, a_off, c_mix, tuple(notes), t_mix, spread, time_source,
                 {lp: t for lp, (t, _) in times.items()})


def baseline_plans(n_layers: int) -> dict:
    """{name: RecomputeConfig} of the hand settings: none, full, uniform N, block N (every N for up to
    16 layers; deeper stacks: the N that divide the depth, and block N every depth/8), the presets."""
    L = n_layers
    out = {"none": RecomputeConfig(), "full": recompute_config((_policies.NOTHING,) * L)}
    uni = range(2, L + 1) if L <= 16 else [n for n in range(2, L + 1) if L % n == 0]
    for n in uni:
        out[f"uniform {n}"] = RecomputeConfig(granularity="full", method="uniform", num_layers=n)
    blk = range(1, L) if L <= 16 else sorted({max(1, round(k * L / 8)) for k in range(1, 8)})
    for n in blk:
        out[f"block {n}"] = recompute_config((_policies.NOTHING,) * n + (None,) * (L - n))
    for m in MODULE_PRESETS:
        out[m] = recompute_config((m,) * L)
    return out


def config_policies(rc: RecomputeConfig, n_layers: int):
    """The per-layer policies of a config made of single-layer regions (None where it is not one:
    multi-layer regions, uniform N > 1)."""
    if not rc.enabled:
        return (None,) * n_layers
    if isinstance(rc.layers, PerLayer):
        return tuple(rc.layers.policies)
    return None


def greedy(model: Model, budget: int, verify: Callable) -> tuple:
    """MaxText's estimator: from full remat, step each tag in a fixed order (the library's) to the
    device, else to host, else leave it recomputed, while the predicted peak fits; the result is
    compiled and the last step taken back while it does not fit. Returns (policies, steps)."""
    L = model.n_layers
    order = [t for t in _names.known() if t in model.tags]
    ch = {t: RECOMPUTE for t in model.tags}
    steps = []
    for t in order:
        for where in (SAVE, OFFLOAD) if model.a_off is not None else (SAVE,):
            trial = dict(ch, **{t: where})
            if model.predict((tag_policy(trial),) * L)[0] <= budget:
                ch = trial
                steps.append(t)
                break
    while True:
        lp = (tag_policy(ch),) * L
        if verify(lp) <= budget or not steps:
            return lp, steps
        ch[steps.pop()] = RECOMPUTE
