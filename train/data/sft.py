"""SFT's door: DATA_PATH (or the built-in pairs) -> the SFT cache (tokenized once) -> encoded
conversations (SFTDataset; for an encoder-decoder (source, target) pairs, as its layout says) -> the
held-out split (VAL_FRACTION or VAL_PATH) -> PACKING's rows, returned as Data (train/val datasets and
their collators) for the one loader factory. Everything it calls is the chat library's
(train/data/chat). Takes the data config, the tokenizer and plain values, never the Plan or the model
(packing asks for the model's attention switch alone); never the root config.py."""

from __future__ import annotations

import itertools
from pathlib import Path

from train.data import records
from train.data.chat.batching import bucket_lengths, padded
from train.data.chat.cache import tokenize_workers
from train.data.chat.conversation_cache import SFTDataset, sft_cache
from train.data.chat.encode import Rendering
from train.data.chat.formats import builtin_conversations, converted, open_records
from train.data.chat.packing import pack_conversations
from train.data.chat.template_table import template_decision
from train.data.holdout import held_out
from train.data.json_lines import record_limit
from train.data.loader import Data
from train.data.text import language_note

BUILTIN = "built-in (standard-library functions: signature and docstring -> body)"


def fine_tuning_data(d, tok, *, layout, max_length: int, device, precision: str, eval_batches: int,
                     set_attention, say, decide, compile_on: bool = False) -> Data:
    """The encoded examples of data config `d` (the model's layout's), the held-out ones, and their
    collators. PACKING=1 packs them into rows (and lowers LENGTH_GROUPING in `d`); compile_on
    (COMPILE=1) or a CUDA device pads batches to length buckets (a decision)."""
    template_decision(d, tok, layout, say, decide)
    with record_limit(d.max_record_mb):
        if d.data_path is not None:
            language_note(tok, first_texts(d), say)
        dataset, fmt = load_dataset(d, tok, max_length, say, layout)
    if fmt.partition(":")[0] == "text" and d.template is None and tok.chat_template is not None:
        tok.chat_template = None  # plain documents: final/ is a text model, and generate continues a prompt
        decide("template", "none (plain text)", "every record is plain text (TEXT_FIELD): final/ saves no "
               "chat template, so generate continues a prompt as the model trained")
    meta, n_loaded = dataset.examples.meta, len(dataset)
    dataset, val_dataset = held_out(d, eval_batches, dataset,
                                    lambda v: load_dataset(v, tok, max_length, say, layout)[0], decide)
    multiple = 8 if device.type == "cuda" else 1  # tensor cores like multiples of 8; elsewhere: waste
    train_set, collate, packed = dataset, padded(layout)(tok.pad_token_id, pad_to_multiple_of=multiple), {}
    if d.packing:
        train_set, collate, packed = pack_conversations(d, dataset, set_attention, tok, device, precision,
                                                        max_length, decide)
    val_collate = padded(layout)(tok.pad_token_id, pad_to_multiple_of=multiple)
    bucket_lengths(compile_on, device, max_length, collate, val_collate, layout, decide)
    summary = {"data_format": fmt, "model_kind": layout.name, "n_conversations": n_loaded,
               "n_val_conversations": len(val_dataset) if val_dataset is not None else 0,
               "n_truncated": meta.n_truncated, "n_skipped": meta.n_skipped,
               "length_grouping": d.length_grouping, "token_budget": d.token_budget,
               "packing": bool(d.packing)}  # empty (None) is 0 in SFT
    return Data(tokenizer=tok, dataset=train_set, val_dataset=val_dataset, collate=collate,
                val_collate=val_collate, summary={**summary, **packed}, conversations=dataset)


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


def load_dataset(d, tok, max_length: int, say, layout) -> tuple[SFTDataset, str]:
    """DATA_PATH (or the built-in set) -> (encoded examples, format), through the SFT cache (tokenized
    once per data, tokenizer, template, MAX_LENGTH and layout); says the format and every count."""
    builtin = builtin_conversations() if d.data_path is None else None
    examples, done = sft_cache(d.data_path, builtin, tok, max_length, d.skip_bad_records, Path(d.cache_dir),
                               tokenize_workers(d), say, layout, Rendering.of(d), d.text_field)
    dataset, meta, n = SFTDataset(examples, layout), examples.meta, len(examples)
    fmt = meta.format if builtin is None else BUILTIN
    how = layout.pick("", " (one per assistant turn: the turns before it are its source)")
    say(f"SFT data: {d.data_path or 'built-in'}, format {fmt}, {n} {dataset.unit}{how}; {done}")
    if meta.n_skipped:
        say(f"skipped {meta.n_skipped} bad record(s) (SKIP_BAD_RECORDS=1); the rest train; the first: "
            f"{meta.first_error}")
    if meta.n_unfit > n:  # only under SKIP_BAD_RECORDS=1 (sft_cache refuses it otherwise): said loudly
        total = meta.n_unfit + n
        say(f"warning: SKIP_BAD_RECORDS=1: skipped {meta.n_unfit} of {total} records "
            f"({meta.n_unfit / total:.0%}) that cannot fit this model at MAX_LENGTH={max_length}; "
            f"only the {n} that fit train (a longer MAX_LENGTH, a model of a longer context, or shorter "
            f"records keep them); the first: {meta.first_unfit}")
    elif meta.n_unfit:
        say(f"warning: skipped {meta.n_unfit} record(s) that cannot fit this model at "
            f"MAX_LENGTH={max_length} (not bad input: the rest train); the first: {meta.first_unfit}")
    if meta.n_truncated:
        sides = layout.pick("", " on a side (a source keeps its end, the turns the reply answers; a "
                                "target its start and eos)")
        say(f"truncated {meta.n_truncated} of {n} {dataset.unit} longer than MAX_LENGTH={max_length} "
            f"tokens{sides}")
    if meta.n_tools_kept:
        say(f"{meta.n_tools_kept} of them have a tools list: it was kept with the system turn, and the "
            "history cut")
    return dataset, fmt
