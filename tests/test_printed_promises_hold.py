"""What the README and the messages promise, checked against what train.py really prints.

- the preflight's smaller-batch advice keeps the sequences per step (batch_size x grad_accum_steps);
- `--cpu_checkpointing` on a CPU backend says, in the summary and in `--memory_report`, that nothing moves;
- `--memory_report`'s saved table shows count x bytes of each, not count x total.

The gloo lines of a one-process jax.distributed run are checked in tests/test_multiprocess.py (its
1-process gloo run), the notebook's output folder in tests/test_notebook.py.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

from remat.memory import MiB, compiled_stats, format_bytes
from remat_lm.training import config_from_args, preflight, prepare
from remat_lm.training.compile import compile_train_step
from remat_lm.training.report import CPU_OFFLOAD, run_summary
from targethelp import need
from trainhelp import _main

TINY = ["--preset", "tiny", "--val_every", "0", "--no-progress", "--num_iterations", "1"]
GPU_FLAGS = ["--target", "h200", "--dry_run"]  # compiled-memory claims: XLA:GPU's figures (deviceless)
ADVICE = re.compile(r"e\.g\. --batch_size (\d+)(?: --grad_accum_steps (\d+))? --activation_recompute --loss_chunk (\d+)")


# --- the preflight's advice keeps the sequences per step ---------------------------------------

@pytest.mark.parametrize("seqs, most, step, want", [
    (65536, 44731, 1, (32768, 2)),   # the README's example: was 44731 x 2 = 89,462 sequences
    (96, 40, 1, (32, 3)),
    (96, 40, 8, (32, 3)),
    (96, 31, 8, (24, 4)),
    (97, 40, 1, (1, 97)),            # a prime: only 1 divides it below 97
    (96, 96, 8, (96, 1)),
    (12, 5, 8, None),                # no multiple of 8 divides 12
    (24, 7, 8, None),                # 8 divides 24 but does not fit
])
def test_split_batch_keeps_the_product(seqs, most, step, want):
    got = preflight.split_batch(seqs, most, step)
    assert got == want
    if got is not None:
        b, accum = got
        assert b * accum == seqs and b <= most and b % step == 0


def test_split_batch_is_the_largest_divisor():
    # against a brute-force search over every micro-batch
    for seqs in range(1, 200):
        for most in (1, 7, 16, 50, 199):
            for step in (1, 2, 8):
                brute = [b for b in range(step, most + 1, step) if seqs % b == 0]
                assert preflight.split_batch(seqs, most, step) == ((brute[-1], seqs // brute[-1]) if brute else None)


@pytest.mark.slow  # a real compiled advice (~30 s of XLA:GPU compiles); the split arithmetic is tested fast above
def test_batch_advice_keeps_the_sequences_per_step():
    """A real advice, compiled by XLA:GPU for an H200 (`--target h200 --dry_run`, deviceless): 96
    sequences per step (48 x 2) with a capacity sized so that about 40 of them fit per micro-batch
    under full remat with the chunked loss. The advice is 32 x 3 = 96 (rounding the accumulation up
    gave ~40 x 3 = 120), and its configuration fits."""
    need("cuda")
    chunk = 16  # the run's own --loss_chunk: one full-remat candidate to compile, not two
    base = TINY + GPU_FLAGS + ["--n_layer", "1", "--batch_size", "48", "--grad_accum_steps", "2", "--loss_chunk", str(chunk)]
    setup = prepare(config_from_args(base))
    full = dataclasses.replace(setup.mcfg, recompute=preflight._full(setup.mcfg), loss_chunk=chunk)
    stats = compiled_stats(compile_train_step(setup, full))
    fixed = stats.peak_estimate - stats.temp
    target = fixed + stats.temp * 40 / 48  # the budget in which ~40 sequences fit
    cap = preflight.Capacity(int((target + MiB / 2) / preflight.HEADROOM), "a test's capacity")
    assert stats.peak_estimate > cap.budget  # the run's own micro-batch does not fit

    hint = preflight.advice(setup, cap, compile_train_step)
    m = ADVICE.search(hint)
    assert m, hint
    b, accum = int(m.group(1)), int(m.group(2) or 2)  # no --grad_accum_steps: the run's 2
    assert b * accum == 96 and 30 <= b <= 40 and "the same 96 sequences" in hint, hint
    # the flags as given: the same tokens per step, and a compiled step within the budget
    cfg = config_from_args(TINY + GPU_FLAGS + ["--n_layer", "1", "--batch_size", m.group(1), "--grad_accum_steps", str(accum),
                                   "--activation_recompute", "--loss_chunk", m.group(3)])
    assert cfg.tokens_per_step == setup.cfg.tokens_per_step
    assert compiled_stats(compile_train_step(prepare(cfg))).peak_estimate <= cap.budget


# --- --cpu_checkpointing on CPU says that nothing moves -------------------------------------------

OFFLOAD = TINY + ["--activation_recompute", "--cpu_checkpointing"]


def test_cpu_checkpointing_summary_says_nothing_moves(capsys):
    rc, out, err = _main(OFFLOAD + ["--dry_run"], capsys)
    assert rc == 0, err
    lines = [l for l in out.splitlines() if CPU_OFFLOAD in l]
    assert len(lines) == 1 and lines[0].startswith("offload  ") and "--cpu_checkpointing" in lines[0], out
    # without offloading, or with it explained by the DeepSpeed notes, no such line
    assert CPU_OFFLOAD not in run_summary(prepare(config_from_args(TINY + ["--activation_recompute"])))


@pytest.mark.parametrize("flags", [["--recompute_plan", "offload_names:qkv x2"],
                                   ["--activation_recompute", "--remat_policy", "offload_names:qkv"]])
def test_an_offloading_policy_on_cpu_says_nothing_moves(flags):
    """A plan or a policy that offloads is as silent on a CPU backend as --cpu_checkpointing would be."""
    summary = run_summary(prepare(config_from_args(TINY + flags)))
    lines = [l for l in summary.splitlines() if CPU_OFFLOAD in l]
    assert len(lines) == 1 and "the recompute policy offloads" in lines[0], summary


def test_memory_report_counts_each_saved_value(capsys):
    """The saved table of the real report: the offloaded region inputs (one per layer, B x T x C
    float32 each) read `2 x <one input>`, the line about CPU offload follows, and a row of values of
    different sizes says count and total."""
    rc, out, err = _main(OFFLOAD + ["--memory_report"], capsys)
    assert rc == 0, err
    cfg = config_from_args(OFFLOAD)
    one_input = cfg.batch_size * cfg.sequence_length * 32 * 4  # tiny: C=32, float32
    assert "count x bytes of each (count, total where their sizes differ)" in out, out
    host = [l for l in out.splitlines() if l.strip().startswith("<intermediate:device_put> (host)")]
    assert len(host) == 1 and host[0].endswith(f" 2 x {format_bytes(one_input)}"), host
    args = [l for l in out.splitlines() if l.strip().startswith("<arguments>")]
    assert len(args) == 1 and re.search(r"\d+, [\d.]+ \S+ total$", args[0]), args
    assert sum(CPU_OFFLOAD in l for l in out.splitlines()) == 1, out
