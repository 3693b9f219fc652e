"""remat.checkpoint behaves as jax.checkpoint: each behavior JAX's own remat tests check, checked here
against the library's default path (which is `jax.checkpoint` with the policy resolved) and, where
the library adds to it, against `jax.checkpoint` itself.

Areas: call form and options; forward, reverse and higher-order AD (also through jit, vmap, scan,
while_loop and cond); custom_jvp/custom_vjp inside; policies and names; static arguments and
Python scalars; one trace per call signature; no leaked tracers; errors.
"""
import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import remat
from remat import memory

ck = remat.checkpoint
X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
W = jnp.arange(9.0).reshape(3, 3) / 9


def f(w, x):
    return jnp.sum(jnp.sin(jnp.sin(x @ w)) * x)


def close(a, b, tol=1e-6):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


# 1. The call form and the options --------------------------------------------------------------

def test_returns_a_function_and_decorates_like_jax_checkpoint():
    @ck
    def g(w, x):
        return f(w, x)

    @functools.partial(ck, policy=jax.checkpoint_policies.dots_saveable)
    def h(w, x):
        return f(w, x)

    for fn in (ck(f), g, h, ck()(f), ck(prevent_cse=False)(f)):
        close(jax.grad(fn)(W, X), jax.grad(f)(W, X))


def test_the_torch_form_runs_at_once_and_equals_the_wrapped_function():
    # torch.utils.checkpoint(fn, *args, use_reentrant=...): both paths, values and gradients
    for reentrant in (False, True):
        close(ck(f, W, X, use_reentrant=reentrant), ck(f, use_reentrant=reentrant)(W, X))
        close(jax.grad(lambda w: ck(f, w, X, use_reentrant=reentrant).sum())(W), jax.grad(lambda w: f(w, X).sum())(W))
    g = lambda w, x, scale=1.0: f(w, x) * scale  # noqa: E731
    close(ck(g, W, X, scale=2.0), 2.0 * f(W, X))  # a keyword that is not an option goes to the function
    with pytest.raises(TypeError, match=r"not options.*remat.checkpoint\(fn, policy=...\)\(\*args, \*\*kwargs\)"):
        ck(f, train=False)  # no arguments: a typo'd option is not silently dropped


def test_a_function_parameter_named_like_an_option_receives_its_value():
    def g(x, name, policy):
        return x * name + policy
    assert float(ck(g, name="region")(2.0, name=3.0, policy=1.0)) == 7.0
    # in the form that runs at once, such a keyword is ambiguous: refused, with both ways to say it
    with pytest.raises(TypeError, match=r"'policy' and 'name' are options of remat.checkpoint and parameters of g.*"
                                        r"functools.partial\(fn, policy=..., name=...\)"):
        ck(g, 2.0, name=3.0, policy=1.0)
    assert float(ck(functools.partial(g, name=3.0, policy=1.0), 2.0)) == 7.0


# 2. Forward, reverse, higher order, through the transformations ---------------------------------

@pytest.mark.parametrize("mode", ["jvp", "jacfwd", "linearize", "jvp_of_jit", "linearize_of_jit", "grad",
                                  "grad_of_jit", "vmap_of_grad", "grad_of_vmap", "hessian", "hessian_of_jit",
                                  "jvp_of_grad"])
def test_every_mode_agrees_with_jax_checkpoint(mode):
    t = jnp.ones_like(W)
    run = {
        "jvp": lambda c: jax.jvp(lambda w: c(f)(w, X), (W,), (t,))[1],
        "jacfwd": lambda c: jax.jacfwd(lambda w: c(f)(w, X))(W),
        "linearize": lambda c: jax.linearize(lambda w: c(f)(w, X), W)[1](t),
        "jvp_of_jit": lambda c: jax.jvp(jax.jit(lambda w: c(f)(w, X)), (W,), (t,))[1],
        "linearize_of_jit": lambda c: jax.linearize(jax.jit(lambda w: c(f)(w, X)), W)[1](t),
        "grad": lambda c: jax.grad(c(f))(W, X),
        "grad_of_jit": lambda c: jax.grad(jax.jit(c(f)))(W, X),
        "vmap_of_grad": lambda c: jax.vmap(jax.grad(c(f)), (None, 0))(W, jnp.stack([X, 2 * X])),
        "grad_of_vmap": lambda c: jax.grad(lambda w: jnp.sum(jax.vmap(c(f), (None, 0))(w, jnp.stack([X, X]))))(W),
        "hessian": lambda c: jax.hessian(lambda w: c(f)(w, X))(W),
        "hessian_of_jit": lambda c: jax.hessian(jax.jit(lambda w: c(f)(w, X)))(W),
        "jvp_of_grad": lambda c: jax.jvp(jax.grad(lambda w: c(f)(w, X)), (W,), (t,))[1],
    }[mode]
    close(run(ck), run(jax.checkpoint), tol=1e-5)


