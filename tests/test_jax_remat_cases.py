"""remat.checkpoint against jax.checkpoint on the behaviours JAX's own remat tests check.

Every case wraps one function with both `jax.checkpoint` and `remat.checkpoint` (same options) and
compares what the two give: values and derivatives (float32, 1e-6 relative), the program each
traces, the residuals the backward keeps, the primitives left in the linearized program, trace and
lowering counts, HLO optimization barriers, and the errors raised. Default path only (CPU).
"""
import collections
import contextlib
import functools
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import remat
from remat import memory

JAX_CK = jax.checkpoint
cp = jax.checkpoint_policies
NEVER = lambda *_, **__: False  # noqa: E731  (a policy callable that saves nothing)
ALWAYS = lambda *_, **__: True  # noqa: E731
SAVE_COS = lambda prim, *_, **__: str(prim) == "cos"  # noqa: E731
OPTS = {"default": {}, "never": {"policy": NEVER}}


def both(fn, **opts):
    """(jax.checkpoint(fn, **opts), remat.checkpoint(fn, **opts))."""
    return JAX_CK(fn, **opts), remat.checkpoint(fn, **opts)


def close(a, b, rtol=1e-6):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(la, lb):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=0)


def prims(closed) -> collections.Counter:
    """Primitive names in a (closed) jaxpr, sub-jaxprs (scan/cond/while/remat/jit bodies) included."""
    out = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            out[eqn.primitive.name] += 1
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)
    walk(closed.jaxpr if hasattr(closed, "jaxpr") else closed)
    return out


def _traced(make_inner, f, *args):
    """Primitives of the function `make_inner(f, *args)` returns (a linearized or VJP function),
    all traced abstractly: nothing is evaluated."""
    out = []

    def outer(*a):
        inner, inner_args = make_inner(f, *a)
        out.append(prims(jax.make_jaxpr(inner)(*inner_args)))
        return jnp.zeros(())
    jax.make_jaxpr(outer)(*args)
    return out[0]


def lin_prims(f, *args):
    """Primitives the linearized function evaluates: what was recomputed rather than saved."""
    return _traced(lambda f, *a: (jax.linearize(f, *a)[1], a), f, *args)


def vjp_prims(f, *args):
    def make(f, *a):
        y, f_vjp = jax.vjp(f, *a)
        return f_vjp, (y,)
    return _traced(make, f, *args)


def residuals(f, *args):
    return [(r.shape, r.dtype, r.kind, r.name, r.host) for r in memory.saved_residuals(f, *args).rows]


def same_programs(fa, fb, *args):
    """The two wrapped functions trace the same forward, linearized and VJP programs."""
    assert str(jax.make_jaxpr(fa)(*args)) == str(jax.make_jaxpr(fb)(*args))
    assert lin_prims(fa, *args) == lin_prims(fb, *args)
    assert vjp_prims(fa, *args) == vjp_prims(fb, *args)


def _derivatives(f, order, argnums, jvp):
    def run(*args):
        outs, g = [f(*args)], f
        for _ in range(order):
            g = jax.grad(lambda *a, g=g: jnp.sum(jnp.asarray(g(*a))), argnums=argnums)
            outs.append(g(*args))
        if jvp:
            outs.append(jax.jvp(f, args, jax.tree.map(jnp.ones_like, args)))
        return outs
    return run


def grads_agree(fa, fb, *args, order=1, argnums=0, jvp=True):
    """Values, reverse-mode derivatives up to `order` and a JVP agree (one compiled program)."""
    da, db = _derivatives(fa, order, argnums, jvp), _derivatives(fb, order, argnums, jvp)
    a, b = jax.jit(lambda *x: (da(*x), db(*x)))(*args)
    close(a, b)
    return b


@contextlib.contextmanager
def count_lowerings():
    """How many jaxpr -> MLIR lowerings (compilations) happen inside the block."""
    n = [0]

    def listener(event, _secs, **_):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            n[0] += 1
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield lambda: n[0]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def two_sines(x):
    return lax.sin(lax.sin(x))


# 1. The call forms -------------------------------------------------------------------------------

def test_the_decorator_forms_wrap_like_jax_checkpoint():
    def g(x):
        return jnp.sin(jnp.sin(x)), 3.0

    forms = [
        (JAX_CK(g), remat.checkpoint(g)),
        (JAX_CK(g, policy=NEVER), remat.checkpoint(g, policy=NEVER)),
        (functools.partial(JAX_CK, prevent_cse=False)(g), functools.partial(remat.checkpoint, prevent_cse=False)(g)),
        (jax.remat(g, policy=cp.dots_saveable), remat.checkpoint(g, policy=cp.dots_saveable)),
    ]
    for fa, fb in forms:
        assert fb.__name__ == fa.__name__ == "g"
        close(fa(2.0), fb(2.0))
        same_programs(lambda x, f=fa: f(x)[0], lambda x, f=fb: f(x)[0], 2.0)


