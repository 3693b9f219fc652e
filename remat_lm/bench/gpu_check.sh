#!/usr/bin/env bash
# GPU check (make gpu-check): GPT-2 d12, T=1024, bf16 on one GPU; see remat_lm/bench/gpu_check.py.
# Writes gpu_check.md and gpu_check.json (then planner_validate.json) to $OUT if set, else out/gpu_check. Sized for < 8 + 5 min
# on one H200; extra arguments go to the script (e.g. --budget_s 300, --settings none,full).
set -euo pipefail
cd "$(dirname "$0")/../.."
# Allocate on demand, so that peak_bytes_in_use is what each setting needs, not a preallocated
# pool; let the allocator grow to 95% of the device (with preallocation off, the BFC allocator
# otherwise stops at its default 75%).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"
export XLA_CLIENT_MEM_FRACTION="${XLA_CLIENT_MEM_FRACTION:-$XLA_PYTHON_CLIENT_MEM_FRACTION}"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
"$PY" -m remat_lm.bench.gpu_check "$@"
# The planner's validation on this GPU (docs/planner.md, "Validation"): every plan and hand setting
# timed interleaved against its predicted step; sized for under 5 minutes.
timeout 290 "$PY" -m remat_lm.bench.planner --target h200 --batch_size 16 --sequence_length 1024 \
    --dtype bfloat16 --budgets 5 --validate --validate_seconds 60 \
    --json "${OUT:-out/gpu_check}/planner_validate.json" || echo "planner validation: exit $? (see above)"
