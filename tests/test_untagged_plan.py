"""The planners on models nobody tagged: `remat.linen.tag_submodules` names a Linen layer's submodule
outputs by module path so the per-tag planner plans per tensor, and the preset planner drops the
presets that save nothing (remat.planning.untagged) and plans with JAX's policies by operation.

The model is a Hugging Face-style Flax GPT-2 (FlaxGPT2LMHeadModel's module names and call
convention, keyword bools, blocks named "0".."L-1" under `h`), one `remat.linen.remat_module` per
block, with no `checkpoint_name` in it. Gradients are compared on this host in float32 against the
model without remat: max|Δg| ≤ 1e-5·max|g| (float32 summation order; recomputation is exact).
"""
import contextlib
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

import remat
from remat import RecomputeConfig
from remat import linen as rlinen
from remat import policies
from remat.memory import CompiledMemory, compiled_stats
from remat.planning import cost, tagplan, untagged
from targethelp import GPU, need


@dataclasses.dataclass(frozen=True)
class Dims:
    vocab: int = 32
    T: int = 8
    C: int = 16
    heads: int = 2
    L: int = 2
    B: int = 2


SMALL = Dims()
H200 = Dims(vocab=64, T=32, C=128, heads=4, L=4, B=16)   # activations dominate the step's peak


