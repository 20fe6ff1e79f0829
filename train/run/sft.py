"""`python -m train sft`: where an SFT run's model and data come from (SFTSource).

The plan is made by the same function as a pretraining run's (train/run/plan.py make_plan), with
the same decisions (EFFECTIVE_BATCH, LR_SCALING, the memory-adaptive settings ...), and the step
(train/core/step.py), the loop, the run folder and summary.json are shared: SFT differs only in
where the model and the batches come from. The model is MODEL_PATH (any local transformers
causal LM with its tokenizer, loaded offline); batches are conversations padded to their own
longest sample (train/data/sft_data.py), optionally grouped by length or sized by a token budget
(train/data/sft_batching.py), or packed several to a row (PACKING=1, train/data/packing.py),
with every process reading its own share of each epoch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from config import TrainConfig
from train.core import model as model_lib
from train.core.errors import UsageError
from train.core.remote_code import refuse_custom_code
from train.data.loader import make_loader, training_loader
from train.data.packing import FLASH, SDPA, Attention, PackedCollator, PackedRows, attention_for, pack
from train.data.sft_batching import BudgetSampler, GroupedSampler
from train.data.sft_data import (
    PadCollator,
    builtin_conversations,
    encode_conversations,
    ensure_special_tokens,
    load_conversations,
    stop_token_ids,
)
from train.run.evaluate import MAX_AUTO_FRACTION, VAL_ROWS, val_windows
from train.run.plan import Data, Plan, shortest_limit
from train.run.runlog import quiet_saving

MAKE_A_MODEL = "MODEL_SIZE=nano MAX_STEPS=200 ./run_single_gpu_optimized.sh"
SFT_ONLY = ("model_path", "trust_remote_code", "length_grouping", "token_budget", "packing", "skip_bad_records")


def refuse_sft_settings(cfg: TrainConfig) -> None:
    """Pretraining: an SFT-only knob that is set would be ignored, so say so and stop."""
    for name in SFT_ONLY:
        section = getattr(cfg, "model" if name in ("model_path", "trust_remote_code") else "data")
        if getattr(section, name) not in (None, False):
            raise UsageError(
                f"{name.upper()} (--{name}) is an SFT setting; use `python -m train sft` or ./train_sft_custom.sh"
            )


def newest_pretrained(output_dir: Path) -> Path | None:
    """final/ of the newest run under output_dir whose summary.json says mode "pretrain".
    runs/latest is no help here: it may point at an SFT run."""
    best, best_time = None, -math.inf
    for run in output_dir.iterdir() if output_dir.is_dir() else ():
        summary, final = run / "summary.json", run / "final"
        if run.is_symlink() or not summary.is_file() or not (final / "config.json").is_file():
            continue
        try:
            mode = json.loads(summary.read_text()).get("mode")
        except (OSError, ValueError, AttributeError):
            continue  # a half-written or foreign file: not a run to start from
        if mode == "pretrain" and summary.stat().st_mtime > best_time:
            best, best_time = final, summary.stat().st_mtime
    return best


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_pretrained(path: Path, tokenizer_path: str | None, trust_remote_code: bool):
    """(model, tokenizer) from local folders only; every failure is one UsageError line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    hint = (
        "" if trust_remote_code else " (if it ships its own model code and you trust it: TRUST_REMOTE_CODE=1)"
    )
    tok_source = tokenizer_path or path
    var = "TOKENIZER_PATH" if tokenizer_path else "MODEL_PATH"
    for folder, name in ((tok_source, var), (path, "MODEL_PATH")):
        refuse_custom_code(folder, name, trust_remote_code, allow="TRUST_REMOTE_CODE=1 lets it run")
    try:
        tok = AutoTokenizer.from_pretrained(tok_source, **offline)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError... for a bad folder
        raise UsageError(
            f"{var}={tok_source}: no tokenizer could be loaded: {_first_line(err)}{hint}"
        ) from None
    # float32 weights whatever the checkpoint's dtype (transformers 5 loads "auto"): AdamW on
    # bf16 weights loses small updates; mixed precision is autocast's job (ENABLE_BF16/FP16).
    load = partial(AutoModelForCausalLM.from_pretrained, path, dtype=torch.float32, **offline)
    try:
        with quiet_saving():  # no "Loading weights" bar on every run: the load takes a moment
            try:
                model = load(attn_implementation="sdpa")
            except ValueError as err:
                if "sdpa" not in str(err).lower():
                    raise
                model = load()  # an architecture without sdpa support
    except Exception as err:
        raise UsageError(
            f"MODEL_PATH={path}: not a causal-LM model folder: {_first_line(err)}{hint}"
        ) from None
    return model, tok


