"""llm.c tokenizer files (remat_lm/models/tokenizer.py): real v1 and v2 files, and really corrupted ones."""
import os

import numpy as np
import pytest

from remat_lm.models import tokenizer as tk


def _gpt2_like_tokens(n: int, seed: int = 0) -> list[bytes]:
    """Every single byte first (as GPT-2's vocabulary has), then random multi-byte strings."""
    rng = np.random.default_rng(seed)
    out = [bytes([i]) for i in range(256)]
    seen = set(out)
    while len(out) < n:
        t = bytes(rng.integers(32, 127, size=int(rng.integers(2, 9))).astype(np.uint8))
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


@pytest.fixture(scope="module")
def v2_file(tmp_path_factory):
    tokens = [bytes([i]) for i in range(256)] + [b"de", b"def", b" ret", b"urn", "é".encode()]
    path = tmp_path_factory.mktemp("tok") / "tok_v2.bin"
    tk.save(path, tokens, eot_token=3, version=2)
    return str(path), tokens


def test_v2_file_round_trip(v2_file):
    path, tokens = v2_file
    raw = open(path, "rb").read()
    header = np.frombuffer(raw[:1024], "<i4")
    assert list(header[:4]) == [20240328, 2, len(tokens), 3]  # the bytes llm.c's tokenizer.h reads
    assert raw[1024] == 1 and raw[1025] == 0  # token 0: length 1, byte 0x00
    tok = tk.load(path)
    assert (tok.version, tok.vocab_size, tok.eot_token) == (2, len(tokens), 3)
    assert tok.tokens == tuple(tokens)
    assert tok.decode([257, 258, 259]) == "def return"
    assert tok.decode([260]) == "é" and tok.decode_bytes([260]) == "é".encode()


def test_decode_invalid_utf8_is_replaced(v2_file):
    tok = tk.load(v2_file[0])
    first_half_of_e_acute = "é".encode()[0]
    assert tok.decode([ord("a"), first_half_of_e_acute, ord("b")]) == "a\ufffdb"
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        tok.decode([len(v2_file[1])])


def test_encode_is_greedy_longest_match(v2_file):
    tok = tk.load(v2_file[0])
    assert tok.encode("def return") == [257, 258, 259]  # "def" (257) beats "de" (256) and "d"
    assert tok.encode("de") == [256] and tok.encode("é") == [260]
    assert tok.encode("xdefy") == [ord("x"), 257, ord("y")]


def test_encode_fails_on_a_byte_no_token_starts(tmp_path):
    path = tmp_path / "t.bin"
    tk.save(path, [b"a", b"b", b"ab"], eot_token=0)
    tok = tk.load(path)
    assert tok.encode("abba") == [2, 1, 0]
    with pytest.raises(ValueError, match="byte 0x63.*--prompt_tokens"):
        tok.encode("abc")


def test_v1_file_is_gpt2_with_eot_50256(tmp_path):
    tokens = _gpt2_like_tokens(50257)
    path = tmp_path / "gpt2_tokenizer.bin"
    tk.save(path, tokens, version=1)
    assert list(np.frombuffer(open(path, "rb").read()[:16], "<i4")) == [20240328, 1, 50257, 0]
    tok = tk.load(path)
    assert (tok.version, tok.vocab_size, tok.eot_token) == (1, 50257, 50256)
    assert tok.decode([50000, 50001]) == (tokens[50000] + tokens[50001]).decode()
    text = "Hello, tokenizer!"
    assert tok.decode(tok.encode(text)) == text


def _corrupt(tmp_path, name, mutate, tokens=None):
    tokens = tokens or [bytes([i]) for i in range(256)] + [b"xy"]
    path = tmp_path / name
    tk.save(path, tokens, eot_token=256)
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(mutate(data)))
    return str(path)


def _set_int(data, slot, value):
    data[4 * slot:4 * slot + 4] = np.int32(value).tobytes()
    return data


@pytest.mark.parametrize("name,mutate,match", [
    ("magic", lambda d: _set_int(d, 0, 20240326), "magic 20240326 is not an llm.c tokenizer's"),
    ("version", lambda d: _set_int(d, 1, 3), "unknown tokenizer version 3"),
    ("vocab", lambda d: _set_int(d, 2, 0), "vocab_size is 0"),
    ("eot", lambda d: _set_int(d, 3, 999), "EOT token 999 is outside"),
    ("truncated_token", lambda d: d[:-1], "truncated: token 256 needs 2 bytes"),
    ("truncated_count", lambda d: _set_int(d, 2, 300), "truncated: the header says 300 tokens"),
    ("trailing", lambda d: d + b"\x01z", "2 bytes after the last"),
    ("short", lambda d: d[:100], "shorter than the 1024-byte header"),
    ("zero_length", lambda d: d[:1024] + b"\x00" + d[1025:], "token 0 has length 0"),
])
def test_corrupt_files_raise_one_line_value_errors(tmp_path, name, mutate, match):
    path = _corrupt(tmp_path, name + ".bin", mutate)
    with pytest.raises(ValueError, match=match) as e:
        tk.load(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(path) and "gpt2_tokenizer.bin" in msg


def test_fifo_directory_and_missing_file_are_rejected_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.bin"
    os.mkfifo(fifo)  # open() on it would block forever; the reader must not open it
    with pytest.raises(ValueError, match="not a regular file"):
        tk.load(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        tk.load(tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        tk.load(tmp_path / "missing.bin")


def test_vocab_smaller_than_the_model_is_rejected(v2_file):
    tok = tk.load(v2_file[0])
    tok.check_vocab(tok.vocab_size)
    with pytest.raises(ValueError, match=f"has {tok.vocab_size} tokens but the model's vocab_size is 50257"):
        tok.check_vocab(50257)


def test_byte_tokenizer():
    bt = tk.ByteTokenizer()
    assert bt.encode("é!") == [0xC3, 0xA9, 0x21] and bt.decode([0xC3, 0xA9, 0x21]) == "é!"
    assert bt.decode([0xC3]) == "\ufffd"
    with pytest.raises(ValueError, match="not a byte"):
        bt.decode([300])
