"""One optimizer step, as the guides write it: set lr -> micro-steps (autocast, backward of
loss / accumulation) -> unscale -> clip -> step -> zero_grad(set_to_none=True). The loop, the
bench, find-batch and autotune all run this code: there is no second, faster copy."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace

import torch

from train.core.attention import host_padding, register_no_sync_mask
from train.core.device import autocast
from train.core.loss import (
    chunked_cross_entropy,
    correct_predictions,
    count_targets,
    lm_hidden_and_head,
    seq2seq_loss_sum,
    shift_targets,
    step_targets,
    token_mean_share,
)
from train.core.model import unwrapped


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's grad norm) as a plain tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def build_optimizer(optim, model: torch.nn.Module, device: torch.device):
    """(optimizer, how it runs) from the optimizer section (config.OptimConfig: OPTIMIZER,
    LEARNING_RATE, WEIGHT_DECAY), the one builder the trainer, find-batch, autotune and the benches
    share. Only parameters that require grad (FREEZE leaves the rest out: no state for them).
    Decay on matrices only. AdamW fused (one kernel for all parameters) where the device has it,
    which saves the per-parameter launch overhead of the for-loop version; on CPU too
    (bench/RESULTS.md): nano's step takes 4.9 ms fused vs 18.3 foreach, 17.2 for-loop.
    adafactor: torch's own, its lr the schedule's (the cap of its relative step, which it scales
    by each matrix's RMS); it reads two norms per parameter on the host each step (torch's code),
    so on a GPU it syncs where AdamW does not. sgd: momentum 0.9, Nesterov."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    lr = optim.learning_rate
    if optim.optimizer == "adafactor":  # foreach: one kernel per op over all tensors
        return torch.optim.Adafactor(groups, lr=lr, foreach=True), "Adafactor (foreach)"
    if optim.optimizer == "sgd":
        klass, how, label = torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, "SGD (momentum 0.9, Nesterov, {})"
    else:
        klass, how, label = torch.optim.AdamW, {"betas": (0.9, 0.95)}, "AdamW ({})"
    from torch.distributed.tensor import DTensor

    # FSDP2's parameters are DTensors, which torch's fused SGD kernel does not take (fused AdamW does)
    if klass is torch.optim.AdamW or not any(isinstance(p, DTensor) for p in decay + no_decay):
        try:
            return klass(groups, lr=lr, fused=True, **how), label.format("fused")
        except (RuntimeError, TypeError):
            pass
    return klass(groups, lr=lr, foreach=True, **how), label.format("foreach")


ONECYCLE_DIV, ONECYCLE_FINAL_DIV = 25.0, 1e4  # OneCycleLR's div_factor and final_div_factor


def lr_at(step: float, peak: float, warmup: float, total: float, min_ratio: float, shape: str = "cosine") -> float:
    """The learning rate of optimizer step `step` (from 0; fractional under a changed batch, see
    Schedule). cosine, linear, constant: linear warm-up to the peak over `warmup` steps, then
    cosine or linear decay to peak x min_ratio at `total`, or flat. onecycle: torch's
    OneCycleLR (anneal_strategy="cos", pct_start = warmup / total, three_phase=False) computed
    here: cosine from peak / 25 up to the peak at step warmup - 1, cosine down to peak / 25 / 1e4
    at step total - 1. Its momentum cycling is not done (OneCycleLR's cycle_momentum): the
    optimizers keep their own betas / momentum, and the kit sets only the lr."""
    if shape == "onecycle":
        return _onecycle(step, peak, warmup, total)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if shape == "constant":
        return peak
    if shape == "linear":
        return peak * (min_ratio + (1 - min_ratio) * (1 - progress))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _onecycle(step: float, peak: float, warmup: float, total: float) -> float:
    """OneCycleLR's two phases, with its step ends (warmup - 1, total - 1). A one-step warm-up,
    where OneCycleLR would divide by zero, is the starting lr at step 0."""
    initial = peak / ONECYCLE_DIV
    low = initial / ONECYCLE_FINAL_DIV
    rise_end = warmup - 1

    def anneal(start, end, pct):
        return end + (start - end) / 2.0 * (math.cos(math.pi * min(1.0, max(0.0, pct))) + 1)

    if step <= rise_end:
        return anneal(initial, peak, step / rise_end if rise_end > 0 else 0.0)
    return anneal(peak, low, (step - rise_end) / max(1e-9, total - 1 - rise_end))


