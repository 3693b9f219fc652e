"""Step times measured on this machine: programs timed round-robin (interleaved), with repeats
until each one's spread is known, and the noise floor two copies of one program show.

The planner measures where the target is the machine it runs on (`front(..., run_step=...)`);
the planner's bench uses the same functions to validate it. docs/planner.md states the statistics.

Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.ones((256, 256))
    >>> f = jax.jit(lambda a: a @ a)
    >>> t = time_programs({"a": lambda: f(x).block_until_ready(), "b": lambda: (x + 1).block_until_ready()},
    ...                   min_rounds=3, max_rounds=5)
    >>> sorted(t), t["a"].rounds >= 3
    (['a', 'b'], True)
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Mapping, Sequence

import numpy as np

__all__ = ["Timed", "interleaved", "noise_floor", "time_programs"]

NOTCH = 1.57   # a box plot's notch: median ± 1.57·IQR/√n is about a 95% interval of the median


@dataclasses.dataclass(frozen=True)
class Timed:
    """One program's measured step: `median_s`, `iqr_s` (interquartile range) over `rounds` timed runs."""
    median_s: float
    iqr_s: float
    rounds: int
    samples_s: tuple = dataclasses.field(default=(), repr=False)

    @property
    def notch_s(self) -> float:
        """Half-width of the median's ~95% interval: 1.57·IQR/√rounds."""
        return NOTCH * self.iqr_s / math.sqrt(max(self.rounds, 1))


def _timed(samples: Sequence[float]) -> Timed:
    q1, q2, q3 = np.percentile(np.asarray(samples, float), [25, 50, 75])
    return Timed(float(q2), float(q3 - q1), len(samples), tuple(float(s) for s in samples))


def interleaved(steps: Mapping[str, Callable[[], object]], n: int, warmup: int = 1,
                tick: Callable[[], object] | None = None) -> dict:
    """Time every callable `n` times, round-robin, after `warmup` untimed rounds.

    Each round runs every program once; the order rotates from round to round so that no program
    always runs right after the same neighbour. On a shared machine a background job slows
    whatever runs while it is active: interleaving spreads that over all programs instead of
    charging it to one. The callables must block until their work is done.

    Args:
      steps: {name: zero-argument callable doing one step}.
      n: timed rounds.
      warmup: untimed rounds first (compilation caches, allocator growth).
      tick: called after every step, warm-up included (a progress bar's update).
    Returns:
      {name: [seconds per timed step, in round order]}.
    Example:
      >>> s = interleaved({"a": step_a, "b": step_b}, n=5)
    """
    names = list(steps)
    tick = tick or (lambda: None)
    for _ in range(warmup):
        for k in names:
            steps[k]()
            tick()
    out = {k: [] for k in names}
    for r in range(n):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            t0 = time.perf_counter()
            steps[k]()
            out[k].append(time.perf_counter() - t0)
            tick()
    return out


def time_programs(steps: Mapping[str, Callable[[], object]], *, min_rounds: int = 5, max_rounds: int = 25,
                  rel: float = 0.02, max_seconds: float | None = None, warmup: int = 1,
                  tick: Callable[[], object] | None = None) -> dict:
    """Time programs interleaved until each median is known: rounds go on past `min_rounds` while
    some program's notch (1.57·IQR/√n) exceeds `rel` of its median, up to `max_rounds` or
    `max_seconds` of timing.

    Args:
      steps: {name: zero-argument callable doing one step, blocking}.
      min_rounds, max_rounds: timed rounds at least / at most.
      rel: the notch, relative to the median, at which a program's time counts as known.
      max_seconds: stop adding rounds after this much timing (None: no limit).
      warmup: untimed rounds first.
      tick: called after every step (a progress bar's update).
    Returns:
      {name: Timed}.
    Example: see the module docstring.
    """
    t0 = time.perf_counter()
    samples = interleaved(steps, min_rounds, warmup=warmup, tick=tick)
    names = list(steps)
    while True:
        timed = {k: _timed(samples[k]) for k in names}
        rounds = len(samples[names[0]]) if names else 0
        open_ = [k for k in names if timed[k].notch_s > rel * timed[k].median_s]
        if not open_ or rounds >= max_rounds or (max_seconds is not None and time.perf_counter() - t0 > max_seconds):
            return timed
        more = interleaved(steps, 1, warmup=0, tick=tick)
        for k in names:
            samples[k].extend(more[k])


def noise_floor(a: Timed, b: Timed) -> float:
    """The step-time difference two copies of one program show: the larger of their medians'
    difference and the notches' sum (the difference two medians must exceed to differ at ~95%)."""
    return max(abs(a.median_s - b.median_s), a.notch_s + b.notch_s)
