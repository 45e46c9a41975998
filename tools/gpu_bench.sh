#!/usr/bin/env bash
# One script for a GPU session (sized for one H200 in under 8 minutes, no network needed). Stages:
#   1. gpu-tests      the GPU-marked tests, then the kernel tests with the kernels compiled;
#   2. kernels        tools/bench_kernels.py: fused Triton kernels vs eager vs torch.compile, GB/s
#                     against the measured copy bandwidth;
#   3. train-124m     tools/bench_train.py on GPT-2 124M, bf16: eager vs torch.compile, with MFU;
#   4. train-1.3b     the same on the 1.3B config, plus FP8 through torchao against bf16;
#   5. attention      tools/bench_memory.py at s=8192: SDPA (flash) vs the materialized (math)
#                     attention, bytes kept for backward and peak memory;
#   6. chapter        tools/reproduce.py --device cuda: the chapter tables' GPU cells, saved as
#                     gpu_measurements.json, which later CPU runs of reproduce.py read back.
# Everything goes under $OUT (default ./gpu_results): env.txt (date, git commit, GPU, driver,
# torch, triton), one .log per stage, and gpu_<stage>.md (+ .json rows, + .png) per benchmark.
# Copy the gpu_*.md/json/png and gpu_measurements.json into docs/results/ to publish them.
# Each stage has its own time limit on the GPU (LIMIT_SCALE=2 doubles them all, for a slower GPU); a failing
# stage is recorded and the next one still runs. The dry run applies no limits: its stages only check that
# the code paths work, and on a busy CPU their time says nothing (the caller's own timeout bounds it).
#
#   bash tools/gpu_bench.sh                 # from the repository root, on the GPU machine
#   bash tools/gpu_bench.sh --dry-run       # every stage's set-up on the CPU with tiny shapes (CI runs it)
#   OUT=/tmp/results FULL=1 bash tools/gpu_bench.sh   # every kernel benchmark shape (~4 more minutes)
set -uo pipefail

cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT="${OUT:-./gpu_results}"
PYTHON="${PYTHON:-python3}"
FULL="${FULL:-0}"
LIMIT_SCALE="${LIMIT_SCALE:-1}"
WORKERS="${WORKERS:-8}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"

failed=()
stage() {  # stage NAME SECONDS LOG COMMAND...: run with a time limit (none in a dry run), tee to LOG, remember failures
    local name=$1 limit=$2 log=$3
    shift 3
    local start=$SECONDS
    if [ "$DRY" = "1" ]; then
        echo "== $name (no limit: dry run): $*" | tee -a "$log"
        "$@" 2>&1 | tee -a "$log"
    else
        limit=$(awk -v s="$limit" -v f="$LIMIT_SCALE" 'BEGIN { printf "%d", s * f + 0.5 }')
        echo "== $name (limit ${limit}s): $*" | tee -a "$log"
        timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    fi
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$log"
    [ "$rc" -eq 0 ] || failed+=("$name(rc=$rc)")
}

if [ "$DRY" != "1" ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible: nothing to measure (bash tools/gpu_bench.sh --dry-run checks the stages on CPU)"
    exit 1
fi

{
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo 'no commit') $(git status --porcelain 2>/dev/null | wc -l) changed files"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || echo "nvidia-smi unavailable"
    "$PYTHON" - <<'PY' 2>&1
import importlib, sys
import torch
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| device',
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')
for name in ('triton', 'torchao'):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # noqa: BLE001  the header says what is missing; the stages that need it fail
        print(name, 'unavailable:', e)
PY
    [ "$DRY" = "1" ] && echo "DRY RUN on the CPU: tiny shapes, no figure here is a GPU measurement"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "$DRY" = "1" ]; then
    # Each stage's own code path with shapes that take seconds on a CPU; the kernels interpreted.
    export TRITON_INTERPRET=1
    device=cpu
    tiny="model.n_layer=2 model.d_model=64 model.n_head=4 model.max_seq_len=64 train.micro_batch_size=2"
    cfg124=configs/tiny.yaml; cfg13=configs/tiny.yaml; base124="$tiny"; base13="$tiny"
    steps=(--steps 1 --warmup 1 --rounds 1)
    seq=256
    kernel_ops=(--ops rms_norm --reps 1 --warmup 1 --no-compile)
    compiled=""  # torch.compile's CPU build of every variant would take minutes; tests/unit/parallel/test_compile.py covers it
