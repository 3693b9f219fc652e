"""A small GPT in plain JAX (parameters are a pytree of arrays, layers are functions), adopting remat.

Written the way Equinox/plain-JAX GPTs are (a block is a pure function of its weights and x; the
model loops over the layers). Adopting the library is the lines marked `# remat:`: each block call
goes through `remat.checkpoint` (`jax.checkpoint` with a registry policy), and the MLP activation
is tagged so that `save_names:mlp_act` can keep it. `remat=None` is the original;
`"jax.checkpoint"` is the plain JAX baseline of the same setting.

    python -m examples.jax_gpt     # saved bytes, compiled temp on XLA:GPU (h200) and on XLA:CPU
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import remat  # remat:

VOCAB, WIDTH, HEADS, LAYERS, MAX_LEN = 64, 64, 4, 4, 64


def init(key):
    def dense(k, m, n):
        return jax.random.normal(k, (m, n)) * m ** -0.5
    keys = iter(jax.random.split(key, 4 * LAYERS + 2))
    block = lambda: {"ln1": jnp.ones(WIDTH), "ln2": jnp.ones(WIDTH),  # noqa: E731
                     "attn": dense(next(keys), WIDTH, 3 * WIDTH), "proj": dense(next(keys), WIDTH, WIDTH),
                     "fc": dense(next(keys), WIDTH, 4 * WIDTH), "out": dense(next(keys), 4 * WIDTH, WIDTH)}
    return {"wte": dense(next(keys), VOCAB, WIDTH) * 0.1, "wpe": dense(next(keys), MAX_LEN, WIDTH) * 0.1,
            "blocks": [block() for _ in range(LAYERS)], "lnf": jnp.ones(WIDTH)}


def layer_norm(x, scale):
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale


def block(p, x):  # x: (B, T, C)
    B, T, C = x.shape
    q, k, v = jnp.split(layer_norm(x, p["ln1"]) @ p["attn"], 3, axis=-1)
    q, k, v = (t.reshape(B, T, HEADS, C // HEADS) for t in (q, k, v))
    att = jnp.einsum("bthd,bshd->bhts", q, k) / (C // HEADS) ** 0.5
    att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -jnp.inf), axis=-1)
    x = x + jnp.einsum("bhts,bshd->bthd", att, v).reshape(B, T, C) @ p["proj"]
    h = checkpoint_name(jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["fc"]), "mlp_act")  # remat: tag
    return x + h @ p["out"]


def forward(params, tokens, remat_policy=None):
    x = params["wte"][tokens] + params["wpe"][:tokens.shape[1]]
    for p in params["blocks"]:
        if remat_policy is None:
            x = block(p, x)
        elif remat_policy == "jax.checkpoint":
            x = jax.checkpoint(block)(p, x)
        else:
            x = remat.checkpoint(block, policy=remat_policy)(p, x)  # remat: the one change
    return layer_norm(x, params["lnf"]) @ params["wte"].T


def loss_fn(params, tokens, remat_policy=None):
    logp = jax.nn.log_softmax(forward(params, tokens[:, :-1], remat_policy))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def sample(params, prompt, steps):
    """Greedy sampling (the whole prefix each step)."""
    out = prompt
    for _ in range(steps):
        out = jnp.concatenate([out, jnp.argmax(forward(params, out)[:, -1], -1)[:, None]], axis=1)
    return out


TARGET = "h200"  # the first temp column: XLA:GPU for it, no GPU needed (pip install 'remat[targets]')
SETTINGS = {"original": None, "jax.checkpoint": "jax.checkpoint", "remat.checkpoint": "full",
            "remat.checkpoint save_names:mlp_act": "save_names:mlp_act"}


def measure(batch=2, seq=33, labels=None, target=TARGET):
    """{setting: (grads, saved bytes, `target`'s temp, XLA:CPU temp)} of `jax.grad(loss)`, tiny float32 shapes."""
    from remat.memory import compiled_memory, compiled_stats, saved_residuals
    key = jax.random.key(0)
    params, tokens = init(key), jax.random.randint(key, (batch, seq), 0, VOCAB)
    out = {}
    for label, pol in SETTINGS.items():
        if labels is not None and label not in labels:
            continue
        loss = functools.partial(loss_fn, tokens=tokens, remat_policy=pol)
        grad = jax.jit(jax.grad(loss)).lower(params).compile()  # this host: the gradient and its temp
        out[label] = (grad(params), saved_residuals(loss, params).intermediates,
                      compiled_memory(jax.grad(loss), params, target=target).temp, compiled_stats(grad).temp)
    return out


if __name__ == "__main__":
    gpu = f"temp {remat.planning.targets.get(TARGET).compiler} ({TARGET})"
    print(f"{'setting':<36} {'saved':>10} {gpu:>22} {'temp XLA:CPU (this host)':>26}")
    for label, (_, saved, gpu_temp, cpu_temp) in measure().items():
        print(f"{label:<36} {saved / 2**20:6.2f} MiB {gpu_temp / 2**20:18.2f} MiB {cpu_temp / 2**20:22.2f} MiB")
