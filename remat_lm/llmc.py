"""`python -m remat_lm.llmc verify`: the Flax port against an llm.c debug-state file.

    python -m remat_lm.llmc verify MODEL.bin STATE.bin [--activation_recompute
        --recompute_granularity full --recompute_method uniform --recompute_num_layers 2
        --use_reentrant --scan_layers --loss_chunk N]

prints one row per tensor (max |Δ|, max |ref|) and exits 0 when everything is within tolerance,
1 when something is not, 2 on a bad file or flag (one line, no traceback). The recompute flags are
train.py's (`remat_lm.training.flags`, without the train-only `--memory_budget`); the files are read
and compared by `remat_lm.models.llmc`.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from remat import RecomputeConfig
from remat_lm.argtypes import Parser, integer, real, usage_error
from remat_lm.models.llmc import ATOL, load, load_state, verify
from remat_lm.models.llmc_io import LlmcFormatError
from remat_lm.training import flags as recompute_flags

__all__ = ["PROG", "entry", "main"]

PROG = "python -m remat_lm.llmc"


def _recompute_from(a) -> RecomputeConfig:
    """The RecomputeConfig of the parsed recompute flags (remat_lm.training.flags, the same as train.py's)."""
    # NOTE: checked before from_flags, whose `auto` errors name train.py's --memory_budget, which
    # verify does not take.
    methods = [m.strip() for m in str(a.recompute_method).split(",")]
    if len(methods) > 1 or "auto" in methods:
        raise ValueError(f"--recompute_method {a.recompute_method}: verify runs one setting (auto plans against "
                         f"train.py's compiled train step); pass one of none, uniform, block, or --recompute_segments "
                         f"/ --recompute_every")
    (_, rc), = recompute_flags.from_flags(vars(a))
    return rc


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="compare the model with an llm.c debug state file")
    v.add_argument("model", help="llm.c model file (.bin)")
    v.add_argument("state", help="llm.c debug state file (.bin)")
    recompute_flags.add_arguments(v, train=False)  # the same recompute flags as train.py's
    v.add_argument("--loss_chunk", type=integer(0), default=0,
                   help="compute the loss over chunks of N positions (0: off)")
    for f in ("norm_eps", "rope_theta", "ffn_dim_multiplier"):
        v.add_argument(f"--{f}", type=real(above=0), default=None, help="LLaMA-3 header override")
    return p


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        recompute = _recompute_from(a)
        config, params = load(a.model, recompute, scan_layers=a.scan_layers, norm_eps=a.norm_eps,
                              rope_theta=a.rope_theta, ffn_dim_multiplier=a.ffn_dim_multiplier)
        config = dataclasses.replace(config, loss_chunk=a.loss_chunk)
        recompute.validate_for(config.n_layer)
        state = load_state(a.state, config)
    except (LlmcFormatError, ValueError, OSError) as e:
        return usage_error(f"{PROG} verify", e)
    rows = verify(config, params, state)
    print(f"{'tensor':<16} {'max |Δ|':>12} {'max |ref|':>12}  within {ATOL:g}")
    for r in rows:
        print(f"{r.tensor:<16} {r.max_abs_diff:>12.3e} {r.max_abs_ref:>12.3e}  {'ok' if r.ok else 'FAIL'}")
    bad = [r.tensor for r in rows if not r.ok]
    print(f"{len(rows) - len(bad)} of {len(rows)} tensors within tolerance"
          + (f"; failing: {', '.join(bad)}" if bad else f" ({recompute.granularity} recompute)"))
    return 1 if bad else 0


def entry() -> int:
    """The `remat-llmc` console script: messages and --help name the command as typed."""
    global PROG
    PROG = "remat-llmc"
    return main()


if __name__ == "__main__":
    sys.exit(main())
