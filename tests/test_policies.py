"""The policy registry, the selective presets and the dtype-preserving bf16 policy."""
import pathlib

import jax
import jax.numpy as jnp
import pytest

import remat
from remat import memory, names as N, policies
from tinyblocks import B, C, T, block, init_block

KEY = jax.random.PRNGKey(0)


def test_names_cover_the_required_policies_and_all_resolve():
    ns = policies.names()
    for need in ("full", "everything", "dots", "dots_no_batch", "core_attn", "mlp", "norm", "bf16",
                 "save_names:<name,...>", "offload_names:<name,...>", "bf16:<policy>"):
        assert need in ns
    for n in ns:
        if ":" not in n:
            assert callable(policies.get(n))
    for n in policies.examples():
        assert callable(policies.get(n))


@pytest.mark.parametrize("bad,needle", [
    ("nope", "unknown policy 'nope'"), ("save_names", "needs an argument"),
    ("save_names:", "needs an argument"), ("save_names:qkv,bogus", "bogus"),
    ("everything:qkv", "takes no argument"), ("nothing_saveable", "unknown policy 'nothing_saveable'"),
    ("full:qkv", "takes no argument"), ("core_attn+bogus", "bogus"), ("", "non-empty"),
    ("bf16:nope", "unknown policy 'nope'"),
])
def test_bad_policy_names_say_what_is_valid(bad, needle):
    with pytest.raises(ValueError) as e:
        policies.get(bad)
    assert needle in str(e.value)


def test_policies_are_hashable_and_cached():
    assert policies.get("core_attn+mlp") is policies.get("core_attn+mlp")
    hash(policies.get("bf16:save_names:qkv")); hash(policies.get("offload_names:mlp_up"))


def test_selective_presets_drop_their_module_names():
    saved = lambda name: {n for n in N.ALL if policies.by_name(name).saves(n)}  # noqa: E731
    assert saved("core_attn") == set(N.ALL) - {N.ATTN_PROBS}
    assert saved("mlp") == set(N.ALL) - {N.MLP_UP, N.MLP_GATE, N.MLP_ACT}
    assert saved("core_attn+norm") == set(N.ALL) - {N.ATTN_PROBS, N.LN_1, N.LN_2}


def test_docs_policy_table_is_generated_from_the_registry():
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "library.md").read_text()
    assert policies.table_markdown() in doc, "regenerate docs/library.md's policy table: python -m remat.policies"


def _saved(policy, n_layers=4, method="none", num_layers=1, dtype=jnp.float32, compute=None, granularity="full"):
    ps = [init_block(k, dtype=dtype) for k in jax.random.split(KEY, n_layers)]
    x = jax.random.normal(KEY, (B, T, C), dtype)
    cfg = remat.RecomputeConfig(granularity=granularity, method=method, num_layers=num_layers, policy=policy)
    # a linear loss keeps nothing itself, so every saved value comes from the layers
    f = lambda ps, x: jnp.sum(remat.apply_layers(lambda p, h, k: block(p, h, compute_dtype=compute),
                                                 ps, x, cfg).astype(jnp.float32))
    return memory.saved_residuals(f, ps, x)


def test_saved_bytes_strictly_ordered_full_core_attn_everything():
    full, core, every = (_saved(p).total for p in ("full", "core_attn", "everything"))
    assert full < core < every, (full, core, every)
    assert _saved("full", method="uniform", num_layers=2).total < full


def test_save_names_saves_exactly_those_names():
    r = _saved("save_names:qkv,mlp_up")
    named = {row.name for row in r.rows if row.kind == "named"}
    assert named == {N.QKV, N.MLP_UP}
    # besides the names, only the region inputs are kept: the outputs of layers 0..2 (x is an argument)
    others = [row for row in r.rows if row.kind not in ("argument", "named") and row.bytes > 0]
    assert [(row.name, row.shape) for row in others] == [("add", (B, T, C))] * 3


def _bf16_rows(policy):
    # bf16 compute: activations (the residual stream too) in bf16, params cast at use.
    return _saved(policy, dtype=jnp.bfloat16, compute=jnp.bfloat16)


