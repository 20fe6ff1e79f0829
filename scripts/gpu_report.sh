#!/usr/bin/env bash
# `make gpu-report`: the GPU figures of bench/RESULTS.md in one go, with the kit's own commands,
# every path of the kit measured and one step of each profiled. Parts, in order, with the most
# seconds each may take (what each took on an H200 on 2026-11-27, or an estimate where new):
#   pretrain-preset  120 s  doctor on the optimized preset (32 x 4), GPT-2 small, T=1024, bf16 +
#                           compile, 30 steps: its verdict and the pretraining row; first, it also
#                           builds the tokenizer and token cache (82 s)
#   sft-grouped       90 s  SFT from that run's final/, LENGTH_GROUPING=1, the launcher's batch, the
#                           default compile (one graph over the length buckets) and CUDA graphs (21 s eager)
#   trl-sft-padfree   90 s  TRL's SFTTrainer, padding_free=True, on sft-grouped's plan (estimated 45 s:
#                           the plan exported, TRL imported, 30 steps, one profiled)
#   sft-packing1      75 s  the same with PACKING=1 (compiled: 59 s; eager less)
#   trl-sft-packed    90 s  TRL's SFTTrainer, packing=True (bfd, padding-free rows), sft-packing1's plan (45 s)
#   t5-pretrain      110 s  MODEL_FAMILY=t5 MODEL_SIZE=small, MAX_LENGTH 512, optimized preset 32 x 4,
#                           bf16 + compile, 30 steps (75 s)
#   t5-sft            90 s  SFT from t5-pretrain's final/, MAX_LENGTH 512, the launcher's batch, the
#                           default compile and CUDA graphs (21 s eager at 20)
#   seq2seq-t5-sft    75 s  transformers' Seq2SeqTrainer (ChatLM's SFT trainer) on t5-sft's plan (35 s)
#   dpo              100 s  preference training from the doctor run's final/ on the built-in pairs,
#                           REFERENCE=copy, the launcher's batch and packing, default compile and CUDA
#                           graphs (25 s eager at 16 pairs)
#   trl-dpo           90 s  TRL's DPOTrainer on dpo's plan (45 s)
#   grpo-base         75 s  only where grpo or grpo-trl runs and the session has no SFT or DPO final/ (a call of
#                           the GRPO pair alone): SFT from scratch, MODEL_SIZE=small, batch 16, 10 steps, eager
#                           (estimated 35 s: its BPE on the built-in conversations, 10 steps, the 0.5 GB save)
#   grpo             150 s  reward training (GRPO) from sft-grouped's final/ (else dpo's, else grpo-base's) on
#                           the built-in arithmetic task, NUM_GENERATIONS 8, MAX_COMPLETION_LENGTH 128 (fixed,
#                           so the sides' steps compare at one length), bf16, the launcher's batch (4 prompts,
#                           32 rows), the default compile (the loss's forwards; sampling eager; TRL's default
#                           is eager), a log line every step (estimated 95 s: 55 s eager, ~0.8 s a step, 128
#                           sampled tokens at ~5 ms each, and the profiled step's trace, + ~40 s compile warm-up)
#   grpo-trl         120 s  TRL's GRPOTrainer on grpo's plan: its prompts' token ids, rows, lengths, stop ids,
#                           loss and rewards, bf16, no vLLM (bench/grpo_trl_side.py --kit; estimated 70 s)
#   tokenize-scaling 100 s  the token cache build of a generated 1 GB JSONL corpus on every CPU core
#                           against one core's encode rate and the machine's ceiling, memory sampled
#                           (bench/tokenize_scaling.py; the corpus is made in the background while
#                           the GPU parts run; 90 s)
#   pretrain-auto     80 s  the optimized preset with AUTO_BATCH=1: find-batch's search in the run, its
#                           answer saved as find-batch saves it (the find-batch row), 30 steps (79 s)
#   bench-baseline    60 s  bench of the baseline preset (fp32, 8 x 1), 20 steps: the optimized / baseline
#                           ratio against pretrain-preset (30 s)
# about 640 s expected in all before the peers and GRPO (the peers ~180 s more, the GRPO pair ~165 s):
# more than one call's budget. A part gets the smaller of its limit and what is left of
# GPU_REPORT_BUDGET_S (560 s: one 10-minute device call with room for the report), so the parts the
# issue's targets need come first and bench-baseline, measured before, last.
# GPU_REPORT_PARTS=a,b runs only the parts named (a second call's re-run of what changed);
# GPU_REPORT_PARTS=peers names the peers and the kit parts they are measured against (about 445 s);
# GPU_REPORT_PARTS=grpo,grpo-trl the GRPO pair (about 165 s, 200 s with grpo-base on a fresh machine).
# One session (15 minutes of device time, start-up included) in two calls, the second at once on the
# warm machine with the same GPU_REPORT_DIR (so GRPO starts from the first call's sft-grouped final/):
# GPU_REPORT_PARTS=peers (~445 s), then grpo,grpo-trl,tokenize-scaling,pretrain-auto,bench-baseline
# (~365 s; bench-baseline, 30 s, is the one to leave out where start-up took more than ~60 s).
# GPU_REPORT_DRY=1 runs the parts on this machine's CPU at toy sizes (MODEL_SIZE nano, MAX_LENGTH 128,
# T5 64, MAX_STEPS 4, MAX_COMPLETION_LENGTH 8, fp32, eager; no tokenize-scaling; each part 3x its
# seconds, the budget 3x too): the parts' own commands checked without a GPU, the table written to
# GPU_REPORT_DIR (RESULTS.md, gpu_table.json), never to bench/.
# The kit's parts run the launchers' defaults (batch, COMPILE, DPO's packing) except where the peer
# needs the same setting: bf16 (ENABLE_BF16=1; the peers' bf16 too), the DataLoader in the
# training process (NUM_WORKERS=0, the trainers' default), DPO's REFERENCE=copy (TRL's frozen copy).
# A peer part (bench/peers.py) exports its kit part's plan (model, token ids, MAX_LENGTH) with that
# run's batch and precision, and runs the peer on it; the peers come from .whl/ (bash
# bench/peer_wheels.sh here, then carry .whl to the GPU machine), installed once into
# GPU_REPORT_PEER_SITE (/tmp/site) where python3 has no trl. The
# paths (pretrain-preset, sft-grouped, sft-packing1, t5-pretrain, t5-sft, dpo, grpo) run under
# train/tools/step_profile.py, which traces optimizer step 2 (inside the warm-up the throughput
# leaves out) into NAME.profile.json. Then train/tools/gpu_report.py writes the "GPU table"
# section of bench/RESULTS.md (device, date, every row, the issue's targets as met / missed by
# how much, the profiles, the peers and the kit / peer ratios) and bench/gpu_table.json (the same
# figures for a program). A part that fails or runs out of time is named in the table and the
# others still run.
# Outputs: runs/gpu-report-<date>/ (a log per part). Without a CUDA GPU it says so in one line and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

