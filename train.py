# `python train.py`: the trainer's command line, which lives in remat_lm/train.py (`python -m
# remat_lm.train`, installed as `remat-train`). Flags, examples, exit codes: `python train.py --help`.
import sys

import remat_lm.train as _train
from remat_lm.train import PROG, _exit_on_early_signals, main  # noqa: F401  (tests call train.main)

__doc__ = _train.__doc__

if __name__ == "__main__":
    _exit_on_early_signals()  # first, before main() imports jax (remat_lm.training.signals replaces it later)
    sys.exit(main())
