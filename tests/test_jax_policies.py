"""JAX's own policies everywhere: a `jax.checkpoint_policies` callable is accepted wherever a
registry name is and keeps exactly the same bytes; reports print it readably; the policy that saves
nothing is JAX's `nothing_saveable`; JAX internals are imported by remat/_compat.py (and JAX's cuDNN
module by remat_lm/models/attention.py) only."""
import os
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import remat
from remat import RecomputeConfig, memory, names as N, policies
from remat import linen as rlinen, nnx as rnnx
from remat.config import RecomputeConfigError
from remat.planning.planner import plan_for_budget
from tinyblocks import B, C, T, LinenBlock, NNXBlock, block, init_block, rel_err

cp = jax.checkpoint_policies
ROOT = pathlib.Path(__file__).parents[1]
KEY = jax.random.PRNGKey(0)
L = 2
X = jax.random.normal(KEY, (B, T, C))
PS = [init_block(k) for k in jax.random.split(KEY, L)]

# (JAX policy callable, the registry name that is the same policy)
PAIRS = [
    (cp.nothing_saveable, policies.NOTHING),
    (cp.save_only_these_names(N.QKV, N.MLP_UP), "save_names:qkv,mlp_up"),
    (cp.dots_with_no_batch_dims_saveable, "dots_no_batch"),
    (cp.save_any_names_but_these(N.ATTN_PROBS), "core_attn"),
]
PAIR_IDS = ["full", "save_only_these_names", "dots_no_batch", "save_any_names_but_these"]


def _stack_bytes(policy):
    cfg = RecomputeConfig(granularity="full", policy=policy)
    return memory.saved_residuals(lambda ps, x: jnp.sum(remat.apply_layers(lambda p, h, k: block(p, h), ps, x, cfg)),
                                  PS, X).total


def _layer_policies_bytes(policy):
    cfg = RecomputeConfig(granularity="full", layers=remat.per_layer((policy, None)))
    return memory.saved_residuals(lambda ps, x: jnp.sum(remat.apply_layers(lambda p, h, k: block(p, h), ps, x, cfg)),
                                  PS, X).total


def _checkpoint_bytes(policy):
    return memory.saved_residuals(lambda p, x: jnp.sum(remat.checkpoint(block, policy=policy)(p, x)), PS[0], X).total


LINEN_VARS = rlinen.LayerStack(LinenBlock, L).init(KEY, X)


def _linen_bytes(policy):
    stack = rlinen.LayerStack(LinenBlock, L, RecomputeConfig(granularity="full", policy=policy))
    return memory.saved_residuals(lambda v: jnp.sum(stack.apply(v, X)), LINEN_VARS).total


class _Two(nn.Module):
    policy: object

    @nn.compact
    def __call__(self, x):
        blk = rlinen.remat_module(LinenBlock, policy=self.policy)
        return blk()(blk()(x))


MODULE_VARS = _Two(None).init(KEY, X)


def _remat_module_bytes(policy):
    return memory.saved_residuals(lambda v: jnp.sum(_Two(policy).apply(v, X)), MODULE_VARS).total


def _nnx_bytes(policy):
    cfg = RecomputeConfig(granularity="full", policy=policy)
    stack = rnnx.LayerStack([NNXBlock(nnx.Rngs(i)) for i in range(L)], cfg)
    graphdef, state = nnx.split(stack)
    return memory.saved_residuals(lambda s: jnp.sum(nnx.merge(graphdef, s)(X)), state).total


PATHS = {"apply_layers": _stack_bytes, "layer_policies": _layer_policies_bytes, "checkpoint": _checkpoint_bytes,
         "linen_stack": _linen_bytes, "remat_module": _remat_module_bytes, "nnx_stack": _nnx_bytes}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_jax_policy_saves_what_its_registry_name_saves(path):
    measure = PATHS[path]
    by_name = {}
    for fn, name in PAIRS:
        by_name[name] = measure(name)
        assert measure(fn) == by_name[name], (path, name, policies.describe(fn))
    # the pairs are different policies, so the equality above is not vacuous
    assert len(set(by_name.values())) == len(PAIRS), by_name


