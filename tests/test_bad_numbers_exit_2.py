"""Bad numbers on every command line (bench CLIs, remat_lm.sample, remat_lm.llmc, train.py) and a signal
while train.py is still importing: exit 2 (or 130/143) with one line naming the flag, no traceback,
no hang.

Most cases run the module's own `main(argv)` in this process with argparse's `parse_known_args`
guarded: a bad value must stop at argument parsing, and one that gets through raises `_Accepted`
at once instead of starting a benchmark (so a missing check fails fast rather than compiling or
hanging). One real subprocess per module proves the same without the guard: rc 2, one line, no
traceback.
"""
import argparse
import importlib
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)

POS = ("0", "-5", "abc", "1.5", "²", "٣")            # an integer >= 1
NONNEG = ("-1", "abc", "1.5", "²", "٣")              # an integer >= 0
POSREAL = ("0", "-1", "nan", "inf", "abc", "١.٥")    # a finite number > 0
NONNEGREAL = ("-1", "nan", "inf", "abc", "١.٥")      # a finite number >= 0
SHAPE = ("n_layer", "n_embd", "n_head", "seq", "batch", "vocab")

# module → (leading argv, {flag: bad values})
CASES = {
    "remat_lm.bench.policies": ((), {**{k: POS for k in SHAPE}, "steps": POS}),
    "remat_lm.bench.planner": ((), {"steps": POS, "final_steps": POS,
                           "fractions": ("abc", "0.5,", "-0.1", "1.5", "nan", "٠.٥")}),
    "remat_lm.bench.sample": ((), {"tokens": POS, "rounds": POS}),
    "remat_lm.bench.loss_chunk": ((), {"seq": POS, "batch": POS, "chunks": ("0", "128,0", "-5", "abc", "", "²")}),
    "remat_lm.bench.attention": ((), {**{k: POS for k in ("batch", "steps", "tile", "n_layer", "n_embd", "n_head", "vocab")},
                             "seqs": ("0", "1024,-1", "abc", "²"), "tile_sweep": ("0", "64,x", "²"),
                             "shapes": ("8x0", "8", "8x256x2", "abc", "8x²")}),
    "remat_lm.bench.gpu_check": ((), {**{k: POS for k in ("n_layer", "n_embd", "n_head", "seq", "batch", "steps",
                                                 "max_batch")},
                             **{k: NONNEG for k in ("bisect", "bisect_other", "loss_chunk")},
                             "peak_tflops": POSREAL, "budget_s": POSREAL, "grace_s": NONNEGREAL}),
    "remat_lm.bench.torch_peer": ((), {**{k: POS for k in SHAPE}, "steps": POS, "torch_threads": ("0", "1,0", "abc", "²")}),
    "remat_lm.sample": (("ckpt",), {"sample_length": POS, "num_samples": POS, "top_k": POS, "step": NONNEG,
                                  "seed": ("-1", "4294967296", "18446744073709551616", "abc", "²"),
                                  "temperature": NONNEGREAL, "norm_eps": POSREAL, "rope_theta": POSREAL,
                                  "ffn_dim_multiplier": POSREAL}),
    "remat_lm.llmc": (("verify", "model.bin", "state.bin"),
                    {"loss_chunk": NONNEG, "recompute_num_layers": ("abc", "1.5", "²", "٣"),
                     "recompute_every": ("abc", "1.5", "²", "٣"), "recompute_segments": ("²-3", "0-٣"),
                     "norm_eps": POSREAL, "rope_theta": POSREAL, "ffn_dim_multiplier": POSREAL}),
}


class _Accepted(Exception):
    """Raised in place of running a benchmark: the arguments parsed without an error."""


def _prog(module: str) -> str:
    return f"python -m {module}" + (" verify" if module == "remat_lm.llmc" else "")


def _main(module: str, argv, capsys) -> tuple:
    """`module.main(argv)` in this process: (exit status, stderr lines)."""
    try:
        rc = importlib.import_module(module).main(list(argv))
    except SystemExit as e:
        rc = e.code
    return rc, [l for l in capsys.readouterr().err.splitlines() if l.strip()]


@pytest.fixture
def parse_only(monkeypatch):
    parse = argparse.ArgumentParser.parse_known_args

    def guarded(self, *a, **k):
        ns, rest = parse(self, *a, **k)
        raise _Accepted(ns)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", guarded)


@pytest.mark.parametrize("module,flag", [(m, f) for m, (_, flags) in CASES.items() for f in flags])
def test_bad_number_is_one_usage_line_naming_the_flag(module, flag, parse_only, capsys):
    lead, flags = CASES[module]
    for value in flags[flag]:
        rc, lines = _main(module, [*lead, f"--{flag}", value], capsys)
        assert rc == 2 and len(lines) == 1, (value, lines)
        assert lines[0].startswith(f"{_prog(module)}: error: argument --{flag}: "), (value, lines)


def test_the_guard_lets_good_values_through(parse_only, capsys):
    """The guard is what makes a missing check fail at once: good values reach it."""
    for module, (lead, _) in CASES.items():
        with pytest.raises(_Accepted):
            importlib.import_module(module).main([*lead])
    with pytest.raises(_Accepted):
        importlib.import_module("remat_lm.bench.planner").main(["--fractions", "0,0.5,1", "--steps", "1"])


def test_prompt_token_ids_are_ascii_integers():
    from remat_lm.sample import parse_token_ids
    assert parse_token_ids("3, 5", 10) == [3, 5]
    for spec in ("٣", "²", "3,x"):
        with pytest.raises(ValueError, match="--prompt_tokens"):
            parse_token_ids(spec, 10)


def test_unknown_model_is_one_line(capsys):
    rc, lines = _main("remat_lm.bench.policies", ["--model", "gpt3"], capsys)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("python -m remat_lm.bench.policies: error: argument --model")


