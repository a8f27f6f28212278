#!/usr/bin/env bash
# Every GPU check in one call, for the GPU machine: versions, the gpu-marked tests, the benchmark,
# device memory under session churn, and the no-bleed / cycle / in-flight tests under
# compute-sanitizer memcheck. API errors are not
# reported there: cuda-bindings probes the driver for versioned entry points with cuGetProcAddress,
# and each miss shows up as CUDA_ERROR_INVALID_VALUE (34 of them, nothing else, in the first run).
#
#   bash tests/gpu_run.sh            # from the repository root; PYTHONPATH must reach the repo
#
# Everything is teed to $OUT/gpu.log (OUT defaults to ./out). A failing stage does not stop the
# next one, so one run shows everything; the exit status is the number of failed stages.
# Each stage has a time limit so that a hang cannot eat the others' time: the whole run stays
# under GPU_RUN_BUDGET seconds (default 570, for a 600 s limit on the call). The benchmark runs
# before the sanitizer stage because the sanitizer is the slowest and least predictable.
set -u -o pipefail

OUT="${OUT:-out}"
mkdir -p "$OUT"
LOG="$OUT/gpu.log"
: >"$LOG"
BUDGET="${GPU_RUN_BUDGET:-570}"
START=$(date +%s)
FAILED=0

left() { echo $((BUDGET - ($(date +%s) - START))); }

# stage NAME LIMIT_SECONDS COMMAND...: run, tee, record failure; never exits the script.
stage() {
    local name=$1 limit=$2
    shift 2
    local room
    room=$(left)
    if ((room < limit)); then limit=$room; fi
    if ((limit < 20)); then
        echo "=== $name: skipped, only ${room}s of the budget left" | tee -a "$LOG"
        FAILED=$((FAILED + 1))
        return 1
    fi
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local t0 rc
    t0=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $(($(date +%s) - t0))s$( ((rc == 124)) && echo ' (TIMED OUT)')" | tee -a "$LOG"
    if ((rc != 0)); then FAILED=$((FAILED + 1)); fi
    return "$rc"
}

stage versions 60 bash -c '
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
    compute-sanitizer --version | tail -n 1 || true
    python - <<EOF
import sys, torch, triton
from cuda.bindings import driver
import cuda.bindings
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| triton", triton.__version__, "| cuda-bindings", cuda.bindings.__version__)
print("device", torch.cuda.get_device_name(0), "| capability", torch.cuda.get_device_capability(0))
EOF
'

# The gateway's tests drive it with the openai package, which GPU images may lack; none of them is gpu-marked.
SKIP=()
python -c "import openai" 2>/dev/null || SKIP=(--ignore=tests/gateway)
if ! stage pytest 240 python -m pytest -m gpu -x -q --durations=15 --junitxml="$OUT/pytest-gpu.xml" "${SKIP[@]}" tests/; then
    # -x stopped at the first failure: run everything once more so every failure is visible.
    stage pytest-all 150 python -m pytest -m gpu -q -rfE --durations=10 "${SKIP[@]}" tests/
fi

stage bench 150 python -m cuda_state.bench.table --json "$OUT/bench.json"
stage step-profile 120 python -m worker.bench.step_profile --sessions 1 64 --steps 200
stage step-profile-cublas 120 env WORKER_ROW_PRODUCTS=0 python -m worker.bench.step_profile --sessions 1 64 --steps 200
stage bench-matmul 90 python -m worker.bench.matmul --rows 1 16 64
stage bench-prefill 120 python -m worker.bench.prefill
stage memory-churn 120 python -m worker.bench.memory_churn --rounds 12 --prompt-max 1900 --json "$OUT/memory_churn.json"

stage sanitizer 400 env GPU_TESTS_UNDER_SANITIZER=1 \
    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
    python -m pytest -m gpu -q -p no:cacheprovider -k "bleed or cycle or inflight" "${SKIP[@]}" tests/

echo "=== done: $FAILED failed stage(s) in $(($(date +%s) - START))s; log $LOG" | tee -a "$LOG"
exit "$FAILED"
