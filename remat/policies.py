"""The one registry of remat policy names: each name is a composition of JAX's own policies.

A policy decides, for each primitive inside a checkpointed region, whether its output is saved for
the backward pass, offloaded to host memory, or recomputed. `get(name)` turns a registry name into
a `Policy`: a small frozen, hashable object with JAX's policy protocol (`policy(prim, *avals,
**params)`) whose fields say what it saves, offloads and in which dtype, so `describe`, `by_name`,
`offloads` and `device_twin` read them. It decides as the `jax.checkpoint_policies` composition
its fields name (`save_only_these_names`, `save_any_names_but_these`,
`save_and_offload_only_these_names`, `nothing_saveable`, ...); the one local combinator is the
dtype-preserving `bf16:<policy>` (`DtypePreserving`). Everywhere a policy is accepted, a JAX policy
callable works as well as a name (reports call it "a JAX policy": what it saves is known only by
tracing). `names()` lists what `get` accepts; the CLI's choices, the policy table of docs/library.md and the tests'
parametrization all derive from `REGISTRY`.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from remat import memory, names, policies
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> layer = lambda w, x: jnp.sum(jnp.tanh(checkpoint_name(x @ w, names.QKV)))
    >>> f = jax.checkpoint(layer, policy=policies.get("save_names:qkv"))
    >>> list(memory.saved_residuals(f, jnp.ones((8, 8)), jnp.ones((4, 8))).by_name())
    [..., 'qkv']
    >>> policies.describe(policies.get("save_names:qkv"))
    "jax.checkpoint_policies.save_only_these_names('qkv')"
"""
from __future__ import annotations

import dataclasses
import collections
import functools
import warnings
from typing import Callable

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import Recompute

from remat import names as N

__all__ = ["NOTHING", "Policy", "DtypePreserving", "ByName", "Entry", "REGISTRY", "UntaggedRegionWarning", "get",
           "resolve", "validate", "names", "examples", "describe", "by_name", "by_op", "offloads", "device_twin",
           "selective", "region_tags", "region_key", "warn_untagged", "table_markdown"]

cp = jax.checkpoint_policies

OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"

# The policy that saves nothing inside a region (JAX's `nothing_saveable`): the word of the granularity
# that recomputes everything.
NOTHING = "full"


def _wide_float(prim, avals, params) -> bool:
    """True when `prim` returns a float of 32 bits or more."""
    if prim.name == "name":
        dt = avals[0].dtype
    elif prim is lax.convert_element_type_p:
        dt = params.get("new_dtype")
    elif prim is lax.dot_general_p:
        dt = params.get("preferred_element_type") or jnp.result_type(*(a.dtype for a in avals))
    else:
        floats = [a.dtype for a in avals if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
        dt = jnp.result_type(*floats) if floats else None
    return dt is not None and jnp.issubdtype(dt, jnp.floating) and jnp.dtype(dt).itemsize >= 4


# Ops that only move, replicate, cut out or pad their input: recomputing one costs no FLOPs and needs
# only its input, which is either kept anyway or itself recomputed, so saving their outputs is never
# worth it.
# Slices and pads are among them (docs/architecture.md, Design notes: `policies.py` `_MOVES`).
_MOVES = frozenset({"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "copy", "copy_p",
                    "slice", "dynamic_slice", "pad"})


def _out_dtypes(prim, avals, params):
    """The dtypes `prim` returns for `avals` (None when its abstract evaluation is not available)."""
    try:
        out = prim.abstract_eval(*avals, **params)
    except Exception:
        return None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (set, frozenset)):
        out = out[0]  # (avals, effects)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    dts = [getattr(a, "dtype", None) for a in outs]
    return None if any(d is None for d in dts) else dts


