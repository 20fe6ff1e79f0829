"""GRPO's policy loss per token, TRL 1.16's GRPOTrainer._compute_loss, and a micro-batch's share of it.

For completion token t of sequence i, with A_i its advantage (advantages.group_advantages):
  log-ratio  r_it = logp_it - old_it  (old: the policy's log-probs when it sampled, kept when
             NUM_ITERATIONS > 1; otherwise the current ones, detached, so r = 0 and the ratio is 1)
  ratio      w_it = exp(r_it) (IMPORTANCE_SAMPLING_LEVEL=token), or w_i = exp(mean_t r_it) over the
             completion's kept tokens (sequence: GSPO)
  token loss -min(w A_i, clip(w, 1 - EPSILON, 1 + EPSILON_HIGH) A_i), the unclipped w capped at DELTA
             where it is set (two-sided GRPO); cispo: -min(w, EPSILON_HIGH) A_i logp_it, the weight
             detached (MiniMax-M1); sapo: -A_i (4 / tau) sigmoid(tau (w - 1)), tau SAPO_TEMPERATURE_POS
             where A_i > 0, else SAPO_TEMPERATURE_NEG; vespo: -phi_i A_i logp_it, phi_i detached (below);
             plus BETA x kl_it where BETA > 0:
  kl_it      exp(ref_it - logp_it) - (ref_it - logp_it) - 1 (k3), times w (TRL's default
             use_bias_correction_kl)
  vespo      phi_i = exp(lambda + k log W_i - lambda W_i) (a gamma weight, phi(1) = 1), log W_i = sum_t m
             clamp(r_it, -20, 20) clamped to [log 1e-8, 20]; k, lambda VESPO_K_POS, VESPO_LAMBDA_POS where
             A_i >= 0, else VESPO_K_NEG, VESPO_LAMBDA_NEG; a non-finite phi reads 0 (TRL's get_gamma_weights)
LOSS_TYPE is how the token losses l_it, over the kept tokens (mask m_it), become the step's number:
  grpo, sapo          mean over sequences of (sum_t m l / sum_t m)
  bnpo                sum m l / sum m over the micro-batch, averaged over the step's micro-batches
  dr_grpo             sum m l / (sequences x MAX_COMPLETION_LENGTH)
  dapo, cispo, vespo  sum m l / (kept tokens of the whole step)
  luspo               mean over sequences of sum_t m l (GSPO's loss scaled by each length)
Accumulation and ranks. The kit's rule is that an optimizer step's loss is the loss of one big batch;
each micro-batch returns its share, with the step's totals counted on the host first (step_counts), and
backward of the shares, added up (and averaged over ranks by DDP), is the step's gradient. Under
gradient accumulation TRL divides grpo, bnpo and dr_grpo by the number of accumulation steps, so grpo
and dr_grpo are the one big batch's number wherever the micro-batches hold equal numbers of
completions (TRL's always do), and so are the shares here. bnpo is the one exception by definition: TRL
normalises it per local (micro-)batch, and so does this share (one micro-batch per step: bnpo = dapo).
sapo and luspo are divided by the accumulation in TRL as grpo is; cispo's and vespo's divisor is dapo's.
dapo: TRL divides by num_items_in_batch (the kept tokens of the whole generation batch, gathered over
processes) / processes x accumulation / steps_per_generation; with one generation per optimizer step
(TRL's default steps_per_generation = accumulation, the kit's only case) that is the step's kept tokens
over all ranks / ranks: the share here, sum / step tokens x world_size, is the same value.
Metrics keep TRL's names and meanings: each micro-batch's value (a masked mean over its tokens, or over
its sequences at sequence level) divided by the step's micro-batches, so the sum over the micro-steps
that train_step makes is TRL's mean over them. Counts for DDP must be summed over ranks by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from train.core.device import autocast
from train.core.reward.knobs import GrpoKnobs
from train.core.reward.logps import Completions, completion_logps, model_inputs


@dataclass(frozen=True)
class StepCounts:
    """One optimizer step's totals, host ints counted from the micro-batches' CPU masks (no sync)."""

    sequences: int  # completions (rows) of the step: grpo's and dr_grpo's divisor
    tokens: int  # kept completion tokens of the step: dapo's divisor
    micro_batches: int  # this rank's micro-batches of the step: bnpo's and every metric's divisor


def step_counts(batches: Iterable[dict]) -> StepCounts:
    """The step's StepCounts from its micro-batches (their completion_mask after advantages.loss_mask).
    With DDP, sum sequences and tokens over the ranks (one all_reduce) before the step's forwards; the
    micro-batches stay this rank's."""
    sequences = tokens = micro = 0
    for batch in batches:
        mask = batch["completion_mask"]
        sequences, tokens, micro = sequences + mask.shape[0], tokens + int(mask.sum()), micro + 1
    return StepCounts(sequences, tokens, micro)


