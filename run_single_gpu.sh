#!/usr/bin/env bash
# Baseline launcher: the guides' "before" settings (batch 8, no accumulation, fp32, 0 workers).
# Usage: [VAR=value ...] ./run_single_gpu.sh [--any_flag value ...]
#   e.g. MODEL_SIZE=nano MAX_STEPS=20 ./run_single_gpu.sh
# Every variable below maps to one flag of `python -m train pretrain` (see README's knob table).
set -euo pipefail

MODEL_SIZE=${MODEL_SIZE:-}              # nano | tiny | small | medium; empty: small on a GPU, nano demo on CPU
MODEL_FAMILY=${MODEL_FAMILY:-}          # gpt2 | t5 (encoder-decoder, span corruption); empty: gpt2
BATCH_SIZE=${BATCH_SIZE:-8}             # micro-batch per GPU
GRADIENT_ACCUM=${GRADIENT_ACCUM:-1}     # micro-batches per optimizer step
ENABLE_FP16=${ENABLE_FP16:-}            # "--fp16" (or 1) for fp16 autocast + GradScaler
ENABLE_BF16=${ENABLE_BF16:-}            # "--bf16" (or 1) for bf16 autocast
ENABLE_GRAD_CKPT=${ENABLE_GRAD_CKPT:-}  # "--gradient_checkpointing" (or 1)
MAX_LENGTH=${MAX_LENGTH:-}              # tokens per sequence; empty: the model's context
NUM_WORKERS=${NUM_WORKERS:-0}           # DataLoader workers
LEARNING_RATE=${LEARNING_RATE:-}        # empty: 6e-4
MAX_STEPS=${MAX_STEPS:-}                # stop after N optimizer steps (or EPOCHS / MAX_SAMPLES)
EPOCHS=${EPOCHS:-}
DATA_PATH=${DATA_PATH:-}                # .txt/.md, .jsonl(.gz), .parquet, Arrow folder, or a folder/glob of them; empty: built-in
TEXT_FIELD=${TEXT_FIELD:-}              # the text field/column of JSONL, parquet, Arrow records; empty: text
TOKENIZE_WORKERS=${TOKENIZE_WORKERS:-}  # processes tokenizing into the token cache; empty: every core
TOKENIZER_SAMPLE_MB=${TOKENIZER_SAMPLE_MB:-} # MB of text the BPE trains on (spread through the corpus); empty: 100
RUN_NAME=${RUN_NAME:-}                  # empty: run_single_gpu-<time>
SEED=${SEED:-}
SAVE_EVERY=${SAVE_EVERY:-}              # optimizer steps between checkpoints; empty: 500
RESUME=${RESUME:-}                      # 1: continue runs/$RUN_NAME (empty: this launcher's newest run)
NPROC_PER_NODE=${NPROC_PER_NODE:-1}     # processes (GPUs) on this machine; >1 starts torchrun (DDP)
SHARDING=${SHARDING:-}                  # zero2 | zero3: FSDP2 sharding (the guides' DeepSpeed ZeRO-2/3)
OFFLOAD_OPTIMIZER=${OFFLOAD_OPTIMIZER:-} # 1 (with SHARDING): optimizer state in host memory
EVAL_EVERY=${EVAL_EVERY:-}              # steps between validation passes (one always at the end); empty: 250
REPORT_TO=${REPORT_TO:-none}            # tensorboard: also write TensorBoard events in the run folder
DRY_RUN=${DRY_RUN:-}                    # 1: print settings, derived numbers and a memory estimate, then exit

source "$(dirname "$0")/scripts/common.sh"
kit_launch pretrain baseline "$@"
