#!/usr/bin/env bash
# Optimized launcher: the guides' fixes as one variable each (batch 32 x accumulation 4,
# 4 workers with prefetch, pinned memory and persistent workers, TF32; mixed precision opt-in).
# Usage: [VAR=value ...] ./run_single_gpu_optimized.sh [--any_flag value ...]
#   e.g. MODEL_SIZE=medium BATCH_SIZE=16 GRADIENT_ACCUM=8 ENABLE_FP16="--fp16" ./run_single_gpu_optimized.sh
set -euo pipefail

# Every knob of config.py that applies here, grouped; each maps to one flag of `python -m train pretrain`
# (README's knob table). Empty: the launcher's preset (optimized), else config.py's default.
# ---- model ----
MODEL_SIZE=${MODEL_SIZE:-}              # nano | tiny | small | medium; empty: small on a GPU, nano demo on CPU
MODEL_FAMILY=${MODEL_FAMILY:-}          # gpt2 | t5 (encoder-decoder, span corruption); empty: gpt2
MODEL_CONFIG=${MODEL_CONFIG:-}          # a transformers config.json (or its folder) to train from scratch instead of MODEL_SIZE
ENABLE_GRAD_CKPT=${ENABLE_GRAD_CKPT:-}  # "--gradient_checkpointing" (or 1): far less activation memory, ~30 % slower
COMPILE=${COMPILE:-0}                   # 1: torch.compile the model (pays off in runs of more than a few minutes on a GPU)
FREEZE=${FREEZE:-}                      # parameters left untrained: embeddings | encoder | decoder | lm_head or name patterns; empty: none
GENERATION_CONFIG=${GENERATION_CONFIG:-} # a JSON file of generate() settings saved into final/generation_config.json

# ---- data ----
DATA_PATH=${DATA_PATH:-}                # .txt/.md, .jsonl(.gz), .parquet, Arrow folder, or a folder/glob of them; empty: built-in
TEXT_FIELD=${TEXT_FIELD:-}              # the text field/column of JSONL, parquet, Arrow records; empty: text
TOKENIZER_PATH=${TOKENIZER_PATH:-}      # a local tokenizer folder; empty: a byte-level BPE trained on the corpus (cached)
VOCAB_SIZE=${VOCAB_SIZE:-}              # the BPE's vocabulary (no TOKENIZER_PATH); empty: 8192
TOKENIZER_SAMPLE_MB=${TOKENIZER_SAMPLE_MB:-} # MB of text the BPE trains on (spread through the corpus); empty: 100
TOKENIZE_WORKERS=${TOKENIZE_WORKERS:-}  # processes tokenizing into the token cache; empty: every core
MAX_RECORD_MB=${MAX_RECORD_MB:-}        # longest JSONL record read, in MB; empty: 64
VAL_FRACTION=${VAL_FRACTION:-}          # share held out for the validation loss; empty: 0.01 (0: none)
VAL_PATH=${VAL_PATH:-}                  # a separate validation file or folder, used instead of VAL_FRACTION
CACHE_DIR=${CACHE_DIR:-}                # trained tokenizers and token caches; empty: .cache/ in this folder

# ---- batch, sequence length, data loading ----
BATCH_SIZE=${BATCH_SIZE:-32}            # micro-batch per GPU: raise until VRAM is ~70-85 % full
GRADIENT_ACCUM=${GRADIENT_ACCUM:-4}     # micro-batches per optimizer step: effective batch = BATCH_SIZE x GRADIENT_ACCUM x GPUs
EFFECTIVE_BATCH=${EFFECTIVE_BATCH:-}    # sequences per step to keep while BATCH_SIZE changes (GRADIENT_ACCUM follows)
AUTO_BATCH=${AUTO_BATCH:-0}             # 1: find-batch picks BATCH_SIZE x GRADIENT_ACCUM first, same effective batch
MAX_LENGTH=${MAX_LENGTH:-}              # tokens per sequence; empty: the model's context
NUM_WORKERS=${NUM_WORKERS:-4}           # DataLoader workers loading ahead of the GPU
PREFETCH_FACTOR=${PREFETCH_FACTOR:-4}   # batches each worker prepares ahead (torch's default: 2)
PIN_MEMORY=${PIN_MEMORY:-1}             # 1: page-locked buffers for asynchronous host-to-GPU copies
PERSISTENT_WORKERS=${PERSISTENT_WORKERS:-1} # 1: keep the workers alive between epochs

