"""`--profile_steps A:B` (remat_lm/training/profile.py): a jax.profiler trace of those steps appears where the
run says; bad specs exit 2 with one line; off by default."""
from __future__ import annotations

import io
import os

import pytest

import train
from remat_lm.training import config_from_args, run
from remat_lm.training.profile import parse_steps, profile_dir

TINY = ["--preset", "tiny", "--n_layer", "1", "--val_every", "0", "--no-progress", "--num_iterations", "3"]


def _files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


@pytest.mark.slow  # a traced train.py run, ~15 s
def test_trace_of_the_chosen_steps_is_written_beside_the_log(tmp_path):
    log = tmp_path / "run.jsonl"
    out = io.StringIO()
    res = run(config_from_args(TINY + ["--profile_steps", "1:2", "--log_jsonl", str(log)]), out=out)
    assert len(res.history) == 3
    files = _files(tmp_path / "run.profile")
    assert any(f.endswith(".xplane.pb") for f in files), files
    assert any(f.endswith("perfetto_trace.json.gz") and os.path.getsize(f) > 0 for f in files), files
    line = next(l for l in out.getvalue().splitlines() if l.startswith("profile"))
    assert "steps 2..2" in line and str(tmp_path / "run.profile") in line
    # Off by default: the same run without the flag writes no trace.
    run(config_from_args(TINY + ["--log_jsonl", str(tmp_path / "plain.jsonl")]), out=io.StringIO())
    assert not (tmp_path / "plain.profile").exists()


@pytest.mark.parametrize("spec", ["3:2", "2:2", "a:b", "5", "0:4", "-1:2"])
def test_bad_profile_steps_exit_2_with_one_line(spec, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(TINY + [f"--profile_steps={spec}"])
    assert e.value.code == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and "--profile_steps" in err[0] and "A:B" in err[0], err


def test_parse_steps_and_where():
    assert parse_steps("0:3", 3) == (0, 3) and parse_steps(" 10:12", 100) == (10, 12)
    assert profile_dir("ck", "runs/x.jsonl") == os.path.join("ck", "profile")
    assert profile_dir(None, "runs/x.jsonl") == "runs/x.profile"
    assert profile_dir(None, None) == os.path.join("runs", "profile")
