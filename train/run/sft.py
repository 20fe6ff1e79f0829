"""`python -m train sft`: where an SFT run's model and data come from (SFTSource).

The plan is made by the same function as a pretraining run's (train/run/plan.py make_plan), with
the same decisions (EFFECTIVE_BATCH, LR_SCALING, the memory-adaptive settings ...), and the step
(train/core/step.py), the loop, the run folder and summary.json are shared: SFT differs only in
where the model and the batches come from. The model is MODEL_PATH (any local transformers
causal LM or encoder-decoder with its tokenizer, loaded offline: train/run/sft_model.py);
batches are conversations padded to their own longest sample (train/data/sft_data.py), or for
an encoder-decoder (source, target) pairs, each side padded to its own longest; optionally
grouped by length or sized by a token budget (train/data/sft_batching.py), or packed several to
a row (PACKING=1, causal only: train/data/packing.py), with every process reading its own share
of each epoch.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from config import TrainConfig
from train.config import knobs
from train.core import model as model_lib
from train.core.errors import UsageError
from train.core.units import cpu_cores
from train.data.loader import make_loader, training_loader
from train.data.packing import FLASH, SDPA, Attention, PackedCollator, PackedRows, attention_for, pack
from train.data.sft_batching import BudgetSampler, GroupedSampler, Seq2SeqCollator
from train.data.sft_cache import sft_cache
from train.data.sft_data import PadCollator, builtin_conversations
from train.run.evaluate import MAX_AUTO_FRACTION, VAL_ROWS, val_windows
from train.run.plan import Data, Plan, shortest_limit
from train.run.sft_model import (  # noqa: F401 (newest_pretrained: the tests' and tools' name for it)
    load_pretrained,
    model_kind_of,
    model_label,
    model_source,
    newest_pretrained,
    prepare_model,
)

SFT_ONLY = knobs.marked("sft")  # config.py's fields marked "sft"


def refuse_sft_settings(cfg: TrainConfig) -> None:
    """Pretraining: an SFT-only knob that is set would be ignored, so say so and stop."""
    for name in SFT_ONLY:
        if knobs.value(cfg, name) not in (None, False):
            raise UsageError(
                f"{knobs.env_name(name)} (--{name}) is an SFT setting; use `python -m train sft` or ./train_sft_custom.sh"
            )


def unit_of(pairs: bool) -> str:
    """What one example is, for the log."""
    return "source -> target pairs" if pairs else "conversations"


class SFTDataset(Dataset):
    """Encoded examples ({"input_ids", "labels"}): the SFT cache's memory-mapped view
    (train/data/sft_cache.py), or a list in memory; lengths (a numpy array) for the samplers.
    pairs (encoder-decoder: labels are the target): lengths are source + target, and
    source_lengths the sources (None for conversations)."""

    def __init__(self, examples, pairs: bool = False):
        self.examples, self.pairs = examples, pairs
        lengths, sources = getattr(examples, "lengths", None), getattr(examples, "source_lengths", None)
        if lengths is None:
            lengths = [len(e["input_ids"]) + (len(e["labels"]) if pairs else 0) for e in examples]
            sources = [len(e["input_ids"]) for e in examples] if pairs else None
        self.lengths = np.asarray(lengths)
        self.source_lengths = None if sources is None else np.asarray(sources)

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
        sampler = BudgetSampler(b.dataset.lengths, d.token_budget, seed=seed, source_lengths=getattr(b.dataset, "source_lengths", None),
                                **share)
        return training_loader(b.dataset, d, device, collate, batch_sampler=sampler), sampler
    if d.length_grouping and not d.packing:
        sampler = GroupedSampler(b.dataset.lengths, batch_size, seed=seed, **share)
        return training_loader(b.dataset, d, device, collate, batch_size=batch_size, sampler=sampler), sampler
    return make_loader(b.dataset, d, batch_size, seed, device, collate_fn=collate, **share)


def plan_sft_steps(
    cfg: TrainConfig, n: int, micro_per_epoch: int, rows_per_micro: float, world_size: int = 1,
    unit: str = "conversations",
) -> tuple[int, str]:
    """Optimizer steps: the smallest of MAX_STEPS, EPOCHS and MAX_SAMPLES (default one epoch).
    micro_per_epoch and rows_per_micro are per rank; a step takes one from every rank."""
    o = cfg.optim
    unit = "packed rows" if cfg.data.packing else unit
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


def tokenize_workers(cfg: TrainConfig) -> int:
    """TOKENIZE_WORKERS, or every core this process may run on."""
    if cfg.data.tokenize_workers is not None:
        return cfg.data.tokenize_workers
    return cpu_cores()


def load_dataset(cfg: TrainConfig, tok, max_length: int, say, kind: str = "causal") -> tuple[SFTDataset, str, int, int]:
    """DATA_PATH (or the built-in set) -> encoded examples, through the SFT cache (tokenized
    once per data, tokenizer, template, MAX_LENGTH and model kind); says the format and every count."""
    builtin = None
    if cfg.data.data_path is None:
        builtin = builtin_conversations()
    examples, done = sft_cache(cfg.data.data_path, builtin, tok, max_length, cfg.data.skip_bad_records,
                               Path(cfg.data.cache_dir), tokenize_workers(cfg), say, kind)
    meta, pairs = examples.meta, kind == "seq2seq"
    fmt = meta.format if builtin is None else "built-in (standard-library functions: signature and docstring -> body)"
    unit = unit_of(pairs)
    how = " (one per assistant turn: the turns before it are its source)" if pairs else ""
    say(f"SFT data: {cfg.data.data_path or 'built-in'}, format {fmt}, {len(examples)} {unit}{how}; {done}")
    if meta.n_skipped:
        say(f"skipped {meta.n_skipped} bad record(s) (SKIP_BAD_RECORDS=1); the rest train; the first: {meta.first_error}")
    if meta.n_truncated:
        sides = (" on a side (a source keeps its end, the turns the reply answers; a target its start)"
                 if pairs else "")
        say(f"truncated {meta.n_truncated} of {len(examples)} {unit} longer than MAX_LENGTH={max_length} tokens{sides}")
    return SFTDataset(examples, pairs), fmt, meta.n_skipped, meta.n_truncated


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
        if cfg.model.model_family != "gpt2":
            say(f"MODEL_FAMILY={cfg.model.model_family} is ignored: SFT fine-tunes MODEL_PATH, whose config.json decides")
        self.path = Path(model_source(cfg, decide))
        self.kind = model_kind_of(self.path, cfg.model.trust_remote_code) or "causal"
        if self.kind == "seq2seq":
            if cfg.data.packing:  # before the weights or any data are read
                raise UsageError(
                    f"PACKING=1: MODEL_PATH={self.path} is an encoder-decoder, and packing several source -> target "
                    "pairs per row (per-pair attention masks on both sides) is not built; use LENGTH_GROUPING=1 or "
                    "TOKEN_BUDGET"
                )
            decide("model_kind", "seq2seq", "an encoder-decoder (AutoModelForSeq2SeqLM): trains on source -> target "
                   "pairs, one per assistant turn, loss on the target")
        self.model, self.tok = load_pretrained(self.path, cfg.data.tokenizer_path, cfg.model.trust_remote_code,
                                               self.kind)
        prepare_model(self.model, self.tok, cfg.model.gradient_checkpointing, decide)
        return model_label(self.path, self.model), model_lib.context_length(self.model.config), False

    def data(self, cfg: TrainConfig, device: torch.device, precision: str, max_length: int, say, decide) -> Data:
        """The encoded conversations, the held-out ones, and how to batch them."""
        tok = self.tok
        dataset, fmt, skipped, truncated = load_dataset(cfg, tok, max_length, say, self.kind)
        n_loaded = len(dataset)
        val_dataset = split_validation(cfg, dataset, tok, max_length, say, decide, self.kind)
        if val_dataset is not None and cfg.data.val_path is None:
            dataset = SFTDataset(dataset.examples[: len(dataset) - len(val_dataset)], dataset.pairs)
        self.conversations = dataset
        # Multiples of 8 suit tensor cores; elsewhere every pad token is pure waste.
        multiple = 8 if device.type == "cuda" else 1
        collator = Seq2SeqCollator if dataset.pairs else PadCollator
        train_set, collate = dataset, collator(tok.pad_token_id, pad_to_multiple_of=multiple)
        packed = {}
        if cfg.data.packing:
            train_set, collate, packed = pack_conversations(
                cfg, dataset, self.model, tok, device, precision, max_length, decide
            )
        summary = {
            "model_path": str(self.path),
            "data_format": fmt,
            "model_kind": self.kind,
            "n_conversations": n_loaded,  # source -> target pairs for an encoder-decoder
            "n_val_conversations": len(val_dataset) if val_dataset is not None else 0,
            "n_truncated": truncated,
            "n_skipped": skipped,
            "length_grouping": cfg.data.length_grouping,
            "token_budget": cfg.data.token_budget,
            "packing": cfg.data.packing,
        }
        return Data(
            tokenizer=tok, dataset=train_set, val_dataset=val_dataset, make_loader=partial(sft_loader, collate=collate),
            val_collate=collator(tok.pad_token_id, pad_to_multiple_of=multiple), summary={**summary, **packed},
        )

    def steps(self, cfg: TrainConfig, data: Data, world_size: int, say, decide) -> tuple[int, str]:
        """Optimizer steps; with TOKEN_BUDGET the epoch's mean rows stand for BATCH_SIZE in summary.json."""
        total_steps, why, rows_per_micro = sft_steps(cfg, data.dataset, world_size, say, decide)
        if cfg.data.token_budget is not None:  # batch sizes vary: report the epoch's mean, not BATCH_SIZE
            effective = rows_per_micro * cfg.optim.gradient_accumulation_steps * world_size
            data.summary.update(batch_size=round(rows_per_micro, 2), effective_batch_size=round(effective, 2))
        lengths, sources = self.conversations.lengths, self.conversations.source_lengths
        sides = {"conversation": lengths} if sources is None else {"source": sources, "target": lengths - sources}
        say("; ".join(f"{side} lengths in tokens: median {int(np.median(v))}, max {int(v.max())}"
                      for side, v in sides.items()))
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


