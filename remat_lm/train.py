"""Train GPT-2 or LLaMA-3 with configurable activation recompute (rematerialization).

    python train.py                                   # small GPT-2 on the Python stdlib's source, CPU, minutes
    python train.py --model gpt2 --preset tiny --num_iterations 3 --activation_recompute \\
        --recompute_method uniform --recompute_num_layers 2
    python train.py --model llama3 --preset tiny --num_iterations 3 --activation_recompute \\
        --recompute_granularity selective --recompute_modules core_attn,mlp
    python train.py --activation_recompute --use_reentrant --scan_layers --dtype bfloat16
    python train.py --preset d12 --activation_recompute --recompute_method uniform,block \\
        --recompute_num_layers 4 --memory_report        # side-by-side memory of two methods, no training
    python train.py --data "fineweb_train_*.bin" --val_data fineweb_val_000000.bin --preset d12 \\
        --batch_size 8 --sequence_length 1024 --grad_accum_steps 8 --checkpoint_dir runs/d12 \\
        --checkpoint_every 500 --log_jsonl runs/d12.jsonl --mesh data=2,fsdp=4
    python train.py ... --checkpoint_dir runs/d12 --resume   # continue bit-identically
    python train.py --preset d12 --recompute_method auto --memory_budget 12GiB   # planner picks per layer
    python train.py --sample_every 500 --prompt "def " --temperature 0.8 --top_k 20   # samples while training
    python train.py --preset d12 --sequence_length 1024 --activation_recompute --loss_chunk 128  # no (B,T,V) logits
    python train.py --num_iterations 20 --profile_steps 10:13 --log_jsonl runs/x.jsonl  # trace to runs/x.profile
    python train.py --model llama3 --preset 8b --target h200x8 --mesh fsdp=8 --batch_size 8 \\
        --sequence_length 8192 --dtype bfloat16 --scan_layers --dry_run   # will it fit 8 H200s? (no GPU needed)

Flags are generated from `remat_lm.training.TrainConfig` (`python train.py --help`). Bad input (an unknown
value, inconsistent recompute flags, a missing or malformed data file, a mismatched --init_from,
--resume without a checkpoint or with changed training flags, an unusable --checkpoint_dir or
--log_jsonl, an empty path, an input that is not a readable regular file, an output path that is an
input, a mesh that does not fit, a model or batch too large for the devices: the preflight
compares the compiled peak with the devices' memory and names a setting to try; --no-preflight
skips it) exits with status 2 and one line on stderr, before anything is written. A NaN/inf loss,
a failed checkpoint save or a failed --log_jsonl write (a full disk) stops the run with status 1;
Ctrl-C exits 130 and SIGTERM 143 (an in-flight save is completed first).
"""
from __future__ import annotations

import os
import sys

__all__ = ["PROG", "entry", "main"]

PROG = "train.py"


def main(argv=None) -> int:
    from remat_lm.argtypes import usage_exit
    from remat_lm.training.config import UsageError, config_from_args

    try:
        cfg = config_from_args(argv, prog=PROG, description=__doc__)
    except UsageError as e:
        usage_exit(PROG, e)
    from remat_lm.training import signals

    signals.install(PROG)  # Ctrl-C / SIGTERM: exit 130 / 143 with one line (remat_lm/training/signals.py)
    from remat_lm.training import distributed

    try:
        distributed.initialize()  # N processes (JAX_COORDINATOR_ADDRESS..., SLURM, Open MPI): remat_lm/training/distributed.py
    except (RuntimeError, ValueError) as e:
        sys.stderr.write(f"{PROG}: error: could not start the multi-process run ({' '.join(str(e).split())[:300]}); "
                         f"check JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID and that every "
                         f"process was started\n")
        return 1
    distributed.quiet_others()  # process 0 prints and logs
    from remat_lm import training
    from remat_lm.models.llmc_io import LlmcFormatError
    from remat_lm.training.saving import CheckpointSaveError, quiet_failed_save_threads
    from remat_lm.training.log import LogWriteError
    from remat_lm.training.run import Interrupted

    quiet_failed_save_threads()

    try:
        training.run(cfg)
    except (UsageError, LlmcFormatError) as e:  # bad input found while preparing: nothing was written
        usage_exit(PROG, e)
    except training.TrainingDiverged as e:
        sys.stderr.write(f"{PROG}: stopped: {e}\n")
        return 1
    except LogWriteError as e:  # a full disk under --log_jsonl: the checkpoints in flight were completed
        sys.stderr.write(f"{PROG}: error: {e.strerror}\n")
        return 1
    except CheckpointSaveError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        # NOTE: orbax's save threads and futures are left failed; a normal interpreter teardown
        # prints their tracebacks. Nothing else is in flight (the save is abandoned; orbax leaves
        # it in a temporary directory the next run removes), so leave without the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    except Interrupted as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        return e.code
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130
    except Exception as e:
        reason = distributed.peer_failure(e)  # multi-process: a collective with a dead process failed
        if reason is None:
            raise
        distributed.exit_on_peer_failure(reason, PROG)
    if signals.pending():  # a signal during the last save: it completed, the run is whole
        sys.stderr.write(f"{PROG}: {signals.stop_words(signals.pending())} after the last step; the run and its "
                         f"checkpoint are complete\n")
        return signals.exit_code(signals.pending())
    return 0


def _exit_on_early_signals() -> None:
    """SIGINT / SIGTERM before `remat_lm.training.signals` takes over (while Python imports JAX and parses the
    flags, about a second): exit 130 / 143 with one line. Python's defaults would print a
    KeyboardInterrupt traceback through the import machinery, or die on SIGTERM without a word."""
    import signal

    def leave(signum, frame):
        word = "interrupted (SIGINT)" if signum == signal.SIGINT else "terminated (SIGTERM)"
        os.write(2, f"{PROG}: {word} while starting; nothing was written\n".encode())
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, leave)
    signal.signal(signal.SIGTERM, leave)


def entry() -> int:
    """The `remat-train` console script: `python train.py` installed with the package (its messages
    and --help name `remat-train`)."""
    global PROG
    PROG = "remat-train"
    _exit_on_early_signals()
    return main()


if __name__ == "__main__":
    _exit_on_early_signals()  # first, before main() imports jax (remat_lm.training.signals replaces it later)
    sys.exit(main())
