#!/usr/bin/env bash
# Optimized launcher: the guides' fixes as one variable each (batch 32 x accumulation 4,
# 4 workers with prefetch, pinned memory and persistent workers, TF32; mixed precision opt-in).
# Usage: [VAR=value ...] ./run_single_gpu_optimized.sh [--any_flag value ...]
#   e.g. MODEL_SIZE=medium BATCH_SIZE=16 GRADIENT_ACCUM=8 ENABLE_FP16="--fp16" ./run_single_gpu_optimized.sh
set -euo pipefail

# BEGIN knobs: generated from config.py by `make knobs` (defaults: edit them here; comments: config.py)
# Every knob of config.py that applies to `python -m train pretrain`, as VARIABLE=${VARIABLE:-default}
# (docs/knobs.md). Empty: the launcher's preset (optimized), else config.py's default.
KIT_GIVEN=" $(compgen -v | while read -r v; do [ -z "${!v:-}" ] || printf '%s ' "$v"; done)"  # set before the defaults below: RESUME=1 keeps the run's own settings for the rest

# ---- model ----
MODEL_SIZE=${MODEL_SIZE:-}              # 8K vocab: nano 5.3M (tests, CPU), tiny 30M, small 92M, medium 312M (GPT-2 small/medium: 124M/355M at 50K); empty: small on a GPU, else a nano demo
MODEL_FAMILY=${MODEL_FAMILY:-}          # what MODEL_SIZE builds: gpt2, llama, qwen3 or t5; empty: gpt2
MODEL_CONFIG=${MODEL_CONFIG:-}          # a transformers causal-LM or encoder-decoder (T5, BART ...) config.json
ENABLE_GRAD_CKPT=${ENABLE_GRAD_CKPT:-}  # "--gradient_checkpointing" (or 1): recompute activations in the backward pass: about 30 % slower per step; empty: 0
COMPILE=${COMPILE:-}                    # torch.compile the model (fused kernels; compile time reported apart); empty: on with a GPU, off on a CPU
COMPILE_MODE=${COMPILE_MODE:-}          # COMPILE's mode; reduce-overhead: CUDA graphs; empty: that on one GPU where a step is launch-bound, else default
GENERATION_CONFIG=${GENERATION_CONFIG:-} # a JSON file of generate() settings
DROPOUT=${DROPOUT:-}                    # every dropout of the model (gpt2 resid/embd/attn_pdrop, llama/qwen3 attention_dropout, t5 dropout_rate); empty: 0 (preset optimized)
FREEZE=${FREEZE:-}                      # parameters left untrained (no gradients, no optimizer state); empty: nothing frozen

# ---- data, tokenizer, data loading ----
DATA_PATH=${DATA_PATH:-}                # training text, or SFT's records (alpaca, messages, ShareGPT, prompt/response): .txt/.md, JSONL (.jsonl, .jsonl.gz); empty: the built-in corpus (the standard-library sources of the running Python)
TEXT_FIELD=${TEXT_FIELD:-}              # the field (JSON) or column (parquet, Arrow; only it is read) of the text; empty: text
TOKENIZER_PATH=${TOKENIZER_PATH:-}      # a local AutoTokenizer folder; empty: a byte-level BPE trained on the corpus and cached
VOCAB_SIZE=${VOCAB_SIZE:-}              # vocabulary of the BPE trained when no TOKENIZER_PATH is given; empty: 8192
TOKENIZER_SAMPLE_MB=${TOKENIZER_SAMPLE_MB:-} # MB of text the BPE (no TOKENIZER_PATH) trains on: the whole corpus when smaller, else a sample spread through it; empty: 100
MAX_RECORD_MB=${MAX_RECORD_MB:-}        # longest JSONL record (a line, decompressed) read; past it a mistake or a decompression bomb; empty: 64
TOKENIZE_WORKERS=${TOKENIZE_WORKERS:-}  # processes tokenizing the data into its cache (tokens, SFT conversations, pairs); empty: every core (a corpus under 8 MB: none, in the training process)
MAX_LENGTH=${MAX_LENGTH:-}              # tokens per training sequence; sequences are packed to exactly this length; empty: the model's context length
NUM_WORKERS=${NUM_WORKERS:-4}           # DataLoader worker processes
PREFETCH_FACTOR=${PREFETCH_FACTOR:-4}   # batches each worker loads ahead (only with NUM_WORKERS > 0; torch's default is 2)
PIN_MEMORY=${PIN_MEMORY:-1}             # page-locked host buffers so host-to-GPU copies run asynchronously (no effect on CPU)
PERSISTENT_WORKERS=${PERSISTENT_WORKERS:-1} # keep worker processes alive between epochs instead of restarting them
CACHE_DIR=${CACHE_DIR:-}                # where trained tokenizers and token caches live, keyed by data content and tokenizer; empty: .cache
VAL_FRACTION=${VAL_FRACTION:-}          # share of the data held out for validation (the last part of the token stream, never trained on); empty: 0.01
VAL_PATH=${VAL_PATH:-}                  # a separate validation file or folder (same formats as DATA_PATH), tokenized with the same tokenizer

