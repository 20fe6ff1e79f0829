"""`python -m train dpo`: where a preference-training run's model, data and loss come from (DPOSource).

The plan is make_plan's, as for pretraining and SFT, and the step, loop, checkpoints and run folder are
shared. The model and its tokenizer are SFT's (sft.py's functions, composed: MODEL_PATH, default the
newest completed SFT run's final/; LoRA), the data is train/data/pref's front door (pairs of chosen and
rejected replies), and the loss is train/core/preference's, handed to the step as the plan's objective
with the reference model REFERENCE decides (train/run/plan/dpo_reference.py).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch

from config import MODE_DEFAULTS, TrainConfig
from train.config import knobs
from train.core.errors import UsageError
from train.core.preference import DPO_LOSS, PreferenceObjective, build_reference
from train.core.units import MIB
from train.data.loader import Data
from train.data.preference import preference_data
from train.distributed.process_group import gather
from train.models.family import dropout_of, set_dropout
from train.run.plan import dpo_reference, sft, sft_scratch
from train.run.plan.make import ModelChoice

DEFAULTS = MODE_DEFAULTS["dpo"]
"""The DPO knobs' values when empty: config.py's (config.resolve sets them; a config made without it, or an
older run's, may still hold None)."""


def settings(cfg: TrainConfig) -> dict:
    """The DPO knobs as the run uses them: empty ones at DEFAULTS."""
    values = {name: knobs.value(cfg, name) for name in DEFAULTS}
    return {name: DEFAULTS[name] if value is None else value for name, value in values.items()}


def refuse_preference(cfg: TrainConfig) -> None:
    """What preference training cannot do, one line each, before any work."""
    if sft_scratch.asked(cfg):
        which = "MODEL_CONFIG" if cfg.model.model_config is not None else "MODEL_SIZE"
        raise UsageError(f"{which}: preference training fine-tunes a trained chat model; set MODEL_PATH (or "
                         f"leave it empty: the newest completed SFT run's final/)")
    if cfg.optim.loss_mean is not None:
        raise UsageError(f"LOSS_MEAN={cfg.optim.loss_mean}: preference training's loss is the mean over the "
                         f"step's pairs; leave LOSS_MEAN empty")
    loss, reference = settings(cfg)["dpo_loss"], cfg.model.reference
    if cfg.optim.beta == 0:  # one field with GRPO's BETA, where 0 means no reference
        raise UsageError("BETA=0: preference training's beta scales the log-ratios; above 0 (empty: 0.1)")
    for name in ("beta", "label_smoothing", "simpo_gamma"):  # a setting the loss never reads would be ignored
        value = knobs.value(cfg, name)
        if value not in (None, DEFAULTS[name]) and name not in DPO_LOSS[loss].reads:
            reads = ", ".join(knobs.env_name(n) for n in sorted(DPO_LOSS[loss].reads))
            raise UsageError(f"{knobs.env_name(name)}={value:g}: DPO_LOSS={loss} ignores it (it reads "
                             f"{reads}); leave {knobs.env_name(name)} empty")
    if reference is not None and not DPO_LOSS[loss].reference:
        raise UsageError(f"REFERENCE={reference}: DPO_LOSS={loss} is reference-free; leave REFERENCE empty")
    if reference == "adapters" and not cfg.model.lora_r:
        raise UsageError("REFERENCE=adapters: the reference is the base model under LoRA's adapters; set "
                         "LORA_R (or REFERENCE=copy / precomputed)")
    if cfg.system.sharding != "none" and reference == "copy":
        raise UsageError(f"REFERENCE=copy with SHARDING={cfg.system.sharding}: a whole copy on every process "
                         f"defeats the sharding; use REFERENCE=precomputed")


def copy_room(cfg: TrainConfig, model, device, precision: str, max_length: int) -> dict:
    """The figures REFERENCE's choice weighs, in bytes: the frozen copy's weights (the estimate's own
    count, fp32), the run's estimated peak without it (train/models/estimate.py at the planned
    micro-batch), and what the device has for the run (capacity_mb: MAX_MEMORY_MB, free VRAM, or host
    RAM; a dry run on CUDA reads the card's properties, making no CUDA context)."""
    from train.core.device import memory_capacity
    from train.core.model import count_params
    from train.models.estimate import estimate_for_run
    from train.models.freeze import trainable_of
    from train.run.plan.adapt import capacity_mb

    n_params = count_params(model)
    without = copy.deepcopy(cfg)
    without.model.reference = "precomputed"  # the run as it would be without the copy
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    est = estimate_for_run(model.config, n_params, without, max_length, precision, device.type, world,
                           trainable_of(model))
    if cfg.run.dry_run and device.type == "cuda":
        cap, what = memory_capacity(device, cfg.system.max_memory_mb)
    else:
        cap_mb, what = capacity_mb(device, cfg.system.max_memory_mb)
        cap = None if cap_mb is None else cap_mb * MIB
    return {"copy": n_params * 4, "run": est["peak"], "capacity": cap, "what": what}


def tightest(rooms: list[dict]) -> dict:
    """Of copy_room's figures from every rank, those of the rank with the least room left: each rank
    measures its own device (free memory differs by the moment it is read), and all ranks must choose
    the same REFERENCE, one that fits on every device."""
    def left(room: dict) -> float:
        return float("inf") if room["capacity"] is None else room["capacity"] - room["run"]

    return min(rooms, key=left)


def short_run(cfg: TrainConfig, pairs: int, trained: int) -> bool:
    """The run reads fewer pairs than there are, one whole model per process: a copy may cost less."""
    return trained < pairs and cfg.system.sharding == "none"


def copy_may_be_chosen(cfg: TrainConfig, pairs: int, trained: int) -> bool:
    """Whether decide_reference may choose a frozen copy: REFERENCE empty, a loss with a reference, no
    LoRA, and a short run; the room left beside the run then decides (copy_room)."""
    loss = settings(cfg)["dpo_loss"]
    return (cfg.model.reference is None and DPO_LOSS[loss].reference and not cfg.model.lora_r
            and short_run(cfg, pairs, trained))


def decide_reference(
    cfg: TrainConfig, pairs: int, trained: int, decide, room: dict | None = None
) -> str | None:
    """REFERENCE as the run uses it (set in the plan's config): the asked one, or the kit's choice.
    room: copy_room's figures; a copy that does not fit beside the run is never chosen."""
    loss = settings(cfg)["dpo_loss"]
    if not DPO_LOSS[loss].reference:
        return None
    if cfg.model.reference is not None:
        return cfg.model.reference
    short = short_run(cfg, pairs, trained)
    left = None if room is None or room["capacity"] is None else room["capacity"] - room["run"]
    if cfg.model.lora_r:
        kind, why = "adapters", ("LORA_R is set: the base model is the policy with its adapters off (no "
                                 "copy, no pass)")
    elif short and left is not None and room["copy"] > left:
        kind, why = "precomputed", (
            f"a frozen copy's weights ({room['copy'] / MIB:,.1f} MB) do not fit beside the run (estimated "
            f"peak {room['run'] / MIB:,.1f} MB of {room['capacity'] / MIB:,.1f} MB, {room['what']}: "
            f"{max(0.0, left) / MIB:,.1f} MB left): one forward pass over the {pairs} pairs (cached) instead")
    elif trained >= pairs:
        kind, why = "precomputed", (f"the run reads {trained} pairs, every one of the {pairs} at least once: "
                                    f"one forward "
                                    f"pass over the {pairs} before training (cached) costs less than a "
                                    f"frozen copy's memory and its forward every step")
    elif not short:  # SHARDING: a whole copy on every process defeats it
        kind, why = "precomputed", (f"SHARDING={cfg.system.sharding}: a frozen copy would be whole on every "
                                    f"process; one "
                                    f"forward pass over the {pairs} pairs before training (cached) instead")
    else:
        fits = "" if left is None else (f"; its {room['copy'] / MIB:,.1f} MB fit in the {left / MIB:,.1f} MB "
                                        f"left")
        kind, why = "copy", (f"a short run reads {trained} of {pairs} pairs: a frozen copy (a second set of "
                             f"weights on the device) costs less than a pass over them all{fits}")
    cfg.model.reference = kind
    decide("reference", kind, why)
    return kind


def dropout_off(cfg: TrainConfig, model, choice: ModelChoice, decide) -> torch.nn.Module:
    """DROPOUT empty or 0: every dropout off, LoRA's too, so the policy and its reference (in eval mode)
    score a pair alike and the first step's loss is ln 2 (TRL's disable_dropout, on by default); the
    settings read at forward (Llama's attention_dropout, T5's) as well as the torch.nn.Dropout layers.
    DROPOUT above 0: SFT's model took it (loaded_dropout; LoRA's is LORA_DROPOUT)."""
    if cfg.model.dropout:  # set by loaded_dropout, before LoRA
        return model
    asked = "DROPOUT empty" if cfg.model.dropout is None else "DROPOUT=0"
    if changed := set_dropout(model, 0.0):
        decide("dropout", 0.0, f"{asked}: {changed} dropout settings off (MODEL_PATH's own: "
               f"{dropout_of(choice.config)}), LoRA's too, as TRL's DPO does: policy and reference score a "
               f"pair alike (the first step's loss is ln 2)")
    return model


def loaded_dropout(cfg: TrainConfig, model, choice: ModelChoice, decide) -> None:
    """DROPOUT above 0 as SFT takes it; 0 or empty: dropout_off turns every dropout off, LoRA's too."""
    if cfg.model.dropout:
        sft.loaded_dropout(cfg, model, choice, decide)
        decide("dropout", cfg.model.dropout, f"DROPOUT={cfg.model.dropout:g}: the policy trains with "
               f"dropout, the reference scores without it, so the first step's loss is not ln 2 (TRL: "
               "disable_dropout=False)")


class DPOSource:
    """Preference training: SFT's model and tokenizer (MODEL_PATH or the newest SFT run's final/, LoRA:
    sft.py's functions), pairs from DATA_PATH, and the preference loss as the step's objective. Each call
    returns what it made."""

    shapes_vary = True  # pairs padded to each batch's longest, or each micro-batch packed

    def refuse(self, cfg: TrainConfig) -> None:
        sft_scratch.refuse_both(cfg)
        refuse_preference(cfg)

    def choose(self, cfg: TrainConfig, device: torch.device, say, decide) -> ModelChoice:
        return sft.choose_fine_tuned(cfg, device, say, decide)

    def tokenizer(self, cfg: TrainConfig, choice: ModelChoice, max_length: int, say, decide):
        return sft.chat_tokenizer(cfg, choice, max_length, say, decide)

    def model(self, cfg: TrainConfig, choice: ModelChoice, tok, data: Data, device,
              decide) -> torch.nn.Module:
        """SFT's model (MODEL_PATH, LoRA) with DPO's dropout (dropout_off, loaded_dropout)."""
        model = sft.fine_tuned_model(cfg, choice, tok, data, device, decide, dropout=loaded_dropout)
        return dropout_off(cfg, model, choice, decide)

    def data(self, cfg: TrainConfig, choice: ModelChoice, tok, device, precision: str, max_length: int, say,
             decide) -> Data:
        """The encoded pairs, the held-out ones, and how to batch them (train/data/pref)."""
        settings = sft.door_settings(cfg, choice, max_length, device, precision, say, decide)
        data = preference_data(cfg.data, tok, **settings, context=choice.context)
        data.summary = {"model_path": str(choice.path), **data.summary}
        return data

    def steps(self, cfg: TrainConfig, data: Data, world_size: int, say, decide) -> tuple[int, str]:
        """Optimizer steps of BATCH_SIZE pairs (packed rows with PACKING=1); see sft.said_steps."""
        return sft.said_steps(cfg, data, world_size, say, decide)

    def fill_reference(self, cfg: TrainConfig, data: Data, world_size: int, effective: int) -> str | None:
        """The reference the fill (no BATCH_SIZE of the user's, on a GPU) leaves room for, before
        REFERENCE is decided from the room left: "copy" where decide_reference may choose one at the
        steps this effective batch gives; None where it will not (every pair read: precomputed; LoRA;
        SHARDING; a reference-free loss) or REFERENCE is set (the estimate reads it)."""
        per_rank, n = max(1, math.ceil(effective / world_size)), len(data.dataset)
        sized = copy.deepcopy(cfg)
        sized.optim.batch_size, sized.optim.gradient_accumulation_steps = per_rank, 1
        try:  # the fill keeps the effective batch, so these are the run's steps (whole-number rounding aside)
            steps, _ = sft.plan_sft_steps(sized, n, n // world_size // per_rank, per_rank, world_size)
        except UsageError:  # less data than one step: the plan's step count refuses it after the fill
            return None
        return "copy" if copy_may_be_chosen(cfg, len(data.conversations), steps * effective) else None

    def objective(self, cfg: TrainConfig, choice: ModelChoice, model, data: Data, device, precision: str,
                  max_length: int, trained: int, say, decide):
        """(the preference objective, a new Data): the reference REFERENCE decides, made now from the
        policy as it starts (a copy, or the cached pass whose log-probs the new Data's batches carry)."""
        s = settings(cfg)
        layout = choice.family.layout
        room = None
        if cfg.model.reference is None and DPO_LOSS[s["dpo_loss"]].reference and not cfg.model.lora_r:
            room = tightest(gather(copy_room(cfg, model, device, precision, max_length)))
        kind = decide_reference(cfg, len(data.conversations), trained, decide, room)
        reference = None
        if kind is not None and not cfg.run.dry_run:
            if kind == "precomputed":
                data = dpo_reference.with_precomputed(data, model, device, precision, layout,
                                                      cfg.data.cache_dir, say)
            reference = build_reference(kind, model, layout=layout)
        data = replace(data, summary={**data.summary, **s, "reference": kind})
        objective = PreferenceObjective(layout, s["dpo_loss"], s["beta"], s["label_smoothing"],
                                        s["simpo_gamma"], s["sft_weight"], reference)
        return objective, data
