#!/usr/bin/env bash
# Reward training (GRPO, the fourth stage: pretrain -> SFT -> DPO -> GRPO) with the micro-batch, in PROMPTS, as
# the first argument: each prompt is NUM_GENERATIONS sampled completions, scored by REWARD_FUNCS. Any further
# flags go to `python -m train grpo` as they are. docs/grpo.md: the prompts, the rewards, the loss.
# Usage: [VAR=value ...] ./train_grpo.sh [MICRO_BATCH] [--any_flag value ...]
#   e.g. MAX_STEPS=30 ./train_grpo.sh 4                         (the built-in arithmetic task)
#        MODEL_PATH=runs/my-sft/final DATA_PATH=prompts.jsonl REWARD_FUNCS=accuracy ./train_grpo.sh 8
set -euo pipefail

if [ $# -gt 0 ] && [[ $1 != -* ]]; then  # the first argument is the micro-batch unless it is a flag
  export BATCH_SIZE=$1  # the user's: the run tells it from the launcher's default by the environment (train/run/plan/fill.py)
  shift
fi
# BEGIN knobs: generated from config.py by `make knobs` (defaults: edit them here; comments: config.py)
# Every knob of config.py that applies to `python -m train grpo`, as VARIABLE=${VARIABLE:-default}
# (docs/knobs.md). Empty: the launcher's preset (grpo), else config.py's default.
KIT_GIVEN=" $(compgen -v | while read -r v; do [ -z "${!v:-}" ] || printf '%s ' "$v"; done)"  # set before the defaults below: RESUME=1 keeps the run's own settings for the rest

# ---- model ----
ENABLE_GRAD_CKPT=${ENABLE_GRAD_CKPT:-}  # "--gradient_checkpointing" (or 1): recompute activations in the backward pass: about 30 % slower per step; empty: 0
COMPILE=${COMPILE:-}                    # torch.compile the model (fused kernels; compile time reported apart); empty: on with a GPU, off on a CPU
COMPILE_MODE=${COMPILE_MODE:-}          # COMPILE's mode; reduce-overhead: CUDA graphs; empty: that on one GPU where a step is launch-bound, else default
MODEL_PATH=${MODEL_PATH:-}              # the model to train; empty: the newest completed SFT or DPO run's final/
GENERATION_CONFIG=${GENERATION_CONFIG:-} # a JSON file of generate() settings
LORA_R=${LORA_R:-}                      # LoRA rank (peft; 8-64 usual): adapters train, the model stays frozen; empty or 0: full fine-tuning
LORA_ALPHA=${LORA_ALPHA:-}              # LoRA's scale is LORA_ALPHA / LORA_R; empty: 2 x LORA_R
LORA_DROPOUT=${LORA_DROPOUT:-}          # dropout on the LoRA adapters' input; empty: 0.05
LORA_TARGETS=${LORA_TARGETS:-}          # layer names LoRA adapts (comma-separated, or all-linear); empty: the architecture's (docs/sft.md)
TRUST_REMOTE_CODE=${TRUST_REMOTE_CODE:-} # let MODEL_PATH run the Python code it ships (custom architectures); empty: 0
REFERENCE=${REFERENCE:-}                # the reference of BETA > 0: copy | adapters; empty: adapters with LORA_R, else copy
DROPOUT=${DROPOUT:-}                    # every dropout of the model (gpt2 resid/embd/attn_pdrop, llama/qwen3 attention_dropout, t5 dropout_rate); empty: 0 (preset grpo)
FREEZE=${FREEZE:-}                      # parameters left untrained (no gradients, no optimizer state); empty: nothing frozen

# ---- data, tokenizer, data loading ----
DATA_PATH=${DATA_PATH:-}                # prompts (TRL's prompt-only records, messages, alpaca; extra columns go to the rewards); empty: a built-in task
TOKENIZER_PATH=${TOKENIZER_PATH:-}      # a local AutoTokenizer folder; empty: a byte-level BPE trained on the corpus and cached
MAX_RECORD_MB=${MAX_RECORD_MB:-}        # longest JSONL record (a line, decompressed) read; past it a mistake or a decompression bomb; empty: 64
TOKENIZE_WORKERS=${TOKENIZE_WORKERS:-}  # processes tokenizing the data into its cache (tokens, SFT conversations, pairs); empty: every core (a corpus under 8 MB: none, in the training process)
MAX_LENGTH=${MAX_LENGTH:-}              # a prompt with its completion; empty: model context
NUM_WORKERS=${NUM_WORKERS:-}            # DataLoader worker processes; empty: 0
PREFETCH_FACTOR=${PREFETCH_FACTOR:-}    # batches each worker loads ahead (only with NUM_WORKERS > 0; torch's default is 2)
PIN_MEMORY=${PIN_MEMORY:-}              # page-locked host buffers so host-to-GPU copies run asynchronously (no effect on CPU); empty: 0
PERSISTENT_WORKERS=${PERSISTENT_WORKERS:-} # keep worker processes alive between epochs instead of restarting them; empty: 0
CACHE_DIR=${CACHE_DIR:-}                # where trained tokenizers and token caches live, keyed by data content and tokenizer; empty: .cache
SKIP_BAD_RECORDS=${SKIP_BAD_RECORDS:-}  # skip records that cannot be used (bad JSON, no response, wrong shape) and print how many; empty: 0
TEMPLATE=${TEMPLATE:-}                  # builtin | tokenizer | none (raw: source + eos -> target + eos, as ChatLM) | a Jinja file; empty: the tokenizer's own chat template where it has one, else builtin
VAL_FRACTION=${VAL_FRACTION:-}          # share of the prompts held out, 0 unless set (a pass samples NUM_GENERATIONS completions of each); empty: 0
VAL_PATH=${VAL_PATH:-}                  # prompts, in any format DATA_PATH's prompts take

# ---- batch, learning rate, how long ----
BATCH_SIZE=${BATCH_SIZE:-}              # prompts per micro-batch, NUM_GENERATIONS completions each; empty: 4 (preset grpo)
GRADIENT_ACCUM=${GRADIENT_ACCUM:-}      # micro-batches summed before each optimizer step; empty: 1
LEARNING_RATE=${LEARNING_RATE:-}        # peak learning rate, reached after the warm-up, then following LR_SCHEDULE; empty: 1e-5 (preset grpo)
MIN_LR_RATIO=${MIN_LR_RATIO:-}          # the cosine and linear schedules end at LEARNING_RATE x this; empty: 0.1
OPTIMIZER=${OPTIMIZER:-}                # adamw | adafactor | sgd | adafactor_relative; empty: adamw
LR_SCHEDULE=${LR_SCHEDULE:-}            # cosine | linear | constant | onecycle; empty: cosine
WARMUP_STEPS=${WARMUP_STEPS:-}          # optimizer steps of linear warm-up; below 1, a share of the run's steps (0.05: 5 %, rounded up, as TRL's warmup_steps); empty: 5 % of the run, at most 200
WEIGHT_DECAY=${WEIGHT_DECAY:-}          # weight decay on matrices (not on biases and norms); empty: 0 (preset grpo)
GRAD_CLIP=${GRAD_CLIP:-}                # clip the gradient norm to this before each step (0: no clipping); empty: 1
MAX_STEPS=${MAX_STEPS:-}                # stop after this many optimizer steps
EPOCHS=${EPOCHS:-}                      # stop after this many passes over the data (fractions allowed)
MAX_SAMPLES=${MAX_SAMPLES:-}            # stop after this many training sequences (DPO: pairs; the budget `make compare` holds fixed)
BETA=${BETA:-}                          # the KL-to-reference weight (TRL's beta); empty: 0
NUM_GENERATIONS=${NUM_GENERATIONS:-}    # completions sampled per prompt (a group); BATCH_SIZE counts prompts, each of these many rows; empty: 8
MAX_COMPLETION_LENGTH=${MAX_COMPLETION_LENGTH:-} # tokens a completion may run to; empty: 256 (a CPU: 32), or what MAX_LENGTH leaves after the longest prompt
TEMPERATURE=${TEMPERATURE:-}            # sampling temperature (0: greedy); the log-probs are taken at it too, as TRL takes them; empty: 1
TOP_P=${TOP_P:-}                        # nucleus sampling: the likeliest tokens whose probability reaches TOP_P (1: all); empty: 1
TOP_K=${TOP_K:-}                        # only the TOP_K likeliest tokens are drawn from (0: all); empty: 0
LOSS_TYPE=${LOSS_TYPE:-}                # dapo (tokens of the step) | grpo (per completion) | bnpo | dr_grpo | cispo | sapo | luspo | vespo (docs/grpo.md); empty: dapo
EPSILON=${EPSILON:-}                    # the policy ratio is clipped to 1 - EPSILON (and 1 + EPSILON without EPSILON_HIGH); empty: 0.2
EPSILON_HIGH=${EPSILON_HIGH:-}          # the ratio's upper clip, 1 + EPSILON_HIGH (DAPO: 0.28; cispo's cap); empty: EPSILON
DELTA=${DELTA:-}                        # two-sided GRPO: the unclipped ratio capped at DELTA; empty: off
SAPO_TEMPERATURE_POS=${SAPO_TEMPERATURE_POS:-} # sapo's gate temperature where the advantage is positive; empty: 1
SAPO_TEMPERATURE_NEG=${SAPO_TEMPERATURE_NEG:-} # sapo's gate temperature elsewhere; empty: 1.05
VESPO_K_POS=${VESPO_K_POS:-}            # vespo's power k where the advantage is >= 0: how hard a completion whose ratio fell below 1 is down-weighted; empty: 2
VESPO_LAMBDA_POS=${VESPO_LAMBDA_POS:-}  # vespo's decay lambda where the advantage is >= 0: how hard a ratio above 1 is down-weighted; empty: 3
VESPO_K_NEG=${VESPO_K_NEG:-}            # vespo's k where the advantage is negative; empty: 3
VESPO_LAMBDA_NEG=${VESPO_LAMBDA_NEG:-}  # vespo's lambda where the advantage is negative; empty: 2
SCALE_REWARDS=${SCALE_REWARDS:-}        # advantages divided by the std of the group's rewards | the batch's | none (Dr; empty: group
IMPORTANCE_SAMPLING_LEVEL=${IMPORTANCE_SAMPLING_LEVEL:-} # token | sequence (GSPO: one ratio per completion); empty: token
MULTI_OBJECTIVE_AGGREGATION=${MULTI_OBJECTIVE_AGGREGATION:-} # sum_then_normalize | normalize_then_sum; empty: sum_then_normalize
NUM_ITERATIONS=${NUM_ITERATIONS:-}      # optimizer steps taken on one generation (TRL's mu); above 1 keeps the sampling's log-probs; empty: 1
MASK_TRUNCATED_COMPLETIONS=${MASK_TRUNCATED_COMPLETIONS:-} # a completion that ends without EOS within MAX_COMPLETION_LENGTH counts no token in the loss; empty: 0
REWARD_FUNCS=${REWARD_FUNCS:-}          # rewards, comma-separated: accuracy | exact | format | length, or your own file.py:function; empty: accuracy,format on the built-in task; DATA_PATH needs them named
REWARD_WEIGHTS=${REWARD_WEIGHTS:-}      # one weight per reward of REWARD_FUNCS, comma-separated; empty: 1 each
REWARD_TIMEOUT=${REWARD_TIMEOUT:-}      # seconds one reward call may take; past it the run stops, naming the reward; empty: 60
REWARD_PATTERN=${REWARD_PATTERN:-}      # the format reward's regular expression; empty: the built-in task's (a number first); other data sets one
REWARD_LENGTH=${REWARD_LENGTH:-}        # the length reward's target, in tokens
EFFECTIVE_BATCH=${EFFECTIVE_BATCH:-}    # sequences per optimizer step to keep fixed while BATCH_SIZE is traded against GRADIENT_ACCUM; empty: BATCH_SIZE x GRADIENT_ACCUM
AUTO_BATCH=${AUTO_BATCH:-}              # 1: before training, find the fastest micro-batch that fits TARGET_VRAM; empty: 0
LR_SCALING=${LR_SCALING:-}              # none | linear | sqrt: scale LEARNING_RATE by (effective batch / LR_REFERENCE_BATCH), or its square root; empty: none
LR_REFERENCE_BATCH=${LR_REFERENCE_BATCH:-} # the effective batch LEARNING_RATE is meant for; empty: the preset's BATCH_SIZE x GRADIENT_ACCUM (baseline 8, optimized 128; 8 without a preset)

# ---- precision, device, several GPUs ----
DEVICE=${DEVICE:-}                      # auto (CUDA, which ROCm builds also present as cuda, then Apple mps, then CPU), or a torch device such as cuda:1 or cpu; empty: auto
ENABLE_FP16=${ENABLE_FP16:-}            # "--fp16" (or 1): fp16 autocast + GradScaler
ENABLE_BF16=${ENABLE_BF16:-}            # "--bf16" (or 1): bf16 autocast (Ampere+ GPUs, modern CPUs)
PRECISION=${PRECISION:-}                # fp32 | fp16 | bf16 | auto; empty: fp32
TF32=${TF32:-}                          # let fp32 matmuls use TF32 tensor cores (Ampere and newer): about 2-3x faster fp32 matmuls at 10-bit mantissa precision; empty: 1 (preset grpo)
SEED=${SEED:-}                          # seeds model init, data order and dropout: the same seed gives the same run; empty: 1337
NPROC_PER_NODE=${NPROC_PER_NODE:-}      # processes (GPUs) on this machine; above 1 starts torchrun (DDP): docs/multi-gpu.md
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
REPORT_TO=${REPORT_TO:-}                # none | tensorboard: also write the metrics rows and the summary as TensorBoard scalars in runs/<name>/tensorboard/; empty: none
DRY_RUN=${DRY_RUN:-}                    # print the resolved settings, the derived numbers and a peak-memory estimate, then exit: no model on the device; empty: 0
# END knobs

source "$(dirname "$0")/scripts/common.sh"
kit_launch grpo grpo "$@"