# ---- batch, learning rate, how long ----
BATCH_SIZE=${BATCH_SIZE:-32}            # micro-batch per GPU: sequences in one forward/backward
GRADIENT_ACCUM=${GRADIENT_ACCUM:-4}     # micro-batches summed before each optimizer step
LEARNING_RATE=${LEARNING_RATE:-}        # peak learning rate, reached after the warm-up, then following LR_SCHEDULE; empty: 6e-4
MIN_LR_RATIO=${MIN_LR_RATIO:-}          # the cosine and linear schedules end at LEARNING_RATE x this; empty: 0.1
OPTIMIZER=${OPTIMIZER:-}                # adamw | adafactor | sgd | adafactor_relative; empty: adamw
LR_SCHEDULE=${LR_SCHEDULE:-}            # cosine | linear | constant | onecycle; empty: cosine
WARMUP_STEPS=${WARMUP_STEPS:-}          # optimizer steps of linear warm-up; below 1, a share of the run's steps (0.05: 5 %, rounded up, as TRL's warmup_steps); empty: 5 % of the run, at most 200
WEIGHT_DECAY=${WEIGHT_DECAY:-}          # weight decay on matrices (not on biases and norms); empty: 0.1
GRAD_CLIP=${GRAD_CLIP:-}                # clip the gradient norm to this before each step (0: no clipping); empty: 1
MAX_STEPS=${MAX_STEPS:-}                # stop after this many optimizer steps
EPOCHS=${EPOCHS:-}                      # stop after this many passes over the data (fractions allowed)
MAX_SAMPLES=${MAX_SAMPLES:-}            # stop after this many training sequences (DPO: pairs; the budget `make compare` holds fixed)
EFFECTIVE_BATCH=${EFFECTIVE_BATCH:-}    # sequences per optimizer step to keep fixed while BATCH_SIZE is traded against GRADIENT_ACCUM; empty: BATCH_SIZE x GRADIENT_ACCUM
AUTO_BATCH=${AUTO_BATCH:-0}             # 1: before training, find the fastest micro-batch that fits TARGET_VRAM
LR_SCALING=${LR_SCALING:-}              # none | linear | sqrt: scale LEARNING_RATE by (effective batch / LR_REFERENCE_BATCH), or its square root; empty: none
LR_REFERENCE_BATCH=${LR_REFERENCE_BATCH:-} # the effective batch LEARNING_RATE is meant for; empty: the preset's BATCH_SIZE x GRADIENT_ACCUM (baseline 8, optimized 128; 8 without a preset)

# ---- precision, device, several GPUs ----
DEVICE=${DEVICE:-}                      # auto (CUDA, which ROCm builds also present as cuda, then Apple mps, then CPU), or a torch device such as cuda:1 or cpu; empty: auto
ENABLE_FP16=${ENABLE_FP16:-}            # "--fp16" (or 1): fp16 autocast + GradScaler
ENABLE_BF16=${ENABLE_BF16:-}            # "--bf16" (or 1): bf16 autocast (Ampere+ GPUs, modern CPUs)
PRECISION=${PRECISION:-}                # fp32 | fp16 | bf16 | auto; empty: fp32
TF32=${TF32:-1}                         # let fp32 matmuls use TF32 tensor cores (Ampere and newer): about 2-3x faster fp32 matmuls at 10-bit mantissa precision
SEED=${SEED:-}                          # seeds model init, data order and dropout: the same seed gives the same run; empty: 1337
NPROC_PER_NODE=${NPROC_PER_NODE:-1}     # processes (GPUs) on this machine; above 1 starts torchrun (DDP): docs/multi-gpu.md
SHARDING=${SHARDING:-}                  # none | zero2 | zero3; empty: none
OFFLOAD_OPTIMIZER=${OFFLOAD_OPTIMIZER:-} # with SHARDING: keep sharded parameters, gradients and AdamW state in host memory and run the optimizer step on the CPU; empty: 0
TARGET_VRAM=${TARGET_VRAM:-}            # share of device memory find-batch, AUTO_BATCH and autotune may fill (the guides' 70-85 %); empty: 0.8
MAX_MEMORY_MB=${MAX_MEMORY_MB:-}        # memory budget in MiB; empty: the device's memory (on CPU, the RAM available at start)

# ---- run folder, checkpoints, evaluation, logs ----
OUTPUT_DIR=${OUTPUT_DIR:-}              # run folders go in OUTPUT_DIR/RUN_NAME; OUTPUT_DIR/latest points at the newest; empty: runs
RUN_NAME=${RUN_NAME:-}                  # name of this run's folder; empty: the launcher's name and the time, always new
OVERWRITE=${OVERWRITE:-}                # replace an existing run folder of the same RUN_NAME (refused otherwise); empty: 0
LOG_EVERY=${LOG_EVERY:-}                # optimizer steps between log lines; empty: every 10 steps, more often in short runs
SAVE_EVERY=${SAVE_EVERY:-}              # optimizer steps between checkpoints in runs/<name>/checkpoints/ (0: only at the end and when stopped); empty: 500
KEEP_CHECKPOINTS=${KEEP_CHECKPOINTS:-}  # checkpoints kept: the newest N (an older one is deleted only once a newer one is complete); empty: 2
RESUME=${RESUME:-}                      # continue runs/RUN_NAME (empty RUN_NAME: the newest run of this launcher) from its newest valid checkpoint; empty: 0
NAN_PATIENCE=${NAN_PATIENCE:-}          # stop after this many optimizer steps in a row with a non-finite loss, keeping the newest checkpoint from before them; empty: 5
EVAL_EVERY=${EVAL_EVERY:-}              # optimizer steps between validation passes; one always runs at the end; empty: 250
EVAL_BATCHES=${EVAL_BATCHES:-}          # validation batches of 8 sequences per pass (read BATCH_SIZE at a time); empty: 20
KEEP_BEST=${KEEP_BEST:-}                # also save the model with the lowest validation loss so far in best/ (final/ is always the last model); empty: 0
REPORT_TO=${REPORT_TO:-none}            # none | tensorboard: also write the metrics rows and the summary as TensorBoard scalars in runs/<name>/tensorboard/
DRY_RUN=${DRY_RUN:-}                    # print the resolved settings, the derived numbers and a peak-memory estimate, then exit: no model on the device; empty: 0
# END knobs

source "$(dirname "$0")/scripts/common.sh"
kit_launch pretrain optimized "$@"
