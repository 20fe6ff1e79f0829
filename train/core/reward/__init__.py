"""Reward training's (GRPO's) loss core: the knobs (knobs), group-relative advantages from the reward
functions' scores and TRL's metrics of them (advantages), per-token log-probs and entropies of the
sampled completions without the (tokens x vocab) logits (logps), and the clipped policy loss by
LOSS_TYPE with a micro-batch's share of the step (loss). Every formula is TRL 1.16's GRPOTrainer's.
Imports torch and train/core's other modules only.
The rewards: the built-in reward functions, pure functions of the completions and the data's columns
(builtin), and the guarded call that scores a batch with several at once, each bounded in time and its
answer checked (guard); loading a user's reward file is run-level work (train/run/plan/reward_funcs.py).
Sampling G completions per prompt under the policy's current weights (sampling), and the KV cache that
sampling holds, counted (kv_cache)."""

from train.core.reward.advantages import (
    completion_metrics,
    group_advantages,
    loss_mask,
    stack_rewards,
    truncated,
)
from train.core.reward.knobs import LOSS_TYPES, GrpoKnobs
from train.core.reward.logps import Completions, completion_logps, model_inputs
from train.core.reward.loss import LOSS_TYPE, StepCounts, grpo_loss, policy_loss, step_counts

__all__ = [
    "LOSS_TYPE", "LOSS_TYPES", "Completions", "GrpoKnobs", "StepCounts", "completion_logps",
    "completion_metrics", "group_advantages", "grpo_loss", "loss_mask", "model_inputs", "policy_loss",
    "stack_rewards", "step_counts",
    "truncated",
]
