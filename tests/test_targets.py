"""remat.planning.targets: names, meshes, the compile for a GPU/TPU without one, and the defaults it decides.

Every figure is what the target's compiler allocated (remat.memory.compiled_memory(..., target=...)), compared
with another compile, never with a number written here.
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import remat
from remat.planning import targets
from remat.memory import compiled_memory
from targethelp import GPU, TPU, need


def test_names_parse_to_targets():
    assert targets.get("h200").count == 1 and targets.get("h200").platform == "cuda"
    t = targets.get("H200x8")
    assert (t.name, t.count, t.topology, t.compiler) == ("h200x8", 8, "1x1x8", "XLA:GPU")
    assert targets.get("v5e:2x4").count == 8 and targets.get("v5e").topology == "v5e:1x1"
    assert targets.get("v5p").topology == "v5p:1x1x1" and targets.get("v5p:2x2x2").count == 8
    assert targets.get("cpu").platform == "cpu" and targets.get(t) is t
    for name in ("h100", "a100-80g", "b200", "v6e"):
        assert name in targets.names() and targets.get(name).memory > 0
    assert targets.get("h200").hardware() == "NVIDIA H200 141GB HBM3e"
    assert targets.get("h200x8").hardware() == "8 x NVIDIA H200 141GB HBM3e"


@pytest.mark.parametrize("bad,words", [("h300", "is not known; use one of h100, h200"),
                                       ("h200:2x2", "a GPU count is written h200xN"),
                                       ("v5ex4", "libtpu's topology words, e.g. v5e:2x4"),
                                       ("h200x0", "the GPU count must be 1..4096"),
                                       ("cpux4096", "this host has")])
def test_bad_names_say_what_is_valid(bad, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        targets.get(bad)


def test_memory_limit_is_jax_s_share_on_a_gpu(monkeypatch):
    h = targets.get("h200")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    assert h.memory_limit == int(h.memory * 0.75)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert h.memory_limit == int(h.memory * 0.9)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    assert h.memory_limit == h.memory
    assert targets.get("v5e").memory_limit == targets.get("v5e").memory


def test_mesh_over_the_target_devices():
    need("cuda")
    mesh = targets.get("h200x8").mesh({"data": 2, "fsdp": 4})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
    assert {d.device_kind for d in mesh.devices.flat} == {"NVIDIA H200 141GB HBM3e"}
    with pytest.raises(ValueError, match="spans 6 devices but h200x8 has 8"):
        targets.get("h200x8").mesh({"fsdp": 6})


def _mlp(w, x):
    for i in range(w.shape[0]):
        x = jnp.tanh(x @ w[i])
    return x.sum()


@pytest.mark.parametrize("target", [GPU, TPU])
def test_compile_without_the_device_and_shard_arguments(target):
    need(targets.get(target).platform)
    w = jax.ShapeDtypeStruct((4, 512, 512), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((64, 512), jnp.bfloat16)
    one = compiled_memory(jax.grad(_mlp), w, x, target=target)
    assert one.argument == 4 * 512 * 512 * 2 + 64 * 512 * 2  # the arguments as placed on one device
    assert one.flops and one.flops > 0
    many = f"{target}x4" if target == GPU else f"{target}:2x2"
    split = compiled_memory(jax.grad(_mlp), w, x, target=many, mesh={"fsdp": 4},
                                    specs=(P(None, "fsdp"), P("fsdp")))
    assert split.argument == one.argument // 4  # per device: each holds a quarter of both arguments


def test_gpu_flops_are_counted_from_the_program():
    need("cuda")
    a = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    b = jax.ShapeDtypeStruct((512, 128), jnp.float32)
    cm = compiled_memory(lambda a, b: a @ b, a, b, target=GPU)
    assert cm.flops_source == "optimized HLO matmuls" and cm.flops == 2 * 256 * 512 * 128


@pytest.mark.parametrize("target", ["cpu", GPU])
def test_flops_of_a_scan_count_every_iteration(target):
    """XLA's cost analysis counts a scan body once whatever its length; the FLOPs the project reports
    are the program's: scan(length=8) of a matmul is 8x scan(length=1)."""
    if target != "cpu":
        need("cuda")
    c = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    scan = lambda n: lambda c: jax.lax.scan(lambda c, _: (jnp.tanh(c @ c), None), c, None, length=n)[0]  # noqa: E731
    one, eight = (compiled_memory(scan(n), c, target=target) for n in (1, 8))
    assert one.flops == 2 * 64 ** 3 and eight.flops == 8 * one.flops, (one.flops, eight.flops)
    assert eight.flops_source == "optimized HLO matmuls"


