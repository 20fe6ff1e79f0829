#!/usr/bin/env bash
# SFT with the micro-batch as the first argument: the guides' 16 (recommended), 20 (faster),
# 24 (the limit on their GPU). Any further flags go to `python -m train sft` as they are.
# Usage: [VAR=value ...] ./train_sft_custom.sh [MICRO_BATCH] [--any_flag value ...]
#   e.g. ./train_sft_custom.sh 20
#        MODEL_PATH=runs/my-run/final DATA_PATH=chat.jsonl LENGTH_GROUPING=1 ./train_sft_custom.sh 16 --seed 7
set -euo pipefail

if [ $# -gt 0 ] && [[ $1 != -* ]]; then  # the first argument is the micro-batch unless it is a flag
  BATCH_SIZE=$1
  shift
fi
MODEL_PATH=${MODEL_PATH:-}              # local causal-LM or encoder-decoder (T5, BART) folder; empty: newest pretraining run's final/
DATA_PATH=${DATA_PATH:-}                # .json/.jsonl/.parquet or Arrow folder: alpaca, messages, ShareGPT, prompt/response; empty: built-in
BATCH_SIZE=${BATCH_SIZE:-16}            # micro-batch (the first argument)
GRADIENT_ACCUM=${GRADIENT_ACCUM:-1}     # effective batch = BATCH_SIZE x GRADIENT_ACCUM x GPUs
MAX_LENGTH=${MAX_LENGTH:-}              # longer conversations are truncated (and counted); empty: model's context
EPOCHS=${EPOCHS:-}                      # empty with no MAX_STEPS: one epoch
MAX_STEPS=${MAX_STEPS:-}
LEARNING_RATE=${LEARNING_RATE:-}        # empty: 1e-4 (preset sft); 2e-5 for a well-trained model of 1B+
LENGTH_GROUPING=${LENGTH_GROUPING:-0}   # 1: batch conversations of similar length (less padding)
TOKEN_BUDGET=${TOKEN_BUDGET:-}          # N: micro-batches of at most N padded tokens instead of BATCH_SIZE rows
PACKING=${PACKING:-0}                   # 1: pack conversations into MAX_LENGTH rows (BATCH_SIZE counts rows); causal LMs only
ENABLE_FP16=${ENABLE_FP16:-}            # "--fp16" (or 1): fp16 autocast + GradScaler
ENABLE_BF16=${ENABLE_BF16:-}            # "--bf16" (or 1): bf16 autocast
ENABLE_GRAD_CKPT=${ENABLE_GRAD_CKPT:-}  # "--gradient_checkpointing" (or 1): less memory, ~30 % slower
NUM_WORKERS=${NUM_WORKERS:-}            # empty: 2 (preset sft)
SKIP_BAD_RECORDS=${SKIP_BAD_RECORDS:-0} # 1: skip unusable records and print how many
TOKENIZE_WORKERS=${TOKENIZE_WORKERS:-} # processes that tokenize into the SFT cache (once); empty: every core
TRUST_REMOTE_CODE=${TRUST_REMOTE_CODE:-0}  # 1: let MODEL_PATH run the code it ships
RUN_NAME=${RUN_NAME:-}                  # empty: train_sft_custom-<time>
SEED=${SEED:-}
REPORT_TO=${REPORT_TO:-none}            # tensorboard: also write TensorBoard events in the run folder
NPROC_PER_NODE=${NPROC_PER_NODE:-1}     # processes (GPUs) on this machine; >1 starts torchrun (DDP)

source "$(dirname "$0")/scripts/common.sh"
kit_launch sft sft "$@"