def test_a_config_with_a_jax_policy_is_a_static_jit_argument_and_keeps_gradients():
    layer = lambda w, h, k: jnp.tanh(checkpoint_name(h @ w, N.QKV))  # noqa: E731  (small: one cheap compile)
    f = lambda ws, x, cfg: jnp.sum(remat.apply_layers(layer, ws, x, cfg) ** 2)  # noqa: E731
    ws, x = [jax.random.normal(k, (C, C)) for k in jax.random.split(KEY, L)], X[0]
    a = RecomputeConfig(granularity="full", policy=cp.save_only_these_names(N.QKV))
    b = RecomputeConfig(granularity="full", policy=cp.save_only_these_names(N.QKV))
    assert a == b and hash(a) == hash(b)  # JAX's policy objects compare by value: one jit cache entry
    assert a != RecomputeConfig(granularity="full", policy=cp.save_only_these_names(N.MLP_UP))
    g = jax.jit(jax.grad(f), static_argnums=2)(ws, x, a)
    assert rel_err(g, jax.grad(f)(ws, x, RecomputeConfig())) <= 1e-5


def test_describe_names_registry_names_and_jax_policies():
    assert policies.describe("core_attn") == "core_attn"
    assert policies.describe(cp.dots_with_no_batch_dims_saveable) == \
        "jax.checkpoint_policies.dots_with_no_batch_dims_saveable"
    # a registry policy knows what it saves (its fields): shown as the JAX expression it decides as
    assert policies.describe(policies.get("save_names:qkv,mlp_up")) == \
        "jax.checkpoint_policies.save_only_these_names('mlp_up', 'qkv')"
    assert policies.describe(policies.get("custom:qkv=device,mlp_up=offload")) == (
        "jax.checkpoint_policies.save_and_offload_only_these_names(names_which_can_be_saved=('qkv',), "
        "names_which_can_be_offloaded=('mlp_up',), offload_src='device', offload_dst='pinned_host')")
    # a JAX policy a factory built is opaque (nothing reads its closure): named as a JAX policy
    assert policies.describe(cp.save_only_these_names("qkv", "mlp_up")) == "a JAX policy (SaveOnlyTheseNames)"
    assert policies.describe(cp.save_from_both_policies(cp.dots_saveable, cp.nothing_saveable)) == \
        "a JAX policy (save_from_both_policies.<locals>.policy)"
    assert policies.describe(policies.get("bf16")) == \
        "remat.policies.DtypePreserving(jax.checkpoint_policies.save_any_names_but_these('attn_probs'))"

    def my_policy(prim, *_, **__):
        return False
    assert policies.describe(my_policy) == f"{__name__}.test_describe_names_registry_names_and_jax_policies." \
                                           "<locals>.my_policy"
    # every registry name is a JAX composition: its description is JAX's (or the bf16 wrapper of one)
    for name in policies.examples():
        shown = policies.describe(policies.get(name))
        assert shown.startswith(("jax.checkpoint_policies.", "remat.policies.DtypePreserving(jax.")), (name, shown)


def test_reports_print_a_jax_policy_readably():
    pol = cp.save_only_these_names(N.QKV, N.MLP_UP)
    shown = "a JAX policy (SaveOnlyTheseNames)"
    assert f"policy={shown}," in repr(RecomputeConfig(granularity="full", policy=pol))
    assert f"layers=per_layer((None, {shown}, 'mlp'))" in repr(
        RecomputeConfig(granularity="full", layers=remat.per_layer((None, pol, "mlp"))))
    with pytest.raises(RecomputeConfigError, match=r"policy: jax\.checkpoint_policies\.dots_saveable has no effect"):
        RecomputeConfig(policy=cp.dots_saveable)
    with pytest.warns(policies.UntaggedRegionWarning, match=r"policy jax\.checkpoint_policies\.save_only_these_names"):
        remat.checkpoint(lambda x: jnp.sin(x) * 2, policy=policies.get("save_names:qkv,mlp_up"))(X)