else
    # The kernels must be compiled here: an inherited TRITON_INTERPRET=1 would silently interpret them.
    unset TRITON_INTERPRET
    device=cuda
    cfg124=configs/gpt2-124m.yaml; cfg13=configs/gpt-1.3b.yaml; base124=""; base13="train.micro_batch_size=4"
    steps=(--steps 3 --warmup 3 --rounds 3)
    seq=8192
    kernel_ops=()
    [ "$FULL" = "1" ] || kernel_ops+=(--quick)
    compiled="train.compile=true"
fi
bf16="train.device=$device precision.mode=bf16 parallel.strategy=none train.grad_accum_steps=1"

# 1. Tests: every GPU-marked test in the repo, then the kernel tests on CUDA (compiled kernels).
if [ "$DRY" = "1" ]; then
    # Collecting every test module takes long on a CPU and the suite does it anyway: the files with GPU tests.
    stage gpu-tests 120 "$OUT/tests.log" "$PYTHON" -m pytest -q --collect-only -m gpu \
        $(grep -rl --include="*.py" "pytest.mark.gpu" tests/) -p no:cacheprovider
else
    # 150 s: the in-process GPU tests, and a 2-rank launch (Transformer Engine's FP8 under DDP) that
    # starts two processes and imports Transformer Engine in each.
    stage gpu-tests 150 "$OUT/tests.log" \
        "$PYTHON" -m pytest -q -m gpu tests/ --timeout=90 -p no:cacheprovider
    xdist=()
    "$PYTHON" -c "import xdist" 2>/dev/null && xdist=(-n "$WORKERS")
    stage kernel-tests 80 "$OUT/tests.log" \
        "$PYTHON" -m pytest -q "${xdist[@]}" tests/unit/kernels/test_triton_kernels.py tests/unit/kernels/test_gpt_on_triton_kernels.py --timeout=60 -p no:cacheprovider
fi

# 2. Kernels: time and GB/s of each fused kernel against the copy bandwidth measured alongside.
stage kernels 160 "$OUT/kernels.log" "$PYTHON" -m tools.bench_kernels "${kernel_ops[@]}" \
    --markdown "$OUT/gpu_kernels.md" --plot "$OUT/gpu_kernels.png"

# 3-4. Training steps: bf16 eager vs compiled (MFU in the table), and FP8 (torchao) vs bf16 on 1.3B.
stage train-124m 120 "$OUT/train_124m.log" "$PYTHON" -m tools.bench_train --config "$cfg124" "${steps[@]}" \
    --variants "$base124 $bf16" ${compiled:+"$base124 $bf16 $compiled"} \
    --markdown "$OUT/gpu_train_124m.md" --plot "$OUT/gpu_train_124m.png"
fp8="train.device=$device precision.mode=fp8 precision.fp8_backend=torchao parallel.strategy=none train.grad_accum_steps=1"
stage train-1.3b 150 "$OUT/train_1.3b.log" "$PYTHON" -m tools.bench_train --config "$cfg13" "${steps[@]}" \
    --variants "$base13 $bf16 $compiled" "$base13 $fp8 $compiled" ${compiled:+"$base13 $bf16"} \
    --markdown "$OUT/gpu_train_1.3b.md" --plot "$OUT/gpu_train_1.3b.png"

# 5. Attention memory at a long sequence: the fused kernel keeps no s x s scores.
stage attention 90 "$OUT/attention.log" "$PYTHON" -m tools.bench_memory --device "$device" --n-layer 1 \
    --seq-len "$seq" --micro-batch 1 --policies none --attention reference sdpa --steps 2 \
    --markdown "$OUT/gpu_attention.md" --plot "$OUT/gpu_attention.png"

# 6. The chapter's tables with this machine's GPU cells (gpu_measurements.json).
if [ "$DRY" = "1" ]; then
    stage chapter 120 "$OUT/chapter.log" "$PYTHON" -m tools.reproduce --quick --no-measure --out "$OUT/chapter"
else
    stage chapter 120 "$OUT/chapter.log" "$PYTHON" -m tools.reproduce --quick --device cuda --out "$OUT/chapter"
fi

echo "outputs in $OUT:"
ls -l "$OUT"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED stages: ${failed[*]}"
    exit 1
fi
echo "all stages passed"
