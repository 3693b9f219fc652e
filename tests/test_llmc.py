"""remat_lm.models.llmc: load/save for the Flax models, and `python -m remat_lm.llmc verify` against reference states.

Reference states come from tests/llmc_reference.py, an independent float64 NumPy forward and
hand-written backward (checked by finite differences in test_llmc_io.py).
"""
import subprocess
import sys

import numpy as np
import pytest

import llmc_reference as ref
from remat_lm import llmc as llmc_cli
from remat_lm.models import llmc
from remat_lm.models.llmc_io import read_model, write_model, write_state

KINDS = {"gpt2": ref.tiny_gpt2_header, "llama3": ref.tiny_llama3_header}


@pytest.fixture(scope="module", params=list(KINDS))
def files(request, tmp_path_factory):
    kind = request.param
    header = KINDS[kind]()
    tensors = ref.random_tensors(header, seed=1)
    x, y = ref.random_batch(header, 2, 8, seed=2)
    logits, loss, grads = ref.forward_backward(kind, header, tensors, x, y)
    d = tmp_path_factory.mktemp(kind)
    write_model(d / "model.bin", kind, header, tensors)
    write_state(d / "state.bin", kind, header, x, y, logits.astype(np.float32), np.float32(loss),
                {k: v.astype(np.float32) for k, v in grads.items()})
    return kind, header, d


RECOMPUTE_FLAGS = [
    [], ["--activation_recompute"],
    ["--activation_recompute", "--recompute_method", "uniform", "--recompute_num_layers", "2"],
    ["--activation_recompute", "--recompute_method", "block", "--recompute_num_layers", "1"],
    ["--activation_recompute", "--use_reentrant"],
    ["--activation_recompute", "--recompute_granularity", "selective", "--recompute_modules", "core_attn,mlp"],
    ["--activation_recompute", "--scan_layers", "--recompute_method", "uniform", "--recompute_num_layers", "2"],
    ["--activation_recompute", "--loss_chunk", "3"],  # T=8: chunks of 3, 3 and a remainder of 2
]


# Fast: none, full and the scanned uniform stack per family; the rest (uniform and block on
# the loop, reentrant, selective, the chunked loss) with the slow set: tests/test_models.py compares each of
# those with no remat, and test_flag_to_program shows each flag reaches the compiled program.
FAST_FLAGS = (0, 1, 6)


@pytest.mark.parametrize("flags", [pytest.param(f, marks=() if i in FAST_FLAGS else pytest.mark.slow)
                                   for i, f in enumerate(RECOMPUTE_FLAGS)], ids=lambda f: " ".join(f) or "none")
def test_verify_passes_for_every_recompute_setting(files, flags, capsys):
    kind, _, d = files
    assert llmc_cli.main(["verify", str(d / "model.bin"), str(d / "state.bin"), *flags]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "attn.c_attn.w" in out and "loss" in out


def test_verify_fails_on_a_wrong_reference(files, tmp_path, capsys):
    kind, header, d = files
    st = llmc.load_state(d / "state.bin", llmc.load(d / "model.bin")[0])
    st["grads"]["ln_f.w"] = st["grads"]["ln_f.w"] + 1e-2
    write_state(tmp_path / "bad.bin", kind, header, st["x"], st["y"], st["logits"], st["loss"], st["grads"])
    assert llmc_cli.main(["verify", str(d / "model.bin"), str(tmp_path / "bad.bin")]) == 1
    assert "failing: ln_f.w" in capsys.readouterr().out


def test_save_after_load_is_byte_identical(files, tmp_path):
    kind, _, d = files
    for scan in (False, True):
        config, params = llmc.load(d / "model.bin", scan_layers=scan)
        llmc.save(tmp_path / "again.bin", config, params)
        assert (tmp_path / "again.bin").read_bytes() == (d / "model.bin").read_bytes()
    config, params = llmc.load(d / "model.bin")
    llmc.save(tmp_path / "bf16.bin", config, params, dtype="bfloat16")
    _, _, t16, dt = read_model(tmp_path / "bf16.bin")
    _, _, t32, _ = read_model(d / "model.bin")
    assert dt == "bfloat16"
    for k in t32:  # bf16 keeps 8 mantissa bits: relative rounding <= 2^-8
        np.testing.assert_allclose(t16[k], t32[k], rtol=2 ** -8, atol=0)


def _bad(tmp_path, files):
    kind, header, d = files
    good = (d / "model.bin").read_bytes()
    cases = {
        "truncated": (good[:-8], "truncated"),
        "magic": (b"\x00" * 4 + good[4:], "magic"),
        "oversized": (good + b"\x00" * 8, "bytes"),
        "short": (good[:100], "1024"),
    }
    if kind == "gpt2":
        v1 = bytearray(good); v1[4:8] = np.int32(1).tobytes()
        cases["old-version"] = (bytes(v1), "re-export with a current train_gpt2.py")
    else:
        tr = bytearray(good)
        tr[40:44] = np.int32(0).tobytes()  # norm_eps written as a truncated integer (1e-5 -> 0)
        cases["truncated-float-slot"] = (bytes(tr), "--norm_eps")
    return cases


def test_bad_files_exit_2_with_one_line(files, tmp_path, capsys):
    kind, _, d = files
    for name, (data, needle) in _bad(tmp_path, files).items():
        p = tmp_path / f"{name}.bin"
        p.write_bytes(data)
        assert llmc_cli.main(["verify", str(p), str(d / "state.bin")]) == 2, name
        err = capsys.readouterr().err
        assert needle in err and str(p) in err and err.count("\n") == 1, (name, err)


def test_state_that_does_not_fit_the_model(files, tmp_path, capsys):
    kind, header, d = files
    other = ref.tiny_llama3_header() if kind == "gpt2" else ref.tiny_gpt2_header()
    okind = "llama3" if kind == "gpt2" else "gpt2"
    t = ref.random_tensors(other, seed=3)
    x, y = ref.random_batch(other, 1, 4, seed=3)
    lg, ls, gr = ref.forward_backward(okind, other, t, x, y)
    write_state(tmp_path / "foreign.bin", okind, other, x, y, lg.astype(np.float32), np.float32(ls),
                {k: v.astype(np.float32) for k, v in gr.items()})
    assert llmc_cli.main(["verify", str(d / "model.bin"), str(tmp_path / "foreign.bin")]) == 2
    assert capsys.readouterr().err.startswith("python -m remat_lm.llmc verify: error: ")


def test_truncated_llama_header_accepts_overrides(tmp_path):
    header = ref.tiny_llama3_header()
    tensors = ref.random_tensors(header, seed=1)
    write_model(tmp_path / "m.bin", "llama3", header, tensors)
    raw = bytearray((tmp_path / "m.bin").read_bytes())
    raw[40:44] = np.int32(0).tobytes()
    (tmp_path / "t.bin").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="--norm_eps"):
        llmc.load(tmp_path / "t.bin")
    config, _ = llmc.load(tmp_path / "t.bin", norm_eps=header.norm_eps)
    assert config.norm_eps == pytest.approx(header.norm_eps)


def test_cli_bad_input_prints_no_traceback(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    r = subprocess.run([sys.executable, "-m", "remat_lm.llmc", "verify", str(tmp_path / "empty.bin"),
                        str(tmp_path / "missing.bin")], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "empty.bin" in r.stderr
    r = subprocess.run([sys.executable, "-m", "remat_lm.llmc", "verify", "a", "b", "--recompute_method", "zig"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "zig" in r.stderr
