"""Token ids ↔ text: llm.c's tokenizer file (`gpt2_tokenizer.bin`) and byte-level text.

llm.c's tokenizer file (written by its train_gpt2.py, read by its tokenizer.h): a 256 × int32
little-endian header, [0] magic 20240328, [1] version 1 or 2, [2] vocab_size, [3] the
end-of-text token id (version 2 only; version 1 files are GPT-2's, whose EOT is 50256); then,
for each token in id order, a uint8 length (1..255) followed by that many bytes. Decoding joins
the byte strings and decodes UTF-8 with errors="replace" (a token may hold part of a character).

# NOTE: encoding. The file holds only the tokens' byte strings, not GPT-2's BPE merges, so text
# is encoded by a greedy longest match over those byte strings. GPT-2's vocabulary holds every
# single byte, so any text encodes; the ids are a valid spelling of the text but not always the
# ones GPT-2's BPE would choose (a model still continues them sensibly). For exact ids pass them
# directly (`python -m remat_lm.sample ... --prompt_tokens 50256,464`).

Example:
    >>> tok = load("tokenizer.bin")   # e.g. llm.c's gpt2_tokenizer.bin
    >>> tok.encode("Hello, world"), tok.decode([256, 257])
    ([256, 257], 'Hello, world')
    >>> ByteTokenizer().decode(list(b"def f():"))
    'def f():'
"""
from __future__ import annotations

import dataclasses
import os
import stat

import numpy as np

MAGIC = 20240328
VERSIONS = (1, 2)
HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS
GPT2_EOT = 50256  # the EOT of version-1 files (GPT-2's vocabulary of 50257)
BYTE_VOCAB = 256


class TokenizerError(ValueError):
    """A tokenizer file (or text to encode) is unusable; the message is one line naming the fix."""


def _fail(path, problem: str, fix: str) -> TokenizerError:
    return TokenizerError(f"{path}: {problem}; {fix}")


