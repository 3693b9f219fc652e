"""Training data: llm.c token shards or byte-level text, sampled deterministically by batch index.

A dataset is a list of token streams. llm.c token shards (`*.bin`: GPT-2, uint16, magic 20240520;
LLaMA-3, uint32, magic 20240801) are each one stream (a memory map that
`remat_lm.models.llmc_io.read_tokens` returns after validating the file), all of one format; text files are
concatenated into one stream of bytes (vocabulary 256). A batch is `batch_size` windows of
`sequence_length + 1` tokens that never cross a stream boundary; batch `i` depends only on
`(seed, i)`, so the data position of a run is the single integer `i` and a resumed run sees
exactly the batches an uninterrupted run would.

The default corpus, which needs no download, is the text of the Python standard library's own
source files (`sysconfig.get_paths()["stdlib"]`, `*.py`, without tests and site-packages).

Example:
    >>> ds = load(["shard_000.bin"])
    >>> x, y = ds.batch(index=0, seed=1337, batch_size=8, seq_len=64, accum=1)  # (1, 8, 64) each
"""
from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig

import numpy as np

from remat_lm.models import family
from remat_lm.models.llmc_io import LlmcFormatError, TokenFormat, read_tokens, token_format
from remat_lm.training.config import UsageError

BYTE_VOCAB = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def default_corpus() -> list[str]:
    """The Python standard library's `*.py` files (no tests, no site-packages), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        out += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py")]
    return out


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Token streams plus what they are. `vocab_needed` is max token id + 1."""
    streams: tuple  # 1-D integer arrays (np.memmap for shards: uint16 GPT-2, uint32 LLaMA-3)
    kind: str       # "tokens" (llm.c shards) or "text" (bytes)
    vocab_needed: int
    description: str
    token_format: TokenFormat | None = None  # shards: their one format (GPT-2 uint16 / LLaMA-3 uint32)
    top_file: str = ""                       # shards: the file holding the largest token id

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.streams)

    def check(self, vocab_size: int, seq_len: int, what: str = "--data") -> None:
        """Raise UsageError unless every token id is < vocab_size and a window of seq_len+1 fits."""
        if self.vocab_needed > vocab_size:
            top = self.vocab_needed - 1
            if self.token_format is not None:
                # the model whose vocabulary is llm.c's tokenizer of the shard format (GPT-2 d12: 50257,
                # LLaMA-3 1b: 128256): the fix named when the ids fit it
                fam = family.get(self.token_format.kind)
                vocab = fam.presets[fam.tokenizer_preset]["vocab_size"]
                flags = f"--model {fam.name} --preset {fam.tokenizer_preset}"
                model = f"{flags} (vocab {vocab}) or " if top < vocab else ""
                raise UsageError(
                    f"{what} {self.top_file} ({self.token_format.words()}) holds token ids up to {top}, but the "
                    f"model's vocab_size is {vocab_size}; pass {model}--vocab_size >= {top + 1}, or data tokenized "
                    f"for this model's vocabulary")
            raise UsageError(f"{what} ({self.description}) holds token ids up to {top}, but the "
                             f"model's vocab_size is {vocab_size}; use a preset/--vocab_size >= {self.vocab_needed}")
        longest = max(len(s) for s in self.streams)
        if longest < seq_len + 1:
            raise UsageError(f"{what} ({self.description}): the longest token stream has {longest} tokens but "
                             f"--sequence_length {seq_len} needs at least {seq_len + 1}; pass more data or a "
                             f"shorter --sequence_length")

    def split_tail(self, fraction: float, min_tokens: int) -> tuple["Dataset", "Dataset"]:
        """(train, held-out): the last `fraction` of the last stream becomes the held-out set."""
        last = self.streams[-1]
        n_val = max(int(len(last) * fraction), min_tokens)
        if len(last) - n_val < min_tokens:
            raise UsageError(f"--data ({self.description}) is too short to hold out {n_val} tokens for validation "
                             f"and still train on windows of {min_tokens}; pass --val_data or --val_every 0")
        train = dataclasses.replace(self, streams=self.streams[:-1] + (last[:len(last) - n_val],))
        val = dataclasses.replace(self, streams=(last[len(last) - n_val:],),
                                  description=f"held-out last {100 * fraction:g}%")
        return train, val

    def _windows(self, seq_len: int):
        starts = np.array([max(len(s) - seq_len, 0) for s in self.streams], np.int64)  # valid starts per stream
        return starts, np.concatenate([[0], np.cumsum(starts)])

    def _gather(self, flat_starts, seq_len: int):
        counts, offsets = self._windows(seq_len)
        which = np.searchsorted(offsets, flat_starts, side="right") - 1
        out = np.empty((len(flat_starts), seq_len + 1), np.int32)
        for row, (w, s) in enumerate(zip(which, flat_starts - offsets[which])):
            out[row] = self.streams[w][s:s + seq_len + 1]
        return out

    def batch(self, index: int, seed: int, batch_size: int, seq_len: int, accum: int = 1, rows: slice | None = None):
        """Training batch number `index`: random windows drawn from `(seed, index)`.

        Args:
          rows: read only these rows of the batch axis (a process's share of the global batch,
            `remat_lm.training.distributed.put_rows`); the start of every row is drawn, so they are the
            same rows as in the whole batch.
        Returns:
          x, y: int32 arrays (accum, batch_size, seq_len), or (accum, rows, seq_len); y is x shifted by one token.
        """
        counts, offsets = self._windows(seq_len)
        rng = np.random.default_rng([seed, index])
        flat = rng.integers(0, offsets[-1], size=accum * batch_size).reshape(accum, batch_size)
        if rows is not None:
            flat = flat[:, rows]
        w = self._gather(flat.ravel(), seq_len).reshape(accum, flat.shape[1], seq_len + 1)
        return w[..., :-1], w[..., 1:]

    def eval_batch(self, index: int, batch_size: int, seq_len: int, rows: slice | None = None):
        """Validation batch number `index`: consecutive non-overlapping windows (wrapping around).

        Args:
          rows: read only these rows (as in `batch`).
        Returns:
          x, y: int32 arrays (batch_size, seq_len), or (rows, seq_len).
        """
        counts, offsets = self._windows(seq_len)
        stride = np.array([(index * batch_size + b) * seq_len for b in range(batch_size)[rows or slice(None)]],
                          np.int64)
        w = self._gather(stride % offsets[-1], seq_len)
        return w[:, :-1], w[:, 1:]


