#!/usr/bin/env bash
# Optimized launcher: the guides' fixes as one variable each (batch 32 x accumulation 4,
# 4 workers with prefetch, pinned memory and persistent workers, TF32; mixed precision opt-in).
# Usage: [VAR=value ...] ./run_single_gpu_optimized.sh [--any_flag value ...]
#   e.g. MODEL_SIZE=medium BATCH_SIZE=16 GRADIENT_ACCUM=8 ENABLE_FP16="--fp16" ./run_single_gpu_optimized.sh
set -euo pipefail

MODEL_SIZE=${MODEL_SIZE:-}              # nano | tiny | small | medium; empty: small on a GPU, nano demo on CPU
MODEL_FAMILY=${MODEL_FAMILY:-}          # gpt2 | t5 (encoder-decoder, span corruption); empty: gpt2
BATCH_SIZE=${BATCH_SIZE:-32}            # micro-batch per GPU: raise until VRAM is ~70-85 % full
GRADIENT_ACCUM=${GRADIENT_ACCUM:-4}     # effective batch = BATCH_SIZE x GRADIENT_ACCUM x GPUs
AUTO_BATCH=${AUTO_BATCH:-0}             # 1: find-batch picks BATCH_SIZE x GRADIENT_ACCUM first, same effective batch
ENABLE_FP16=${ENABLE_FP16:-}            # "--fp16" (or 1): fp16 autocast + GradScaler
ENABLE_BF16=${ENABLE_BF16:-}            # "--bf16" (or 1): bf16 autocast (Ampere+ GPUs, modern CPUs)
PRECISION=${PRECISION:-}                # auto: bf16 where fast, fp16 where not, fp32 otherwise
ENABLE_GRAD_CKPT=${ENABLE_GRAD_CKPT:-}  # "--gradient_checkpointing" (or 1): less memory, ~30 % slower
MAX_LENGTH=${MAX_LENGTH:-}              # tokens per sequence; empty: the model's context
NUM_WORKERS=${NUM_WORKERS:-4}           # DataLoader workers loading ahead of the GPU
PREFETCH_FACTOR=${PREFETCH_FACTOR:-4}   # batches each worker prepares ahead
PIN_MEMORY=${PIN_MEMORY:-1}             # page-locked buffers for asynchronous host-to-GPU copies
PERSISTENT_WORKERS=${PERSISTENT_WORKERS:-1}
TF32=${TF32:-1}                         # TF32 tensor cores for fp32 matmuls (Ampere+)
COMPILE=${COMPILE:-0}                   # 1: torch.compile the model
LEARNING_RATE=${LEARNING_RATE:-}        # empty: 6e-4
MAX_STEPS=${MAX_STEPS:-}                # stop after N optimizer steps (or EPOCHS / MAX_SAMPLES)
EPOCHS=${EPOCHS:-}
DATA_PATH=${DATA_PATH:-}                # .txt/.md, .jsonl(.gz), .parquet, Arrow folder, or a folder/glob of them; empty: built-in
TEXT_FIELD=${TEXT_FIELD:-}              # the text field/column of JSONL, parquet, Arrow records; empty: text
TOKENIZE_WORKERS=${TOKENIZE_WORKERS:-}  # processes tokenizing into the token cache; empty: every core
TOKENIZER_SAMPLE_MB=${TOKENIZER_SAMPLE_MB:-} # MB of text the BPE trains on (spread through the corpus); empty: 100
RUN_NAME=${RUN_NAME:-}                  # empty: run_single_gpu_optimized-<time>
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
kit_launch pretrain optimized "$@"