def sft_steps(cfg: TrainConfig, dataset, world_size: int, say, decide) -> tuple[int, str, float]:
    """(optimizer steps, why, rows per micro-batch): BATCH_SIZE rows, or TOKEN_BUDGET's mean."""
    if cfg.data.token_budget is not None:
        batches = BudgetSampler(dataset.lengths, cfg.data.token_budget, seed=cfg.system.seed,
                                source_lengths=getattr(dataset, "source_lengths", None)).batches()
        micro, rows_per_micro = len(batches) // world_size, len(dataset) / max(1, len(batches))
        decide(
            "batch_size",
            f"~{rows_per_micro:.1f}",
            f"TOKEN_BUDGET={cfg.data.token_budget} padded tokens per micro-batch"
            f"{' (rows x (longest source + longest target))' if dataset.pairs else ''}; BATCH_SIZE unused",
        )
        if cfg.data.length_grouping:
            say("LENGTH_GROUPING=1 adds nothing with TOKEN_BUDGET, which groups by length itself")
    else:  # every rank reads 1/world_size of the epoch
        micro, rows_per_micro = len(dataset) // world_size // cfg.optim.batch_size, float(cfg.optim.batch_size)
    pairs = getattr(dataset, "pairs", False)  # PackedRows: causal conversations
    total_steps, why = plan_sft_steps(cfg, len(dataset), micro, rows_per_micro, world_size, unit_of(pairs))
    return total_steps, why, rows_per_micro


