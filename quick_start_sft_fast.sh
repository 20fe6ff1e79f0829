#!/usr/bin/env bash
# SFT with the fast defaults: micro-batch 16 x accumulation 2 (effective 32), conversations of
# similar length batched together, 2 loader workers with pinned memory.
# Usage: [VAR=value ...] ./quick_start_sft_fast.sh [--any_flag value ...]
#   e.g. MAX_STEPS=10 ./quick_start_sft_fast.sh
#        MODEL_PATH=runs/my-run/final DATA_PATH=alpaca.json ENABLE_BF16=1 ./quick_start_sft_fast.sh
set -euo pipefail

MODEL_PATH=${MODEL_PATH:-}              # local causal-LM or encoder-decoder (T5, BART) folder; empty: newest pretraining run's final/
DATA_PATH=${DATA_PATH:-}                # .json/.jsonl/.parquet or Arrow folder: alpaca, messages, ShareGPT, prompt/response; empty: built-in
BATCH_SIZE=${BATCH_SIZE:-16}            # micro-batch per GPU
GRADIENT_ACCUM=${GRADIENT_ACCUM:-2}     # effective batch = BATCH_SIZE x GRADIENT_ACCUM x GPUs
MAX_LENGTH=${MAX_LENGTH:-}              # longer conversations are truncated (and counted); empty: model's context
EPOCHS=${EPOCHS:-}                      # empty with no MAX_STEPS: one epoch
MAX_STEPS=${MAX_STEPS:-}
LEARNING_RATE=${LEARNING_RATE:-}        # empty: 1e-4 (preset sft); 2e-5 for a well-trained model of 1B+
LENGTH_GROUPING=${LENGTH_GROUPING:-1}   # batch conversations of similar length (less padding)
TOKEN_BUDGET=${TOKEN_BUDGET:-}          # N: micro-batches of at most N padded tokens instead of BATCH_SIZE rows
PACKING=${PACKING:-0}                   # 1: pack conversations into MAX_LENGTH rows (BATCH_SIZE counts rows); causal LMs only
ENABLE_FP16=${ENABLE_FP16:-}            # "--fp16" (or 1): fp16 autocast + GradScaler
ENABLE_BF16=${ENABLE_BF16:-}            # "--bf16" (or 1): bf16 autocast
ENABLE_GRAD_CKPT=${ENABLE_GRAD_CKPT:-}  # "--gradient_checkpointing" (or 1): less memory, ~30 % slower
NUM_WORKERS=${NUM_WORKERS:-2}           # loader workers padding the next batches during compute
SKIP_BAD_RECORDS=${SKIP_BAD_RECORDS:-0} # 1: skip unusable records and print how many
TOKENIZE_WORKERS=${TOKENIZE_WORKERS:-} # processes that tokenize into the SFT cache (once); empty: every core
TRUST_REMOTE_CODE=${TRUST_REMOTE_CODE:-0}  # 1: let MODEL_PATH run the code it ships
RUN_NAME=${RUN_NAME:-}                  # empty: quick_start_sft_fast-<time>
SEED=${SEED:-}
REPORT_TO=${REPORT_TO:-none}            # tensorboard: also write TensorBoard events in the run folder
NPROC_PER_NODE=${NPROC_PER_NODE:-1}     # processes (GPUs) on this machine; >1 starts torchrun (DDP)

if [[ -z $TOKEN_BUDGET && $BATCH_SIZE =~ ^[0-9]+$ && $GRADIENT_ACCUM =~ ^[0-9]+$ ]]; then  # TOKEN_BUDGET: rows vary
  echo "effective batch = BATCH_SIZE $BATCH_SIZE x GRADIENT_ACCUM $GRADIENT_ACCUM = $((BATCH_SIZE * GRADIENT_ACCUM)) per GPU (x NPROC_PER_NODE $NPROC_PER_NODE processes)"
fi
source "$(dirname "$0")/scripts/common.sh"
kit_launch sft sft "$@"
