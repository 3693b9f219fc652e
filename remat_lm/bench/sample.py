"""Generation speed: the KV-cached `remat_lm.models.sample.generate` against rerunning the full forward per token.

    python -m remat_lm.bench.sample [--tokens 300] [--rounds 3]

Rows: the tiny GPT-2 and LLaMA-3 presets (block 64: past it every token reruns the 64-token
window, see remat_lm/models/sample.py) and the tiny GPT-2 with block_size 512 (all tokens cached), greedy,
one sequence after an 8-token prompt. "no cache" is a jitted Flax forward on the last block_size
tokens (right-padded to a fixed shape, so it compiles once) and a host argmax per token, the way
nanoGPT samples. Both are timed interleaved after a warm-up; "first call" is the cached
generation's first call in this process, compilation included.
"""
from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from remat_lm.bench.common import interleaved_ms, median, cli
from remat_lm.models import family
from remat_lm.models.sample import generate
from remat_lm.argtypes import Parser, integer

ROWS = {"gpt2 tiny": ("gpt2", "tiny", {}), "llama3 tiny": ("llama3", "tiny", {}),
        "gpt2 tiny, block 512": ("gpt2", "tiny", dict(block_size=512))}
TARGET_S = 5.0  # the goal: a few hundred tokens of the tiny model "in seconds" on CPU, compilation included


def _no_cache(model, params, cfg, prompt, n):
    full = jax.jit(lambda p, idx: model.apply({"params": p}, idx)[0])
    T = cfg.block_size

    def run():
        seq = list(prompt)
        for _ in range(n):
            window = seq[-T:]
            padded = np.zeros((1, T), np.int32)
            padded[0, :len(window)] = window
            logits = np.asarray(full(params, jnp.asarray(padded)))[0, len(window) - 1, :cfg.vocab_size]
            seq.append(int(logits.argmax()))
        return seq
    return run


def main(argv=None) -> int:
    p = Parser(prog="python -m remat_lm.bench.sample", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=integer(1), default=300, help="tokens to generate (default: %(default)s)")
    p.add_argument("--rounds", type=integer(1), default=3, help="timed interleaved rounds (default: %(default)s)")
    a = p.parse_args(argv)
    prompt = list(range(1, 9))
    print(f"greedy generation of {a.tokens} tokens after an {len(prompt)}-token prompt, batch 1, "
          f"{jax.devices()[0].platform}")
    print(f"| model | first call (compile + run) | KV cache | no cache | no cache / KV cache |\n|---|---|---|---|---|")
    worst = 0.0
    for name, (model, preset, over) in ROWS.items():
        fam = family.get(model)
        cfg = fam.config(preset, **over)
        params = fam.init_params(cfg, jax.random.PRNGKey(0))
        cached = lambda: generate(params, cfg, [prompt], a.tokens)
        t0 = time.perf_counter()
        out = cached()
        first = time.perf_counter() - t0
        naive = _no_cache(fam.model_cls(cfg), params, cfg, prompt, a.tokens)
        assert list(out[0]) == naive(), f"{name}: the cached and uncached greedy tokens differ"
        ms = interleaved_ms({"cache": cached, "naive": naive}, n=a.rounds)
        c, n = median(ms["cache"]), median(ms["naive"])
        worst = max(worst, first)
        print(f"| {name} | {first:.2f} s | {c:.0f} ms | {n:.0f} ms | {n / c:.1f}x |")
    met = worst <= TARGET_S
    print(f"\n- target: {a.tokens} tokens of a tiny model within {TARGET_S:g} s on CPU, compilation included: "
          f"slowest first call {worst:.2f} s → **{'met' if met else 'missed'}**")
    return 0


if __name__ == "__main__":
    sys.exit(cli(main, "sample"))