@dataclass(frozen=True)
class Schedule:
    """lr_at over samples consumed, not steps: with the same settings that is the same curve step
    for step; with a changed BATCH_SIZE or GRADIENT_ACCUM (a resume) the run continues at the same
    sample, at the same point of the warm-up and decay, and ends at the same sample. unit: the
    samples of the run's first effective batch, so that an unchanged run gives lr_at exactly
    (step, WARMUP_STEPS, total steps). peak, min_ratio and shape: LEARNING_RATE, MIN_LR_RATIO and
    LR_SCHEDULE. This is the one source of the lr (no torch LRScheduler object), onecycle too."""

    unit: int
    warmup_samples: int
    budget_samples: int
    peak: float = 0.0
    min_ratio: float = 0.0
    shape: str = "cosine"

    def lr(self, samples: int) -> float:
        """The learning rate of a step that starts after `samples` samples."""
        u = self.unit
        return lr_at(samples / u, self.peak, self.warmup_samples / u, self.budget_samples / u, self.min_ratio,
                     self.shape)

    def state_dict(self) -> dict:
        """A checkpoint's meta.json "schedule": the curve in samples (peak and shape are the config's)."""
        return {"unit_samples": self.unit, "warmup_samples": self.warmup_samples, "budget_samples": self.budget_samples}

    def load_state_dict(self, state: dict) -> Schedule:
        """The saved curve with this schedule's peak and shape (frozen: a new Schedule)."""
        return replace(self, unit=state["unit_samples"], warmup_samples=state["warmup_samples"],
                       budget_samples=state["budget_samples"])  # fmt: skip


def build_schedule(optim, effective: int, warmup_steps: int, total_steps: int) -> Schedule:
    """The LR schedule from the optimizer section (config.OptimConfig: LEARNING_RATE,
    MIN_LR_RATIO, LR_SCHEDULE) and the plan's steps of `effective` samples, beside build_optimizer."""
    e = effective
    return Schedule(e, warmup_steps * e, total_steps * e, optim.learning_rate, optim.min_lr_ratio, optim.lr_schedule)


def chunkable(model) -> bool:
    """The chunked loss (train/core/loss.py) runs the base model and the LM head itself, so it
    needs the bare transformers model: DDP's forward does its gradient-sync bookkeeping,
    FSDP2's parameters are gathered only inside the model's own forward, and torch.compile's
    graph is the whole forward. Those keep transformers' loss (same numbers, full logits)."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or isinstance(model, FSDPModule):
        return False
    head = model.get_output_embeddings()
    return head is not None and getattr(head, "bias", None) is None


VARLEN_INTS = ("max_length_q", "max_length_k")  # flash-attention varlen's longest, as host ints


def forward_loss(
    model, batch: dict, device: torch.device, precision: str, targets: int | None = None, world_size: int = 1,
    accuracy: bool = False, *, source_target: bool,
):
    """The batch's summed token loss / `targets`: the target tokens of the whole optimizer step
    (token-correct accumulation: the step's loss is the mean over all its target tokens, as
    one big batch would give, not a mean of per-micro-batch means). targets None: this batch's
    own (its mean loss). Counted on the host before the batch moves: no device sync. With DDP or
    FSDP2, which average gradients over ranks, `targets` is the count over all ranks and the
    share is scaled by world_size: the step's gradient is the token mean over every rank's
    targets, as one process would take it, whatever each rank's own count. source_target: the model's family's
    data shape (train/models Family.source_target): an encoder-decoder's source -> target batch."""
    if targets is None:
        targets = count_targets(batch, shifted=not source_target)
    # Only tensors reach the model, and flash-attention's varlen lengths: the collators also hand
    # over host ints (n_real_tokens ...), which BatchCounter has already read. Without
    # max_length_q/k transformers rebuilds the varlen arguments from position_ids on the device,
    # reading them back in every layer.
    padded = _host_padded(batch)
    batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
             if torch.is_tensor(v) or k in VARLEN_INTS}
    labels = batch.pop("labels", batch["input_ids"])
    compiled = hasattr(model, "_orig_mod")
    if padded is not None and not ({"attention_mask", "cu_seq_lens_q"} & batch.keys()) and (
        not compiled or "varlen_index" in batch
    ):
        # a 2D mask keeps transformers from asking the device whether position_ids restart (a
        # packed row). Not for flash-attention's varlen row, which a mask would turn into one
        # sequence; not for a compiled model, which traces that look away, and where a traced
        # mask of ones would become a dense (T x T) mask and cost sdpa its causal kernel.
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    with autocast(device, precision), host_padding(padded) if padded is not None else contextlib.nullcontext():
        if source_target:  # source -> target: input_ids and attention_mask are the source, labels the target
            out = seq2seq_loss_sum(
                model, unwrapped(model), batch["input_ids"], batch.get("attention_mask"), labels, correct=accuracy
            )
            total, hits = out if accuracy else (out, None)
            loss = token_mean_share(total, targets, world_size)
        elif chunkable(model):
            hidden, weight = lm_hidden_and_head(model, **batch)
            total, _, *hits = chunked_cross_entropy(hidden, weight, labels, correct=accuracy)
            loss = token_mean_share(total, targets, world_size)
            hits = hits[0] if accuracy else None  # counted inside the chunks: no (tokens x vocab) logits
        else:
            out = model(**batch, labels=labels, num_items_in_batch=max(1, targets))
            loss = out.loss * world_size
            # the logits exist on this path (DDP, FSDP2, compiled); argmax only on a log step
            hits = correct_predictions(out.logits, shift_targets(labels)) if accuracy else None
    return (loss, token_mean_share(hits.float(), targets, world_size)) if accuracy else loss