def test_name_based_reports_read_the_registry_policy_and_know_jax_policies_by_operation():
    # by_name reads a registry Policy's fields; a JAX policy a factory built is opaque (None), and
    # JAX's policies by operation are known by identity, so predict_saved models them as their names
    assert policies.by_name("save_names:qkv") == policies.ByName(save=frozenset({N.QKV}))
    assert policies.by_name(cp.save_only_these_names(N.QKV)) is None
    assert policies.by_name("core_attn").saves(N.QKV) and not policies.by_name("core_attn").saves(N.ATTN_PROBS)
    assert policies.by_name(cp.dots_saveable) is None and policies.by_name(policies.NOTHING) is None
    layer = memory.LayerBytes({N.BLOCK_INPUT: 100, N.QKV: 300, N.MLP_UP: 400}, untagged=50)
    predict = lambda p: memory.predict_saved(layer, 4, RecomputeConfig(granularity="full", policy=p))  # noqa: E731
    for fn, name in ((cp.nothing_saveable, policies.NOTHING), (cp.everything_saveable, "everything")):
        assert predict(fn) == predict(name) is not None, name
    assert predict(cp.save_only_these_names(N.QKV)) is None and predict(lambda *a, **k: True) is None
    assert policies.offloads(cp.nothing_saveable) is False and policies.offloads(cp.save_only_these_names(N.QKV)) is None


def test_the_planner_takes_jax_policy_candidates():
    # a synthetic step (no compilation): one candidate is a callable; the table names it readably
    freed = {None: 0, "mlp": 30, cp.nothing_saveable: 90}
    flops = {None: 0.0, "mlp": 1.0, cp.nothing_saveable: 9.0}

    def step(rc):
        lp = rc.layers.policies if isinstance(rc.layers, remat.regions.PerLayer) else (None,) * 4
        return memory.CompiledMemory(temp=1000 - sum(freed[c] for c in lp), argument=0, output=0, alias=0,
                                     generated_code=0, host_temp=0, flops=100.0 + sum(flops[c] for c in lp))
    plan = plan_for_budget(step, 4, 800, candidates=("none", "mlp", cp.nothing_saveable), peak="temp")
    assert plan.fits and cp.nothing_saveable in plan.layer_policies
    assert "jax.checkpoint_policies.nothing_saveable" in plan.table()


def test_the_policy_that_saves_nothing_has_the_granularitys_name():
    """`full` is the one name of JAX's `nothing_saveable` in the registry, the word Megatron's
    granularity uses for recomputing everything; JAX's attribute name is not a second registry name."""
    assert policies.NOTHING == "full" and policies.get("full") == policies.Policy("nothing")
    assert policies.describe(policies.get("full")) == "jax.checkpoint_policies.nothing_saveable"
    assert "full" in policies.names() and "nothing_saveable" not in policies.names()
    for call in (lambda: policies.get("nothing_saveable"), lambda: remat.checkpoint(jnp.sin, policy="nothing_saveable")(X),
                 lambda: rlinen.remat_module(LinenBlock, policy="nothing_saveable")):
        with pytest.raises(ValueError, match="unknown policy 'nothing_saveable'"):
            call()
    with pytest.raises(RecomputeConfigError, match="unknown policy 'nothing_saveable'") as e:
        RecomputeConfig(granularity="full", policy="nothing_saveable")
    assert e.value.field == "policy"
    assert RecomputeConfig(granularity="full").effective_policy() == "full"
    # the JAX callable itself is accepted wherever a name is, and means the same
    assert policies.describe(policies.resolve(jax.checkpoint_policies.nothing_saveable)) == policies.describe(policies.get("full"))


def test_jax_internals_are_imported_in_two_known_places_only():
    found = []
    for pkg in ("remat", "remat_lm"):
        for dirpath, _, files in os.walk(ROOT / pkg):
            for f in files:
                if f.endswith(".py") and "jax._src" in (pathlib.Path(dirpath) / f).read_text():
                    found.append(str((pathlib.Path(dirpath) / f).relative_to(ROOT)))
    # the library's in one module; remat_lm's one (JAX's cuDNN attention module) beside its only user
    assert sorted(found) == ["remat/_compat.py", "remat_lm/models/attention.py"], found


def test_pyproject_bounds_jax_to_the_tested_minor():
    import re

    from remat import _compat
    text = (ROOT / "pyproject.toml").read_text()
    assert '"jax>=0.10.2,<0.11"' in text
    lo = tuple(int(v) for v in re.search(r'"jax>=([0-9.]+),<', text).group(1).split("."))
    assert all(lo <= tuple(int(v) for v in t.split(".")) < (0, 11) for t in _compat.JAX_TESTED)