class SFTDataset(Dataset):
    """Encoded examples in memory ({"input_ids", "labels"} lists); lengths for the samplers."""

    def __init__(self, examples: list[dict]):
        self.examples = examples
        self.lengths = [len(e["input_ids"]) for e in examples]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]


def sft_loader(b: Plan, batch_size: int, collate: PadCollator):
    """(DataLoader, sampler) for Plan.make_loader: the loop's knobs (workers, prefetch, pinned
    memory) with one of three batchings: by token budget, length-grouped, or plain shuffled.
    Every rank builds the same epoch order (same seed) and reads its own share of it."""
    d, device, seed = b.cfg.data, b.device, b.cfg.system.seed
    share = dict(rank=b.world.rank, world_size=b.world.world_size)
    if d.token_budget is not None:
        sampler = BudgetSampler(b.dataset.lengths, d.token_budget, seed=seed, **share)
        return training_loader(b.dataset, d, device, collate, batch_sampler=sampler), sampler
    if d.length_grouping and not d.packing:
        sampler = GroupedSampler(b.dataset.lengths, batch_size, seed=seed, **share)
        return training_loader(b.dataset, d, device, collate, batch_size=batch_size, sampler=sampler), sampler
    return make_loader(b.dataset, d, batch_size, seed, device, collate_fn=collate, **share)


def plan_sft_steps(
    cfg: TrainConfig, n: int, micro_per_epoch: int, rows_per_micro: float, world_size: int = 1
) -> tuple[int, str]:
    """Optimizer steps: the smallest of MAX_STEPS, EPOCHS and MAX_SAMPLES (default one epoch).
    micro_per_epoch and rows_per_micro are per rank; a step takes one from every rank."""
    o = cfg.optim
    unit = "packed rows" if cfg.data.packing else "conversations"
    accum = o.gradient_accumulation_steps
    per_epoch = micro_per_epoch // accum
    processes = f" on each of {world_size} processes" if world_size > 1 else ""
    if per_epoch == 0:
        raise UsageError(
            f"DATA_PATH: {n} {unit} make {micro_per_epoch} micro-batches{processes}, fewer than one "
            f"optimizer step needs (GRADIENT_ACCUM={accum}); add data or lower BATCH_SIZE / GRADIENT_ACCUM"
        )
    per_step = rows_per_micro * accum * world_size
    steps, source = shortest_limit(cfg, per_epoch, per_step)
    why = f"{source}; one epoch is {per_epoch} steps of ~{per_step:.0f} {unit}"
    if world_size > 1:
        why += f" ({world_size} processes, each reading its own 1/{world_size} of every epoch)"
    return steps, why


