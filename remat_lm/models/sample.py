"""Text generation for GPT-2 and LLaMA-3 through the models' own decode path and a KV cache.

`generate` continues prompts greedily or by sampling (temperature, top-k, seed); `decoder_for` and
`render` turn the ids into text. The command line (`python -m remat_lm.sample`) and loading a
train.py run directory live in the application layer, remat_lm/sample.py.

The forward is the Flax model's (`GPT2`/`Llama3` called with `decode_pos` and a `cache`
collection, remat_lm/models/layers.py CausalSelfAttention._decode): each attention layer keeps
the keys and values of positions 0..T_max-1 (B, T_max, K, D) and attends over them with
`remat_lm.models.attention.cached_attention`, a plain masked attention whatever the model's
`attention` core (tests/test_sample.py checks the logits against the full forward at every
position). Parameters in either layout (`blocks/h_0..` or a stacked `blocks/h`) decode; the
decode runs the loop layout (a scanned stack cannot write a cache back per layer).

# NOTE: context longer than block_size. The model sees at most its last `block_size` tokens, as
# in nanoGPT's and llm.c's generation (they crop the sequence and rerun the model). A prompt
# longer than block_size is cropped to its last block_size tokens (the output still starts with
# the whole prompt); up to position block_size each token is one cached step; past it, every new
# token reruns the model on the last block_size tokens (its positions shift, so GPT-2's learned
# position embeddings make the cached keys stale). Greedy output is therefore exactly "argmax of
# the full forward on the cropped sequence, repeated" at any length, and past the context each
# token costs a block_size-token forward.

Example:
    >>> tokens = generate(params, cfg, [list(b"def ")], 8, temperature=0.8, top_k=20, seed=0)
    >>> tokens.shape   # the prompt, then 8 new tokens
    (1, 12)
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from remat import RecomputeConfig
from remat.linen import stack_layers, unstack_layers
from remat_lm.models import family
from remat_lm.models.tokenizer import ByteTokenizer
from remat_lm.models.tokenizer import load as load_tokenizer


def _decode_config(config):
    """The config the decode runs: no recompute or dropout, loop layout, no sharding constraints
    (settings that do not change the forward, reset so they share one compilation)."""
    return dataclasses.replace(config, recompute=RecomputeConfig(), dropout=0.0, scan_layers=False, sharding=None)


def _loop_params(params):
    """The parameters in the loop layout (`blocks/h_0..`); a stacked `blocks/h` is sliced per layer."""
    if "h" not in params["blocks"]:
        return params
    return {**params, "blocks": stack_layers(unstack_layers(params["blocks"]))}


def init_cache(config, batch: int, max_len: int):
    """An empty key/value cache (the model's `cache` collection) for `batch` sequences of up to
    `max_len` (<= block_size) positions: per layer `k`, `v` (B, T_max, K, D) in the compute dtype.

    Example:
      >>> cache = init_cache(cfg, 1, cfg.block_size)
      >>> cache["blocks"]["h_0"]["attn"]["k"].shape  # (B, T_max, K, D)
      (1, 64, 4, 8)
    """
    cfg = _decode_config(config)
    model = family.of(cfg).model_cls(cfg)
    idx = jnp.zeros((batch, max_len), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), idx, decode_pos=0))["cache"]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def forward(params, config, tokens, cache, pos):
    """Logits of `tokens` at positions pos..pos+S-1, given the cache of positions < pos.

    The model's own forward (`GPT2/Llama3.apply` with `decode_pos=pos`), which also writes the
    tokens' keys and values into the cache.
    Args:
      params: the model's parameters (loop or scan layout).
      config: GPT2Config or Llama3Config.
      tokens: (B, S) int; cache: from `init_cache`, T_max >= pos + S; pos: int (may be traced).
    Returns:
      (logits (B, S, Vp) float32, the updated cache).
    Example:
      >>> step = jax.jit(forward, static_argnums=1)
      >>> logits, cache = step(params, cfg, prompt, init_cache(cfg, 1, 64), 0)   # prompt: (1, 4)
      >>> logits.shape   # tests/test_sample.py checks them against the model's at every position
      (1, 4, 256)
    """
    S, T_max = tokens.shape[1], jax.tree.leaves(cache)[0].shape[1]
    if isinstance(pos, (int, np.integer)) and not 0 <= pos <= T_max - S:
        raise ValueError(f"positions {pos}..{pos + S - 1} do not fit the cache of {T_max} positions; "
                         f"make it longer (init_cache max_len <= block_size {config.block_size})")
    cfg = _decode_config(config)
    (logits, _), new = family.of(cfg).model_cls(cfg).apply({"params": _loop_params(params), "cache": cache}, tokens,
                                                       decode_pos=pos, mutable=["cache"])
    return logits, new["cache"]


def _pick(logits, key, vocab: int, temperature: float, top_k: int | None):
    """The next token per row of logits (B, Vp); padded columns >= vocab are never chosen."""
    logits = logits[:, :vocab]
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None and top_k < vocab:
        vals, idx = lax.top_k(logits, top_k)  # (B, k): draw among exactly these k ids
        choice = jax.random.categorical(key, vals, axis=-1)
        return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "n_new", "temperature", "top_k"))
def _generate(params, prompt, key, *, config, n_new: int, temperature: float, top_k: int | None):
    params = _loop_params(params)  # once, not per step
    B, P = prompt.shape
    T, total = config.block_size, P + n_new
    n_cached = min(n_new - 1, T - P)  # tokens P+1..P+n_cached come from one cached step each
    pick = lambda logits, j: _pick(logits, jax.random.fold_in(key, j), config.vocab_size, temperature, top_k)
    put = lambda out, tok, j: lax.dynamic_update_slice_in_dim(out, tok[:, None], j, axis=1)

    out = jnp.zeros((B, total), jnp.int32).at[:, :P].set(prompt)  # (B, P + n_new)
    logits, cache = forward(params, config, prompt, init_cache(config, B, P + n_cached), 0)
    out = put(out, pick(logits[:, -1], P), P)

    def cached_step(j, carry):  # token j from token j-1 at position j-1 and the cache
        out, cache = carry
        logits, cache = forward(params, config, lax.dynamic_slice_in_dim(out, j - 1, 1, axis=1), cache, j - 1)
        return put(out, pick(logits[:, -1], j), j), cache

    out, _ = lax.fori_loop(P + 1, P + 1 + n_cached, cached_step, (out, cache))

    def window_step(j, out):  # past the context: rerun the last T tokens
        logits, _ = forward(params, config, lax.dynamic_slice_in_dim(out, j - T, T, axis=1),
                            init_cache(config, B, T), 0)
        return put(out, pick(logits[:, -1], j), j)

    if total == P + 1 + n_cached:  # the whole generation fits the context
        return out
    return lax.fori_loop(P + 1 + n_cached, total, window_step, out)


SEED_MAX = 2**32 - 1  # jax.random.PRNGKey keeps 32 bits of a seed: larger ones repeat smaller ones
INT32_MAX = 2**31 - 1  # the positions of a sample (prompt + generated tokens) are int32 indices


def generate(params, config, prompt, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0) -> np.ndarray:
    """Continue `prompt` by `max_new_tokens` tokens: greedy, or sampled with temperature and top-k.

    Args:
      params, config: the model (GPT-2 or LLaMA-3, either layer layout).
      prompt: (B, P) token ids (a list of lists or an array), P >= 1; only the last block_size are
        seen (see the module NOTE).
      max_new_tokens: N >= 0.
      temperature: 0 picks the argmax; > 0 samples from softmax(logits / temperature).
      top_k: sample among the k most likely tokens only (needs temperature > 0).
      seed: the sampling seed, 0..SEED_MAX; the same seed gives the same tokens.
    Returns:
      (B, P + N) int32 NumPy array: the prompt followed by the generated tokens.
    Example:
      >>> out = generate(params, cfg, [list(b"def ")], 8, temperature=0.8, top_k=20, seed=0)
      >>> out.shape, bytes(out[0, :4].tolist())
      ((1, 12), b'def ')
    """
    prompt = np.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 1 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt must be a (batch, length >= 1) array of token ids, got shape {prompt.shape} "
                         f"of {prompt.dtype}; pass at least one token")
    if prompt.min() < 0 or prompt.max() >= config.vocab_size:
        raise ValueError(f"prompt token ids span [{prompt.min()}, {prompt.max()}] but the model's vocabulary is "
                         f"0..{config.vocab_size - 1}; encode the prompt with the model's tokenizer")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0: greedy)")
    if top_k is not None:
        if not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise ValueError(f"top_k={top_k!r} must be an integer >= 1 (or None for the whole vocabulary)")
        if temperature == 0.0:
            raise ValueError("top_k samples among the k most likely tokens; it needs temperature > 0 "
                             "(temperature 0 is greedy)")
        top_k = int(min(top_k, config.vocab_size))
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed={seed!r} must be an integer in 0..{SEED_MAX} (jax.random.PRNGKey keeps 32 bits)")
    if prompt.shape[1] + max_new_tokens > INT32_MAX:
        raise ValueError(f"a {prompt.shape[1]}-token prompt and max_new_tokens={max_new_tokens} give "
                         f"{prompt.shape[1] + max_new_tokens} positions, more than {INT32_MAX} (2**31 - 1: positions "
                         f"are int32 indices); generate fewer tokens")
    if max_new_tokens == 0:
        return prompt.astype(np.int32)
    T = config.block_size
    out = _generate(params, jnp.asarray(prompt[:, -T:], jnp.int32), jax.random.PRNGKey(seed),
                    config=_decode_config(config), n_new=int(max_new_tokens), temperature=temperature, top_k=top_k)
    unseen = prompt[:, :max(prompt.shape[1] - T, 0)].astype(np.int32)  # cropped off: printed, never seen
    return np.concatenate([unseen, np.asarray(out)], axis=1)


# ------------------------------------------------------------------------------------------------
# Ids to text


def decoder_for(vocab_size: int, tokenizer: str | None, what: str = "--tokenizer"):
    """The tokenizer that decodes a model's ids: llm.c's file if given, bytes for a vocabulary of
    at most 256, else None (ids are printed). Raises TokenizerError for a bad or too small file.

    Example:
      >>> decoder_for(256, None).decode([104, 105])
      'hi'
    """
    if tokenizer:
        tok = load_tokenizer(tokenizer)
        tok.check_vocab(vocab_size, what)
        return tok
    return ByteTokenizer() if vocab_size <= 256 else None


def render(ids, decoder) -> str:
    """Decoded text, or the ids as a comma list when there is no decoder."""
    return decoder.decode(ids) if decoder is not None else ",".join(str(int(i)) for i in np.asarray(ids))
