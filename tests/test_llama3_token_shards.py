"""llm.c's LLaMA-3 token shards (uint32, magic 20240801, version 7) next to its GPT-2 ones (uint16,
magic 20240520, version 1): read, written, trained on, and refused with one line when they do not
fit the model.

The shards here are made by `llmc_reference.llmc_write_datafile`, which does what llm.c's
`dev/data/data_common.py` `write_datafile` does, independently of `remat_lm.models.llmc_io`.
"""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import train
from llmc_reference import llmc_write_datafile
from remat_lm.models.llmc_io import LlmcFormatError, read_tokens, token_format, write_tokens
from remat_lm.training.data import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_VOCAB = 128256  # LLaMA-3's tokenizer (llm.c's train_llama3.py)
BOS = 128000           # <|begin_of_text|>
LLAMA = "llm.c LLaMA-3 shard (uint32, magic 20240801)"
GPT2 = "llm.c GPT-2 shard (uint16, magic 20240520)"


def _llama3_tokens(n, seed=0):
    """Documents of LLaMA-3 ids, each starting with BOS, most ids above uint16's range."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, LLAMA3_VOCAB, n)
    toks[::100] = BOS
    return toks.tolist()


def _exit2(argv, capsys, tmp_path):
    """train.main(argv) must exit 2 with one 'train.py: error:' line, no traceback, nothing written."""
    before = sorted(os.listdir(tmp_path))
    argv = list(argv) + ["--no-progress", "--checkpoint_dir", str(tmp_path / "ck"),
                         "--log_jsonl", str(tmp_path / "out" / "log.jsonl")]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2
    _, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == before, "a usage error must write nothing"
    return lines[0]


# ------------------------------------------------------------------------------------------------
# Reading and writing both formats


@pytest.mark.parametrize("kind, desc, dtype", [("gpt2", "gpt-2", np.uint16), ("llama3", "llama-3", np.uint32)])
def test_round_trip_is_llmc_byte_for_byte(tmp_path, kind, desc, dtype):
    """write_tokens(kind=) makes the bytes llm.c's writer makes; read_tokens gives them back, in their dtype."""
    toks = [0, 1, 50256, 65535] if kind == "gpt2" else [0, 65535, 65536, BOS, LLAMA3_VOCAB - 1]
    ours, theirs = tmp_path / "ours.bin", tmp_path / "theirs.bin"
    write_tokens(ours, np.array(toks, np.int64), kind=kind)
    llmc_write_datafile(str(theirs), toks, desc)
    assert ours.read_bytes() == theirs.read_bytes()
    for mmap in (False, True):
        got = read_tokens(theirs, mmap=mmap)
        assert got.dtype == dtype and got.tolist() == toks
    fmt, n = token_format(theirs)
    assert (fmt.kind, fmt.magic, fmt.version, n) == ((kind, 20240520, 1, 4) if kind == "gpt2"
                                                      else (kind, 20240801, 7, 5))


def test_dataset_of_llama3_shards_keeps_ids_above_uint16(tmp_path):
    """The training batches of a LLaMA-3 shard hold its ids (> 65535) exactly, from a uint32 memory map."""
    toks = _llama3_tokens(3000)
    llmc_write_datafile(str(tmp_path / "s.bin"), toks, "llama-3")
    ds = load([str(tmp_path / "s.bin")])
    assert isinstance(ds.streams[0], np.memmap) and ds.streams[0].dtype == np.uint32
    assert ds.vocab_needed == max(toks) + 1 > 65536 and ds.token_format.words() == LLAMA
    x, y = ds.eval_batch(0, 4, 16)
    np.testing.assert_array_equal(x.ravel(), toks[:64])
    np.testing.assert_array_equal(y.ravel(), toks[1:65])
    ds.check(LLAMA3_VOCAB, 16)  # fits LLaMA-3's vocab


