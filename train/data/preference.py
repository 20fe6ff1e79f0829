"""Preference training's front door: DATA_PATH (or the built-in pairs) -> the preference cache (tokenized once) -> pairs
(PairDataset) -> the held-out split (VAL_FRACTION or VAL_PATH) -> padded or packed batches of chosen
and rejected rows, returned as Data for the one loader factory (train/data/loader.py), which batches
them length-grouped or by TOKEN_BUDGET through SFT's samplers. Takes the data config, the tokenizer
and plain values, never the Plan or the model (packing asks for the model's attention switch alone);
imports train/core and train/data only, never the root config.py.

The batch keys the loss code reads (train/data/chat/pair_batching.py): causal input_ids,
attention_mask, labels of 2P rows (chosen rows 0..P-1, rejected rows P..2P-1); seq2seq input_ids and
attention_mask of P rows (the source once per pair) and labels of 2P rows; packed rows add
position_ids and sequence_ids; every form carries n_pairs, n_real_tokens and n_padded_tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from train.core.errors import UsageError
from train.data import records
from train.data.chat.batching import bucket_lengths
from train.data.chat.packing import FLASH, VARLEN
from train.data.chat.pair_batching import (
    MicroPackedPairCollator,
    PackedPairCollator,
    PairCollator,
    PairDataset,
    Seq2SeqPairCollator,
    pack_pairs,
)
from train.data.chat.pair_cache import preference_cache
from train.data.chat.pair_formats import BUILTIN_NAME, builtin_pairs
from train.data.chat.templates import Rendering
from train.data.holdout import held_out_tail
from train.data.json_lines import record_limit
from train.data.loader import Data
from train.data.sft import packed_attention, template_decision, tokenize_workers


def refuse_settings(d, kind: str) -> None:
    """What preference data cannot do, in one line each, before any work."""
    if d.loss_on == "all":
        raise UsageError("LOSS_ON=all: preference training scores the replies only (the prompt is the same on "
                         "both sides); leave LOSS_ON empty")
    if d.packing and kind == "seq2seq":
        raise UsageError("PACKING=1: an encoder-decoder's pairs are not packed (the source is read once per "
                         "pair); leave PACKING empty")


def preference_data(d, tok, *, kind: str, max_length: int, device, precision: str, eval_batches: int,
                    set_attention, say, decide, compile_on: bool = False, context: int | None = None) -> Data:
    """The encoded pairs of data config `d`, the held-out ones, and their collators. PACKING=1 packs
    them into rows (and lowers LENGTH_GROUPING in `d`), empty packs each micro-batch (micro_pack); compile_on
    (COMPILE=1) or a CUDA device pads batches to length buckets (a decision). context: the model's, so that
    no advice asks past it."""
    refuse_settings(d, kind)
    template_decision(d, tok, kind, say, decide)
    with record_limit(d.max_record_mb):
        dataset, meta = load_dataset(d, tok, max_length, say, kind, context)
    n_loaded = len(dataset)
    val_dataset = split_validation(d, eval_batches, dataset, tok, max_length, say, decide, kind)
    if val_dataset is not None and d.val_path is None:
        dataset = PairDataset(dataset.examples[: len(dataset) - len(val_dataset)], dataset.seq2seq)
    multiple = 8 if device.type == "cuda" else 1  # tensor cores like multiples of 8; elsewhere padding is waste
    collator = Seq2SeqPairCollator if dataset.seq2seq else PairCollator
    train_set, collate, packed = dataset, collator(tok.pad_token_id, pad_to_multiple_of=multiple), {}
    if d.packing:
        train_set, collate, packed = pack_preference(d, dataset, set_attention, tok, device, precision, max_length,
                                                     decide)
    elif d.packing is None:
        collate, packed = micro_pack(dataset, set_attention, tok, device, precision, decide, collate)
    val_collate = collator(tok.pad_token_id, pad_to_multiple_of=multiple)
    bucket_lengths(compile_on, device, 2 * max_length if d.packing else max_length, collate, val_collate,
                   dataset.seq2seq, decide)
    summary = {
        "data_format": meta.format,
        "model_kind": kind,
        "n_pairs": n_loaded,
        "n_val_pairs": len(val_dataset) if val_dataset is not None else 0,
        "n_truncated": meta.n_truncated,
        "n_reply_cut": meta.n_reply_cut,
        "n_skipped": meta.n_skipped,
        "length_grouping": d.length_grouping,
        "token_budget": d.token_budget,
        "packing": bool(d.packing),
    }
    return Data(tokenizer=tok, dataset=train_set, val_dataset=val_dataset, collate=collate, val_collate=val_collate,
                summary={**summary, **packed}, conversations=dataset)


def load_dataset(d, tok, max_length: int, say, kind: str = "causal", context: int | None = None):
    """DATA_PATH -> (PairDataset, the cache's manifest), through the preference cache; says the format
    and every count."""
    builtin = builtin_pairs() if d.data_path is None else None
    pairs, done = preference_cache(d.data_path, builtin, tok, max_length, d.skip_bad_records, Path(d.cache_dir),
                                   tokenize_workers(d), say, kind, Rendering.of(d))
    meta = pairs.meta
    fmt = BUILTIN_NAME if builtin is not None else f"format {meta.format}"
    say(f"preference data: {d.data_path or 'built-in'}, {fmt}, {len(pairs)} pairs; {done}")
    if meta.n_skipped:
        say(f"skipped {meta.n_skipped} bad record(s) (SKIP_BAD_RECORDS=1); the rest train; the first: "
            f"{meta.first_error}")
    if meta.n_truncated:
        say(f"truncated {meta.n_truncated} of {len(pairs)} pairs longer than MAX_LENGTH={max_length} tokens: the "
            f"prompt gave way first, cut once for both replies (TRUNCATION={Rendering.of(d).truncation})")
    if meta.n_reply_cut:
        say(f"warning: {meta.n_reply_cut} of {len(pairs)} pairs lost the end of a reply (the reply alone is longer "
            f"than what MAX_LENGTH={max_length} leaves after the prompt); {longer(max_length, context)}")
    if meta.n_tools_kept:
        say(f"{meta.n_tools_kept} of them have a tools list: it was kept with the system turn, and the history cut")
    return PairDataset(pairs, kind == "seq2seq"), meta


def longer(max_length: int, context: int | None) -> str:
    """What scores whole replies: a MAX_LENGTH up to the model's context, never past it."""
    if context is not None and max_length >= context:
        return (f"MAX_LENGTH={max_length} is already the model's context, so only shorter pairs (or a model with a "
                "longer context) score whole replies")
    up_to = f" (up to the model's context, {context})" if context is not None else " (up to the model's context)"
    return f"raise MAX_LENGTH{up_to} to score whole replies"


def pack_preference(d, dataset: PairDataset, set_attention, tok, device, precision: str, max_length: int, decide):
    """PACKING=1: the pairs packed best-fit decreasing into rows of 2 x MAX_LENGTH tokens (a pair's two
    sequences in one row), the collator that keeps every sequence apart in attention, and the figures
    for summary.json. Returns (rows dataset, collator, summary entries)."""
    if d.length_grouping:
        d.length_grouping = False
        decide("length_grouping", 0, "PACKING=1 groups pairs by length itself")
    rows, packing = pack_pairs(dataset, max_length)
    decide("packing", f"{len(rows)} rows",
           f"{len(dataset)} pairs best-fit into rows of 2 x MAX_LENGTH = {2 * max_length} tokens (a pair's chosen "
           f"and rejected sequences share a row): {packing.efficiency:.1%} of the row tokens are real; BATCH_SIZE "
           "counts rows")  # fmt: skip
    attention = packed_attention(device, precision, set_attention)
    decide("attention", attention.kind, attention.why)
    multiple = 8 if device.type == "cuda" else 1
    collate = PackedPairCollator(tok.pad_token_id, attention=attention.kind, pad_to_multiple_of=multiple)
    return rows, collate, {"packed_rows": len(rows), "packing_efficiency": packing.efficiency,
                           "attention": attention.kind}  # fmt: skip


def micro_pack(dataset: PairDataset, set_attention, tok, device, precision: str, decide, padded):
    """PACKING empty: a causal model's micro-batches of pairs each in one unpadded row (the padded run's
    sampler, BATCH_SIZE pairs, the same pairs per step: its losses); an encoder-decoder's stay `padded`.
    Returns (collator, summary entries)."""
    if dataset.seq2seq:
        decide("packing", 0, "PACKING empty: an encoder-decoder's pairs are padded (its source is read once per "
               "pair); LENGTH_GROUPING=1 or TOKEN_BUDGET trims their padding")
        return padded, {}
    attention = packed_attention(device, precision, set_attention)
    flat = attention.kind in (FLASH, VARLEN)
    decide("packing", "micro-batch",
           f"PACKING empty: each micro-batch's BATCH_SIZE pairs (as the padded run draws them) "
           f"{'laid end to end in one row' if flat else 'one pair per row'} instead of 2 x BATCH_SIZE rows padded "
           "to the longest: the same pairs per step, so the same losses, without the pad tokens (padding "
           "efficiency in summary.json); PACKING=0 pads, PACKING=1 packs all pairs into rows of 2 x MAX_LENGTH")
    decide("attention", attention.kind, attention.why)
    multiple = 8 if device.type == "cuda" else 1
    collate = MicroPackedPairCollator(tok.pad_token_id, attention=attention.kind, pad_to_multiple_of=multiple)
    return collate, {"packing": "micro-batch", "attention": attention.kind}


def split_validation(d, eval_batches: int, dataset: PairDataset, tok, max_length: int, say, decide,
                     kind: str = "causal") -> PairDataset | None:
    """Held-out pairs: VAL_PATH (the same formats as DATA_PATH), or the last VAL_FRACTION of the data
    (never trained on). None when VAL_FRACTION is 0."""
    if d.val_path is not None:
        with records.reading("VAL_PATH"), record_limit(d.max_record_mb):
            val, _ = load_dataset(dataclasses.replace(d, data_path=d.val_path), tok, max_length, say, kind)
        decide("validation", f"{len(val)} pairs", f"VAL_PATH={d.val_path}")
        return val
    n_val = held_out_tail(len(dataset), d.val_fraction, eval_batches, "pairs", decide)
    if n_val == 0:
        return None
    return PairDataset(dataset.examples[len(dataset) - n_val :], dataset.seq2seq)
