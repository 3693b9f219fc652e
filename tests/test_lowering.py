"""The train step built for a GPU and a TPU from this CPU host: lowered (not compiled) for `cuda` and
`tpu` for every recompute setting, with assertions on the lowered program (remat_lm.bench.lower reads it)."""
import jax
import jax.numpy as jnp
import pytest

from remat_lm.bench import lower as L
from remat_lm.models import attention
from remat import RecomputeConfig, checkpoint
from remat.memory import building_for, lowered_for, target_platform

PLATFORMS = ("cuda", "tpu")
MODELS = ("gpt2", "llama3")
FULL = dict(granularity="full")
# (recompute config, model config overrides, tensor-parallel size)
SETTINGS = {
    "none": (dict(), dict(), 1),
    "full": (FULL, dict(), 1),
    "selective_core_attn": (dict(granularity="selective", modules=("core_attn",)), dict(), 1),
    "uniform": (dict(granularity="full", method="uniform", num_layers=1), dict(), 1),
    "reentrant": (dict(granularity="full", use_reentrant=True), dict(), 1),
    "scan": (FULL, dict(scan_layers=True), 1),
    "bf16": (FULL, dict(dtype="bfloat16"), 1),
    "loss_chunk": (FULL, dict(loss_chunk=64), 1),
    "offload_policy": (dict(granularity="full", policy="offload_names:mlp_up,qkv"), dict(), 1),
    "cpu_checkpointing": (dict(granularity="full", offload_inputs=True), dict(), 1),
    "tensor2": (FULL, dict(), 2),
}
OFFLOADS = ("offload_policy", "cpu_checkpointing")
KERNEL = {"cuda": L.CUDNN, "tpu": L.PALLAS_TPU}


def _mcfg(model, setting, **more):
    rc, over, _ = SETTINGS[setting]
    # T = 128: the Pallas kernel tiles T by 128 (remat_lm.models.attention.PALLAS_BLOCK)
    return L.model_config(model, recompute=RecomputeConfig(**rc), block_size=128, **{**over, **more})


def _kernel_calls(text, platform):
    return sum(n for t, n in L.custom_calls(text).items() if t.startswith(KERNEL[platform]))


MATRIX = [(m, s) for m in MODELS for s in SETTINGS]
# GPT-2 lowers every setting in the fast run; LLaMA-3 the ones where its program differs in kind
# (no remat, bf16: the kernels' dtype, GQA under tensor parallelism, an offload); the rest of its
# row runs with `-m slow` (the layer stack, the regions and the offload path are shared).
LLAMA_FAST = {"none", "bf16", "tensor2", "cpu_checkpointing"}


def _matrix():
    for m, s in MATRIX:
        slow = m == "llama3" and s not in LLAMA_FAST
        yield pytest.param(m, s, id=f"{m}-{s}", marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("model,setting", list(_matrix()))
def test_train_step_lowers_for_gpu_and_tpu(model, setting):
    mcfg = _mcfg(model, setting)
    for platform in PLATFORMS:
        text = L.lower_train_step(mcfg, platform, tensor=SETTINGS[setting][2]).as_text()
        # auto: cuDNN on cuda only in bf16 (float32 gets the tiled core), Pallas on tpu in both
        # (under the tensor=2 mesh in a shard_map: XLA cannot partition a Mosaic call)
        wants_kernel = platform == "tpu" or mcfg.dtype == "bfloat16"
        assert (_kernel_calls(text, platform) > 0) == wants_kernel, (platform, L.custom_calls(text))
        hosts = L.placements(text).get("pinned_host", 0)
        assert (hosts > 0) == (setting in OFFLOADS), (platform, L.placements(text))


@pytest.mark.parametrize("setting", OFFLOADS)
@pytest.mark.parametrize("model", MODELS)
def test_every_copy_back_waits_for_the_cotangent(model, setting):
    # c · loss: every cotangent depends on c (%arg0) and nothing in the forward does
    mcfg = _mcfg(model, setting, dtype="bfloat16")
    for platform in PLATFORMS:
        waits = L.copy_backs(L.lower_seeded_grad(mcfg, platform).as_text())
        assert waits and all(waits), (platform, waits)


def _region_copy_backs(platform):
    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))

    def loss(c, w, x):
        h = checkpoint(lambda w, x: jnp.tanh(x @ w), offload_inputs=(1,))(w, x)
        h = checkpoint(lambda w, x: jnp.tanh(x @ w), offload_inputs=(1,))(w, h)
        return c * jnp.sin(h).sum()

    return L.copy_backs(lowered_for(jax.grad(loss, argnums=1), platform, 1.0, w, x).as_text())


