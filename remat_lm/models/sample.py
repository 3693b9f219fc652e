"""Text generation for GPT-2 and LLaMA-3 with a KV cache, and the `python -m remat_lm.models.sample` CLI.

    python -m remat_lm.models.sample runs/x --prompt "def main(" --sample_length 300     # a train.py run
    python -m remat_lm.models.sample gpt2_124M.bin --tokenizer gpt2_tokenizer.bin --prompt "Hello," \\
        --temperature 0.8 --top_k 40 --seed 1                                   # an llm.c model
    python -m remat_lm.models.sample gpt2_124M.bin --prompt_tokens 50256 --tokenizer gpt2_tokenizer.bin

CHECKPOINT is an orbax directory written by `train.py --checkpoint_dir` (its latest step, or
`--step N`) or an llm.c model `.bin` (GPT-2 or LLaMA-3). The generation (prompt included) goes to
stdout, one sample after another; a summary line goes to stderr. Byte-level models (vocabulary
256) decode bytes as UTF-8 text; larger vocabularies decode with llm.c's tokenizer file
(`--tokenizer`, remat_lm/models/tokenizer.py), or print token ids without one. Bad input exits 2 with one
line on stderr.

The decode is a pure-JAX forward over the model's parameter tree (either layout: `blocks/h_0..`
or a stacked `blocks/h`), built from the shared pieces of remat_lm/models/layers.py, that computes what
GPT2/Llama3.apply computes (tests/test_sample.py checks the logits at every position) while
reading and extending a fixed-size cache of keys and values (L, B, T_max, K, D).

# NOTE: context longer than block_size. The model sees at most its last `block_size` tokens, as
# in nanoGPT's and llm.c's generation (they crop the sequence and rerun the model). A prompt
# longer than block_size is cropped to its last block_size tokens (the output still starts with
# the whole prompt); up to position block_size each token is one cached step; past it, every new
# token reruns the model on the last block_size tokens (its positions shift, so GPT-2's learned
# position embeddings make the cached keys stale). Greedy output is therefore exactly "argmax of
# the full forward on the cropped sequence, repeated" at any length, and past the context each
# token costs a block_size-token forward.

Example:
    >>> config, params, info = load_model("model.bin")   # or a train.py --checkpoint_dir
    >>> tokens = generate(params, config, [list(b"def ")], 8, temperature=0.8, top_k=20, seed=0)
    >>> tokens.shape   # the prompt, then 8 new tokens
    (1, 12)
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from remat_lm.models import family
from remat_lm.models.layers import embed, gelu_tanh, layer_norm, rms_norm, rope_frequencies, swiglu
from remat_lm.models.tokenizer import ByteTokenizer
from remat_lm.models.tokenizer import load as load_tokenizer
from remat import RecomputeConfig
from remat_lm.argtypes import Parser, integer, parse_int, real

F32 = jnp.float32


class KVCache(NamedTuple):
    """Keys and values of every layer for positions 0..T_max-1 (entries past the filled ones are
    never read: the attention mask stops at the query's position)."""
    k: jax.Array  # (L, B, T_max, K, D)
    v: jax.Array  # (L, B, T_max, K, D)


def _is_gpt2(config) -> bool:
    return family.of(config).name == "gpt2"


def _heads(config) -> tuple[int, int, int]:
    """(H, K, D): query heads, key/value heads, head size."""
    kv = getattr(config, "n_kv_head", config.n_head)  # GPT-2: as many key/value heads as query heads
    return config.n_head, kv, config.n_embd // config.n_head


def init_cache(config, batch: int, max_len: int) -> KVCache:
    """An empty cache for `batch` sequences of up to `max_len` (<= block_size) positions.

    Example:
      >>> cache = init_cache(cfg, 1, cfg.block_size)
      >>> cache.k.shape  # (L, B, T_max, K, D)
      (2, 1, 64, 4, 8)
    """
    _, K, D = _heads(config)
    shape = (config.n_layer, batch, max_len, K, D)
    return KVCache(jnp.zeros(shape, config.compute_dtype), jnp.zeros(shape, config.compute_dtype))


def _stacked_layers(blocks, n_layer: int):
    """The LayerStack's parameters with a leading layer axis, for either layout.

    (remat_lm.models.layers.stack_layers does this in NumPy for one tensor; here it must trace under jit.)
    """
    if "h" in blocks:
        return blocks["h"]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *[blocks[f"h_{i}"] for i in range(n_layer)])