# 2. Eager linearize, closed-over values, jit, vmap ----------------------------------------------

@pytest.mark.parametrize("opts", OPTS.values(), ids=OPTS)
def test_linearize_recomputes_the_same_primitives(opts):
    fa, fb = both(lambda x: (two_sines(x), 3.0), **opts)
    ya, lin_a = jax.linearize(lambda x: fa(x)[0], 2.0)
    yb, lin_b = jax.linearize(lambda x: fb(x)[0], 2.0)
    close(ya, yb)
    close(lin_a(3.0), lin_b(3.0))
    np.testing.assert_allclose(lin_b(3.0), np.cos(np.sin(2.0)) * np.cos(2.0) * 3.0, rtol=1e-6)
    pa, pb = prims(jax.make_jaxpr(lin_a)(3.0)), prims(jax.make_jaxpr(lin_b)(3.0))
    assert pa == pb and pb["sin"] == 1 and pb["cos"] == 2  # the inner sin recomputed, two cosines


@pytest.mark.parametrize("opts", OPTS.values(), ids=OPTS)
def test_a_region_closing_over_an_outer_tracer(opts):
    def make(ck):
        def f(x):
            y = 2 * jnp.sin(x)
            return ck(lambda x: jnp.cos(x) * jnp.sin(y), **opts)(x)
        return f

    plain = lambda x: jnp.cos(x) * jnp.sin(2 * jnp.sin(x))  # noqa: E731
    (ya, la), (yb, lb) = jax.linearize(make(JAX_CK), 2.0), jax.linearize(make(remat.checkpoint), 2.0)
    close(ya, yb)
    close(la(3.0), lb(3.0))
    np.testing.assert_allclose(lb(3.0), jax.linearize(plain, 2.0)[1](3.0), rtol=1e-6)
    grads_agree(make(JAX_CK), make(remat.checkpoint), 2.0, order=2)


def test_a_region_under_jit_closing_over_a_jit_tracer():
    def make(ck):
        @jax.jit
        def f(x):
            y = 2 * x
            return ck(lambda: y)()
        return f
    close(make(JAX_CK)(3.0), make(remat.checkpoint)(3.0))

    def outer(ck):
        @jax.jit
        def f(x):
            y = jnp.sin(x) * 3
            return ck(lambda z: jnp.sin(z * y))(x)
        return f
    grads_agree(outer(JAX_CK), outer(remat.checkpoint), 0.7, order=2)


@pytest.mark.parametrize("opts", OPTS.values(), ids=OPTS)
def test_jit_grad_and_grad_of_jit(opts):
    fa, fb = both(two_sines, **opts)
    close(jax.jit(fa)(2.0), jax.jit(fb)(2.0))
    close(jax.grad(jax.jit(fa))(2.0), jax.grad(jax.jit(fb))(2.0))
    close(jax.jit(jax.grad(fa))(2.0), jax.jit(jax.grad(fb))(2.0))
    np.testing.assert_allclose(jax.grad(fb)(2.0), np.cos(np.sin(2.0)) * np.cos(2.0), rtol=1e-6)


@pytest.mark.parametrize("opts", OPTS.values(), ids=OPTS)
def test_vmap_jacfwd_jacrev_and_a_non_leading_batch_axis(opts):
    fa, fb = both(two_sines, **opts)
    x = jnp.arange(3.0)
    close(jax.vmap(fa)(x), jax.vmap(fb)(x))
    close(jax.jacfwd(fa)(x), jax.jacfwd(fb)(x))
    close(jax.jacrev(fa)(x), jax.jacrev(fb)(x))
    xs = jnp.arange(15.0).reshape(3, 5)
    close(jax.vmap(fa, 1, 0)(xs), jax.vmap(fb, 1, 0)(xs))
    np.testing.assert_allclose(jax.vmap(fb, 1, 0)(xs), np.sin(np.sin(np.asarray(xs))).T, rtol=1e-6)
    grads_agree(jax.vmap(fa, 1, 0), jax.vmap(fb, 1, 0), xs)


# 3. Higher order, nesting, symbolic zeros --------------------------------------------------------

@pytest.mark.parametrize("opts", OPTS.values(), ids=OPTS)
def test_higher_order_derivatives(opts):
    f = lambda x: lax.cos(lax.sin(x))  # noqa: E731
    fa, fb = both(f, **opts)
    grads_agree(f, fb, 3.0, order=2)  # the plain function's derivatives
    grads_agree(fa, fb, 3.0, order=3)
    v = jnp.array([0.3, 0.9])
    close(*jax.jit(lambda v: (jax.hessian(fa)(v), jax.hessian(fb)(v)))(v))