def _model_label(path: Path, model) -> str:
    """summary.json's model_size: the source run's size where MODEL_PATH is a kit run's final/."""
    try:
        return str(json.loads((path.parent / "summary.json").read_text())["model_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return model.config.model_type


def prepare_model(model, tok, gradient_checkpointing: bool, decide) -> None:
    """Chat-template tokens in the tokenizer and the embeddings, stop tokens, training mode."""
    added = ensure_special_tokens(tok)
    rows = model.get_input_embeddings().num_embeddings
    if len(tok) > rows:
        from transformers.utils import logging as hf_logging

        # transformers explains its mean resizing in a paragraph with a link on every run; the
        # decision below says it once, in the kit's words.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
        finally:
            hf_logging.set_verbosity(verbosity)
        decide(
            "vocab_size",
            model.get_input_embeddings().num_embeddings,
            f"resized embeddings {rows} -> {model.get_input_embeddings().num_embeddings} for {added} chat-template "
            "token(s) (a multiple of 64; new rows drawn around the mean of the old)",
        )
    # Saved with final/: a plain model.generate() then stops at the end of the assistant's turn.
    model.generation_config.eos_token_id = stop_token_ids(tok)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.config.use_cache = False  # the KV cache only costs memory in training
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"  # as pretraining sets it; left unset, transformers warns each run
    if gradient_checkpointing:
        model_lib.enable_checkpointing(model)
    model.train()  # from_pretrained returns the model in eval mode (dropout off)


def load_dataset(cfg: TrainConfig, tok, max_length: int, say) -> tuple[SFTDataset, str, int, int]:
    """DATA_PATH (or the built-in set) -> encoded examples; says the format and every count."""
    skipped = 0
    if cfg.data.data_path is None:
        conversations = builtin_conversations()
        fmt = "built-in (standard-library functions: signature and docstring -> body)"
    else:
        conversations, fmt, skipped = load_conversations(Path(cfg.data.data_path), cfg.data.skip_bad_records)
    source = cfg.data.data_path or "built-in"
    say(f"SFT data: {source}, format {fmt}, {len(conversations)} conversations")
    if skipped:
        say(f"skipped {skipped} bad record(s) (SKIP_BAD_RECORDS=1); the rest train")
    examples, truncated = encode_conversations(conversations, tok, max_length)
    if truncated:
        say(
            f"truncated {truncated} of {len(examples)} conversations longer than MAX_LENGTH={max_length} tokens"
        )
    return SFTDataset(examples), fmt, skipped, truncated


class SFTSource:
    """SFT: the model and tokenizer of MODEL_PATH (or the newest pretraining run's final/), and
    conversations from DATA_PATH (or the built-in pairs), padded, grouped, budgeted or packed."""

    def refuse(self, cfg: TrainConfig) -> None:
        if cfg.model.model_config is not None:
            raise UsageError("MODEL_CONFIG builds a new model for pretraining; SFT starts from MODEL_PATH")

    def model(self, cfg: TrainConfig, device: torch.device, say, decide) -> tuple[str, int, bool]:
        """(model size, context length, CPU demo: never) of the loaded model."""
        if cfg.model.model_size is not None:
            say(f"MODEL_SIZE={cfg.model.model_size} is ignored: SFT fine-tunes MODEL_PATH at its own size")
        self.path = Path(model_source(cfg, decide))
        self.model, self.tok = load_pretrained(self.path, cfg.data.tokenizer_path, cfg.model.trust_remote_code)
        prepare_model(self.model, self.tok, cfg.model.gradient_checkpointing, decide)
        return _model_label(self.path, self.model), model_lib.context_length(self.model.config), False

    def data(self, cfg: TrainConfig, device: torch.device, precision: str, max_length: int, say, decide) -> Data:
        """The encoded conversations, the held-out ones, and how to batch them."""
        tok = self.tok
        dataset, fmt, skipped, truncated = load_dataset(cfg, tok, max_length, say)
        n_loaded = len(dataset)
        val_dataset = split_validation(cfg, dataset, tok, max_length, say, decide)
        if val_dataset is not None and cfg.data.val_path is None:
            dataset = SFTDataset(dataset.examples[: len(dataset) - len(val_dataset)])
        self.conversations = dataset
        # Multiples of 8 suit tensor cores; elsewhere every pad token is pure waste.
        multiple = 8 if device.type == "cuda" else 1
        train_set, collate = dataset, PadCollator(tok.pad_token_id, pad_to_multiple_of=multiple)
        packed = {}
        if cfg.data.packing:
            train_set, collate, packed = pack_conversations(
                cfg, dataset, self.model, tok, device, precision, max_length, decide
            )
        summary = {
            "model_path": str(self.path),
            "data_format": fmt,
            "n_conversations": n_loaded,
            "n_val_conversations": len(val_dataset) if val_dataset is not None else 0,
            "n_truncated": truncated,
            "n_skipped": skipped,
            "length_grouping": cfg.data.length_grouping,
            "token_budget": cfg.data.token_budget,
            "packing": cfg.data.packing,
        }
        return Data(
            tokenizer=tok, dataset=train_set, val_dataset=val_dataset, make_loader=partial(sft_loader, collate=collate),
            val_collate=PadCollator(tok.pad_token_id, pad_to_multiple_of=multiple), summary={**summary, **packed},
        )

    def steps(self, cfg: TrainConfig, data: Data, world_size: int, say, decide) -> tuple[int, str]:
        """Optimizer steps; with TOKEN_BUDGET the epoch's mean rows stand for BATCH_SIZE in summary.json."""
        total_steps, why, rows_per_micro = sft_steps(cfg, data.dataset, world_size, say, decide)
        if cfg.data.token_budget is not None:  # batch sizes vary: report the epoch's mean, not BATCH_SIZE
            effective = rows_per_micro * cfg.optim.gradient_accumulation_steps * world_size
            data.summary.update(batch_size=round(rows_per_micro, 2), effective_batch_size=round(effective, 2))
        lengths = np.asarray(self.conversations.lengths)
        say(f"conversation lengths in tokens: median {int(np.median(lengths))}, max {int(lengths.max())}")
        return total_steps, why

    def finish_model(self, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
        return self.model.to(device)


def pack_conversations(cfg: TrainConfig, dataset, model, tok, device, precision: str, max_length: int, decide):
    """PACKING=1: the conversations packed best-fit decreasing into rows of MAX_LENGTH tokens
    (train/data/packing.py), the collator that keeps them apart in attention, and the figures
    for summary.json. Returns (rows dataset, collator, summary entries)."""
    if cfg.data.length_grouping:
        cfg.data.length_grouping = False
        decide("length_grouping", 0, "PACKING=1 groups conversations by length itself")
    packing = pack(dataset.lengths, max_length)
    rows = PackedRows(dataset.examples, packing.rows)
    decide(
        "packing",
        f"{len(rows)} rows",
        f"{len(dataset)} conversations best-fit into rows of MAX_LENGTH={max_length}: {packing.efficiency:.1%} of "
        "the row tokens are real; BATCH_SIZE counts rows",
    )
    attention = attention_for(device, precision)
    if attention.kind == FLASH:
        try:
            model.set_attn_implementation(FLASH)
        except Exception as err:  # no flash support for this architecture: the masked path
            attention = Attention(SDPA, f"packed attention: sdpa with a block-diagonal causal mask ({err})")
    decide("attention", attention.kind, attention.why)
    multiple = 8 if device.type == "cuda" else 1
    collate = PackedCollator(tok.pad_token_id, attention=attention.kind, pad_to_multiple_of=multiple)
    packed = {"packed_rows": len(rows), "packing_efficiency": packing.efficiency, "attention": attention.kind}
    return rows, collate, packed


def model_source(cfg: TrainConfig, decide) -> str:
    """MODEL_PATH, or the newest pretraining run's final/ under OUTPUT_DIR."""
    if cfg.model.model_path is not None:
        return cfg.model.model_path
    found = newest_pretrained(Path(cfg.run.output_dir))
    if found is None:
        raise UsageError(
            f"MODEL_PATH is empty and {cfg.run.output_dir} holds no pretraining run with final/; "
            f"make one with `{MAKE_A_MODEL}` or set MODEL_PATH to a local transformers model folder"
        )
    decide("model_path", str(found), "the newest pretraining run's final/ (set MODEL_PATH to choose)")
    return str(found)


def sft_steps(cfg: TrainConfig, dataset, world_size: int, say, decide) -> tuple[int, str, float]:
    """(optimizer steps, why, rows per micro-batch): BATCH_SIZE rows, or TOKEN_BUDGET's mean."""
    if cfg.data.token_budget is not None:
        batches = BudgetSampler(dataset.lengths, cfg.data.token_budget, seed=cfg.system.seed).batches()
        micro, rows_per_micro = len(batches) // world_size, len(dataset) / max(1, len(batches))
        decide(
            "batch_size",
            f"~{rows_per_micro:.1f}",
            f"TOKEN_BUDGET={cfg.data.token_budget} padded tokens per micro-batch; BATCH_SIZE unused",
        )
        if cfg.data.length_grouping:
            say("LENGTH_GROUPING=1 adds nothing with TOKEN_BUDGET, which groups by length itself")
    else:  # every rank reads 1/world_size of the epoch
        micro, rows_per_micro = len(dataset) // world_size // cfg.optim.batch_size, float(cfg.optim.batch_size)
    total_steps, why = plan_sft_steps(cfg, len(dataset), micro, rows_per_micro, world_size)
    return total_steps, why, rows_per_micro


def split_validation(cfg: TrainConfig, dataset: SFTDataset, tok, max_length: int, say, decide):
    """Held-out conversations: VAL_PATH (same formats as DATA_PATH), or the last VAL_FRACTION of
    the data (never trained on). None when VAL_FRACTION is 0."""
    if cfg.data.val_path is not None:
        val_cfg = copy.copy(cfg)
        val_cfg.data = dataclasses.replace(cfg.data, data_path=cfg.data.val_path)
        val, *_ = load_dataset(val_cfg, tok, max_length, say)
        decide("validation", f"{len(val)} conversations", f"VAL_PATH={cfg.data.val_path}")
        return val
    want = cfg.run.eval_batches * VAL_ROWS
    n_val = val_windows(len(dataset), cfg.data.val_fraction, want)
    if n_val == 0:
        return None
    asked = math.ceil(cfg.data.val_fraction * len(dataset))
    if n_val > asked:  # a small set: a handful of conversations gives a noisy validation loss
        decide(
            "val_fraction",
            round(n_val / len(dataset), 4),
            f"VAL_FRACTION={cfg.data.val_fraction:g} holds out {asked} of {len(dataset)} conversations; raised "
            f"towards EVAL_BATCHES x {VAL_ROWS} = {want}, at most {MAX_AUTO_FRACTION:.0%} of the data",
        )
    decide(
        "validation",
        f"{n_val} conversations",
        f"the last {n_val / len(dataset):.1%} of the data (VAL_FRACTION)",
    )
    return SFTDataset(dataset.examples[len(dataset) - n_val :])