@pytest.mark.parametrize("argv,needle", [
    (["--recompute_method", "auto"], "--recompute_method auto"),
    (["--activation_recompute", "--recompute_method", "auto"], "--recompute_method auto"),
    (["--activation_recompute", "--recompute_method", "uniform,auto"], "--recompute_method uniform,auto"),
    (["--activation_recompute", "--recompute_method", "uniform", "--recompute_num_layers", "0"],
     "--recompute_num_layers"),
    (["--activation_recompute", "--recompute_every", "-1"], "--recompute_every"),
])
def test_llmc_verify_recompute_errors_name_verify_flags(argv, needle, capsys):
    """verify takes no --memory_budget: its recompute errors name what it accepts (before any file is read)."""
    rc, lines = _main("remat_lm.llmc", ["verify", "model.bin", "state.bin", *argv], capsys)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("python -m remat_lm.llmc verify: error: "), lines
    assert needle in lines[0] and "--memory_budget" not in lines[0], lines
    if "auto" in needle:
        assert "none, uniform, block" in lines[0]


@pytest.mark.parametrize("argv,flag", [
    (["--activation_recompute", "--recompute_segments", "²-3"], "--recompute_segments"),
    (["--activation_recompute", "--recompute_segments", "0-٣"], "--recompute_segments"),
    (["--mesh", "data=²"], "--mesh"),
    (["--mesh", "data=٢"], "--mesh"),
    (["--profile_steps", "¹:2"], "--profile_steps"),
    (["--profile_steps", "0:٢"], "--profile_steps"),
    (["--num_iterations", "٣"], "--num_iterations"),
    (["--learning_rate", "١.٥"], "--learning_rate"),
    (["--activation_recompute", "--recompute_method", "uniform", "--recompute_num_layers", "٢"],
     "--recompute_num_layers"),
])
def test_train_flags_take_ascii_digits_only(argv, flag, capsys):
    """int() reads '٣' as 3 and rejects '²' (which str.isdigit() accepts): both are usage errors naming the flag."""
    from remat_lm.training.config import UsageError, config_from_args
    try:
        config_from_args(["--num_iterations", "4", *argv])
    except UsageError as e:
        message = str(e)
    except SystemExit as e:
        assert e.code == 2
        message = capsys.readouterr().err
    else:
        pytest.fail(f"{argv} was accepted")
    assert flag in message and "invalid literal" not in message, message


# One real process per command line: the exit status and stderr as a user sees them.
PROCESSES = [
    ["-m", "remat_lm.bench.policies", "--n_layer", "0"],
    ["-m", "remat_lm.bench.planner", "--fractions", "abc"],
    ["-m", "remat_lm.bench.sample", "--tokens", "-5"],
    ["-m", "remat_lm.bench.loss_chunk", "--chunks", "0"],
    ["-m", "remat_lm.bench.attention", "--tile", "²"],
    ["-m", "remat_lm.bench.gpu_check", "--bisect", "-1"],
    ["-m", "remat_lm.bench.torch_peer", "--steps", "²"],
    ["-m", "remat_lm.sample", "ckpt", "--seed", "18446744073709551616"],
    ["-m", "remat_lm.llmc", "verify", "m.bin", "s.bin", "--loss_chunk", "-1"],
]


# One real process per module; four in the fast set (every parser is also run in-process above).
FAST_PROCESSES = {0, 1, 7, 8}


def _start(indices):
    """Start them all at once (each mostly imports JAX), then collect: {index: (rc, stderr)}."""
    procs = {i: subprocess.Popen([sys.executable, *PROCESSES[i]], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for i in indices}
    out = {}
    for i, p in procs.items():
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err = "TIMEOUT (a hang)\n" + err
        out[i] = (p.returncode, err)
    return out


@pytest.fixture(scope="module")
def fast_processes():
    return _start(sorted(FAST_PROCESSES))


@pytest.fixture(scope="module")
def slow_processes():
    return _start([i for i in range(len(PROCESSES)) if i not in FAST_PROCESSES])


@pytest.mark.parametrize("i", [pytest.param(i, marks=() if i in FAST_PROCESSES else pytest.mark.slow)
                               for i in range(len(PROCESSES))], ids=[" ".join(a[:2]) for a in PROCESSES])
def test_process_exits_2_with_one_line(i, request):
    processes = request.getfixturevalue("fast_processes" if i in FAST_PROCESSES else "slow_processes")
    argv, (rc, err) = PROCESSES[i], processes[i]
    lines = [l for l in err.splitlines() if l.strip()]
    prog = _prog(argv[1])
    flag = next(a for a in argv if a.startswith("--"))
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert lines[0].startswith(f"{prog}: error: ") and flag in lines[0], lines


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a SIGTERM handler yet (/proc's caught-signal mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(l.split()[1], 16) for l in f if l.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask & (1 << (signal.SIGTERM - 1)))


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_while_importing_exits_with_one_line(sig, code):
    """A real signal ~0.3 s after train.py starts, while it still imports JAX (over a second here)."""
    p = subprocess.Popen([sys.executable, "train.py", "--num_iterations", "1"], cwd=ROOT, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not _catches_sigterm(p.pid) and time.monotonic() - t0 < 0.5:  # Python is up and has its handler
        time.sleep(0.005)
    time.sleep(0.3)
    p.send_signal(sig)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("train.py did not exit after the signal")
    lines = [l for l in err.splitlines() if l.strip()]
    assert p.returncode == code and len(lines) == 1 and "Traceback" not in err, (p.returncode, err[-2000:])
    assert signal.Signals(sig).name in lines[0] and lines[0].startswith("train.py: "), lines
