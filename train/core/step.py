"""One optimizer step, as the guides write it: set lr -> micro-steps (autocast, backward of
loss / accumulation) -> unscale -> clip -> step -> zero_grad(set_to_none=True). The loop, the
bench, find-batch and autotune all run this code: there is no second, faster copy. The optimizer and
the learning rate it is stepped with are train/core/optim's (build_optimizer, build_schedule)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from train.core.attention import add_mask_of_ones, host_padding, register_no_sync_mask
from train.core.device import autocast
from train.core.loss import (
    chunked_cross_entropy,
    correct_predictions,
    lm_hidden_and_head,
    seq2seq_loss_sum,
    shift_targets,
    token_mean_share,
)
from train.core.model import unwrapped
from train.core.objective import perplexity


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's grad norm) as a plain tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


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


@contextlib.contextmanager
def compiled_run_eager():
    """A compiled model's step run eager (torch.compiler's force_eager stance: the host-sync
    probe's step). It gets the same inputs as the compiled step (forward_loss hands both the 2D
    mask of ones), so the probe counts the compiled step's syncs."""
    with torch.compiler.set_stance("force_eager"):
        yield


def forward_loss(
    model, batch: dict, device: torch.device, precision: str, targets: int | None = None, world_size: int = 1,
    accuracy: bool = False, *, layout,
):
    """The batch's summed token loss / `targets`: the target tokens of the whole optimizer step
    (token-correct accumulation: the step's loss is the mean over all its target tokens, as
    one big batch would give, not a mean of per-micro-batch means). targets None: this batch's
    own (its mean loss). Counted on the host before the batch moves: no device sync. With DDP or
    FSDP2, which average gradients over ranks, `targets` is the count over all ranks and the
    share is scaled by world_size: the step's gradient is the token mean over every rank's
    targets, as one process would take it, whatever each rank's own count. layout: the model's family's
    (train/models Family.layout): what the targets are, and an encoder-decoder's source -> target batch."""
    if targets is None:
        targets = layout.count_targets(batch)
    # Only tensors reach the model, and flash-attention's varlen lengths: the collators also hand
    # over host ints (n_real_tokens ...), which BatchCounter has already read. Without
    # max_length_q/k transformers rebuilds the varlen arguments from position_ids on the device,
    # reading them back in every layer.
    padded, maskless = _host_padded(batch), "attention_mask" not in batch
    batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
             if torch.is_tensor(v) or k in VARLEN_INTS}
    labels = batch.pop("labels", batch["input_ids"])
    add_mask_of_ones(batch)
    with (
        autocast(device, precision),
        host_padding(padded, maskless) if padded is not None else contextlib.nullcontext(),
    ):
        # source -> target: input_ids and attention_mask are the source, labels the target
        if layout.encoder_decoder:
            out = seq2seq_loss_sum(
                model,
                unwrapped(model),
                batch["input_ids"],
                batch.get("attention_mask"),
                labels,
                correct=accuracy,
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
    """The token-mean LM loss of pretraining and SFT: train_step's default objective (the interface:
    train/core/objective.py Objective). An objective counts its step's divisors on the host from the
    micro-batches (counts; with several ranks each is summed over them) and gives each micro-batch's
    share of the step's loss with its metrics,
    device tensors that train_step sums over the micro-steps (loss). Preference training's is
    train/core/preference/loss.py PreferenceObjective."""

    rows_per_sample: ClassVar[int] = 1
    unit: ClassVar[str] = "samples"
    trial_on_longest: ClassVar[bool] = False  # find-batch: worst-case rows, every one MAX_LENGTH tokens
    layout: object  # the model's family's Layout (train/models/family.py)
    micro_batch_mean: bool = False
    """LOSS_MEAN=micro_batches: each micro-batch's own token mean / the step's micro-batches (over
    all ranks), as ChatLM-mini-Chinese's loop averages: a short micro-batch's tokens weigh more."""

    def counts(self, micro_batches) -> int:
        if self.micro_batch_mean:
            return len(micro_batches)
        return self.layout.step_targets(micro_batches)

    def loss(self, model, batch, device, precision, counts, world_size: int, accuracy: bool):
        if self.micro_batch_mean:  # its own targets x the micro-batches: host ints, no device sync
            counts *= self.layout.count_targets(batch)
        out = forward_loss(model, batch, device, precision, counts, world_size, accuracy,
                           layout=self.layout)  # fmt: skip
        return (out[0], {"mean_token_accuracy": out[1]}) if accuracy else (out, {})

    def returned(self, sums: dict):
        """train_step's fourth value on a log step: the token accuracy (a device tensor)."""
        return sums["mean_token_accuracy"]

    def named(self, returned) -> dict:
        return {"mean_token_accuracy": returned}

    def samples(self, batch: dict) -> int:
        """Rows; a packed row holds several conversations (the collator's n_conversations)."""
        return int(batch.get("n_conversations", batch["input_ids"].shape[0]))

    def shown(self, row: dict) -> str:
        return f"acc {row['mean_token_accuracy']:.3f}"

    def evaluate(self, model, batch: dict, device, precision: str):
        """The batch's token mean loss, weighted by its predicted tokens (labels after the causal shift,
        or an encoder-decoder's every label, that are not -100): a short last batch or masked SFT
        prompts count by their tokens. The token-weighted loss whatever LOSS_MEAN, as one big batch."""
        tokens = self.layout.count_targets(batch)  # host labels: no sync
        return tokens, forward_loss(model, batch, device, precision, layout=self.layout), {}

    def perplexity(self, loss: float | None) -> float | None:
        return perplexity(loss)

    def eval_shown(self, loss: float, metrics: dict) -> str:
        ppl = perplexity(loss)  # a non-finite loss has no perplexity: n/a, and the loop stops the run
        return f"val_ppl {'n/a' if ppl is None else format(ppl, '.2f')}"

    def kept(self, metrics: dict) -> dict:
        return {}

    def describe(self) -> str:
        return "token loss"


def _host_padded(batch: dict) -> bool | None:
    """Whether the batch has padding, read from its host tensors before they move (no device
    sync): the 2D attention_mask's zeros; None for a prepared 4D mask (used as it is)."""
    register_no_sync_mask()
    mask = batch.get("attention_mask")
    if mask is None:
        return False
    return None if mask.dim() != 2 else not bool(mask.all())


def train_step(
    model,
    optimizer,
    scaler,
    batches,
    accum: int,
    grad_clip: float,
    device,
    precision,
    gradient_sync=None,
    step_total=None,
    accuracy: bool = False,
    *,
    layout,
    objective=None,
):
    """One optimizer step: micro-steps (autocast, backward of each micro-batch's share of the
    step's token-mean loss) -> unscale -> clip -> step -> zero_grad. The step's micro-batches
    are fetched first, so their target tokens are counted (on the host) before any forward.
    Returns (step loss, grad norm) as device tensors, so nothing here waits for the device,
    and the seconds spent waiting for batches. gradient_sync(last) (from
    train.distributed.process_group) keeps gradients local on all but the last micro-step;
    step_total(targets) -> (targets over all ranks, ranks) makes the loss the token mean over
    every rank (SFT's ranks hold different numbers of target tokens). accuracy (a log step's):
    a fourth, the step's mean_token_accuracy on this rank's share, a device tensor read with the
    loss at the log line's one sync (the argmax costs a step that logs nothing no work at all).
    objective: the mode's loss (TokenObjective's interface), default the token loss; a log step's
    fourth value is then objective.returned(the metrics summed over the micro-steps)."""
    objective = objective or TokenObjective(layout)
    start = time.perf_counter()
    micro_batches = [next(batches) for _ in range(accum)]
    waited = time.perf_counter() - start
    rollout = getattr(objective, "rollout", None)  # completions made under the current weights (GRPO's)
    if rollout is not None:
        micro_batches = rollout(model, micro_batches)
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
    return (
        (loss_sum, grad_norm, waited, objective.returned(sums)) if accuracy else (loss_sum, grad_norm, waited)
    )
