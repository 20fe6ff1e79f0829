"""`python -m train sft`: where an SFT run's model and data come from (SFTSource).

The plan is made by the same function as a pretraining run's (train/run/plan/make.py make_plan), with
the same decisions (EFFECTIVE_BATCH, LR_SCALING, the memory-adaptive settings ...), and the step
(train/core/step.py), the loop, the run folder and summary.json are shared: SFT differs only in
where the model and the batches come from. The model is MODEL_PATH (any local transformers
causal LM or encoder-decoder with its tokenizer, loaded offline: train/run/plan/sft_model.py), or
a new one of MODEL_CONFIG / MODEL_SIZE trained from scratch (train/run/plan/sft_scratch.py); the
data comes through train/data/sft.py's front door: conversations (or for an
encoder-decoder (source, target) pairs) padded to their own longest, optionally grouped by
length or sized by a token budget, or packed several to a row (PACKING=1, causal only), with
every process reading its own share of each epoch.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch

from config import TrainConfig
from train.core.attention import use_attention
from train.core.errors import UsageError
from train.data import tokenizer
from train.data.chat.batching import BudgetSampler
from train.data.chat.encode import stop_token_ids
from train.data.chat.packing import FLASH, VARLEN
from train.data.loader import Data
from train.data.sft import fine_tuning_data
from train.models import CAUSAL, load, lora
from train.models.build import attention_fits, context_length, new_model, size_vocab
from train.models.family import dropout_of, set_dropout
from train.run.plan import sft_scratch
from train.run.plan.make import ModelChoice, note_family_ignored, shortest_limit, token_objective

# (the tools' name)
from train.run.plan.sft_model import model_label, model_source, newest_pretrained  # noqa: F401


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


def choose_fine_tuned(cfg: TrainConfig, device: torch.device, say, decide) -> ModelChoice:
    """A new model's config (MODEL_CONFIG / MODEL_SIZE), or MODEL_PATH's (read, not loaded: its weights come
    after the data). SFT's choice, and preference training's (which refuses a new model first)."""
    if sft_scratch.asked(cfg):
        return sft_scratch.choose_new(cfg, say, decide)
    note_family_ignored(cfg, say, "it says what MODEL_SIZE builds (set MODEL_SIZE to train a new model from "
                        "scratch); a loaded model's config.json decides its own")
    path = Path(model_source(cfg, decide, say))
    family = load.family_of_folder(path, cfg.model.trust_remote_code) or CAUSAL
    config = load.read_config(path, cfg.model.trust_remote_code)  # its context, before any weights
    variable = f"MODEL_PATH={path}"
    sft_scratch.refuse_packing(cfg, family.layout, variable)
    family.layout.decide_kind(decide, "an encoder-decoder (AutoModelForSeq2SeqLM): trains on source -> "
                              "target pairs, one per assistant turn, loss on the target")
    return ModelChoice(family=family, size=model_label(path, config), context=context_length(config),
                       variable=variable, config=config, path=path)


def chat_tokenizer(cfg: TrainConfig, choice: ModelChoice, max_length: int, say, decide):
    """MODEL_PATH's (or TOKENIZER_PATH), or a new model's (TOKENIZER_PATH or a BPE of the data's turns),
    with TEMPLATE's chat markers added."""
    d = cfg.data
    if choice.path is None:
        tok = tokenizer.turns_tokenizer(d, choice.declared, choice.variable, say, decide)
    else:
        source = d.tokenizer_path or choice.path
        variable = f"TOKENIZER_PATH={source}" if d.tokenizer_path else f"MODEL_PATH={source}"
        tok = tokenizer.folder_tokenizer(source, variable, cfg.model.trust_remote_code,
                                         bare=load.bare_of(choice.path) is not None and not d.tokenizer_path)
    tokenizer.chat_tokens(tok, d.template)
    return tok


def loaded_dropout(cfg: TrainConfig, model, choice: ModelChoice, decide) -> None:
    """DROPOUT, where set, in every dropout setting of MODEL_PATH's model; empty: the model's own."""
    if cfg.model.dropout is not None:
        set_dropout(model, cfg.model.dropout)
        decide("dropout", cfg.model.dropout, f"DROPOUT={cfg.model.dropout:g} in every dropout setting of "
               f"MODEL_PATH's model (its own: {dropout_of(choice.config)})")


def fine_tuned_model(cfg: TrainConfig, choice: ModelChoice, tok, data: Data, device, decide,
                     dropout=loaded_dropout) -> torch.nn.Module:
    """The loaded model fitted to its chat-ready tokenizer, or the new one sized by it; the packed
    attention the data chose; then LoRA's adapters (before the optimizer and DDP). dropout(cfg, model,
    choice, decide): DROPOUT on a loaded model before LoRA's adapters (whose dropout is LORA_DROPOUT)."""
    m = cfg.model
    if choice.path is None:
        size_vocab(choice.config, tok, decide, choice.variable, choice.declared)
        model = new_model(choice.config, False, cfg.system.seed, cfg.run.dry_run, device)
    else:
        model = load.load_pretrained(choice.path, m.trust_remote_code, choice.family)
        load.fit_tokenizer(model, tok, stop_token_ids(tok), decide)
        dropout(cfg, model, choice, decide)
    if data.summary.get("attention") in (FLASH, VARLEN):
        use_attention(model, data.summary["attention"])
    load.ready(model, m.gradient_checkpointing)
    model = lora.wrap(
        model, m.lora_r, m.lora_alpha, m.lora_dropout, m.lora_targets, decide, cfg.system.sharding
    )
    return model if cfg.run.dry_run and choice.path is None else model.to(device)


def said_steps(cfg: TrainConfig, data: Data, world_size: int, say, decide) -> tuple[int, str]:
    """Optimizer steps (sft_steps) of the dataset's own samples (conversations, pairs, packed rows);
    with TOKEN_BUDGET the epoch's mean rows stand for BATCH_SIZE in summary.json. The median and
    longest of each side's lengths (the dataset's own sides), in tokens, said in one line."""
    total_steps, why, rows_per_micro = sft_steps(cfg, data.dataset, world_size, say, decide)
    if cfg.data.token_budget is not None:  # batch sizes vary: report the epoch's mean, not BATCH_SIZE
        effective = rows_per_micro * cfg.optim.gradient_accumulation_steps * world_size
        data.summary.update(batch_size=round(rows_per_micro, 2), effective_batch_size=round(effective, 2))
    say("; ".join(f"{side} lengths in tokens: median {int(np.median(v))}, max {int(v.max())}"
                  for side, v in data.conversations.side_lengths().items()))
    return total_steps, why


def door_settings(cfg: TrainConfig, choice: ModelChoice, max_length: int, device, precision: str, say,
                  decide) -> dict:
    """What a chat data door (SFT's, preference training's) is handed besides DATA_PATH's settings and the
    tokenizer: the layout, the lengths, the device, the attention the model can take, the plan's voice."""
    return dict(layout=choice.family.layout, max_length=max_length, device=device, precision=precision,
                eval_batches=cfg.run.eval_batches, set_attention=partial(attention_fits, choice.config),
                say=say, decide=decide, compile_on=cfg.model.compile)


class SFTSource:
    """SFT: the model and tokenizer of MODEL_PATH (or the newest pretraining run's final/), or a
    new model of MODEL_CONFIG / MODEL_SIZE (sft_scratch.py), and conversations from DATA_PATH (or
    the built-in pairs), padded, grouped, budgeted or packed. Each call returns what it made; the
    calls preference training shares (dpo.py) are this module's functions."""

    shapes_vary = True  # padded to each batch's longest; packed rows gather conversations x longest

    def refuse(self, cfg: TrainConfig) -> None:
        sft_scratch.refuse_both(cfg)

    def choose(self, cfg: TrainConfig, device: torch.device, say, decide) -> ModelChoice:
        return choose_fine_tuned(cfg, device, say, decide)

    def tokenizer(self, cfg: TrainConfig, choice: ModelChoice, max_length: int, say, decide):
        return chat_tokenizer(cfg, choice, max_length, say, decide)

    def data(self, cfg: TrainConfig, choice: ModelChoice, tok, device, precision: str, max_length: int, say,
             decide) -> Data:
        """The encoded conversations, the held-out ones, and how to batch them."""
        settings = door_settings(cfg, choice, max_length, device, precision, say, decide)
        data = fine_tuning_data(cfg.data, tok, **settings)
        where = {"model_path": str(choice.path)} if choice.path else {"model_path": None,
                                                                       "model_config": cfg.model.model_config}
        data.summary = {**where, **data.summary}
        return data

    def steps(self, cfg: TrainConfig, data: Data, world_size: int, say, decide) -> tuple[int, str]:
        """Optimizer steps of BATCH_SIZE conversations (packed rows with PACKING=1); see said_steps."""
        return said_steps(cfg, data, world_size, say, decide)

    def model(
        self, cfg: TrainConfig, choice: ModelChoice, tok, data: Data, device, decide
    ) -> torch.nn.Module:
        return fine_tuned_model(cfg, choice, tok, data, device, decide)

    def objective(self, cfg, choice, model, data: Data, device, precision: str, max_length: int, trained: int,
                  say, decide):
        """(the token loss averaged as LOSS_MEAN says, plan.token_objective; the data as it is); preference
        training's is dpo.py's."""
        return token_objective(cfg, choice), data


def sft_steps(
    cfg: TrainConfig, dataset, world_size: int, say, decide, unit: str | None = None
) -> tuple[int, str, float]:
    """(optimizer steps, why, rows per micro-batch): BATCH_SIZE rows, or TOKEN_BUDGET's mean. unit: what
    a row is (default: the dataset's own: conversations, source -> target pairs, pairs, packed rows)."""
    if cfg.data.token_budget is not None:
        batches = BudgetSampler(dataset.lengths, cfg.data.token_budget, seed=cfg.system.seed,
                                source_lengths=getattr(dataset, "source_lengths", None)).batches()
        micro, rows_per_micro = len(batches) // world_size, len(dataset) / max(1, len(batches))
        decide(
            "batch_size",
            f"~{rows_per_micro:.1f}",
            f"TOKEN_BUDGET={cfg.data.token_budget} padded tokens per micro-batch{dataset.budget_note}; "
            "BATCH_SIZE unused",
        )
        if cfg.data.length_grouping:
            say("LENGTH_GROUPING=1 adds nothing with TOKEN_BUDGET, which groups by length itself")
    else:  # every rank reads 1/world_size of the epoch
        micro, rows_per_micro = (
            len(dataset) // world_size // cfg.optim.batch_size,
            float(cfg.optim.batch_size),
        )
    total_steps, why = plan_sft_steps(
        cfg, len(dataset), micro, rows_per_micro, world_size, unit or dataset.unit
    )
    return total_steps, why, rows_per_micro