def test_offloaded_region_input_comes_back_only_after_the_cotangent():
    # Without a dependency on the cotangent, the copy back to the device reads the host copy straight
    # from the forward and XLA may move every region input back early ([False, False]).
    for platform in PLATFORMS:
        assert _region_copy_backs(platform) == [True, True]


def test_the_default_path_lowers_as_jax_checkpoint_on_every_platform():
    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    ours = jax.grad(lambda w: checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x).sum())
    plain = jax.grad(lambda w: jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x).sum())
    ops = lambda text: (text.count("optimization_barrier"), text.count("stablehlo.reduce"),  # noqa: E731
                        text.count("stablehlo.dot_general"))
    for platform in PLATFORMS:
        assert ops(lowered_for(ours, platform, w).as_text()) == ops(lowered_for(plain, platform, w).as_text())


@pytest.mark.parametrize("core,platform", [("cudnn", "cuda"), ("pallas", "tpu"), ("tiled", "cuda"), ("tiled", "tpu"),
                                           ("xla", "cuda"), ("xla", "tpu")])
def test_each_attention_core_lowers_on_its_platform(core, platform):
    mcfg = _mcfg("llama3", "selective_core_attn", attention=core, dtype="bfloat16")
    text = L.lower_seeded_grad(mcfg, platform).as_text()
    assert (_kernel_calls(text, platform) > 0) == (core in ("cudnn", "pallas")), L.custom_calls(text)


def test_auto_is_chosen_for_the_target_not_the_host():
    assert target_platform() == "cpu"
    pick = lambda p, dt=jnp.bfloat16, **kw: attention.resolve("auto", dt, 64, seq_len=256, platform=p, **kw)
    assert (pick("cpu"), pick("cuda"), pick("tpu")) == ("tiled", "cudnn", "pallas")
    assert pick("cuda", jnp.float32) == "tiled" and pick("tpu", jnp.float32) == "pallas"
    assert pick("cuda", dropout=True) == "tiled" and pick("tpu", dropout=True) == "tiled"
    assert attention.resolve("auto", jnp.bfloat16, 64, seq_len=200, platform="tpu") == "tiled"
    with building_for("cuda"):
        assert target_platform() == "cuda" and attention.resolve("auto", jnp.bfloat16, 64) == "cudnn"
    with pytest.raises(ValueError, match="attention='pallas' cannot run: it needs a TPU and the program is built "
                                         "for cpu; use attention='tiled'"):
        attention.resolve("pallas", jnp.float32, 64, seq_len=128)
    with pytest.raises(ValueError, match="attention='cudnn' cannot run: it needs an NVIDIA GPU and the program is "
                                         "built for tpu"):
        attention.resolve("cudnn", jnp.bfloat16, 64, platform="tpu")
    with pytest.raises(ValueError, match="platform='gpu' is not valid; use one of cpu, cuda, rocm, tpu"):
        with building_for("gpu"):
            pass


def test_cudnn_head_size_limit_is_jax_s():
    # off a Hopper GPU JAX's cuDNN takes head sizes up to 128; on Hopper or later 256
    assert attention.cudnn_head_max() == 128
    assert attention.resolve("auto", jnp.bfloat16, 128, platform="cuda") == "cudnn"
    assert attention.resolve("auto", jnp.bfloat16, 256, platform="cuda") == "tiled"


