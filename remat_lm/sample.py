"""`python -m remat_lm.sample`: generate text from a train.py run or an llm.c model file.

    python -m remat_lm.sample runs/x --prompt "def main(" --sample_length 300     # a train.py run
    python -m remat_lm.sample gpt2_124M.bin --tokenizer gpt2_tokenizer.bin --prompt "Hello," \\
        --temperature 0.8 --top_k 40 --seed 1                                   # an llm.c model
    python -m remat_lm.sample gpt2_124M.bin --prompt_tokens 50256 --tokenizer gpt2_tokenizer.bin

CHECKPOINT is an orbax directory written by `train.py --checkpoint_dir` (its latest step, or
`--step N`) or an llm.c model `.bin` (GPT-2 or LLaMA-3). The generation (prompt included) goes to
stdout, one sample after another; a summary line goes to stderr. Byte-level models (vocabulary
256) decode bytes as UTF-8 text; larger vocabularies decode with llm.c's tokenizer file
(`--tokenizer`, remat_lm/models/tokenizer.py), or print token ids without one. Bad input exits 2 with one
line on stderr.

The application side of generation: reading a run directory (remat_lm.training.saving) or an llm.c
file, and the command line. The generation itself (the models' KV-cached decode, sampling, ids to
text) is remat_lm/models/sample.py.

Example:
    >>> config, params, info = load_model("model.bin")   # or a train.py --checkpoint_dir
    >>> tokens = generate(params, config, [list(b"def ")], 8, temperature=0.8, top_k=20, seed=0)
    >>> tokens.shape   # the prompt, then 8 new tokens
    (1, 12)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

from remat_lm.argtypes import Parser, integer, parse_int, real, usage_error
from remat_lm.models import family, llmc
from remat_lm.models.sample import INT32_MAX, SEED_MAX, decoder_for, generate, render
from remat_lm.training import saving

__all__ = ["PROG", "entry", "load_model", "main", "parse_token_ids"]

PROG = "python -m remat_lm.sample"


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





def _args(argv):
    p = Parser(prog=PROG, description="\n\n".join(__doc__.split("\n\n")[:2]),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a train.py --checkpoint_dir directory or an llm.c model .bin")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="prompt text (encoded as bytes, or with --tokenizer by greedy longest match)")
    p.add_argument("--prompt_tokens", default=None, metavar="IDS", help="prompt as comma-separated token ids")
    p.add_argument("--sample_length", type=integer(1, INT32_MAX - 1), default=200, metavar="N",
                   help=f"tokens to generate, 1..{INT32_MAX - 1} (positions are int32 indices; default: %(default)s)")
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
    prog = PROG
    try:
        a = _args(argv)
    except SystemExit as e:  # argparse: --help (0) or a one-line usage error (2), already printed
        return e.code
    if a.prompt is not None and a.prompt_tokens is not None:
        return usage_error(prog, "pass --prompt TEXT or --prompt_tokens IDS, not both")
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
        return usage_error(prog, e)
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


def entry() -> int:
    """The `remat-sample` console script: messages and --help name the command as typed."""
    global PROG
    PROG = "remat-sample"
    return main()


if __name__ == "__main__":
    sys.exit(main())