PY=$(kit_python)
PLAN="bench (GPT-2 small, T=1024, baseline preset), find-batch, doctor (optimized, bf16 + compile), AUTO_BATCH=1, SFT PACKING=0 vs 1 (LENGTH_GROUPING=1 vs packed), T5 small pretraining and SFT, DPO, GRPO (NUM_GENERATIONS 8), one step of each profiled, TRL's SFT and DPO trainers, TRL's GRPOTrainer and transformers' Seq2SeqTrainer on the same plans; tokenizing 1 GB on every CPU core"
DRY=${GPU_REPORT_DRY:-0}
[[ $DRY =~ ^[01]$ ]] || kit_fail "GPU_REPORT_DRY: expected 0 or 1, got '$DRY'"
if [ "$DRY" = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-report: no CUDA GPU here; on one it runs $PLAN (under 10 minutes) and writes the GPU table of bench/RESULTS.md and bench/gpu_table.json"
  exit 0
fi

BUDGET=${GPU_REPORT_BUDGET_S:-$((560 * (1 + 2 * DRY)))}
[[ $BUDGET =~ ^[1-9][0-9]*$ ]] || kit_fail "GPU_REPORT_BUDGET_S: expected a whole number of seconds, got '$BUDGET'"
OUT=${GPU_REPORT_DIR:-runs/gpu-report-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT" || kit_fail "GPU_REPORT_DIR: cannot create $OUT"
deadline=$((SECONDS + BUDGET))
# Every part: GPT-2 small at T=1024 unless it says otherwise, runs and find-batch's result inside
# $OUT, not runs/; 30 steps, so that step 2 (the profiled one) is inside the 3 warm-up steps the
# throughput leaves out (step 1 was no steady step on an H200: 2,358 ms where steady ones took 278).
SIZE=small LENGTH=1024 T5_LENGTH=512 STEPS=30 BASE_STEPS=10 COMPLETION=128 BF16=1 COMPILE_ON=1 SLOWER=1
if [ "$DRY" = 1 ]; then  # the same commands at toy sizes on the CPU (step 2 still inside the 4 steps)
  SIZE=nano LENGTH=128 T5_LENGTH=64 STEPS=4 BASE_STEPS=4 COMPLETION=8 BF16=0 COMPILE_ON=0 SLOWER=3
fi
export MODEL_SIZE=$SIZE MAX_LENGTH=$LENGTH OUTPUT_DIR="$OUT" MAX_STEPS=$STEPS
export KIT_MADE_BY=gpu-report  # launcher gpu-report-<script>: never SFT's default model
echo "gpu-report: $PLAN -> $OUT (budget ${BUDGET} s)"
[ "$DRY" = 0 ] || echo "gpu-report: GPU_REPORT_DRY=1: on $("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "the CPU")') at toy sizes (MODEL_SIZE $SIZE, MAX_LENGTH $LENGTH, $STEPS steps); the table goes to $OUT"

PEERS=pretrain-preset,sft-grouped,trl-sft-padfree,sft-packing1,trl-sft-packed,t5-pretrain,t5-sft,seq2seq-t5-sft,dpo,trl-dpo
[[ ",${GPU_REPORT_PARTS:-}," == *",peers,"* ]] && GPU_REPORT_PARTS="$GPU_REPORT_PARTS,$PEERS"
# wanted NAME: the part runs this time (every part, or those GPU_REPORT_PARTS=a,b names)
wanted() { [ -z "${GPU_REPORT_PARTS:-}" ] || [[ ",$GPU_REPORT_PARTS," == *",$1,"* ]]; }

# part NAME LIMIT_S COMMAND...: run with the smaller of LIMIT_S and what is left of the budget;
# NAME, seconds and status go to parts.tsv, the output to NAME.log.
part() {
  wanted "$1" || return 0  # not asked for this time (GPU_REPORT_PARTS)
  run_part "$@"
}
# run_part NAME LIMIT_S COMMAND...: part's run, whether or not GPU_REPORT_PARTS names NAME (a part that
# another part needs: grpo-base)
run_part() {
  local name=$1 limit=$(($2 * SLOWER)) left status start=$SECONDS
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

# profiled NAME LIMIT_S LAUNCHER...: the launcher's own command (SHOW_COMMAND=1 prints it:
# python -m train COMMAND flags...) run as a part under step_profile, which writes NAME.profile.json.
profiled() {
  local name=$1 limit=$2 text
  shift 2
  wanted "$name" || return 0
  local cmd=()
  if text=$(SHOW_COMMAND=1 "$@" 2>>"$OUT/$name.log") && eval "cmd=($text)" && [ "${cmd[2]:-}" = train ]; then
    part "$name" "$limit" "$PY" -m train.tools.step_profile --json "$OUT/$name.profile.json" --step 2 "${cmd[@]:3}"
  else
    printf '%s\t0\t%s\n' "$name" "failed (no launcher command; see $name.log)" >>"$OUT/parts.tsv"
  fi
}

# skip NAME WHY: a part that cannot run, named in the table
skip() { wanted "$1" || return 0; printf '%s\t0\t%s\n' "$1" "skipped ($2)" >>"$OUT/parts.tsv"; }

# peer_env: the environment the peers run in (empty where python3 has trl, datasets); the carried
# wheels installed once into GPU_REPORT_PEER_SITE otherwise. Fails where neither is there.
PEER_SITE=${GPU_REPORT_PEER_SITE:-/tmp/site}
peer_env() {
  if [ -z "${peer_pythonpath+set}" ]; then
    if "$PY" -c 'import trl, datasets' 2>/dev/null; then
      peer_pythonpath=
    elif compgen -G ".whl/*.whl" >/dev/null && "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$PEER_SITE" .whl/*.whl >>"$OUT/peer-wheels.log" 2>&1; then
      peer_pythonpath=$PEER_SITE${PYTHONPATH:+:$PYTHONPATH}
    else
      peer_pythonpath=none
    fi
  fi
  [ "$peer_pythonpath" != none ]
}

# peer NAME LIMIT KIT_PART LAUNCHER...: bench/peers.py's NAME on the plan of the launcher's command,
# with the batch and precision of the kit's run KIT_PART; its figures in NAME.json, step 2 profiled.
peer() {
  local name=$1 limit=$2 kit=$3 text
  shift 3
  wanted "$name" || return 0
  [ -f "$OUT/$kit/summary.json" ] || { skip "$name" "no $kit run to measure against"; return 0; }
  peer_env || { skip "$name" "no trl here and no .whl/ wheels: bash bench/peer_wheels.sh, carry .whl"; return 0; }
  local cmd=()
  if text=$(SHOW_COMMAND=1 "$@" 2>>"$OUT/$name.log") && eval "cmd=($text)" && [ "${cmd[2]:-}" = train ]; then
    part "$name" "$limit" env ${peer_pythonpath:+PYTHONPATH=$peer_pythonpath} "$PY" bench/peers.py "$name" \
      --work "$OUT/$name.plan" --run "$OUT/$kit" --steps "$MAX_STEPS" --json "$OUT/$name.json" \
      --profile "$OUT/$name.profile.json" -- "${cmd[@]:3}"
    rm -rf "$OUT/$name.plan"  # the model's copy (0.5 GB for GPT-2 small) and the token ids
  else
    printf '%s\t0\t%s\n' "$name" "failed (no launcher command; see $name.log)" >>"$OUT/parts.tsv"
  fi
}

# The tokenize-scaling part's corpus (1 GB) is made on one core while the GPU parts run.
TOKENIZE_WORK="$OUT/tokenize"
prepare_pid=
if [ "$DRY" = 0 ] && wanted tokenize-scaling; then
  "$PY" bench/tokenize_scaling.py --prepare --work "$TOKENIZE_WORK" >"$OUT/tokenize-prepare.log" 2>&1 &
  prepare_pid=$!
fi

GPT2="env ENABLE_BF16=$BF16 COMPILE=$COMPILE_ON"
profiled pretrain-preset 120 $GPT2 bash scripts/kit.sh doctor optimized --steps "$STEPS"

# SFT starts from the model the doctor run trained (MODEL_SIZE does not apply to SFT).
doctor_json=$(ls "$OUT"/*/doctor.json 2>/dev/null | head -n 1)
base=${doctor_json:+$(dirname "$doctor_json")/final}
SFT="env -u MODEL_SIZE MODEL_PATH=$base ENABLE_BF16=$BF16 NUM_WORKERS=0"
if [ -n "$base" ] && [ -d "$base" ]; then
  profiled sft-grouped 90 $SFT LENGTH_GROUPING=1 RUN_NAME=sft-grouped ./train_sft_custom.sh
  peer trl-sft-padfree 90 sft-grouped $SFT LENGTH_GROUPING=1 RUN_NAME=sft-grouped ./train_sft_custom.sh
  profiled sft-packing1 75 $SFT PACKING=1 RUN_NAME=sft-packing1 ./train_sft_custom.sh
  peer trl-sft-packed 90 sft-packing1 $SFT PACKING=1 RUN_NAME=sft-packing1 ./train_sft_custom.sh
else
  for name in sft-grouped trl-sft-padfree sft-packing1 trl-sft-packed; do skip $name "no doctor run to start from"; done
fi

T5="env MODEL_FAMILY=t5 MODEL_SIZE=$SIZE MAX_LENGTH=$T5_LENGTH ENABLE_BF16=$BF16"
profiled t5-pretrain 110 $T5 COMPILE=$COMPILE_ON RUN_NAME=t5-pretrain ./run_single_gpu_optimized.sh
T5_SFT="env -u MODEL_SIZE MODEL_PATH=$OUT/t5-pretrain/final MAX_LENGTH=$T5_LENGTH ENABLE_BF16=$BF16 NUM_WORKERS=0 RUN_NAME=t5-sft"
if [ -d "$OUT/t5-pretrain/final" ]; then
  profiled t5-sft 90 $T5_SFT ./train_sft_custom.sh
  peer seq2seq-t5-sft 75 t5-sft $T5_SFT ./train_sft_custom.sh
else
  skip t5-sft "no t5-pretrain final/ to start from"
  skip seq2seq-t5-sft "no t5-pretrain final/ to start from"
fi
if [ -n "$base" ] && [ -d "$base" ]; then
  profiled dpo 100 $SFT REFERENCE=copy RUN_NAME=dpo ./train_dpo.sh
  peer trl-dpo 90 dpo $SFT REFERENCE=copy RUN_NAME=dpo ./train_dpo.sh
else
  skip dpo "no doctor run to start from"
  skip trl-dpo "no doctor run to start from"
fi

# GRPO (pretrain -> SFT -> GRPO) from this session's chat model; a call of the GRPO pair alone makes one
# (grpo-base: SFT from scratch, the same GPT-2 shape). NUM_GENERATIONS and MAX_COMPLETION_LENGTH are set
# so that both sides sample the same rows to the same bound; LOG_EVERY=1 logs each step's completion
# lengths (a host read per step, beside the sampler's own), which the completion tokens/s are made of.
# COMPILE is left empty, as a user runs it (on with a GPU: the loss's forwards; TRL's default is eager).
grpo_base=
for m in sft-grouped dpo grpo-base; do [ -d "$OUT/$m/final" ] && { grpo_base=$OUT/$m/final; break; }; done
if ! wanted grpo && [ -f "$OUT/grpo/summary.json" ]; then  # grpo-trl alone: the model of the run it is measured against
  grpo_base=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("model_path") or "")' \
    "$OUT/grpo/summary.json" 2>/dev/null)
fi
if [ -z "$grpo_base" ] && { wanted grpo || wanted grpo-trl; }; then
  run_part grpo-base 75 env MODEL_SIZE=$SIZE ENABLE_BF16=$BF16 NUM_WORKERS=0 COMPILE=0 BATCH_SIZE=16 \
    MAX_STEPS=$BASE_STEPS RUN_NAME=grpo-base ./train_sft_custom.sh
  [ -d "$OUT/grpo-base/final" ] && grpo_base=$OUT/grpo-base/final
fi
GRPO="env -u MODEL_SIZE MODEL_PATH=$grpo_base ENABLE_BF16=$BF16 NUM_WORKERS=0 NUM_GENERATIONS=8 MAX_COMPLETION_LENGTH=$COMPLETION LOG_EVERY=1 RUN_NAME=grpo"
if [ -n "$grpo_base" ]; then
  profiled grpo 150 $GRPO ./train_grpo.sh
  peer grpo-trl 120 grpo $GRPO ./train_grpo.sh
else
  skip grpo "no chat model to start from (see grpo-base.log)"
  skip grpo-trl "no chat model to start from (see grpo-base.log)"
fi

[ -z "$prepare_pid" ] || wait "$prepare_pid" || echo "gpu-report: the tokenize corpus was not made (see $OUT/tokenize-prepare.log)" >&2
if [ "$DRY" = 1 ]; then
  skip tokenize-scaling "GPU_REPORT_DRY: its 1 GB corpus is no toy"
else
  part tokenize-scaling 100 "$PY" bench/tokenize_scaling.py --work "$TOKENIZE_WORK" --json "$OUT/tokenize-scaling.json"
fi
rm -rf "$TOKENIZE_WORK"

part pretrain-auto 80 $GPT2 AUTO_BATCH=1 RUN_NAME=pretrain-auto ./run_single_gpu_optimized.sh
part bench-baseline 60 env PRESET=baseline COMPILE=0 VS_PLAIN=0 ROUNDS=1 bash scripts/bench.sh --json "$OUT/bench-baseline.json"

if [ "$DRY" = 1 ]; then  # a toy table: never bench/'s
  "$PY" -m train.tools.gpu_report --out "$OUT" --results "$OUT/RESULTS.md" --table "$OUT/gpu_table.json"
else
  "$PY" -m train.tools.gpu_report --out "$OUT" --results bench/RESULTS.md --table bench/gpu_table.json
fi