def test_linearize_keeps_the_recomputation_in_the_linear_program():
    """As JAX's: the linearized function recomputes sin (and uses cos) instead of saving them."""
    g = ck(lambda x: jnp.sin(jnp.sin(x)))
    _, g_lin = jax.linearize(g, 2.0)
    text = str(jax.make_jaxpr(g_lin)(1.0))
    assert " sin " in text and " cos " in text
    np.testing.assert_allclose(g_lin(3.0), np.cos(np.sin(2.0)) * np.cos(2.0) * 3.0, rtol=1e-6)


@pytest.mark.parametrize("where", ["scan", "while", "cond", "fori"])
def test_control_flow_inside_and_around(where):
    def body(x):
        if where == "scan":
            return lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=3)[0]
        if where == "while":
            return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x))[1]
        if where == "cond":
            return lax.cond(jnp.sum(x) > 0, jnp.sin, jnp.cos, x)
        return lax.fori_loop(0, 3, lambda i, c: jnp.sin(c) * 1.1, x)

    x = jnp.array([0.3, 0.7])
    for c in (ck, jax.checkpoint):  # remat of the loop, and the loop of remat bodies
        g = lambda x: jnp.sum(c(body)(x))  # noqa: E731
        if where != "while":  # JAX differentiates a while_loop in forward mode only
            close(jax.grad(g)(x), jax.grad(lambda x: jnp.sum(body(x)))(x))
        close(jax.jvp(g, (x,), (jnp.ones(2),))[1], jax.jvp(lambda x: jnp.sum(body(x)), (x,), (jnp.ones(2),))[1])
        close(jax.linearize(g, x)[1](jnp.ones(2)), jax.jvp(lambda x: jnp.sum(body(x)), (x,), (jnp.ones(2),))[1])
    scanned = lambda x: lax.scan(lambda c, _: (ck(jnp.sin)(c), None), x, None, length=3)[0]  # noqa: E731
    close(jax.grad(lambda x: jnp.sum(scanned(x)))(x), jax.grad(lambda x: jnp.sum(body(x)))(x) if where == "scan"
          else jax.grad(lambda x: jnp.sum(lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=3)[0]))(x))


def test_custom_jvp_and_custom_vjp_inside():
    @jax.custom_jvp
    def s(x):
        return jnp.sin(x)
    s.defjvp(lambda p, t: (jnp.sin(p[0]), 2.0 * jnp.cos(p[0]) * t[0]))  # a rule that differs from sin's

    @jax.custom_vjp
    def v(x):
        return jnp.sin(x)
    v.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (3.0 * jnp.cos(x) * g,))

    x = jnp.array([0.2, 0.9])
    for fn in (s, v):
        g = lambda x: jnp.sum(fn(fn(x)))  # noqa: E731
        close(jax.grad(lambda x: jnp.sum(ck(g)(x)))(x), jax.grad(g)(x))
        close(jax.jit(jax.grad(lambda x: jnp.sum(ck(g)(x))))(x), jax.grad(g)(x))
    close(jax.jvp(ck(lambda x: s(s(x))), (x,), (jnp.ones(2),)), jax.jvp(lambda x: s(s(x)), (x,), (jnp.ones(2),)))


# 3. Policies and names ---------------------------------------------------------------------------

def test_a_policy_saves_what_jax_checkpoint_saves():
    def g(w, x):
        a = checkpoint_name(jnp.sin(x @ w), "a")
        return jnp.sum(jnp.cos(a @ w))
    for pol in (jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names("a"),
                jax.checkpoint_policies.nothing_saveable):
        ours = memory.saved_residuals(jax.checkpoint(g, policy=pol), W, X).total
        assert memory.saved_residuals(ck(g, policy=pol), W, X).total == ours
        close(jax.grad(ck(g, policy=pol))(W, X), jax.grad(g)(W, X))


def test_jax_remat_markers_are_kept_for_reports_and_name_stacks(capsys):
    g = ck(lambda x: jnp.sin(jnp.sin(x)))
    assert "remat2[" in str(jax.make_jaxpr(g)(1.0))  # JAX's own remat primitive
    print_saved_residuals(g, 1.0)
    assert "from the argument" in capsys.readouterr().out
    assert "remat2[" in str(jax.make_jaxpr(ck(jnp.sin))(jnp.ones(2)))  # traced for later: JAX's remat inside


