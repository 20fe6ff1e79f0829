"""Build everything a run needs before its folder exists: the plan (train/run/plan/make.py
make_plan, the same for every mode) and, for pretraining, where its model, tokenizer and data come
from (PretrainingSource: a new model of MODEL_SIZE in MODEL_FAMILY, or MODEL_CONFIG; the corpus's
tokenizer and data from train/data's front doors). `python -m train sft` takes them from
train/run/plan/sft.py instead. Nothing here writes to runs/."""

from __future__ import annotations

import torch

from config import TrainConfig
from train.core.errors import UsageError
from train.data.loader import Data
from train.data.pretraining import pretraining_data
from train.data.tokenizer import corpus_tokenizer
from train.distributed.process_group import SINGLE, Dist
from train.models.build import build_config, context_length, new_model, size_vocab
from train.models.family import family_of
from train.run.plan.adapt import over_memory
from train.run.plan.dpo import DPOSource
from train.run.plan.fill import Fill
from train.run.plan.grpo import GRPOSource
from train.run.plan.make import (
    Chosen,
    ModelChoice,
    Plan,
    make_plan,
    note_family_ignored,
    shortest_limit,
    token_objective,
)
from train.run.plan.sft import SFTSource


def plan_steps(cfg: TrainConfig, n_samples: int, world_size: int = 1) -> tuple[int, str]:
    """Optimizer steps for this run: the smallest of MAX_STEPS, EPOCHS and MAX_SAMPLES."""
    effective = cfg.effective_batch_size(world_size)
    # every rank reads its own 1/world_size of the data
    per_epoch = n_samples // world_size // cfg.optim.batch_size // cfg.optim.gradient_accumulation_steps
    if per_epoch == 0:
        processes = " x processes" if world_size > 1 else ""
        raise UsageError(
            f"DATA_PATH: {n_samples} sequences of MAX_LENGTH tokens are fewer than one optimizer step "
            f"needs ({effective} = BATCH_SIZE x GRADIENT_ACCUM{processes}); add data or lower those"
        )
    steps, source = shortest_limit(cfg, per_epoch, effective)
    return steps, f"{source}; one epoch is {per_epoch} steps of {effective} sequences"


def build(asked: TrainConfig, say, world: Dist = SINGLE, chosen: Chosen | Fill | None = None) -> Plan:
    """The plan of a run and the objects it needs. `asked` is left as it is: what was decided
    (adapted workers, derived accumulation, the demo budget, AUTO_BATCH's `chosen` micro-batch ...)
    is in Plan.cfg and Plan.decisions."""
    source = {"sft": SFTSource, "dpo": DPOSource, "grpo": GRPOSource}.get(asked.run.mode, PretrainingSource)()
    plan = make_plan(asked, say, world, source, chosen)
    warning = None if plan.cfg.run.dry_run else over_memory(plan)  # a dry run says it by its estimate
    if warning:
        say(warning)
    return plan


class PretrainingSource:
    """Pretraining: a new model (MODEL_SIZE or MODEL_CONFIG), the corpus's tokenizer, and packed
    windows of a token cache. Each call returns what it made."""

    shapes_vary = False  # every batch is (BATCH_SIZE, MAX_LENGTH), T5's spans too

    def refuse(self, cfg: TrainConfig) -> None:
        """Nothing of pretraining's own: make_plan refuses a knob it does not read (knobs.refuse_unread)."""

    def choose(self, cfg: TrainConfig, device: torch.device, say, decide) -> ModelChoice:
        """The model's shape first (vocab set once the tokenizer is known), so a MAX_LENGTH longer
        than its context stops before any data work."""
        model_size, demo = choose_model_size(cfg, device, say, decide)
        config = build_config(
            model_size,
            cfg.model.model_config,
            cfg.data.vocab_size,
            0,
            cfg.model.model_family,
            cfg.model.dropout,
        )
        family = family_of(config)
        if cfg.model.model_config is not None:
            family.layout.decide_kind(decide, f"model_type {config.model_type!r}: AutoModelForSeq2SeqLM, "
                                      "T5's span corruption")
        m = cfg.model.model_config
        variable = f"MODEL_CONFIG={m}" if m else f"MODEL_SIZE={model_size}"
        return ModelChoice(family=family, size=model_size, context=context_length(config), variable=variable,
                           demo=demo, config=config)

    def tokenizer(self, cfg: TrainConfig, choice: ModelChoice, max_length: int, say, decide):
        return corpus_tokenizer(cfg.data, say)

    def data(self, cfg: TrainConfig, choice: ModelChoice, tok, device, precision: str, max_length: int, say,
             decide) -> Data:
        return pretraining_data(
            cfg.data,
            tok,
            max_length=max_length,
            objective=choice.family.objective,
            eval_batches=cfg.run.eval_batches,
            seed=cfg.system.seed,
            say=say,
            decide=decide,
        )

    def steps(self, cfg: TrainConfig, data: Data, world_size: int, say, decide) -> tuple[int, str]:
        return plan_steps(cfg, len(data.dataset), world_size)

    def model(
        self, cfg: TrainConfig, choice: ModelChoice, tok, data: Data, device, decide
    ) -> torch.nn.Module:
        """The new model, its vocabulary and special ids from the tokenizer (T5's sentinels included)."""
        size_vocab(choice.config, tok, decide)
        return new_model(
            choice.config, cfg.model.gradient_checkpointing, cfg.system.seed, cfg.run.dry_run, device
        )

    def objective(self, cfg, choice, model, data: Data, device, precision: str, max_length: int, trained: int,
                  say, decide):
        """(the token loss, plan.token_objective; the data as it is)."""
        return token_objective(cfg, choice), data


def choose_model_size(cfg: TrainConfig, device: torch.device, say, decide) -> tuple[str, bool]:
    """MODEL_SIZE, "custom" for MODEL_CONFIG, or the default: GPT-2 small on a GPU, the nano
    model as a short demo on a CPU. Returns (size, demo)."""
    if cfg.model.model_config is not None:
        decide("model_size", "custom", f"MODEL_CONFIG={cfg.model.model_config}")
        note_family_ignored(cfg, say, "MODEL_CONFIG's model_type decides the model")
        return "custom", False
    if cfg.model.model_size is not None:
        return cfg.model.model_size, False
    demo = device.type == "cpu"
    model_size = "nano" if demo else "small"
    reason = (
        "no GPU: the nano model for a short CPU demo (set MODEL_SIZE to train another size)"
        if demo
        else "default on a GPU (GPT-2 small)"
    )
    decide("model_size", model_size, reason)
    if demo:
        say("No GPU found: running the nano model as a short CPU demo (set MODEL_SIZE to choose).")
    return model_size, demo