def test_nested_binomial_regions():
    def binom(ck, funs):
        if len(funs) == 1:
            return funs[0]
        f1, f2 = binom(ck, funs[:len(funs) // 2]), binom(ck, funs[len(funs) // 2:])
        return ck(lambda x: f1(f2(x)))

    fa, fb = binom(JAX_CK, [jnp.sin] * 4), binom(remat.checkpoint, [jnp.sin] * 4)
    grads_agree(fa, fb, 4.0, order=2)
    close(fb(4.0), jnp.sin(jnp.sin(jnp.sin(jnp.sin(4.0)))))
    same_programs(fa, fb, 4.0)


def test_unused_outputs_and_constant_outputs_symbolic_zeros():
    def make(ck):
        def func(d0):
            r0 = jnp.linspace(0.0, 5.0, 15).reshape(5, 3)
            move = ck(lambda r, i: (r + 0.001 * d0 * r, jnp.array([0.0])))
            r, _ = lax.scan(move, r0, jnp.arange(2))
            return r[0, 1]
        return func
    grads_agree(make(JAX_CK), make(remat.checkpoint), 5.0)

    def g(x):
        y, unused = JAX_CK(lambda x: (jnp.sin(x), jnp.cos(x)))(x)
        return y

    def h(x):
        y, unused = remat.checkpoint(lambda x: (jnp.sin(x), jnp.cos(x)))(x)
        return y
    grads_agree(g, h, 0.4, order=2)


# 4. Control flow: scan, while_loop, cond ---------------------------------------------------------

def test_region_as_scan_body_and_scan_inside_a_region():
    step = lambda c, x: (jnp.sin(c) * x, jnp.cos(c))  # noqa: E731
    xs = jnp.linspace(0.5, 1.5, 3)

    def body(ck):
        return lambda c: lax.scan(ck(step), c, xs)[0]

    def outer(ck):
        return ck(lambda c: lax.scan(step, c, xs)[0])

    for make in (body, outer):
        fa, fb = make(JAX_CK), make(remat.checkpoint)
        grads_agree(fa, fb, 0.8, order=2)
        same_programs(fa, fb, 0.8)
    assert lin_prims(body(remat.checkpoint), 0.8)["cos"] >= 1
    two = lambda x: lax.scan(lambda c, _: (c + 1, None), x, None, length=1)[0]  # noqa: E731
    grads_agree(lambda x: JAX_CK(lambda x, _: (two(x), None))(x, None)[0],
                lambda x: remat.checkpoint(lambda x, _: (two(x), None))(x, None)[0], 1.0)


@pytest.mark.parametrize("policy", [None, SAVE_COS, cp.everything_saveable], ids=["none", "save_cos", "everything"])
def test_scan_inside_a_region_with_a_policy(policy):
    f = lambda x: lax.scan(lambda c, _: (jnp.sin(c), jnp.sin(c)), x, None, length=3)  # noqa: E731
    fa, fb = both(f, policy=policy)
    grads_agree(lambda x: fa(x)[1], lambda x: fb(x)[1], 3.0, order=2)
    assert lin_prims(fa, 4.0) == lin_prims(fb, 4.0)
    assert residuals(fa, 4.0) == residuals(fb, 4.0)


def test_while_loop_inside_a_region_forward_mode():
    def f(x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, x))[1]

    for policy in (None, SAVE_COS):
        fa, fb = both(f, policy=policy)
        (ya, la), (yb, lb) = jax.linearize(fa, 3.0), jax.linearize(fb, 3.0)
        close(ya, yb)
        close(la(1.0), lb(1.0))
        np.testing.assert_allclose(lb(1.0), jax.grad(lambda x: jnp.sin(jnp.sin(jnp.sin(x))))(3.0), rtol=1e-6)
        pa, pb = lin_prims(fa, 4.0), lin_prims(fb, 4.0)
        assert pa == pb and pb["sin"] >= 1 and pb["cos"] >= 1  # a while loop keeps no residuals


def test_cond_inside_a_region():
    both_sin = lambda x: lax.cond(x > 0.0, lambda c: (jnp.sin(c), jnp.sin(c)),  # noqa: E731
                                  lambda c: (jnp.sin(c), jnp.sin(c)), x)
    one_branch = lambda x: lax.cond(x > 0.0, lambda c: jnp.sin(jnp.sin(c)), lambda c: c, x)  # noqa: E731
    for f, arg in ((lambda x: both_sin(x)[0], 3.0), (one_branch, 3.0), (one_branch, -2.0)):
        fa, fb = both(f)
        grads_agree(fa, fb, arg, order=2)
        same_programs(fa, fb, arg)
        assert residuals(fa, arg) == residuals(fb, arg)


@pytest.mark.parametrize("control", ["scan", "cond"])
def test_custom_jvp_with_a_constant_under_control_flow(control):
    @jax.custom_jvp
    def f(x):
        return x * jnp.arange(3.0)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (xdot,) = primals, tangents
        return f(x), xdot * jnp.arange(3.0)

    def g(x):
        if control == "scan":
            y = lax.scan(lambda c, _: (f(c), None), x, None, length=1)[0]
        else:
            y = lax.cond(x.sum() > 0, f, lambda x: x, x)
        return y.sum()

    fa, fb = both(g)
    grads_agree(fa, fb, jnp.arange(3.0))


# 5. Policies: the residuals kept and the primitives recomputed -----------------------------------

def _dots3(x):
    for _ in range(3):
        x = jnp.sin(jnp.dot(x, x, precision=lax.Precision.HIGHEST) * 1e-1)
    return x


def _einsum3(x):
    for _ in range(3):
        x = jnp.sin(jnp.einsum("...ij,...jk->...ik", x, x, precision=lax.Precision.HIGHEST) * 1e-1)
    return x


def _named(x):
    a = checkpoint_name(jnp.sin(x) * 2.0, "a")
    b = checkpoint_name(jnp.cos(a) @ a.T, "b")
    return jnp.tanh(b).sum() + checkpoint_name(jnp.exp(a), "c").sum()


OFFLOAD = cp.save_and_offload_only_these_names(names_which_can_be_saved=["b"], names_which_can_be_offloaded=["a"],
                                               offload_src="device", offload_dst="pinned_host")
POLICIES = {
    "nothing": (None, _dots3), "full": (cp.nothing_saveable, _dots3),
    "everything": (cp.everything_saveable, _dots3), "dots": (cp.dots_saveable, _dots3),
    "checkpoint_dots": (cp.checkpoint_dots, _dots3),
    "dots_no_batch": (cp.dots_with_no_batch_dims_saveable, _einsum3),
    "save_cos": (SAVE_COS, _named), "names_a": (cp.save_only_these_names("a"), _named),
    "names_but_b": (cp.save_any_names_but_these("b"), _named),
    "both": (cp.save_from_both_policies(cp.save_only_these_names("b"), cp.dots_saveable), _named),
    "offload_a": (OFFLOAD, _named),
}


@pytest.mark.parametrize("name", POLICIES)
def test_policy_keeps_the_same_residuals(name):
    policy, fn = POLICIES[name]
    shape = {_dots3: (3, 3), _einsum3: (3, 2, 2), _named: (3, 4)}[fn]
    x = jnp.linspace(0.1, 0.9, int(np.prod(shape))).reshape(shape)
    fa, fb = both(fn, policy=policy)
    assert residuals(fa, x) == residuals(fb, x)
    assert lin_prims(fa, x) == lin_prims(fb, x)
    assert str(jax.make_jaxpr(fa)(x)) == str(jax.make_jaxpr(fb)(x))
    grads_agree(fa, fb, x, jvp=False)
    if name == "offload_a":
        assert any(r[-1] for r in residuals(fb, x))  # the named value waits in host memory


def test_dot_policies_inside_and_outside_a_scan():
    w = jnp.linspace(-0.5, 0.5, 25).reshape(5, 5)

    def layer(W, x):
        for _ in range(3):
            x = jnp.sin(jnp.dot(x, W, precision=lax.Precision.HIGHEST))
        return x

    def inside(ck):
        def f(W):
            g = ck(lambda x: layer(W, x), policy=cp.checkpoint_dots)
            return lax.scan(lambda x, _: (g(x), None), jnp.ones(5), None, length=2)[0]
        return f

    def outside(ck):
        return ck(lambda W: lax.scan(lambda x, _: (layer(W, x), None), jnp.ones(5), None, length=2)[0],
                  policy=cp.checkpoint_dots)

    for make, sines in ((inside, 2), (outside, 3)):
        fa, fb = make(JAX_CK), make(remat.checkpoint)
        pa, pb = vjp_prims(fa, w), vjp_prims(fb, w)
        assert pa == pb and pb["sin"] == sines and pb["cos"] == 3 and pb["dot_general"] == 6
        grads_agree(jax.jit(fa), jax.jit(fb), w, jvp=False)


# Fast cover: test_cond_inside_a_region, test_policy_keeps_the_same_residuals[checkpoint_dots].
@pytest.mark.slow
def test_dot_policies_inside_and_outside_a_cond():
    def layer(x):
        for _ in range(3):
            x = jnp.sin(jnp.dot(x, x, precision=lax.Precision.HIGHEST) * 0.3)
        return x

    inside = lambda ck: lambda x: lax.cond(x.sum() > 0, ck(layer, policy=cp.checkpoint_dots), lambda x: x, x)  # noqa
    outside = lambda ck: ck(lambda x: lax.cond(x.sum() > 0, layer, lambda x: x, x), policy=cp.checkpoint_dots)  # noqa
    x = jnp.ones((2, 2)) * 0.5
    for make in (inside, outside):
        fa, fb = make(JAX_CK), make(remat.checkpoint)
        assert vjp_prims(fa, x) == vjp_prims(fb, x)
        assert residuals(fa, x) == residuals(fb, x)
        grads_agree(fa, fb, x, jvp=False)


def test_constants_made_inside_are_not_saved():
    cases = [(lambda x: jnp.einsum("ii->i", x), 0), (lambda x: jnp.zeros_like(x) * x, 0),
             (lambda x: jnp.zeros_like(x) * jnp.sin(x), 1)]
    for f, n in cases:
        fa, fb = both(f, policy=NEVER)
        assert len(residuals(fb, jnp.ones((2, 2)))) == n
        assert residuals(fa, jnp.ones((2, 2))) == residuals(fb, jnp.ones((2, 2)))


def test_names_allow_and_deny_lists_and_names_on_pytrees():
    def f(x):
        y = checkpoint_name(jnp.multiply(2.0, 2.0), "y")
        z = checkpoint_name(jnp.multiply(2.0, 2.0), "z")
        w = checkpoint_name(jnp.multiply(2.0, 2.0), "w")
        return (((x * y) * z) * w) * jnp.multiply(2.0, 2.0)

    for names, n in (((), 0), (("w",), 1), (("z", "w"), 2), (("y", "z", "w"), 3)):
        for policy, kept in ((cp.save_only_these_names(*names), n), (cp.save_any_names_but_these(*names), 3 - n)):
            fa, fb = both(f, policy=policy)
            assert len(residuals(fb, 1.0)) == kept
            assert residuals(fa, 1.0) == residuals(fb, 1.0)

    def g(x):
        x = checkpoint_name({"a": jnp.dot(x, x)}, "foo")["a"]
        return jnp.dot(x, x)

    fa, fb = both(g, policy=cp.save_only_these_names("foo"))
    rows = memory.saved_residuals(fb, jnp.ones((3, 3))).rows
    assert rows[1].kind == "named" and rows[1].name == "foo"
    assert residuals(fa, jnp.ones((3, 3))) == residuals(fb, jnp.ones((3, 3)))


def test_saving_everything_through_an_inner_jit_forwards_the_input():
    def f(x):
        y = jnp.ones(2, "float32")
        x = jax.jit(lambda: x * y)()
        return jax.jit(lambda: x * y)()

    fa, fb = both(f, policy=ALWAYS)
    assert len(residuals(fb, jnp.float32(3.0))) == 1
    assert residuals(fa, jnp.float32(3.0)) == residuals(fb, jnp.float32(3.0))


# 6. custom_jvp / custom_vjp inside, grad inside, inner jit ---------------------------------------

def _custom_jvp_chain():
    """Three layers of a custom_jvp sine, as (remat.checkpoint, jax.checkpoint) regions saving dots."""
    @jax.custom_jvp
    def sin(x):
        return jnp.sin(x)
    sin.defjvp(lambda p, t: (sin(p[0]), jnp.cos(p[0]) * t[0]))

    def f(x):
        for _ in range(3):
            x = sin(jnp.dot(x, x) * 1e-3)
        return x
    return both(f, policy=cp.checkpoint_dots)


def test_custom_jvp_inside_a_dots_policy_region_and_a_scan():
    fa, fb = _custom_jvp_chain()
    grads_agree(fa, fb, 3.0, order=2)

    @jax.custom_jvp
    def total(x):
        return jnp.sum(x, axis=0)
    total.defjvp(lambda p, t: (total(p[0]), total(t[0])))
    ta, tb = both(total, policy=cp.checkpoint_dots)
    grads_agree(ta, tb, jnp.ones(3), order=2)
    mapped = lambda g: lambda x: lax.scan(lambda _, r: (None, g(r)), None, x)[1]  # noqa: E731
    grads_agree(mapped(ta), mapped(tb), jnp.ones((2, 3)), order=2)


# Fast cover: test_custom_jvp_inside_a_dots_policy_region_and_a_scan, test_region_as_scan_body_and_scan_inside_a_region.
@pytest.mark.slow
def test_custom_jvp_region_as_a_scan_body():
    fa, fb = _custom_jvp_chain()
    scan = lambda g: lambda x: lax.scan(lambda c, _: (g(c), None), x, None, length=2)[0]  # noqa: E731
    grads_agree(scan(fa), scan(fb), 3.0, order=2)


def test_custom_vjp_inside_a_dots_policy_region():
    @jax.custom_vjp
    def sin(x):
        return jnp.sin(x)
    sin.defvjp(lambda x: (sin(x), x), lambda x, g: (jnp.cos(x) * g,))

    def f(x):
        for _ in range(3):
            x = sin(jax.named_call(lambda y: jnp.dot(x, jnp.dot(y, y)), name="dot")(x) * 1e-3)
        return x

    fa, fb = both(f, policy=cp.checkpoint_dots)
    grads_agree(fa, fb, 3.0, order=2, jvp=False)  # a custom_vjp has no forward mode
    scan = lambda g: lambda x: lax.scan(lambda c, _: (g(c), None), x, None, length=2)[0]  # noqa: E731
    grads_agree(scan(fa), scan(fb), 3.0, order=1, jvp=False)


def test_grad_and_duplicated_outputs_inside_a_region():
    fa, fb = both(lambda x: jax.grad(lambda x: (x, x)[0])(x), policy=cp.checkpoint_dots)
    grads_agree(fa, fb, 3.0)
    for opts in OPTS.values():
        fa, fb = both(lambda x: jax.jit(lambda: (x, x))()[1], **opts)
        grads_agree(fa, fb, 3.0)
    fa, fb = both(lambda x: jax.jit(lambda: 3.0)() * x)
    grads_agree(fa, fb, 3.0)


def test_inner_jits_and_einsums():
    def f(w, x):
        a = jnp.dot(x, w)
        return jnp.sum(jnp.einsum("btT,btd->btd", jnp.einsum("btd,bTd->btT", a, a), a))
    fa, fb = both(f, policy=NEVER)
    grads_agree(fa, fb, jnp.ones([1, 1]), jnp.ones([1, 1, 1]), argnums=(0, 1))

    mul = jax.jit(lambda a, b: a * b)
    fa, fb = both(lambda w, x: mul(mul(w, x), mul(w, x)))
    grads_agree(fa, fb, 1.5, 0.5, argnums=(0, 1))


def test_jit_that_forwards_inputs_to_outputs():
    @jax.jit
    def f(inputs):
        a, b, c = inputs[2], inputs[0], inputs[1]
        return [c, jnp.exp(a), jnp.sin(b)]

    fa, fb = both(f)
    x = [jnp.float32(0.5), jnp.float32(1.0), jnp.float32(2.0)]
    grads_agree(fa, fb, x)


# Fast cover: test_custom_vjp_inside_a_dots_policy_region, test_policy_keeps_the_same_residuals[everything].
@pytest.mark.slow
def test_bfloat16_through_custom_vjps_saving_everything_is_exact():
    @jax.custom_vjp
    def dot(x):
        return jnp.dot(x, x)
    dot.defvjp(lambda x: (dot(x), None), lambda _, g: (g,))

    @jax.custom_vjp
    def foo(x):
        return jnp.float32(1.0) * x.astype("float32")
    foo.defvjp(lambda x: (foo(x), x), lambda x, _: (jnp.float32(1.0) * x.astype("float32"),))

    eps = jnp.finfo(jnp.bfloat16).eps
    x = (jnp.bfloat16(1) + eps) * jnp.eye(2, dtype="bfloat16")
    for ck in (JAX_CK, remat.checkpoint):
        f = jax.jit(ck(lambda x: foo(dot(x)), policy=ALWAYS))
        y, vjp = jax.vjp(f, x)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(vjp(jnp.ones_like(y))[0]))


