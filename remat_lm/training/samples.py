"""Samples during training (`--sample_every N`): a short generation from a fixed prompt.

Every N steps and at the last step, `run` prints the prompt and its continuation (remat_lm/models/sample.py,
KV-cached): greedy, or sampled with `--temperature` and `--top_k` from the fixed seed `--seed`, so
samples from successive steps differ only by what the model learned. The prompt is `--prompt`
(encoded as bytes for byte-level text, or with `--tokenizer` by greedy longest match) or, by
default, the first `DEFAULT_PROMPT_TOKENS` tokens of the validation data. Byte-level models
decode bytes as UTF-8; llm.c token data decodes with `--tokenizer gpt2_tokenizer.bin`, and is
printed as token ids without it. The sample runs after the step's timing and log line, so it
never counts in step time or tokens/s.

Example:
    >>> sampler = make_sampler(cfg, mcfg, train_ds, val_ds)   # None when --sample_every 0
    >>> if sampler and sampler.due(step): print(sampler.report(params, step))
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from remat_lm.models.sample import decoder_for, generate, render
from remat_lm.models.tokenizer import TokenizerError
from remat_lm.training.config import DEFAULT_PROMPT_TOKENS, TrainConfig, UsageError


@dataclasses.dataclass
class Sampler:
    """What every sample of a run uses: the prompt, the decoder and the sampling settings."""
    cfg: TrainConfig
    mcfg: Any
    prompt: np.ndarray  # (1, P) int32
    decoder: Any        # remat_lm.models.tokenizer.Tokenizer / ByteTokenizer, or None (token ids are printed)

    def due(self, step: int) -> bool:
        """True at every `--sample_every` steps and at the last step."""
        every = self.cfg.sample_every
        return every > 0 and (step % every == 0 or step == self.cfg.num_iterations)

    def tokens(self, params) -> np.ndarray:
        """(P + sample_length,) int32: the prompt and its continuation."""
        c = self.cfg
        return generate(params, self.mcfg, self.prompt, c.sample_length, temperature=c.temperature,
                        top_k=c.top_k, seed=c.seed)[0]

    def report(self, params, step: int) -> str:
        """A header line and the sample's text, each line prefixed with '  | '."""
        t0 = time.perf_counter()
        ids = self.tokens(params)
        dt = time.perf_counter() - t0
        c = self.cfg
        mode = "greedy" if c.temperature == 0 else f"temperature {c.temperature:g}" + (
            f", top_k {c.top_k}" if c.top_k else "")
        text = render(ids, self.decoder)
        head = (f"sample   step {step}: {c.sample_length} tokens after a {self.prompt.shape[1]}-token prompt, {mode}, "
                f"{dt:.2f} s")
        return "\n".join([head] + ["  | " + line for line in text.split("\n")])


def make_sampler(cfg: TrainConfig, mcfg, train_ds, val_ds) -> Sampler | None:
    """Validate the sample flags against the data and the model; None when `--sample_every 0`.

    Raises UsageError (one line) for a bad `--tokenizer` file, a tokenizer on byte-level text, a
    tokenizer smaller than the model's vocabulary, or a `--prompt` that cannot be encoded.
    """
    if cfg.tokenizer and train_ds.kind == "text":
        raise UsageError(f"--tokenizer {cfg.tokenizer}: --data is byte-level text, which decodes as bytes; "
                         f"drop --tokenizer (it is for llm.c token shards)")
    try:
        decoder = decoder_for(mcfg.vocab_size, cfg.tokenizer)
    except TokenizerError as e:
        msg = str(e)
        raise UsageError(msg if msg.startswith("--tokenizer") else f"--tokenizer {msg}") from None
    if cfg.sample_every == 0:
        return None
    if cfg.prompt is not None:
        if decoder is None:
            raise UsageError(f"--prompt: llm.c token data (vocab_size {mcfg.vocab_size}) needs --tokenizer "
                             f"gpt2_tokenizer.bin to encode text; add it, or drop --prompt to start from the "
                             f"validation data")
        try:
            ids = decoder.encode(cfg.prompt)
        except TokenizerError as e:
            raise UsageError(f"--prompt: {e}") from None
        if not ids:
            raise UsageError("--prompt is empty; pass some text, or drop --prompt to start from the validation data")
        bad = [i for i in ids if i >= mcfg.vocab_size]
        if bad:
            raise UsageError(f"--prompt encodes to token {bad[0]}, outside the model's vocab_size {mcfg.vocab_size}; "
                             f"pass the tokenizer of the training data")
    else:
        stream = (val_ds if val_ds is not None else train_ds).streams[0]
        ids = np.asarray(stream[:min(DEFAULT_PROMPT_TOKENS, mcfg.block_size)])
    return Sampler(cfg, mcfg, np.asarray(ids, np.int32)[None], decoder)