@dataclasses.dataclass(frozen=True)
class DtypePreserving:
    """Wrap `base` so that only low-precision float values it saves are kept (never a float32 copy).

    Meant for bf16 compute. Of what `base` would save, a value is recomputed instead when it is
    - a float of 32 bits or more that the model did not tag by name: in bf16 compute that is an
      upcast (norm statistics, a float32 softmax or log-sum-exp, a matmul accumulated in float32
      before its cast to bf16, whose bf16 cast is what gets saved);
    - not a float at all (boolean masks, integer indices): derived from iotas, keys or compared
      floats, cheap to rebuild;
    - a reshape, transpose, broadcast, slice or pad of another value (no FLOPs; inside a loop a
      saved slice would be saved once per iteration).
    So the wrapper never marks a value its base does not, and what it keeps of a bf16 model is bf16
    (tests/test_bf16_policy.py checks saved bytes `bf16:p` <= `p` for every registry policy on both
    models, with one and with two attention tiles). Values the model tagged by name are kept as
    `base` decides, in the dtype the forward computed them in. (In a float32 model this keeps only
    named values.)
    """
    base: Callable

    def __repr__(self):
        return f"DtypePreserving({describe(self.base)})"

    def __call__(self, prim, *avals, **params):
        decision = self.base(prim, *avals, **params)
        if decision is False or decision is Recompute or prim.name == "name":
            return decision
        if prim.name in _MOVES:
            return Recompute
        dts = _out_dtypes(prim, avals, params)
        if dts is None:
            return Recompute if _wide_float(prim, avals, params) else decision
        keep = all(jnp.issubdtype(d, jnp.floating) and jnp.dtype(d).itemsize < 4 for d in dts)
        return decision if keep else Recompute


# The policies by operation, by the `jax.checkpoint_policies` attribute each is.
_OPS = {"nothing": "nothing_saveable", "everything": "everything_saveable", "dots": "dots_saveable",
        "dots_no_batch": "dots_with_no_batch_dims_saveable"}


@dataclasses.dataclass(frozen=True)
class Policy:
    """A registry policy: JAX's policy protocol plus what it does, as fields.

    Args:
      kind: `names` (it saves and offloads by `checkpoint_name` tag) or a policy by operation:
        `nothing`, `everything`, `dots`, `dots_no_batch`.
      save: the tags saved on the device; None: every tag but `exclude` (the selective presets).
      exclude: with `save=None`, the tags it does not save.
      offload: the tags offloaded to pinned host memory.
      dtype: None, or `bf16`: of what the rest saves, keep only low-precision floats (`DtypePreserving`).
    Example:
      >>> get("save_names:qkv")
      Policy(kind='names', save=frozenset({'qkv'}), exclude=frozenset(), offload=frozenset(), dtype=None)
      >>> get("save_names:qkv") == Policy("names", save=frozenset({"qkv"}))
      True
    """
    kind: str = "names"
    save: frozenset | None = frozenset()
    exclude: frozenset = frozenset()
    offload: frozenset = frozenset()
    dtype: str | None = None

    def __post_init__(self):
        if self.kind not in ("names", *_OPS) or self.dtype not in (None, "bf16"):
            raise ValueError(f"Policy(kind={self.kind!r}, dtype={self.dtype!r}): kind is names or one of "
                             f"{', '.join(_OPS)}, dtype None or 'bf16'")
        for f in ("save", "exclude", "offload"):
            v = getattr(self, f)
            if v is not None:
                object.__setattr__(self, f, frozenset(v))

    def __call__(self, prim, *avals, **params):
        return _jax_policy(self)(prim, *avals, **params)

    def jax_expression(self) -> str:
        """The `jax.checkpoint_policies` expression this policy decides as (the bf16 wrapper around it)."""
        if self.dtype == "bf16":
            return f"remat.policies.DtypePreserving({dataclasses.replace(self, dtype=None).jax_expression()})"
        if self.kind != "names":
            return f"jax.checkpoint_policies.{_OPS[self.kind]}"
        q = lambda names: ", ".join(map(repr, sorted(names)))  # noqa: E731
        if self.save is None:
            return f"jax.checkpoint_policies.save_any_names_but_these({q(self.exclude)})"
        if self.offload:
            return (f"jax.checkpoint_policies.save_and_offload_only_these_names(names_which_can_be_saved=("
                    f"{q(self.save)}{',' if len(self.save) == 1 else ''}), names_which_can_be_offloaded=("
                    f"{q(self.offload)}{',' if len(self.offload) == 1 else ''}), offload_src={OFFLOAD_SRC!r}, "
                    f"offload_dst={OFFLOAD_DST!r})")
        return f"jax.checkpoint_policies.save_only_these_names({q(self.save)})"


