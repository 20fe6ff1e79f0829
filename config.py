"""Configuration: one dataclass per concern, named presets, the flag/variable names. Precedence: dataclass
default < the mode's own (MODE_DEFAULTS) < preset < launcher variable / CLI flag; users edit them here. One
name per field at every layer: launcher variable (ENV_NAMES, else upper case), flag --<field>. Its markers
(knob(default, "auto", "compared", ...)) list it; knob(modes=...): the modes that read it (else EVERY)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

# One name per knob: the launcher variable (ENV_NAMES, env_name), the markers and the checks:
# train/core/checks.py
from train.core.checks import ENV_NAMES, bad_value, check_fields, check_path, env_name, knob  # noqa: F401
from train.core.checks import check_int as _check_int
from train.core.errors import UsageError
from train.core.optim import registry, schedules
from train.core.units import cpu_cores
from train.models import FAMILIES, SIZES

KIT_DIR = Path(__file__).resolve().parent

MODEL_SIZES, MODEL_FAMILIES = SIZES, tuple(FAMILIES)  # train/models: one entry per family
PRECISIONS, LR_SCALINGS = ("fp32", "fp16", "bf16", "auto"), ("none", "linear", "sqrt")
# a table's entry is a choice
OPTIMIZERS, LR_SCHEDULES = tuple(registry.OPTIMIZERS), tuple(schedules.SCHEDULES)
MODES = ("pretrain", "sft", "dpo", "grpo")
SHARDINGS, REPORT_TO = ("none", "zero2", "zero3"), ("none", "tensorboard")
EVERY, FINE_TUNING, FROM_SCRATCH = {"pretrain", "sft", "dpo", "grpo"}, {"sft", "dpo"}, {"pretrain", "sft"}
# CHAT: the modes that train a chat model (MODEL_PATH, LoRA ...)
CHAT, GRPO = {"sft", "dpo", "grpo"}, {"grpo"}
# GRPO's choices: train/core/reward/knobs.py's (imports torch, which the launchers' config read has not)
LOSS_TYPES, SCALE_REWARDS = (
    ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"),
    ("group", "batch", "none"),
)
LEVELS, AGGREGATIONS = ("token", "sequence"), ("sum_then_normalize", "normalize_then_sum")
DPO_LOSSES, REFERENCES = ("sigmoid", "ipo", "hinge", "simpo", "orpo"), ("copy", "precomputed", "adapters")
LOSS_ONS, TRUNCATIONS, REASONINGS = ("assistant", "all"), ("keep_end", "keep_start"), ("keep", "drop")
MODEL_CONFIG_NAMES = ("config.json", "model_config.json")  # ChatLM's bare checkpoints: model_config.json
RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(kw_only=True)
class ModelConfig:
    model_size: str | None = knob(None, "auto", modes=FROM_SCRATCH, choices=MODEL_SIZES)
    """8K vocab: nano 5.3M (tests, CPU), tiny 30M, small 92M, medium 312M (GPT-2 small/medium: 124M/355M at
    50K). Empty: small on a GPU, else a nano demo. In SFT, set: a new model is trained from scratch (no
    MODEL_PATH)."""
    model_family: str = knob("gpt2", modes=FROM_SCRATCH, choices=MODEL_FAMILIES)
    """What MODEL_SIZE builds: gpt2, llama, qwen3 or t5. gpt2, llama (RMSNorm, rotary, SwiGLU, grouped-query
    attention) and qwen3 (llama's with q/k norms) are causal LMs; t5 an encoder-decoder (span corruption).
    Sizes: the README."""
    model_config: str | None = knob(None, modes=FROM_SCRATCH)
    """A transformers causal-LM or encoder-decoder (T5, BART ...) config.json (or a folder holding one) to
    train from scratch instead of a preset (SFT too: on source -> target pairs), e.g. Llama- or ChatLM's
    T5-style."""
    gradient_checkpointing: bool = knob(False, "switch")
    """Recompute activations in the backward pass: about 30 % slower per step, far less activation memory. The
    guides' fix when VRAM is full at the batch size you want."""
    compile: bool | None = knob(None, "auto", "compared")
    """torch.compile the model (fused kernels; compile time reported apart). Empty: on with a GPU, off on a
    CPU."""
    compile_mode: str | None = knob(None, "auto", choices=("default", "reduce-overhead", "max-autotune"))
    """COMPILE's mode; reduce-overhead: CUDA graphs. Empty: that on one GPU where a step is launch-bound, else
    default."""
    model_path: str | None = knob(None, modes=CHAT)
    """SFT: the model to fine-tune, a local transformers folder (or a state_dict + model_config.json,
    imported). Empty: a new model if MODEL_CONFIG / MODEL_SIZE is set, else the newest pretraining run's
    final/. DPO: the chat model to train (a folder, as for SFT). Empty: the newest completed SFT run's final/.
    GRPO: the model to
    train. Empty: the newest completed SFT or DPO run's final/."""
    generation_config: str | None = None
    """A JSON file of generate() settings ({"num_beams": 5, "repetition_penalty": 1.1, ...}) saved into
    final/generation_config.json, checked at start with transformers' GenerationConfig."""
    lora_r: int | None = knob(None, "compared", modes=CHAT, least=0)
    """SFT: LoRA rank (peft; 8-64 usual): adapters train, the model stays frozen. Empty or 0: full
    fine-tuning."""
    lora_alpha: float | None = knob(None, "compared", modes=CHAT, above=0.0)
    """SFT: LoRA's scale is LORA_ALPHA / LORA_R. Empty: 2 x LORA_R."""
    lora_dropout: float | None = knob(None, "compared", modes=CHAT, least=0.0)
    """SFT: dropout on the LoRA adapters' input. Empty: 0.05."""
    lora_targets: str | None = knob(None, "compared", modes=CHAT)
    """SFT: layer names LoRA adapts (comma-separated, or all-linear). Empty: the architecture's
    (docs/sft.md)."""
    trust_remote_code: bool = knob(False, modes=CHAT)
    """SFT: let MODEL_PATH run the Python code it ships (custom architectures). Off: only architectures
    transformers knows are loaded, as the code runs with your permissions."""
    reference: str | None = knob(None, "auto", "compared", modes={"dpo", "grpo"}, choices=REFERENCES)
    """DPO: copy (a frozen copy on the device) | precomputed (its log-probs made once, cached) | adapters
    (LoRA's base, adapters off). Empty: adapters with LORA_R, a copy for a short run where it fits, else
    precomputed. GRPO:
    the reference of BETA > 0: copy | adapters. Empty: adapters with LORA_R, else copy."""
    dropout: float | None = knob(None, "auto", "compared", least=0.0, below=1.0)
    """Every dropout of the model (gpt2 resid/embd/attn_pdrop, llama/qwen3 attention_dropout, t5
    dropout_rate). Empty: 0 for MODEL_SIZE (nanoGPT's; +11 % tokens/s on an H200), else MODEL_CONFIG's or
    MODEL_PATH's own (SFT keeps what it
    was trained with). DPO: every dropout of the model. Empty: 0, LoRA's too (TRL's disable_dropout)."""
    freeze: str | None = knob(None, "compared")
    """Parameters left untrained (no gradients, no optimizer state): a comma list of embeddings | encoder |
    decoder |
    lm_head or name patterns ("transformer.h.0.*"). Tied weights freeze together. Empty: nothing frozen."""

    def __post_init__(self):
        check_fields(self)
        check_path(self, "model_path", "not a model folder (no config.json)",
                   lambda path: any((Path(path) / n).is_file() for n in MODEL_CONFIG_NAMES))
        check_path(self, "model_config", "no such file", lambda path: Path(path).exists())


@dataclass(kw_only=True)
class DataConfig:
    data_path: str | None = None
    """Training text, or SFT's records (alpaca, messages, ShareGPT, prompt/response): .txt/.md, JSONL (.jsonl,
    .jsonl.gz), a .json list, parquet, an Arrow folder (datasets' save_to_disk), or a folder or glob mixing
    them; streamed, never read whole. Empty: the built-in corpus (the standard-library sources of the running
    Python). DPO: records of a prompt, a chosen and a rejected reply (docs/dpo.md). Empty: built-in pairs.
    GRPO: prompts (TRL's prompt-only records, messages, alpaca; extra columns go to the rewards). Empty: a
    built-in task."""
    text_field: str = knob("text", modes=FROM_SCRATCH)
    """The field (JSON) or column (parquet, Arrow; only it is read) of the text; in SFT a record holding it
    and
    no conversation keys is a plain document, trained whole."""
    tokenizer_path: str | None = None
    """A local AutoTokenizer folder. Empty: a byte-level BPE trained on the corpus and cached. DPO: a local
    AutoTokenizer folder for MODEL_PATH's model. Empty: MODEL_PATH's own."""
    vocab_size: int = knob(8192, modes=FROM_SCRATCH, least=256)
    """Vocabulary of the BPE trained when no TOKENIZER_PATH is given (padded to a multiple of 64 in the model,
    as nanoGPT pads 50257 to 50304, for faster matmuls)."""
    tokenizer_sample_mb: float = knob(100.0, modes=FROM_SCRATCH, above=0.0)
    """MB of text the BPE (no TOKENIZER_PATH) trains on: the whole corpus when smaller, else a sample spread
    through it; ~100 MB finds an 8-50k vocabulary's merges, more costs minutes."""
    max_record_mb: float = knob(64.0, above=0.0)
    """Longest JSONL record (a line, decompressed) read; past it a mistake or a decompression bomb."""
    tokenize_workers: int | None = None
    """Processes tokenizing the data into its cache (tokens, SFT conversations, pairs). Empty: every core (a
    corpus under 8 MB: none, in the training process). More than the CPU cores is refused: each extra process
    only adds its start-up (32 on 2 cores spawned 33 processes)."""
    max_length: int | None = knob(None, "auto", least=2)
    """Tokens per training sequence; sequences are packed to exactly this length. Empty: the model's context
    length. DPO: the prompt with either reply (a long pair loses prompt tokens). Empty: model context. GRPO: a
    prompt
    with its completion. Empty: model context."""
    num_workers: int = knob(0, "compared", least=0)
    """DataLoader worker processes. 0 loads batches in the training process (the guides' 'before'); 4 overlaps
    loading."""
    prefetch_factor: int | None = knob(None, least=1)
    """Batches each worker loads ahead (only with NUM_WORKERS > 0; torch's default is 2)."""
    pin_memory: bool = False
    """Page-locked host buffers so host-to-GPU copies run asynchronously (no effect on CPU)."""
    persistent_workers: bool = False
    """Keep worker processes alive between epochs instead of restarting them."""
    cache_dir: str = str(KIT_DIR / ".cache")
    """Where trained tokenizers and token caches live, keyed by data content and tokenizer."""
    length_grouping: bool = knob(False, modes=FINE_TUNING)
    """SFT: batch samples of similar length together (the guides' "dynamic batch size by sequence length"):
    batches are padded to their longest sample, so less compute goes to pad tokens. The order stays random
    from batch to batch."""
    token_budget: int | None = knob(None, modes=FINE_TUNING, least=1)
    """SFT: build each micro-batch by tokens instead of samples: as many samples as fit in this many padded
    tokens (rows x longest), so short samples come many to a batch and memory per step stays flat. Replaces
    BATCH_SIZE as the batch size; groups by length by itself."""
    packing: bool | None = knob(None, "auto", modes=FINE_TUNING)
    """SFT: pack several conversations into each row of MAX_LENGTH tokens (best-fit decreasing) instead of one
    padded row each: a few percent of padding instead of half; positions restart, attention never crosses one
    (varlen kernels, or a block mask). BATCH_SIZE counts rows. Empty: 0. DPO: 1 packs all pairs into rows of
    2 x MAX_LENGTH (BATCH_SIZE counts rows); 0 pads. Empty: each micro-batch's pairs in one unpadded row."""
    skip_bad_records: bool = knob(False, modes=CHAT)
    """SFT: skip records that cannot be used (bad JSON, no response, wrong shape) and print how many, instead
    of stopping at the first. An empty file or an unknown format still stops."""
    template: str | None = knob(None, modes=CHAT)
    """SFT: builtin | tokenizer | none (raw: source + eos -> target + eos, as ChatLM) | a Jinja file. Empty:
    the
    tokenizer's own chat template where it has one, else builtin."""
    loss_on: str | None = knob(None, modes={"sft"}, choices=LOSS_ONS)
    """SFT: assistant (empty: the replies only) | all (every token of the rendered sequence, pad excluded)."""
    truncation: str | None = knob(None, modes=FINE_TUNING, choices=TRUNCATIONS)
    """SFT: keep_end (empty: a long source keeps its end) | keep_start (its start, as ChatLM); tools kept."""
    reasoning: str | None = knob(None, modes=FINE_TUNING, choices=REASONINGS)
    """SFT: keep (empty: an assistant turn's reasoning_content is rendered and trained) | drop."""
    val_fraction: float = knob(0.01, least=0.0)
    """Share of the data held out for validation (the last part of the token stream, never trained on); raised
    to fill EVAL_BATCHES x 8 sequences where the data allows (at most 10 %), the same whatever BATCH_SIZE, so
    runs that differ in it hold out the same data. 0: no validation. DPO: share of the pairs held out. GRPO:
    share of the prompts held out, 0 unless set (a pass samples NUM_GENERATIONS completions of each)."""
    val_path: str | None = None
    """A separate validation file or folder (same formats as DATA_PATH), tokenized with the same tokenizer;
    used instead of VAL_FRACTION. GRPO: prompts, in any format DATA_PATH's prompts take."""

    def __post_init__(self):
        check_fields(self)
        _check_int(self, "tokenize_workers", 1, optional=True, maximum=cpu_cores(), why=" (this machine's "
                                                                                        "CPU cores)")
        if not self.text_field.strip():
            raise bad_value("text_field", "the name of the text field or column", self.text_field)
        if self.packing and self.token_budget is not None:
            raise UsageError("PACKING=1 (--packing) and TOKEN_BUDGET (--token_budget) both size the batches: "
                             "choose one")
        if self.num_workers == 0:  # torch rejects a prefetch factor and persistent workers without workers
            self.prefetch_factor, self.persistent_workers = None, False
        check_path(self, "data_path")
        if self.val_fraction >= 0.5:
            raise bad_value(
                "val_fraction", "a number from 0 to 0.5 (a small held-out share)", self.val_fraction
            )
        check_path(self, "val_path")
        if self.template not in (None, "builtin", "tokenizer", "none") and not Path(self.template).is_file():
            raise bad_value(
                "template", "builtin | tokenizer | none | a Jinja file (no such file)", self.template
            )
        check_path(self, "tokenizer_path", "not a tokenizer folder", lambda path: Path(path).is_dir())


@dataclass(kw_only=True)
class OptimConfig:
    batch_size: int = knob(8, "compared", least=1)
    """Micro-batch per GPU: sequences in one forward/backward. The first knob the guides turn. DPO: pairs per
    micro-batch (chosen and rejected, two sequences each, in one forward); with PACKING=1, packed rows. GRPO:
    prompts
    per micro-batch, NUM_GENERATIONS completions each."""
    gradient_accumulation_steps: int = knob(1, "compared", least=1)
    """Micro-batches summed before each optimizer step. Effective batch = BATCH_SIZE x GRADIENT_ACCUM x GPUs;
    raise it to keep the effective batch when BATCH_SIZE must shrink."""
    learning_rate: float = knob(6e-4, "compared", above=0.0)
    """Peak learning rate, reached after the warm-up, then following LR_SCHEDULE."""
    min_lr_ratio: float = knob(0.1, "compared", least=0.0)
    """The cosine and linear schedules end at LEARNING_RATE x this."""
    optimizer: str = knob("adamw", "compared", choices=OPTIMIZERS)
    """adamw (fused; 2 fp32 states per parameter) | adafactor (torch's: factored second moment) | sgd
    (momentum 0.9, Nesterov; 1 state) | adafactor_relative (ChatLM's: its own relative step; LEARNING_RATE,
    LR_SCHEDULE unused)."""
    lr_schedule: str = knob("cosine", "compared", choices=LR_SCHEDULES)
    """cosine | linear (to LEARNING_RATE x MIN_LR_RATIO) | constant, each after WARMUP_STEPS of linear warm-up
    |
    onecycle (torch's OneCycleLR shape: from LEARNING_RATE / 25 up over WARMUP_STEPS, cosine down to / 25e4).
    """
    warmup_steps: float | None = knob(None, "auto", "compared", least=0.0)
    """Optimizer steps of linear warm-up; below 1, a share of the run's steps (0.05: 5 %, rounded up, as TRL's
    warmup_steps). Empty: 5 % of the run, at most 200."""
    weight_decay: float = knob(0.1, least=0.0)
    """Weight decay on matrices (not on biases and norms)."""
    grad_clip: float = knob(1.0, least=0.0)
    """Clip the gradient norm to this before each step (0: no clipping)."""
    loss_mean: str | None = knob(None, "compared", modes={"sft"}, choices=("tokens", "micro_batches"))
    """SFT: tokens (empty: the step's loss is the mean over all its target tokens, as one big batch's) |
    micro_batches (the mean of its micro-batches' own token means, as ChatLM-mini-Chinese's loop takes it:
    docs/coming-from.md)."""
    max_steps: int | None = knob(None, "compared", least=1)
    """Stop after this many optimizer steps."""
    epochs: float | None = knob(None, "compared", above=0.0)
    """Stop after this many passes over the data (fractions allowed). No MAX_STEPS, EPOCHS or MAX_SAMPLES: one
    epoch."""
    max_samples: int | None = knob(None, "compared", least=1)
    """Stop after this many training sequences (DPO: pairs; the budget `make compare` holds fixed)."""
    dpo_loss: str | None = knob(None, "compared", modes={"dpo"}, choices=DPO_LOSSES)
    """DPO: sigmoid (DPO) | ipo | hinge (against the reference) | simpo | orpo (reference-free)."""
    beta: float | None = knob(None, "compared", modes={"dpo", "grpo"}, least=0.0)
    """DPO: how far the policy may drift from the reference (TRL's beta; SimPO's and ORPO's scale), above 0.
    GRPO:
    the KL-to-reference weight (TRL's beta). Empty: 0, no reference model."""
    num_generations: int = knob(8, "compared", modes=GRPO, least=2)
    """Completions sampled per prompt (a group); BATCH_SIZE counts prompts, each of these many rows."""
    max_completion_length: int | None = knob(None, "compared", modes=GRPO, least=1)
    """Tokens a completion may run to. Empty: 256 (a CPU: 32), or what MAX_LENGTH leaves after the longest
    prompt."""
    temperature: float = knob(1.0, modes=GRPO, least=0.0)
    """Sampling temperature (0: greedy); the log-probs are taken at it too, as TRL takes them."""
    top_p: float = knob(1.0, modes=GRPO, above=0.0)
    """Nucleus sampling: the likeliest tokens whose probability reaches TOP_P (1: all)."""
    top_k: int = knob(0, modes=GRPO, least=0)
    """Only the TOP_K likeliest tokens are drawn from (0: all)."""
    loss_type: str = knob("dapo", "compared", modes=GRPO, choices=LOSS_TYPES)
    """dapo (tokens of the step) | grpo (per completion) | bnpo | dr_grpo | cispo | sapo | luspo | vespo
    (docs/grpo.md)."""
    epsilon: float = knob(0.2, modes=GRPO, least=0.0, below=1.0)
    """The policy ratio is clipped to 1 - EPSILON (and 1 + EPSILON without EPSILON_HIGH)."""
    epsilon_high: float | None = knob(None, modes=GRPO, least=0.0)
    """The ratio's upper clip, 1 + EPSILON_HIGH (DAPO: 0.28; cispo's cap). Empty: EPSILON."""
    delta: float | None = knob(None, modes=GRPO, above=1.0)
    """Two-sided GRPO: the unclipped ratio capped at DELTA. Empty: off."""
    sapo_temperature_pos: float = knob(1.0, modes=GRPO, above=0.0)
    """sapo's gate temperature where the advantage is positive."""
    sapo_temperature_neg: float = knob(1.05, modes=GRPO, above=0.0)
    """sapo's gate temperature elsewhere."""
    vespo_k_pos: float = knob(2.0, modes=GRPO, least=0.0)
    """vespo's power k where the advantage is >= 0: how hard a completion whose ratio fell below 1 is
    down-weighted."""
    vespo_lambda_pos: float = knob(3.0, modes=GRPO, above=0.0)
    """vespo's decay lambda where the advantage is >= 0: how hard a ratio above 1 is down-weighted."""
    vespo_k_neg: float = knob(3.0, modes=GRPO, least=0.0)
    """vespo's k where the advantage is negative."""
    vespo_lambda_neg: float = knob(2.0, modes=GRPO, above=0.0)
    """vespo's lambda where the advantage is negative."""
    scale_rewards: str = knob("group", modes=GRPO, choices=SCALE_REWARDS)
    """Advantages divided by the std of the group's rewards | the batch's | none (Dr. GRPO)."""
    importance_sampling_level: str = knob("token", modes=GRPO, choices=LEVELS)
    """token | sequence (GSPO: one ratio per completion)."""
    multi_objective_aggregation: str = knob("sum_then_normalize", modes=GRPO, choices=AGGREGATIONS)
    """sum_then_normalize (weighted sum of the rewards, then normalised) | normalize_then_sum (GDPO)."""
    num_iterations: int = knob(1, "compared", modes=GRPO, least=1)
    """Optimizer steps taken on one generation (TRL's mu); above 1 keeps the sampling's log-probs."""
    mask_truncated_completions: bool = knob(False, modes=GRPO)
    """A completion that ends without EOS within MAX_COMPLETION_LENGTH counts no token in the loss."""
    reward_funcs: str | None = knob(None, modes=GRPO)
    """Rewards, comma-separated: accuracy | exact | format | length, or your own file.py:function (runs your
    code:
    docs/grpo.md). Empty: accuracy,format on the built-in task; DATA_PATH needs them named."""
    reward_weights: str | None = knob(None, modes=GRPO)
    """One weight per reward of REWARD_FUNCS, comma-separated. Empty: 1 each."""
    reward_timeout: float = knob(60.0, modes=GRPO, above=0.0)
    """Seconds one reward call may take; past it the run stops, naming the reward."""
    reward_pattern: str | None = knob(None, modes=GRPO)
    """The format reward's regular expression. Empty: the built-in task's (a number first); other data sets
    one."""
    reward_length: int | None = knob(None, modes=GRPO, least=1)
    """The length reward's target, in tokens."""
    label_smoothing: float | None = knob(None, modes={"dpo"}, least=0.0, below=0.5)
    """DPO: the chance a pair's labels are wrong (sigmoid, simpo: conservative DPO), below 0.5."""
    simpo_gamma: float | None = knob(None, modes={"dpo"}, least=0.0)
    """DPO: SimPO's target reward margin (TRL's CPOConfig simpo_gamma)."""
    sft_weight: float | None = knob(None, modes={"dpo"}, least=0.0)
    """DPO: adds this x the chosen replies' token-mean NLL to the loss (TRL 1.16: loss_type sigmoid + sft)."""
    effective_batch: int | None = knob(None, least=1)
    """Sequences per optimizer step to keep fixed while BATCH_SIZE is traded against GRADIENT_ACCUM
    (find-batch, autotune, AUTO_BATCH, OOM recovery). Set: GRADIENT_ACCUM becomes EFFECTIVE_BATCH /
    BATCH_SIZE. Empty: BATCH_SIZE x GRADIENT_ACCUM."""
    auto_batch: bool = False
    """1: before training, find the fastest micro-batch that fits TARGET_VRAM (make find-batch) and set
    BATCH_SIZE and GRADIENT_ACCUM from it, keeping the effective batch. An earlier result for the same model,
    length, precision and device is reused."""
    lr_scaling: str = knob("none", choices=LR_SCALINGS)
    """none | linear | sqrt: scale LEARNING_RATE by (effective batch / LR_REFERENCE_BATCH), or its square
    root, when the effective batch differs from the reference. none keeps it."""
    lr_reference_batch: int | None = knob(None, least=1)
    """The effective batch LEARNING_RATE is meant for. Empty: the preset's BATCH_SIZE x GRADIENT_ACCUM
    (baseline 8, optimized 128; 8 without a preset)."""

    def __post_init__(self):
        check_fields(self)
        self.warmup_steps = schedules.steps_or_share(self.warmup_steps)
        if self.min_lr_ratio > 1:
            raise bad_value("min_lr_ratio", "a number from 0 to 1", self.min_lr_ratio)
        if (
            self.effective_batch is not None
            and not self.auto_batch
            and self.effective_batch % self.batch_size
        ):
            raise UsageError(f"EFFECTIVE_BATCH={self.effective_batch} is not a multiple of "
                             f"BATCH_SIZE={self.batch_size}: "
                             "the effective batch must be BATCH_SIZE x GRADIENT_ACCUM (or set AUTO_BATCH=1)")


@dataclass(kw_only=True)
class SystemConfig:
    device: str = "auto"
    """auto (CUDA, which ROCm builds also present as cuda, then Apple mps, then CPU), or a torch device such
    as cuda:1 or cpu."""
    precision: str = knob("fp32", "compared", choices=PRECISIONS)
    """fp32 | fp16 (autocast + GradScaler) | bf16 (autocast) | auto (bf16 where the device runs it fast, fp16
    where it has fast fp16 but no bf16, fp32 otherwise; measured on CPU)."""
    tf32: bool = False
    """Let fp32 matmuls use TF32 tensor cores (Ampere and newer): about 2-3x faster fp32 matmuls at 10-bit
    mantissa precision, which training tolerates."""
    seed: int = knob(1337, least=0)
    """Seeds model init, data order and dropout: the same seed gives the same run."""
    sharding: str = knob("none", choices=SHARDINGS)
    """none: every process holds the whole model (DDP when NPROC_PER_NODE > 1). zero2: FSDP2 shards optimizer
    state and gradients, parameters stay gathered from forward to backward (DeepSpeed ZeRO-2). zero3:
    parameters sharded too, gathered per block (ZeRO-3): least memory, more communication. For when the model
    or the optimizer state does not fit."""
    offload_optimizer: bool = False
    """With SHARDING: keep sharded parameters, gradients and AdamW state in host memory and run the optimizer
    step on the CPU (the guides' DeepSpeed offload_optimizer): GPU memory traded for host-to-GPU copies every
    step."""
    target_vram: float = knob(0.8, above=0.0)
    """Share of device memory find-batch, AUTO_BATCH and autotune may fill (the guides' 70-85 %); the rest is
    headroom for fragmentation and spikes."""
    max_memory_mb: int | None = knob(None, least=1)
    """Memory budget in MiB. On a GPU, a hard cap on this process's VRAM (share a card); on CPU, the process
    RSS
    find-batch and doctor measure against. Empty: the device's memory (on CPU, the RAM available at start)."""

    def __post_init__(self):
        check_fields(self)
        if self.offload_optimizer and self.sharding == "none":
            raise UsageError("OFFLOAD_OPTIMIZER=1 (--offload_optimizer) needs SHARDING=zero2 or zero3")
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device or ""):
            raise bad_value("device", "auto | cpu | mps | cuda | cuda:N", self.device)
        if self.target_vram > 1:
            raise bad_value("target_vram", "a fraction above 0 and at most 1 (e.g. 0.8)", self.target_vram)


