"""The chunked LM head and loss (`loss_chunk`, remat_lm/models/layers.py `lm_head`): the same loss and
gradients as the plain head, for both models, with remat off and on; the (B, T, V) logits never
exist in the program; `--loss_chunk` changes the compiled train step."""
from __future__ import annotations

import dataclasses
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remat_lm.models import gpt2, llama3
from remat import RecomputeConfig
from remat.memory import compiled_memory
from remat_lm.training import config_from_args, run
from remat_lm.training.run import compile_train_step, prepare
from targethelp import need

MODELS = {"gpt2": (gpt2, gpt2.GPT2Config), "llama3": (llama3, llama3.Llama3Config)}
B, T = 2, 16
# Chunked vs plain in float32: the same operations on the same rows, only the weight gradient is
# summed chunk by chunk (and the loss too), so they differ by float32 summation order (~1e-7).
TOL = 1e-6
RECOMPUTE = {"none": RecomputeConfig(), "full": RecomputeConfig(granularity="full")}
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}  # faster XLA:CPU compiles (as in test_models.py)


def _cfg(model, **kw):
    return MODELS[model][1].preset("tiny", **kw)


def _batch(vocab):
    k1, k2 = jax.random.split(jax.random.key(1))
    return jax.random.randint(k1, (B, T), 0, vocab), jax.random.randint(k2, (B, T), 0, vocab)


@functools.lru_cache(maxsize=None)
def _value_and_grad(model, cfg):
    mod = MODELS[model][0]
    params = mod.init_params(_cfg(model), jax.random.key(0))
    x, y = _batch(cfg.vocab_size)
    step = jax.jit(jax.value_and_grad(lambda p: mod.loss_fn(p, cfg, x, y))).lower(params)
    loss, grads = step.compile(COMPILER_OPTIONS)(params)
    return float(loss), jax.tree.map(np.asarray, grads)


# Chunks of 5 over T=16: three under the scan and a remainder of 1; chunks of 4 divide T. The fast
# run covers each model once, remat off for one and on for the other; the rest are `slow`.
FAST = {("gpt2", "none", 5), ("llama3", "full", 5)}


@pytest.mark.parametrize("model, remat, chunk", [
    pytest.param(*c, marks=() if c in FAST else pytest.mark.slow)
    for c in [(m, r, 5) for m in MODELS for r in RECOMPUTE] + [("gpt2", "none", 4), ("llama3", "full", 4)]])
def test_chunked_gradients_equal_unchunked(model, remat, chunk):
    loss0, g0 = _value_and_grad(model, _cfg(model, recompute=RECOMPUTE[remat]))
    loss, g = _value_and_grad(model, _cfg(model, recompute=RECOMPUTE[remat], loss_chunk=chunk))
    assert abs(loss - loss0) <= TOL * abs(loss0)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g0), jax.tree.leaves(g)):
        err, scale = np.abs(a.astype(np.float64) - b).max(), np.abs(a).max()
        assert err <= TOL * scale, f"{jax.tree_util.keystr(path[0])}: max|Δg| {err:.3e} > {TOL}·{scale:.3e}"