# ---- precision and device ----
ENABLE_FP16=${ENABLE_FP16:-}            # "--fp16" (or 1): fp16 autocast + GradScaler
ENABLE_BF16=${ENABLE_BF16:-}            # "--bf16" (or 1): bf16 autocast (Ampere+ GPUs, modern CPUs)
PRECISION=${PRECISION:-}                # fp32 | fp16 | bf16 | auto (bf16 where fast, fp16 where not, fp32 otherwise); empty: fp32
TF32=${TF32:-1}                         # 1: TF32 tensor cores for fp32 matmuls (Ampere+)
DEVICE=${DEVICE:-}                      # auto | cpu | mps | cuda | cuda:N; empty: auto (CUDA, then mps, then CPU)
MAX_MEMORY_MB=${MAX_MEMORY_MB:-}        # memory budget in MiB (caps this process's VRAM); empty: the device's
TARGET_VRAM=${TARGET_VRAM:-}            # share of memory find-batch / AUTO_BATCH may fill; empty: 0.8

# ---- learning rate and optimizer ----
LEARNING_RATE=${LEARNING_RATE:-}        # empty: 6e-4
MIN_LR_RATIO=${MIN_LR_RATIO:-}          # the cosine schedule ends at LEARNING_RATE x this; empty: 0.1
WARMUP_STEPS=${WARMUP_STEPS:-}          # linear warm-up steps; empty: 5 % of the run, at most 200
OPTIMIZER=${OPTIMIZER:-}                # adamw | adafactor | sgd; empty: adamw
LR_SCHEDULE=${LR_SCHEDULE:-}            # cosine | linear | constant | onecycle (after WARMUP_STEPS); empty: cosine
WEIGHT_DECAY=${WEIGHT_DECAY:-}          # AdamW weight decay on matrices; empty: 0.1
GRAD_CLIP=${GRAD_CLIP:-}                # clip the gradient norm to this (0: off); empty: 1.0
LR_SCALING=${LR_SCALING:-}              # none | linear | sqrt: scale LEARNING_RATE with the effective batch; empty: none
LR_REFERENCE_BATCH=${LR_REFERENCE_BATCH:-} # the effective batch LEARNING_RATE is meant for; empty: the preset's BATCH_SIZE x GRADIENT_ACCUM

# ---- how long ----
MAX_STEPS=${MAX_STEPS:-}                # stop after N optimizer steps
EPOCHS=${EPOCHS:-}                      # stop after N passes over the data (fractions allowed)
MAX_SAMPLES=${MAX_SAMPLES:-}            # stop after N training sequences; none of the three: one epoch (CPU demo: 256)

# ---- run folder, checkpoints, evaluation, logs ----
OUTPUT_DIR=${OUTPUT_DIR:-}              # where run folders go; empty: runs/ in this folder
RUN_NAME=${RUN_NAME:-}                  # empty: run_single_gpu_optimized-<time>
OVERWRITE=${OVERWRITE:-}                # 1: replace an existing runs/$RUN_NAME
RESUME=${RESUME:-}                      # 1: continue runs/$RUN_NAME (empty RUN_NAME: this launcher's newest run)
SEED=${SEED:-}                          # model init, data order, dropout; empty: 1337
SAVE_EVERY=${SAVE_EVERY:-}              # optimizer steps between checkpoints (0: only at the end); empty: 500
KEEP_CHECKPOINTS=${KEEP_CHECKPOINTS:-}  # checkpoints kept, newest first; empty: 2
NAN_PATIENCE=${NAN_PATIENCE:-}          # stop after N steps in a row with a non-finite loss (0: never); empty: 5
EVAL_EVERY=${EVAL_EVERY:-}              # steps between validation passes (one always at the end); empty: 250
EVAL_BATCHES=${EVAL_BATCHES:-}          # validation batches of 8 sequences per pass; empty: 20
KEEP_BEST=${KEEP_BEST:-}                # 1: also save the lowest-validation-loss model in best/
LOG_EVERY=${LOG_EVERY:-}                # steps between log lines; empty: 10, more often in short runs
REPORT_TO=${REPORT_TO:-none}            # tensorboard: also write TensorBoard events in the run folder
DRY_RUN=${DRY_RUN:-}                    # 1: print settings, derived numbers and a memory estimate, then exit

# ---- several GPUs ----
NPROC_PER_NODE=${NPROC_PER_NODE:-1}     # processes (GPUs) on this machine; >1 starts torchrun (DDP)
SHARDING=${SHARDING:-}                  # zero2 | zero3: FSDP2 sharding (the guides' DeepSpeed ZeRO-2/3)
OFFLOAD_OPTIMIZER=${OFFLOAD_OPTIMIZER:-} # 1 (with SHARDING): optimizer state in host memory

source "$(dirname "$0")/scripts/common.sh"
kit_launch pretrain optimized "$@"