@functools.lru_cache(maxsize=None)
def _jax_policy(p: Policy) -> Callable:
    """The JAX policy callable a `Policy` decides as (built once per policy)."""
    if p.dtype == "bf16":
        return DtypePreserving(_jax_policy(dataclasses.replace(p, dtype=None)))
    if p.kind != "names":
        return getattr(cp, _OPS[p.kind])
    if p.save is None:
        return cp.save_any_names_but_these(*sorted(p.exclude))
    if p.offload:
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=tuple(sorted(p.save)), names_which_can_be_offloaded=tuple(sorted(p.offload)),
            offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST)
    return cp.save_only_these_names(*sorted(p.save))


def _names_arg(arg: str, name: str) -> tuple:
    got = tuple(a.strip() for a in arg.split(",") if a.strip())
    bad = [a for a in got if a not in N.known()]
    if not got or bad:
        raise ValueError(f"policy {name!r}: unknown activation name(s) {bad or [arg]}; "
                         f"tagged names are {', '.join(N.known())}; for your own tags call "
                         f"remat.names.register({', '.join(map(repr, bad or ['name']))}) (docs/tagging.md)")
    return tuple(sorted(set(got)))


def selective(modules) -> Policy:
    """Save every tagged activation except the internals of `modules` (Megatron's
    `recompute_modules`): `jax.checkpoint_policies.save_any_names_but_these`; untagged values are
    recomputed."""
    unknown = [m for m in modules if m not in N.MODULES]
    if unknown:
        raise ValueError(f"unknown recompute module(s) {unknown}; valid: {', '.join(N.MODULES)}")
    return Policy(save=None, exclude=frozenset(n for m in modules for n in N.MODULES[m]))


def _offload(save: tuple = (), offload: tuple = ()) -> Policy:
    return Policy(save=frozenset(save), offload=frozenset(offload))


@dataclasses.dataclass(frozen=True)
class Entry:
    """A registry row: `factory(arg)` builds the policy; `template` shows the argument form."""
    factory: Callable
    help: str
    template: str | None = None   # e.g. "save_names:<a,b,...>"
    example: str | None = None    # a concrete instance used by tests and docs


REGISTRY: dict[str, Entry] = {
    NOTHING: Entry(lambda: Policy("nothing"), "save nothing inside a region; only its inputs are kept"),
    "everything": Entry(lambda: Policy("everything"), "save everything: remat becomes a no-op (baseline)"),
    "dots": Entry(lambda: Policy("dots"), "save matmul outputs, recompute the rest"),
    "dots_no_batch": Entry(lambda: Policy("dots_no_batch"),
                           "save matmuls without batch dims (projections, not attention scores)"),
    **{m: Entry(functools.partial(selective, (m,)),
                f"selective: save every tagged activation except {'/'.join(N.MODULES[m])}; "
                f"combine with '+', e.g. core_attn+mlp")
       for m in N.MODULES},
    "bf16": Entry(lambda: dataclasses.replace(selective(("core_attn",)), dtype="bf16"),
                  "dtype-preserving selective (core_attn): of what its policy saves, keeps tagged activations "
                  "and low-precision floats only (no float32 copy of a bf16 value, no mask, no reshaped or sliced "
                  "copy), "
                  "so never more bytes than the policy; `bf16:<policy>` wraps any policy",
                  template="bf16:<policy>", example="bf16:everything"),
    "save_names": Entry(lambda arg: Policy(save=frozenset(_names_arg(arg, "save_names"))),
                        "save only the listed tagged names",
                        template="save_names:<name,...>", example=f"save_names:{N.QKV},{N.ATTN_CONTEXT}"),
    "offload_names": Entry(lambda arg: _offload(offload=_names_arg(arg, "offload_names")),
                           "offload the listed tagged names to pinned host memory, recompute the rest",
                           template="offload_names:<name,...>", example=f"offload_names:{N.MLP_UP},{N.QKV}"),
    "custom": Entry(lambda arg: _custom(arg),
                    "per tagged name: `device` (save), `offload` (pinned host) or `remat` (recompute, "
                    "the default for unlisted names), MaxText-style",
                    template="custom:<name>=device|offload|remat,...",
                    example=f"custom:{N.QKV}=device,{N.MLP_UP}=offload,{N.MLP_ACT}=remat"),
}
_NEEDS_ARG = ("save_names", "offload_names", "custom")