def test_plain_bf16_saves_less_than_no_remat_in_bf16():
    # `bf16` alone is the dtype-preserving selective preset: in bf16 compute it keeps only the
    # tagged bf16 activations, fewer bytes than the same stack without remat.
    assert _bf16_rows("bf16").intermediates < _saved(None, dtype=jnp.bfloat16, compute=jnp.bfloat16,
                                                     granularity="none").intermediates


@pytest.mark.parametrize("base", ["everything", "dots", "core_attn"])
def test_bf16_policy_saves_no_float32_copy_of_a_bf16_value(base):
    plain, bf = _bf16_rows(base), _bf16_rows(f"bf16:{base}")
    # In this block every float32 intermediate is an upcast of bf16 compute (norm statistics,
    # softmax, matmul accumulators): none may be saved, while the plain policy does save some
    # (for `everything`), so the assertion can fail.
    f32 = [r for r in bf.rows if r.kind == "intermediate" and r.dtype == "float32" and r.bytes > 0]
    assert not f32, f32
    if base == "everything":
        assert any(r.kind == "intermediate" and r.dtype == "float32" for r in plain.rows)
    assert bf.total <= plain.total
    # the bf16 values are kept: at least one bf16 intermediate or name is saved by every base
    assert any(r.dtype == "bfloat16" and r.kind != "argument" for r in bf.rows)


def test_bf16_policy_keeps_the_bf16_cast_of_a_float32_accumulated_matmul():
    w = jax.random.normal(KEY, (C, C), jnp.bfloat16)
    x = jax.random.normal(KEY, (B, C), jnp.bfloat16)

    def f(w, x):
        y = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        y = y.astype(jnp.bfloat16)
        return jnp.sum((y * y).astype(jnp.float32))  # the backward needs y

    every = memory.saved_residuals(jax.checkpoint(f, policy=policies.get("everything")), w, x)
    bf = memory.saved_residuals(jax.checkpoint(f, policy=policies.get("bf16:everything")), w, x)
    assert not any(r.dtype == "float32" and r.kind == "intermediate" for r in bf.rows)
    assert any(r.name == "convert_element_type" and r.dtype == "bfloat16" for r in bf.rows)
    assert bf.total <= every.total


@pytest.mark.parametrize("policy", ["offload_names:qkv,mlp_up", "custom:qkv=device,mlp_up=offload,mlp_act=remat"])
def test_offload_compiles_gives_identical_gradients_and_is_reported(policy):
    ps = [init_block(k) for k in jax.random.split(KEY, 2)]
    x = jax.random.normal(KEY, (B, T, C))
    cfg = remat.RecomputeConfig(granularity="full", policy=policy)
    f = lambda ps, x, cfg: jnp.sum(remat.apply_layers(lambda p, h, k: block(p, h), ps, x, cfg) ** 2)
    ref = jax.grad(f)(ps, x, remat.RecomputeConfig())
    g = jax.jit(jax.grad(f), static_argnums=2)(ps, x, cfg)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b)))
    r = memory.saved_residuals(lambda ps, x: f(ps, x, cfg), ps, x)
    # JAX lists an offloaded value as the output of its device_put to host memory
    mlp_up, qkv = B * T * 4 * C * 4, B * T * 3 * C * 4
    assert r.offloaded == 2 * (mlp_up + (qkv if policy.startswith("offload_names") else 0))
    on_device = {row.name for row in r.rows if not row.host and row.kind == "named"}
    assert "mlp_up" not in on_device and "mlp_act" not in on_device
    assert ("qkv" in on_device) == policy.startswith("custom")
    assert "moves nothing" in r.table()  # CPU: the report says no device memory is saved


def test_custom_policy_errors():
    for bad, needle in [("custom:qkv", "<name>=device|offload|remat"), ("custom:qkv=disk", "device|offload|remat"),
                        ("custom:nope=device", "nope")]:
        with pytest.raises(ValueError, match=needle):
            policies.get(bad)