class FlaxGPT2Attention(nn.Module):
    d: Dims

    def setup(self):
        self.c_attn = nn.Dense(3 * self.d.C)
        self.c_proj = nn.Dense(self.d.C)
        self.attn_dropout = nn.Dropout(0.1)
        self.resid_dropout = nn.Dropout(0.1)

    def __call__(self, hidden_states, attention_mask=None, deterministic: bool = True,
                 output_attentions: bool = False):
        d = self.d
        split = lambda t: t.reshape(t.shape[:2] + (d.heads, d.C // d.heads))  # noqa: E731
        q, k, v = (split(t) for t in jnp.split(self.c_attn(hidden_states), 3, axis=-1))   # (B, T, H, D)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d.C // d.heads) ** 0.5             # (B, H, T, T)
        t = hidden_states.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(scores.dtype).min)
        probs = self.attn_dropout(jax.nn.softmax(scores), deterministic=deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(hidden_states.shape)         # (B, T, C)
        out = self.resid_dropout(self.c_proj(out), deterministic=deterministic)
        return (out, probs) if output_attentions else (out,)


class FlaxGPT2MLP(nn.Module):
    d: Dims

    def setup(self):
        self.c_fc = nn.Dense(4 * self.d.C)
        self.c_proj = nn.Dense(self.d.C)
        self.dropout = nn.Dropout(0.1)

    def __call__(self, hidden_states, deterministic: bool = True):
        return self.dropout(self.c_proj(nn.gelu(self.c_fc(hidden_states))), deterministic=deterministic)


class FlaxGPT2Block(nn.Module):
    d: Dims

    def setup(self):
        self.ln_1 = nn.LayerNorm(epsilon=1e-5)
        self.attn = FlaxGPT2Attention(self.d)
        self.ln_2 = nn.LayerNorm(epsilon=1e-5)
        self.mlp = FlaxGPT2MLP(self.d)

    def __call__(self, hidden_states, attention_mask=None, deterministic: bool = True, init_cache: bool = False,
                 output_attentions: bool = False):
        attn = self.attn(self.ln_1(hidden_states), attention_mask=attention_mask, deterministic=deterministic,
                         output_attentions=output_attentions)
        hidden_states = hidden_states + attn[0]
        hidden_states = hidden_states + self.mlp(self.ln_2(hidden_states), deterministic=deterministic)
        return (hidden_states,) + attn[1:]


class FlaxGPT2BlockCollection(nn.Module):
    d: Dims
    recompute: RecomputeConfig = RecomputeConfig()   # a plan: one policy per layer

    @nn.compact
    def __call__(self, hidden_states, attention_mask=None, deterministic: bool = True):
        for i in range(self.d.L):
            policy = self.recompute.effective_policy(i) if self.recompute.enabled else None
            block = FlaxGPT2Block if policy is None else rlinen.remat_module(FlaxGPT2Block, policy=policy)  # remat:
            hidden_states = block(self.d, name=str(i))(hidden_states, attention_mask, deterministic=deterministic,
                                                       init_cache=False, output_attentions=False)[0]
        return hidden_states


class FlaxGPT2LMHeadModel(nn.Module):
    d: Dims
    recompute: RecomputeConfig = RecomputeConfig()

    @nn.compact
    def __call__(self, input_ids, deterministic: bool = True):
        wte = nn.Embed(self.d.vocab, self.d.C, name="wte")
        h = wte(input_ids) + nn.Embed(self.d.T, self.d.C, name="wpe")(jnp.arange(input_ids.shape[1]))
        h = nn.Dropout(0.1, name="dropout")(h, deterministic=deterministic)
        h = FlaxGPT2BlockCollection(self.d, self.recompute, name="h")(h, deterministic=deterministic)
        return wte.attend(nn.LayerNorm(epsilon=1e-5, name="ln_f")(h))


@functools.cache
def _data(d: Dims):
    ids = jax.random.randint(jax.random.key(1), (d.B, d.T), 0, d.vocab)
    return jax.jit(FlaxGPT2LMHeadModel(d).init)(jax.random.key(0), ids), ids   # one compile, not one per operation


def grad_fn(d: Dims, rc: RecomputeConfig, tag: bool = True):
    """The loss's gradient under `rc`, its layers' submodule outputs tagged when `tag`. Dropout is
    off (deterministic=True): XLA:CPU compiles its random bits slowly, and tests/test_hf_style.py
    checks the masks under remat."""
    _, ids = _data(d)

    def loss(p):
        logits = FlaxGPT2LMHeadModel(d, rc).apply(p, ids, deterministic=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    def grad(p):
        with rlinen.tag_submodules() if tag else contextlib.nullcontext():
            return jax.grad(loss)(p)
    return grad


def trace_fn(d: Dims):
    return lambda rc: jax.jit(grad_fn(d, rc)).trace(_data(d)[0]).jaxpr


def rel_err(got, ref) -> float:
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    return diff / max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(ref))


@functools.cache
def _grads(d: Dims, rc: RecomputeConfig, tag: bool = True):
    return jax.jit(grad_fn(d, rc, tag))(_data(d)[0])


def _region_tags(jaxpr) -> list:
    region = cost.layer_region(jaxpr)
    return [] if region is None else sorted({e.params["name"] for e in region.eqns if e.primitive.name == "name"})


BLOCK_PATHS = ["attn", "attn.attn_dropout", "attn.c_attn", "attn.c_proj", "attn.resid_dropout", "ln_1", "ln_2",
               "mlp", "mlp.c_fc", "mlp.c_proj", "mlp.dropout"]


def test_a_layers_submodule_outputs_are_tagged_by_module_path_and_nothing_else():
    d, full = SMALL, tagplan.recompute_config(("full",) * SMALL.L)
    params, _ = _data(d)
    jaxpr = trace_fn(d)(full)
    every = policies.region_tags(lambda p: grad_fn(d, full)(p), params)
    # the forward of a layer carries every submodule path below the block; what no gradient needs
    # (the MLP's last projection, the block's outputs) the backward's recomputation leaves out
    assert set(_region_tags(jaxpr)) <= set(BLOCK_PATHS) and {"attn.c_attn", "mlp.c_fc", "ln_1"} <= set(_region_tags(jaxpr))
    assert sorted(every) == BLOCK_PATHS   # nothing outside the layers: no wte, wpe, ln_f, h.0, dropout
    assert set(BLOCK_PATHS) <= set(remat.names.known())
    untagged_jaxpr = jax.jit(grad_fn(d, full, tag=False)).trace(params).jaxpr
    assert _region_tags(untagged_jaxpr) == []
    with pytest.raises(ValueError, match="tag the layer's activations"):   # the model as written
        tagplan.calibrate(None, lambda rc: untagged_jaxpr, d.L, remat.planning.targets.get("h200"),
                          peak=lambda cm: 0, measure=lambda lp: None)


@pytest.mark.parametrize("policy", [None, "full"])
def test_tagging_leaves_the_program_as_it_is(policy):
    """Without remat, or with nothing saved, the tags change nothing: the same lowered program (the
    tag is the identity). What a name-based policy saves changes with them: its gradients are
    checked against no remat's below (`_check_plan`)."""
    d = SMALL
    rc = tagplan.recompute_config((policy,) * d.L)
    text = lambda tag: jax.jit(grad_fn(d, rc, tag)).lower(_data(d)[0]).as_text()  # noqa: E731
    assert text(True) == text(False)


def test_save_names_of_module_paths_keeps_those_outputs():
    """A policy naming module paths keeps those values for the backward, and no other tagged one."""
    d = SMALL
    rc = tagplan.recompute_config(("save_names:attn.c_attn,mlp.c_fc",) * d.L)
    params, ids = _data(d)
    with rlinen.tag_submodules():
        saved = remat.memory.saved_residuals(lambda p: FlaxGPT2LMHeadModel(d, rc).apply(p, ids).sum(), params)
    names = set(saved.by_name())
    assert {"attn.c_attn", "mlp.c_fc"} <= names and not names & (set(BLOCK_PATHS) - {"attn.c_attn", "mlp.c_fc"})


def test_stack_layers_and_flax_remat_layers_are_tagged_too():
    """A LayerStack's layer and, with `layers=`, a block rematerialized by Flax's own nn.remat."""
    d = SMALL
    x = jnp.ones((d.B, d.T, d.C))
    stack = rlinen.LayerStack(functools.partial(FlaxGPT2Block, d), d.L, RecomputeConfig(granularity="full"),
                              out=lambda y: y[0])
    v = jax.eval_shape(stack.init, jax.random.key(0), x)   # tracing needs only the shapes
    with rlinen.tag_submodules():
        got = policies.region_tags(lambda v: stack.apply(v, x), v)
        with rlinen.tag_submodules():   # nested: still one tag per value
            jaxpr = jax.make_jaxpr(lambda v: stack.apply(v, x))(v)
    assert sorted(got) == BLOCK_PATHS
    region = cost.layer_region(jaxpr)
    assert sum(e.primitive.name == "name" and e.params["name"] == "attn.c_attn" for e in region.eqns) == 1

    class FlaxRemat(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.remat(FlaxGPT2Block)(d, name="0")(x)[0]
    v = jax.eval_shape(FlaxRemat().init, jax.random.key(0), x)
    with rlinen.tag_submodules():
        assert policies.region_tags(lambda v: FlaxRemat().apply(v, x), v) == set()   # not known as a layer
    with rlinen.tag_submodules(layers=[FlaxGPT2Block]):
        assert sorted(policies.region_tags(lambda v: FlaxRemat().apply(v, x), v)) == BLOCK_PATHS
    with pytest.raises(TypeError, match="layers must be flax.linen.Module classes"):
        with rlinen.tag_submodules(layers=[len]):
            pass


def _tag_bytes(d: Dims) -> dict:
    """Bytes of each tagged value of one layer (float32), from the model's shapes."""
    act = d.B * d.T * d.C * 4
    return {"ln_1": act, "attn.c_attn": 3 * act, "attn.attn_dropout": d.B * d.heads * d.T * d.T * 4,
            "attn.c_proj": act, "attn.resid_dropout": act, "attn": act, "ln_2": act, "mlp.c_fc": 4 * act,
            "mlp.c_proj": act, "mlp.dropout": act, "mlp": act}


def _linear_peak_step(d: Dims, p_full: int = 10**6):
    """A compile_step whose peak is full remat's plus, per layer, the bytes its policy keeps (no remat:
    every value and as much again untagged); no compile, so the planner runs in the time of its traces."""
    tags = _tag_bytes(d)
    m_none = 2 * sum(tags.values())

    def step(rc):
        lp = tagplan.config_policies(rc, d.L)
        per = [m_none if p is None else sum(b for t, b in tags.items() if (policies.by_name(p) or
                                                                           policies.ByName()).keeps(t)) for p in lp]
        return CompiledMemory(temp=p_full + sum(per), argument=0, output=0, alias=0, generated_code=0, host_temp=0,
                              flops=1.0)
    return step, p_full, p_full + d.L * m_none


def _check_plan(d: Dims, plan, budget):
    assert plan.compiled_peak <= budget, plan.table()
    lp = tagplan.parse_plan(plan.text, d.L)   # the text --recompute_plan takes, read back
    assert lp == tuple(plan.layer_policies)
    named = {t for p in lp if p is not None for t in BLOCK_PATHS if (policies.by_name(p) or policies.ByName()).keeps(t)}
    assert named and named <= set(BLOCK_PATHS), plan.text   # a per-tensor plan, in module paths
    rc = tagplan.recompute_config(lp)
    assert rel_err(_grads(d, rc), _grads(d, RecomputeConfig(), tag=False)) <= 1e-5


def test_per_tensor_plan_of_an_untagged_model_on_a_linear_peak():
    """The planner per tag on the tagged trace of the untagged model, its compiled peak replaced by a
    linear one (the fast sibling of the XLA:GPU case below)."""
    d = SMALL
    step, lo, hi = _linear_peak_step(d)
    budget = (lo + hi) // 2
    plan = remat.plan_for_budget(step, d.L, budget, target="h200", trace_step=trace_fn(d))
    _check_plan(d, plan, budget)


@pytest.mark.slow  # 6 XLA:GPU compilations of the step: 35-90 s on the shared 2-core machine
def test_per_tensor_plan_of_an_untagged_model_on_h200():
    """The middle budget between full remat's and no remat's compiled peaks (XLA:GPU for an H200, no
    device): the plan fits it, names module paths, parses back, and its gradients are no remat's."""
    need("cuda")
    d = H200
    params, _ = _data(d)
    compiled: dict = {}

    def compile_step(rc):
        if rc not in compiled:
            compiled[rc] = remat.planning.targets.compiled_memory(grad_fn(d, rc), params, target=GPU)
        return compiled[rc]
    lo = compiled_stats(compile_step(tagplan.recompute_config(("full",) * d.L))).peak_estimate
    hi = compiled_stats(compile_step(RecomputeConfig())).peak_estimate
    budget = (lo + hi) // 2
    plan = remat.plan_for_budget(compile_step, d.L, budget, target=GPU, trace_step=trace_fn(d))
    print(plan.table())
    _check_plan(d, plan, budget)


# ------------------------------------------------------------------------------------------------
# The preset planner (no target) on a plain JAX stack: presets that save nothing are dropped.

LP, BP, DP = 2, 16, 32


def _plain_step(tag: bool):
    """compile_step of the gradient of a scanned stack of MLP layers, tagged `mlp_up` or not (XLA:CPU)."""
    ws = {"up": jnp.full((LP, DP, 4 * DP), 0.01), "down": jnp.full((LP, 4 * DP, DP), 0.01)}
    x = jnp.ones((BP, DP))

    def layer(w, h, key):
        up = h @ w["up"]
        return h + jnp.tanh(checkpoint_name(up, "mlp_up") if tag else up) @ w["down"]

    def step(rc):
        loss = lambda ws: remat.apply_layers(layer, ws, x, rc, scan=True).sum()  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(ws).compile()
    return step


@pytest.mark.filterwarnings("ignore::remat.policies.UntaggedRegionWarning")
def test_preset_planner_drops_presets_that_save_nothing_and_plans_by_operation():
    step = _plain_step(tag=False)
    lo = compiled_stats(step(tagplan.recompute_config(("full",) * LP))).peak_estimate
    hi = compiled_stats(step(RecomputeConfig())).peak_estimate
    plan = remat.plan_for_budget(step, LP, (lo + hi) // 2)
    notes = "\n".join(plan.notes)
    for preset in ("norm", "mlp", "core_attn+mlp+norm"):
        assert f"candidate {preset} dropped: it saves nothing on this model: no layer computes a value it names" in notes
    assert [c.name for c in plan.candidates] == ["none", "full", *untagged.by_operation()]
    assert set(plan.layer_policies) <= {None, "full", *untagged.by_operation()} and plan.fits, plan.table()


@pytest.mark.filterwarnings("ignore::remat.policies.UntaggedRegionWarning")
def test_presets_that_save_a_tagged_value_are_kept():
    step = _plain_step(tag=True)
    measure = functools.cache(lambda lp: compiled_stats(step(tagplan.recompute_config(lp))))
    kept, dropped = untagged.screen(["norm", "mlp", "save_names:mlp_up"], measure, LP)
    assert list(kept) == ["norm", "save_names:mlp_up"]   # both keep mlp_up
    assert [c for c, _ in dropped] == ["mlp"]             # mlp recomputes mlp_up, the only tag: full remat


def test_candidates_by_operation_and_inclusion():
    assert untagged.by_operation() == ("dots", "dots_no_batch")
    assert all(policies.by_op(c) in ("dots", "dots_no_batch") for c in untagged.by_operation())
    assert untagged.keeps_within("save_names:qkv", "norm") and not untagged.keeps_within("norm", "save_names:qkv")
    assert untagged.keeps_within("offload_names:qkv", "custom:qkv=device")
    assert not untagged.keeps_within("full", "norm") and not untagged.keeps_within("dots", "norm")
