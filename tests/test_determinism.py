"""The structure check fingerprints the program that really ran (remat.checkpoint, reentrant).

The planted fault is a real mechanism: a function whose Python-side counter changes the program it
traces (tanh on its first trace, sin on every later one). Nothing is flipped by the test.
"""
import re

import jax
import jax.numpy as jnp
import pytest

import remat
from tinyblocks import B, C, rel_err

KEY = jax.random.PRNGKey(0)
W = jax.random.normal(KEY, (C, C)) * 0.3
X = jax.random.normal(jax.random.PRNGKey(1), (B, C))


def _changing():
    """A layer whose first trace computes tanh and every later trace sin (a counter, not a flag)."""
    traces = [0]

    def layer(w, x):
        traces[0] += 1
        act = jnp.tanh if traces[0] == 1 else jnp.sin
        return act(x @ w)

    return layer, traces


def _grad(layer, check, jit=False):
    loss = lambda w: jnp.sum(remat.checkpoint(layer, use_reentrant=True, determinism_check=check,
                                              name="blk")(w, X) ** 2)
    g = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    return g(W)


@pytest.mark.parametrize("jit", [False, True])
def test_structure_check_catches_a_function_that_changes_on_its_second_trace(jit):
    layer, traces = _changing()
    with pytest.raises(remat.CheckpointError) as e:
        _grad(layer, "structure", jit)
    msg = str(e.value)
    assert "'blk'" in msg and "different program" in msg
    assert "tanh" in msg and "sin" in msg  # the first differing equation, forward vs recompute
    assert traces[0] == 2  # one trace for the forward, one for the recomputation: no third trace


def test_the_planted_fault_is_real_without_the_structure_check():
    # With only the aval check (the default) the same function returns a wrong gradient (sin's, for
    # tanh's forward), so the structure check above is what stands between it and the user.
    layer, _ = _changing()
    g = _grad(layer, None)
    ref = jax.grad(lambda w: jnp.sum(jnp.tanh(X @ w) ** 2))(W)
    assert rel_err(g, ref) > 1e-2


def test_structure_check_passes_a_deterministic_function_with_exact_gradients():
    f = lambda w, x: jnp.tanh(x @ w)
    ref = jax.grad(lambda w: jnp.sum(f(w, X) ** 2))(W)
    for jit in (False, True):
        assert rel_err(_grad(f, "structure", jit), ref) <= 1e-6


def _hlo(check):
    loss = lambda w, x: jnp.sum(remat.checkpoint(lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w),
                                                 use_reentrant=True, determinism_check=check)(w, x) ** 2)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(W, X).compile().as_text()
    text = re.split(r"^(?:FileNames|FunctionNames|FileLocations|StackFrames)$", text, flags=re.M)[0]
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(r"^HloModule \S+", "", text)


def test_structure_check_costs_nothing_at_run_time():
    # The forward evaluates the jaxpr it traced and the backward differentiates the one it traced:
    # the same equations as without the check, so the optimized HLO is identical.
    off = _hlo(False)
    assert _hlo("structure") == off
    assert _hlo(True) == off
