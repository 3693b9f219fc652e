"""plan_for_budget(): the setting per layer that recomputes least while the compiled peak fits a budget.

The caller hands in `compile_step(recompute_config)` (the train step's `remat.memory.CompiledMemory`
or `jax.stages.Compiled`), so the library stays model-agnostic. Without a target it picks a preset
per layer at the least recompute FLOPs; with `target=` and `trace_step=` it plans per tag at the
least predicted step time (`front`; remat.planning.tagplan). "Peak" is `CompiledMemory.peak_estimate`
(arguments + outputs + temp − aliased) unless `peak="temp"`. docs/planner.md states both models.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import numpy as np

from remat import memory as _memory
from remat import policies as _policies
from remat.planning import tagplan as _tagplan
from remat.planning import untagged as _untagged
from remat.planning.tagplan import recompute_config
from remat.config import RecomputeConfig
from remat.errors import is_int
from remat.memory import compiled_stats, format_bytes

__all__ = ["DEFAULT_CANDIDATES", "MAX_PLANS", "PEAKS", "BudgetPlan", "Candidate", "Front", "front", "plan_for_budget",
           "recompute_config"]

# Candidate settings: None (not rematerialized), selective presets, and full (nothing saved).
DEFAULT_CANDIDATES = ("none", "norm", "mlp", "core_attn+mlp+norm", _policies.NOTHING)
PEAKS = ("estimate", "temp")
MAX_PLANS = 2_000_000  # compositions enumerated at most; beyond, layers are planned in equal groups

def _name(c) -> str:
    return "none" if c is None else _policies.describe(c)


def _policy(c):
    return None if c is None or (isinstance(c, str) and c == "none") else c


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate setting, calibrated from compiled uniform plans (bytes, FLOPs per layer)."""
    name: str
    interior_freed: float   # d_c: peak bytes freed per layer other than the last
    last_freed: float       # e_c: peak bytes freed by the last layer
    flops: float            # f_c: recompute FLOPs per layer
    saved: int | None       # analytic bytes one layer keeps (remat.memory.predict_saved), if known
    uniform_peak: int       # compiled peak with c on every layer


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """The planner's answer: one setting per layer and what it costs.

    Attributes:
      layer_policies: one policy (a name or a JAX policy callable) or None (not rematerialized) per layer.
      saved_bytes: analytic bytes each layer keeps for the backward (None without `layer_bytes`).
      freed_bytes: calibrated peak bytes each layer's setting frees against no remat.
      recompute_flops: calibrated recompute FLOPs per layer (the compiled programs' matmul FLOPs).
      budget, peak_kind: the budget and what it applies to ("estimate" or "temp").
      predicted_peak, compiled_peak: the model's peak for this plan and XLA's, in bytes.
      compiled: the chosen plan's CompiledMemory; no_remat_peak / minimum_peak: compiled peaks of
        no remat and of the most memory-saving uniform plan; compiled_recompute_flops: the plan's
        compiled FLOPs minus no remat's.
      iterations: planning rounds (1 when the first plan fit); compiles: compilations made;
      notes: what happened (refinements, shortcuts), for people.
    """
    layer_policies: tuple
    saved_bytes: tuple
    freed_bytes: tuple
    recompute_flops: tuple
    budget: int
    peak_kind: str
    predicted_peak: int
    compiled_peak: int
    compiled: _memory.CompiledMemory
    no_remat_peak: int
    minimum_peak: int
    compiled_recompute_flops: float
    iterations: int
    compiles: int
    candidates: tuple = ()
    notes: tuple = ()
    predicted_step_s: float | None = None   # the tag planner's time model (target=...), seconds
    time_source: str = ""   # where that model's step times come from
    scan: bool | None = None   # the layout it was planned for (True: layers under scan), when the caller says

    @property
    def text(self) -> str:
        """The plan's one-line text, with its layout when known (`train.py --recompute_plan` takes it)."""
        return _tagplan.format_plan(self.layer_policies, self.scan)

    @property
    def settings(self) -> tuple:
        return tuple(_name(p) for p in self.layer_policies)

    @property
    def fits(self) -> bool:
        return self.compiled_peak <= self.budget

    @property
    def total_recompute_flops(self) -> float:
        return float(sum(self.recompute_flops))

    def recompute_config(self) -> RecomputeConfig:
        """The plan as a RecomputeConfig (granularity full, one policy per layer)."""
        return recompute_config(self.layer_policies)

    def table(self) -> str:
        """One row per layer (setting, saved bytes, peak bytes freed, recompute FLOPs), then totals
        and the predicted vs compiled peak."""
        w = max(9, *(len(s) for s in self.settings)) + 2
        lines = [f"{'layer':>5}  {'setting'.ljust(w)}{'saved':>12}{'frees at peak':>15}{'recompute MFLOP':>17}"]
        for i, (s, sv, fr, fl) in enumerate(zip(self.settings, self.saved_bytes, self.freed_bytes,
                                                self.recompute_flops)):
            lines.append(f"{i:>5}  {s.ljust(w)}{format_bytes(sv):>12}{format_bytes(fr):>15}{fl / 1e6:>17,.1f}")
        saved = None if any(s is None for s in self.saved_bytes) else sum(self.saved_bytes)
        lines.append(f"{'all':>5}  {''.ljust(w)}{format_bytes(saved):>12}{format_bytes(sum(self.freed_bytes)):>15}"
                     f"{self.total_recompute_flops / 1e6:>17,.1f}")
        what = "arguments + outputs + temp - aliased" if self.peak_kind == "estimate" else "temp"
        lines.append(f"peak ({what}): predicted {format_bytes(self.predicted_peak)}, compiled "
                     f"{format_bytes(self.compiled_peak)}, budget {format_bytes(self.budget)} "
                     f"({'fits' if self.fits else 'DOES NOT FIT'}); no remat {format_bytes(self.no_remat_peak)}, "
                     f"minimum {format_bytes(self.minimum_peak)}")
        lines.append(f"planning: {self.iterations} round(s), {self.compiles} compilation(s); compiled recompute "
                     f"{self.compiled_recompute_flops / 1e6:,.1f} MFLOP")
        if self.predicted_step_s is not None:
            t = self.predicted_step_s
            t = f"{t * 1e3:,.2f} ms" if abs(t) >= 1e-3 else f"{t * 1e6:,.1f} µs"
            lines.append(f"predicted step {t} ({self.time_source or 'the time model'})")
            lines.append(f"plan: {self.text}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


@functools.lru_cache(maxsize=256)
def _compositions(m: int, k: int) -> np.ndarray:
    """All k-tuples of non-negative ints summing to m, as an (N, k) array."""
    if k == 1:
        return np.array([[m]], dtype=np.int32)
    parts = []
    for i in range(m, -1, -1):
        sub = _compositions(m - i, k - 1)
        parts.append(np.concatenate([np.full((len(sub), 1), i, np.int32), sub], axis=1))
    return np.concatenate(parts, axis=0)


def _n_compositions(m: int, k: int) -> int:
    return math.comb(m + k - 1, k - 1)


def plan_for_budget(compile_step: Callable[[RecomputeConfig], object], n_layers: int, budget_bytes: int, *,
                    candidates: Sequence = DEFAULT_CANDIDATES, peak: str = "estimate", max_iterations: int = 4,
                    layer_bytes: _memory.LayerBytes | None = None, log: Callable[[str], None] | None = None,
                    target=None, trace_step: Callable | None = None, run_step: Callable | None = None) -> BudgetPlan:
    """Choose one recompute setting per layer minimizing recompute FLOPs with the compiled peak ≤ budget.

    Args:
      compile_step: `compile_step(recompute_config)` compiles the real train step with that config
        and returns a `remat.memory.CompiledMemory` (or a `jax.stages.Compiled`). Called once per
        distinct plan (about 2 per candidate to calibrate, then 1 per verification).
      n_layers: layers in the stack (all identical).
      budget_bytes: the bound on the peak, in bytes.
      candidates: settings to choose from per layer: "none" (or None), `remat.policies` names and JAX
        policy callables (shown by `remat.policies.describe`). A name-based one that compiles to full
        remat's program on every layer saves nothing on this model and is dropped with a note; when
        that leaves none of the default presets, the policies by operation (`dots`, `dots_no_batch`)
        take their place (remat.planning.untagged).
      peak: "estimate" (arguments + outputs + temp − aliased, the default) or "temp".
      max_iterations: planning rounds at most (each compiles one plan to verify it).
      layer_bytes: the analytic bytes of one layer (`remat_lm.models.memory_model.activation_bytes`), only
        for the saved-bytes column of the table.
      log: called with one line per compilation (progress), e.g. `print`.
      target, trace_step: plan per tag for a `remat.planning.targets` target (name or Target): every tagged
        activation of every layer saved, offloaded or recomputed, at the least predicted step time
        on the target (remat.planning.tagplan, docs/planner.md); `trace_step(recompute_config)` returns the
        train step's jaxpr. `candidates` and `layer_bytes` are then not used. `run_step(recompute_config)`
        (a zero-argument callable running one step here) makes the step times measured, where the
        target is this machine (`front`).
    Returns:
      BudgetPlan; `.table()` prints it, `.recompute_config()` applies it.
    Raises:
      ValueError when the budget is below the least peak any candidate reaches (the message states
      that minimum and how to lower it), or for invalid arguments.
    Usage (compiles the step several times; tests/test_planner.py runs it on a tiny model):
        plan = plan_for_budget(lambda rc: compiled_memory(step_for(rc), *args), 8, 600 * 2**20)
        print(plan.table()); cfg = plan.recompute_config()
    """
    if peak not in PEAKS:
        raise ValueError(f"peak={peak!r} is not valid; use one of {', '.join(PEAKS)}")
    if target is not None or trace_step is not None:
        if trace_step is None:
            raise ValueError("plan_for_budget(target=...) plans per tag and needs trace_step(recompute_config) -> "
                             "the train step's jaxpr (jax.jit(step).trace(...).jaxpr)")
        # no remat first: where it fits, that one compile is the answer (nothing to trace or calibrate)
        none_lp = (None,) * n_layers
        none_cm = compiled_stats(compile_step(recompute_config(none_lp)))
        p_none = none_cm.peak_estimate if peak == "estimate" else none_cm.temp
        if log:
            log(f"compiled {_tagplan.format_plan(none_lp)}: peak {format_bytes(p_none)}")
        if p_none <= int(budget_bytes):
            return BudgetPlan(layer_policies=none_lp, saved_bytes=(None,) * n_layers, freed_bytes=(0,) * n_layers,
                              recompute_flops=(0.0,) * n_layers, budget=int(budget_bytes), peak_kind=peak,
                              predicted_peak=p_none, compiled_peak=p_none, compiled=none_cm, no_remat_peak=p_none,
                              minimum_peak=p_none, compiled_recompute_flops=0.0, iterations=1, compiles=1,
                              notes=("no remat fits the budget: nothing is recomputed",))
        plan = front(compile_step, trace_step, n_layers, [budget_bytes], target=target, peak=peak,
                     max_iterations=max_iterations, log=log, known={none_lp: none_cm}, run_step=run_step).plans[0]
        return dataclasses.replace(plan, compiles=plan.compiles + 1)  # and no remat's, above
    if not is_int(n_layers) or n_layers < 1:
        raise ValueError(f"n_layers={n_layers!r} must be a positive int")
    budget_bytes = int(budget_bytes) if isinstance(budget_bytes, np.integer) else budget_bytes
    if not is_int(budget_bytes) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be a positive number of bytes")
    if max_iterations < 1:
        raise ValueError(f"max_iterations={max_iterations} must be >= 1")
    cands = []
    for c in candidates:
        p = _policy(c)
        if p is not None:
            try:
                _policies.validate(p)
            except ValueError as e:
                raise ValueError(f"plan_for_budget candidate: {e}") from None
        if p not in cands:
            cands.append(p)
    if None not in cands:
        cands.insert(0, None)
    if len(cands) < 2:
        raise ValueError("plan_for_budget needs at least one remat candidate besides 'none'")
    L, budget = n_layers, int(budget_bytes)
    say = log or (lambda s: None)
    cache: dict = {}   # layer_policies tuple -> CompiledMemory
    notes = []

    def measure(lp: tuple) -> _memory.CompiledMemory:
        lp = tuple(lp)
        if lp not in cache:
            cache[lp] = compiled_stats(compile_step(recompute_config(lp)))
            say(f"measured {_tagplan.format_plan(lp)}: peak {format_bytes(pk(cache[lp]))}")
        return cache[lp]

    def pk(cm) -> int:
        return cm.peak_estimate if peak == "estimate" else cm.temp

    def saved_of(c):
        if layer_bytes is None:
            return None
        return _memory.predict_saved(layer_bytes, 1, recompute_config((c,)))

    # 1. Calibrate: no remat, then every candidate on every layer (the minimum), then on all but the last.
    none_lp = (None,) * L
    base = measure(none_lp)
    p_none, f_none = pk(base), base.flops
    if p_none <= budget:
        notes.append("no remat fits the budget: nothing is recomputed")
        return _result(none_lp, cands, {None: Candidate("none", 0.0, 0.0, 0.0, saved_of(None), p_none)}, budget,
                       peak, p_none, base, p_none, p_none, 0.0, 1, len(cache), notes, pk)
    uniform, saves_nothing = _untagged.screen([c for c in cands if c is not None], measure, L)
    for c, note in saves_nothing:
        cands.remove(c)
        notes.append(note)
    if saves_nothing and tuple(candidates) == DEFAULT_CANDIDATES and not any(_policies.by_name(c) for c in uniform):
        ops = [c for c in _untagged.by_operation() if c not in cands]
        notes.append(f"no layer computes a value the presets name: planning with the policies by operation "
                     f"({', '.join(ops)}) instead")
        for c in ops:
            cands.append(c)
            uniform[c] = measure((c,) * L)
    for c in [c for c in uniform if _policies.offloads(c)]:
        dropped = _offload_raises(c, uniform[c], measure, pk, L)
        if dropped:
            del uniform[c]
            cands.remove(c)
            notes.append(dropped)
    if not uniform:
        raise ValueError("plan_for_budget: every remat candidate was dropped (" + "; ".join(notes) + "); "
                         "add one that keeps its values on the device, e.g. full")
    best_c = min(uniform, key=lambda c: pk(uniform[c]))
    minimum = min(pk(uniform[best_c]), p_none)
    if budget < minimum:
        what = "compiled peak: arguments + outputs + temp - aliased" if peak == "estimate" else "compiled temp"
        who = (f"that the most memory-saving setting ({_name(best_c)} on every layer) reaches; no remat needs "
               f"{format_bytes(p_none)}" if pk(uniform[best_c]) < p_none else
               "that no remat needs: no candidate lowers this step's peak (activations are not what fills it)")
        raise ValueError(
            f"memory budget {format_bytes(budget)} is below the minimum of {format_bytes(minimum, up=True)} "
            f"({minimum:,} bytes, {what}) {who}. Raise the budget to at least {format_bytes(minimum, up=True)}, or "
            f"lower the memory: a smaller micro-batch (with more gradient accumulation steps), a shorter sequence, "
            f"bfloat16 compute, or sharding parameters and optimizer state over more devices")
    table = {None: Candidate("none", 0.0, 0.0, 0.0, saved_of(None), p_none)}
    for c in uniform:
        u = uniform[c]
        f = max(0.0, (u.flops - f_none) / L)
        if L > 1:
            b = pk(measure((c,) * (L - 1) + (None,)))
            d, e = (p_none - b) / (L - 1), b - pk(u)
        else:
            d, e = 0.0, float(p_none - pk(u))
        table[c] = Candidate(_name(c), d, e, f, saved_of(c), pk(u))

    # 2. Enumerate plans: counts of interior layers per candidate x the last layer's candidate.
    order = sorted(cands, key=lambda c: -table[c].interior_freed)   # most-freeing first
    group = 1
    k = len(order)
    while _n_compositions((L - 1) // group, k) * (k if (L - 1) % group else 1) * k > MAX_PLANS:
        group += 1
    if group > 1:
        notes.append(f"{L - 1} interior layers planned in groups of {group} (at most {MAX_PLANS:,} plans): "
                     f"optimal over such plans, not over all")
    units, rest = divmod(L - 1, group)   # `units` groups of `group` layers, then `rest` layers alike
    comp = _compositions(units, k) * group
    if rest:
        comp = (comp[:, None, :] + rest * np.eye(k, dtype=np.int32)[None, :, :]).reshape(-1, k)
    d = np.array([table[c].interior_freed for c in order])
    e = np.array([table[c].last_freed for c in order])
    f = np.array([table[c].flops for c in order])
    pred = (p_none - comp @ d)[:, None] - e[None, :]                 # (plans, last)
    cost = (comp @ f)[:, None] + f[None, :]
    pred, cost = pred.ravel(), cost.ravel()
    n_last = len(order)

    def layout(idx: int) -> tuple:
        counts, last = comp[idx // n_last], order[idx % n_last]
        lp = []
        for c, n in zip(order, counts):
            lp += [c] * int(n)
        return tuple(lp) + (last,)

    # 3. Choose the cheapest plan predicted to fit; verify it; refine on overshoot. A plan compiled
    # already (calibration, earlier rounds) is judged by its measured peak, not the prediction.
    flops_of = lambda lp: sum(table[c].flops for c in lp)
    internal = budget
    failed: set = set()
    chosen, chosen_pred, iterations = None, None, 0
    for it in range(1, max_iterations + 1):
        iterations = it
        pick = None
        ok = np.flatnonzero(pred <= internal)
        for idx in ok[np.lexsort((pred[ok], cost[ok]))]:   # by recompute FLOPs, then by predicted peak
            lp = layout(int(idx))
            cm = cache.get(lp)
            if lp not in failed and (cm is None or pk(cm) <= budget):
                pick = (lp, float(pred[idx]), float(cost[idx]))
                break
        known = [lp for lp, cm in cache.items() if pk(cm) <= budget and len(lp) == L and all(c in table for c in lp)]
        best_known = min(known, key=lambda lp: (flops_of(lp), pk(cache[lp])), default=None)
        if best_known is not None and (pick is None or flops_of(best_known) <= pick[2]):
            chosen, chosen_pred = best_known, _predict(best_known, table, p_none)
            break
        if pick is None:
            break
        lp, p_pred, _ = pick
        got = pk(measure(lp))
        if got <= budget:
            chosen, chosen_pred = lp, p_pred
            break
        failed.add(lp)
        over = got - budget
        internal -= over
        notes.append(f"round {it}: {_tagplan.format_plan(lp)} predicted {format_bytes(p_pred)} but compiled to "
                     f"{format_bytes(got)}, {format_bytes(over)} over the budget; planning again with an internal "
                     f"budget of {format_bytes(internal)}")
    if chosen is None:
        # Out of rounds: the cheapest compiled plan that fits (the minimum plan always does).
        fitting = [lp for lp, cm in cache.items() if pk(cm) <= budget and all(c in table for c in lp)]
        chosen = min(fitting, key=lambda lp: (sum(table[c].flops for c in lp), pk(cache[lp])))
        chosen_pred = _predict(chosen, table, p_none)
        notes.append(f"no plan predicted to fit was verified within {max_iterations} round(s): using the cheapest "
                     f"compiled plan that fits, {_tagplan.format_plan(chosen)}")
    elif iterations > 1:
        notes.append(f"refined: the plan fit in round {iterations}")
    cm = cache[chosen]
    return _result(chosen, cands, table, budget, peak, int(round(chosen_pred)), cm, p_none, minimum,
                   cm.flops - f_none, iterations, len(cache), notes, pk)


def _offload_raises(c, cm, measure, pk, L: int) -> str | None:
    """Why offloading candidate `c` is dropped (a note), or None to keep it: dropped when its
    uniform peak is not below that of its device twin (the same values saved on the device,
    `remat.policies.device_twin`), i.e. when on this compiler offloading raises device memory.
    """
    twin = _policies.device_twin(c)
    if twin is None:
        return None
    kept = measure((twin,) * L)
    if pk(cm) < pk(kept):
        return None
    return (f"candidate {_name(c)} dropped: offloading does not lower the compiled peak on this compiler "
            f"({format_bytes(pk(cm))} on every layer against {format_bytes(pk(kept))} keeping the same values on "
            f"the device, {_name(twin)})")


def _predict(lp: tuple, table: dict, p_none: int) -> float:
    return p_none - sum(table[c].interior_freed for c in lp[:-1]) - table[lp[-1]].last_freed


def _result(lp, cands, table, budget, peak, predicted, cm, p_none, minimum, flops, iterations, compiles, notes, pk):
    L = len(lp)
    freed = tuple((table[c].interior_freed if i < L - 1 else table[c].last_freed) for i, c in enumerate(lp))
    return BudgetPlan(layer_policies=tuple(lp), saved_bytes=tuple(table[c].saved for c in lp),
                      freed_bytes=freed, recompute_flops=tuple(table[c].flops for c in lp), budget=budget,
                      peak_kind=peak, predicted_peak=int(predicted), compiled_peak=pk(cm), compiled=cm,
                      no_remat_peak=p_none, minimum_peak=minimum, compiled_recompute_flops=float(flops),
                      iterations=iterations, compiles=compiles, candidates=tuple(table.values()),
                      notes=tuple(notes))


# ------------------------------------------------------------------------------------------------
# The tag planner's front (target=...): remat.planning.tagplan's model, solved per budget, every plan compiled.

@dataclasses.dataclass(frozen=True)
class Front:
    """Plans for increasing budgets (`plans`, one BudgetPlan per budget, monotone: a larger budget
    never has a slower predicted step), the calibrated `model` (remat.planning.tagplan.Model) and every
    compiled plan (`measured`: per-layer policies -> CompiledMemory)."""
    plans: tuple
    model: _tagplan.Model
    measured: dict
    compiles: int


def front(compile_step: Callable[[RecomputeConfig], object], trace_step: Callable, n_layers: int,
          budgets: Sequence, *, target=None, peak: str = "estimate", max_iterations: int = 4,
          log: Callable[[str], None] | None = None, known: dict | None = None, model=None,
          measured: dict | None = None, run_step: Callable | None = None) -> Front:
    """Plan every budget (bytes or size strings) per tag on `target` and compile each plan.

    Args:
      compile_step, trace_step: `f(recompute_config)` -> the compiled step (CompiledMemory or
        jax.stages.Compiled) / the step's jaxpr.
      n_layers: layers in the stack.
      budgets: bounds on the compiled peak, planned in increasing order.
      target: a `remat.planning.targets` name or Target (its roofline prices time; None: this host's CPU).
      known: {per-layer policies: CompiledMemory} of plans compiled already: a known plan that fits
        and is predicted faster than the solver's answer is taken instead.
      model, measured: a calibrated Model and its compiled plans, to share between calls.
      run_step: `run_step(recompute_config)` -> a zero-argument callable running one step on this
        machine (blocking): where the target is this machine, step times are measured (the
        calibration programs timed interleaved until their spread is known); None: the target
        compiler's optimized programs, priced on the target's roofline.
    Returns:
      Front. Raises ValueError when a budget is below full remat's compiled peak.
    Example (compiles the step several times; tests/test_planner.py runs it on a tiny model):
        f = front(compile_step, trace_step, 12, ["6GiB", "8GiB"], target="h200")
        [p.text for p in f.plans]
    """
    from remat.planning import targets as _targets

    if peak not in PEAKS:
        raise ValueError(f"peak={peak!r} is not valid; use one of {', '.join(PEAKS)}")
    tgt = _targets.get(target) if target is not None else _targets.get("cpu")
    say = log or (lambda s: None)
    pk = (lambda cm: cm.peak_estimate) if peak == "estimate" else (lambda cm: cm.temp)
    cache = {} if measured is None else measured
    for lp, cm in (known or {}).items():
        cache.setdefault(tuple(lp), cm)
    n_compiled = [0]

    def measure(lp):
        lp = tuple(None if p == "none" else p for p in lp)
        if lp not in cache:
            cache[lp] = compiled_stats(compile_step(recompute_config(lp)))
            n_compiled[0] += 1
            say(f"compiled {_tagplan.format_plan(lp)}: peak {format_bytes(pk(cache[lp]))}")
        return cache[lp]

    if model is None:
        program_time = None
        if run_step is not None:
            from remat.planning import timing as _timing

            def program_time(lps):
                steps = {lp: run_step(recompute_config(lp)) for lp in lps}
                say(f"timing {len(steps)} programs interleaved until their spread is known")
                got = _timing.time_programs(steps)
                return {lp: (t.median_s, t.notch_s) for lp, t in got.items()}
        model = _tagplan.calibrate(compile_step, trace_step, n_layers, tgt, peak=pk, measure=measure,
                                   program_time=program_time,
                                   time_source="measured on this machine (interleaved, median)" if run_step else "")
    L = n_layers
    none_cm = measure((None,) * L)
    plans, prev = [], None
    for b in sorted(int(b) for b in budgets):
        if b < model.p_full and pk(none_cm) > b:
            raise ValueError(f"memory budget {format_bytes(b)} is below the minimum of {format_bytes(model.p_full, up=True)} "
                             f"({model.p_full:,} bytes) that full remat on every layer reaches on {tgt.compiler}; raise "
                             f"the budget, or lower the memory: a smaller micro-batch, a shorter sequence, bfloat16 "
                             f"compute, or sharding over more devices")
        notes = list(model.notes)
        internal, chosen, it = b, None, 0
        for it in range(1, max_iterations + 1):
            lp = model.solve(internal)
            if lp is None:
                break
            got = pk(measure(lp))
            if got <= b:
                chosen = lp
                break
            notes.append(f"round {it}: {_tagplan.format_plan(lp)} compiled to {format_bytes(got)}, "
                         f"{format_bytes(got - b)} over; solving again with {format_bytes(internal - (got - b))}")
            internal -= got - b
        fits = {lp: cm for lp, cm in cache.items() if len(lp) == L and pk(cm) <= b and _priced(model, lp)}
        best = min(fits, key=lambda lp: model.predict(lp)[1], default=None)
        if best is not None and (chosen is None or model.predict(best)[1] < model.predict(chosen)[1]):
            if chosen is not None:
                notes.append(f"{_tagplan.format_plan(best)}, compiled already, fits and is predicted faster than "
                             f"the solver's {_tagplan.format_plan(chosen)}: taken")
            chosen = best
        chosen = _toward_memory(model, chosen, b, cache, pk, measure, notes, L)
        if prev is not None and model.predict(prev)[1] < model.predict(chosen)[1]:
            notes.append(f"the plan of the smaller budget is predicted faster: kept (monotone front)")
            chosen = prev
        prev = chosen
        cm = cache[chosen]
        pred_peak, step = model.predict(chosen)
        per = [model.layer_cost(p) for p in chosen]
        plans.append(BudgetPlan(
            layer_policies=tuple(chosen), saved_bytes=tuple(int(m) for m, _, _ in per),
            freed_bytes=tuple(model.m_none - m for m, _, _ in per), recompute_flops=(0.0,) * L, budget=b,
            peak_kind=peak, predicted_peak=pred_peak, compiled_peak=pk(cm), compiled=cm, no_remat_peak=pk(none_cm),
            minimum_peak=model.p_full, compiled_recompute_flops=float((cm.flops or 0) - (none_cm.flops or 0)),
            iterations=it, compiles=n_compiled[0], notes=tuple(notes), predicted_step_s=step,
            time_source=model.time_source))
    return Front(tuple(plans), model, cache, n_compiled[0])


def _toward_memory(model, chosen: tuple, budget: int, cache: dict, pk: Callable, measure: Callable, notes: list,
                   n_layers: int) -> tuple:
    """Ties broken toward memory: among plans predicted within the model's spread of `chosen`'s
    step (compiled ones that fit, and the solver's answers for smaller budgets, compiled to check),
    the one with the least compiled peak; a note says so."""
    t_star = model.predict(chosen)[1]
    tie = lambda lp: model.predict(lp)[1] <= t_star + model.spread_s
    pool = {lp for lp, cm in cache.items() if len(lp) == n_layers and pk(cm) <= budget and _priced(model, lp) and tie(lp)}
    if model.spread_s > 0:
        lo = model.p_full
        for j in range(8):   # the least budget whose answer still ties
            lp = model.solve(lo + j * (pk(cache[chosen]) - lo) / 8)
            if lp is not None and tie(lp):
                if pk(measure(lp)) <= budget:
                    pool.add(tuple(lp))
                break
    best = min(pool | {chosen}, key=lambda lp: (pk(cache[lp]) if lp in cache else pk(measure(lp)), model.predict(lp)[1]))
    if best != chosen:
        gain = pk(cache[chosen]) - pk(cache[best])
        notes.append(f"tie broken toward memory: {_tagplan.format_plan(best)} is predicted within "
                     f"{model.spread_s * 1e3:.2f} ms (the measured spread) of {_tagplan.format_plan(chosen)} with a "
                     f"compiled peak {format_bytes(gain)} smaller")
    return best


def _priced(model, lp) -> bool:
    try:
        model.predict(lp)
        return True
    except ValueError:
        return False