@dataclass(frozen=True)
class TokenObjective:
    """The token-mean LM loss of pretraining and SFT: train_step's default objective. An objective
    counts its step's divisors on the host from the micro-batches (counts; with several ranks each
    is summed over them) and gives each micro-batch's share of the step's loss with its metrics,
    device tensors that train_step sums over the micro-steps (loss). Preference training's is
    train/core/preference/loss.py PreferenceObjective."""

    source_target: bool

    def counts(self, micro_batches) -> int:
        return step_targets(micro_batches, shifted=not self.source_target)

    def loss(self, model, batch, device, precision, counts, world_size: int, accuracy: bool):
        out = forward_loss(model, batch, device, precision, counts, world_size, accuracy,
                           source_target=self.source_target)  # fmt: skip
        return (out[0], {"mean_token_accuracy": out[1]}) if accuracy else (out, {})

    def returned(self, sums: dict):
        """train_step's fourth value on a log step: the token accuracy (a device tensor)."""
        return sums["mean_token_accuracy"]


def _host_padded(batch: dict) -> bool | None:
    """Whether the batch has padding, read from its host tensors before they move (no device
    sync): the 2D attention_mask's zeros; None for a prepared 4D mask (used as it is)."""
    register_no_sync_mask()
    mask = batch.get("attention_mask")
    if mask is None:
        return False
    return None if mask.dim() != 2 else not bool(mask.all())


def train_step(
    model, optimizer, scaler, batches, accum: int, grad_clip: float, device, precision, gradient_sync=None, step_total=None,
    accuracy: bool = False, *, source_target: bool, objective=None,
):
    """One optimizer step: micro-steps (autocast, backward of each micro-batch's share of the
    step's token-mean loss) -> unscale -> clip -> step -> zero_grad. The step's micro-batches
    are fetched first, so their target tokens are counted (on the host) before any forward.
    Returns (step loss, grad norm) as device tensors, so nothing here waits for the device,
    and the seconds spent waiting for batches. gradient_sync(last) (from
    train.distributed.distributed) keeps gradients local on all but the last micro-step;
    step_total(targets) -> (targets over all ranks, ranks) makes the loss the token mean over
    every rank (SFT's ranks hold different numbers of target tokens). accuracy (a log step's):
    a fourth, the step's mean_token_accuracy on this rank's share, a device tensor read with the
    loss at the log line's one sync (the argmax costs a step that logs nothing no work at all).
    objective: the mode's loss (TokenObjective's interface), default the token loss; a log step's
    fourth value is then objective.returned(the metrics summed over the micro-steps)."""
    objective = objective or TokenObjective(source_target)
    start = time.perf_counter()
    micro_batches = [next(batches) for _ in range(accum)]
    waited = time.perf_counter() - start
    counts = objective.counts(micro_batches)  # host ints: no device sync
    world_size = 1
    if step_total is not None:
        counts, world_size = step_total(counts)
    loss_sum = torch.zeros((), device=device)
    sums: dict = {}
    for micro, batch in enumerate(micro_batches):
        with gradient_sync(micro + 1 == accum) if gradient_sync else contextlib.nullcontext():
            loss, metrics = objective.loss(model, batch, device, precision, counts, world_size, accuracy)
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
        for name, value in metrics.items():  # on the device, read at a log line only
            sums[name] = sums[name] + value if name in sums else value
    scaler.unscale_(optimizer)
    if grad_clip > 0:
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    else:
        grad_norm = torch.zeros((), device=device)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return (loss_sum, grad_norm, waited, objective.returned(sums)) if accuracy else (loss_sum, grad_norm, waited)