def test_named_call_and_named_scopes_give_one_rematted_computation():
    def g(x, y):
        with jax.named_scope("g"):
            return x @ y

    def f2(x, ws):
        for w in ws:
            x = jnp.tanh(g(x, w))
        return jnp.sum(x)

    x, ws = jnp.ones([8, 8]), [jnp.ones([8, 16]), jnp.ones([16, 8])]
    counts = []
    for ck in (JAX_CK, remat.checkpoint):
        f = ck(lambda x, ws: jax.named_call(jax.jit(f2), name="shard")(x, ws))
        vjp = jax.make_jaxpr(jax.vjp(functools.partial(f, x), ws)[1])(f(x, ws))
        counts.append(vjp.jaxpr.pretty_print(name_stack=True).count("rematted_computation"))
    assert counts == [1, 1]
    fa, fb = both(jax.named_call(jnp.sum, name="test"))
    assert fa(jnp.array([1.0])) == fb(jnp.array([1.0])) == jnp.sum(jnp.array([1.0]))


def test_linearized_scan_of_a_region_dces_to_one_scan():
    def make(ck):
        body = ck(lambda c, x: (jnp.tanh(c * x), jnp.tanh(c * x)))
        return lambda xs: lax.scan(body, jnp.array(1.0, "float32"), xs)

    xs = jnp.arange(10.0, dtype="float32")
    texts = [prims(jax.make_jaxpr(lambda v: jax.linearize(make(ck), v)[1](v))(xs))
             for ck in (JAX_CK, remat.checkpoint)]
    assert texts[0] == texts[1]


