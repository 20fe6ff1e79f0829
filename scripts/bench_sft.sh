#!/usr/bin/env bash
# LENGTH_GROUPING benchmark: the same SFT run (model, data, seed, steps) with LENGTH_GROUPING=0
# and =1 through ./train_sft_custom.sh, then padding efficiency and throughput side by side.
# Usage: [VAR=value ...] scripts/bench_sft.sh   (make sft-bench); any launcher variable applies,
#   e.g. MODEL_PATH=runs/x/final DATA_PATH=chat.jsonl MAX_STEPS=50 make sft-bench
set -euo pipefail
cd "$(dirname "$0")/.."

BATCH_SIZE=${BATCH_SIZE:-16}
export MAX_STEPS=${MAX_STEPS:-20}
export NUM_WORKERS=${NUM_WORKERS:-0}  # loading is not what is measured here
export SEED=${SEED:-1337}
stamp=$(date +%Y%m%d-%H%M%S)
runs=()
for grouping in 0 1; do
  name="sft-bench-$stamp-grouping$grouping"
  echo "LENGTH_GROUPING=$grouping: runs/$name (BATCH_SIZE=$BATCH_SIZE MAX_STEPS=$MAX_STEPS)"
  RUN_NAME=$name LENGTH_GROUPING=$grouping ./train_sft_custom.sh "$BATCH_SIZE" >"/tmp/$name.log" 2>&1 ||
    { tail -n 3 "/tmp/$name.log" >&2; exit 2; }
  runs+=("${OUTPUT_DIR:-runs}/$name")
done
"$(source scripts/common.sh && kit_python)" - "${runs[@]}" <<'PY'
import json, sys
rows = [json.load(open(f"{run}/summary.json")) for run in sys.argv[1:]]
print(f"{'LENGTH_GROUPING':>15} {'padding_eff':>11} {'samples/s':>9} {'real tok/s':>10} {'step ms':>8} {'final loss':>10}")
for r in rows:
    print(f"{int(r['length_grouping']):>15} {r['padding_efficiency']:>11.1%} {r['samples_per_sec']:>9.2f} "
          f"{r['tokens_per_sec']:>10.0f} {r['step_time_ms']:>8.0f} {r['final_loss']:>10.4f}")
base, grouped = rows
print(f"grouping: padding efficiency {base['padding_efficiency']:.1%} -> {grouped['padding_efficiency']:.1%}, "
      f"samples/s x{grouped['samples_per_sec'] / base['samples_per_sec']:.2f}")
PY