def _custom(arg: str) -> Policy:
    choice = {"device": set(), "offload": set(), "remat": set()}
    for item in (a.strip() for a in arg.split(",") if a.strip()):
        name, eq, where = item.partition("=")
        if not eq or where not in choice:
            raise ValueError(f"policy 'custom:{arg}': {item!r} must be <name>=device|offload|remat")
        choice[where] |= set(_names_arg(name, "custom"))
    if not any(choice.values()):
        raise ValueError(f"policy 'custom:{arg}' lists no names; e.g. custom:qkv=device,mlp_up=offload")
    twice = sorted(choice["device"] & choice["offload"])
    if twice:
        raise ValueError(f"policy 'custom:{arg}' puts {', '.join(twice)} both on the device and offloaded; choose "
                         f"one of device|offload per name")
    return _offload(save=tuple(sorted(choice["device"])), offload=tuple(sorted(choice["offload"])))


# ------------------------------------------------------------------------------------------------
# What a policy is, for people (describe) and for the name-based reports (by_name).

def _jax_name(policy) -> str | None:
    """The `jax.checkpoint_policies` attribute that `policy` is (`nothing_saveable`, ...), or None."""
    return next((name for name, obj in vars(cp).items() if obj is policy), None)


def describe(policy) -> str:
    """A readable name for a policy: a registry name as is, a registry `Policy` as the JAX expression
    it decides as, one of `jax.checkpoint_policies`' policies by its name, another JAX policy as "a
    JAX policy", any other callable by its qualified name (None: "None").

    Example:
      >>> describe("core_attn"), describe(jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
      ('core_attn', 'jax.checkpoint_policies.dots_with_no_batch_dims_saveable')
      >>> describe(get("save_names:qkv,mlp_up"))
      "jax.checkpoint_policies.save_only_these_names('mlp_up', 'qkv')"
      >>> describe(jax.checkpoint_policies.save_only_these_names("qkv"))
      'a JAX policy (SaveOnlyTheseNames)'
    """
    if policy is None or isinstance(policy, str):
        return str(policy)
    if isinstance(policy, Policy):
        return policy.jax_expression()
    if isinstance(policy, DtypePreserving):
        return f"remat.policies.{policy!r}"
    name = _jax_name(policy)
    if name is not None:
        return f"jax.checkpoint_policies.{name}"
    if isinstance(policy, functools.partial):
        return repr(policy)
    module = getattr(policy, "__module__", None) or type(policy).__module__
    qual = getattr(policy, "__qualname__", None) or type(policy).__qualname__
    if module.split(".")[0] == "jax":
        return f"a JAX policy ({qual})"
    return f"{module}.{qual}"


@dataclasses.dataclass(frozen=True)
class ByName:
    """What a name-based policy does with `checkpoint_name`-tagged values.

    Attributes:
      save: the tag names it saves on the device; None: every name not in `exclude` (selective).
      exclude: with `save=None`, the names it does not save.
      offload: the tag names it offloads to host memory.
    """
    save: frozenset | None = frozenset()
    exclude: frozenset = frozenset()
    offload: frozenset = frozenset()

    def saves(self, name: str) -> bool:
        return name not in self.exclude and (self.save is None or name in self.save)

    def keeps(self, name: str) -> bool:
        """Saved or offloaded."""
        return self.saves(name) or name in self.offload

    def __str__(self):
        if self.save is None:
            return f"any name but {sorted(self.exclude)}"
        return str(sorted(self.save | self.offload))


def by_name(policy) -> ByName | None:
    """What a name-based registry policy (`save_names:`, the selective presets, `offload_names:`,
    `custom:`, also inside `bf16:`) saves and offloads by tag; None for any other policy (by
    operation: `dots`, `full`; a JAX policy or a callable of your own).

    Example:
      >>> by_name("core_attn").saves("attn_probs"), by_name("core_attn").saves("qkv")
      (False, True)
    """
    policy = resolve(policy)
    if not isinstance(policy, Policy) or policy.kind != "names":
        return None
    return ByName(save=policy.save, exclude=policy.exclude, offload=policy.offload)


