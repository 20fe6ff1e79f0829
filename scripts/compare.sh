#!/usr/bin/env bash
# `make compare` / `make compare-sft` / `make compare-dpo`: the guides' "before" launcher and the fast one
# on the same model, data, seed and sample budget, then `python -m train compare` on their run folders.
# compare-dpo: ./train_dpo.sh with one pair per step against its own defaults, on the same pairs (DATA_PATH).
# compare-grpo: ./train_grpo.sh with one prompt per step against its own defaults, on the same prompts
# (DATA_PATH, or the built-in task).
# Usage: [VAR=value ...] scripts/compare.sh [pretrain|sft|dpo|grpo]
#   COMPARE_SAMPLES  sequences each run trains on (its MAX_SAMPLES); empty: 4096 on a GPU; on CPU 1024
#                    (pretrain: 128 steps of 8 against 8 of 128, 6 minutes on 2 busy cores) or 256 (sft:
#                    256 single conversations against 8 steps of 32): the fewest that give the fast side
#                    the 5 steady-state steps a throughput needs (with 256 / 128 the table called it a guess)
#   REPEAT           runs per side, alternating A B A B ... so drift hits both; the table then shows
#                    the median and the spread, and calls a difference inside the spread noise
#   Shared by both sides: MODEL_SIZE, MODEL_FAMILY (gpt2 | t5), MODEL_CONFIG, MAX_LENGTH, DATA_PATH, TOKENIZER_PATH, VOCAB_SIZE,
#   SEED, DEVICE, CACHE_DIR, OUTPUT_DIR, LOG_EVERY, ... (any launcher variable not listed below).
#   Optimized side only (the baseline keeps the guides' "before"): BATCH_SIZE, GRADIENT_ACCUM,
#   NUM_WORKERS, PREFETCH_FACTOR, PIN_MEMORY, PERSISTENT_WORKERS, PRECISION, ENABLE_FP16, ENABLE_BF16,
#   ENABLE_GRAD_CKPT, TF32, COMPILE. E.g. PRECISION=auto make compare
#   RESUME=1         continue an interrupted comparison (make compare RESUME=1, with the same COMPARE_SAMPLES
#                    and variables): each side with a checkpoint is resumed (a finished one is left as it
#                    is), a side not started yet (or stopped before its first checkpoint) is run again
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MODE=${1:-pretrain}
COMPARE_SAMPLES=${COMPARE_SAMPLES:-}
REPEAT=${REPEAT:-1}
OUTPUT_DIR=${OUTPUT_DIR:-$KIT_DIR/runs}
export OUTPUT_DIR
# Runs recorded as launcher compare-<script>: SFT's default model and RESUME=1 pass them by.
export KIT_MADE_BY=compare

# Knobs that make a side what it is; the baseline runs without them so it stays the "before".
SIDE_KNOBS=(BATCH_SIZE GRADIENT_ACCUM NUM_WORKERS PREFETCH_FACTOR PIN_MEMORY PERSISTENT_WORKERS PRECISION
  ENABLE_FP16 ENABLE_BF16 ENABLE_GRAD_CKPT TF32 COMPILE)

case "$MODE" in
  pretrain)
    A_CMD=("$KIT_DIR/run_single_gpu.sh") B_CMD=("$KIT_DIR/run_single_gpu_optimized.sh")
    A_NAME=compare-baseline B_NAME=compare-optimized
    A_ENV=() ;;
  sft)
    for script in train_sft_custom.sh quick_start_sft_fast.sh; do
      [ -x "$KIT_DIR/$script" ] || kit_fail "make compare-sft needs the SFT launchers (./train_sft_custom.sh and ./quick_start_sft_fast.sh); $script is not in $KIT_DIR"
    done
    # The guides' "before" for SFT: one conversation per step.
    A_CMD=("$KIT_DIR/train_sft_custom.sh" 1) B_CMD=("$KIT_DIR/quick_start_sft_fast.sh")
    A_NAME=compare-sft-batch1 B_NAME=compare-sft-fast
    A_ENV=(BATCH_SIZE=1 GRADIENT_ACCUM=1) ;;
  dpo)
    [ -n "${DATA_PATH:-}" ] || kit_fail "make compare-dpo needs DATA_PATH: a file of preference pairs (docs/dpo.md#data)"
    # The "before" for preference training: one pair (two sequences) per step.
    A_CMD=("$KIT_DIR/train_dpo.sh" 1) B_CMD=("$KIT_DIR/train_dpo.sh")
    A_NAME=compare-dpo-batch1 B_NAME=compare-dpo-fast
    A_ENV=(BATCH_SIZE=1 GRADIENT_ACCUM=1) ;;
  grpo)
    # The "before" for reward training: one prompt (NUM_GENERATIONS completions) per step.
    A_CMD=("$KIT_DIR/train_grpo.sh" 1) B_CMD=("$KIT_DIR/train_grpo.sh")
    A_NAME=compare-grpo-batch1 B_NAME=compare-grpo-fast
    A_ENV=(BATCH_SIZE=1 GRADIENT_ACCUM=1) ;;
  *) kit_fail "scripts/compare.sh: mode must be pretrain, sft, dpo or grpo, got '$MODE'" ;;