def _avals(jaxpr):
    """Every value a jaxpr (and its sub-jaxprs: scan bodies, checkpoint regions, custom VJPs) makes."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


@pytest.mark.parametrize("model", list(MODELS))
def test_full_logits_never_exist_in_forward_or_backward(model):
    mod = MODELS[model][0]
    params = mod.init_params(_cfg(model), jax.random.key(0))
    x, y = _batch(_cfg(model).vocab_size)

    V = params["wte"].shape[0]

    def positions(cfg):  # the most positions of any (B, positions, V) value in the value-and-grad program
        jaxpr = jax.make_jaxpr(jax.value_and_grad(lambda p: mod.loss_fn(p, cfg, x, y)))(params).jaxpr
        return max(a.shape[1] for a in _avals(jaxpr) if a.ndim == 3 and a.shape[::2] == (B, V))

    assert positions(_cfg(model)) == T  # the plain head builds the logits (the check can fail)
    assert positions(_cfg(model, loss_chunk=4)) == 4  # chunked: one chunk's logits at a time


@pytest.mark.slow  # ~5 s
def test_lm_head_logits_when_asked():
    cfg = _cfg("gpt2", loss_chunk=4)
    params = gpt2.init_params(cfg, jax.random.key(0))
    x, y = _batch(cfg.vocab_size)
    logits, loss = gpt2.GPT2(cfg).apply({"params": params}, x, y)
    assert logits is None and loss is not None  # chunked with targets: no logits are built
    plain_logits, _ = gpt2.GPT2(_cfg("gpt2")).apply({"params": params}, x)
    np.testing.assert_array_equal(gpt2.GPT2(cfg).apply({"params": params}, x)[0], plain_logits)


@pytest.mark.parametrize("model", list(MODELS))
def test_config_rejects_negative_chunk(model):
    with pytest.raises(ValueError, match="loss_chunk=-1"):
        _cfg(model, loss_chunk=-1)


def test_flag_changes_the_compiled_train_step(tmp_path):
    """--loss_chunk reaches the compiled train step: its temp buffer loses the logits that the plain
    head keeps and differentiates (8 x 64 x 4096 float32 = 8 MiB) less what one chunk of 16 positions
    keeps, its logits and their gradient (2 x 8 x 16 x 4096 float32 = 4 MiB at most). The step is
    compiled by XLA:GPU for an H200 (`--target h200 --dry_run`, deviceless)."""
    need("cuda")
    data = tmp_path / "t.txt"
    data.write_bytes(bytes(range(256)) * 64)
    argv = ["--preset", "tiny", "--n_layer", "1", "--vocab_size", "4096", "--batch_size", "8", "--sequence_length", "64",
            "--val_every", "0", "--data", str(data), "--target", "h200", "--dry_run"]
    temps = {}
    for chunk in (0, 16):
        setup = prepare(config_from_args(argv + ["--loss_chunk", str(chunk)]))
        assert setup.mcfg.loss_chunk == chunk
        temps[chunk] = compile_train_step(setup).memory_analysis().temp_size_in_bytes
    logits, chunk = 8 * 64 * 4096 * 4, 8 * 16 * 4096 * 4
    # measured on XLA:GPU, h200: 11.82 MB -> 5.46 MB, a fall of 6.06 MiB
    assert temps[0] - temps[16] >= logits - 2 * chunk, temps
    with pytest.raises(Exception, match="loss_chunk"):
        config_from_args(argv + ["--loss_chunk", "-3"])


def _default_chunk_argv(tmp_path):
    data = tmp_path / "t.txt"
    data.write_bytes(bytes(range(256)) * 64)
    return ["--preset", "tiny", "--n_layer", "1", "--vocab_size", "4096", "--batch_size", "8",
            "--val_every", "0", "--data", str(data), "--target", "h200", "--dry_run"]


def test_the_default_chunks_where_a_device_s_logits_are_large(tmp_path):
    """Without --loss_chunk, train.py chunks the loss when one device's float32 logits pass
    CHUNK_LOGITS_MIB (here 8 x 1024 x 4096 x 4 = 128 MiB: chunks of 512 positions, whose logits
    are 64 MiB); with small logits (T=64) it leaves the loss whole; `--loss_chunk 0` turns it off."""
    argv = _default_chunk_argv(tmp_path)
    long = argv + ["--sequence_length", "1024", "--block_size", "1024"]
    assert prepare(config_from_args(long)).mcfg.loss_chunk == 512
    assert prepare(config_from_args(long + ["--loss_chunk", "0"])).mcfg.loss_chunk == 0
    assert prepare(config_from_args(argv + ["--sequence_length", "64"])).mcfg.loss_chunk == 0


@pytest.mark.slow  # two XLA:GPU compiles, ~18 s; test_flag_changes_the_compiled_train_step keeps a chunked step's lower temp fast
def test_the_default_chunk_lowers_the_compiled_step(tmp_path):
    """The chunks the default picks (512 positions, above) need less than the whole loss: XLA:GPU
    for an H200, deviceless."""
    need("cuda")
    long = _default_chunk_argv(tmp_path) + ["--sequence_length", "1024", "--block_size", "1024"]
    temps = {}
    for extra in ([], ["--loss_chunk", "0"]):
        setup = prepare(config_from_args(long + extra))
        temps[setup.mcfg.loss_chunk] = compile_train_step(setup).memory_analysis().temp_size_in_bytes
    assert set(temps) == {512, 0}
    # the whole logits are 128 MiB, a chunk's 64; XLA:GPU reuses the two programs' other buffers
    # differently, so the bound is half that difference (measured: 162.1 -> 114.9 MiB)
    assert temps[512] <= temps[0] - 32 * 2**20, temps


@pytest.mark.parametrize("n_valid", [96, 128], ids=["padded", "whole"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_and_its_gradient_equal_optaxs(n_valid, dtype):
    """The loss with its backward written out (remat_lm.models.layers.cross_entropy) against
    optax's `softmax_cross_entropy_with_integer_labels` with the padded columns masked."""
    import optax
    from remat_lm.models import layers
    k1, k2 = jax.random.split(jax.random.key(0))
    logits = (3 * jax.random.normal(k1, (B, T, 128))).astype(dtype)
    targets = jax.random.randint(k2, (B, T), 0, n_valid)
    where = jnp.broadcast_to(jnp.arange(128) < n_valid, logits.shape)
    ref = lambda z: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
        z.astype(jnp.float32), targets, where=where).sum() / 100
    ours = lambda z: layers.cross_entropy(z, targets, n_valid, total=100)  # noqa: E731
    (a, ga), (b, gb) = jax.value_and_grad(ours)(logits), jax.value_and_grad(ref)(logits)
    assert ga.dtype == gb.dtype == logits.dtype
    assert float(jnp.abs(a - b)) <= 1e-6 * float(jnp.abs(b))
    ga, gb = np.asarray(ga, np.float32), np.asarray(gb, np.float32)
    # float32: the same softmax by another route, ~1 ulp; bf16: both round a float32 gradient to
    # bf16 once, so they differ by at most one bf16 ulp (8 significant bits: 2**-7 relative)
    tol = 1e-6 if dtype == "float32" else 2.0 ** -7
    assert np.abs(ga - gb).max() <= tol * np.abs(gb).max()
    assert not ga[..., n_valid:].any()  # padded columns get no gradient
