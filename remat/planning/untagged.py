"""The preset planner on a model that tags nothing: which name-based candidates are full remat
under another name, and what to plan with instead.

A name-based policy (`norm`, `mlp`, `save_names:...`) saves values by their `checkpoint_name` tag;
on a model that computes no value it names, its program is full remat's. `screen` finds those
candidates from the compiled programs (the optimized HLO, `remat.compiled.hlo_fingerprint`, or
where a compile gives no program text, every figure of its memory analysis and its FLOPs) so that
`remat.plan_for_budget` drops them with a note instead of printing `norm x2` for a layer that saves
nothing; `by_operation` names the registry's policies by operation (`dots`, `dots_no_batch`), which
need no tags, for it to plan with in their place. docs/planner.md, "Models nobody tagged".

Example:
    >>> keeps_within("core_attn+mlp+norm", "norm"), keeps_within("norm", "mlp")
    (True, False)
    >>> by_operation()
    ('dots', 'dots_no_batch')
"""
from __future__ import annotations

from typing import Callable, Sequence

from remat import policies as _policies
from remat.compiled import CompiledMemory

__all__ = ["SAVES_NOTHING", "by_operation", "keeps_within", "same_program", "screen"]

SAVES_NOTHING = "saves nothing on this model: no layer computes a value it names"


def same_program(a: CompiledMemory, b: CompiledMemory) -> bool:
    """Whether two compiles are one program: the same optimized HLO (`hlo_fingerprint`, debug
    information aside) when both have it, else the same memory analysis and FLOPs.

    Example:
      >>> m = CompiledMemory(temp=8, argument=4, output=4, alias=0, generated_code=0, host_temp=0, flops=2.0)
      >>> same_program(m, m), same_program(m, CompiledMemory(**{**m.__dict__, "temp": 9}))
      (True, False)
    """
    if a.fingerprint is not None and b.fingerprint is not None:
        return a.fingerprint == b.fingerprint
    fields = ("temp", "argument", "output", "alias", "host_temp", "host_argument", "host_output", "flops")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def keeps_within(policy, other) -> bool:
    """Whether every tag name-based `policy` saves or offloads, `other` saves or offloads too (both
    registry names or `Policy`s; False when either is not name-based).

    Example:
      >>> keeps_within("save_names:qkv", "core_attn"), keeps_within("save_names:attn_probs", "core_attn")
      (True, False)
    """
    a, b = _policies.by_name(policy), _policies.by_name(other)
    if a is None or b is None:
        return False
    # both keep either finitely many names or all but finitely many: the names either mentions,
    # and one name neither mentions (standing for all the others), decide it
    named = set(a.exclude) | set(b.exclude) | set(a.offload) | set(b.offload)
    named |= set(a.save or ()) | set(b.save or ())
    other_name = "\0" + "".join(sorted(named))
    return all(b.keeps(n) for n in named | {other_name} if a.keeps(n))


def by_operation() -> tuple:
    """The registry's policies by operation that save some values and recompute others (JAX's
    `dots_saveable`, `dots_with_no_batch_dims_saveable`): candidates that need no tags."""
    return tuple(k for k, e in _policies.REGISTRY.items()
                 if not e.template and _policies.by_op(k) not in (None, "nothing", "everything"))


def screen(candidates: Sequence, measure: Callable[[tuple], CompiledMemory], n_layers: int) -> tuple:
    """Split the rematerializing candidates into those to plan with and the name-based ones that
    compile to full remat's program on every layer (`same_program`).

    Args:
      candidates: policies (names or JAX policy callables), none of them None.
      measure: `measure(layer_policies)` -> the CompiledMemory of that plan (cached by the caller).
      n_layers: layers in the stack.
    Returns:
      `(uniform, dropped)`: {candidate: CompiledMemory on every layer} of the kept ones, in order,
      and [(candidate, note)] of the dropped ones. A name-based candidate that keeps only what a
      dropped one keeps (`keeps_within`) is dropped without compiling; full remat (`full`, or JAX's
      `nothing_saveable` when that is the candidate) is compiled for the comparison when it is no
      candidate and some candidate is name-based.
    """
    L = n_layers
    named = [c for c in candidates if _policies.by_name(c) is not None]
    uniform: dict = {}
    dropped: list = []
    full_remat = next((c for c in candidates if _policies.by_op(c) == "nothing"), _policies.NOTHING)
    full = measure((full_remat,) * L) if named else None
    # the candidates that keep more first, so one found saving nothing settles those keeping less
    for c in sorted(named, key=lambda c: -sum(keeps_within(d, c) for d in named)):
        within = next((d for d, _ in dropped if keeps_within(c, d)), None)
        if within is not None:
            dropped.append((c, f"candidate {_name(c)} dropped: it {SAVES_NOTHING} (it keeps only what "
                               f"{_name(within)} keeps, which compiles to full remat's program)"))
            continue
        cm = measure((c,) * L)
        if same_program(cm, full):
            how = "program" if cm.fingerprint is not None and full.fingerprint is not None else "peak and FLOPs"
            dropped.append((c, f"candidate {_name(c)} dropped: it {SAVES_NOTHING} (on every layer it compiles to "
                               f"full remat's {how})"))
        else:
            uniform[c] = cm
    gone = [c for c, _ in dropped]
    kept = {c: uniform[c] if c in uniform else measure((c,) * L) for c in candidates if c not in gone}
    return kept, dropped


def _name(c) -> str:
    return _policies.describe(c)