esac

[[ "$REPEAT" =~ ^[1-9][0-9]*$ ]] || kit_fail "REPEAT must be a whole number >= 1, got '$REPEAT'"
for var in MAX_STEPS EPOCHS MAX_SAMPLES RUN_NAME; do
  [ -z "${!var:-}" ] || kit_fail "$var is set, but make compare fixes the budget and the run names: set COMPARE_SAMPLES (and unset $var)"
done

PY=$(kit_python)
if [ -z "$COMPARE_SAMPLES" ]; then
  on_gpu=0
  if [ "${DEVICE:-auto}" != cpu ]; then
    on_gpu=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
  fi
  # CPU: 1,024 batch-1 steps made compare-sft slow, 256 / 128 gave the fast side too few steps to time
  # DPO: 128 pairs (two sequences each, a reference forward too): 16 steps of 8 on the fast side
  # GRPO: 32 prompts (8 sampled completions each): 8 steps of 4 on the fast side
  cpu_samples=$(case "$MODE" in sft) echo 256 ;; dpo) echo 128 ;; grpo) echo 32 ;; *) echo 1024 ;; esac)
  COMPARE_SAMPLES=$([ "$on_gpu" = 1 ] && echo 4096 || echo "$cpu_samples")
fi
[[ "$COMPARE_SAMPLES" =~ ^[1-9][0-9]*$ ]] || kit_fail "COMPARE_SAMPLES must be a whole number >= 1, got '$COMPARE_SAMPLES'"

# The launcher's own default for a variable (its `VAR=${VAR:-N}` line), so the budget check follows
# the scripts if their defaults change.
launcher_default() {
  sed -n "s/^$2=\${$2:-\([0-9]*\)}.*/\1/p" "$1" | head -n 1
}
if [ "$MODE" = pretrain ]; then
  a_effective=$(( $(launcher_default "${A_CMD[0]}" BATCH_SIZE) * $(launcher_default "${A_CMD[0]}" GRADIENT_ACCUM) ))
else
  a_effective=1
fi
b_batch=${BATCH_SIZE:-$(launcher_default "${B_CMD[0]}" BATCH_SIZE)}
b_accum=${GRADIENT_ACCUM:-$(launcher_default "${B_CMD[0]}" GRADIENT_ACCUM)}
b_effective=$(( ${b_batch:-1} * ${b_accum:-1} ))
gcd() { local a=$1 b=$2; while [ "$b" -ne 0 ]; do set -- "$b" $(( a % b )); a=$1 b=$2; done; echo "$a"; }
step=$(( a_effective * b_effective / $(gcd "$a_effective" "$b_effective") ))
# Both sides read the same seeded permutation, in steps of their effective batch; a budget that is
# a multiple of both makes them train on exactly the same sequences in the same order.
if (( COMPARE_SAMPLES % step )); then
  kit_fail "COMPARE_SAMPLES=$COMPARE_SAMPLES is not a multiple of $step (effective batches $a_effective and $b_effective): the two runs would see different samples; try $(( (COMPARE_SAMPLES + step - 1) / step * step ))"
fi

a_unset=()
for var in "${SIDE_KNOBS[@]}"; do a_unset+=(-u "$var"); done
a_runs=() b_runs=() n=0
for ((i = 1; i <= REPEAT; i++)); do
  suffix=$([ "$REPEAT" -gt 1 ] && echo "-r$i" || true)
  for side in A B; do
    n=$((n + 1))
    if [ $side = A ]; then
      name=$A_NAME$suffix cmd=("${A_CMD[@]}") side_env=("${a_unset[@]}" "${A_ENV[@]}")
      a_runs+=("$OUTPUT_DIR/$name")
    else
      name=$B_NAME$suffix cmd=("${B_CMD[@]}") side_env=()
      b_runs+=("$OUTPUT_DIR/$name")
    fi
    # RESUME=1: a side with a checkpoint continues (its own settings, train/run/guard/carry.py); else a new run
    how=(RESUME= OVERWRITE=1) said=""
    resume=${RESUME:-}
    if [[ ${resume,,} =~ ^(1|true|yes|on)$ ]] \
      && compgen -G "$OUTPUT_DIR/$name/checkpoints/step-[0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9]" >/dev/null; then
      how=(RESUME=1 OVERWRITE=) said=", resumed"
    fi
    echo "== compare ($MODE) run $n/$((2 * REPEAT)): ${cmd[*]#"$KIT_DIR/"} -> $OUTPUT_DIR/$name ($COMPARE_SAMPLES samples$said)"
    env "${side_env[@]}" MAX_SAMPLES="$COMPARE_SAMPLES" RUN_NAME="$name" "${how[@]}" "${cmd[@]}"
  done
done

out="$OUTPUT_DIR/compare/${A_NAME}_vs_${B_NAME}"
echo "== compare ($MODE): $A_NAME vs $B_NAME"
PYTHONPATH="$KIT_DIR${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m train compare "${a_runs[@]}" "${b_runs[@]}" --group "$REPEAT" --out "$out"
echo "comparison written to $out/ (compare.md, compare.json, compare.png)"
