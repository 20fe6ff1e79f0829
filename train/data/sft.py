"""SFT's front door: DATA_PATH (or the built-in pairs) -> the SFT cache (tokenized once) ->
encoded conversations (SFTDataset) -> the held-out split (VAL_FRACTION or VAL_PATH) -> PACKING's
rows, returned as Data (train/val datasets and their collators) for the one loader factory, which
batches them padded, length-grouped or by token budget. For an encoder-decoder an example is a
(source, target) pair. Takes the data config, the tokenizer and plain values, never the Plan or
the model (packing asks for the model's attention switch alone); imports train/core and
train/data only, never the root config.py."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from train.core.errors import UsageError
from train.core.units import cpu_cores
from train.data import records
from train.data.chat.batching import Seq2SeqCollator, bucket_lengths
from train.data.chat.cache import sft_cache
from train.data.chat.encode import PadCollator, Rendering, builtin_conversations
from train.data.chat.formats import converted, open_records
from train.data.chat.packing import (
    FLASH,
    SDPA,
    VARLEN,
    Attention,
    PackedCollator,
    PackedRows,
    attention_for,
    pack,
)
from train.data.chat.template_table import TEMPLATE
from train.data.chat.templates import has_generation_markers
from train.data.holdout import held_out_tail
from train.data.json_lines import record_limit
from train.data.loader import Data
from train.data.text import language_note


def fine_tuning_data(d, tok, *, kind: str, max_length: int, device, precision: str, eval_batches: int,
                     set_attention, say, decide, compile_on: bool = False) -> Data:
    """The encoded conversations of data config `d` (or pairs, kind "seq2seq"), the held-out ones,
    and their collators. PACKING=1 packs them into rows (and lowers LENGTH_GROUPING in `d`);
    compile_on (COMPILE=1) or a CUDA device pads batches to length buckets (a decision)."""
    template_decision(d, tok, kind, say, decide)
    with record_limit(d.max_record_mb):
        if d.data_path is not None:
            language_note(tok, first_texts(d), say)
        dataset, fmt, skipped, truncated = load_dataset(d, tok, max_length, say, kind)
    if fmt.partition(":")[0] == "text" and d.template is None and tok.chat_template is not None:
        tok.chat_template = None  # plain documents: final/ is a text model, and generate continues a prompt
        decide("template", "none (plain text)", "every record is plain text (TEXT_FIELD): final/ saves no chat "
               "template, so generate continues a prompt as the model trained")
    n_loaded = len(dataset)
    val_dataset = split_validation(d, eval_batches, dataset, tok, max_length, say, decide, kind)
    if val_dataset is not None and d.val_path is None:
        dataset = SFTDataset(dataset.examples[: len(dataset) - len(val_dataset)], dataset.pairs)
    # Multiples of 8 suit tensor cores; elsewhere every pad token is pure waste.
    multiple = 8 if device.type == "cuda" else 1
    collator = Seq2SeqCollator if dataset.pairs else PadCollator
    train_set, collate = dataset, collator(tok.pad_token_id, pad_to_multiple_of=multiple)
    packed = {}
    if d.packing:
        train_set, collate, packed = pack_conversations(d, dataset, set_attention, tok, device, precision, max_length,
                                                        decide)
    summary = {
        "data_format": fmt,
        "model_kind": kind,
        "n_conversations": n_loaded,  # source -> target pairs for an encoder-decoder
        "n_val_conversations": len(val_dataset) if val_dataset is not None else 0,
        "n_truncated": truncated,
        "n_skipped": skipped,
        "length_grouping": d.length_grouping,
        "token_budget": d.token_budget,
        "packing": bool(d.packing),  # empty (None) is 0 in SFT
    }
    val_collate = collator(tok.pad_token_id, pad_to_multiple_of=multiple)
    bucket_lengths(compile_on, device, max_length, collate, val_collate, dataset.pairs, decide)
    return Data(
        tokenizer=tok, dataset=train_set, val_dataset=val_dataset, collate=collate, val_collate=val_collate,
        summary={**summary, **packed}, conversations=dataset,
    )


def template_decision(d, tok, kind: str, say, decide) -> None:
    """TEMPLATE as the run renders it (a decision where it was left empty), LOSS_ON=all refused for an
    encoder-decoder, TEMPLATE=none's Jinja twin on a causal LM's tokenizer (saved with final/), and a note
    where the template saved with final/ has no {% generation %} markers."""
    if kind == "seq2seq" and d.loss_on == "all":
        raise UsageError("LOSS_ON=all: an encoder-decoder trains its target only (the source is read, not "
                         "predicted); leave LOSS_ON empty")
    mode = Rendering.of(d).mode(tok)
    entry = TEMPLATE[mode]
    if entry.final is not None and kind == "causal":  # final/ then prompts as trained (none: the raw source + eos)
        tok.chat_template = entry.final(tok)
    if not d.template:
        decide("template", mode, f"TEMPLATE empty: {entry.why}")
    if entry.own_markup and not has_generation_markers(tok.chat_template):
        say("note: the chat template saved with final/ has no {% generation %} markers, so transformers' "
            "return_assistant_tokens_mask and TRL's assistant_only_loss cannot use it (TEMPLATE=builtin has them)")


def first_texts(d, records_read: int = 256):
    """The turns' texts of DATA_PATH's first records (for the tokenizer's note); nothing from a .json
    list over 64 MB, which is read whole. A bad record before the first good one stops here as the
    SFT cache would next (SKIP_BAD_RECORDS=0), not read past for a note."""
    sources = records.source_files(d.data_path)
    if records.suffix_of(sources[0]) == ".json" and sources[0].stat().st_size > 64 << 20:
        return iter(())
    fmt, items = open_records(d.data_path, d.text_field, d.skip_bad_records)
    good, _ = converted(itertools.islice(items, records_read), fmt)
    return (turn["content"] for conversation in good for turn in conversation if turn.get("content"))


def unit_of(pairs: bool) -> str:
    """What one example is, for the log."""
    return "source -> target pairs" if pairs else "conversations"


class SFTDataset(Dataset):
    """Encoded examples ({"input_ids", "labels"}): the SFT cache's memory-mapped view
    (train/data/chat/cache.py), or a list in memory; lengths (a numpy array) for the samplers.
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


def tokenize_workers(d) -> int:
    """TOKENIZE_WORKERS, or every core this process may run on."""
    if d.tokenize_workers is not None:
        return d.tokenize_workers
    return cpu_cores()


def load_dataset(d, tok, max_length: int, say, kind: str = "causal") -> tuple[SFTDataset, str, int, int]:
    """DATA_PATH (or the built-in set) -> encoded examples, through the SFT cache (tokenized
    once per data, tokenizer, template, MAX_LENGTH and model kind); says the format and every count."""
    builtin = None
    if d.data_path is None:
        builtin = builtin_conversations()
    examples, done = sft_cache(d.data_path, builtin, tok, max_length, d.skip_bad_records,
                               Path(d.cache_dir), tokenize_workers(d), say, kind, Rendering.of(d), d.text_field)
    meta, pairs = examples.meta, kind == "seq2seq"
    fmt = meta.format if builtin is None else "built-in (standard-library functions: signature and docstring -> body)"
    unit = unit_of(pairs)
    how = " (one per assistant turn: the turns before it are its source)" if pairs else ""
    say(f"SFT data: {d.data_path or 'built-in'}, format {fmt}, {len(examples)} {unit}{how}; {done}")
    if meta.n_skipped:
        say(f"skipped {meta.n_skipped} bad record(s) (SKIP_BAD_RECORDS=1); the rest train; the first: {meta.first_error}")
    if meta.n_unfit > len(examples):  # only under SKIP_BAD_RECORDS=1 (sft_cache refuses it otherwise): said loudly
        total = meta.n_unfit + len(examples)
        say(f"warning: SKIP_BAD_RECORDS=1: skipped {meta.n_unfit} of {total} records ({meta.n_unfit / total:.0%}) that "
            f"cannot fit this model at MAX_LENGTH={max_length}; only the {len(examples)} that fit train (a longer "
            f"MAX_LENGTH, a model of a longer context, or shorter records keep them); the first: {meta.first_unfit}")
    elif meta.n_unfit:
        say(f"warning: skipped {meta.n_unfit} record(s) that cannot fit this model at MAX_LENGTH={max_length} (not bad "
            f"input: the rest train); the first: {meta.first_unfit}")
    if meta.n_truncated:
        sides = (" on a side (a source keeps its end, the turns the reply answers; a target its start and eos)"
                 if pairs else "")
        say(f"truncated {meta.n_truncated} of {len(examples)} {unit} longer than MAX_LENGTH={max_length} tokens{sides}")
    if meta.n_tools_kept:
        say(f"{meta.n_tools_kept} of them have a tools list: it was kept with the system turn, and the history cut")
    return SFTDataset(examples, pairs), fmt, meta.n_skipped, meta.n_truncated


def pack_conversations(d, dataset, set_attention, tok, device, precision: str, max_length: int, decide):
    """PACKING=1: the conversations packed best-fit decreasing into rows of MAX_LENGTH tokens
    (train/data/chat/packing.py), the collator that keeps them apart in attention, and the figures
    for summary.json. set_attention(kind): switches the model to the varlen kernel chosen. Returns (rows
    dataset, collator, summary entries)."""
    if d.length_grouping:
        d.length_grouping = False
        decide("length_grouping", 0, "PACKING=1 groups conversations by length itself")
    packing = pack(dataset.lengths, max_length)
    rows = PackedRows(dataset.examples, packing.rows)
    decide(
        "packing",
        f"{len(rows)} rows",
        f"{len(dataset)} conversations best-fit into rows of MAX_LENGTH={max_length}: {packing.efficiency:.1%} of "
        "the row tokens are real; BATCH_SIZE counts rows",
    )
    attention = packed_attention(device, precision, set_attention)
    decide("attention", attention.kind, attention.why)
    multiple = 8 if device.type == "cuda" else 1
    collate = PackedCollator(tok.pad_token_id, attention=attention.kind, pad_to_multiple_of=multiple)
    packed = {"packed_rows": len(rows), "packing_efficiency": packing.efficiency, "attention": attention.kind}
    return rows, collate, packed


def packed_attention(device, precision: str, set_attention) -> Attention:
    """The attention that keeps packed sequences apart here (packing.attention_for), the model switched
    to it by set_attention(kind); the masked sdpa path where the model cannot switch."""
    attention = attention_for(device, precision)
    if attention.kind in (FLASH, VARLEN):
        try:
            set_attention(attention.kind)
        except Exception as err:  # no flash/varlen support for this architecture: the masked path
            attention = Attention(SDPA, f"packed attention: sdpa with a block-diagonal causal mask ({err})")
    return attention


def split_validation(d, eval_batches: int, dataset: SFTDataset, tok, max_length: int, say, decide, kind: str = "causal"):
    """Held-out conversations: VAL_PATH (same formats as DATA_PATH), or the last VAL_FRACTION of
    the data (never trained on). None when VAL_FRACTION is 0."""
    if d.val_path is not None:
        with records.reading("VAL_PATH"), record_limit(d.max_record_mb):
            val, *_ = load_dataset(dataclasses.replace(d, data_path=d.val_path), tok, max_length, say, kind)
        decide("validation", f"{len(val)} {unit_of(val.pairs)}", f"VAL_PATH={d.val_path}")
        return val
    n_val = held_out_tail(len(dataset), d.val_fraction, eval_batches, unit_of(dataset.pairs), decide)
    if n_val == 0:
        return None
    return SFTDataset(dataset.examples[len(dataset) - n_val :], dataset.pairs)