def _linear(x, p, dt, out_dtype=None):
    """remat_lm.models.layers.Linear on its parameters {w (out, in)[, b]}."""
    y = jnp.einsum("...i,oi->...o", x.astype(dt), p["w"].astype(dt), preferred_element_type=out_dtype)
    return y + p["b"].astype(y.dtype) if "b" in p else y


def _rope_tables(config, max_len: int):
    """cos, sin (max_len, D/2) of RoPE's angles, computed as remat_lm.models.layers.apply_rope computes them
    (NumPy float32), so cached and full forwards rotate by bit-identical factors."""
    D = config.n_embd // config.n_head
    angles = np.outer(np.arange(max_len, dtype=np.float32),
                      rope_frequencies(D, config.rope_theta, config.use_scaled_rope))  # (T, D/2)
    return np.cos(angles), np.sin(angles)


def _rotate(x, cos, sin):
    """RoPE over adjacent feature pairs (apply_rope's rotation) at the positions of cos/sin (S, D/2)."""
    B, S, n, D = x.shape
    xr = x.astype(F32).reshape(B, S, n, D // 2, 2)
    x0, x1 = xr[..., 0], xr[..., 1]
    c, s = cos[None, :, None], sin[None, :, None]  # (1, S, 1, D/2)
    return jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(x.shape).astype(x.dtype)


def _attend(q, k, v, positions):
    """Causal GQA attention of S new queries over the cache: query head h reads kv head h // G.

    Args:
      q: (B, S, H, D); k, v: (B, T_max, K, D); positions: (S,) the queries' positions.
    Returns:
      (B, S, H·D), float32 scores and softmax as in remat_lm.models.layers.causal_attention.
    """
    B, S, H, D = q.shape
    T, K = k.shape[1], k.shape[2]
    qg = q.reshape(B, S, K, H // K, D)
    s = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=F32) * (1.0 / math.sqrt(D))  # (B, K, G, S, T)
    visible = jnp.arange(T)[None, :] <= positions[:, None]  # (S, T)
    s = jnp.where(visible, s, -jnp.inf)
    p = jnp.exp(s - jax.nn.logsumexp(s, axis=-1, keepdims=True))
    y = jnp.einsum("bkgst,btkd->bskgd", p.astype(v.dtype), v)  # (B, S, K, G, D)
    return y.reshape(B, S, H * D)


def forward(params, config, tokens, cache: KVCache, pos):
    """Logits of `tokens` at positions pos..pos+S-1, given the cache of positions < pos.

    Computes what `GPT2(config).apply` / `Llama3(config).apply` compute for those positions, and
    writes the tokens' keys and values into the cache.
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
    gpt, dt = _is_gpt2(config), config.compute_dtype
    B, S = tokens.shape
    if isinstance(pos, (int, np.integer)) and not 0 <= pos <= cache.k.shape[2] - S:
        raise ValueError(f"positions {pos}..{pos + S - 1} do not fit the cache of {cache.k.shape[2]} positions; "
                         f"make it longer (init_cache max_len <= block_size {config.block_size})")
    H, K, D = _heads(config)
    positions = pos + jnp.arange(S)  # (S,)
    x = embed(params["wte"], tokens)  # (B, S, C)
    if gpt:
        x = x + lax.dynamic_slice_in_dim(params["wpe"], pos, S, axis=0)
        norm = lambda h, p: layer_norm(h, p["w"], p["b"]).astype(dt)
    else:
        cos, sin = (lax.dynamic_slice_in_dim(jnp.asarray(t), pos, S, axis=0)
                    for t in _rope_tables(config, cache.k.shape[2]))  # (S, D/2)
        norm = lambda h, p: rms_norm(h, p["w"], config.norm_eps).astype(dt)
    x = x.astype(dt)
    layers = _stacked_layers(params["blocks"], config.n_layer)
    ck, cv = cache
    for i in range(config.n_layer):
        p = jax.tree.map(lambda a: a[i], layers)
        h = norm(x, p["ln_1"])
        qkv = _linear(h, p["attn"]["c_attn"], dt)  # (B, S, (H+2K)·D)
        q, k, v = jnp.split(qkv, [H * D, (H + K) * D], axis=-1)
        q, k, v = q.reshape(B, S, H, D), k.reshape(B, S, K, D), v.reshape(B, S, K, D)
        if not gpt:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        ck = lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), (i, 0, pos, 0, 0))
        cv = lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), (i, 0, pos, 0, 0))
        y = _attend(q, ck[i], cv[i], positions)  # (B, S, C)
        x = x + _linear(y, p["attn"]["c_proj"], dt)
        h, m = norm(x, p["ln_2"]), p["mlp"]
        if gpt:
            x = x + _linear(gelu_tanh(_linear(h, m["c_fc"], dt)), m["c_proj"], dt)
        else:
            x = x + _linear(swiglu(_linear(h, m["c_fc2"], dt), _linear(h, m["c_fc"], dt)), m["c_proj"], dt)
    x = norm(x, params["ln_f"])  # (B, S, C)
    if gpt:
        logits = jnp.einsum("bsc,vc->bsv", x, params["wte"].astype(dt), preferred_element_type=F32)  # (B, S, Vp)
    else:
        logits = _linear(x, params["lm_head"], dt, F32)  # (B, S, V)
    return logits, KVCache(ck, cv)


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


def _decode_config(config):
    """The config with the settings that do not change the forward reset (one compilation)."""
    return dataclasses.replace(config, recompute=RecomputeConfig(), dropout=0.0)


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
      seed: the sampling seed; the same seed gives the same tokens.
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
    if max_new_tokens == 0:
        return prompt.astype(np.int32)
    T = config.block_size
    out = _generate(params, jnp.asarray(prompt[:, -T:], jnp.int32), jax.random.PRNGKey(seed),
                    config=_decode_config(config), n_new=int(max_new_tokens), temperature=temperature, top_k=top_k)
    unseen = prompt[:, :max(prompt.shape[1] - T, 0)].astype(np.int32)  # cropped off: printed, never seen
    return np.concatenate([unseen, np.asarray(out)], axis=1)


# ------------------------------------------------------------------------------------------------
# Loading a model and the CLI


def load_model(path: str, step: int | None = None, **llmc_overrides):
    """(config, params, info) from a train.py checkpoint directory or an llm.c model file.

    `info` is a dict: kind ("orbax"/"llm.c"), model ("gpt2"/"llama3"), step, and the run's
    train config for a directory. `llmc_overrides` (norm_eps, rope_theta, ffn_dim_multiplier) go
    to `remat_lm.models.llmc.load` for LLaMA-3 files whose float header slots llm.c wrote truncated.
    Raises ValueError (one line) for anything unusable.
    Example:
      >>> config, params, info = load_model("model.bin")
      >>> info["kind"], info["model"]
      ('llm.c', 'gpt2')
    """
    from remat_lm.models import llmc
    from remat_lm.training import saving

    if os.path.isdir(path):
        info = saving.inspect_dir(path, "CHECKPOINT")
        if info.step is None:
            raise ValueError(f"{path}: the directory holds no complete checkpoint; pass a train.py "
                             f"--checkpoint_dir or an llm.c model .bin")
        if step is not None and step not in info.steps:
            raise ValueError(f"{path}: no step {step}; it holds steps {', '.join(map(str, sorted(info.steps)))}")
        step = info.step if step is None else step
        meta = info.meta  # the model config is the same at every step (train.py --resume checks it)
        fam = family.get(meta["model"])
        config = fam.config_cls(**meta["model_config"])
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.eval_shape(lambda: fam.init_params(config, jax.random.PRNGKey(0)))
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), abstract)
        try:
            params = saving.restore(path, step, {"params": abstract}, partial=True)[0]["params"]
        except Exception as e:  # orbax reports a shape/structure mismatch or unreadable arrays
            raise ValueError(f"{path}: step {step}: cannot restore its parameters ({type(e).__name__}); pass a "
                             f"directory train.py --checkpoint_dir wrote with this version") from None
        return config, params, {"kind": "orbax", "model": meta["model"], "step": step,
                                "train_config": meta.get("train_config", {})}
    if step is not None:
        raise ValueError(f"--step {step} selects a step of a checkpoint directory, but {path} is a file")
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file or directory; pass a train.py --checkpoint_dir or an llm.c model .bin")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: not a regular file or directory; pass an llm.c model .bin")
    config, params = llmc.load(path, **{k: v for k, v in llmc_overrides.items() if v is not None})
    return config, params, {"kind": "llm.c", "model": family.of(config).name, "step": None,
                            "train_config": {}}


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


def parse_token_ids(spec: str, vocab_size: int, what: str = "--prompt_tokens") -> list[int]:
    """'50256,464' → [50256, 464], each in 0..vocab_size-1 (ValueError otherwise)."""
    try:
        ids = [parse_int(s.strip()) for s in spec.split(",") if s.strip()]  # ASCII digits only
    except ValueError:
        raise ValueError(f"{what} {spec!r}: expected comma-separated integers, e.g. 50256,464") from None
    if not ids:
        raise ValueError(f"{what} is empty; pass at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{what}: token id {bad[0]} is outside the model's vocabulary 0..{vocab_size - 1}")
    return ids


def render(ids, decoder) -> str:
    """Decoded text, or the ids as a comma list when there is no decoder."""
    return decoder.decode(ids) if decoder is not None else ",".join(str(int(i)) for i in np.asarray(ids))


SEED_MAX = 2**32 - 1  # jax.random.PRNGKey keeps 32 bits of a seed: larger ones repeat smaller ones


def _args(argv):
    p = Parser(prog="python -m remat_lm.models.sample", description="\n\n".join(__doc__.split("\n\n")[:2]),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a train.py --checkpoint_dir directory or an llm.c model .bin")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="prompt text (encoded as bytes, or with --tokenizer by greedy longest match)")
    p.add_argument("--prompt_tokens", default=None, metavar="IDS", help="prompt as comma-separated token ids")
    p.add_argument("--sample_length", type=integer(1), default=200, metavar="N",
                   help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=real(0), default=0.0, metavar="X",
                   help="0: greedy; > 0: sample (default: %(default)s)")
    p.add_argument("--top_k", type=integer(1), default=None, metavar="K", help="sample among the k most likely tokens")
    p.add_argument("--seed", type=integer(0, SEED_MAX), default=0, metavar="N",
                   help="sampling seed, 0..4294967295 (default: %(default)s)")
    p.add_argument("--num_samples", type=integer(1), default=1, metavar="N",
                   help="independent samples, run as one batch (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, metavar="FILE", help="llm.c tokenizer file (gpt2_tokenizer.bin)")
    p.add_argument("--step", type=integer(0), default=None, metavar="N", help="checkpoint step (default: the latest)")
    for f in ("norm_eps", "rope_theta", "ffn_dim_multiplier"):
        p.add_argument(f"--{f}", type=real(above=0), default=None, metavar="X", help="LLaMA-3 llm.c header override")
    return p.parse_args(argv)


def main(argv=None) -> int:
    prog = "python -m remat_lm.models.sample"
    try:
        a = _args(argv)
    except SystemExit as e:  # argparse: --help (0) or a one-line usage error (2), already printed
        return e.code

    def fail(msg):
        print(f"{prog}: error: {' '.join(str(msg).split())}", file=sys.stderr)
        return 2

    if a.prompt is not None and a.prompt_tokens is not None:
        return fail("pass --prompt TEXT or --prompt_tokens IDS, not both")
    try:
        config, params, info = load_model(a.checkpoint, a.step, norm_eps=a.norm_eps, rope_theta=a.rope_theta,
                                          ffn_dim_multiplier=a.ffn_dim_multiplier)
        tok_path = a.tokenizer or info["train_config"].get("tokenizer")
        decoder = decoder_for(config.vocab_size, tok_path)
        if a.prompt_tokens is not None:
            ids = parse_token_ids(a.prompt_tokens, config.vocab_size)
        elif a.prompt is not None:
            if decoder is None:
                raise ValueError(f"--prompt needs a tokenizer to encode text for a vocabulary of {config.vocab_size}; "
                                 f"pass --tokenizer gpt2_tokenizer.bin or --prompt_tokens IDS")
            ids = decoder.encode(a.prompt)
            if not ids:
                raise ValueError("--prompt is empty; pass some text")
        elif getattr(decoder, "eot_token", None) is not None:
            ids = [decoder.eot_token]  # llm.c starts its samples from <|endoftext|>
        else:
            raise ValueError("pass --prompt TEXT (or --prompt_tokens IDS) to start the sample from")
        prompt = np.tile(np.asarray(ids, np.int32)[None], (a.num_samples, 1))
        t0 = time.perf_counter()
        out = generate(params, config, prompt, a.sample_length, temperature=a.temperature, top_k=a.top_k,
                       seed=a.seed)
        dt = time.perf_counter() - t0
    except (ValueError, OSError) as e:  # LlmcFormatError, TokenizerError and UsageError are ValueErrors
        return fail(e)
    where = f"step {info['step']} of {a.checkpoint}" if info["step"] is not None else a.checkpoint
    mode = "greedy" if a.temperature == 0 else f"temperature {a.temperature:g}" + (
        f", top_k {a.top_k}" if a.top_k else "")
    print(f"{prog}: {info['model']} from {where}: {a.num_samples} x {a.sample_length} tokens after a "
          f"{len(ids)}-token prompt, {mode}, {dt:.2f} s (compilation included)", file=sys.stderr)
    for i, row in enumerate(out):
        if i:
            print("\n" + "-" * 40)
        print(render(row, decoder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
