"""Build everything a run needs before its folder exists: the plan (train/run/plan/plan.py
make_plan, the same for every mode) and, for pretraining, where its model and data come from
(PretrainingSource: a new model; the data from train/data/pretraining.py's front door).
`python -m train sft` takes its model and data from train/run/plan/sft.py instead. Nothing here
writes to runs/."""

from __future__ import annotations

import torch

from config import TrainConfig
from train.core import model as model_lib
from train.core.errors import UsageError
from train.core.measure import estimate
from train.data.loader import Data
from train.data.pretraining import pretraining_data
from train.distributed.distributed import SINGLE, Dist
from train.run.plan.adapt import over_memory
from train.run.plan.plan import Chosen, Plan, make_plan, shortest_limit
from train.run.plan.sft import SFTSource, refuse_sft_settings


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


def build(asked: TrainConfig, say, world: Dist = SINGLE, chosen: Chosen | None = None) -> Plan:
    """The plan of a run and the objects it needs. `asked` is left as it is: what was decided
    (adapted workers, derived accumulation, the demo budget, AUTO_BATCH's `chosen` micro-batch ...)
    is in Plan.cfg and Plan.decisions."""
    source = (SFTSource if asked.run.mode == "sft" else PretrainingSource)(world.world_size)
    plan = make_plan(asked, say, world, source, chosen)
    warning = None if plan.cfg.run.dry_run else over_memory(plan)  # a dry run says it by its estimate
    if warning:
        say(warning)
    return plan


class PretrainingSource:
    """Pretraining: a new model (MODEL_SIZE or MODEL_CONFIG) and packed windows of a token cache."""

    def __init__(self, world_size: int = 1):
        self.world_size = world_size

    def refuse(self, cfg: TrainConfig) -> None:
        refuse_sft_settings(cfg)

    def model(self, cfg: TrainConfig, device: torch.device, say, decide) -> tuple[str, int, bool]:
        """(model size, context length, CPU demo). The model's shape first (vocab set once the
        tokenizer is known), so a MAX_LENGTH longer than its context stops before any data work."""
        model_size, demo = choose_model_size(cfg, device, say, decide)
        self.model_size = model_size
        self.hf_cfg = model_lib.build_config(
            model_size, cfg.model.model_config, cfg.data.vocab_size, 0, cfg.model.model_family
        )
        if cfg.model.model_config is not None and model_lib.is_seq2seq(self.hf_cfg):
            decide("model_kind", "seq2seq", f"model_type {self.hf_cfg.model_type!r}: AutoModelForSeq2SeqLM, T5's span corruption")
        return model_size, model_lib.context_length(self.hf_cfg), demo

    def data(self, cfg: TrainConfig, device, precision: str, max_length: int, say, decide) -> Data:
        # From the config alone, before the data work and before anything is allocated.
        m = cfg.model.model_config
        variable = f"MODEL_CONFIG={m}" if m else f"MODEL_SIZE={self.model_size}"
        estimate.refuse_unfit(self.hf_cfg, cfg, max_length, precision, device, self.world_size, variable)
        hf_cfg = self.hf_cfg
        data = pretraining_data(cfg.data, max_length=max_length, seq2seq=model_lib.is_seq2seq(hf_cfg),
                                eval_batches=cfg.run.eval_batches, seed=cfg.system.seed, say=say, decide=decide)
        # The model's vocab and special tokens from the tokenizer (sentinels included).
        tok = data.tokenizer
        hf_cfg.vocab_size = model_lib.padded_vocab(len(tok))
        if hf_cfg.vocab_size != len(tok):
            decide("vocab_size", hf_cfg.vocab_size, f"tokenizer's {len(tok)} padded to a multiple of 64")
        model_lib.set_special_tokens(hf_cfg, tok.convert_tokens_to_ids(tok.eos_token), tok.pad_token_id)
        return data

    def steps(self, cfg: TrainConfig, data: Data, world_size: int, say, decide) -> tuple[int, str]:
        return plan_steps(cfg, len(data.dataset), world_size)

    def finish_model(self, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
        return make_model(cfg, self.hf_cfg, device)


def choose_model_size(cfg: TrainConfig, device: torch.device, say, decide) -> tuple[str, bool]:
    """MODEL_SIZE, "custom" for MODEL_CONFIG, or the default: GPT-2 small on a GPU, the nano
    model as a short demo on a CPU. Returns (size, demo)."""
    if cfg.model.model_config is not None:
        decide("model_size", "custom", f"MODEL_CONFIG={cfg.model.model_config}")
        if cfg.model.model_family != "gpt2":
            say(f"MODEL_FAMILY={cfg.model.model_family} is ignored: MODEL_CONFIG's model_type decides the model")
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


def make_model(cfg: TrainConfig, hf_cfg, device: torch.device) -> torch.nn.Module:
    if cfg.run.dry_run:
        with torch.device("meta"):  # shapes and parameter count only: nothing allocated anywhere
            return model_lib.build_model(hf_cfg, cfg.model.gradient_checkpointing, cfg.system.seed)
    return model_lib.build_model(hf_cfg, cfg.model.gradient_checkpointing, cfg.system.seed).to(device)
