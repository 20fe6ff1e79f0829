"""The preference losses by name (DPO_LOSS), and a micro-batch's share of an optimizer step's loss.

x = (pi_c - ref_c) - (pi_r - ref_r): the policy's log-prob margin of chosen over rejected, less the
reference's. Each row of DPO_LOSS is TRL 1.16's formula (trl/trainer/dpo_trainer.py; cpo_trainer.py
and orpo_trainer.py, now in trl/experimental), with TRL's metric names in TRL's meanings, but for
LABEL_SMOOTHING on sigmoid: conservative DPO, as earlier TRL releases and LLaMA-Factory take it (1.16's
sigmoid ignores it), and ORPO's NLL (below):
  sigmoid  DPO: -(1 - ls) logsigmoid(b x) - ls logsigmoid(-b x)     (ls: LABEL_SMOOTHING)
  ipo      (x - 1 / (2 b))^2, on length-normalised log-probs (the mean per response token)
  hinge    relu(1 - b x)                                            (RSO)
  simpo    -(1 - ls) logsigmoid(b (c - r) - gamma) - ls logsigmoid(-(...)), no reference,
           length-normalised (CPOTrainer's simpo with cpo_alpha = 0; SIMPO_GAMMA)
  orpo     chosen NLL - b logsigmoid(log odds(c) - log odds(r)), no reference, length-normalised,
           log odds(p) = log p - log(1 - p) (ORPOTrainer). The NLL is over the chosen response's
           tokens, as the kit's SFT loss and SFT_WEIGHT take it; TRL's ORPOTrainer takes a causal
           LM's over prompt and response (its encoder-decoder's over the response, as here)
SFT_WEIGHT adds sft_weight x the chosen side's token-mean NLL (TRL 1.16's loss_type ["sigmoid", "sft"] with
loss_weights [1, w]; rpo_alpha before) to any of them.
rewards/chosen is b (pi_c - ref_c) (b pi_c without a reference, as CPO and ORPO log it). logps/* and
rewards/* are summed over the response's tokens for sigmoid, hinge and ipo, as DPOTrainer logs them
(its IPO normalises by the response lengths inside the loss only), and per-token means for simpo and
orpo, as CPOTrainer and ORPOTrainer log them.

Accumulation and ranks: a per-pair loss is averaged over every pair of the optimizer step, all its
micro-batches and all ranks, and the NLL over every chosen response token, as one big batch would
(forward_loss's token-correct accumulation, by pairs): each micro-batch returns
sum(its pair losses) / pairs x world_size, with the step's totals counted on the host first
(step_counts), so backward of each share, added up and averaged by DDP, is one big batch's gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from train.core.device import autocast
from train.core.preference.logps import device_inputs, sequence_logps


@dataclass(frozen=True)
class Knobs:
    """The per-pair formulas' settings (BETA, LABEL_SMOOTHING, SIMPO_GAMMA), always given: their defaults
    are config.py's (MODE_DEFAULTS), handed down by the plan."""

    beta: float
    label_smoothing: float
    simpo_gamma: float


def _smoothed(z: torch.Tensor, ls: float) -> torch.Tensor:
    """-(1 - ls) logsigmoid(z) - ls logsigmoid(-z): conservative DPO (ls, the chance a label is flipped)."""
    return -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)


def _sigmoid(c, r, rc, rr, k: Knobs):
    return _smoothed(k.beta * ((c - rc) - (r - rr)), k.label_smoothing), {}


def _ipo(c, r, rc, rr, k: Knobs):
    return ((c - rc) - (r - rr) - 1 / (2 * k.beta)) ** 2, {}


def _hinge(c, r, rc, rr, k: Knobs):
    return torch.relu(1 - k.beta * ((c - rc) - (r - rr))), {}


def _simpo(c, r, rc, rr, k: Knobs):
    return _smoothed(k.beta * (c - r) - k.simpo_gamma, k.label_smoothing), {}


def _orpo(c, r, rc, rr, k: Knobs):
    # log odds(c) - log odds(r) with log(1 - p) = log1p(-exp(log p)): the odds of a length-normalised
    # likelihood (ORPO's Eqs. 4 and 7); the NLL half of ORPO is added by preference_loss (nll=True)
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    ratio = F.logsigmoid(log_odds)
    return -k.beta * ratio, {"log_odds_ratio": ratio, "log_odds_chosen": log_odds}