@pytest.mark.parametrize("case, cut, fragments", [
    ("truncated", 4, ["truncated by 4 bytes", "uint32 tokens of an " + LLAMA]),
    ("half-token", 2, ["truncated by 2 bytes"]),
    ("version", 0, ["unsupported LLaMA-3 token shard version 6 (expected 7 with magic 20240801)"]),
])
def test_damaged_llama3_shard(tmp_path, case, cut, fragments):
    path = tmp_path / f"{case}.bin"
    llmc_write_datafile(str(path), _llama3_tokens(500), "llama-3")
    data = bytearray(path.read_bytes())
    if case == "version":
        data[4:8] = np.int32(6).tobytes()  # the version slot
    path.write_bytes(bytes(data[:len(data) - cut]))
    with pytest.raises(LlmcFormatError) as info:
        read_tokens(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg and all(f in msg for f in fragments), msg


def test_unknown_magic_names_both_formats(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(np.array([12345, 1, 2] + [0] * 253, "<i4").tobytes() + b"\0" * 4)
    with pytest.raises(LlmcFormatError, match=r"unknown magic 12345; known token shard magics: "
                                              r"20240520 \(GPT-2, uint16\), 20240801 \(LLaMA-3, uint32\)"):
        read_tokens(path)


def test_write_tokens_checks_the_range_of_the_format(tmp_path):
    with pytest.raises(LlmcFormatError, match="outside uint16.*write kind='llama3'"):
        write_tokens(tmp_path / "t.bin", np.array([BOS]))
    with pytest.raises(LlmcFormatError, match="outside uint32"):
        write_tokens(tmp_path / "t.bin", np.array([-1]), kind="llama3")
    with pytest.raises(ValueError, match="kind must be one of 'gpt2', 'llama3'"):
        write_tokens(tmp_path / "t.bin", np.array([1]), kind="llama-3")
    assert os.listdir(tmp_path) == []


def test_token_shards_load_no_jax(tmp_path):
    """Token shards stay NumPy only: writing and reading a LLaMA-3 one imports no JAX."""
    code = ("import sys, numpy as np; from remat_lm.models.llmc_io import read_tokens, write_tokens; "
            "write_tokens(sys.argv[1], np.array([70000, 1]), kind='llama3'); "
            "assert read_tokens(sys.argv[1]).tolist() == [70000, 1]; print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s.bin")], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# ------------------------------------------------------------------------------------------------
# train.py


@pytest.mark.slow  # a train.py run, ~25 s; the shard reading stays fast above
def test_llmc_llama3_shard_trains(tmp_path):
    """A real train.py run: LLaMA-3 tiny with LLaMA-3's vocabulary on shards llm.c's writer made."""
    llmc_write_datafile(str(tmp_path / "train_000.bin"), _llama3_tokens(4000, seed=1), "llama-3")
    llmc_write_datafile(str(tmp_path / "val_000.bin"), _llama3_tokens(1000, seed=2), "llama-3")
    log = tmp_path / "log.jsonl"
    args = ["--model", "llama3", "--preset", "tiny", "--vocab_size", str(LLAMA3_VOCAB), "--num_iterations", "3",
            "--batch_size", "4", "--sequence_length", "32", "--data", str(tmp_path / "train_*.bin"),
            "--val_data", str(tmp_path / "val_000.bin"), "--val_every", "3", "--val_steps", "1",
            "--log_jsonl", str(log), "--no-progress"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    first = next(r["loss"] for r in rows if "loss" in r)
    # a fresh model over 128256 ids starts near ln(128256) = 11.76: the uint32 ids reached the loss
    assert abs(first - math.log(LLAMA3_VOCAB)) < 0.5, first
    assert math.isfinite(next(r["val_loss"] for r in rows if "val_loss" in r))


def test_llama3_shard_on_a_gpt2_model_is_refused(capsys, tmp_path_factory, tmp_path):
    shard = tmp_path_factory.mktemp("d") / "llama3_tokens.bin"
    llmc_write_datafile(str(shard), _llama3_tokens(2000), "llama-3")
    line = _exit2(["--model", "gpt2", "--vocab_size", "50257", "--data", str(shard)], capsys, tmp_path)
    for part in (f"--data {shard} ({LLAMA})", "the model's vocab_size is 50257",
                 "--model llama3 --preset 1b (vocab 128256)", f"--vocab_size >= {max(_llama3_tokens(2000)) + 1}"):
        assert part in line, line


def test_gpt2_shard_on_a_small_llama3_model_is_refused(capsys, tmp_path_factory, tmp_path):
    shard = tmp_path_factory.mktemp("d") / "gpt2_tokens.bin"
    toks = np.arange(3000) * 17 % 50257
    toks[::100] = 50256  # <|endoftext|>
    llmc_write_datafile(str(shard), toks.tolist(), "gpt-2")
    line = _exit2(["--model", "llama3", "--data", str(shard)], capsys, tmp_path)
    for part in (f"--data {shard} ({GPT2}) holds token ids up to 50256", "the model's vocab_size is 256",
                 "--model gpt2 --preset d12 (vocab 50257)"):
        assert part in line, line


def test_ids_beyond_every_vocab_name_no_model(capsys, tmp_path_factory, tmp_path):
    """A uint32 id no LLaMA-3 model holds: the fix is --vocab_size or other data, not --model llama3."""
    shard = tmp_path_factory.mktemp("d") / "odd.bin"
    llmc_write_datafile(str(shard), [1, 2, 3] * 100 + [200000], "llama-3")
    line = _exit2(["--model", "llama3", "--data", str(shard)], capsys, tmp_path)
    assert "--vocab_size >= 200001" in line and "--model" not in line.split(";")[1], line


def test_mixed_formats_are_refused(capsys, tmp_path_factory, tmp_path):
    d = tmp_path_factory.mktemp("d")
    llmc_write_datafile(str(d / "a.bin"), [1, 2, 3] * 100, "gpt-2")
    llmc_write_datafile(str(d / "b.bin"), [1, 2, 3] * 100, "llama-3")
    line = _exit2(["--model", "llama3", "--data", str(d / "*.bin")], capsys, tmp_path)
    assert f"mixes token shard formats: {d / 'a.bin'} is an {GPT2}, {d / 'b.bin'} an {LLAMA}" in line, line
    line = _exit2(["--model", "llama3", "--data", str(d / "a.bin"), "--val_data", str(d / "b.bin")],
                  capsys, tmp_path)
    assert f"--val_data {d / 'b.bin'} is an {LLAMA} but --data is an {GPT2}" in line, line


def test_truncated_llama3_shard_exits_2(capsys, tmp_path_factory, tmp_path):
    shard = tmp_path_factory.mktemp("d") / "cut.bin"
    llmc_write_datafile(str(shard), _llama3_tokens(2000), "llama-3")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 6)
    line = _exit2(["--model", "llama3", "--vocab_size", str(LLAMA3_VOCAB), "--data", str(shard)], capsys, tmp_path)
    assert f"--data {shard}: file is" in line and "truncated by 6 bytes" in line and LLAMA in line, line