# 7. prevent_cse: the optimization barrier in the lowered program ---------------------------------

def _barriers(ck, **opts):
    g = ck(lambda x: (lax.sin(lax.sin(x)), 3.0), **opts)
    f = lambda x: g(x)[0]  # noqa: E731
    fwd = jax.jit(f).lower(2.0).as_text()
    bwd = jax.jit(jax.grad(f)).lower(2.0).as_text()
    return fwd.count("optimization_barrier"), bwd.count("optimization_barrier")


@pytest.mark.parametrize("opts", [{}, {"policy": NEVER}, {"prevent_cse": False}], ids=["default", "never", "no_cse"])
def test_prevent_cse_puts_a_barrier_only_in_the_backward(opts):
    ja, rb = _barriers(JAX_CK, **opts), _barriers(remat.checkpoint, **opts)
    assert ja == rb
    assert rb[0] == 0 and (rb[1] > 0) == opts.get("prevent_cse", True)


@pytest.mark.parametrize("prevent_cse", [(False, True), (False, False), ({"W": False, "x": True},)],
                         ids=["partial", "all_false", "pytree"])
def test_partial_prevent_cse(prevent_cse):
    def loss(ck):
        if len(prevent_cse) == 1:
            layer = ck(lambda d: d["x"] @ d["W"], prevent_cse=prevent_cse)
            step = lambda W, x: layer(dict(W=W, x=x))  # noqa: E731
        else:
            layer = ck(lambda W, x: x @ W + jnp.array([1.0, 2.0, 3.0]), prevent_cse=prevent_cse)
            step = layer

        def f(Ws, x):
            for W in Ws:
                x = step(W, x)
            return jnp.sum(x ** 2)
        return f

    Ws, x = [jnp.ones((3, 3)) * 0.5 for _ in range(2)], jnp.ones(3)
    ta = jax.jit(jax.grad(loss(JAX_CK), (0, 1))).lower(Ws, x).as_text()
    tb = jax.jit(jax.grad(loss(remat.checkpoint), (0, 1))).lower(Ws, x).as_text()
    barrier = r"optimization_barrier %[a-z0-9]+, %[a-z0-9]+ :"
    assert len(re.findall(barrier, ta)) == len(re.findall(barrier, tb))
    assert bool(re.search(barrier, tb)) == any(jax.tree.leaves(prevent_cse))
    grads_agree(loss(JAX_CK), loss(remat.checkpoint), Ws, x, argnums=(0, 1), jvp=False)


