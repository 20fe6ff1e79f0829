"""From scored completions to group-relative advantages, and the numbers TRL logs about them.

The B x G completions of a generation batch come in groups of G = NUM_GENERATIONS (a prompt's G
samples side by side). Each reward function gives one float per completion, or None where it does
not apply; TRL 1.16 (GRPOTrainer._calculate_rewards and _generate_and_score_completions) makes a
None NaN and then, with MULTI_OBJECTIVE_AGGREGATION sum_then_normalize (its default):
  reward    = nansum_k(w_k r_k)  (NaN where every function gave None: the completion is unscorable)
  advantage = reward - nanmean(group's rewards), divided by (std + 1e-4) where std is the group's
              (SCALE_REWARDS=group), the whole batch's (batch), or not divided (none);
              std is nanstd: Bessel-corrected, NaN below two values; a NaN advantage becomes 0.
normalize_then_sum (GDPO) normalises each function's rewards within the group first, sums them
with the weights, then normalises the sums over the batch.
Everything here runs on the host's float32 tensors of rewards that Python functions returned:
no device is involved, so the .item() of the metrics costs no sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from train.core.reward.knobs import GrpoKnobs

EPS = 1e-4  # TRL's: added to the std before dividing (a group of equal rewards: advantage 0, not 0 / 0)


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The sample standard deviation ignoring NaNs, NaN where fewer than two values (TRL's nanstd)."""
    dims = tuple(range(x.dim())) if dim is None else dim
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std if keepdim else std.squeeze(dims)


def stack_rewards(columns: Mapping[str, Sequence[float | None]]) -> torch.Tensor:
    """(N, F) float32 rewards from each reward function's list (its name -> one value per completion),
    None as NaN (TRL: a function that does not apply to a sample returns None)."""
    lengths = {name: len(values) for name, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"REWARD_FUNCS: one reward per completion from each function; got {lengths}")
    rows = [[float("nan") if v is None else float(v) for v in values] for values in columns.values()]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), -1).T.contiguous()


def _weights(knobs: GrpoKnobs, functions: int) -> torch.Tensor:
    if knobs.reward_weights is None:
        return torch.ones(functions, dtype=torch.float32)
    if len(knobs.reward_weights) != functions:
        raise ValueError(f"REWARD_WEIGHTS: {len(knobs.reward_weights)} weights, {functions} reward functions")
    return torch.tensor(knobs.reward_weights, dtype=torch.float32)


def _sum_then_normalize(per_func, weights, unscorable, g: int, scale: str):
    rewards = (per_func * weights[None]).nansum(1)
    rewards[unscorable] = float("nan")
    mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # "none" too: its std only says which groups had equal rewards (frac_reward_zero_std)
        std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + EPS)
    return advantages, std


def _normalize_then_sum(per_func, weights, unscorable, g: int):
    grouped = per_func.view(-1, g, per_func.shape[1])
    mean, std = torch.nanmean(grouped, dim=1, keepdim=True), nanstd(grouped, dim=1, keepdim=True)
    each = (grouped - mean) / (std + EPS)
    rewards = (each.view(-1, per_func.shape[1]) * weights[None]).nansum(1)
    rewards[unscorable] = float("nan")
    std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return (rewards - torch.nanmean(rewards)) / (std + EPS), std


def group_advantages(per_func: torch.Tensor, names: Sequence[str], knobs: GrpoKnobs,
                     ) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """(advantages (N,), metrics) for rewards (N, F) of N = prompts x NUM_GENERATIONS completions, each
    prompt's G side by side, F reward functions named `names` (stack_rewards). Metrics in TRL's names:
    reward and reward_std (of the weighted sums, unscorable ones left out), rewards/<name>/mean and
    /std (each function's, its Nones left out) and frac_reward_zero_std (the share of completions whose
    group (or batch) std is 0: they teach nothing)."""
    g = knobs.num_generations
    if per_func.dim() != 2 or per_func.shape[0] % g or per_func.shape[1] != len(names):
        raise ValueError(f"NUM_GENERATIONS={g}: rewards of shape {tuple(per_func.shape)} are not whole "
                         f"groups of {g} completions scored by {len(names)} reward functions")  # fmt: skip
    per_func = per_func.float()
    weights = _weights(knobs, per_func.shape[1])
    unscorable = torch.isnan(per_func).all(dim=1)
    if knobs.multi_objective_aggregation == "sum_then_normalize":
        advantages, std = _sum_then_normalize(per_func, weights, unscorable, g, knobs.scale_rewards)
    else:
        advantages, std = _normalize_then_sum(per_func, weights, unscorable, g)
    advantages = torch.nan_to_num(advantages, nan=0.0)  # unscorable completions move nothing
    metrics = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    rewards = (per_func * weights[None]).nansum(1)
    rewards[unscorable] = float("nan")
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = nanstd(rewards).item()
    metrics["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
    return advantages, metrics


def truncated(completions: Sequence[Sequence[int]], stop_ids: Sequence[int]) -> torch.Tensor:
    """(N,) bool: a completion whose last token is not a stop (EOS or pad) ran into MAX_COMPLETION_LENGTH.
    completions: the sampled ids, each cut after its first EOS (TRL's completion_ids_list)."""
    stops = set(stop_ids)
    return torch.tensor([not ids or ids[-1] not in stops for ids in completions], dtype=torch.bool)


def loss_mask(completion_mask: torch.Tensor, is_truncated: torch.Tensor, knobs: GrpoKnobs) -> torch.Tensor:
    """The completion mask the loss counts: MASK_TRUNCATED_COMPLETIONS zeroes a truncated completion's
    row (TRL also feeds that mask to the forward as attention: its tokens then predict nothing). Apply
    it before the old and reference log-probs are taken and a step's tokens counted (loss.step_counts)."""
    if not knobs.mask_truncated_completions:
        return completion_mask
    return completion_mask * (~is_truncated.to(completion_mask.device)).unsqueeze(1).to(completion_mask.dtype)


def completion_metrics(lengths: torch.Tensor, is_truncated: torch.Tensor) -> dict:
    """TRL's completions/* of a generation batch: lengths (N,) of the sampled completions (before any
    masking), is_truncated (N,) from truncated()."""
    lengths = lengths.float()
    ended = lengths[~is_truncated]
    if ended.numel() == 0:  # TRL: no completion ended, the terminated lengths read 0
        ended = torch.zeros(1)
    return {
        "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": is_truncated.float().mean().item(),
        "completions/mean_terminated_length": ended.mean().item(),
        "completions/min_terminated_length": ended.min().item(),
        "completions/max_terminated_length": ended.max().item(),
    }  # fmt: skip
