"""`python -m train grpo`: where a reward-training run's model, prompts and loss come from (GRPOSource).

The plan is make_plan's, and the step, loop, checkpoints and run folder are shared. The model and its
tokenizer are SFT's (sft.py's functions, composed as DPOSource composes them): MODEL_PATH, default the
newest completed SFT or DPO run's final/ (a decision, printed); LoRA. The prompts come through
train/data/prompt's front door (DATA_PATH, or the built-in arithmetic task; the held-out ones of VAL_PATH or
VAL_FRACTION, split as the chat doors split theirs, for validation), the rewards are REWARD_FUNCS
(train/run/plan/reward_funcs.py), and the loss is train/core/reward's, handed to the step as the plan's
objective (GRPOObjective), whose rollout samples and scores the completions inside each step. BETA > 0
compares with a reference: REFERENCE=copy (a frozen copy) or adapters (LoRA's base); precomputed cannot
serve completions that do not exist before the step, and is refused.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from config import MODE_DEFAULTS, TrainConfig
from train.core.errors import UsageError
from train.core.model import frozen_copy
from train.core.reward.knobs import GrpoKnobs
from train.core.reward.objective import GRPOObjective
from train.core.reward.sampling import Sampler, SamplingSettings
from train.data.chat.batching import length_buckets
from train.data.chat.encode import stop_token_ids
from train.data.holdout import held_out
from train.data.loader import Data
from train.data.prompt.prompt_batches import PromptCollate, PromptDataset
from train.data.prompt.prompts import PromptSet, prompt_set
from train.distributed import process_group
from train.models.family import set_dropout
from train.run.plan import sft, sft_scratch
from train.run.plan.make import ModelChoice, shortest_limit
from train.run.plan.reward_funcs import build_rewards
from train.run.plan.sft_model import SFT_LAUNCHERS, choose_pretrained

DEFAULTS = MODE_DEFAULTS["grpo"]
DPO_LAUNCHERS = ("train_dpo", "train")
COMPLETION_ROOM = 256  # MAX_COMPLETION_LENGTH's default, where MAX_LENGTH leaves that much after the prompts
CPU_COMPLETION_ROOM = 32  # on a CPU: 64 rows of 256 sampled tokens a step would make `make grpo` no demo


def beta(cfg: TrainConfig) -> float:
    return DEFAULTS["beta"] if cfg.optim.beta is None else cfg.optim.beta


def taken_reference(cfg: TrainConfig) -> str | None:
    """The reference BETA > 0 compares with: REFERENCE, else LoRA's base (adapters) or a frozen copy."""
    if beta(cfg) == 0:
        return None
    return cfg.model.reference or ("adapters" if cfg.model.lora_r else "copy")


def grpo_knobs(cfg: TrainConfig) -> GrpoKnobs:
    """config.py's GRPO knobs as the loss core takes them (its own checks repeat config.py's ranges)."""
    o = cfg.optim
    weights = None if not o.reward_weights else tuple(float(w) for w in o.reward_weights.split(","))
    return GrpoKnobs(
        loss_type=o.loss_type,
        beta=beta(cfg),
        epsilon=o.epsilon,
        epsilon_high=o.epsilon_high,
        delta=o.delta,
        sapo_temperature_pos=o.sapo_temperature_pos,
        sapo_temperature_neg=o.sapo_temperature_neg,
        vespo_k_pos=o.vespo_k_pos,
        vespo_lambda_pos=o.vespo_lambda_pos,
        vespo_k_neg=o.vespo_k_neg,
        vespo_lambda_neg=o.vespo_lambda_neg,
        importance_sampling_level=o.importance_sampling_level,
        num_iterations=o.num_iterations,
        max_completion_length=o.max_completion_length or COMPLETION_ROOM,
        temperature=o.temperature or 1.0,
        mask_truncated_completions=o.mask_truncated_completions,
        num_generations=o.num_generations,
        scale_rewards=o.scale_rewards,
        reward_weights=weights,
        multi_objective_aggregation=o.multi_objective_aggregation,
    )


