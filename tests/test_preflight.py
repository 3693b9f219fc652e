"""The memory preflight (remat_lm/training/preflight.py): a batch that really does not fit in this machine's
RAM stops train.py before the first step with exit 2 and one line of advice, and the advice, run as
given, compiles to a step that fits (the join). Nothing is trained or run at the large sizes: the
train step is only compiled."""
from __future__ import annotations

import re
import sys

import pytest

from remat_lm.training import preflight
from remat.memory import format_bytes
from trainhelp import _main

# One layer keeps every compilation short; the data is the default corpus (no files needed).
BASE = ["--preset", "tiny", "--n_layer", "1", "--val_every", "0", "--no-progress", "--num_iterations", "1"]
ADVICE = re.compile(r"e\.g\. (--batch_size \d+(?: --grad_accum_steps \d+)? --activation_recompute --loss_chunk \d+)")
TRY_AUTO = re.compile(r"try (--recompute_method auto --memory_budget \S+(?: --loss_chunk \d+)?)")


def _one_line(err):
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.slow  # ~28 s (bisects the batch); test_recompute_that_fits_is_suggested_and_fits covers the check fast
def test_batch_that_does_not_fit_in_ram_exits_2_with_a_smaller_batch(capsys, tmp_path):
    avail = preflight.host_available()
    log = tmp_path / "log.jsonl"
    # 4,000,000 sequences of 64 tokens: the step needs terabytes; full remat cannot make it fit.
    rc, out, err = _main(BASE + ["--batch_size", "4000000", "--log_jsonl", str(log)], capsys)
    assert rc == 2
    line = _one_line(err)
    need = float(re.search(r"needs ([\d.]+) GiB", line).group(1))
    assert need * 2 ** 30 > avail and "available host RAM" in line, line
    assert "even full remat" in line and "--no-preflight" in line
    flags = ADVICE.search(line)
    assert flags, line
    # stopped before anything was written; stdout holds only the line announcing the compile
    assert not log.exists() and out.startswith("compile ") and len(out.splitlines()) == 1, out

    # The join: the advice, run as given, compiles to a step that passes the same check (its
    # compiled peak fits the RAM) and the dry run ends normally.
    rc, out, err = _main(BASE + flags.group(1).split() + ["--dry_run"], capsys)
    assert rc == 0, err
    est = re.search(r"memory\s+(.*) per device \(compiled est\.\)", out).group(1)
    assert "fits" in out and "dry run" in out, out
    assert est != format_bytes(0)


def test_no_preflight_skips_the_check(monkeypatch):
    # --no-preflight: the check is not called, the step is compiled and the dry run ends normally.
    from remat_lm.training import config_from_args, run
    calls = []
    monkeypatch.setattr(preflight, "check", lambda *a, **k: calls.append(a))
    run(config_from_args(BASE + ["--dry_run"]), out=sys.stderr)
    assert len(calls) == 1
    run(config_from_args(BASE + ["--dry_run", "--no-preflight"]), out=sys.stderr)
    assert len(calls) == 1


def test_capacity_reads_host_ram_on_cpu():
    import jax
    cap = preflight.capacity(jax.devices("cpu")[:1])
    meminfo = dict(l.split(":", 1) for l in open("/proc/meminfo"))
    assert cap.bytes == pytest.approx(int(meminfo["MemAvailable"].split()[0]) * 1024, rel=0.2)
    assert cap.sharing == 1 and "MemAvailable" in cap.what
    assert preflight.parse_size(cap.budget_flag) <= 0.8 * cap.bytes


@pytest.mark.slow
def test_recompute_that_fits_is_suggested_and_fits(capsys):
    """8 layers, a batch sized from this machine's available RAM so that no remat needs about twice
    of it and full remat well under it: the advice is the planner with a budget (no smaller batch),
    and running it fits."""
    from remat_lm.training import config_from_args, prepare
    from remat_lm.training.log import compiled_estimate
    from remat_lm.training.run import compile_train_step
    deep = ["--preset", "tiny", "--n_layer", "8", "--val_every", "0", "--no-progress", "--num_iterations", "1"]
    per_seq = compiled_estimate(compile_train_step(prepare(config_from_args(deep + ["--batch_size", "256"])))) / 256
    batch = int(2 * preflight.host_available() / per_seq)
    rc, out, err = _main(deep + ["--batch_size", str(batch)], capsys)
    assert rc == 2
    line = _one_line(err)
    flags = TRY_AUTO.search(line)
    assert flags and "full remat" in line and "--batch_size" not in line, line
    rc, out, err = _main(deep + ["--batch_size", str(batch)] + flags.group(1).split() + ["--dry_run"], capsys)
    assert rc == 0, err
    assert "fits" in out
