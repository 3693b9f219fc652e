"""The optimizer: optax AdamW with llm.c's warmup + cosine schedule, clipping and a decay mask.

Example:
    >>> tx, schedule = make_optimizer(*optimizer_settings(cfg))
    >>> opt_state = tx.init(params)
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import optax

from remat_lm.training.model import decay_mask

BETAS = (0.9, 0.95)
EPS = 1e-8


def make_schedule(peak: float, warmup: int, total: int, final_fraction: float):
    """llm.c's learning rate at optimizer update `count` (0-based).

    Linear warmup `peak·(count+1)/warmup` for `count < warmup`, then a cosine from `peak` down to
    `final_fraction·peak` at update `total`, and flat after it.

    Example:
      >>> make_schedule(1e-3, 10, 100, 0.1)(0)  # 1e-4
    """
    lo = peak * final_fraction

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = peak * (count + 1.0) / max(warmup, 1)
        ratio = jnp.clip((count - warmup) / max(total - warmup, 1), 0.0, 1.0)
        cos = lo + 0.5 * (1.0 + jnp.cos(math.pi * ratio)) * (peak - lo)
        return jnp.where(count < warmup, warm, cos)

    return schedule


def optimizer_settings(cfg) -> tuple:
    """The TrainConfig fields the optimizer depends on, as a hashable tuple (make_optimizer's args)."""
    return (cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters or cfg.num_iterations, cfg.lr_decay,
            cfg.weight_decay, cfg.grad_clip)


def make_optimizer(learning_rate: float, warmup_iters: int, decay_iters: int, lr_decay: float,
                   weight_decay: float, grad_clip: float):
    """(optax transformation, schedule): clip → AdamW(warmup+cosine schedule, decay mask).

    Gradient accumulation is done by the train step (a scan over micro-batches), so one
    optimizer update is one training step.

    Example:
      >>> tx, schedule = make_optimizer(*optimizer_settings(cfg))
    """
    schedule = make_schedule(learning_rate, warmup_iters, decay_iters, lr_decay)
    # NOTE: identity() stands in for a disabled clip so that the optimizer state has the same
    # structure whatever the flags: a checkpoint resumes under a changed --grad_clip.
    clip = optax.clip_by_global_norm(grad_clip) if grad_clip > 0 else optax.identity()
    adamw = optax.adamw(schedule, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=weight_decay, mask=decay_mask)
    return optax.chain(clip, adamw), schedule