def _grpo(masked, mask, counts: StepCounts, knobs: GrpoKnobs, world_size: int):
    per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.sum() / max(1, counts.sequences) * world_size


def _luspo(masked, mask, counts: StepCounts, knobs: GrpoKnobs, world_size: int):
    return masked.sum() / max(1, counts.sequences) * world_size


def _bnpo(masked, mask, counts: StepCounts, knobs: GrpoKnobs, world_size: int):
    # TRL's per-(micro-)batch token mean: DDP's average over ranks is TRL's too, so no world_size
    return masked.sum() / mask.sum().clamp(min=1.0) / max(1, counts.micro_batches)


def _dr_grpo(masked, mask, counts: StepCounts, knobs: GrpoKnobs, world_size: int):
    return masked.sum() / (max(1, counts.sequences) * knobs.max_completion_length) * world_size


def _dapo(masked, mask, counts: StepCounts, knobs: GrpoKnobs, world_size: int):
    return masked.sum() / max(1, counts.tokens) * world_size


def _clipped(coef_1, advantages, logps, knobs: GrpoKnobs, *_):
    coef_2 = torch.clamp(coef_1, 1 - knobs.epsilon_low, 1 + knobs.upper_epsilon)
    if knobs.delta is not None:  # TRL caps after coef_2 is made, and its clip metrics read the capped ratio
        coef_1 = torch.clamp(coef_1, max=knobs.delta)
    return -torch.min(coef_1 * advantages, coef_2 * advantages), coef_1


def _cispo(coef_1, advantages, logps, knobs: GrpoKnobs, *_):
    return -torch.clamp(coef_1, max=knobs.upper_epsilon).detach() * advantages * logps, coef_1


def _sapo(coef_1, advantages, logps, knobs: GrpoKnobs, *_):
    tau = torch.where(advantages > 0, knobs.sapo_temperature_pos, knobs.sapo_temperature_neg)
    return -(torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau) * advantages, coef_1


LOG_1E_8 = math.log(1e-8)  # vespo's floor of log W: TRL clamps there so that W itself is >= 1e-8