def by_op(policy) -> str | None:
    """The operation a policy saves by, when it is exactly one of JAX's policies by operation (a
    registry name or `jax.checkpoint_policies`' own, no `bf16:`): `nothing`, `everything`, `dots`,
    `dots_no_batch`; None otherwise.

    Example:
      >>> by_op("full"), by_op(jax.checkpoint_policies.everything_saveable), by_op("core_attn")
      ('nothing', 'everything', None)
    """
    policy = resolve(policy)
    if isinstance(policy, Policy):
        return policy.kind if policy.kind != "names" and policy.dtype is None else None
    name = _jax_name(policy)
    return next((k for k, v in _OPS.items() if v == name), None)


def offloads(policy) -> bool | None:
    """Whether `policy` moves saved values to host memory: True (`offload_names:`, `custom:` with an
    `offload` name, also inside `bf16:`), False (a registry policy that keeps everything on the
    device, one of `jax.checkpoint_policies`' policies by operation, or None), None (another JAX
    policy or a callable of your own: only tracing the region tells).

    Example:
      >>> offloads("offload_names:qkv"), offloads("save_names:qkv"), offloads(lambda *a, **k: True)
      (True, False, None)
    """
    policy = resolve(policy)
    if isinstance(policy, Policy):
        return bool(policy.offload)
    if policy is None or _jax_name(policy) is not None:
        return False
    return None


def device_twin(policy) -> Policy | None:
    """The policy that saves on the device what `policy` offloads (and saves what it saves): what
    offloading is measured against. None for a policy that does not offload, or of unknown make.

    Example:
      >>> describe(device_twin("custom:qkv=device,mlp_up=offload"))
      "jax.checkpoint_policies.save_only_these_names('mlp_up', 'qkv')"
    """
    policy = resolve(policy)
    if not isinstance(policy, Policy) or not policy.offload:
        return None
    return dataclasses.replace(policy, save=policy.save | policy.offload, offload=frozenset())


