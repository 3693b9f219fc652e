"""remat.checkpoint: gradients, pytrees, both paths, the determinism check, early stop, RNG."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import remat
from remat import policies
from tinyblocks import B, C, T, block, init_block, rel_err

KEY = jax.random.PRNGKey(0)
PS = [init_block(k) for k in jax.random.split(KEY, 4)]
X = jax.random.normal(KEY, (B, T, C))


def _loss(ps, x, wrap):
    for p in ps:
        x = wrap(block, p, x)
    return jnp.mean(x ** 2)


@functools.cache
def _ref():
    """The gradient without remat (computed on first use, not while the test files are collected)."""
    return jax.grad(_loss, argnums=(0, 1))(PS, X, lambda f, *a: f(*a))


@pytest.mark.parametrize("policy", policies.examples())
def test_gradients_equal_for_every_policy(policy):
    g = jax.grad(_loss, argnums=(0, 1))(PS, X, lambda f, *a: remat.checkpoint(f, policy=policy)(*a))
    assert rel_err(g, _ref()) <= 1e-5


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradients_equal_jitted(reentrant):
    f = jax.jit(jax.grad(_loss, argnums=(0, 1)), static_argnums=2)
    g = f(PS, X, lambda fn, *a: remat.checkpoint(fn, use_reentrant=reentrant)(*a))
    assert rel_err(g, _ref()) <= 1e-5


def test_pytrees_static_and_non_array_arguments_both_paths():
    def f(p, h, cfg, scale, tag):  # cfg: dict with a Python int; scale: float; tag: str (static)
        assert tag == "x"
        y = jnp.tanh(h["a"] @ p["w"]) * scale * cfg["k"]
        return {"y": y, "pair": (y.sum(), h["n"] + 1)}

    p = {"w": jax.random.normal(KEY, (C, C))}
    h = {"a": jax.random.normal(KEY, (B, C)), "n": jnp.arange(3)}

    def loss(p, h, wrap):
        out = wrap(f, p, h, {"k": 3}, 0.5, "x")
        return jnp.sum(out["y"] ** 2) + out["pair"][0] + jnp.sum(out["pair"][1])

    ref = jax.grad(loss)(p, h, lambda fn, *a: fn(*a))
    for reentrant in (False, True):
        g = jax.grad(loss)(p, h, lambda fn, *a: remat.checkpoint(fn, use_reentrant=reentrant,
                                                                static_argnums=(4,))(*a))
        assert rel_err(g, ref) <= 1e-6


def test_decorator_forms():
    @remat.checkpoint
    def f1(w, x):
        return jnp.sin(x @ w)

    @remat.checkpoint(use_reentrant=True, name="layer")
    def f2(w, x):
        return jnp.sin(x @ w)

    w, x = jax.random.normal(KEY, (C, C)), jax.random.normal(KEY, (B, C))
    ref = jax.grad(lambda w: jnp.sum(jnp.sin(x @ w) ** 2))(w)
    for f in (f1, f2):
        assert rel_err(jax.grad(lambda w: jnp.sum(f(w, x) ** 2))(w), ref) <= 1e-6


def test_reentrant_rejects_a_policy():
    with pytest.raises(ValueError, match="saves only the inputs"):
        remat.checkpoint(jnp.sin, use_reentrant=True, policy="dots")(X)


# --- the determinism check: each kind of mismatch planted in a function that really traces
# differently the second time (a Python-side trace counter, as a stateful function would) ---------
def _second_trace(first, second):
    """A function whose first trace is `first` and every later one `second`."""
    traces = []

    def h(x):
        traces.append(1)
        return (first if len(traces) == 1 else second)(x)
    return h


def _planted(kind):
    changed = {"dtype": lambda y: y.astype(jnp.bfloat16), "shape": lambda y: y[:, :-1],
               "tree": lambda y: (y, y)}[kind]
    return _second_trace(lambda x: x * 2, lambda x: changed(x * 2))


@pytest.mark.parametrize("kind,needles", [
    ("dtype", ["float32[2, 16]", "bfloat16[2, 16]"]), ("shape", ["float32[2, 16]", "float32[2, 15]"]),
    ("tree", ["different output structure"])])
def test_determinism_check_names_region_leaf_and_both_avals(kind, needles):
    x = jax.random.normal(KEY, (B, C))
    y, vjp = jax.vjp(lambda x: remat.checkpoint(_planted(kind), use_reentrant=True, name="blk")(x), x)
    with pytest.raises(remat.CheckpointError) as e:
        vjp(jnp.ones_like(y))
    assert "'blk'" in str(e.value)
    for n in needles:
        assert n in str(e.value)


def test_determinism_check_catches_sharding_change():
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
    h = _second_trace(lambda x: x * 2, lambda x: jax.sharding.reshard(x * 2, P()))

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("x")))
        y, vjp = jax.vjp(lambda x: remat.checkpoint(h, use_reentrant=True)(x), x)
        with pytest.raises(remat.CheckpointError, match=r"sharded \('x', None\).*sharded \(None, None\)"):
            vjp(jnp.ones_like(y))


def test_structure_check_catches_a_change_that_keeps_avals():
    # The recompute does the matmul in bf16 and casts back: same output aval, wrong gradients. The
    # function really traces differently the second time (a Python-side trace counter).
    w, x = jax.random.normal(KEY, (C, C)), jax.random.normal(KEY, (B, C))

    def changing():
        traces = []

        def h(w, x):
            traces.append(1)
            if len(traces) > 1:
                return jnp.tanh((x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32))
            return jnp.tanh(x @ w)
        return h

    for check, raises in ((None, False), (True, True), ("structure", True)):
        y, vjp = jax.vjp(lambda w: remat.checkpoint(changing(), use_reentrant=True, determinism_check=check)(w, x), w)
        if raises:
            with pytest.raises(remat.CheckpointError, match="different program"):
                vjp(jnp.ones_like(y))
        else:
            vjp(jnp.ones_like(y))  # the aval check alone (the default) cannot see it


def _hlo(check):
    f = jax.jit(jax.grad(_loss, argnums=(0, 1)), static_argnums=2)
    text = f.lower(PS, X, lambda fn, *a: remat.checkpoint(fn, use_reentrant=True,
                                                          determinism_check=check)(*a)).compile().as_text()
    text = re.split(r"^(?:FileNames|FunctionNames|FileLocations|StackFrames)$", text, flags=re.M)[0]
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(r"^HloModule \S+", "", text)


@pytest.mark.slow  # ~6 s
def test_determinism_check_costs_nothing_in_the_optimized_hlo():
    assert _hlo(True) == _hlo(False)


def test_reentrant_recompute_stops_early():
    # y = tanh(x @ w1) @ w2: the backward needs tanh(x @ w1) but not the final matmul.
    w1, w2 = jax.random.normal(KEY, (C, 2 * C)), jax.random.normal(KEY, (2 * C, C))
    x = jax.random.normal(KEY, (B, C))
    f = lambda a, b, c: jnp.tanh(c @ a) @ b

    def dots(reentrant):
        loss = lambda a, b, c: jnp.sum(remat.checkpoint(f, use_reentrant=reentrant)(a, b, c))
        return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(w1, w2, x)).count("dot_general")

    forward, backward = 2, 4  # forward: 2 matmuls; backward: dw2, dh, dw1, dx
    assert dots(True) == forward + 1 + backward  # recompute: only x @ w1
    assert dots(False) == forward + 1 + backward


@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_inside_a_region_uses_the_same_mask(reentrant):
    keys = jax.random.split(jax.random.PRNGKey(7), len(PS))

    def loss(ps, x, wrap):
        for p, k in zip(ps, keys):
            x = wrap(lambda p, x, k: block(p, x, k, 0.3), p, x, k)
        return jnp.mean(x ** 2)

    ref = jax.grad(loss)(PS, X, lambda f, *a: f(*a))
    g = jax.grad(loss)(PS, X, lambda f, *a: remat.checkpoint(f, use_reentrant=reentrant)(*a))
    # Same masks: the only differences are float32 rounding from XLA's different fusion of the
    # recomputation (measured 2.8e-7 relative, jitted or not); a wrong mask moves gradients by O(1).
    assert rel_err(g, ref) <= 1e-6
    other = jax.random.split(jax.random.PRNGKey(8), len(PS))
    wrong = jax.grad(lambda ps, x: _loss_keys(ps, x, other))(PS, X)
    assert rel_err(wrong, ref) > 1e-2


def _loss_keys(ps, x, keys):
    for p, k in zip(ps, keys):
        x = block(p, x, k, 0.3)
    return jnp.mean(x ** 2)


def test_values_check_catches_a_planted_rng_mismatch():
    # The region draws its dropout key from Python-side state that advances on every trace:
    # shapes and dtypes match, the recomputed mask does not.
    counter = [0]

    def layer(x):
        counter[0] += 1
        keep = jax.random.bernoulli(jax.random.PRNGKey(counter[0]), 0.5, x.shape)
        return jnp.where(keep, x * 2, 0.0)

    x = jax.random.normal(KEY, (B, C))
    grad = lambda check: jax.grad(lambda x: jnp.sum(remat.checkpoint(
        layer, use_reentrant=True, determinism_check=check, name="drop")(x) ** 2))(x)
    grad(None)  # the default shape/dtype check cannot see it
    with pytest.raises(Exception, match=r"region 'drop'.*recomputed values differ"):
        jax.block_until_ready(grad("values"))


def test_values_check_passes_a_deterministic_region_and_needs_reentrant():
    g = jax.jit(jax.grad(_loss, argnums=(0, 1)), static_argnums=2)(
        PS, X, lambda fn, *a: remat.checkpoint(fn, use_reentrant=True, determinism_check="values")(*a))
    assert rel_err(g, _ref()) <= 1e-5
    with pytest.raises(ValueError, match="needs use_reentrant=True"):
        remat.checkpoint(jnp.sin, determinism_check="values")(X)
    with pytest.raises(ValueError, match="needs use_reentrant=True"):
        remat.RecomputeConfig(granularity="full", determinism_check="values")
