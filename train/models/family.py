"""The registry of model families: one Family entry per architecture the kit builds new
(FAMILIES: gpt2, t5, llama, qwen3; MODEL_FAMILY picks one), and a generic entry per kind for a loaded
model of another type (Qwen2, Mistral, BART, mT5 ...: KINDS). Everything that differs between
families is a field here, so the rest of the kit reads `plan.family.<field>` instead of asking
what the model is: a new family is one entry (a file beside this one and a line in FAMILIES).

`family_of(model or config)` is the one way to tell: the named entry for its model_type, else the
kind transformers' own tables give (causal or encoder-decoder), else None (BERT, ViT ...)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from train.core.model import unwrapped

# Dropout settings of other types' configs (Qwen, Mistral: attention_dropout; BART: dropout,
# activation_dropout).
GENERIC_DROPOUT = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "dropout_rate", "dropout",
                   "activation_dropout", "hidden_dropout")


@dataclass(frozen=True)
class Layout:
    """The encoder-decoder difference, one strategy object on the family (Family.layout): a causal LM reads
    one sequence whose labels are its inputs shifted (position t predicts label t+1); an encoder-decoder
    (T5, BART) reads a source with its encoder and predicts a target with its decoder: batches of two
    lengths, every label a target (the decoder shifts its inputs, not the labels), an SFT example a
    (source, target) pair per assistant turn, a reply generated from the decoder's start. Callers ask it,
    not which it is: the targets it counts, the loss and log-probs it runs (train/core), the generation
    inputs it makes, the tokens the meter counts, the lengths FLOPs and the memory estimate are taken at,
    whether the fill applies, its model_kind decision and its refusals (PACKING=1, causal-only settings);
    what data/ builds for each (collators, encoders, unit names) is chosen by `pick`, since data/ sits
    above this layer. Imports torch's side on use: the launchers read the registry bare."""

    name: str
    """"causal" or "seq2seq": summary.json's model_kind and part of every chat cache's key."""
    encoder_decoder: bool

    @property
    def shifted(self) -> bool:
        """Targets are the labels shifted by one (a causal LM); an encoder-decoder's labels are its
        targets."""
        return not self.encoder_decoder

    @property
    def packs(self) -> bool:
        """Several sequences to a row (PACKING) is built for it: a causal LM's; an encoder-decoder's
        pairs would need per-pair masks on both sides."""
        return not self.encoder_decoder

    def pick(self, causal, encoder_decoder):
        """Of two things made for each layout (a collator, an encoder, a word for the log), this layout's."""
        return encoder_decoder if self.encoder_decoder else causal

    def count_targets(self, batch) -> int:
        """A micro-batch's target tokens, a host int (train/core/loss.py count_targets)."""
        from train.core.loss import count_targets

        return count_targets(batch, shifted=self.shifted)

    def step_targets(self, batches) -> int:
        """An optimizer step's target tokens: its micro-batches together."""
        from train.core.loss import step_targets

        return step_targets(batches, shifted=self.shifted)

    def responses(self, batch):
        """Where a preference batch's response tokens are (train/core/preference/logps.py Responses)."""
        from train.core.preference.logps import Responses

        return Responses.of(batch, shifted=self.shifted)

    def token_logps(self, model, inputs: dict, responses, chunk_tokens: int | None):
        """(M,) fp32 log-probs of a preference batch's response tokens: a causal LM's rows through its base
        model and head, or an encoder-decoder's sources read once for both replies."""
        from train.core.preference import logps

        return self.pick(logps.causal_tokens, logps.seq2seq_tokens)(model, inputs, responses, chunk_tokens)

    def prompt_ids(self, tok, text: str, templated: bool) -> list[int]:
        """Generation's input ids of a prompt: an encoder-decoder's source carries what its tokenizer adds
        itself (T5's </s>), as its SFT sources do, and a plain one ends with end-of-text as span
        corruption's sources do; a causal LM's prompt is the text's ids alone (the template's markup)."""
        ids = tok(text, add_special_tokens=self.encoder_decoder)["input_ids"]
        eos = tok.eos_token_id
        if self.encoder_decoder and not templated and ids and eos is not None and ids[-1] != eos:
            ids.append(eos)
        return ids

    def new_tokens(self, limit: int, context: int, prompt: int) -> int:
        """New tokens a reply may take: a decoder has the context to itself; a causal LM's follows
        the prompt."""
        return min(limit, context - self.pick(prompt, 0))

    def reply_start(self, prompt: int) -> int:
        """Where generate()'s output starts the reply: after the decoder's start token, or after the prompt
        a causal LM repeats."""
        return self.pick(prompt, 1)

    def batch_tokens(self, batch: dict) -> tuple[int, int]:
        """(real, padded) tokens of a micro-batch as the meter counts them, on the host: a causal LM's from
        the collator's ints (packed pretraining windows: all real), an encoder-decoder's source + target
        (train/core/loss.py seq2seq_tokens)."""
        from train.core.loss import seq2seq_tokens

        if self.encoder_decoder:
            return seq2seq_tokens(batch)
        ids = batch["input_ids"]
        return batch.get("n_real_tokens", ids.numel()), batch.get("n_padded_tokens", ids.numel())

    def sample_lengths(self, mode: str, max_length: int) -> tuple[int, int | None]:
        """(window, None) for a causal LM; (source, target) for an encoder-decoder in this mode
        (train/models/estimate_seq2seq.py lengths): the lengths FLOPs and the memory estimate are taken at."""
        from train.models.estimate_seq2seq import lengths

        return lengths(mode, max_length) if self.encoder_decoder else (max_length, None)

    def flop_lengths(self, mode: str, max_length: int, rows: int, tokens: int) -> tuple[int, int | None]:
        """The lengths summary.json's FLOPs per token are taken at: an encoder-decoder's source and target
        at the planned lengths (sample_lengths); a causal LM's real tokens per row seen (`tokens` over
        `rows`; pretraining: max_length, as before any row is seen)."""
        if self.encoder_decoder:
            return self.sample_lengths(mode, max_length)
        return (round(tokens / rows) if rows else max_length), None

    def bound_shape(self, mode: str, max_length: int) -> dict:
        """estimate_for_run's row lengths at the mode's bound (data without per-row lengths: pretraining's
        windows, preference pairs): max_length, and an encoder-decoder's target_length (span corruption's
        target; MAX_LENGTH for both otherwise)."""
        source, target = self.sample_lengths(mode, max_length)
        return {"max_length": source} if target is None else {"max_length": source, "target_length": target}

    def data_shape(self, lengths, sources, padded: Callable[[int], int]) -> dict:
        """estimate_for_run's row lengths of the data's longest rows, each as padded() widens it: an
        encoder-decoder's source and target apart where the data keeps its sources' lengths (sources not
        None), else the longest row (an array: numpy's max, not a Python loop over it)."""
        import numpy as np

        if self.encoder_decoder and sources is not None:
            targets = np.asarray(lengths) - sources
            return {"max_length": padded(sources.max()), "target_length": padded(targets.max())}
        return {"max_length": padded(np.max(lengths))}

    def fills(self, mode: str) -> bool:
        """Whether the command line's fill (a GPU's largest micro-batch) applies: SFT, DPO, GRPO and
        an encoder-decoder's pretraining (T5); GPT-2 pretraining keeps its preset (train/core/objective.py
        fills_causal)."""
        from train.core.objective import mode_of

        return mode_of(mode).fills_causal or self.encoder_decoder

    def decide_kind(self, decide, why: str) -> None:
        """The model_kind decision where it is news: an encoder-decoder's (why: what the caller's mode
        trains it on); a causal LM, every mode's default, is not said."""
        if self.encoder_decoder:
            decide("model_kind", self.name, why)

    def refuse_packing(self, asked, message: str) -> None:
        """PACKING=1 (asked truthy) where packing is not built for this layout (packs): a usage error with
        the caller's message (exit 2, before any weights or data are read)."""
        from train.core.errors import UsageError

        if asked and not self.packs:
            raise UsageError(message)

    def causal_only(self, asked, message: str) -> None:
        """A setting built for a causal LM alone (LOSS_ON=all, bench --vs-plain), asked (truthy) of an
        encoder-decoder: a usage error with the caller's message (exit 2)."""
        from train.core.errors import UsageError

        if asked and self.encoder_decoder:
            raise UsageError(message)


