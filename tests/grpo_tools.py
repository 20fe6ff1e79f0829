"""Helpers for the GRPO loss tests (and bench/grpo_vs_trl_loss.py): tiny GPT-2 and Llama models from
the kit's registry, a generation batch in TRL's layout (prompts left-padded, completions right-padded,
some cut short without EOS) scored by two reward functions through the kit's advantages, and the
independent computation the kit is checked against: TRL 1.16's formulas transcribed plainly from
trl/trainer/grpo_trainer.py (_generate_and_score_completions, _compute_loss) and trl/trainer/utils.py
(nanstd), on the full logits of a plain transformers forward, one process, no accumulation."""

from __future__ import annotations

import math

import torch

from train.core.reward import (
    Completions,
    GrpoKnobs,
    completion_logps,
    group_advantages,
    grpo_loss,
    loss_mask,
    model_inputs,
    stack_rewards,
    truncated,
)
from train.models.build import build_config, build_model

VOCAB, EOS, PAD = 96, 1, 0
SHAPES = {  # 2 layers, width 32
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, n_positions=64),
    "llama": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64),
}  # fmt: skip


def tiny(family: str, seed: int = 0):
    """MODEL_FAMILY's nano config from the registry, shrunk to SHAPES, no dropout, fp32."""
    cfg = build_config("nano", None, VOCAB, EOS, model_family=family)
    for key, value in SHAPES[family].items():
        setattr(cfg, key, value)
    cfg.pad_token_id = PAD
    return build_model(cfg, gradient_checkpointing=False, seed=seed)