def refuse_grpo(cfg: TrainConfig) -> None:
    """What reward training cannot do, one line each, before any work (MODEL_SIZE, MODEL_CONFIG and KEEP_BEST
    are no knobs of its mode: refused by name before this)."""
    reference, b = cfg.model.reference, beta(cfg)
    if reference == "precomputed":
        raise UsageError("REFERENCE=precomputed: GRPO's completions are sampled during training, so no pass "
                         "before it can score them; use REFERENCE=copy or adapters")
    if reference is not None and b == 0:
        raise UsageError(f"REFERENCE={reference}: BETA is 0, so no reference is used; set BETA above 0 or "
                         f"leave REFERENCE empty")
    if reference == "adapters" and not cfg.model.lora_r:
        raise UsageError("REFERENCE=adapters: the reference is the base model under LoRA's adapters; set "
                         "LORA_R (or REFERENCE=copy)")
    if cfg.system.sharding != "none":
        raise UsageError(f"SHARDING={cfg.system.sharding}: GRPO's sampling is not built for sharded weights; "
                         f"use SHARDING=none (DDP with NPROC_PER_NODE works)")
    try:
        grpo_knobs(cfg)
    except ValueError as err:
        raise UsageError(str(err)) from None


def held_out_prompts(cfg: TrainConfig, prompts: PromptSet, load, decide):
    """(training prompts, held-out prompts): VAL_PATH's (read by load, errors naming VAL_PATH) or the last
    VAL_FRACTION of DATA_PATH's (or the built-in task's); None: no validation. VAL_FRACTION is 0 by default
    here (config.MODE_DEFAULTS): each pass samples NUM_GENERATIONS completions of every held-out prompt."""
    d = cfg.data
    train, val = held_out(d, cfg.run.eval_batches, prompts, load, decide)
    if val is None and d.val_fraction > 0:
        raise UsageError(f"VAL_FRACTION={d.val_fraction:g}: {len(prompts)} prompt(s) leave none to hold out "
                         "beside one to train on; add prompts, set VAL_PATH, or set VAL_FRACTION=0")
    return train, val


def newest_chat_model(cfg: TrainConfig, decide) -> str:
    """MODEL_PATH, or the final/ of the newest completed SFT or DPO run of a launcher under OUTPUT_DIR."""
    if cfg.model.model_path is not None:
        return cfg.model.model_path
    out = Path(cfg.run.output_dir)
    found = [
        c
        for c in (choose_pretrained(out, "sft", SFT_LAUNCHERS), choose_pretrained(out, "dpo", DPO_LAUNCHERS))
        if c is not None
    ]
    if not found:
        raise UsageError(f"MODEL_PATH is empty and {cfg.run.output_dir} holds no completed SFT or DPO run of "
                         f"a "
                         "launcher; make one with `MAX_STEPS=50 ./train_sft_custom.sh` or set MODEL_PATH to "
                         "a local transformers chat model folder")
    chosen = max(found, key=lambda c: c.time)
    stage = chosen.config.get("config", {}).get("run", {}).get("mode", "sft").upper()
    decide("model_path", str(chosen.final), f"the newest completed SFT or DPO run of a launcher (a {stage} "
           f"run; set MODEL_PATH to choose)")
    return str(chosen.final)


def prompt_room(cfg: TrainConfig, longest: int, max_length: int, device, decide) -> int:
    """MAX_COMPLETION_LENGTH as the run uses it (set in the plan's config)."""
    asked = cfg.optim.max_completion_length
    if asked is not None:
        return asked
    most = CPU_COMPLETION_ROOM if device.type == "cpu" else COMPLETION_ROOM
    room = min(most, max_length - longest)
    if room < 1:
        raise UsageError(f"MAX_LENGTH={max_length}: the longest prompt is {longest} tokens, leaving no room "
                         f"for a completion; raise MAX_LENGTH or shorten the prompts")
    cfg.optim.max_completion_length = room
    decide("max_completion_length", room, f"{most} at most{' on a CPU' if most != COMPLETION_ROOM else ''}, "
           f"within MAX_LENGTH={max_length} after the longest prompt ({longest} tokens)")
    return room


