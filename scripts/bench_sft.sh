#!/usr/bin/env bash
# SFT batching benchmark: the same SFT run (model, data, seed, steps) three ways through
# ./train_sft_custom.sh: plain padding (each batch padded to its longest conversation),
# LENGTH_GROUPING=1 (similar lengths batched together) and PACKING=1 (conversations packed
# best-fit into rows of MAX_LENGTH, attention kept apart), then padding efficiency and real
# tokens/s side by side. With no DATA_PATH the built-in pairs are written as an alpaca file
# (instruction / input / output) and read back through the alpaca reader.
# Usage: [VAR=value ...] scripts/bench_sft.sh   (make sft-bench); any launcher variable applies,
#   e.g. MODEL_PATH=runs/x/final DATA_PATH=chat.jsonl MAX_STEPS=50 make sft-bench
set -euo pipefail
cd "$(dirname "$0")/.."

BATCH_SIZE=${BATCH_SIZE:-16}
export MAX_STEPS=${MAX_STEPS:-20}
export NUM_WORKERS=${NUM_WORKERS:-0}  # loading is not what is measured here
export SEED=${SEED:-1337}
PY="$(source scripts/common.sh && kit_python)"
stamp=$(date +%Y%m%d-%H%M%S)
# Each run's console output beside the runs (not the system temp folder, which a reboot empties)
logs="${OUTPUT_DIR:-runs}/sft-bench-$stamp-logs"
mkdir -p "$logs"
if [ -z "${DATA_PATH:-}" ]; then
  mkdir -p "${OUTPUT_DIR:-runs}"
  export DATA_PATH="${OUTPUT_DIR:-runs}/sft-bench-alpaca.json"
  "$PY" - "$DATA_PATH" <<'PY'
import json, sys
from train.data.chat.formats import builtin_conversations
records = [{"instruction": c[0]["content"], "input": "", "output": c[1]["content"]} for c in builtin_conversations()]
json.dump(records, open(sys.argv[1], "w"))
print(f"data: {len(records)} alpaca records (built-in pairs) in {sys.argv[1]}")
PY
fi
runs=()
for mode in plain grouping packing; do
  name="sft-bench-$stamp-$mode"
  case $mode in
    plain) vars=(LENGTH_GROUPING=0 PACKING=0) ;;
    grouping) vars=(LENGTH_GROUPING=1 PACKING=0) ;;
    packing) vars=(LENGTH_GROUPING=0 PACKING=1) ;;
  esac
  echo "$mode (${vars[*]}): runs/$name (BATCH_SIZE=$BATCH_SIZE MAX_STEPS=$MAX_STEPS)"
  env RUN_NAME="$name" "${vars[@]}" ./train_sft_custom.sh "$BATCH_SIZE" >"$logs/$mode.log" 2>&1 ||
    { tail -n 3 "$logs/$mode.log" >&2; echo "sft-bench: $mode failed; its whole output: $logs/$mode.log" >&2; exit 2; }
  runs+=("${OUTPUT_DIR:-runs}/$name")
done
"$PY" - "${runs[@]}" <<'PY'
import json, sys
rows = [json.load(open(f"{run}/summary.json")) for run in sys.argv[1:]]
print(f"{'mode':>9} {'padding_eff':>11} {'conv/s':>8} {'real tok/s':>10} {'step ms':>8} {'final loss':>10}")
for name, r in zip(("plain", "grouping", "packing"), rows):
    print(f"{name:>9} {r['padding_efficiency']:>11.1%} {r['samples_per_sec']:>8.2f} "
          f"{r['tokens_per_sec']:>10.0f} {r['step_time_ms']:>8.0f} {r['final_loss']:>10.4f}")
plain, grouped, packed = rows
for name, r in (("grouping", grouped), ("packing", packed)):
    print(f"{name}: padding efficiency {plain['padding_efficiency']:.1%} -> {r['padding_efficiency']:.1%}, "
          f"real tokens/s x{r['tokens_per_sec'] / plain['tokens_per_sec']:.2f} vs plain")
print("packing counts BATCH_SIZE in rows of MAX_LENGTH tokens, so its steps hold more conversations;"
      " compare real tokens/s")
PY
echo "logs: $logs/ (plain.log, grouping.log, packing.log)"
