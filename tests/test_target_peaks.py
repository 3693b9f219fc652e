"""The compiled-peak claims on the compilers users train with: XLA:GPU for an H200 and XLA:TPU for a
v5e, each compiling (not running) the gradient with no device (remat.planning.targets, through
remat_lm.bench.peaks). tests/test_peak.py makes the same claims on XLA:CPU at the reference shape.

Tiny GPT-2 (4 layers, C=64, 2 heads, T=128, B=4, vocabulary 256; float32 unless named) so that a
compile takes seconds. Every assertion compares two compiles of one compiler.

# NOTE: XLA:TPU places small buffers in the TPU core's VMEM and its `temp_size_in_bytes` counts HBM
# only. At this shape nearly everything fits there: in-process v5e figures of a few MiB say where
# XLA:TPU put the buffers, not what the program keeps live (full remat's HBM temp can read above no
# remat's). The TPU claims about remat are therefore asserted on XLA:TPU with VMEM placement off
# (LIBTPU_INIT_ARGS=--xla_vf_vmem_memory_space_assignment=false, read by libtpu when it loads: a fresh
# process, `_tpu_no_vmem`), which counts every buffer; `test_tpu_vmem_hides_temp` asserts what VMEM
# placement does to the in-process figure. docs/BENCHMARKS.md ("peaks") has both.
"""
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from remat.planning import targets
from remat.memory import MiB, building_for, compiled_memory, compiled_stats
from remat_lm.bench import common, peaks
from remat_lm.models import attention as A
from remat_lm.models import family
from tests.targethelp import GPU, TPU, need

TINY = dict(n_layer=4, n_embd=64, n_head=2, vocab_size=256)
B, T = 4, 128
NO_VMEM = "--xla_vf_vmem_memory_space_assignment=false"


def _setting(platform: str, row: str) -> peaks.Setting:
    return next(s for s in peaks.settings(platform, TINY["n_layer"]) if peaks.key(s) == row)


@functools.lru_cache(maxsize=None)
def temp(target: str, row: str, model: str = "gpt2", **shape) -> int:
    """Device temp of one peaks row (`remat_lm.bench.peaks.key`) at the tiny shape, in this process."""
    s = _setting(targets.get(target).platform, row)
    return peaks.measure(model, s, target, batch=B, seq=T, **{**TINY, **shape})["temp"]


