"""The optimizer: optax AdamW with llm.c's warmup + cosine schedule, clipping and a decay mask.

Example:
    >>> tx, schedule = make_optimizer(cfg)
    >>> opt_state = tx.init(params)
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import optax

from training.model import decay_mask

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


def make_optimizer(cfg):
    """(optax transformation, schedule) for a TrainConfig: clip → AdamW(schedule, mask).

    Gradient accumulation is done by the train step (a scan over micro-batches), so one
    optimizer update is one training step.
    """
    schedule = make_schedule(cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters or cfg.num_iterations,
                             cfg.lr_decay)
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(schedule, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=cfg.weight_decay,
                             mask=decay_mask))
    return optax.chain(*parts), schedule
