#!/usr/bin/env bash
# Profile a config end to end: train.py --profile -> chrome trace(s) -> text summary -> memory snapshot.
# docs/profiling.md explains what to look for in each.
#
# usage: tools/profile.sh [options] CONFIG [--section.key=value ...]
#
#   -n, --nproc N    run N processes with torchrun (default 1: plain python); each rank writes a trace
#   --nccl-debug     NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET, one log per process in the profile folder
#                    (set before launch: NCCL reads them when the communicator is created)
#   --steps N        train.max_steps of the profiling run (default: profile wait + warmup + active + 1)
#   --no-snapshot    skip the memory snapshot (tools/memory_snapshot.py, one process)
#   -h, --help       this text
#
# Overrides go to train.py and to the snapshot, e.g. --model.recompute=full --precision.mode=bf16.
# Environment: PYTHON (default: python), TRAIN_PY (default: train.py in the repository root).
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

NPROC=1
NCCL_LOG=0
SNAPSHOT=1
STEPS=""
CONFIG=""
OVERRIDES=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        -n|--nproc) NPROC="${2:?--nproc needs a number}"; shift 2 ;;
        --nccl-debug) NCCL_LOG=1; shift ;;
        --steps) STEPS="${2:?--steps needs a number}"; shift 2 ;;
        --no-snapshot) SNAPSHOT=0; shift ;;
        --*=*) OVERRIDES+=("$1"); shift ;;
        -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
        *)
            if [[ -n "$CONFIG" ]]; then echo "error: one CONFIG expected, got '$CONFIG' and '$1'" >&2; exit 2; fi
            CONFIG="$1"; shift ;;
    esac
done
if [[ -z "$CONFIG" ]]; then echo "error: no CONFIG given (e.g. tools/profile.sh configs/tiny.yaml)" >&2; exit 2; fi
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then echo "error: --nproc must be a positive integer, got '$NPROC'" >&2; exit 2; fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
TRAIN_PY="${TRAIN_PY:-$ROOT/train.py}"
cd "$ROOT"

# The profiling run is a run of its own: by default it is named <name>-profile-<UTC time>, so it never
# writes into (and is never refused by) the folder of a training run or of an earlier profile; a
# --name or --logging.run_dir among the overrides wins. The run directory, the default step count and
# the config's decay length are resolved from the config exactly as train.py resolves them.
read -r RUN_NAME RUN_DIR DEFAULT_STEPS DECAY_STEPS < <("$PYTHON" -c '
import sys, time
from training.config import load_config
base = load_config(sys.argv[1], sys.argv[2:])
stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
cfg = load_config(sys.argv[1], ["--name=" + base.name + "-profile-" + stamp, *sys.argv[2:]])
t = cfg.train
print(cfg.name, cfg.logging.run_dir.format(name=cfg.name), t.profile_wait + t.profile_warmup + t.profile_active + 1,
      cfg.lr_schedule()["decay_steps"])
' "$CONFIG" "${OVERRIDES[@]}")
STEPS="${STEPS:-$DEFAULT_STEPS}"
PROFILE_DIR="$RUN_DIR/profile"
mkdir -p "$PROFILE_DIR"
MARKER="$(mktemp)"
trap 'rm -f "$MARKER"' EXIT

if [[ "$NCCL_LOG" == 1 ]]; then
    export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE="$PROFILE_DIR/nccl.%h.%p.log"
fi

# A short run: no evaluation, no checkpoints; the user's overrides come last and win. It is the first
# few steps of the config's full schedule (decay_steps stated), so it runs at that schedule's learning
# rates instead of a warm-up and decay squeezed into the profiling run.
RUN_ARGS=(--config "$CONFIG" "--name=$RUN_NAME" --profile "--train.max_steps=$STEPS" "--optim.decay_steps=$DECAY_STEPS"
          --train.eval_interval=0 --checkpoint.save_final=false "${OVERRIDES[@]}")
echo "== 1/3 profiling $STEPS steps of $CONFIG into $PROFILE_DIR ($NPROC process(es))"
if [[ "$NPROC" -gt 1 ]]; then
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$TRAIN_PY" "${RUN_ARGS[@]}"
else
    "$PYTHON" "$TRAIN_PY" "${RUN_ARGS[@]}"
fi

echo "== 2/3 trace summary"
mapfile -t TRACES < <(find "$PROFILE_DIR" -maxdepth 1 -type f \( -name '*.json' -o -name '*.json.gz' \) \
                      -newer "$MARKER" ! -name 'memory_trace_cpu.json' | sort)
if [[ ${#TRACES[@]} -eq 0 ]]; then
    echo "error: train.py wrote no trace into $PROFILE_DIR; are there more than" \
         "profile_wait + profile_warmup steps (see --steps)?" >&2
    exit 1
fi
for trace in "${TRACES[@]}"; do
    "$PYTHON" -m tools.trace_summary "$trace" | tee "${trace%%.json*}.summary.txt"
    echo
done

if [[ "$SNAPSHOT" == 1 ]]; then
    echo "== 3/3 memory snapshot (one process, same model, precision and checkpointing)"
    "$PYTHON" -m tools.memory_snapshot --config "$CONFIG" --out "$PROFILE_DIR" "${OVERRIDES[@]}" \
        --parallel.strategy=none --parallel.init_on_meta=false --train.compile=false
else
    echo "== 3/3 memory snapshot skipped (--no-snapshot)"
fi

echo
echo "traces:    ${TRACES[*]}  (open in https://ui.perfetto.dev)"
[[ "$NCCL_LOG" == 1 ]] && echo "NCCL logs: $PROFILE_DIR/nccl.*.log"
echo "next:      docs/profiling.md, 'Reading a trace' and 'Reading a memory snapshot'"