def _sides(logps: torch.Tensor, ref: torch.Tensor, p: int) -> tuple[torch.Tensor, ...]:
    """(chosen, rejected, reference chosen, reference rejected): the rows 0..P-1 and P..2P-1."""
    return logps[:p], logps[p:], ref[:p], ref[p:]


@dataclass(frozen=True)
class PreferenceLoss:
    """One row of DPO_LOSS: per_pair(c, r, ref_c, ref_r, knobs) -> (losses (P,), extra per-pair
    metrics); the log-probs it takes, per response token (normalised) or summed; whether it needs a
    reference model's; whether the chosen NLL is part of it (weight 1, SFT_WEIGHT on top); the Knobs its
    formula reads (a knob set that it does not read is refused, as it would be ignored); whether TRL's
    trainer for it logs logps/* and rewards/* as per-token means (CPOTrainer, ORPOTrainer) or as sums
    (DPOTrainer, IPO included), so that each name means what it means in TRL."""

    per_pair: Callable
    normalised: bool
    reference: bool
    nll: bool = False
    reads: frozenset = frozenset({"beta"})
    logs_means: bool = False


DPO_LOSS = {
    "sigmoid": PreferenceLoss(
        _sigmoid, normalised=False, reference=True, reads=frozenset({"beta", "label_smoothing"})
    ),
    "ipo": PreferenceLoss(_ipo, normalised=True, reference=True),
    "hinge": PreferenceLoss(_hinge, normalised=False, reference=True),
    "simpo": PreferenceLoss(
        _simpo,
        normalised=True,
        reference=False,
        reads=frozenset({"beta", "label_smoothing", "simpo_gamma"}),
        logs_means=True,
    ),
    "orpo": PreferenceLoss(_orpo, normalised=True, reference=False, nll=True, logs_means=True),
}


def step_counts(batches: Iterable[dict], layout) -> tuple[int, int]:
    """(pairs, chosen response tokens) of one optimizer step's micro-batches, as host ints counted
    from their CPU labels (no device sync): the divisors preference_loss takes. With DDP, sum each
    over the ranks (one all_reduce of both) before the step's forwards."""
    pairs = tokens = 0
    for batch in batches:
        r = layout.responses(batch)
        pairs, tokens = pairs + r.pairs, tokens + r.chosen_tokens
    return pairs, tokens


def pair_metrics(c, r, rewards_c, rewards_r, extra: dict, share: Callable) -> dict:
    """TRL's names, each this batch's share of the step's mean over pairs (device tensors, detached:
    the loop reads them at a log line, the only sync)."""
    metrics = {
        "rewards/chosen": rewards_c, "rewards/rejected": rewards_r,
        "rewards/accuracies": (rewards_c > rewards_r).float(), "rewards/margins": rewards_c - rewards_r,
        "logps/chosen": c, "logps/rejected": r, **extra,
    }  # fmt: skip
    return {name: share(value.detach().sum()) for name, value in metrics.items()}