CAUSAL_LM = Layout("causal", encoder_decoder=False)
ENCODER_DECODER = Layout("seq2seq", encoder_decoder=True)


@dataclass(frozen=True)
class Family:
    """One architecture: how to configure, build, load, count and train it."""

    name: str
    """MODEL_FAMILY's value (a named entry) or the kind ("causal", "seq2seq") of a generic one."""
    layout: Layout
    """How its model reads a batch (CAUSAL_LM or ENCODER_DECODER): the one strategy object read outside
    train/models/ for the encoder-decoder difference (targets, losses, log-probs, generation inputs)."""
    auto: str
    """transformers' Auto class that builds and loads it."""
    peft_task_type: str
    """peft's task type for LoRA."""
    sizes: Mapping[str, Mapping] = field(default_factory=lambda: MappingProxyType({}))
    """MODEL_SIZE -> the config class's keyword arguments (nano, tiny, small, medium)."""
    make_config: Callable | None = None
    """(size, vocab_size, eos_id) -> a transformers config of that size: MODEL_SIZE's new model."""
    context: int = 1024
    """The context length when the config has no position table (T5's relative positions)."""
    objective: str = "causal_lm"
    """Pretraining's objective on raw text: causal_lm (next token) or span_corruption (T5)."""
    dropout: tuple[str, ...] = GENERIC_DROPOUT
    """The config's dropout settings DROPOUT sets (a loaded model of another type: those of these it has)."""
    dropout_modules: tuple[str, ...] = ("attention_dropout", "dropout", "activation_dropout")
    """Module attributes that hold a dropout as a plain float read at forward (Llama's attention, T5's), set
    with the config on a model already built; torch.nn.Dropout layers are set wherever they are."""
    qk_norm: bool = False
    """An RMSNorm on each head's queries and keys before the rotation (Qwen3): the memory estimate counts
    what it saves (train/models/estimate.py)."""
    attention: Callable | None = None
    """model -> None: the kit's attention installed on every model of the family it builds or loads
    (T5's: the position bias folded with the mask once per forward, train/models/t5_attention.py);
    None: sdpa as transformers runs it. Nothing of it is saved with the model."""

    def auto_class(self):
        import transformers

        return getattr(transformers, self.auto)

    def config_for(self, size: str, vocab_size: int, eos_id: int):
        if self.make_config is None or size not in self.sizes:
            raise KeyError(f"the {self.name} family has no size {size!r}")
        return self.make_config(self.sizes[size], vocab_size, eos_id)