@functools.lru_cache(maxsize=None)
def _tpu_no_vmem(rows: tuple, model: str = "gpt2", shape: tuple = ()) -> dict:
    """{row: temp} compiled by XLA:TPU for a v5e with VMEM placement off, in a fresh process."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "peaks.json")
        sizes = ",".join(f"{k}={v}" for k, v in {**TINY, **dict(shape)}.items())
        env = dict(os.environ, LIBTPU_INIT_ARGS=(os.environ.get("LIBTPU_INIT_ARGS", "") + " " + NO_VMEM).strip(),
                   JAX_PLATFORMS="cpu")
        cmd = [sys.executable, "-m", "remat_lm.bench.peaks", "--target", TPU, "--models", model, "--rows", ",".join(rows),
               "--batch", str(B), "--seq", str(T), "--shape", sizes, "--json", out]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-2000:]
        with open(out) as f:
            res = json.load(f)
    assert NO_VMEM in res["meta"]["source"]["libtpu_args"]
    return {r["row"]: r["temp"] for r in res["rows"]}


# The slow tests' XLA:TPU rows, compiled in one fresh process with VMEM placement off.
SLOW_ROWS = ("none", "full", "uniform 2", "block 2", "none scan", "full scan", "selective core_attn",
             "selective core_attn+mlp", "full offload bf16", "full + save_names offload bf16",
             "full + offload_names offload bf16", "full sharded", "full + shard_inputs fsdp sharded")


def _tpu(*rows) -> dict:
    got = _tpu_no_vmem(SLOW_ROWS)
    return {r: got[r] for r in rows}


def _mib(d: dict) -> dict:
    out = {k: round(v / MiB, 2) for k, v in d.items()}
    print(out)
    return out


# --- full remat, uniform, block: the claims of tests/test_peak.py

def test_full_remat_cuts_compiled_temp_on_gpu():
    need("cuda")
    t = {r: temp(GPU, r) for r in ("none", "full")}
    assert t["full"] <= 0.5 * t["none"], _mib(t)  # measured 0.41 (6.4 of 15.4 MiB)


@pytest.mark.slow  # two more XLA:GPU compiles; the fast case above keeps full against none
def test_uniform_and_block_between_on_gpu():
    need("cuda")
    t = {r: temp(GPU, r) for r in ("none", "full", "uniform 2", "block 2")}
    assert t["full"] < t["uniform 2"] < t["none"] and t["full"] < t["block 2"] < t["none"], _mib(t)


def test_full_remat_cuts_temp_on_tpu_without_vmem():
    need("tpu")
    t = _tpu_no_vmem(("none", "full"))
    assert t["full"] <= 0.6 * t["none"], _mib(t)  # measured 0.48 (8.0 of 16.7 MiB)


@pytest.mark.slow
def test_uniform_and_block_between_on_tpu_without_vmem():
    need("tpu")
    t = _tpu("none", "full", "uniform 2", "block 2")
    _mib(t)
    assert t["full"] < t["uniform 2"] < t["none"] and t["full"] < t["block 2"] < t["none"], _mib(t)


@pytest.mark.slow
def test_tpu_vmem_hides_temp():
    """In process (VMEM placement on, libtpu's default) the v5e's HBM temp of the tiny model is below
    what the program keeps live, and full remat's is not below no remat's: what XLA:TPU placed in
    VMEM is not in the figure."""
    need("tpu")
    hbm = {r: temp(TPU, r) for r in ("none", "full")}
    every = _tpu("none", "full")
    _mib(hbm), _mib(every)
    assert all(hbm[r] < every[r] for r in hbm), (_mib(hbm), _mib(every))
    assert hbm["full"] >= hbm["none"], _mib(hbm)  # measured 5.5 vs 4.7 MiB: not a remat claim at this size


# --- scan layout

@pytest.mark.slow
def test_scan_full_remat_on_gpu():
    need("cuda")
    t = {r: temp(GPU, r) for r in ("none scan", "full scan", "full")}
    _mib(t)
    assert t["full scan"] <= 0.5 * t["none scan"], _mib(t)  # measured 0.38 (5.5 of 14.5 MiB)
    assert t["full scan"] <= 1.1 * t["full"], _mib(t)  # scan keeps no more than the loop (5.5 vs 6.4 MiB)


@pytest.mark.slow
def test_scan_full_remat_on_tpu_without_vmem():
    need("tpu")
    t = _tpu("none scan", "full scan", "full")
    _mib(t)
    assert t["full scan"] <= 0.5 * t["none scan"], _mib(t)  # measured 0.34 (8.5 of 24.7 MiB)
    assert t["full scan"] <= 1.1 * t["full"], _mib(t)  # measured 8.5 vs 8.0 MiB


# --- selective

@pytest.mark.slow
def test_selective_on_gpu():
    need("cuda")
    t = {r: temp(GPU, r) for r in ("none", "selective core_attn", "selective core_attn+mlp")}
    _mib(t)
    assert t["selective core_attn+mlp"] < t["selective core_attn"] < t["none"], _mib(t)


@pytest.mark.slow
def test_selective_on_tpu_without_vmem():
    need("tpu")
    t = _tpu("none", "selective core_attn", "selective core_attn+mlp")
    _mib(t)
    assert t["selective core_attn+mlp"] < t["none"] and t["selective core_attn"] <= t["none"], _mib(t)


# --- attention cores: the fused kernels against the tiled core, where T makes it matter

def _attention_temp(target: str, core: str, seq: int = 1024) -> int:
    x = jax.ShapeDtypeStruct((1, seq, 4 * 64), jnp.bfloat16)
    f = lambda q, k, v: A.causal_attention(q, k, v, 4, 4, attention=core).astype(jnp.float32).sum()  # noqa: E731
    return compiled_memory(jax.grad(f, argnums=(0, 1, 2)), x, x, x, target=target).temp


def test_cudnn_attention_below_tiled_on_gpu():
    need("cuda")
    t = {c: _attention_temp(GPU, c) for c in ("cudnn", "tiled", "xla")}
    assert t["cudnn"] < t["tiled"] < t["xla"], _mib(t)  # measured 1.0 < 4.5 < 49.0 MiB at T=1024


@pytest.mark.slow
def test_pallas_attention_below_xla_on_tpu():
    """At T=4096 the (T, T) scores are far beyond VMEM; splash attention keeps none of them."""
    need("tpu")
    t = {c: _attention_temp(TPU, c, 4096) for c in ("pallas", "xla")}
    _mib(t)
    assert t["pallas"] < 0.01 * t["xla"], _mib(t)  # measured 0.0 vs 1152 MiB


def _pallas_gpt2(n_layer=1):
    cfg = common.reference_config("gpt2", **{**TINY, "n_layer": n_layer}, block_size=T, attention="pallas",
                                  dtype="bfloat16")
    fam = family.of(cfg)
    params = jax.eval_shape(lambda: fam.init_params(cfg, jax.random.key(0)))
    x = jax.ShapeDtypeStruct((8, T), jnp.int32)
    return jax.grad(lambda p, x, y: fam.loss_fn(p, cfg, x, y)), (params, x, x)


def test_pallas_attention_however_the_caller_shards():
    """v5e:2x2, batch over 4 chips: the gradient compiles inside `jax.set_mesh` and with sharded inputs
    alone (no mesh set: XLA's partitioner refused the Mosaic call before), one splash kernel per chip."""
    need("tpu")
    t = targets.get("v5e:2x2")
    mesh = t.mesh({"data": 4})
    fn, args = _pallas_gpt2()
    structs = targets.place(args, mesh, (P(), P("data"), P("data")))
    compiled = {}
    with building_for("tpu"):
        with jax.set_mesh(mesh):
            compiled["mesh"] = jax.jit(fn).trace(*structs).lower().compile()
        compiled["inputs"] = jax.jit(fn).trace(*structs).lower().compile()
    calls = {how: c.as_text().count("tpu_custom_call") for how, c in compiled.items()}
    # the same splash kernels either way; the temps may differ, as c_attn is one matmul per piece
    # under a multi-device mesh and one fused matmul without one (remat_lm/models/layers.py)
    assert calls["mesh"] == calls["inputs"] > 0, calls


@pytest.mark.slow
def test_pallas_attention_heads_over_a_mesh_axis_with_inputs_only():
    """Tensor parallelism (batch over `data`, heads over `tensor`, the model's `split` layout) with
    sharded inputs and no mesh set: the gradient compiles, one kernel per chip's heads."""
    need("tpu")
    from remat_lm.models import parallel
    mesh = targets.get("v5e:2x2").mesh({"data": 2, "tensor": 2})
    spec = parallel.ShardingConfig(batch=("data",), tensor="tensor").split
    f = lambda q, k, v: A.causal_attention(q, k, v, 4, 2, attention="pallas", spec=spec).astype(jnp.float32).sum()  # noqa: E731
    q, kv = jax.ShapeDtypeStruct((4, T, 4 * 16), jnp.bfloat16), jax.ShapeDtypeStruct((4, T, 2 * 16), jnp.bfloat16)
    structs = targets.place((q, kv, kv), mesh, (spec, spec, spec))
    with building_for("tpu"):
        c = jax.jit(jax.grad(f, argnums=(0, 1, 2))).trace(*structs).lower().compile()
    assert "tpu_custom_call" in c.as_text()


# --- the chunked loss

@pytest.mark.slow
@pytest.mark.parametrize("target", [GPU, TPU])
def test_loss_chunk_cuts_full_remat_temp(target):
    """With a vocabulary of 4096 the (B, T, V) float32 logits dominate full remat's temp; chunks of 32
    positions keep a quarter of them at a time."""
    need(targets.get(target).platform)
    if target == TPU:
        t = _tpu_no_vmem(("full", "full + loss_chunk 64"), shape=(("vocab_size", 4096),))
    else:
        t = {r: temp(target, r, vocab_size=4096) for r in ("full", "full + loss_chunk 64")}
    _mib(t)
    assert t["full + loss_chunk 64"] < 0.8 * t["full"], _mib(t)


# --- offload

@pytest.mark.slow
def test_offload_on_tpu_keeps_what_it_moves_on_the_device():
    """XLA:TPU (docs/offload.md): offloading `qkv,mlp_up` does not bring device temp below saving them
    on the device, where XLA:GPU does (tests/test_offload_targets.py)."""
    need("tpu")
    t = _tpu("full offload bf16", "full + save_names offload bf16", "full + offload_names offload bf16")
    _mib(t)
    assert t["full + offload_names offload bf16"] >= t["full offload bf16"], t


# --- sharded saved inputs

@pytest.mark.slow
@pytest.mark.parametrize("target", [GPU, TPU])
def test_sharded_saved_inputs_per_compiler(target):
    """Mesh data=2 x fsdp=2 (h200x4, v5e:2x2): each region input split along T over fsdp. XLA:GPU's
    per-device temp falls; XLA:TPU's (no VMEM) does not at this size: the 3 saved inputs are 64 KiB
    each per device, less than the buffers of the all-to-all and gather that split and rebuild them
    (measured 4.30 vs 3.93 MiB; docs/BENCHMARKS.md, "peaks": at the reference shape XLA:GPU 0.43x)."""
    need(targets.get(target).platform)
    rows = ("full sharded", "full + shard_inputs fsdp sharded")
    t = _tpu(*rows) if target == TPU else {r: temp(target, r) for r in rows}
    _mib(t)
    if target == GPU:
        assert t[rows[1]] < t[rows[0]], t
    else:
        assert t[rows[1]] >= t[rows[0]], t


# --- LLaMA-3

@pytest.mark.slow
def test_llama3_full_remat_on_gpu_and_tpu():
    need("cuda", "tpu")
    gpu = {r: temp(GPU, r, model="llama3", multiple_of=64) for r in ("none", "full")}
    tpu = _tpu_no_vmem(("none", "full"), model="llama3", shape=(("multiple_of", 64),))
    _mib(gpu), _mib(tpu)
    assert gpu["full"] <= 0.6 * gpu["none"], _mib(gpu)
    assert tpu["full"] <= 0.6 * tpu["none"], _mib(tpu)
