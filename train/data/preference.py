"""Preference training's door: DATA_PATH (or the built-in pairs) -> the preference cache (tokenized
once) -> pairs (PairDataset) -> the held-out split (VAL_FRACTION or VAL_PATH) -> padded or packed batches
of chosen and rejected rows, returned as Data for the one loader factory (train/data/loader.py), which
batches them length-grouped or by TOKEN_BUDGET through the library's samplers. Everything it calls is
the chat library's (train/data/chat). Takes the data config, the tokenizer and plain values, never the
Plan or the model (packing asks for the model's attention switch alone); never the root config.py.

The batch keys the loss code reads (train/data/chat/pair_batching.py): causal input_ids,
attention_mask, labels of 2P rows (chosen rows 0..P-1, rejected rows P..2P-1); seq2seq input_ids and
attention_mask of P rows (the source once per pair) and labels of 2P rows; packed rows add position_ids
and sequence_ids; every form carries n_pairs, n_real_tokens and n_padded_tokens.
"""

from __future__ import annotations

from pathlib import Path

from train.core.errors import UsageError
from train.data.chat.batching import bucket_lengths
from train.data.chat.cache import tokenize_workers
from train.data.chat.pair_batching import PairDataset, padded_pairs, pair_batches
from train.data.chat.pair_cache import preference_cache
from train.data.chat.pair_formats import BUILTIN_NAME, builtin_pairs
from train.data.chat.template_table import template_decision
from train.data.chat.templates import Rendering
from train.data.holdout import held_out
from train.data.json_lines import record_limit
from train.data.loader import Data


def preference_data(d, tok, *, layout, max_length: int, device, precision: str, eval_batches: int,
                    set_attention, say, decide, compile_on: bool = False, context: int | None = None) -> Data:
    """The encoded pairs of data config `d`, the held-out ones, and their collators (pair_batches:
    PACKING=1 packs them into rows and lowers LENGTH_GROUPING in `d`, empty packs each micro-batch);
    compile_on (COMPILE=1) or a CUDA device pads batches to length buckets (a decision). context: the
    model's, so that no advice asks past it."""
    if d.loss_on == "all":
        raise UsageError("LOSS_ON=all: preference training scores the replies only (the prompt is the same "
                         "on both sides); leave LOSS_ON empty")
    layout.refuse_packing(d.packing, "PACKING=1: an encoder-decoder's pairs are not packed (the source is "
                          "read once per pair); leave PACKING empty")
    template_decision(d, tok, layout, say, decide)
    with record_limit(d.max_record_mb):
        dataset, meta = load_dataset(d, tok, max_length, say, layout, context)
    n_loaded = len(dataset)
    dataset, val_dataset = held_out(d, eval_batches, dataset,
                                    lambda v: load_dataset(v, tok, max_length, say, layout)[0], decide)
    multiple = 8 if device.type == "cuda" else 1  # tensor cores like multiples of 8; elsewhere: waste
    padded = padded_pairs(layout)(tok.pad_token_id, pad_to_multiple_of=multiple)
    train_set, collate, packed = pair_batches(d, dataset, padded, set_attention, tok, device, precision,
                                              max_length, decide)
    val_collate = padded_pairs(layout)(tok.pad_token_id, pad_to_multiple_of=multiple)
    widest = 2 * max_length if d.packing else max_length
    bucket_lengths(compile_on, device, widest, collate, val_collate, layout, decide)
    summary = {"data_format": meta.format, "model_kind": layout.name, "n_pairs": n_loaded,
               "n_val_pairs": len(val_dataset) if val_dataset is not None else 0,
               "n_truncated": meta.n_truncated, "n_reply_cut": meta.n_reply_cut, "n_skipped": meta.n_skipped,
               "length_grouping": d.length_grouping, "token_budget": d.token_budget,
               "packing": bool(d.packing)}
    return Data(tokenizer=tok, dataset=train_set, val_dataset=val_dataset, collate=collate,
                val_collate=val_collate, summary={**summary, **packed}, conversations=dataset)


def load_dataset(d, tok, max_length: int, say, layout, context: int | None = None):
    """DATA_PATH -> (PairDataset, the cache's manifest), through the preference cache; says the format
    and every count."""
    builtin = builtin_pairs() if d.data_path is None else None
    pairs, done = preference_cache(d.data_path, builtin, tok, max_length, d.skip_bad_records,
                                   Path(d.cache_dir), tokenize_workers(d), say, layout, Rendering.of(d))
    meta = pairs.meta
    fmt = BUILTIN_NAME if builtin is not None else f"format {meta.format}"
    say(f"preference data: {d.data_path or 'built-in'}, {fmt}, {len(pairs)} pairs; {done}")
    if meta.n_skipped:
        say(f"skipped {meta.n_skipped} bad record(s) (SKIP_BAD_RECORDS=1); the rest train; the first: "
            f"{meta.first_error}")
    if meta.n_truncated:
        say(f"truncated {meta.n_truncated} of {len(pairs)} pairs longer than MAX_LENGTH={max_length} tokens: "
            f"the prompt gave way first, cut once for both replies (TRUNCATION={Rendering.of(d).truncation})")
    if meta.n_reply_cut:
        say(f"warning: {meta.n_reply_cut} of {len(pairs)} pairs lost the end of a reply (the reply alone is "
            f"longer than what MAX_LENGTH={max_length} leaves after the prompt); "
            f"{longer(max_length, context)}")
    if meta.n_tools_kept:
        say(f"{meta.n_tools_kept} of them have a tools list: it was kept with the system turn, and the "
            "history cut")
    return PairDataset(pairs, layout), meta


def longer(max_length: int, context: int | None) -> str:
    """What scores whole replies: a MAX_LENGTH up to the model's context, never past it."""
    if context is not None and max_length >= context:
        return (f"MAX_LENGTH={max_length} is already the model's context, so only shorter pairs (or a model "
                "with a longer context) score whole replies")
    up_to = f" (up to the model's context, {context})" if context is not None else (" (up to the model's "
                                                                                    "context)")
    return f"raise MAX_LENGTH{up_to} to score whole replies"