@pytest.mark.slow  # ~8 s; the Pallas core's lowering stays fast
def test_pallas_core_gradients_equal_the_reference():
    # the kernel in Pallas' interpreter on CPU, GQA (4 query heads over 2 kv heads), float32
    B, T, H, K, D = 1, 128, 4, 2, 8
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kq, (B, T, H * D)), jax.random.normal(kk, (B, T, K * D)),
               jax.random.normal(kv, (B, T, K * D)))
    loss = lambda core: (lambda q, k, v: (core(q, k, v) ** 2).sum())
    got = jax.grad(loss(lambda q, k, v: attention.pallas_causal_attention(q, k, v, H, K, interpret=True)),
                   argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: attention.causal_attention(q, k, v, H, K, attention="xla")),
                    argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        assert float(jnp.abs(g - w).max()) <= 1e-5 * float(jnp.abs(w).max())


def test_pallas_residuals_are_tagged_attn_probs():
    # core_attn recomputes the kernel's forward: what it keeps is named attn_probs, as for cudnn
    from remat.memory import saved_residuals
    q = jnp.ones((1, 128, 32))
    with building_for("tpu"):
        res = saved_residuals(lambda q: attention.pallas_causal_attention(q, q, q, 4, 4).sum(), q)
    assert "attn_probs" in res.by_name(), res.by_name()


def test_pallas_runs_per_shard_under_a_data_parallel_mesh():
    # XLA cannot partition a Mosaic call: under a mesh the kernel runs in a shard_map (batch over
    # the mesh's axes when the model gives no layout), and its residuals keep their name
    from remat.memory import saved_residuals
    from remat_lm.training.sharding import make_mesh
    q = jnp.ones((2, 128, 32))
    f = lambda q: attention.causal_attention(q, q, q, 4, 4, attention="pallas").sum()
    with jax.set_mesh(make_mesh({"data": 2})):
        assert lowered_for(jax.grad(f), "tpu", q).as_text().count(L.PALLAS_TPU) > 0
        with building_for("tpu"):
            assert "attn_probs" in saved_residuals(f, q).by_name()


def test_auto_on_a_gpu_in_float32_takes_the_gpu_tile():
    # cuDNN takes only bf16/fp16: float32 gets the tiled core with GPU_TILE-row tiles (fewer serial
    # tile steps: n(n+1)/2 per pass, n = T/tile), an explicit `tiled` keeps its own tile
    q = jax.ShapeDtypeStruct((1, 1024, 2 * 64), jnp.float32)
    lower = lambda platform, **kw: lowered_for(
        jax.grad(lambda q: attention.causal_attention(q, q, q, 2, 2, **kw).sum()), platform, q).as_text()
    gpu, cpu = lower("cuda"), lower("cpu")
    assert f"{attention.GPU_TILE}x64xf32>" in gpu and f"{attention.GPU_TILE}x64xf32>" not in cpu
    assert "128x64xf32>" in cpu and "128x64xf32>" in lower("cuda", attention="tiled")


def test_bench_lower_cli(capsys):
    from remat_lm.bench.common import cli
    assert L.main(["--platform", "tpu", "--model", "llama3", "--cpu_checkpointing",
                   "--recompute_granularity", "full"]) == 0
    out = capsys.readouterr().out
    assert "tpu_custom_call" in out and "'pinned_host': 2" in out and "copy_backs_waiting   2/2" in out
    assert cli(lambda: L.main(["--platform", "cuda", "--attention", "pallas"]), "lower") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m remat_lm.bench.lower: error: attention='pallas' cannot run: it needs a TPU and the program is "
                   "built for cuda; use attention='tiled' (--attention tiled), which runs on every backend"]


def test_cudnn_under_a_tensor_parallel_mesh_goes_through_jax_s_partitioner():
    # JAX wraps its cuDNN call in custom_partitioning under a mesh: XLA's SPMD pass expands
    # CustomSPMDPartitioning into the per-device cuDNN call when compiling for the GPU
    calls = {core: L.custom_calls(L.lower_train_step(_mcfg("gpt2", "full", dtype="bfloat16", attention=core),
                                                     "cuda", tensor=2).as_text())
             for core in ("cudnn", "tiled")}
    assert calls["cudnn"].get("CustomSPMDPartitioning", 0) > 0 and "CustomSPMDPartitioning" not in calls["tiled"]