class GRPOSource:
    """Reward training: SFT's model and tokenizer (sft.py's functions), prompts from DATA_PATH or the built-in
    task, and the GRPO objective with its sampler, rewards and reference. Each call returns what it made."""

    shapes_vary = True  # prompts and completions padded to each batch's longest

    def refuse(self, cfg: TrainConfig) -> None:
        sft_scratch.refuse_both(cfg)
        refuse_grpo(cfg)

    def choose(self, cfg: TrainConfig, device: torch.device, say, decide) -> ModelChoice:
        cfg.model.model_path = newest_chat_model(cfg, decide)
        choice = sft.choose_fine_tuned(cfg, device, say, decide)
        choice.family.layout.causal_only(True, f"MODEL_PATH={choice.path}: an encoder-decoder; reward "
                                               f"training is "
                                         "built for causal LMs (GPT-2, Llama, Qwen3): the loss's log-probs "
                                         "read prompt and completion as one sequence")
        return choice

    def tokenizer(self, cfg: TrainConfig, choice: ModelChoice, max_length: int, say, decide):
        return sft.chat_tokenizer(cfg, choice, max_length, say, decide)

    def data(self, cfg: TrainConfig, choice: ModelChoice, tok, device, precision: str, max_length: int, say,
             decide) -> Data:
        """The prompts (rendered and encoded), the rewards (checked against the prompts' columns), the
        held-out prompts (VAL_PATH's, or VAL_FRACTION's last share: the chat doors' one split), and their
        collators."""
        o = cfg.optim
        rewards = build_rewards(o.reward_funcs, o.reward_weights, timeout=o.reward_timeout,
                                pattern=o.reward_pattern or "", length=o.reward_length or 0,
                                builtin_data=cfg.data.data_path is None)  # fmt: skip
        room = o.max_completion_length

        def load(d):
            return prompt_set(d.data_path, tok, skip_bad_records=d.skip_bad_records,
                              max_tokens=None if room is None else max_length - room, seed=cfg.system.seed,
                              say=say)  # fmt: skip

        loaded = load(cfg.data)
        rewards.check_columns(loaded.column_names)
        prompts, val = held_out_prompts(cfg, loaded, load, decide)
        if val is not None and cfg.data.val_path is not None:
            rewards.check_columns(val.column_names, "VAL_PATH")
        room = prompt_room(cfg, max(len(r) for r in prompts.ids + (val.ids if val else [])), max_length,
                           device, decide)  # fmt: skip
        summary = {"model_path": str(choice.path), "prompt_format": prompts.format, "prompts": len(loaded),
                   "val_prompts": len(val) if val is not None else 0,
                   "skipped_records": prompts.n_skipped, "reward_funcs": ",".join(rewards.names),
                   "num_generations": o.num_generations, "max_completion_length": room}  # fmt: skip
        return Data(
            tokenizer=tok,
            dataset=PromptDataset(prompts.ids, room),
            val_dataset=None if val is None else PromptDataset(val.ids, room),
            collate=PromptCollate(prompts.ids, tok.pad_token_id),
            val_collate=None if val is None else PromptCollate(val.ids, tok.pad_token_id),
            summary=summary,
            conversations=SimpleNamespace(prompts=prompts, rewards=rewards, held_out=val),
        )

    def model(
        self, cfg: TrainConfig, choice: ModelChoice, tok, data: Data, device, decide
    ) -> torch.nn.Module:
        """SFT's model (MODEL_PATH, LoRA); DROPOUT empty: off, so sampling (eval mode) and the loss's forward
        score a completion alike (NUM_ITERATIONS > 1's ratios start at 1)."""
        model = sft.fine_tuned_model(cfg, choice, tok, data, device, decide)
        if cfg.model.dropout is None and (changed := set_dropout(model, 0.0)):
            decide("dropout", 0.0, f"DROPOUT empty: {changed} dropout settings off, so sampling and the loss "
                   "score a completion alike")
        return model

    def steps(self, cfg: TrainConfig, data: Data, world_size: int, say, decide) -> tuple[int, str]:
        """Optimizer steps of BATCH_SIZE x GRADIENT_ACCUM prompts per process."""
        o = cfg.optim
        n = len(data.dataset)
        per_epoch = n // world_size // o.batch_size // o.gradient_accumulation_steps
        if per_epoch == 0:
            held = data.summary["prompts"] - n  # VAL_FRACTION's
            kept = f" (VAL_FRACTION held out {held} more)" if held else ""
            raise UsageError(f"DATA_PATH: {n} prompts{kept} are fewer than one optimizer step needs "
                             "(BATCH_SIZE x GRADIENT_ACCUM x processes); add prompts or lower those")
        per_step = o.batch_size * o.gradient_accumulation_steps * world_size
        steps, source = shortest_limit(cfg, per_epoch, per_step)
        lengths = data.dataset.lengths
        say(f"prompt lengths in tokens: median {int(lengths.median())}, max {int(lengths.max())}; "
            f"{o.num_generations} completions of each, at most {o.max_completion_length} tokens")
        return steps, (f"{source}; one epoch is {per_epoch} steps of {per_step} prompts x "
                       f"{o.num_generations} "
                       "completions")

    def fill_reference(self, cfg: TrainConfig, data: Data, world_size: int, effective: int) -> str | None:
        """The reference the fill (no BATCH_SIZE of the user's, on a GPU) leaves room for: the frozen copy
        objective() takes after the micro-batch where REFERENCE is empty (REFERENCE set: the estimate's)."""
        return "copy" if cfg.model.reference is None and taken_reference(cfg) == "copy" else None

    def objective(self, cfg: TrainConfig, choice: ModelChoice, model, data: Data, device, precision: str,
                  max_length: int, trained: int, say, decide):
        """(the GRPO objective, the data as it is): its sampler (seeded SEED + rank), the rewards, and where
        BETA > 0 the reference REFERENCE decides (copy: made now, from the policy as it starts)."""
        k = grpo_knobs(cfg)
        o, prompts, rewards = cfg.optim, data.conversations.prompts, data.conversations.rewards
        reference = taken_reference(cfg)
        if reference is not None:
            if cfg.model.reference is None:
                decide(
                    "reference",
                    reference,
                    "LORA_R is set: the policy with its adapters off"
                    if cfg.model.lora_r
                    else f"BETA={k.beta:g}: a frozen copy of the policy as it starts",
                )
            cfg.model.reference = reference
        world = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        settings = SamplingSettings(
            o.num_generations, o.max_completion_length, o.temperature, o.top_p, o.top_k
        )
        sampler = Sampler(
            settings,
            eos_ids=stop_token_ids(data.tokenizer),
            pad_id=data.tokenizer.pad_token_id,
            device=device,
            precision=precision,
            seed=cfg.system.seed,
            rank=world,
            tokenizer=data.tokenizer,
        )
        widths = None
        if cfg.model.compile:  # the loss's forwards; sampling (a KV cache that grows each token) stays eager
            widths = length_buckets(max(map(len, prompts.ids)) + o.max_completion_length)
            decide("length_buckets", ",".join(map(str, widths)),
                   f"COMPILE: the loss's forward pads the completions until prompt + completion is the "
                   f"smallest of {len(widths)} widths; one graph with dynamic lengths serves them all; the "
                   "sampling runs eager")  # fmt: skip
        ref_model = frozen_copy(model) if reference == "copy" and not cfg.run.dry_run else None
        objective = GRPOObjective(
            choice.family.layout,
            k,
            sampler,
            rewards,
            prompts.ids,
            prompts.for_rewards,
            reference=reference,
            ref_model=ref_model,
            held_out=data.conversations.held_out,
            device=device,
            precision=precision,
            gather=process_group.gather_rows if torch.distributed.is_initialized() else None,
            gather_names=process_group.gather_names if torch.distributed.is_initialized() else None,
            widths=widths,
        )
        # TRL's trainer_state: the run's optimizer steps (trained counts every rank's samples)
        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        objective.max_steps = trained // max(1, cfg.effective_batch_size(ranks))
        summary = {**data.summary, "loss_type": k.loss_type, "beta": k.beta, "reference": reference,
                   "num_iterations": k.num_iterations, "temperature": k.temperature}  # fmt: skip
        return objective, replace(data, summary=summary)
