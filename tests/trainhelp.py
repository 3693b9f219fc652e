"""Helpers the train.py test files share: the small text corpus, running train.py in this process
or as a real one, and the one-line error check."""
import io
import os
import pathlib

import pytest

import train
from training import config_from_args, run
from training.data import default_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """60 kB of the default corpus as one text file."""
    path = tmp_path_factory.mktemp("data") / "code.txt"
    path.write_bytes(b"".join(pathlib.Path(f).read_bytes() for f in default_corpus()[:3])[:60000])
    return str(path)


def _run(argv, **kw):
    """training.run on parsed flags in this process: (RunResult, what it printed)."""
    out = io.StringIO()
    return run(config_from_args(argv), out=out, **kw), out.getvalue()


def _env(**extra):
    """The environment of a real train.py process: CPU, this checkout first, one host device."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env


def _one_line(stderr: str) -> str:
    """The one non-blank line of `stderr`; fails on more, or on a traceback."""
    lines = [l for l in stderr.splitlines() if l.strip()]
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