def test_prevent_cse_per_argument_as_a_pytree_prefix():
    layer = ck(lambda d: d["x"] @ d["W"], prevent_cse=({"W": False, "x": True},))
    loss = lambda ws, x: jnp.sum(functools.reduce(lambda h, w: layer({"W": w, "x": h}), ws, x) ** 2)  # noqa: E731
    ws = [jnp.ones((3, 3))] * 2
    close(jax.grad(loss)(ws, jnp.ones(3)), jax.grad(lambda ws, x: jnp.sum(functools.reduce(
        lambda h, w: h @ w, ws, x) ** 2))(ws, jnp.ones(3)))
    assert "optimization_barrier" in jax.jit(jax.grad(loss)).lower(ws, jnp.ones(3)).as_text()


# 4. Static arguments, Python scalars, caching ---------------------------------------------------

def test_python_scalars_are_traced_and_static_argnums_are_not():
    with pytest.raises(jax.errors.TracerBoolConversionError):
        ck(lambda x: x if x > 0 else jnp.sin(x))(3.0)
    assert float(ck(lambda x: x.sum())(3.0)) == 3.0  # a traced scalar has array methods
    g = ck(lambda x, n: x * (2.0 if n > 0 else 3.0), static_argnums=(1,))
    assert float(g(1.0, 1)) == 2.0 and float(g(1.0, -1)) == 3.0
    h = ck(lambda x, *, train: x * (0.5 if train else 1.0), static_argnames="train")
    assert float(jax.grad(lambda x: h(x, train=True))(1.0)) == 0.5


def test_concreteness_errors_point_at_the_user_code():
    with pytest.raises(jax.errors.TracerBoolConversionError):
        try:
            ck(lambda x, _: x if x > 0 else jnp.sin(x), static_argnums=(1,))(3.0, 1.0)
        except jax.errors.TracerBoolConversionError:
            assert "x if x > 0" in traceback.format_exc()
            raise


def test_traced_once_per_call_signature():
    count = []

    def g(x):
        count.append(1)
        return jnp.sin(x), 3.0

    r = ck(g)
    for _ in range(5):
        r(2.0)
        jax.grad(lambda x: r(x)[0])(2.0)
    assert len(count) == 1  # eager and under jax.grad: one signature (float32[], weak)
    r(jnp.ones(3))
    assert len(count) == 2  # a new shape: a new trace
    s = ck(lambda x, n: (count.append(1), x * n)[1], static_argnums=(1,))
    for _ in range(3):
        s(1.0, 2)
    assert len(count) == 3


def test_static_argnums_out_of_range_and_of_a_wrong_type():
    with pytest.raises(ValueError, match="static_argnums"):
        ck(f, static_argnums=(2,))(W, X)
    with pytest.raises(TypeError, match="static_argnums"):
        ck(f, static_argnums="1")


# 5. No leaked tracers ----------------------------------------------------------------------------

@pytest.mark.parametrize("reentrant", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_no_tracer_leaks(reentrant):
    with jax.check_tracer_leaks():
        jax.jit(lambda x: jax.vjp(ck(lambda x: jax.nn.relu(1.0 * x), use_reentrant=reentrant), x)[0])(1.0)
        jax.grad(lambda w: ck(f, use_reentrant=reentrant)(w, X))(W)
        jax.jit(jax.grad(lambda w: ck(f, use_reentrant=reentrant)(w, X)))(W)


def test_closed_over_traced_weights_are_hoisted():
    def loss(w):
        return jnp.sum(ck(lambda x: jnp.tanh(x @ w))(X) ** 2)  # closes over the outer grad's w
    close(jax.grad(loss)(W), jax.grad(lambda w: jnp.sum(jnp.tanh(X @ w) ** 2))(W))
    close(jax.jit(jax.grad(loss))(W), jax.grad(lambda w: jnp.sum(jnp.tanh(X @ w) ** 2))(W))


# 6. Errors where the library differs ------------------------------------------------------------

def test_reentrant_forward_mode_names_the_option():
    with pytest.raises(TypeError, match="use_reentrant=False"):
        jax.jvp(ck(jnp.sin, use_reentrant=True), (1.0,), (1.0,))


def test_non_jax_leaves_are_refused_as_jax_refuses_them():
    f = lambda x, tag: x * len(tag)  # noqa: E731
    with pytest.raises(TypeError, match="not a valid JAX type"):
        ck(f)(2.0, "abc")
    with pytest.raises(TypeError, match="not a valid JAX type"):
        jax.checkpoint(f)(2.0, "abc")
    assert float(ck(f, static_argnums=1)(2.0, "abc")) == 6.0