# 8. static_argnums, traces and lowerings ---------------------------------------------------------

@pytest.mark.parametrize("static", [False, True], ids=["plain", "static_argnums"])
def test_eager_calls_trace_once(static):
    counts = []
    for ck in (JAX_CK, remat.checkpoint):
        n = [0]

        def g(x, flag=True):
            n[0] += 1
            return (lax.sin(x) if flag else lax.cos(x)), 3.0
        f = ck(g, static_argnums=(1,)) if static else ck(g)
        for _ in range(5):
            (f(2.0, True) if static else f(2.0))[0].block_until_ready()
        counts.append(n[0])
    assert counts == [1, 1]


def test_static_argnums_select_python_control_flow():
    def g(x, mode, scale):
        return (jnp.sin(x) if mode == "sin" else jnp.cos(x)) * scale

    for argnums, modes in (((1,), ("sin", "cos")), (1, ("cos",)), ((-2,), ("sin",))):
        fa, fb = both(g, static_argnums=argnums)
        for mode in modes:
            ha = lambda x, s: fa(x, mode, s)  # noqa: E731
            hb = lambda x, s: fb(x, mode, s)  # noqa: E731
            same_programs(ha, hb, 0.3, 2.0)
            if argnums == (1,):
                grads_agree(ha, hb, 0.3, 2.0, order=2, argnums=(0, 1))
    fa, fb = both(lambda x, n: x ** n, static_argnums=(1,))
    close(jax.jit(jax.grad(lambda x: fa(x, 3)))(2.0), jax.jit(jax.grad(lambda x: fb(x, 3)))(2.0))