def _expand(paths, what: str) -> list[str]:
    out = []
    for p in paths:
        if any(c in p for c in "*?["):
            hits = sorted(glob.glob(p))
            if not hits:
                raise UsageError(f"{what} {p}: the pattern matches no file; check the path")
            out += hits
        else:
            out.append(p)
    for p in out:
        if not os.path.exists(p):
            raise UsageError(f"{what} {p}: no such file; check the path")
        if not os.path.isfile(p):
            raise UsageError(f"{what} {p}: not a regular file; pass token shards (*.bin) or text files")
        if os.path.getsize(p) == 0:
            raise UsageError(f"{what} {p}: the file is empty; drop it or pass a file with data")
    return out


def load(paths, what: str = "--data") -> Dataset:
    """Load token shards (`*.bin`) or text files. Raises UsageError / LlmcFormatError on bad input.

    Args:
      paths: file paths or glob patterns; empty means the default corpus (the stdlib's source).
      what: the flag name used in error messages.
    Example:
      >>> load(["notes.txt"]).kind
      'text'
    """
    default = not paths
    files = default_corpus() if default else _expand(paths, what)
    if not files:
        raise UsageError(f"{what}: no files found (the default corpus needs the Python standard library's "
                         f"sources); pass --data PATH")
    shards = [f for f in files if f.endswith(".bin")]
    if shards and len(shards) != len(files):
        raise UsageError(f"{what} mixes token shards (*.bin) and text files ({files[0]}, ...): their token ids "
                         f"mean different things; pass one kind")
    if shards:
        formats = [token_format(path)[0] for path in shards]  # header and size of every shard, first
        mixed = next((i for i, f in enumerate(formats) if f != formats[0]), None)
        if mixed is not None:
            raise UsageError(f"{what} mixes token shard formats: {shards[0]} is an {formats[0].words()}, "
                             f"{shards[mixed]} an {formats[mixed].words()}; their token ids come from "
                             f"different tokenizers: pass shards of one format")
        streams, top, top_file = [], -1, shards[0]
        for path in shards:
            # NOTE: a memory map (validated by read_tokens): the shard is paged in to find its largest id,
            # and later only the windows a batch reads; it is never copied into this process's memory.
            tokens = read_tokens(path, mmap=True)
            m = int(tokens.max())
            if m > top:
                top, top_file = m, path
            streams.append(tokens)
        desc = shards[0] if len(shards) == 1 else f"{len(shards)} token shards ({shards[0]}, ...)"
        return Dataset(tuple(streams), "tokens", top + 1, desc, formats[0], top_file)
    parts = []
    for path in files:
        with open(path, "rb") as fh:
            parts.append(np.frombuffer(fh.read(), np.uint8))
    stream = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if default:
        desc = f"default corpus: {len(files)} Python stdlib source files"
    else:
        desc = files[0] if len(files) == 1 else f"{len(files)} text files ({files[0]}, ...)"
    return Dataset((stream,), "text", int(stream.max()) + 1, desc)


__all__ = ["BYTE_VOCAB", "Dataset", "LlmcFormatError", "default_corpus", "load"]