def split_validation(cfg: TrainConfig, dataset: SFTDataset, tok, max_length: int, say, decide, kind: str = "causal"):
    """Held-out conversations: VAL_PATH (same formats as DATA_PATH), or the last VAL_FRACTION of
    the data (never trained on). None when VAL_FRACTION is 0."""
    if cfg.data.val_path is not None:
        val_cfg = copy.copy(cfg)
        val_cfg.data = dataclasses.replace(cfg.data, data_path=cfg.data.val_path)
        val, *_ = load_dataset(val_cfg, tok, max_length, say, kind)
        decide("validation", f"{len(val)} {unit_of(val.pairs)}", f"VAL_PATH={cfg.data.val_path}")
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
            f"VAL_FRACTION={cfg.data.val_fraction:g} holds out {asked} of {len(dataset)} {unit_of(dataset.pairs)}; raised "
            f"towards EVAL_BATCHES x {VAL_ROWS} = {want}, at most {MAX_AUTO_FRACTION:.0%} of the data",
        )
    decide(
        "validation",
        f"{n_val} {unit_of(dataset.pairs)}",
        f"the last {n_val / len(dataset):.1%} of the data (VAL_FRACTION)",
    )
    return SFTDataset(dataset.examples[len(dataset) - n_val :], dataset.pairs)
