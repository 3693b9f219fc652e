"""Helpers the train.py test files share: the small text corpus, running train.py in this process
or as a real one, and the one-line error check."""
import functools
import io
import os
import pathlib
import re
import subprocess
import sys

import pytest

import train
from remat_lm.training import config_from_args, run
from remat_lm.training.data import default_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["--val_every", "0", "--no-progress"]
# A fixed schedule length, so that runs of 3, 4 and 6 steps share one compiled train step.
COMMON = ["--preset", "tiny", "--lr_decay_iters", "6"] + QUIET


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """60 kB of the default corpus as one text file."""
    path = tmp_path_factory.mktemp("data") / "code.txt"
    path.write_bytes(b"".join(pathlib.Path(f).read_bytes() for f in default_corpus()[:3])[:60000])
    return str(path)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, text_file):
    """Checkpoints at steps 2 and 4 of a run, and an uninterrupted 6-step run (its RunResult):
    (checkpoint dir, the common flags, RunResult)."""
    d = tmp_path_factory.mktemp("ck")
    common = COMMON + ["--data", text_file]
    _run(common + ["--num_iterations", "4", "--checkpoint_every", "2", "--checkpoint_dir", str(d / "ck")])
    straight, _ = _run(common + ["--num_iterations", "6"])
    return str(d / "ck"), common, straight


def _run(argv, **kw):
    """remat_lm.training.run on parsed flags in this process: (RunResult, what it printed)."""
    out = io.StringIO()
    return run(config_from_args(argv), out=out, **kw), out.getvalue()


def _env(**extra):
    """The environment of a real train.py process: CPU, this checkout first, one host device."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env


def _digits_masked(line: str) -> str:
    """`line` with every number as 0 and runs of spaces as one (glog pads process ids)."""
    return re.sub(r"\s+", " ", re.sub(r"[0-9]+", "0", line.strip()))


@functools.lru_cache(maxsize=None)
def jax_startup_lines() -> frozenset:
    """What JAX itself writes on stderr when a fresh process starts its backends (the installed
    plugins' notices; nothing where none is installed), digits masked: measured once per session."""
    p = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return frozenset(_digits_masked(l) for l in p.stderr.splitlines() if l.strip())


def ours(stderr: str) -> list:
    """The non-blank lines of a process's `stderr` that JAX's own start-up did not write (a logging
    handler the program installed may put a prefix before JAX's words)."""
    startup = jax_startup_lines()
    return [l for l in stderr.splitlines() if l.strip() and not any(_digits_masked(l).endswith(j) for j in startup)]


def _one_line(stderr: str) -> str:
    """The project's one non-blank line of `stderr` (JAX's start-up notices aside); fails on more, or
    on a traceback."""
    lines = ours(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def _main(argv, capsys):
    """train.main in this process: (exit code, stdout, stderr)."""
    try:
        rc = train.main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err