@torch.no_grad()  # phi only scales each completion's gradient, as TRL's weight
def _vespo_weights(log_ratio, advantages, mask, knobs: GrpoKnobs) -> torch.Tensor:
    """Each completion's gamma weight phi (B, 1) from its token log-ratios (module doc)."""
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True).clamp(LOG_1E_8, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, knobs.vespo_k_pos, knobs.vespo_k_neg)
    lam = torch.where(nonneg, knobs.vespo_lambda_pos, knobs.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _vespo(coef_1, advantages, logps, knobs: GrpoKnobs, log_ratio, mask):
    phi = _vespo_weights(log_ratio, advantages, mask, knobs)
    return -phi * advantages * logps, phi


@dataclass(frozen=True)
class LossType:
    """One row of LOSS_TYPE: token_loss(ratio, advantages, logps, knobs, log_ratio, mask) -> (token
    losses, the ratio the metrics read: vespo's phi); share(masked token losses (B, C), mask, counts,
    knobs, world_size) -> this micro-batch's share of the step; clip: which of TRL's metrics it logs."""

    token_loss: Callable
    share: Callable
    clip: str  # "region" (clip_ratio/*), "cispo" (cispo_clip_ratio), "vespo" (vespo/phi_seq_mean), ""


LOSS_TYPE: dict[str, LossType] = {
    "grpo": LossType(_clipped, _grpo, "region"), "bnpo": LossType(_clipped, _bnpo, "region"),
    "dr_grpo": LossType(_clipped, _dr_grpo, "region"), "dapo": LossType(_clipped, _dapo, "region"),
    "cispo": LossType(_cispo, _dapo, "cispo"), "sapo": LossType(_sapo, _grpo, ""),
    "luspo": LossType(_clipped, _luspo, "region"), "vespo": LossType(_vespo, _dapo, "vespo"),
}  # fmt: skip
"""LOSS_TYPE -> its token loss and its normalisation, TRL 1.16's."""


# TRL tells a per-sequence (B, 1) value from a per-token one by its width; so would a batch whose
# completions are all one token wide (C = 1), so here the caller says which it is.
def _masked_mean(x: torch.Tensor, mask: torch.Tensor, per_sequence: bool = False) -> torch.Tensor:
    """TRL's global_masked_mean on one process: over the kept tokens, or over the sequences for a
    sequence-level (B, 1) value (every sequence counts there, a fully masked one too)."""
    if per_sequence:
        return x.sum() / max(1, x.shape[0])
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _sequence_means(x: torch.Tensor, mask: torch.Tensor, per_sequence: bool) -> torch.Tensor:
    """TRL's masked_seq_mean: each sequence's mean over its kept tokens (NaN where none is kept)."""
    return x.squeeze(1) if per_sequence else (x * mask).sum(-1) / mask.sum(-1)


def _nan_extreme(x: torch.Tensor, largest: bool) -> torch.Tensor:
    """TRL's nanmin / nanmax without its host read (NaN where every value is NaN)."""
    nan = torch.isnan(x)
    fill = torch.where(nan, torch.full_like(x, -torch.inf if largest else torch.inf), x)
    value = fill.max() if largest else fill.min()
    return torch.where(nan.all(), torch.full_like(value, torch.nan), value)


def _clip_metrics(coef_1, advantages, mask, knobs: GrpoKnobs) -> dict:
    seq = knobs.importance_sampling_level == "sequence"  # then coef_1, and so each of these, is (B, 1)
    kind = LOSS_TYPE[knobs.loss_type].clip
    if kind == "cispo":
        return {"cispo_clip_ratio": _masked_mean(((coef_1 > knobs.upper_epsilon) & (advantages > 0)).float(),
                                                 mask, seq)}  # fmt: skip
    if kind == "vespo":  # phi is one value per completion at either level
        return {"vespo/phi_seq_mean": _masked_mean(coef_1, mask, per_sequence=True)}
    if not kind:
        return {}
    low = ((coef_1 < 1 - knobs.epsilon_low) & (advantages < 0)).float()
    high = ((coef_1 > 1 + knobs.upper_epsilon) & (advantages > 0)).float()
    region = torch.maximum(low, high)
    return {
        "clip_ratio/low_mean": _masked_mean(low, mask, seq),
        "clip_ratio/high_mean": _masked_mean(high, mask, seq),
        "clip_ratio/region_mean": _masked_mean(region, mask, seq),
        "clip_ratio/low_min": _nan_extreme(_sequence_means(low, mask, seq), largest=False),
        "clip_ratio/high_max": _nan_extreme(_sequence_means(high, mask, seq), largest=True),
    }  # fmt: skip


def policy_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, knobs: GrpoKnobs,
                counts: StepCounts, world_size: int = 1, *, old: torch.Tensor | None = None,
                ref: torch.Tensor | None = None, entropies: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """(this micro-batch's share of the step's loss, metrics) from the current per-token log-probs
    logps (B, C) (with their gradient), advantages (B,), the loss mask (B, C), the old log-probs (B, C)
    (None: logps detached) and the reference's (B, C) (needed where BETA > 0). Metrics: kl (BETA > 0),
    entropy (given entropies), clip_ratio/{low,high,region}_mean, clip_ratio/low_min, /high_max (the
    clipped losses), cispo_clip_ratio (cispo), vespo/phi_seq_mean (vespo), each this micro-batch's share
    (module doc), detached device tensors: nothing here reads the device."""
    if knobs.loss_type not in LOSS_TYPE:
        raise ValueError(f"LOSS_TYPE={knobs.loss_type}: expected one of {', '.join(LOSS_TYPE)}")
    if knobs.beta != 0.0 and ref is None:
        raise ValueError(f"BETA={knobs.beta}: the KL term needs the reference model's log-probs (REFERENCE)")
    mask = mask.to(logps.dtype)
    advantages = advantages.to(logps.dtype).unsqueeze(1) if advantages.dim() == 1 else advantages
    old = logps.detach() if old is None else old
    log_ratio = logps - old
    if knobs.importance_sampling_level == "token":
        log_weights = log_ratio
    else:  # GSPO: one ratio per completion, from its mean log-ratio over the kept tokens
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    if knobs.beta != 0.0:
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        if knobs.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    row = LOSS_TYPE[knobs.loss_type]
    per_token_loss, coef_1 = row.token_loss(coef_1, advantages, logps, knobs, log_ratio, mask)
    if knobs.beta != 0.0:
        per_token_loss = per_token_loss + knobs.beta * per_token_kl
    share = row.share(per_token_loss * mask, mask, counts, knobs, world_size)

    with torch.no_grad():
        metrics = _clip_metrics(coef_1, advantages, mask, knobs)
        if knobs.beta != 0.0:
            metrics["kl"] = _masked_mean(per_token_kl, mask)
        if entropies is not None:
            metrics["entropy"] = _masked_mean(entropies, mask)
        metrics = {name: value.detach() / max(1, counts.micro_batches) for name, value in metrics.items()}
    return share, metrics


def grpo_loss(model, batch: dict, device: torch.device, precision: str, counts: StepCounts | None = None,
              world_size: int = 1, *, knobs: GrpoKnobs, chunk_tokens: int | None = None,
              ) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """(this micro-batch's share of the step's loss, metrics), as forward_loss shapes it. batch (TRL's
    layout, on the CPU as the loader gives it): prompt_ids, prompt_mask (B, P), left-padded;
    completion_ids, completion_mask (B, C), right-padded, the mask after advantages.loss_mask;
    advantages (B,); old_per_token_logps (B, C) where knobs.keeps_old_logps; ref_per_token_logps (B, C)
    where BETA > 0 (both completion_logps under no_grad at generation time). counts: step_counts of
    the step's micro-batches (None: this batch alone)."""
    if knobs.num_iterations > 1 and batch.get("old_per_token_logps") is None:
        # without them every ratio reads 1 and the clip never acts: the later iterations would not be GRPO's
        raise ValueError(f"NUM_ITERATIONS={knobs.num_iterations}: the batch carries no old_per_token_logps "
                         "(the policy's log-probs kept at generation time)")  # fmt: skip
    counts = counts or step_counts([batch])
    where = Completions.of(batch).to(device)
    inputs = model_inputs(batch, device)
    with autocast(device, precision):
        logps, entropies = completion_logps(model, inputs, where, knobs.temperature, chunk_tokens)

    def moved(key: str) -> torch.Tensor | None:
        value = batch.get(key)
        return None if value is None else value.to(device, non_blocking=True)

    old, ref = moved("old_per_token_logps"), moved("ref_per_token_logps")
    return policy_loss(logps, moved("advantages"), moved("completion_mask"), knobs, counts, world_size,
                       old=old, ref=ref, entropies=entropies)  # fmt: skip
