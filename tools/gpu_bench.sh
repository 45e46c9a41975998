#!/usr/bin/env bash
# One script for a GPU session (sized for one H200 in under 8 minutes, no network needed):
#   1. the GPU tests (pytest -m gpu) and the kernel tests with the kernels compiled, not interpreted;
#   2. tools/bench_kernels.py: eager vs torch.compile vs Triton, time and GB/s vs measured copy bandwidth;
#   3. tools/bench_train.py, if it exists: GPT-2 124M steps with the torch ops, the Triton kernels,
#      and torch.compile (BENCH_TRAIN_ARGS replaces those options).
# Everything it writes goes under $OUT (default ./gpu_results), at most 10 files:
#   env.txt, tests.log, bench_kernels.log, kernels.md, kernels.json, kernels.png,
#   bench_train.log, train.md, train.json, train.png
# (each .json holds the rows of the .md of the same name, for tools that read the results).
# Each stage has its own time limit (together 440 s, plus ~10 s of set-up); a failing stage is
# recorded and the next one still runs. The kernel tests compile a few hundred kernel variants
# (dtypes x block sizes x integer specializations), so they run on 8 pytest-xdist workers.
#
#   bash tools/gpu_bench.sh                 # from the repository root
#   OUT=/tmp/results FULL=1 bash tools/gpu_bench.sh   # every benchmark shape (needs ~4 more minutes)
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_results}"
PYTHON="${PYTHON:-python3}"
FULL="${FULL:-0}"
WORKERS="${WORKERS:-8}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The kernels must be compiled here: an inherited TRITON_INTERPRET=1 would silently interpret them.
unset TRITON_INTERPRET

failed=()
stage() {  # stage NAME SECONDS LOG COMMAND...: run with a time limit, tee to LOG, remember failures
    local name=$1 limit=$2 log=$3
    shift 3
    local start=$SECONDS
    echo "== $name (limit ${limit}s): $*" | tee -a "$log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$log"
    [ "$rc" -eq 0 ] || failed+=("$name(rc=$rc)")
}

{
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo 'no commit') $(git status --porcelain 2>/dev/null | wc -l) changed files"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || echo "nvidia-smi unavailable"
    "$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
    "$PYTHON" -c "import triton; print('triton', triton.__version__)" 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible: nothing to do here (run the CPU tests with pytest instead)" | tee -a "$OUT/env.txt"
    exit 1
fi

# 1. Tests: every GPU-marked test in the repo, then the kernel tests on CUDA (compiled kernels).
stage gpu-tests 90 "$OUT/tests.log" \
    "$PYTHON" -m pytest -q -m gpu tests/ --timeout=90 -p no:cacheprovider
xdist=()
"$PYTHON" -c "import xdist" 2>/dev/null && xdist=(-n "$WORKERS")
stage kernel-tests 80 "$OUT/tests.log" \
    "$PYTHON" -m pytest -q "${xdist[@]}" tests/test_kernels.py tests/test_kernels_model.py --timeout=60 -p no:cacheprovider

# 2. Kernel benchmark (torch.compile of each reference is most of its time).
bench_args=(--markdown "$OUT/kernels.md" --plot "$OUT/kernels.png")
[ "$FULL" = "1" ] || bench_args+=(--quick)
stage bench-kernels 160 "$OUT/bench_kernels.log" "$PYTHON" tools/bench_kernels.py "${bench_args[@]}"

# 3. Training throughput, when the tool exists.
if [ -f tools/bench_train.py ]; then
    if [ -n "${BENCH_TRAIN_ARGS:-}" ]; then
        # shellcheck disable=SC2206  # a list of options, split on purpose
        train_args=(${BENCH_TRAIN_ARGS})
    else
        common="train.grad_accum_steps=1 precision.mode=bf16 parallel.strategy=none"
        train_args=(--config configs/gpt2-124m.yaml --steps 10 --warmup 3 --variants
                    "$common kernels.backend=torch" "$common kernels.backend=triton"
                    "$common kernels.backend=torch train.compile=true")
    fi
    stage bench-train 110 "$OUT/bench_train.log" \
        "$PYTHON" tools/bench_train.py --markdown "$OUT/train.md" --plot "$OUT/train.png" "${train_args[@]}"
else
    echo "tools/bench_train.py not present: skipped" | tee -a "$OUT/env.txt"
fi

echo "outputs in $OUT:"
ls -l "$OUT"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED stages: ${failed[*]}"
    exit 1
fi
echo "all stages passed"
