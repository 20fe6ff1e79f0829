"""SFT from scratch: MODEL_CONFIG (a transformers config.json) or MODEL_SIZE (+ MODEL_FAMILY gpt2 |
t5) builds a NEW model (random init, SEED) that trains on the SFT data's source -> target pairs,
the way ChatLM-mini-Chinese "pretrains" its T5 on prompt/response parquet: an encoder-decoder
through the seq2seq SFT path (encoder source, decoder target), a causal LM through the causal
one. MODEL_PATH with either is refused: one model, loaded or built.

The tokenizer is TOKENIZER_PATH, or a byte-level BPE (VOCAB_SIZE) trained on the SFT data's own
text, every turn's contents, with the pretraining trainer and its cache (train/data/text.py).
The model's special ids come from that tokenizer (pad, eos; an encoder-decoder's decoder starts
at pad, as T5's does). Where MODEL_CONFIG sets its own (ChatLM's pad 0, eos 1), a trained BPE is
laid out to give the same ids; where they still differ, the decision says so.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from config import TrainConfig
from train.core import model as model_lib
from train.core.errors import UsageError
from train.core.measure import estimate
from train.data import records
from train.data import text as text_lib
from train.data.sft.sft_formats import builtin_conversations, open_records, to_conversation
from train.data.sft.sft_turns import BadRecord, call_text, split_tools
from train.run.plan.sft_model import chat_tokens

# Part of the tokenizer cache's key: the same files give another BPE as SFT turns than as
# pretraining text.
TURNS_KEY = "sft-turns"


def asked(cfg: TrainConfig) -> bool:
    """MODEL_CONFIG or MODEL_SIZE set: SFT builds a new model."""
    return cfg.model.model_config is not None or cfg.model.model_size is not None


def refuse_both(cfg: TrainConfig) -> None:
    if cfg.model.model_path is not None and asked(cfg):
        both = "MODEL_CONFIG" if cfg.model.model_config is not None else "MODEL_SIZE"
        raise UsageError(
            f"MODEL_PATH and {both} are both set: MODEL_PATH fine-tunes an existing model, {both} builds a new one; "
            "set one of them"
        )
    if asked(cfg) and cfg.model.lora_r:  # said before the tokenizer trains, not after (core/lora.py's own check)
        raise UsageError(f"LORA_R={cfg.model.lora_r}: SFT builds this model new (MODEL_CONFIG / MODEL_SIZE), and LoRA "
                         "would keep its random weights frozen; LoRA adapts a trained model: set MODEL_PATH, or leave "
                         "LORA_R empty")


def turn_texts(data_path: str | None, sample_mb: float, text_field: str = "text") -> Iterator[str]:
    """Every turn's text of the SFT data (contents, tool calls, tools lists), up to
    TOKENIZER_SAMPLE_MB; records that are bad are passed over here (the SFT cache names them)."""
    if data_path is None:
        conversations = iter(builtin_conversations())
    else:
        fmt, items = open_records(data_path, text_field)
        conversations = _good(items, fmt)
    budget, taken = sample_mb * (1 << 20), 0
    for conversation in conversations:
        for piece in _conversation_texts(conversation):
            yield piece
            taken += len(piece.encode("utf-8"))
        if taken >= budget:
            return


def _good(items, fmt: str) -> Iterator[list[dict]]:
    for _, record in items:
        if isinstance(record, BadRecord):
            continue
        try:
            yield to_conversation(record, fmt)
        except BadRecord:
            continue


def _conversation_texts(conversation) -> Iterator[str]:
    tools, turns = split_tools(conversation)
    if tools:
        yield json.dumps(tools, ensure_ascii=False)
    for turn in turns:
        # every string a turn carries (its content, a reasoning part ...) but its role
        yield from (v for k, v in turn.items() if k != "role" and isinstance(v, str) and v)
        yield from (call_text(call) for call in turn.get("tool_calls") or ())


class Scratch:
    """The new model's config (from MODEL_CONFIG / MODEL_SIZE), then its tokenizer and weights."""

    def __init__(self, cfg: TrainConfig, say, decide):
        m = cfg.model
        if m.model_config is not None:
            self.size, self.variable = "custom", f"MODEL_CONFIG={m.model_config}"
            decide("model_size", "custom", f"MODEL_CONFIG={m.model_config}: a new model, trained from scratch")
            if m.model_family != "gpt2":
                say(f"MODEL_FAMILY={m.model_family} is ignored: MODEL_CONFIG's model_type decides the model")
        else:
            self.size, self.variable = m.model_size, f"MODEL_SIZE={m.model_size}"
        self.declared = model_lib.declared_ids(m.model_config)
        self.hf_cfg = model_lib.build_config(self.size, m.model_config, cfg.data.vocab_size, 0, m.model_family)
        self.kind = "seq2seq" if model_lib.is_seq2seq(self.hf_cfg) else "causal"
        self.template = cfg.data.template  # TEMPLATE: its markers are in the vocabulary the model is sized for
        what = "an encoder-decoder: source -> target" if self.kind == "seq2seq" else "a causal LM: conversations"
        decide("model", f"new {self.hf_cfg.model_type}", f"{self.variable}: random init (SEED={cfg.system.seed}), "
               f"{what}; no MODEL_PATH")  # fmt: skip

    def tokenizer(self, cfg: TrainConfig, say, decide):
        """TOKENIZER_PATH, or a BPE trained (and cached) on the SFT data's turns, laid out at
        MODEL_CONFIG's own pad / eos ids where it sets small ones."""
        d = cfg.data
        if d.tokenizer_path is not None:
            return text_lib.load_tokenizer(d.tokenizer_path, [], "", d.vocab_size, Path(d.cache_dir), say)
        if d.data_path is not None:
            open_records(d.data_path, d.text_field)  # an unknown format or empty data stops here, before the BPE trains
        files = text_lib.builtin_corpus_files() if d.data_path is None else records.source_files(d.data_path)
        turns_key = TURNS_KEY if d.text_field == "text" else f"{TURNS_KEY}:{d.text_field}"  # which text it learns
        key = text_lib.corpus_fingerprint(files, turns_key, Path(d.cache_dir) / "sums")
        layout = text_lib.special_layout(self.declared.get("pad_token_id"), self.declared.get("eos_token_id"))
        specials = layout or (text_lib.EOS,)
        if layout and layout != (text_lib.EOS,):
            decide("tokenizer_specials", list(layout), f"{self.variable}'s pad / eos ids, so its ids hold")
        return text_lib.load_tokenizer(None, files, key, d.vocab_size, Path(d.cache_dir), say,
                                       sample_mb=d.tokenizer_sample_mb, specials=specials,
                                       texts=lambda: turn_texts(d.data_path, d.tokenizer_sample_mb, d.text_field))  # fmt: skip

    def special_ids(self, tok, decide) -> None:
        """The model config's vocabulary and special ids from the tokenizer, template markers
        included, so the embeddings never need resizing; MODEL_CONFIG's own ids where they differ
        are said."""
        chat_tokens(tok, self.template)  # the chat template's markers, before the vocabulary is sized
        c = self.hf_cfg
        c.vocab_size = model_lib.padded_vocab(len(tok))
        decide("vocab_size", c.vocab_size, f"the tokenizer's {len(tok)} tokens, padded to a multiple of 64")
        eos = tok.convert_tokens_to_ids(tok.eos_token)
        model_lib.set_special_tokens(c, eos, tok.pad_token_id)
        if self.kind == "causal":
            c.pad_token_id = tok.pad_token_id  # as the collator pads
        now = {k: getattr(c, k, None) for k in self.declared}
        differ = [k for k, v in self.declared.items() if now[k] != v]
        if differ:
            config = ", ".join(f"{k} {self.declared[k]}" for k in differ)
            decide("special_ids", {k: now[k] for k in differ}, f"{self.variable} sets {config}, which the tokenizer "
                   "does not have: its ids are used (TOKENIZER_PATH with the config's own tokenizer keeps them)")  # fmt: skip

    def build(self, cfg: TrainConfig, device: torch.device, precision: str, max_length: int, world_size: int,
              say, decide):
        """(model, tokenizer): refused before any data work when the model cannot fit; on the meta
        device for a dry run (shapes only)."""
        estimate.refuse_unfit(self.hf_cfg, cfg, max_length, precision, device, world_size, self.variable)
        tok = self.tokenizer(cfg, say, decide)
        self.special_ids(tok, decide)
        with torch.device("meta") if cfg.run.dry_run else contextlib.nullcontext():
            return model_lib.build_model(self.hf_cfg, False, cfg.system.seed), tok


def refuse_packing(cfg: TrainConfig, kind: str, what: str) -> None:
    """PACKING=1 with an encoder-decoder: before the weights or any data are read."""
    if kind == "seq2seq" and cfg.data.packing:
        raise UsageError(
            f"PACKING=1: {what} is an encoder-decoder, and packing several source -> target pairs per row "
            "(per-pair attention masks on both sides) is not built; use LENGTH_GROUPING=1 or TOKEN_BUDGET"
        )