@dataclass(kw_only=True)
class RunConfig:
    mode: str = knob("pretrain", "command", choices=MODES)
    """pretrain | sft | dpo | grpo."""
    output_dir: str = str(KIT_DIR / "runs")
    """Run folders go in OUTPUT_DIR/RUN_NAME; OUTPUT_DIR/latest points at the newest."""
    run_name: str | None = None
    """Name of this run's folder. Empty: the launcher's name and the time, always new."""
    overwrite: bool = False
    """Replace an existing run folder of the same RUN_NAME (refused otherwise)."""
    launcher: str = knob("train", "command")
    """Who started the run (the launcher script's name); used in default run names."""
    log_every: int | None = knob(None, "auto", least=1)
    """Optimizer steps between log lines. Reading the loss syncs host and device, so it is done only here,
    never per micro-step. Empty: every 10 steps, more often in short runs."""
    save_every: int = knob(500, least=0)
    """Optimizer steps between checkpoints in runs/<name>/checkpoints/ (0: only at the end and when stopped).
    Each holds weights, optimizer, GradScaler, RNG states and data position."""
    keep_checkpoints: int = knob(2, least=1)
    """Checkpoints kept: the newest N (an older one is deleted only once a newer one is complete)."""
    resume: bool = False
    """Continue runs/RUN_NAME (empty RUN_NAME: the newest run of this launcher) from its newest valid
    checkpoint; the same settings give the same losses as an uninterrupted run. The guides'
    --is_keep_training=True is accepted for it."""
    nan_patience: int = knob(5, least=0)
    """Stop after this many optimizer steps in a row with a non-finite loss, keeping the newest checkpoint
    from before them (0: never stop). fp16 steps the GradScaler skips are counted."""
    eval_every: int = knob(250, least=0)
    """Optimizer steps between validation passes; one always runs at the end. 0: only at the end. Each pass
    reads EVAL_BATCHES x 8 held-out sequences, forward only (about a third of training on them)."""
    eval_batches: int = knob(20, least=1)
    """Validation batches of 8 sequences per pass (read BATCH_SIZE at a time): the same sequences every pass
    and for any BATCH_SIZE, at most as many as a short run trains on. More gives a steadier number."""
    keep_best: bool = knob(False, modes=FINE_TUNING | FROM_SCRATCH)
    """Also save the model with the lowest validation loss so far in best/ (final/ is always the last
    model). Not GRPO's: its policy loss is not its measure (val_reward is)."""
    report_to: str = knob("none", choices=REPORT_TO)
    """none | tensorboard: also write the metrics rows and the summary as TensorBoard scalars in
    runs/<name>/tensorboard/ (`tensorboard --logdir runs`), as the transformers Trainer does."""
    dry_run: bool = False
    """Print the resolved settings, the derived numbers and a peak-memory estimate, then exit: no model on the
    device, no run folder (`make show-config`)."""

    def __post_init__(self):
        check_fields(self)
        if self.run_name is not None and not RUN_NAME_PATTERN.match(self.run_name):
            raise bad_value(
                "run_name", "letters, digits, '.', '_' or '-' (no spaces or slashes)", self.run_name
            )
        # a run folder there would stop runs/latest from ever moving again
        if (self.run_name or "").lower() == "latest":
            raise UsageError("RUN_NAME=latest: that name is the link to the newest run (OUTPUT_DIR/latest); "
                             "pick another")
        if self.resume and self.overwrite:
            raise UsageError("RESUME=1 and OVERWRITE=1 are both set: choose one (RESUME continues the run, "
                             "OVERWRITE replaces it)")
        if self.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
            raise UsageError("REPORT_TO=tensorboard: the tensorboard package is not installed (`make setup` "
                             "installs it); or set REPORT_TO=none")


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "system": SystemConfig,
    "run": RunConfig,
}


