"""Tests for remat_lm.models.llmc_io (llm.c file formats) and the float64 reference in llmc_reference.

Expected files are built here by hand with struct/NumPy/ml_dtypes straight from
docs/llmc-format.md, independently of the writer under test.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct

import ml_dtypes
import numpy as np
import pytest

from llmc_reference import (
    forward_backward,
    random_batch,
    random_tensors,
    rope_frequencies,
    tiny_gpt2_header,
    tiny_llama3_header,
)
from remat_lm.models import llmc_io
from remat_lm.models.gpt2 import GPT2Header
from remat_lm.models.llama3 import Llama3Header
from remat_lm.models.llmc_io import (
    LlmcFormatError,
    bfloat16_bits_to_float32,
    float32_to_bfloat16_bits,
    read_model,
    read_state,
    read_tokens,
    write_model,
    write_state,
    write_tokens,
)

KINDS = ("gpt2", "llama3")
DTYPES = ("float32", "bfloat16")

# Tensor order and shapes of the tiny configs, transcribed from docs/llmc-format.md.
GPT2_TINY_SHAPES = [  # Vp=128, T=16, L=2, C=32
    ("wte", (128, 32)), ("wpe", (16, 32)), ("ln_1.w", (2, 32)), ("ln_1.b", (2, 32)),
    ("attn.c_attn.w", (2, 96, 32)), ("attn.c_attn.b", (2, 96)), ("attn.c_proj.w", (2, 32, 32)),
    ("attn.c_proj.b", (2, 32)), ("ln_2.w", (2, 32)), ("ln_2.b", (2, 32)), ("mlp.c_fc.w", (2, 128, 32)),
    ("mlp.c_fc.b", (2, 128)), ("mlp.c_proj.w", (2, 32, 128)), ("mlp.c_proj.b", (2, 32)),
    ("ln_f.w", (32,)), ("ln_f.b", (32,)),
]
LLAMA3_TINY_SHAPES = [  # V=96, L=2, C=32, hd=8, qkv rows (4+2*2)*8=64, H=96
    ("wte", (96, 32)), ("ln_1.w", (2, 32)), ("attn.c_attn.w", (2, 64, 32)), ("attn.c_proj.w", (2, 32, 32)),
    ("ln_2.w", (2, 32)), ("mlp.c_fc.w", (2, 96, 32)), ("mlp.c_fc2.w", (2, 96, 32)),
    ("mlp.c_proj.w", (2, 32, 96)), ("ln_f.w", (32,)), ("lm_head.w", (96, 32)),
]
TINY_SHAPES = {"gpt2": GPT2_TINY_SHAPES, "llama3": LLAMA3_TINY_SHAPES}


def tiny(kind):
    return tiny_gpt2_header() if kind == "gpt2" else tiny_llama3_header()


def f32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def header_bytes(slots: list[int]) -> bytes:
    return struct.pack("<256i", *(list(slots) + [0] * (256 - len(slots))))


def model_slots(kind, h, version, float_slots="bits"):
    if kind == "gpt2":
        return [20240326, version, h.block_size, h.vocab_size, h.n_layer, h.n_head, h.n_embd, h.padded_vocab_size]
    conv = f32_bits if float_slots == "bits" else int  # "int": llm.c master's truncation
    return [20240803, version, h.block_size, h.vocab_size, h.n_layer, h.n_head, h.n_kv_head, h.n_embd,
            conv(h.ffn_dim_multiplier), h.multiple_of, conv(h.norm_eps), conv(h.rope_theta),
            int(h.use_scaled_rope), h.max_gen_batch_size, 3, 1]


def payload_bytes(kind, tensors, dtype):
    out = b""
    for name, _ in TINY_SHAPES[kind]:
        a = np.asarray(tensors[name], dtype=np.float32)
        out += a.astype("<f4").tobytes() if dtype == "float32" else a.astype(ml_dtypes.bfloat16).tobytes()
    return out


def hand_model(kind, h, tensors, dtype="float32", float_slots="bits") -> bytes:
    version = 3 if dtype == "float32" else 5
    return header_bytes(model_slots(kind, h, version, float_slots)) + payload_bytes(kind, tensors, dtype)


def bf16_round(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def put(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def assert_format_error(path, fragments, **kwargs):
    with pytest.raises(LlmcFormatError) as info:
        read_model(path, **kwargs)
    check_message(info.value, path, fragments)
    return str(info.value)


def check_message(err, path, fragments):
    msg = str(err)
    assert str(path) in msg and "\n" not in msg, msg
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in {msg!r}"


# ---------------------------------------------------------------------------
# headers


def test_tensor_shapes_follow_formats_md():
    assert tiny_gpt2_header().tensor_shapes() == GPT2_TINY_SHAPES
    assert tiny_llama3_header().tensor_shapes() == LLAMA3_TINY_SHAPES
    assert tiny_llama3_header().ffn_hidden() == 96
    gpt2_124m = GPT2Header(1024, 50257, 12, 12, 768, 50304)
    assert gpt2_124m.n_params() == 124475904  # llm.c's printed num_parameters
    llama_8b = Llama3Header(8192, 128256, 32, 32, 8, 4096, 1.3, 1024, 1e-5, 500000.0, True, 4)
    assert llama_8b.ffn_hidden() == 14336
    assert llama_8b.n_params() == 8030261248


# ---------------------------------------------------------------------------
# model files: reading hand-built files, writing byte-exact files, round trips


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_read_hand_built_model(tmp_path, kind, dtype):
    h = tiny(kind)
    tensors = random_tensors(h, seed=3)
    path = put(tmp_path, "model.bin", hand_model(kind, h, tensors, dtype))
    got_kind, got_h, got, got_dtype = read_model(path)
    assert (got_kind, got_h, got_dtype) == (kind, h, dtype)
    assert [(n, a.shape) for n, a in got.items()] == TINY_SHAPES[kind]
    for name, arr in got.items():
        assert arr.dtype == np.float32
        want = tensors[name] if dtype == "float32" else bf16_round(tensors[name])
        np.testing.assert_array_equal(arr, want, err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_write_model_is_byte_exact_and_round_trips(tmp_path, kind, dtype):
    h = tiny(kind)
    tensors = random_tensors(h, seed=4)
    path = tmp_path / "model.bin"
    write_model(path, kind, h, tensors, dtype=dtype)
    assert path.read_bytes() == hand_model(kind, h, tensors, dtype)
    got_kind, got_h, got, got_dtype = read_model(path)
    assert (got_kind, got_h, got_dtype) == (kind, h, dtype)
    for name in tensors:
        want = tensors[name] if dtype == "float32" else bf16_round(tensors[name])
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    # re-writing what was read reproduces the file exactly (bf16 -> f32 -> bf16 is lossless)
    write_model(tmp_path / "again.bin", kind, got_h, got, dtype=dtype)
    assert (tmp_path / "again.bin").read_bytes() == path.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["again.bin", "model.bin"]  # no temp files left


def test_bfloat16_rounding_matches_ml_dtypes():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4028235e38, -3.4028235e38, np.inf,
                        -np.inf, 0.0, -0.0, 1e-40, np.nan], dtype=np.float32)
    x = np.concatenate([bits.view(np.float32), special])
    ours = float32_to_bfloat16_bits(x)
    with np.errstate(invalid="ignore"):  # ml_dtypes warns when casting NaN
        ref = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    finite_or_inf = ~np.isnan(x)
    np.testing.assert_array_equal(ours[finite_or_inf], ref[finite_or_inf])
    assert (ours[~finite_or_inf] == 0x7FC0).all()  # PyTorch's canonical NaN
    # ties go to even: 1+2^-8 is halfway between 1 and 1+2^-7
    assert bfloat16_bits_to_float32(float32_to_bfloat16_bits(special[:3])).tolist() == [1.0, 1.0, 1 + 2**-6]
    np.testing.assert_array_equal(bfloat16_bits_to_float32(ref[finite_or_inf]), bf16_round(x[finite_or_inf]))


def test_gpt2_padded_wte_rows_written_as_zeros(tmp_path):
    h = tiny_gpt2_header()
    tensors = random_tensors(h, seed=5)
    clean = hand_model("gpt2", h, tensors)
    dirty = dict(tensors, wte=tensors["wte"].copy())
    dirty["wte"][h.vocab_size:] = 7.0
    write_model(tmp_path / "dirty.bin", "gpt2", h, dirty)
    assert (tmp_path / "dirty.bin").read_bytes() == clean
    unpadded = dict(tensors, wte=tensors["wte"][: h.vocab_size])  # (V, C) is accepted too
    write_model(tmp_path / "unpadded.bin", "gpt2", h, unpadded)
    assert (tmp_path / "unpadded.bin").read_bytes() == clean
    _, _, got, _ = read_model(tmp_path / "dirty.bin")
    assert not got["wte"][h.vocab_size:].any()


def test_write_model_rejects_bad_tensors_and_leaves_no_file(tmp_path):
    h = tiny_llama3_header()
    tensors = random_tensors(h, seed=6)
    path = tmp_path / "m.bin"
    with pytest.raises(LlmcFormatError, match="missing \\['lm_head.w'\\]"):
        write_model(path, "llama3", h, {k: v for k, v in tensors.items() if k != "lm_head.w"})
    with pytest.raises(LlmcFormatError, match="mlp.c_fc.w has shape"):
        write_model(path, "llama3", h, dict(tensors, **{"mlp.c_fc.w": tensors["mlp.c_fc2.w"][:, :5]}))
    with pytest.raises(ValueError, match="does not match header"):
        write_model(path, "gpt2", h, tensors)
    assert os.listdir(tmp_path) == []


def test_write_model_failure_keeps_previous_file(tmp_path, monkeypatch):
    h = tiny_gpt2_header()
    path = tmp_path / "m.bin"
    write_model(path, "gpt2", h, random_tensors(h, seed=7))
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(llmc_io.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        write_model(path, "gpt2", h, random_tensors(h, seed=8))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.bin"]


# ---------------------------------------------------------------------------
# bad model files


def _mutated(kind, slot_changes=None, cut=0, extra=0, version=3):
    h = tiny(kind)
    slots = model_slots(kind, h, version)
    for slot, value in (slot_changes or {}).items():
        slots[slot] = value
    data = header_bytes(slots) + payload_bytes(kind, random_tensors(h, seed=9), "float32")
    return data[: len(data) - cut] + b"\0" * extra


BAD_MODELS = {
    "empty": (b"", ["0 bytes", "shorter than the 1024-byte"]),
    "short": (b"\x01" * 1000, ["1000 bytes", "shorter than the 1024-byte"]),
    "unknown-magic": (_mutated("gpt2", {0: 12345}), ["unknown magic 12345", "20240326", "20240803"]),
    "state-magic": (_mutated("gpt2", {0: 20240327}), ["GPT-2 debug state", "read_state"]),
    "token-magic": (_mutated("gpt2", {0: 20240520}), ["token shard", "read_tokens"]),
    "gpt2-v1": (_mutated("gpt2", {1: 1}), ["version 1", "format without vocab padding",
                                          "re-export with a current train_gpt2.py"]),
    "gpt2-v2": (_mutated("gpt2", {1: 2}), ["version 2", "format without vocab padding"]),
    "gpt2-v4": (_mutated("gpt2", {1: 4}), ["unsupported gpt2 model file version 4", "3 (float32), 5 (bfloat16)"]),
    "llama-v7": (_mutated("llama3", {1: 7}), ["unsupported llama3 model file version 7", "read_state"]),
    "truncated": (_mutated("gpt2", cut=4), ["truncated by 4 bytes", "re-export"]),
    "oversized": (_mutated("llama3", extra=8), ["8 extra bytes"]),
    "bf16-size": (_mutated("gpt2", version=5), ["bfloat16 parameters", "extra bytes"]),
    "embd-not-div-head": (_mutated("gpt2", {5: 5}), ["n_embd 32 is not divisible by n_head 5"]),
    "zero-layers": (_mutated("gpt2", {4: 0}), ["n_layer = 0 must be a positive integer"]),
    "negative-vocab": (_mutated("llama3", {3: -5}), ["vocab_size = -5 must be a positive integer"]),
    "padded-lt-vocab": (_mutated("gpt2", {7: 64}), ["padded_vocab_size 64 is smaller than vocab_size 100"]),
    "head-not-div-kv": (_mutated("llama3", {6: 3}), ["n_head 4 is not divisible by n_kv_head 3"]),
    "scaled-rope-2": (_mutated("llama3", {12: 2}), ["use_scaled_rope (slot 12) = 2"]),
    "negative-eps": (_mutated("llama3", {10: f32_bits(-1e-5)}), ["nonsensical header: slot 10 norm_eps = -1e-05 is outside", "--norm_eps"]),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_bad_model_files_raise_clear_errors(tmp_path, case):
    data, fragments = BAD_MODELS[case]
    assert_format_error(put(tmp_path, f"{case}.bin", data), fragments)


def test_llmc_master_truncated_llama_header(tmp_path):
    h = tiny_llama3_header()
    tensors = random_tensors(h, seed=10)
    path = put(tmp_path, "llmc_master.bin", hand_model("llama3", h, tensors, float_slots="int"))
    msg = assert_format_error(path, ["truncated integers", "train_llama3.py", "--norm_eps", "--rope_theta",
                                     "--ffn_dim_multiplier", "slot 8", "slot 10", "slot 11", "holds int 10000"])
    assert "holds int 0" in msg  # norm_eps 1e-5 became 0
    # partial overrides: the still-missing slots are named, the given one is not
    msg = assert_format_error(path, ["slot 8", "slot 11"], norm_eps=1e-5)
    assert "slot 10" not in msg
    kind, got_h, got, _ = read_model(path, norm_eps=1e-5, rope_theta=10000.0, ffn_dim_multiplier=1.0)
    assert (kind, got_h) == ("llama3", h)
    for name in tensors:
        np.testing.assert_array_equal(got[name], tensors[name])
    with pytest.raises(LlmcFormatError, match="override norm_eps=0.0"):
        read_model(path, norm_eps=0.0, rope_theta=10000.0, ffn_dim_multiplier=1.0)


def test_truncated_8b_header_detected_before_size_check(tmp_path):
    # llm.c master's LLaMA-3.1-8B header: 1.3 -> 1, 1e-5 -> 0, 500000.0 -> 500000; no tensors
    h = Llama3Header(8192, 128256, 32, 32, 8, 4096, 1.3, 1024, 1e-5, 500000.0, True, 4)
    path = put(tmp_path, "8b.bin", header_bytes(model_slots("llama3", h, 3, float_slots="int")))
    assert_format_error(path, ["holds int 1 ", "holds int 0 ", "holds int 500000 ", "--rope_theta"])
    # with the right overrides the header is accepted and the size check names the real size
    assert_format_error(path, ["truncated by 32121044992 bytes"], norm_eps=1e-5, rope_theta=500000.0,
                        ffn_dim_multiplier=1.3)


def test_overrides_replace_valid_llama_values_and_reject_gpt2(tmp_path):
    h = tiny_llama3_header()
    path = tmp_path / "m.bin"
    write_model(path, "llama3", h, random_tensors(h, seed=11))
    assert read_model(path, norm_eps=1e-6)[1].norm_eps == 1e-6
    g = tiny_gpt2_header()
    write_model(tmp_path / "g.bin", "gpt2", g, random_tensors(g, seed=11))
    with pytest.raises(ValueError, match="LLaMA-3 files only"):
        read_model(tmp_path / "g.bin", norm_eps=1e-5)


# ---------------------------------------------------------------------------
# debug state files


def hand_state(kind, h, x, y, logits, loss, grads) -> bytes:
    B, T = x.shape
    slots = [20240327, 2, B, T] if kind == "gpt2" else [20240803, B, T]
    out = header_bytes(slots) + x.astype("<i4").tobytes() + y.astype("<i4").tobytes()
    out += logits.astype("<f4").tobytes() + struct.pack("<f", loss)
    return out + payload_bytes(kind, grads, "float32")


@pytest.fixture(scope="module")
def reference_runs():
    runs = {}
    for kind in KINDS:
        h = tiny(kind)
        tensors = random_tensors(h, seed=12)
        x, y = random_batch(h, B=2, T=8, seed=13)
        runs[kind] = (h, tensors, x, y, *forward_backward(kind, h, tensors, x, y))
    return runs


@pytest.mark.parametrize("kind", KINDS)
def test_state_round_trip_and_bytes(tmp_path, reference_runs, kind):
    h, _, x, y, logits, loss, grads = reference_runs[kind]
    path = tmp_path / "state.bin"
    write_state(path, kind, h, x, y, logits, loss, grads)
    assert path.read_bytes() == hand_state(kind, h, x, y, logits, loss, grads)
    state = read_state(path, kind, h)
    np.testing.assert_array_equal(state["x"], x)
    np.testing.assert_array_equal(state["y"], y)
    np.testing.assert_array_equal(state["logits"], logits.astype(np.float32))
    assert state["loss"] == float(np.float32(loss))
    assert list(state["grads"]) == [n for n, _ in TINY_SHAPES[kind]]
    for name, g in grads.items():
        np.testing.assert_array_equal(state["grads"][name], g.astype(np.float32), err_msg=name)


def test_gpt2_state_with_unpadded_logits(tmp_path, reference_runs):
    # llm.c's own train_gpt2.py / test_gpt2.c store logits over V, not Vp: both are accepted
    h, _, x, y, logits, loss, grads = reference_runs["gpt2"]
    path = tmp_path / "state.bin"
    write_state(path, "gpt2", h, x, y, logits[..., : h.vocab_size], loss, grads)
    state = read_state(path, "gpt2", h)
    assert state["logits"].shape == (2, 8, h.vocab_size)
    assert not state["grads"]["wte"][h.vocab_size:].any()


def test_bad_state_files(tmp_path, reference_runs):
    h, tensors, x, y, logits, loss, grads = reference_runs["gpt2"]
    good = hand_state("gpt2", h, x, y, logits, loss, grads)

    def expect(name, data, fragments, header=h, kind="gpt2"):
        path = put(tmp_path, name, data)
        with pytest.raises(LlmcFormatError) as info:
            read_state(path, kind, header)
        check_message(info.value, path, fragments)

    expect("short.bin", good[:100], ["shorter than the 1024-byte"])
    expect("model.bin", hand_model("gpt2", h, tensors), ["magic 20240326", "not a gpt2 debug state file"])
    expect("v1.bin", header_bytes([20240327, 1, 2, 8]) + good[1024:], ["version 1"])
    expect("truncated.bin", good[:-4], ["logits over 100", "logits over 128", "does not fit"])
    small = GPT2Header(4, 100, 2, 4, 32, 128)
    expect("long_t.bin", good, ["T=8 exceeds the model's block_size 4"], header=small)
    bigger_vocab = GPT2Header(16, 100, 2, 4, 32, 256)
    expect("vocab.bin", good, ["logits' vocab does not fit"], header=bigger_vocab)
    bad_x = bytearray(good)
    bad_x[1024:1028] = struct.pack("<i", 100)
    expect("bad_x.bin", bytes(bad_x), ["x holds token ids", "outside the vocab [0, 100)"])
    lh, _, lx, ly, llogits, lloss, lgrads = reference_runs["llama3"]
    expect("llama_as_gpt2.bin", hand_state("llama3", lh, lx, ly, llogits, lloss, lgrads),
           ["magic 20240803", "not a gpt2 debug state file"])


# ---------------------------------------------------------------------------
# token shards


def test_tokens_round_trip_and_bytes(tmp_path):
    tokens = np.array([50256, 0, 1, 65535, 464], dtype=np.uint16)
    path = tmp_path / "shard.bin"
    write_tokens(path, tokens.astype(np.int64))
    assert path.read_bytes() == header_bytes([20240520, 1, 5]) + tokens.astype("<u2").tobytes()
    got = read_tokens(path)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, tokens)


@pytest.mark.parametrize(
    "case, data, fragments",
    [
        ("empty", header_bytes([20240520, 1, 0]), ["0 tokens", "empty shard"]),
        ("short", b"\0" * 10, ["10 bytes", "shorter than"]),
        ("magic", header_bytes([20240326, 1, 2]) + b"\0" * 4, ["GPT-2 model file", "20240520"]),
        ("llama-size", header_bytes([20240801, 7, 2]) + b"\0" * 4, ["truncated by 4 bytes", "uint32 tokens"]),
        ("llama-version", header_bytes([20240801, 1, 2]) + b"\0" * 8, ["LLaMA-3 token shard version 1"]),
        ("version", header_bytes([20240520, 2, 2]) + b"\0" * 4, ["version 2"]),
        ("size", header_bytes([20240520, 1, 10]) + b"\0" * 16, ["truncated by 4 bytes"]),
    ],
)
def test_bad_token_shards(tmp_path, case, data, fragments):
    path = put(tmp_path, f"{case}.bin", data)
    with pytest.raises(LlmcFormatError) as info:
        read_tokens(path)
    check_message(info.value, path, fragments)


def test_write_tokens_rejects_bad_input(tmp_path):
    for bad, match in [(np.array([70000]), "outside uint16"), (np.array([], np.int32), "non-empty"),
                       (np.zeros((2, 2), np.int32), "1-D"), (np.array([1.5]), "dtype")]:
        with pytest.raises(LlmcFormatError, match=match):
            write_tokens(tmp_path / "t.bin", bad)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# the float64 reference itself


@pytest.mark.parametrize("kind", KINDS)
def test_reference_backward_matches_finite_differences(kind):
    h = tiny(kind)
    params = {k: v.astype(np.float64) for k, v in random_tensors(h, seed=14, std=0.1).items()}
    x, y = random_batch(h, B=2, T=8, seed=15)
    _, _, grads = forward_backward(kind, h, params, x, y)
    rng = np.random.default_rng(16)
    step = 1e-3
    for name, arr in params.items():
        for _ in range(3):
            idx = tuple(int(rng.integers(0, s)) for s in arr.shape)

            def loss_at(delta):
                bumped = arr.copy()
                bumped[idx] += delta
                return forward_backward(kind, h, dict(params, **{name: bumped}), x, y)[1]

            # 4-point stencil: truncation error O(step^4), far below the 1e-6 tolerance
            fd = (8 * (loss_at(step) - loss_at(-step)) - (loss_at(2 * step) - loss_at(-2 * step))) / (12 * step)
            analytic = grads[name][idx]
            # relative error; below |g| ~ 1e-6 this is an absolute 1e-12 (the stencil's round-off floor)
            rel = abs(fd - analytic) / max(abs(fd), abs(analytic), 1e-6)
            assert rel < 1e-6, (name, idx, fd, analytic)


def test_reference_gpt2_loss_ignores_padded_vocab():
    h = tiny_gpt2_header()
    tensors = random_tensors(h, seed=17)
    x, y = random_batch(h, B=2, T=5, seed=18)
    zero = {k: np.zeros_like(v) for k, v in tensors.items()}
    zero.update({k: np.ones_like(tensors[k]) for k in ("ln_1.w", "ln_2.w", "ln_f.w")})
    _, loss, _ = forward_backward("gpt2", h, zero, x, y)
    assert loss == pytest.approx(math.log(h.vocab_size), abs=1e-12)  # log V, not log Vp
    logits0, loss0, grads0 = forward_backward("gpt2", h, tensors, x, y)
    dirty = dict(tensors, wte=tensors["wte"].copy())
    dirty["wte"][h.vocab_size:] = 5.0
    logits1, loss1, grads1 = forward_backward("gpt2", h, dirty, x, y)
    assert logits1.shape == (2, 5, h.padded_vocab_size) and np.abs(logits1[..., h.vocab_size:]).min() > 0
    np.testing.assert_array_equal(logits1[..., : h.vocab_size], logits0[..., : h.vocab_size])
    assert loss1 == loss0
    assert not grads1["wte"][h.vocab_size:].any() and not grads0["wte"][h.vocab_size:].any()


@pytest.mark.parametrize("kind", KINDS)
def test_reference_is_causal(kind):
    h = tiny(kind)
    tensors = random_tensors(h, seed=19)
    x, y = random_batch(h, B=1, T=6, seed=20)
    x2 = x.copy()
    x2[0, -1] = (x2[0, -1] + 1) % h.vocab_size
    a, _, _ = forward_backward(kind, h, tensors, x, y)
    b, _, _ = forward_backward(kind, h, tensors, x2, y)
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], rtol=0, atol=1e-12)
    assert np.abs(a[:, -1] - b[:, -1]).max() > 1e-6


def test_reference_gqa_equals_mha_with_repeated_kv_heads():
    g = tiny_llama3_header()  # 4 query heads share 2 kv heads: head i uses kv head i // 2
    m = dataclasses.replace(g, n_kv_head=4)
    tg = random_tensors(g, seed=21)
    C, hd = g.n_embd, g.head_dim
    w = tg["attn.c_attn.w"]
    k = w[:, C : C + 2 * hd].reshape(2, 2, hd, C)
    v = w[:, C + 2 * hd :].reshape(2, 2, hd, C)
    rep = lambda a: np.repeat(a, 2, axis=1).reshape(2, 4 * hd, C)  # noqa: E731
    tm = dict(tg, **{"attn.c_attn.w": np.concatenate([w[:, :C], rep(k), rep(v)], axis=1)})
    x, y = random_batch(g, B=2, T=7, seed=22)
    lg, loss_g, _ = forward_backward("llama3", g, tg, x, y)
    lm, loss_m, _ = forward_backward("llama3", m, tm, x, y)
    np.testing.assert_allclose(lg, lm, rtol=0, atol=1e-12)


def test_rope_frequencies_llama31_scaling():
    base = rope_frequencies(128, 500000.0, False)
    scaled = rope_frequencies(128, 500000.0, True)
    assert base[0] == 1.0 and scaled[0] == 1.0
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / 4
    low = wavelen > 8192
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    np.testing.assert_array_equal(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-15)
    smooth = (8192 / wavelen[mid] - 1) / 3
    np.testing.assert_allclose(scaled[mid], (1 - smooth) * base[mid] / 8 + smooth * base[mid], rtol=1e-15)
    assert (scaled[mid] < base[mid]).all() and (scaled[mid] > base[mid] / 8).all()


def test_format_page_holds_the_generated_tables():
    from pathlib import Path
    from remat_lm.models import llmc
    page = (Path(__file__).parent.parent / "docs" / "llmc-format.md").read_text()
    assert llmc.format_markdown() in page
