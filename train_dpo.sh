#!/usr/bin/env bash
# Preference training (the third stage: pretrain -> SFT -> DPO) with the micro-batch, in PAIRS, as the
# first argument: each pair is two sequences (chosen and rejected) in one forward. Any further flags go to
# `python -m train dpo` as they are. docs/dpo.md: the data shapes, the losses, REFERENCE's three ways.
# Usage: [VAR=value ...] ./train_dpo.sh [MICRO_BATCH] [--any_flag value ...]
#   e.g. DATA_PATH=pairs.jsonl ./train_dpo.sh 8
#        MODEL_PATH=runs/my-sft/final DATA_PATH=dpo_en_demo.json DPO_LOSS=ipo LORA_R=16 ./train_dpo.sh 4
set -euo pipefail

if [ $# -gt 0 ] && [[ $1 != -* ]]; then  # the first argument is the micro-batch unless it is a flag
  BATCH_SIZE=$1
  shift
fi
# Every knob of config.py that applies here, grouped; each maps to one flag of `python -m train dpo`
# (docs/knobs.md). Empty: the launcher's preset (dpo), else config.py's default.
# ---- preference loss and reference ----
DPO_LOSS=${DPO_LOSS:-}                  # sigmoid (DPO) | ipo | hinge | simpo | orpo (reference-free); empty: sigmoid
BETA=${BETA:-}                          # how far the policy may drift from the reference (TRL's beta); empty: 0.1
LABEL_SMOOTHING=${LABEL_SMOOTHING:-}    # chance a pair's labels are wrong (sigmoid, simpo), below 0.5; empty: 0
SIMPO_GAMMA=${SIMPO_GAMMA:-}            # SimPO's target reward margin; empty: 0.5
SFT_WEIGHT=${SFT_WEIGHT:-}              # adds this x the chosen replies' NLL (TRL's rpo_alpha); empty: 0
REFERENCE=${REFERENCE:-}                # copy | precomputed | adapters (with LORA_R); empty: the kit decides and says why

# ---- model ----
MODEL_PATH=${MODEL_PATH:-}              # the chat model to train: a local causal-LM or encoder-decoder (T5) folder; empty: the newest completed SFT run's final/
TRUST_REMOTE_CODE=${TRUST_REMOTE_CODE:-0} # 1: let MODEL_PATH run the code it ships
LORA_R=${LORA_R:-}                      # LoRA rank (8-64 usual): adapters train, the model stays frozen; empty or 0: full fine-tuning
LORA_ALPHA=${LORA_ALPHA:-}              # LoRA's scale is LORA_ALPHA / LORA_R; empty: 2 x LORA_R
LORA_DROPOUT=${LORA_DROPOUT:-}          # dropout on the adapters' input; empty: 0.05
LORA_TARGETS=${LORA_TARGETS:-}          # layer names LoRA adapts (comma-separated, or all-linear); empty: the architecture's
ENABLE_GRAD_CKPT=${ENABLE_GRAD_CKPT:-}  # "--gradient_checkpointing" (or 1): far less activation memory, ~30 % slower
COMPILE=${COMPILE:-}                    # 1: torch.compile the model (pays off in runs of more than a few minutes on a GPU)
FREEZE=${FREEZE:-}                      # parameters left untrained: embeddings | encoder | decoder | lm_head or name patterns; empty: none
GENERATION_CONFIG=${GENERATION_CONFIG:-} # a JSON file of generate() settings saved into final/generation_config.json

# ---- data ----
DATA_PATH=${DATA_PATH:-}                # preference pairs (.json/.jsonl(.gz)/.parquet/Arrow): TRL prompt/chosen/rejected, LLaMA-Factory, MiniMind (required)
TOKENIZER_PATH=${TOKENIZER_PATH:-}      # a local tokenizer folder; empty: MODEL_PATH's own
TEMPLATE=${TEMPLATE:-}                  # builtin | tokenizer | none | a Jinja file; empty: the tokenizer's own, else builtin
TRUNCATION=${TRUNCATION:-}              # keep_end | keep_start: which end of an over-long prompt is kept; empty: keep_end
REASONING=${REASONING:-}                # keep | drop: an assistant turn's reasoning_content; empty: keep
SKIP_BAD_RECORDS=${SKIP_BAD_RECORDS:-0} # 1: skip unusable pairs (a missing side, chosen = rejected ...) and print how many
TOKENIZE_WORKERS=${TOKENIZE_WORKERS:-}  # processes that tokenize into the preference cache (once); empty: every core
MAX_RECORD_MB=${MAX_RECORD_MB:-}        # longest JSONL record read, in MB; empty: 64
VAL_FRACTION=${VAL_FRACTION:-}          # share of pairs held out for validation (val_rewards/...); empty: 0.01 (0: none)
VAL_PATH=${VAL_PATH:-}                  # a separate validation file, used instead of VAL_FRACTION
CACHE_DIR=${CACHE_DIR:-}                # the preference cache and the precomputed reference log-probs; empty: .cache/ in this folder

# ---- batch, sequence length, data loading ----
BATCH_SIZE=${BATCH_SIZE:-8}             # pairs per micro-batch (the first argument): 2 x BATCH_SIZE sequences per forward
GRADIENT_ACCUM=${GRADIENT_ACCUM:-1}     # micro-batches per optimizer step: effective batch = BATCH_SIZE x GRADIENT_ACCUM x GPUs
EFFECTIVE_BATCH=${EFFECTIVE_BATCH:-}    # pairs per step to keep while BATCH_SIZE changes (GRADIENT_ACCUM follows)
AUTO_BATCH=${AUTO_BATCH:-}              # 1: find-batch picks BATCH_SIZE x GRADIENT_ACCUM first, same effective batch
MAX_LENGTH=${MAX_LENGTH:-}              # prompt + reply tokens; the prompt is cut first, once for both replies; empty: the model's context
LENGTH_GROUPING=${LENGTH_GROUPING:-0}   # 1: batch pairs of similar length (less padding)
TOKEN_BUDGET=${TOKEN_BUDGET:-}          # N: micro-batches of at most N padded tokens instead of BATCH_SIZE rows
PACKING=${PACKING:-0}                   # 1: pack pairs into rows of 2 x MAX_LENGTH (BATCH_SIZE counts rows); causal LMs only
NUM_WORKERS=${NUM_WORKERS:-}            # loader workers; empty: 2 (preset dpo)
PREFETCH_FACTOR=${PREFETCH_FACTOR:-}    # batches each worker prepares ahead; empty: 2
PIN_MEMORY=${PIN_MEMORY:-}              # 1: page-locked buffers for asynchronous host-to-GPU copies; empty: 1 (preset dpo)
PERSISTENT_WORKERS=${PERSISTENT_WORKERS:-} # 1: keep the workers alive between epochs; empty: 0

# ---- precision and device ----
ENABLE_FP16=${ENABLE_FP16:-}            # "--fp16" (or 1): fp16 autocast + GradScaler
ENABLE_BF16=${ENABLE_BF16:-}            # "--bf16" (or 1): bf16 autocast (Ampere+ GPUs, modern CPUs)
PRECISION=${PRECISION:-}                # fp32 | fp16 | bf16 | auto (bf16 where fast, fp16 where not, fp32 otherwise); empty: fp32
TF32=${TF32:-}                          # 1: TF32 tensor cores for fp32 matmuls (Ampere+); empty: 1 (preset dpo)
DEVICE=${DEVICE:-}                      # auto | cpu | mps | cuda | cuda:N; empty: auto (CUDA, then mps, then CPU)
MAX_MEMORY_MB=${MAX_MEMORY_MB:-}        # memory budget in MiB (caps this process's VRAM); empty: the device's
TARGET_VRAM=${TARGET_VRAM:-}            # share of memory find-batch / AUTO_BATCH may fill; empty: 0.8

# ---- learning rate and optimizer ----
LEARNING_RATE=${LEARNING_RATE:-}        # empty: 5e-6 (preset dpo); TRL's 1e-6 for a well-trained model of 1B+
MIN_LR_RATIO=${MIN_LR_RATIO:-}          # the cosine schedule ends at LEARNING_RATE x this; empty: 0.1
WARMUP_STEPS=${WARMUP_STEPS:-}          # linear warm-up steps; empty: 5 % of the run, at most 200
OPTIMIZER=${OPTIMIZER:-}                # adamw | adafactor | sgd; empty: adamw
LR_SCHEDULE=${LR_SCHEDULE:-}            # cosine | linear | constant | onecycle (after WARMUP_STEPS); empty: cosine
WEIGHT_DECAY=${WEIGHT_DECAY:-}          # AdamW weight decay on matrices; empty: 0.0 (preset dpo)
GRAD_CLIP=${GRAD_CLIP:-}                # clip the gradient norm to this (0: off); empty: 1.0
LR_SCALING=${LR_SCALING:-}              # none | linear | sqrt: scale LEARNING_RATE with the effective batch; empty: none
LR_REFERENCE_BATCH=${LR_REFERENCE_BATCH:-} # the effective batch LEARNING_RATE is meant for; empty: the preset's BATCH_SIZE x GRADIENT_ACCUM

# ---- how long ----
MAX_STEPS=${MAX_STEPS:-}                # stop after N optimizer steps
EPOCHS=${EPOCHS:-}                      # empty with no MAX_STEPS or MAX_SAMPLES: one epoch
MAX_SAMPLES=${MAX_SAMPLES:-}            # stop after N pairs (packed rows with PACKING=1)

# ---- run folder, checkpoints, evaluation, logs ----
OUTPUT_DIR=${OUTPUT_DIR:-}              # where run folders go; empty: runs/ in this folder
RUN_NAME=${RUN_NAME:-}                  # empty: train_dpo-<time>
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
kit_launch dpo dpo "$@"