@dataclass(kw_only=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        registry.check_sharding(self.optim.optimizer, self.system.sharding)

    def effective_batch_size(self, world_size: int = 1) -> int:
        """Sequences per optimizer step: micro-batch x accumulation x processes."""
        return self.optim.batch_size * self.optim.gradient_accumulation_steps * world_size

    def tokens_per_step(self, max_length: int, world_size: int = 1) -> int:
        """Tokens per optimizer step at a given (resolved) sequence length."""
        return self.effective_batch_size(world_size) * max_length

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_flat(cls, values: dict) -> TrainConfig:
        """Build from a flat {field: value} dict (values already typed)."""
        if unknown := set(values) - set(FIELD_SECTION):
            raise UsageError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        return cls(**{sec: klass(**{n: v for n, v in values.items() if FIELD_SECTION[n] == sec})
                      for sec, klass in SECTIONS.items()})


FIELD_SECTION = {f.name: sec for sec, klass in SECTIONS.items() for f in fields(klass)}

# Named presets: the guides' numbers. Mixed precision stays opt-in (ENABLE_FP16 / ENABLE_BF16 /
# PRECISION=auto).
PRESETS: dict[str, dict] = {
    "baseline": dict(
        batch_size=8,
        gradient_accumulation_steps=1,
        precision="fp32",
        num_workers=0,
        dropout=0.0,
        compile=False,
    ),
    "optimized": dict(
        batch_size=32,
        gradient_accumulation_steps=4,
        num_workers=4,
        prefetch_factor=4,
        pin_memory=True,
        persistent_workers=True,
        tf32=True,
        dropout=0.0,
    ),
    # Fine-tuning: a lower peak LR than pretraining (6e-4) and no weight decay, as SFT recipes use. 1e-4 suits
    # the kit's own small models (GPT-2 class, briefly pretrained); for a well-trained 1B+ model,
    # LEARNING_RATE=2e-5.
    "sft": dict(
        batch_size=16,
        gradient_accumulation_steps=1,
        learning_rate=1e-4,
        weight_decay=0.0,
        num_workers=2,
        pin_memory=True,
        persistent_workers=True,
        tf32=True,
    ),
    # Preference training: TRL's DPO learning rate is 1e-6 for billion-parameter models; 5e-6 moves the kit's
    # small ones
    "dpo": dict(
        batch_size=8,
        learning_rate=5e-6,
        weight_decay=0.0,
        num_workers=2,
        pin_memory=True,
        tf32=True,
        dropout=0.0,
    ),
    # Reward training: BATCH_SIZE prompts x NUM_GENERATIONS rows; the kit's small models move at 1e-5 (TRL:
    # 1e-6)
    "grpo": dict(batch_size=4, learning_rate=1e-5, weight_decay=0.0, tf32=True, dropout=0.0),
}
MODE_DEFAULTS = {"dpo": dict(dpo_loss="sigmoid", beta=0.1, label_smoothing=0.0, simpo_gamma=0.5,
                             sft_weight=0.0),
                 "grpo": dict(beta=0.0, val_fraction=0.0)}  # TRL's (GRPOTrainer evaluates only if asked)


def resolve(preset: str | None, overrides: dict) -> TrainConfig:
    """Dataclass defaults < the mode's own (MODE_DEFAULTS: TRL's values of knobs a mode reads apart)
    < preset < explicit overrides (typed values)."""
    if preset is not None and preset not in PRESETS:
        raise UsageError(f"PRESET (--preset): expected {' | '.join(PRESETS)}, got {preset!r}")
    values: dict = {**MODE_DEFAULTS.get(overrides.get("mode", RunConfig.mode), {}), **PRESETS.get(preset, {})}
    # LR_SCALING's reference: the effective batch the preset (or the defaults) were tuned with.
    base = {
        "batch_size": OptimConfig.batch_size,
        "gradient_accumulation_steps": OptimConfig.gradient_accumulation_steps,
        **values,
    }
    values["lr_reference_batch"] = base["batch_size"] * base["gradient_accumulation_steps"]
    values.update(overrides)
    return TrainConfig.from_flat(values)
