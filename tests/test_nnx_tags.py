"""remat.nnx.tag_submodules: an NNX model that tags nothing gets its layers' submodule outputs tagged
by module path, name-based policies keep them, gradients are unchanged, and the classes come back."""
import jax
import jax.numpy as jnp
from flax import nnx

import remat
from remat.memory import saved_residuals
from remat.nnx import tag_submodules
from remat.policies import region_tags

C, L = 16, 3


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.c_fc = nnx.Linear(C, 4 * C, rngs=rngs)
        self.c_proj = nnx.Linear(4 * C, C, rngs=rngs)

    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x)))


class Block(nnx.Module):   # written with no checkpoint_name, as most NNX models are
    def __init__(self, rngs):
        self.ln = nnx.LayerNorm(C, rngs=rngs)
        self.mlp = Mlp(rngs)

    def __call__(self, x):
        return x + self.mlp(self.ln(x))


class Model(nnx.Module):
    def __init__(self, policy, rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(L)])
        self.policy = policy

    def __call__(self, x):
        for b in self.blocks:
            x = remat.nnx.remat(lambda b, x: b(x), policy=self.policy)(b, x) if self.policy else b(x)
        return jnp.sum(x ** 2)


def _grads(model, x):
    return nnx.grad(lambda m: m(x))(model)


def test_submodule_outputs_are_tagged_by_path_inside_the_context_only():
    model, x = Model("save_names:mlp.c_fc", nnx.Rngs(0)), jnp.ones((4, C))
    with tag_submodules(*model.blocks):
        tags = region_tags(lambda x: model.blocks[0](x), x)
        assert {"ln", "mlp", "mlp.c_fc", "mlp.c_proj"} <= set(tags)
        graphdef, state = nnx.split(model)
        saved = saved_residuals(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
        grads = _grads(model, x)
    assert type(model.blocks[0].mlp.c_fc) is nnx.Linear and type(model.blocks[0].mlp) is Mlp
    assert region_tags(lambda x: model.blocks[0](x), x) == set()
    # the policy keeps what it names: the c_fc outputs, one per layer
    assert saved.by_name().get("mlp.c_fc", (0, 0))[0] == L, saved.by_name()
    ref = _grads(Model(None, nnx.Rngs(0)), x)
    g, r = jax.tree.leaves(nnx.state(grads)), jax.tree.leaves(nnx.state(ref))
    scale = max(float(jnp.max(jnp.abs(a))) for a in r)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g, r)) <= 1e-5 * scale
