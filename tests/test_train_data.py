"""remat_lm.training.data: token shards and byte-level text, deterministic batches, the default corpus."""
import numpy as np
import pytest

from remat_lm.models.llmc_io import LlmcFormatError, write_tokens
from remat_lm.training import UsageError
from remat_lm.training.data import BYTE_VOCAB, default_corpus, load


def test_default_corpus_is_the_stdlib_source_without_tests():
    files = default_corpus()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f or "/test/" in f for f in files)
    assert any(f.endswith("/json/__init__.py") for f in files)


def test_text_is_bytes(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello \xff world")
    ds = load([str(tmp_path / "a.txt")])
    assert ds.kind == "text" and ds.vocab_needed == 256 and ds.n_tokens == 13
    assert ds.streams[0].dtype == np.uint8 and BYTE_VOCAB == 256


def test_text_files_are_concatenated_in_order(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"abc")
    (tmp_path / "b.txt").write_bytes(b"def")
    ds = load([str(tmp_path / "b.txt"), str(tmp_path / "a.txt")])
    assert bytes(ds.streams[0]) == b"defabc" and ds.vocab_needed == ord("f") + 1


def test_shards_by_glob(tmp_path):
    write_tokens(tmp_path / "s_0.bin", np.arange(100) % 50)
    write_tokens(tmp_path / "s_1.bin", np.arange(200) % 70)
    ds = load([str(tmp_path / "s_*.bin")])
    assert ds.kind == "tokens" and [len(s) for s in ds.streams] == [100, 200] and ds.vocab_needed == 70
    np.testing.assert_array_equal(np.asarray(ds.streams[1][:5]), [0, 1, 2, 3, 4])


def test_shard_errors_are_llmc_format_errors(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\1" * 3000)
    with pytest.raises(LlmcFormatError, match="magic"):
        load([str(tmp_path / "x.bin")])


def test_batches_are_deterministic_and_shifted(tmp_path):
    write_tokens(tmp_path / "s.bin", np.arange(1000) % 256)
    ds = load([str(tmp_path / "s.bin")])
    x, y = ds.batch(index=3, seed=1, batch_size=4, seq_len=16, accum=2)
    assert x.shape == y.shape == (2, 4, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])
    np.testing.assert_array_equal((x + 1) % 256, y)  # consecutive tokens of the shard
    x2, _ = ds.batch(index=3, seed=1, batch_size=4, seq_len=16, accum=2)
    np.testing.assert_array_equal(x, x2)
    assert not np.array_equal(x, ds.batch(index=4, seed=1, batch_size=4, seq_len=16, accum=2)[0])
    assert not np.array_equal(x, ds.batch(index=3, seed=2, batch_size=4, seq_len=16, accum=2)[0])


def test_windows_never_cross_streams(tmp_path):
    write_tokens(tmp_path / "a.bin", np.full(40, 1))
    write_tokens(tmp_path / "b.bin", np.full(40, 2))
    ds = load([str(tmp_path / "a.bin"), str(tmp_path / "b.bin")])
    for i in range(20):
        x, y = ds.batch(i, 0, 8, 16, 1)
        w = np.concatenate([x[0], y[0][:, -1:]], axis=1)
        assert all(len(set(row.tolist())) == 1 for row in w)


def test_eval_batches_tile_the_stream(tmp_path):
    write_tokens(tmp_path / "v.bin", np.arange(1000) % 256)
    ds = load([str(tmp_path / "v.bin")])
    x0, _ = ds.eval_batch(0, 2, 10)
    x1, _ = ds.eval_batch(1, 2, 10)
    np.testing.assert_array_equal(np.concatenate([x0, x1]).ravel(), np.arange(40))


def test_split_tail_and_checks(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(200)) * 10)
    ds = load([str(tmp_path / "a.txt")])
    train, val = ds.split_tail(0.02, 33)
    assert train.n_tokens + val.n_tokens == 2000 and val.n_tokens == 40
    with pytest.raises(UsageError, match="vocab_size is 100"):
        ds.check(100, 16)
    with pytest.raises(UsageError, match="needs at least 2001"):
        ds.check(256, 2000)
    with pytest.raises(UsageError, match="too short to hold out"):
        ds.split_tail(0.5, 1500)


class _Counting:
    """A token stream that records which windows are sliced out of it."""

    def __init__(self, a, log):
        self.a, self.log = a, log

    def __len__(self):
        return len(self.a)

    def __getitem__(self, s):
        self.log.append((s.start, s.stop))
        return self.a[s]


def test_rows_are_the_same_rows_and_only_those_are_read(tmp_path):
    """`rows=` (a process's share of the batch) gives the rows of the whole batch and reads only them."""
    import dataclasses

    write_tokens(tmp_path / "s.bin", np.arange(5000) % 256)
    ds = load([str(tmp_path / "s.bin")])
    x, y = ds.batch(index=5, seed=3, batch_size=8, seq_len=16, accum=2)
    ex, ey = ds.eval_batch(2, 8, 16)
    log = []
    counted = dataclasses.replace(ds, streams=(_Counting(ds.streams[0], log),))
    xr, yr = counted.batch(index=5, seed=3, batch_size=8, seq_len=16, accum=2, rows=slice(4, 6))
    np.testing.assert_array_equal(xr, x[:, 4:6])
    np.testing.assert_array_equal(yr, y[:, 4:6])
    assert len(log) == 2 * 2  # accum x rows windows, not accum x batch
    log.clear()
    exr, _ = counted.eval_batch(2, 8, 16, rows=slice(6, 8))
    np.testing.assert_array_equal(exr, ex[6:8])
    assert len(log) == 2