class _Encoder:
    """Greedy longest match over token byte strings (see the module NOTE)."""

    def __init__(self, tokens):
        self.ids: dict[bytes, int] = {}
        for i, t in enumerate(tokens):
            self.ids.setdefault(t, i)  # a duplicated byte string encodes to its lowest id
        self.longest = max(len(t) for t in tokens)

    def encode(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(self.longest, len(data) - i), 0, -1):
                tid = self.ids.get(data[i:i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
            else:
                raise TokenizerError(f"the text's byte {data[i]:#04x} (at byte {i}) is no token of the vocabulary "
                                     f"and starts none; pass token ids instead (--prompt_tokens)")
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """An llm.c tokenizer: each id's byte string, and the end-of-text id (None if unknown).

    Example:
      >>> tok = Tokenizer((b"a", b"b", b"ab"), eot_token=None)
      >>> tok.encode("aab"), tok.decode([0, 2])
      ([0, 2], 'aab')
    """
    tokens: tuple
    eot_token: int | None = None
    version: int = 2
    path: str | None = None

    def __post_init__(self):
        if not self.tokens:
            raise TokenizerError("a tokenizer needs at least one token")
        if self.eot_token is not None and not 0 <= self.eot_token < len(self.tokens):
            raise TokenizerError(f"eot_token={self.eot_token} is outside the vocabulary of {len(self.tokens)}")

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def decode_bytes(self, ids) -> bytes:
        """The concatenated byte strings of `ids` (ints < vocab_size)."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token id {bad[0]} is outside the tokenizer's vocabulary of {self.vocab_size}; "
                                 f"use the tokenizer the model was trained with")
        return b"".join(self.tokens[i] for i in ids)

    def decode(self, ids) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        """Token ids spelling `text` (UTF-8), by greedy longest match (see the module NOTE)."""
        enc = self.__dict__.get("_encoder")
        if enc is None:
            enc = _Encoder(self.tokens)
            object.__setattr__(self, "_encoder", enc)
        return enc.encode(text.encode("utf-8"))

    def check_vocab(self, model_vocab: int, what: str = "--tokenizer") -> None:
        """Raise TokenizerError when the model can emit ids this tokenizer cannot decode."""
        if self.vocab_size < model_vocab:
            raise TokenizerError(f"{what} {self.path}: the tokenizer has {self.vocab_size} tokens but the model's "
                                 f"vocab_size is {model_vocab}; pass the tokenizer the model's data was made with")


class ByteTokenizer:
    """Byte-level text (vocabulary 256): id i is byte i.

    Example:
      >>> ByteTokenizer().encode("hi")
      [104, 105]
    """
    vocab_size = BYTE_VOCAB
    eot_token = None
    path = None

    def decode_bytes(self, ids) -> bytes:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= BYTE_VOCAB):
            raise TokenizerError(f"token id {int(ids.max() if ids.max() >= BYTE_VOCAB else ids.min())} is not a byte; "
                                 f"decode llm.c token data with its tokenizer file (--tokenizer)")
        return ids.astype(np.uint8).tobytes()

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def check_vocab(self, model_vocab: int, what: str = "byte-level text") -> None:
        if model_vocab > BYTE_VOCAB:
            raise TokenizerError(f"{what}: the model's vocab_size {model_vocab} exceeds 256 bytes; pass the "
                                 f"tokenizer of its token data (--tokenizer gpt2_tokenizer.bin)")


def load(path) -> Tokenizer:
    """Read an llm.c tokenizer file, validating all of it.

    Raises:
      TokenizerError (a ValueError) naming the file and the problem: missing, not a regular file
      (a FIFO, a directory), wrong magic, unknown version, a bad header, truncated or with bytes
      after the last token.
    Example:
      >>> load("tokenizer.bin").vocab_size   # llm.c's gpt2_tokenizer.bin: 50257
      258
    """
    path = os.fspath(path)
    fix = "pass llm.c's gpt2_tokenizer.bin (written by its train_gpt2.py)"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _fail(path, "no such file", fix) from None
    except OSError as e:
        raise _fail(path, f"cannot stat it ({e.strerror})", fix) from None
    if not stat.S_ISREG(st.st_mode):  # checked before open(): opening a FIFO would block
        raise _fail(path, "not a regular file", fix)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise _fail(path, f"cannot read it ({e.strerror})", fix) from None
    if len(data) < HEADER_BYTES:
        raise _fail(path, f"file is {len(data)} bytes, shorter than the {HEADER_BYTES}-byte header", fix)
    header = np.frombuffer(data[:HEADER_BYTES], "<i4")
    magic, version, vocab = int(header[0]), int(header[1]), int(header[2])
    if magic != MAGIC:
        raise _fail(path, f"magic {magic} is not an llm.c tokenizer's ({MAGIC})", fix)
    if version not in VERSIONS:
        raise _fail(path, f"unknown tokenizer version {version} (known: 1, 2)", fix)
    if vocab < 1:
        raise _fail(path, f"the header's vocab_size is {vocab}", fix)
    if version == 2:
        eot = int(header[3])
        if not 0 <= eot < vocab:
            raise _fail(path, f"the header's EOT token {eot} is outside its vocabulary of {vocab}", fix)
    else:
        eot = GPT2_EOT if vocab > GPT2_EOT else None
    tokens, pos = [], HEADER_BYTES
    for i in range(vocab):
        if pos >= len(data):
            raise _fail(path, f"truncated: the header says {vocab} tokens but the file ends after {i}", fix)
        n = data[pos]
        if n == 0:
            raise _fail(path, f"token {i} has length 0 (llm.c's tokens are 1..255 bytes)", fix)
        if pos + 1 + n > len(data):
            raise _fail(path, f"truncated: token {i} needs {n} bytes but the file ends after "
                              f"{len(data) - pos - 1}", fix)
        tokens.append(data[pos + 1:pos + 1 + n])
        pos += 1 + n
    if pos != len(data):
        raise _fail(path, f"{len(data) - pos} bytes after the last of its {vocab} tokens", fix)
    return Tokenizer(tuple(tokens), eot, version, path)


def save(path, tokens, eot_token: int | None = None, version: int = 2) -> None:
    """Write an llm.c tokenizer file (version 2 stores `eot_token`; version 1 stores none).

    Example:
      >>> save("tok.bin", [bytes([i]) for i in range(256)], eot_token=0)
      >>> load("tok.bin").decode(list(b"hi"))
      'hi'
    """
    tokens = [bytes(t) for t in tokens]
    if version not in VERSIONS:
        raise TokenizerError(f"version {version} is not an llm.c tokenizer version; use 1 or 2")
    bad = [i for i, t in enumerate(tokens) if not 1 <= len(t) <= 255]
    if bad or not tokens:
        raise TokenizerError(f"token {bad[0] if bad else 0} must be 1..255 bytes long")
    header = np.zeros(HEADER_INTS, "<i4")
    header[:3] = [MAGIC, version, len(tokens)]
    if version == 2:
        if eot_token is None or not 0 <= eot_token < len(tokens):
            raise TokenizerError(f"a version-2 tokenizer stores its EOT id: eot_token={eot_token!r} must be in "
                                 f"0..{len(tokens) - 1}")
        header[3] = eot_token
    payload = b"".join(bytes([len(t)]) + t for t in tokens)
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes() + payload)
    os.replace(tmp, path)
