"""remat.nnx.LayerStack(scan=True) holds its layers stacked (one graphdef, each Variable with a
leading layer axis, built once) and scans that state in place: no per-call copy of the weights in
the program (no `concatenate`), compiled temp within a layer's slice and its gradient of the loop
layout's (XLA:CPU, XLA:GPU for an H200), gradients equal the loop layout's and no remat, layers
made under `nnx.vmap` accepted, parameter paths mapped both ways, len and indexing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from remat import RecomputeConfig
from remat.planning import targets
from remat.memory import compiled_memory, saved_residuals
from remat import nnx as rnnx
from targethelp import GPU, need
from tinyblocks import rel_err

C, L = 32, 4
X = jax.random.normal(jax.random.key(1), (8, C))
FULL = RecomputeConfig(granularity="full")


class Blk(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(C, 4 * C, rngs=rngs), nnx.Linear(4 * C, C, rngs=rngs)

    def __call__(self, x):
        return x + self.b(jax.nn.gelu(self.a(x)))


class Model(nnx.Module):
    def __init__(self, cfg=None, scan=False):
        blocks = [Blk(nnx.Rngs(i)) for i in range(L)]
        self.layers = nnx.List(blocks) if cfg is None else rnnx.LayerStack(blocks, cfg, scan=scan)
        self.cfg = cfg

    def __call__(self, x):
        if self.cfg is None:
            for b in self.layers:
                x = b(x)
            return x
        return self.layers(x)


def _grad_fn(model):
    graphdef, state = nnx.split(model)
    return (lambda s, x: jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x) ** 2))(s)), state


@pytest.mark.parametrize("target", ["cpu", pytest.param(GPU, id="h200")])
def test_scan_reads_the_stored_stack_in_place(target):
    if target == GPU:
        need("cuda")
    temps, texts = {}, {}
    for scan in (False, True):
        f, state = _grad_fn(Model(FULL, scan=scan))
        cm = compiled_memory(f, state, X, target=target)
        temps[scan], texts[scan] = cm.temp, targets.lower(f, state, X, target=target).as_text()
        if scan:
            # the stack's state is one (L, ...) array per Variable, stored so, not per call
            assert all(a.shape[0] == L for a in jax.tree.leaves(state))
            # slack: the scan reads one layer's weights and writes one layer's gradient per step,
            # each a buffer of one layer's bytes (the compiled arguments, less x, over L)
            slack = 2 * (cm.argument - X.nbytes) // L
    assert "concatenate" not in texts[True] and "concatenate" not in str(jax.make_jaxpr(f)(state, X))
    assert temps[True] <= temps[False] + slack, (temps, slack)


# (FULL is slow: its sibling uniform 2 stays fast, and test_outside_models.py's scan test covers FULL)
@pytest.mark.parametrize("cfg", [pytest.param(FULL, marks=pytest.mark.slow),
                                 RecomputeConfig(granularity="full", method="uniform", num_layers=2)])
def test_scan_gradients_equal_the_loop_and_no_remat_and_paths_map_both_ways(cfg):
    plain, loop, scanned = Model(), Model(cfg), Model(cfg, scan=True)
    nnx.update(loop, rnnx.stack_layers(nnx.state(plain)))
    nnx.update(scanned, rnnx.stack_layers(nnx.state(plain), scan=True))  # a checkpoint without the stack loads
    grad = lambda m: nnx.state(nnx.jit(nnx.grad(lambda m: jnp.sum(m(X) ** 2)))(m), nnx.Param)  # noqa: E731
    ref = grad(plain)
    g_loop = rnnx.unstack_layers(grad(loop))
    g_scan = rnnx.unstack_layers(grad(scanned), scan=True)
    assert jax.tree.structure(g_scan) == jax.tree.structure(ref)
    assert rel_err(g_scan, ref) <= 1e-5 and rel_err(g_scan, g_loop) <= 1e-5
    back = rnnx.unstack_layers(nnx.state(scanned), scan=True)  # and back: the round trip is exact
    assert jax.tree.structure(back) == jax.tree.structure(nnx.state(plain))
    assert rel_err(back, nnx.state(plain)) == 0.0


def test_layers_made_under_nnx_vmap_len_and_indexing():
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Blk(rngs)

    made = make(nnx.Rngs(0))  # NNX's own scan-over-layers layout
    stack = rnnx.LayerStack(made, FULL, scan=True)
    assert len(stack) == L and stack.layers is made
    layer = stack[2]  # a module merged from a slice of the stacked state: a copy
    np.testing.assert_array_equal(layer.a.kernel[...], made.a.kernel[...][2])
    assert len(list(stack)) == L and isinstance(layer, Blk)
    loop = rnnx.LayerStack([stack[i] for i in range(L)], FULL)
    g_scan = nnx.state(nnx.grad(lambda m: jnp.sum(m(X) ** 2))(stack), nnx.Param)
    g_loop = nnx.state(nnx.grad(lambda m: jnp.sum(m(X) ** 2))(loop), nnx.Param)
    g_scan = rnnx.unstack_layers({"s": g_scan}, stack="s", scan=True)["s"]
    assert rel_err(jax.tree.leaves(g_scan), jax.tree.leaves(g_loop["layers"])) <= 1e-5
    with pytest.raises(ValueError, match="scan=True"):
        rnnx.LayerStack(made, FULL)
    with pytest.raises(IndexError):
        stack[L]


@pytest.mark.parametrize("cfg", [FULL, RecomputeConfig(granularity="full", method="uniform", num_layers=2)])
def test_saved_report_under_scan_counts_activations_only(cfg):
    saved = {}
    for scan in (False, True):
        graphdef, state = nnx.split(Model(cfg, scan=scan))
        saved[scan] = saved_residuals(lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) ** 2), state, X)
    # the weights enter the scan reshaped per group of layers (uniform 2: (L/2, 2, ...)); those views
    # of the arguments are arguments, not saved activations
    kernels = {a.shape[1:] for a in jax.tree.leaves(state) if a.ndim == 3}
    assert any(r.name.startswith("reshape") for r in saved[True].rows) == (cfg.method == "uniform")
    assert not [r for r in saved[True].rows if r.kind != "argument" and tuple(r.shape[-2:]) in kernels]
    # the same activations as the loop layout; the scan's stacked layer inputs hold a copy of its
    # first input too, an argument (x) in the loop layout
    assert saved[True].intermediates == saved[False].intermediates + X.nbytes


def test_layer_maps_refuse_what_they_cannot_map():
    """The state maps between a layer list and a stack say what is wrong instead of renumbering
    layers, passing a state through unchanged, or failing inside jnp.stack."""
    w = lambda *s: nnx.Param(jnp.ones(s))  # noqa: E731
    gap = nnx.State({"layers": {0: {"w": w(2)}, 2: {"w": w(2)}}})
    with pytest.raises(ValueError, match=r"'layers' holds \[0, 2\], not a layer list 0 \.\.\. L-1"):
        rnnx.stack_layers(gap, scan=True)
    with pytest.raises(ValueError, match=r"the state has no 'blocks' entry"):
        rnnx.stack_layers(gap, stack="blocks")
    shapes = nnx.State({"layers": {0: {"w": w(2)}, 1: {"w": w(3)}}})
    with pytest.raises(ValueError, match=r"layer 1's \['w'\] has shape \(3,\), layer 0's \(2,\).*use scan=False"):
        rnnx.stack_layers(shapes, scan=True)
    with pytest.raises(ValueError, match=r"the state has no layers/layers"):
        rnnx.unstack_layers(gap)  # a layer list, not a stack


def test_linen_layer_maps_refuse_what_they_cannot_map():
    from remat import linen as rlinen
    with pytest.raises(ValueError, match=r"layer 1's \['w'\] has shape \(3,\), layer 0's \(2,\)"):
        rlinen.stack_layers([{"w": jnp.ones(2)}, {"w": jnp.ones(3)}], scan=True)
    with pytest.raises(ValueError, match=r"expected a LayerStack collection .* got keys \['block_0', 'block_1'\]"):
        rlinen.unstack_layers({"block_0": {}, "block_1": {}})
    with pytest.raises(ValueError, match=r"got keys \['h_0', 'h_2'\]"):
        rlinen.unstack_layers({"h_0": {}, "h_2": {}})
