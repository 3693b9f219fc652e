"""The jitted train and eval steps.

The train state is a plain dict pytree (what orbax saves):
  params     the model parameters (float32)
  opt_state  the optax state
  step       int32, optimizer steps done
  rng        uint32[2], the base PRNG key; step k's dropout key is fold_in(rng, k)

A step takes a batch of shape (accum, B, T): gradients of the `accum` micro-batches are averaged
by a `lax.scan` (one optimizer update per step, no optax.MultiSteps bookkeeping) and the metrics
are loss (mean over micro-batches), grad_norm (before clipping) and lr (the one applied).

Example:
    >>> train_step = make_train_step(fam, mcfg, tx, schedule, dropout=0.0)
    >>> state, metrics = jax.jit(train_step)(state, x, y)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax



def make_train_step(fam, mcfg, tx, schedule, dropout: float):
    """A pure `(state, x, y) -> (state, metrics)`; x and y are int32 (accum, B, T)."""
    use_dropout = dropout > 0

    def loss_and_grad(params, x, y, key):
        return jax.value_and_grad(fam.loss_fn)(params, mcfg, x, y, key if use_dropout else None)

    def train_step(state, x, y):
        params, step = state["params"], state["step"]
        step_key = jax.random.fold_in(state["rng"], step)
        accum = x.shape[0]
        if accum == 1:
            loss, grads = loss_and_grad(params, x[0], y[0], jax.random.fold_in(step_key, 0))
        else:
            def micro(carry, inp):
                i, xi, yi = inp
                loss_i, g_i = loss_and_grad(params, xi, yi, jax.random.fold_in(step_key, i))
                g_acc, l_acc = carry
                return (jax.tree.map(jnp.add, g_acc, g_i), l_acc + loss_i), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            (gsum, lsum), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)),
                                          (jnp.arange(accum), x, y))
            grads = jax.tree.map(lambda g: g / accum, gsum)
            loss = lsum / accum
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_state = {"params": new_params, "opt_state": opt_state, "step": step + 1, "rng": state["rng"]}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(step)}
        return new_state, metrics

    return train_step


def make_eval_step(fam, mcfg):
    """A pure `(params, x, y) -> loss` without dropout; x and y are int32 (B, T)."""
    def eval_step(params, x, y):
        return fam.loss_fn(params, mcfg, x, y, None)
    return eval_step


def init_state(fam, mcfg, tx, seed: int):
    """A fresh train state (call under jit with out_shardings to create it sharded)."""
    # NOTE: layout-independent init. `remat.linen.LayerStack` draws one key per layer from the same
    # stream in both layouts (h_i == h[i]), so every recompute and layout setting starts from the same
    # weights (and the same first loss).
    key = jax.random.PRNGKey(seed)
    init_key, rng = jax.random.split(key)
    params = fam.init_params(mcfg, init_key)
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32), "rng": rng}