def test_bad_static_argnums_raise_as_jax_does():
    for argnums in ((5,), ["a"], 1.5):
        errs = []
        for ck in (JAX_CK, remat.checkpoint):
            try:
                ck(lambda x, y: x * y, static_argnums=argnums)(1.0, 2.0)
            except Exception as e:  # noqa: BLE001
                errs.append(type(e))
            else:
                errs.append(None)
        assert errs[0] is not None and errs[1] is not None and issubclass(errs[1], errs[0]), (argnums, errs)


def test_linearize_vjp_and_forward_lower_once():
    results = []
    for ck in (JAX_CK, remat.checkpoint):
        identity = ck(jax.jit(lambda x: 2 * x))
        _, f_lin = jax.linearize(identity, 1.0)
        f_lin(1.0)
        with count_lowerings() as lin:
            for _ in range(5):
                f_lin(1.0).block_until_ready()
        _, f_vjp = jax.vjp(identity, 1.0)
        f_vjp(1.0)
        with count_lowerings() as vjp:
            for _ in range(5):
                f_vjp(1.0)[0].block_until_ready()
        with count_lowerings() as fwd:
            for _ in range(5):
                jax.vjp(identity, 1.0)[0].block_until_ready()
        static = ck(lambda x, y: jax.jit(lambda x: 2 * x if y else x)(x), static_argnums=(1,))
        with count_lowerings() as st:
            for _ in range(5):
                static(1.0, True).block_until_ready()
        results.append((lin(), vjp(), fwd(), st()))
    assert results[0] == results[1]
    assert all(n <= 1 for n in results[1])