CAUSAL = Family("causal", layout=CAUSAL_LM, auto="AutoModelForCausalLM", peft_task_type="CAUSAL_LM")
SEQ2SEQ = Family("seq2seq", layout=ENCODER_DECODER, auto="AutoModelForSeq2SeqLM",
                 peft_task_type="SEQ_2_SEQ_LM",
                 context=512, objective="span_corruption")
KINDS = {"causal": CAUSAL, "seq2seq": SEQ2SEQ}


def kind_of_type(model_type, is_decoder: bool = False) -> str | None:
    """"causal" (GPT-2, Llama, Qwen ...), "seq2seq" (T5, mT5, BART ...) or None for a model type
    that is neither (BERT, ViT ...), from transformers' own tables of model types."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "seq2seq"
    # BERT, RoBERTa ... are in the causal table too (a head for is_decoder=True), but are encoders.
    encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not is_decoder
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not encoder:
        return "causal"
    return None


def family_of_type(model_type) -> Family | None:
    """family_of for a bare model_type string (a saved run's config.json, read as JSON)."""
    return family_of(type("Config", (), {"model_type": model_type})())


def family_of(model_or_config) -> Family | None:
    """The Family of a model (wrapped or not) or of its config: its named entry (gpt2, t5, llama, qwen3),
    else the generic entry of its kind; None for a type that is neither a causal LM nor an
    encoder-decoder."""
    from train.models import FAMILIES

    cfg = getattr(unwrapped(model_or_config), "config", model_or_config)
    model_type = getattr(cfg, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if getattr(cfg, "is_encoder_decoder", False):
        return SEQ2SEQ
    kind = kind_of_type(model_type, bool(getattr(cfg, "is_decoder", False)))
    return KINDS[kind] if kind else None


def dropout_of(model_or_config) -> float | None:
    """The largest dropout setting of a model's config (None where its family names none it has)."""
    cfg = getattr(unwrapped(model_or_config), "config", model_or_config)
    family = family_of(cfg)
    values = [
        getattr(cfg, n)
        for n in (family.dropout if family else ())
        if isinstance(getattr(cfg, n, None), float)
    ]
    return max(values) if values else None


def set_dropout(model_or_config, p: float) -> int:
    """DROPOUT: every dropout setting of the family in the config (saved with final/), and on a built model
    every torch.nn.Dropout and the float attributes its layers read at forward (modules made from the config
    before it changed keep their own copy). Returns how many of those it changed (0 for a config)."""
    import torch

    model = unwrapped(model_or_config)
    cfg = getattr(model, "config", model_or_config)
    family = family_of(cfg)
    for name in family.dropout if family else ():
        if isinstance(getattr(cfg, name, None), (int, float)) and not isinstance(getattr(cfg, name), bool):
            setattr(cfg, name, float(p))
    if not isinstance(model, torch.nn.Module):
        return 0
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            changed += module.p != p
            module.p = float(p)
        for name in family.dropout_modules if family else ():
            if isinstance(getattr(module, name, None), float):
                changed += getattr(module, name) != p
                setattr(module, name, float(p))
    return changed