def preference_loss(
    model,
    batch: dict,
    device: torch.device,
    precision: str,
    pairs: int | None = None,
    world_size: int = 1,
    *,
    layout,
    chosen_tokens: int | None = None,
    loss: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    sft_weight: float = 0.0,
    reference: Callable | None = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """(this micro-batch's share of the step's loss, metrics), as forward_loss shapes it: `pairs` and
    `chosen_tokens` are the whole step's (step_counts; over all ranks with DDP, with world_size the
    ranks), None: this batch's own. batch: 2P rows as the loader gives them (labels on the CPU), chosen
    first; for an encoder-decoder input_ids / attention_mask are the P sources, labels the 2P
    targets. reference: reference.build_reference's function, None for simpo and orpo. layout:
    the model's family's (train/models Family.layout): its targets and log-probs."""
    row = DPO_LOSS.get(loss)
    if row is None:
        raise ValueError(f"DPO_LOSS={loss!r}: expected one of {', '.join(DPO_LOSS)}")
    if row.reference and reference is None:
        raise ValueError(f"DPO_LOSS={loss} compares with a reference model: give one (copy, precomputed, "
                         f"adapters)")
    knobs = Knobs(beta, label_smoothing, simpo_gamma)
    host = layout.responses(batch)
    pairs, chosen_tokens = pairs or host.pairs, chosen_tokens or host.chosen_tokens
    responses = host.to(device)
    inputs = device_inputs(batch, device)
    with autocast(device, precision):
        sums = sequence_logps(model, inputs, responses, chunk_tokens, layout=layout)
        ref = reference(model, batch, inputs, responses) if row.reference else None
    p = host.pairs
    counts = responses.counts.clamp(min=1).float()  # a row with no response token: 0, not 0 / 0
    ref = torch.zeros_like(sums) if ref is None else ref
    c, r, rc, rr = _sides(
        sums / counts if row.normalised else sums, ref / counts if row.normalised else ref, p
    )
    losses, extra = row.per_pair(c, r, rc, rr, knobs)
    if row.logs_means != row.normalised:  # IPO: DPOTrainer logs the sums its loss normalised
        c, r, rc, rr = _sides(
            sums / counts if row.logs_means else sums, ref / counts if row.logs_means else ref, p
        )

    def share(total: torch.Tensor, divisor: int = pairs) -> torch.Tensor:
        return total / max(1, divisor) * world_size

    value = share(losses.sum())
    metrics = pair_metrics(c, r, beta * (c - rc), beta * (r - rr), extra, share)
    nll_weight = sft_weight + (1.0 if row.nll else 0.0)
    if nll_weight:  # the token mean over the step's chosen responses, as transformers' SFT loss takes it
        nll = share(-sums[:p].sum(), chosen_tokens)
        value = value + nll_weight * nll
        metrics["nll_loss"] = nll.detach()
    return value, metrics


@dataclass(frozen=True)
class PreferenceObjective:
    """Preference training's objective for train_step (step.TokenObjective's interface): the step's
    (pairs, chosen tokens) counted on the host, then each micro-batch's share of the loss and TRL's
    metrics (device tensors; train_step sums them over the micro-steps, the loop reads them at a log
    line). reference: build_reference's function (None for simpo and orpo). The interface:
    train/core/objective.py Objective."""

    rows_per_sample: ClassVar[int] = 2  # a pair: its chosen and its rejected sequence in one forward
    unit: ClassVar[str] = "pairs"
    trial_on_longest: ClassVar[bool] = True  # find-batch: the data's longest pairs, collated as the run does
    layout: object  # the model's family's Layout (train/models/family.py)
    loss_name: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0
    reference: Callable | None = None

    def counts(self, micro_batches) -> tuple[int, int]:
        return step_counts(micro_batches, self.layout)

    def loss(self, model, batch, device, precision, counts, world_size: int = 1, accuracy: bool = False):
        pairs, chosen_tokens = counts
        return preference_loss(
            model,
            batch,
            device,
            precision,
            pairs,
            world_size,
            layout=self.layout,
            chosen_tokens=chosen_tokens,
            loss=self.loss_name,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            simpo_gamma=self.simpo_gamma,
            sft_weight=self.sft_weight,
            reference=self.reference,
        )

    def returned(self, sums: dict) -> dict:
        """train_step's fourth value on a log step: every metric, summed over the micro-steps."""
        return sums

    def named(self, returned: dict) -> dict:
        return returned

    def samples(self, batch: dict) -> int:
        return int(batch["n_pairs"])

    def shown(self, row: dict) -> str:
        """The reward accuracy and margin."""
        return f"acc {row['rewards/accuracies']:.3f} margin {row['rewards/margins']:.3f}"

    def evaluate(self, model, batch: dict, device, precision: str):
        """The batch's mean loss and TRL's metrics over its pairs, weighted by its pairs."""
        counts = self.counts([batch])  # host labels: no sync
        loss, metrics = self.loss(model, batch, device, precision, counts)
        return counts[0], loss, metrics

    def perplexity(self, loss: float | None) -> None:
        return None  # a preference loss is no token loss

    def eval_shown(self, loss: float, metrics: dict) -> str:
        return (f"val_rewards/accuracies {metrics['rewards/accuracies']:.3f} "
                f"val_rewards/margins {metrics['rewards/margins']:.3f}")

    def kept(self, metrics: dict) -> dict:
        """TRL's rewards/... (the reward accuracy, margin, chosen and rejected rewards)."""
        return {name: value for name, value in metrics.items() if name.startswith("rewards/")}

    def describe(self) -> str:
        return f"preference loss {self.loss_name}"