def test_matmul_flops_follow_scans_and_gradients():
    w, x = jnp.ones((3, 16, 16)), jnp.ones((4, 16))
    scan = lambda w, x: jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0].sum()  # noqa: E731
    one = 2 * 4 * 16 * 16
    assert targets.matmul_flops(jax.make_jaxpr(scan)(w, x)) == 3 * one
    # the gradient: the forward, and two products per layer in the backward
    assert targets.matmul_flops(jax.make_jaxpr(jax.grad(scan))(w, x)) == 3 * one * 3


def test_missing_compiler_is_one_line_naming_the_extra():
    # a real missing module: the CUDA plugin package blocked from importing in a fresh interpreter
    code = ("import sys; sys.modules['jax_plugins.xla_cuda12'] = None\n"
            "import jax, jax.numpy as jnp, remat.memory, remat.planning.targets as T\n"
            "try:\n"
            "    remat.memory.compiled_memory(jnp.sin, jax.ShapeDtypeStruct((4,), jnp.float32), target='h100')\n"
            "except T.TargetUnavailable as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"}).stdout.strip()
    assert out.splitlines() == [out] and "XLA:GPU's compiler (jax-cuda12-pjrt)" in out, out
    assert "pip install 'remat[targets]'" in out


@pytest.mark.parametrize("target", [GPU, TPU])
def test_default_checkpoint_is_jax_s_own_on_accelerators(target):
    """Built for cuda/tpu remat.checkpoint is jax.checkpoint: the same compiled temp, and forward-mode
    AD (jax.jvp, jacfwd, jax.linearize) goes through it."""
    need(targets.get(target).platform)
    w = jax.ShapeDtypeStruct((4, 256, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 256), jnp.float32)

    def stack(ck):
        def loss(w, x):
            for i in range(w.shape[0]):
                x = ck(lambda wi, h: jnp.tanh(h @ wi), w[i], x)
            return x.sum()
        return loss

    ours = stack(lambda f, *a: remat.checkpoint(f)(*a))
    theirs = stack(lambda f, *a: jax.checkpoint(f)(*a))
    assert (compiled_memory(jax.grad(ours), w, x, target=target).temp
            == compiled_memory(jax.grad(theirs), w, x, target=target).temp)
    for fwd in (lambda w, x: jax.jvp(lambda x: ours(w, x), (x,), (x,)),
                lambda w, x: jax.jacfwd(ours)(w[:, :8, :8], x[:2, :8]),
                lambda w, x: jax.linearize(lambda x: ours(w, x), x)[1](x)):
        targets.compile(fwd, w, x, target=target)


def test_forward_mode_runs_on_the_default_path():
    f = lambda x: remat.checkpoint(lambda x: jnp.sin(x) * x)(x).sum()  # noqa: E731
    x = jnp.arange(3.0)
    primal, tangent = jax.jvp(f, (x,), (jnp.ones(3),))
    want = jnp.sum(jnp.sin(x) + x * jnp.cos(x))
    assert np.allclose(tangent, want, rtol=1e-6) and np.allclose(jax.jacfwd(f)(x), jax.grad(f)(x), rtol=1e-6)
    assert np.allclose(jax.hessian(f)(x), jax.hessian(lambda x: (jnp.sin(x) * x).sum())(x), rtol=1e-6)
    # jax.linearize, and forward mode through a jitted function (staged before it is differentiated),
    # go through the default path too
    assert np.allclose(jax.linearize(f, x)[1](jnp.ones(3)), want, rtol=1e-6)
    assert np.allclose(jax.jvp(jax.jit(f), (x,), (jnp.ones(3),))[1], want, rtol=1e-6)
    assert np.allclose(jax.linearize(jax.jit(f), x)[1](jnp.ones(3)), want, rtol=1e-6)


def test_docs_table_is_the_registry():
    from pathlib import Path
    page = (Path(__file__).parent.parent / "docs" / "targets.md").read_text()
    assert targets.table_markdown() in page


def test_a_deviceless_compile_with_a_compilation_cache_set_warns_nothing(tmp_path):
    """With JAX_COMPILATION_CACHE_DIR set, a second process compiling the same program for an absent
    device would read the first one's entry, which cannot be loaded without the device: JAX warns
    "Error reading persistent compilation cache entry". Deviceless compiles skip the cache."""
    need("cuda")
    code = ("import jax, jax.numpy as jnp, remat\nfrom remat.planning import targets\n"
            "x = jnp.ones((64, 64))\n"
            "jax.jit(lambda x: jnp.cos(x) @ x).lower(x).compile()\n"  # a host compile first: the cache is in use
            "targets.compile(lambda x: jnp.sin(x) @ x.T, jax.ShapeDtypeStruct((64, 64), jnp.float32), target='h200')\n"
            "jax.jit(lambda x: jnp.tan(x) @ x).lower(x).compile()\n")  # and still in use after it
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("JAX_PLATFORMS", None)
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert not any("persistent compilation cache" in r.stderr for r in runs), runs[-1].stderr[-2000:]
    lambdas = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("jit__lambda"))
    assert len(lambdas) == 2, lambdas  # the two host programs, not the H200's