def generation_batch(rows: int, seed: int, prompt_max: int = 6, completion_max: int = 8) -> tuple[dict, list]:
    """(batch, completions): TRL's padded tensors of `rows` random prompt / completion pairs, and the
    completion id lists (cut after the first EOS, as TRL's completion_ids_list). Every third completion
    runs to completion_max without EOS (truncated); the others end with EOS at a random length."""
    g = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for i in range(rows):
        p = int(torch.randint(2, prompt_max + 1, (1,), generator=g))
        prompts.append(torch.randint(2, VOCAB, (p,), generator=g).tolist())
        if i % 3 == 2:
            completions.append(torch.randint(2, VOCAB, (completion_max,), generator=g).tolist())
        else:
            c = int(torch.randint(1, completion_max, (1,), generator=g))
            completions.append(torch.randint(2, VOCAB, (c - 1,), generator=g).tolist() + [EOS])
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    batch = {
        "prompt_ids": torch.tensor([[PAD] * (width_p - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [PAD] * (width_c - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions]),
    }
    return batch, completions


def plain_logps(model, batch: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's per-token log-probs and entropies of the completion tokens from the whole logits: the
    model's own forward over prompt + completion, logits divided by the temperature, position t scored
    on token t + 1, the last C positions kept, 0 where the label is -100 (attention mask 0)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    c = batch["completion_ids"].shape[1]
    # the kit's one difference from TRL's forward: the positions the sampler drew at (TRL passes none)
    positions = torch.cat([batch["prompt_mask"], torch.ones_like(batch["completion_mask"])], 1).cumsum(1) - 1
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions.clamp(min=0))
    logits = logits.logits[:, :-1].float() / temperature
    labels = input_ids[:, 1:]
    logp_all = logits.log_softmax(-1)
    logps = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    keep = attention_mask[:, 1:] == 1
    return (logps * keep)[:, -c:], (entropy * keep)[:, -c:].detach()


CPU = torch.device("cpu")
G = 4  # NUM_GENERATIONS
ROWS = 2 * G
# Each loss type also carries one more of TRL's knobs, so every one of them meets the comparison.
EXTRA = {
    "grpo": dict(delta=1.1, epsilon=0.1),
    "bnpo": dict(mask_truncated_completions=True),
    "dr_grpo": dict(max_completion_length=12, epsilon=0.05),
    "dapo": dict(epsilon_high=0.28, epsilon=0.05),
    "cispo": dict(epsilon_high=1.05),  # the weight's cap (TRL suggests 5): low enough here to bite
    "sapo": dict(sapo_temperature_neg=1.5, sapo_temperature_pos=0.8),
    "luspo": dict(epsilon=0.1),
    "vespo": dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5),
}


def rewards_of(completions: list, seed: int) -> tuple[torch.Tensor, list[str]]:
    """Two reward functions: one scores every completion, the other only some (None elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    score = torch.randn(len(completions), generator=g).tolist()
    length = [float(len(c)) if i % 2 else None for i, c in enumerate(completions)]
    return stack_rewards({"score": score, "length": length}), ["score", "length"]


def scored_batch(knobs: GrpoKnobs, seed: int = 3) -> dict:
    """A generation batch after scoring, as the loss reads it: TRL's loss mask and advantages."""
    batch, completions = generation_batch(ROWS, seed)
    cut = truncated(completions, [EOS, PAD])
    batch["completion_mask"] = loss_mask(batch["completion_mask"], cut, knobs)
    per_func, names = rewards_of(completions, seed)
    batch["advantages"], _ = group_advantages(per_func, names, knobs)
    return batch


def generation_logps(model, batch: dict, knobs: GrpoKnobs) -> torch.Tensor:
    with torch.no_grad():
        return completion_logps(model, model_inputs(batch, CPU), Completions.of(batch), knobs.temperature)[0]


def take_step(model, batch: dict, knobs: GrpoKnobs) -> None:
    """One real optimizer step on the kit's loss (the first of NUM_ITERATIONS=2)."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    loss, _ = grpo_loss(model, batch, CPU, "fp32", knobs=knobs)
    loss.backward()
    opt.step()
    model.zero_grad(set_to_none=True)


def nanstd(tensor, dim=None, keepdim=False):  # trl/trainer/utils.py
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance *= correction
    std = torch.sqrt(variance)
    if keepdim:
        return std
    return std.squeeze(dim) if dim is not None else std.squeeze()


def plain_advantages(rewards_per_func, reward_weights, num_generations, scale_rewards, aggregation, names):
    """_generate_and_score_completions from the rewards to the advantages and the reward metrics."""
    metrics = {}
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
        mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
        if scale_rewards in ["group", "none"]:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = nanstd(rewards).expand_as(rewards)
        advantages = rewards - mean_grouped_rewards
        if scale_rewards != "none":
            advantages = advantages / (std_rewards + 1e-4)
    else:
        grouped = rewards_per_func.view(-1, num_generations, len(names))
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, len(names))
        rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
        std_rewards = nanstd(rewards).expand_as(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = nanstd(rewards).item()
    metrics["frac_reward_zero_std"] = is_std_zero.float().mean().item()
    return advantages, metrics


def _nanmin(t):
    return torch.tensor(float("nan")) if torch.isnan(t).all() else torch.min(t[~torch.isnan(t)])


def _nanmax(t):
    return torch.tensor(float("nan")) if torch.isnan(t).all() else torch.max(t[~torch.isnan(t)])


@torch.no_grad()
def get_gamma_weights(advantages, log_ratio_per_token, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    """GRPOTrainer.get_gamma_weights without vLLM's importance_sampling_ratio (None here)."""
    lower_clamp = math.log(1e-8)
    log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = advantages >= 0
    k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
    lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def plain_loss(per_token_logps, entropies, inputs: dict, k) -> tuple[torch.Tensor, dict]:
    """_compute_loss after the forward, one process, current_gradient_accumulation_steps 1, with
    num_items_in_batch = the batch's kept tokens (a generation batch of one micro-batch). k: GrpoKnobs."""
    mask = inputs["completion_mask"]
    epsilon_low, epsilon_high = k.epsilon, k.epsilon if k.epsilon_high is None else k.epsilon_high
    advantages = inputs["advantages"].unsqueeze(1)
    old_per_token_logps = inputs.get("old_per_token_logps")
    old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    log_ratio = per_token_logps - old_per_token_logps
    if k.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if k.beta != 0.0:
        ref_per_token_logps = inputs["ref_per_token_logps"]
        per_token_kl = (
            torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        )
        if k.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if k.loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif k.loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if k.delta is not None:
            coef_1 = torch.clamp(coef_1, max=k.delta)
        per_token_loss1 = coef_1 * advantages
        per_token_loss2 = coef_2 * advantages
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    elif k.loss_type == "vespo":
        phi_seq = get_gamma_weights(advantages, log_ratio, mask, k.vespo_k_pos, k.vespo_lambda_pos,
                                    k.vespo_k_neg, k.vespo_lambda_neg)  # fmt: skip
        per_token_loss = -phi_seq * advantages * per_token_logps
    else:  # sapo
        temperatures = torch.where(advantages > 0, k.sapo_temperature_pos, k.sapo_temperature_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    if k.beta != 0.0:
        per_token_loss = per_token_loss + k.beta * per_token_kl
    if k.loss_type in ["grpo", "sapo"]:
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif k.loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif k.loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * k.max_completion_length)
    elif k.loss_type in ["cispo", "dapo", "vespo"]:
        normalizer = mask.sum().clamp(min=1.0) / 1  # num_items_in_batch / num_processes, x 1 / 1
        loss = (per_token_loss * mask).sum() / normalizer
    else:  # luspo
        loss = (per_token_loss * mask).sum(-1).mean()

    def masked_seq_mean(x):
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]))
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        return (local_sum / local_count.clamp(min=1.0)).item()

    metrics = {}
    if k.beta != 0.0:
        metrics["kl"] = global_masked_mean(per_token_kl)
    metrics["entropy"] = global_masked_mean(entropies)
    if k.loss_type == "cispo":
        is_cispo_clipped = (coef_1 > epsilon_high) & (advantages > 0)
        metrics["cispo_clip_ratio"] = global_masked_mean(is_cispo_clipped.float())
        return loss, metrics
    if k.loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = global_masked_mean(phi_seq)
        return loss, metrics
    if k.loss_type == "sapo":
        return loss, metrics
    is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages < 0)
    is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages > 0)
    is_region_clipped = is_low_clipped | is_high_clipped
    metrics["clip_ratio/low_mean"] = global_masked_mean(is_low_clipped.float())
    metrics["clip_ratio/high_mean"] = global_masked_mean(is_high_clipped.float())
    metrics["clip_ratio/region_mean"] = global_masked_mean(is_region_clipped.float())
    metrics["clip_ratio/low_min"] = _nanmin(masked_seq_mean(is_low_clipped.float())).item()
    metrics["clip_ratio/high_max"] = _nanmax(masked_seq_mean(is_high_clipped.float())).item()
    return loss, metrics
