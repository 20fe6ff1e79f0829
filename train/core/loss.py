"""The language-model loss without the (tokens x vocab) logits, and token-correct under accumulation.

Chunked cross-entropy: the LM head and the loss run over a few hundred tokens at a time, so
the fp32 logits of a whole micro-batch (8 x 1024 tokens x 50K vocab = 1.6 GB, and as much
again for their gradient) never exist at once. The gradients of each chunk are computed in
the forward pass, right after its loss, and kept (they are the size of the hidden states and
of the head's weight, not of the logits); backward only scales them. That is the backward
done chunk by chunk without recomputing the logits a second time (three matmuls per chunk,
as the plain loss; recomputing in backward would take four).

Token-correct accumulation: transformers' loss is the mean over one micro-batch's target
tokens, so with accumulation a micro-batch of 30 targets weighs as much as one of 3,000. The
loss of an optimizer step here is sum(token losses of all micro-batches) / (all their target
tokens), which equals the loss of one big batch. The step's total is counted on the host
from the labels (count_targets) before they move to the device, so no micro-step waits for
the device to learn it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from train.core.units import IGNORE_INDEX

CHUNK_ELEMENTS = 2**25  # logits per chunk (128 MiB in fp32): ~650 tokens at GPT-2's 50K vocab


def shift_targets(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels -> (B, T) targets: position t predicts label t+1, the last predicts nothing.
    The same shift as transformers' ForCausalLMLoss (labels padded with -100, then [1:])."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def _compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The matmul dtype the plain head would run in: autocast's where it is on (bf16/fp16
    logits, upcast to fp32 for the loss, as transformers does), else the hidden states'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, grads, correct):
        # hidden (N, H), weight (V, H), targets (N,) -> the SUM of token losses (fp32 scalar).
        # grads: grad mode was on outside (inside forward it is always off, and
        # needs_input_grad says True under no_grad too, where gradients would be wasted work).
        # correct: also count the targets the argmax predicts, on the device (mean_token_accuracy
        # of a log step), from each chunk's logits while they exist.
        want_h, want_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        dtype = _compute_dtype(hidden.device, hidden.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(hidden) if want_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
            hits = torch.zeros((), dtype=torch.long, device=hidden.device) if correct else None
            for lo in range(0, hidden.shape[0], chunk):
                h = hidden[lo : lo + chunk].to(dtype)
                t = targets[lo : lo + chunk]
                valid = t != IGNORE_INDEX
                safe = torch.where(valid, t, 0)
                logits = (h @ w.T).float()
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, safe[:, None])[:, 0]
                total += ((lse - picked) * valid).sum()
                if correct:  # before the gradient below overwrites the logits in place
                    hits += correct_predictions(logits, t)
                if not (want_h or want_w):
                    continue
                # d(sum of losses)/d(logits) = softmax - one_hot(target), zero on ignored rows;
                # built in place in the logits buffer so a chunk holds one (c, V) fp32 array.
                grad = logits.sub_(lse[:, None]).exp_()
                grad[torch.arange(len(t), device=t.device), safe] -= 1.0
                grad *= valid[:, None]
                g = grad.to(dtype)
                del logits, grad
                if want_h:
                    grad_h[lo : lo + chunk] = (g @ w).to(hidden.dtype)
                if want_w:
                    grad_w += (g.T @ h).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        if hits is None:
            return total
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_out, *_):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None


def correct_predictions(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Targets (not -100) whose argmax prediction equals them, as a device count (no sync):
    logits (..., V) and targets (...) already aligned (shifted for a causal LM)."""
    return ((logits.argmax(-1) == targets) & (targets != IGNORE_INDEX)).sum()


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int | None = None,
    correct: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(sum of token losses, number of target tokens) for final hidden states (B, T, H), the LM
    head's weight (V, H) (GPT-2 ties it to wte) and unshifted labels (B, T) with -100 where
    nothing is learned. Both are device tensors: reading them is what syncs, not this call.
    chunk_tokens: tokens per chunk (default: CHUNK_ELEMENTS // V). correct: a third, the count
    of targets the argmax predicts (taken inside the chunks: the full logits never exist)."""
    vocab, width = weight.shape
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // vocab)
    targets = shift_targets(labels).reshape(-1)
    flat = hidden.reshape(-1, width)
    out = _ChunkedCrossEntropy.apply(flat, weight, targets, chunk, torch.is_grad_enabled(), correct)
    total, hits = out if correct else (out, None)
    count = (targets != IGNORE_INDEX).sum()
    return (total, count, hits) if correct else (total, count)


def count_targets(batch: dict, shifted: bool = True) -> int:
    """Target tokens of a micro-batch as a host int: labels != -100 after the causal shift (the
    first label of a row is never a target). shifted False: an encoder-decoder's labels, each
    of which is a target (its decoder shifts its inputs, not the labels). Call it on the batch
    as the loader gives it, labels still on the CPU: then it costs no device sync."""
    if isinstance(batch, dict) and "labels" not in batch:  # pretraining: every next token is a target
        rows, width = batch["input_ids"].shape
        return rows * (width - 1)
    labels = batch["labels"] if isinstance(batch, dict) else batch
    return int(((labels[..., 1:] if shifted else labels) != IGNORE_INDEX).sum())


def step_targets(batches: Iterable[dict], shifted: bool = True) -> int:
    """Target tokens of one optimizer step: its micro-batches together (fetch them first)."""
    return sum(count_targets(b, shifted) for b in batches)


def seq2seq_loss_sum(model, unwrapped, input_ids, attention_mask, labels, correct: bool = False):
    """The SUM of target-token losses of an encoder-decoder (T5, BART): the decoder's inputs are
    the labels shifted right from its start token (the model's own rule), the loss is taken
    here in fp32 as a sum, so accumulation can divide by the step's target count (transformers'
    T5 loss is a per-batch mean and takes no num_items_in_batch). `model` is what runs the
    forward (DDP, FSDP2 or compiled); `unwrapped` the transformers model it wraps. correct: also
    the count of decoder labels the argmax predicts, as (sum, count)."""
    decoder_input_ids = unwrapped.prepare_decoder_input_ids_from_labels(labels=labels)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids
    ).logits
    total = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return (total, correct_predictions(logits, labels)) if correct else total


def token_mean_share(sum_loss: torch.Tensor, step_total: int, world_size: int = 1) -> torch.Tensor:
    """A micro-batch's share of the step's loss: sum_loss / step_total. Backward of each share,
    added over the step's micro-batches, gives the gradient of the token mean over all of them.
    With DDP, which averages gradients over ranks, step_total is the count over all ranks and
    the share is scaled by world_size so the average comes out as the global token mean."""
    return sum_loss / max(1, step_total) * world_size


def lm_hidden_and_head(model, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states, LM-head weight) of a transformers causal LM whose head is a plain
    linear map (GPT-2, Llama, Qwen ...): the base model's output instead of the logits."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("chunked_cross_entropy supports LM heads without a bias")
    out = model.base_model(**inputs)
    return out.last_hidden_state, head.weight


def seq2seq_tokens(batch: dict) -> tuple[int, int]:
    """(real, padded) source + target tokens of a seq2seq batch (the batch contract: input_ids
    and attention_mask the source, labels the target with -100 on padding), on the host."""
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    labels = batch.get("labels", ids)  # no labels: the model learns its source (core/step.py forward_loss)
    source = int(mask.sum()) if mask is not None else ids.numel()
    return source + int((labels != IGNORE_INDEX).sum()), ids.numel() + labels.numel()
