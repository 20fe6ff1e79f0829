#!/usr/bin/env bash
# `make gpu-report`: the GPU figures of bench/RESULTS.md in one go, with the kit's own commands:
# bench for GPT-2 small at T=1024 (baseline preset vs optimized preset with bf16 + compile),
# find-batch, doctor, and SFT with PACKING=0 vs PACKING=1 from the doctor run's model; then
# train/tools/gpu_report.py writes the "GPU table" section of bench/RESULTS.md (device, date).
# Each part gets a time limit inside a total budget (GPU_REPORT_BUDGET_S, 540 s), so the whole
# report takes under 10 minutes; a part that fails or runs out of time is named in the table
# and the others still run. Outputs: runs/gpu-report-<date>/ (a log per part).
# Without a CUDA GPU it says so in one line and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

PY=$(kit_python)
PLAN="bench (GPT-2 small, T=1024: baseline vs optimized bf16+compile), find-batch, doctor and SFT PACKING=0 vs 1"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-report: no CUDA GPU here; on one it runs $PLAN (under 10 minutes) and writes the GPU table of bench/RESULTS.md"
  exit 0
fi

BUDGET=${GPU_REPORT_BUDGET_S:-540}
[[ $BUDGET =~ ^[1-9][0-9]*$ ]] || kit_fail "GPU_REPORT_BUDGET_S: expected a whole number of seconds, got '$BUDGET'"
OUT=${GPU_REPORT_DIR:-runs/gpu-report-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT" || kit_fail "GPU_REPORT_DIR: cannot create $OUT"
deadline=$((SECONDS + BUDGET))
# Every part: GPT-2 small at T=1024, runs and find-batch's result inside $OUT, not runs/.
export MODEL_SIZE=small MAX_LENGTH=1024 OUTPUT_DIR="$OUT"
export KIT_MADE_BY=gpu-report  # launcher gpu-report-<script>: never SFT's default model
echo "gpu-report: $PLAN -> $OUT (budget ${BUDGET} s)"

# part NAME LIMIT_S COMMAND...: run with the smaller of LIMIT_S and what is left of the budget;
# NAME, seconds and status go to parts.tsv, the output to NAME.log.
part() {
  local name=$1 limit=$2 left status start=$SECONDS
  shift 2
  left=$((deadline - SECONDS))
  ((left < limit)) && limit=$left
  if ((limit < 10)); then
    status="skipped (time budget)"
  elif timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
    status=ok
  else
    local rc=$?
    status=$([ "$rc" = 124 ] && echo "stopped after ${limit} s" || echo "failed (exit $rc)")
    tail -n 2 "$OUT/$name.log" >&2
  fi
  printf '%s\t%s\t%s\n' "$name" "$((SECONDS - start))" "$status" >>"$OUT/parts.tsv"
  echo "gpu-report: $name: $status ($((SECONDS - start)) s)"
}

part bench-baseline 120 env PRESET=baseline VS_PLAIN=0 ROUNDS=1 MAX_STEPS=20 \
  bash scripts/bench.sh --json "$OUT/bench-baseline.json"
part bench-optimized 200 env PRESET=optimized ENABLE_BF16=1 COMPILE=1 VS_PLAIN=0 ROUNDS=1 MAX_STEPS=12 \
  bash scripts/bench.sh --json "$OUT/bench-optimized.json"
part find-batch 100 env ENABLE_BF16=1 bash scripts/kit.sh find-batch optimized
part doctor 90 env ENABLE_BF16=1 bash scripts/kit.sh doctor optimized --steps 6

# SFT starts from the model the doctor run trained (MODEL_SIZE does not apply to SFT).
doctor_json=$(ls "$OUT"/*/doctor.json 2>/dev/null | head -n 1)
base=${doctor_json:+$(dirname "$doctor_json")/final}
for packing in 0 1; do
  if [ -z "$base" ] || [ ! -d "$base" ]; then
    printf '%s\t0\t%s\n' "sft-packing$packing" "skipped (no doctor run to start from)" >>"$OUT/parts.tsv"
    continue
  fi
  part "sft-packing$packing" 60 env -u MODEL_SIZE MODEL_PATH="$base" PACKING=$packing \
    RUN_NAME="sft-packing$packing" MAX_STEPS=20 ENABLE_BF16=1 NUM_WORKERS=0 ./train_sft_custom.sh 16
done

"$PY" -m train.tools.gpu_report --out "$OUT" --results bench/RESULTS.md