def _tags(jaxpr, out: set) -> set:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            out.add(eqn.params["name"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _tags(sub, out)
    return out


def region_tags(fn, *args) -> set:
    """The `checkpoint_name` tags that `fn(*args)` computes (sub-programs included)."""
    return _tags(jax.make_jaxpr(fn)(*args).jaxpr, set())


# What the untagged-region warning has looked at, oldest first: {key: None} for the programs seen
# (region identity, policy, input avals), {program: tags} for the region bodies traced. Bounded, so a
# long session holds no model alive; a key pushed out only means one more look.
_SEEN: "collections.OrderedDict" = collections.OrderedDict()
_TAGS: "collections.OrderedDict" = collections.OrderedDict()
_KEEP = 4096


class UntaggedRegionWarning(UserWarning):
    """A name-based policy on a region that tags none of its names: it is full remat."""


def _abstract(leaf):
    try:
        return jax.typeof(leaf)
    except TypeError:
        try:
            hash(leaf)
            return leaf
        except TypeError:
            return type(leaf)


def region_key(region, policy, *trees) -> tuple | None:
    """The key of one region's program for `warn_untagged`: `region` (a hashable identity), the
    resolved policy and the abstract values (shape, dtype, sharding) of `trees`, the region's inputs.
    None when something in it is not hashable (then every look warns).

    Example:
      >>> import jax.numpy as jnp
      >>> region_key("f", "full", jnp.ones(2)) == region_key("f", "full", jnp.zeros(2))
      True
    """
    leaves, tree = jax.tree.flatten(trees)
    key = (region, resolve(policy), tree, tuple(_abstract(x) for x in leaves))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _remember(store, key, value=None) -> None:
    store[key] = value
    store.move_to_end(key)
    while len(store) > _KEEP:
        store.popitem(last=False)


def warn_untagged(policy, fn, args, region: str, key=None, program=None) -> None:
    """Warn when `policy` saves or offloads by tag and `fn(*args)` tags none of those names (then the
    region saves nothing: full remat). Traces the region once more, for name-based policies only.

    Args:
      policy, region: the region's policy and its name in the message.
      fn, args: what the region computes, traced (`jax.make_jaxpr`) for its tags.
      key: the region's program (`region_key`): said and traced once per key; None: every call.
      program: optional key of what `fn` computes wherever the region sits (e.g. a module class and
        its input avals), so identical regions are traced once.
    """
    wanted = by_name(policy)
    if wanted is None or (wanted.save is not None and not wanted.save | wanted.offload):
        return
    if key is not None:
        if key in _SEEN:
            _SEEN.move_to_end(key)
            return
        _remember(_SEEN, key)
    found = _TAGS.get(program) if program is not None else None
    if found is None:
        found = frozenset(region_tags(fn, *args))
        if program is not None:
            _remember(_TAGS, program, found)
    if any(wanted.keeps(n) for n in found):
        return
    have = f"it tags only {sorted(found)}" if found else "it has no tagged activations"
    warnings.warn(
        f"remat: region {region!r}: the policy {describe(policy)} saves or offloads values tagged {wanted}, but "
        f"{have}: it is full remat. Tag activations with jax.ad_checkpoint.checkpoint_name(x, name) "
        f"(docs/tagging.md) or use policy {NOTHING!r} (said once per region and program)", UntaggedRegionWarning,
        stacklevel=3)


def names() -> tuple[str, ...]:
    """Every name `get` accepts: plain names and argument templates (`save_names:<name,...>`)."""
    out = []
    for k, e in REGISTRY.items():
        if k not in _NEEDS_ARG:
            out.append(k)
        if e.template:
            out.append(e.template)
    return tuple(out)


def examples() -> tuple[str, ...]:
    """One concrete, valid name per registry row and form (for tests and docs)."""
    out = [k for k in REGISTRY if k not in _NEEDS_ARG]
    out += [e.example for e in REGISTRY.values() if e.example]
    out.append("core_attn+mlp")
    return tuple(out)


@functools.lru_cache(maxsize=None)
def get(name: str) -> Policy:
    """Return the `Policy` for a registry name.

    Args:
      name: a plain name (`full`, `core_attn`, ...), a '+'-combination of selective modules
        (`core_attn+mlp`), or an argument form (`save_names:qkv,mlp_up`, `offload_names:mlp_up`,
        `bf16:<policy>`).
    Example:
      >>> get("core_attn+mlp") is get("core_attn+mlp")   # cached: jit sees one policy
      True
      >>> get("full")(jax.lax.sin_p) is jax.checkpoint_policies.nothing_saveable(jax.lax.sin_p)
      True
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy must be a non-empty name or a JAX policy callable; valid names: "
                         f"{', '.join(names())}")
    head, sep, arg = name.partition(":")
    if head == "bf16" and sep:
        return dataclasses.replace(get(arg), dtype="bf16")
    if head in _NEEDS_ARG:
        if not sep or not arg:
            raise ValueError(f"policy {name!r} needs an argument: {REGISTRY[head].template}")
        return REGISTRY[head].factory(arg)
    if sep and head in REGISTRY:
        raise ValueError(f"policy {head!r} takes no argument (got {name!r})")
    if "+" in name:
        return selective(tuple(p.strip() for p in name.split("+")))
    if head not in REGISTRY:
        raise ValueError(f"unknown policy {head!r}; valid: {', '.join(names())} "
                         f"(selective modules combine with '+', e.g. core_attn+mlp)")
    return REGISTRY[name].factory()


def resolve(policy) -> Callable | None:
    """The policy callable for `policy`: a registry name's `Policy` (`get`), a callable as it is, or None.

    Example:
      >>> resolve("dots") is get("dots"), resolve(jax.checkpoint_policies.dots_saveable) is jax.checkpoint_policies.dots_saveable
      (True, True)
    """
    if policy is None or callable(policy):
        return policy
    if isinstance(policy, str):
        return get(policy)
    raise ValueError(f"policy={policy!r} must be a remat.policies name or a JAX policy callable (e.g. "
                     f"jax.checkpoint_policies.dots_saveable); valid names: {', '.join(names())}")


def validate(policy) -> None:
    """Raise ValueError with the valid choices if `policy` is neither a usable policy name nor a callable."""
    resolve(policy)


def table_markdown() -> str:
    """The policy table of docs/library.md, generated from the registry."""
    rows = ["| policy | what it does | as JAX's policies (`jax.checkpoint_policies.`) |", "|---|---|---|"]
    short = lambda p: describe(p).replace("jax.checkpoint_policies.", "")  # noqa: E731
    for k, e in REGISTRY.items():
        jax_form = f"`{short(get(k))}`" if not e.template else f"`{e.example}` is `{short(get(e.example))}`"
        rows.append(f"| `{e.template or k}` | {e.help} | {jax_form} |")
    return "\n".join(rows)


if __name__ == "__main__":  # regenerate docs/library.md's policy table: python -m remat.policies
    print(table_markdown())