# 9. Tracer leaks, escaped tracers, concreteness errors, effects ----------------------------------

def test_no_tracer_leaks():
    for ck in (JAX_CK, remat.checkpoint):
        with jax.checking_leaks():
            jax.jit(lambda v: jax.vjp(ck(lambda x: jax.nn.relu(1.0 * x)), v)[0])(1.0)


def test_a_tracer_escaping_into_global_state_is_reported():
    for ck in (JAX_CK, remat.checkpoint):
        def f():
            seq = [jnp.zeros([])]

            def g():
                seq[0] += 1
                return seq[0]
            ck(g)()
            ck(lambda: g())()

        with pytest.raises(jax.errors.UnexpectedTracerError, match="global state"):
            jax.jit(f)()


@pytest.mark.parametrize("static", [False, True], ids=["plain", "static_argnums"])
def test_concreteness_error_points_at_user_code(static):
    def f(x, _=None):
        if x > 0:
            return x
        return jnp.sin(x)

    for ck in (JAX_CK, remat.checkpoint):
        g = ck(f, static_argnums=(1,)) if static else ck(f)
        with pytest.raises(jax.errors.TracerBoolConversionError) as info:
            g(3.0, 1.0)
        assert "x > 0" in "".join(traceback.format_exception(info.value))


def test_debug_callbacks_run_as_often_as_with_jax_checkpoint():
    counts = []
    for ck in (JAX_CK, remat.checkpoint):
        seen = []

        def f(x):
            jax.debug.callback(lambda v: seen.append(float(v)), x)
            return jnp.sin(jnp.sin(x))
        g = ck(f)
        jax.grad(g)(0.5)
        jax.jit(jax.grad(g))(0.5)
        jax.effects_barrier()
        counts.append(len(seen))
    assert counts[0] == counts[1] >= 2


def test_gradient_accumulates_into_a_ref():
    for ck in (JAX_CK, remat.checkpoint):
        f = ck(jnp.sin)
        param = jnp.array(2.0, dtype=jnp.float32)
        loss, vjp_fn = jax.vjp(f, param)
        ref = jax.ref.new_ref(jnp.zeros_like(param))
        vjp_fn.with_refs(ref)(jnp.array(1.0, dtype=param.dtype))
        np.testing.assert_allclose(loss, jnp.sin(param))
        np.testing.assert_allclose(jax.ref.get(ref), jnp.cos(param), rtol=1e-6)


# 10. The remat3 implementation (config `jax_remat3`) ---------------------------------------------

@pytest.fixture
def remat3():
    before = jax.config.jax_remat3
    jax.config.update("jax_remat3", True)
    try:
        yield
    finally:
        jax.config.update("jax_remat3", before)


def test_remat3_mode_agrees_with_jax_checkpoint(remat3):
    fa, fb = both(lambda x: jnp.sin(jnp.sin(x)) * x)
    grads_agree(fa, fb, 0.7, order=2)
    fa, fb = both(_named, policy=cp.save_only_these_names("a"))
    x = jnp.linspace(0.1, 0.9, 12).reshape(3, 4)
    grads_agree(fa, fb, x, jvp=False)
    # Argument rows are compared without their names: under remat3 `jax.checkpoint` returns a bare
    # functools.partial, whose arguments JAX describes as args[0], ...; remat.checkpoint's wrapper
    # keeps the function's signature (x).
    strip = lambda rows: [r if r[2] != "argument" else r[:3] + r[4:] for r in rows]  # noqa: E731
    assert strip(residuals(fa, x)) == strip(residuals(fb, x))
    with jax.checking_leaks():
        jax.jit(remat.checkpoint(lambda x: x + 1))(jnp.arange(3))
