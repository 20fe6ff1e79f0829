"""GRPO's loss and advantage settings, one frozen value (the integration fills it from config.py).

Each field is TRL 1.16's GRPOConfig field of the same meaning (trl/trainer/grpo_config.py), with
TRL's default; docs/grpo.md maps them to the launcher variables. A bad value is refused in one line
that names the launcher variable, as config.py's checks do.
"""

from __future__ import annotations

from dataclasses import dataclass

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
"""The loss types built here (loss.LOSS_TYPE): TRL 1.16's eight."""
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass(frozen=True)
class GrpoKnobs:
    loss_type: str = "dapo"
    """LOSS_TYPE: how the token losses become one number (TRL's default dapo: over the step's tokens)."""
    beta: float = 0.0
    """BETA: the k3 KL-to-reference weight; 0 needs no reference model (TRL's default)."""
    epsilon: float = 0.2
    """EPSILON: the ratio's lower clip, 1 - epsilon (and the upper one without EPSILON_HIGH)."""
    epsilon_high: float | None = None
    """EPSILON_HIGH: the ratio's upper clip, 1 + epsilon_high (DAPO's clip-higher: 0.28); cispo's cap
    of the weight itself (TRL suggests 5.0); None: EPSILON."""
    delta: float | None = None
    """DELTA: two-sided GRPO (INTELLECT-2): the unclipped ratio capped at delta; None: off."""
    sapo_temperature_pos: float = 1.0
    """SAPO_TEMPERATURE_POS: sapo's gate temperature where the advantage is positive."""
    sapo_temperature_neg: float = 1.05
    """SAPO_TEMPERATURE_NEG: sapo's gate temperature elsewhere."""
    vespo_k_pos: float = 2.0
    """VESPO_K_POS: vespo's power k where the advantage is >= 0 (how hard a sequence ratio below 1 is
    down-weighted)."""
    vespo_lambda_pos: float = 3.0
    """VESPO_LAMBDA_POS: vespo's decay lambda where the advantage is >= 0 (how hard a ratio above 1 is)."""
    vespo_k_neg: float = 3.0
    """VESPO_K_NEG: vespo's k elsewhere."""
    vespo_lambda_neg: float = 2.0
    """VESPO_LAMBDA_NEG: vespo's lambda elsewhere."""
    importance_sampling_level: str = "token"
    """IMPORTANCE_SAMPLING_LEVEL: token, or sequence (GSPO: the mean log-ratio of each completion)."""
    num_iterations: int = 1
    """NUM_ITERATIONS (mu): optimizer steps taken on one generation batch."""
    max_completion_length: int = 512
    """MAX_COMPLETION_LENGTH: tokens sampled at most; dr_grpo's constant divisor."""
    temperature: float = 1.0
    """TEMPERATURE: sampling's, and the logits are divided by it before every log-prob (TRL's way)."""
    mask_truncated_completions: bool = False
    """MASK_TRUNCATED_COMPLETIONS: a completion that ended without EOS counts no token in the loss."""
    use_bias_correction_kl: bool = True
    """The KL term times the importance ratio (DeepSeek-V3.2; TRL 1.16's default)."""
    num_generations: int = 8
    """NUM_GENERATIONS (G): completions per prompt, one group."""
    scale_rewards: str = "group"
    """SCALE_REWARDS: advantages divided by the group's reward std, the batch's, or none (Dr. GRPO)."""
    reward_weights: tuple[float, ...] | None = None
    """REWARD_WEIGHTS: one weight per reward function; None: 1 each."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """Weighted sum of the rewards then normalised, or each normalised then summed (GDPO)."""

    def __post_init__(self):
        choices = (
            ("LOSS_TYPE", self.loss_type, LOSS_TYPES), ("SCALE_REWARDS", self.scale_rewards, SCALE_REWARDS),
            ("IMPORTANCE_SAMPLING_LEVEL", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS),
            ("MULTI_OBJECTIVE_AGGREGATION", self.multi_objective_aggregation, AGGREGATIONS),
        )  # fmt: skip
        for variable, value, allowed in choices:
            if value not in allowed:
                raise ValueError(f"{variable}={value}: expected one of {', '.join(allowed)}")
        if self.num_generations < 2:
            g = self.num_generations
            raise ValueError(f"NUM_GENERATIONS={g}: 2 at least (a group of 1 has no baseline)")
        if self.num_iterations < 1 or self.max_completion_length < 1:
            raise ValueError(f"NUM_ITERATIONS={self.num_iterations}, MAX_COMPLETION_LENGTH="
                             f"{self.max_completion_length}: each at least 1")  # fmt: skip
        if not self.temperature > 0:
            raise ValueError(f"TEMPERATURE={self.temperature}: above 0 (the logits are divided by it)")
        high = self.epsilon_high
        if self.beta < 0 or not 0 <= self.epsilon < 1 or high is not None and high < 0:
            raise ValueError(f"BETA={self.beta}, EPSILON={self.epsilon}, EPSILON_HIGH={high}: BETA >= 0, "
                             "0 <= EPSILON < 1, EPSILON_HIGH >= 0")  # fmt: skip
        if not (self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0):
            raise ValueError(f"SAPO_TEMPERATURE_POS={self.sapo_temperature_pos}, SAPO_TEMPERATURE_NEG="
                             f"{self.sapo_temperature_neg}: each above 0")  # fmt: skip
        ks, lambdas = (self.vespo_k_pos, self.vespo_k_neg), (self.vespo_lambda_pos, self.vespo_lambda_neg)
        if min(ks) < 0 or min(lambdas) <= 0:
            raise ValueError(f"VESPO_K_POS={ks[0]}, VESPO_K_NEG={ks[1]}, VESPO_LAMBDA_POS={lambdas[0]}, "
                             f"VESPO_LAMBDA_NEG={lambdas[1]}: k at least 0, lambda above 0")  # fmt: skip
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            # vespo makes its own sequence weight from the token log-ratios; the level would change
            # nothing but the KL term's correction (TRL warns)
            raise ValueError(f"LOSS_TYPE=vespo, IMPORTANCE_SAMPLING_LEVEL={self.importance_sampling_level}: "
                             "vespo weighs each completion by its own sequence ratio; set "
                             "IMPORTANCE_SAMPLING_LEVEL=token (the default)")  # fmt: skip
        if self.delta is not None and self.delta <= 1:
            raise ValueError(f"DELTA={self.delta}: above 1 (TRL recommends above 1 + EPSILON_HIGH), or unset")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def upper_epsilon(self) -> float:
        """EPSILON_HIGH, or EPSILON where it is unset (TRL's epsilon_high)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def keeps_old_logps(self, gradient_accumulation_steps: int, steps_per_generation: int | None = None,
                        ) -> bool:  # fmt: skip
        """Whether the generation pass must keep the policy's log-probs (old_per_token_logps): TRL's
        test, gradient_accumulation_steps % (steps_per_generation x num_iterations) != 0. With the kit's
        one generation per optimizer step (steps_per_generation = the accumulation), that is
        num_iterations > 1; otherwise the old log-probs are the current ones, detached."""
        spg = steps_per_generation or gradient_accumulation_steps
        return gradient_accumulation_steps % (spg * self.num_iterations) != 0
