"""Per-token log-probs (and entropies) of the sampled completion tokens, without the (tokens x vocab)
logits.

A GRPO batch is TRL's: prompt_ids / prompt_mask (B, P), left-padded, then completion_ids /
completion_mask (B, C), right-padded; the forward sees them side by side as one (B, P + C) row with
its attention mask, as TRL's _get_per_token_logps_and_entropies feeds the model. Completion token j
of row b sits at P + j and is predicted by position P + j - 1. Only the tokens the completion mask
keeps go through the LM head (where they are is read from the mask on the host before the batch
moves, and so is whether any row is padded, which transformers' sdpa mask would otherwise ask the
device: no host sync), a chunk of them at a time, as train/core/loss.py's chunked cross-entropy
does, so no (tokens x vocab) fp32 array exists at once. As TRL, the logits are multiplied by
1 / TEMPERATURE before the log-softmax (the sampling distribution's log-probs), and a token the mask
drops reads 0 (log-prob and entropy).

The gradient that comes back differs per token (the policy loss's weight of it), so, as
train/core/preference/logps.py does for a trained head, backward recomputes each chunk's logits from
the saved hidden rows and each token's logsumexp: 4 matmuls per chunk where the plain loss takes 3,
and never the logits saved. The entropy (TRL's `entropy` metric) is taken from the same chunks in the
forward and carries no gradient (TRL's entropy bonus, entropy_coef, is not built); its softmax is a
second (chunk x vocab) fp32 buffer beside the logits, 2 x 128 MiB at CHUNK_ELEMENTS.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from train.core.attention import add_mask_of_ones, host_padding, register_no_sync_mask
from train.core.loss import CHUNK_ELEMENTS, _compute_dtype, lm_hidden_and_head
from train.core.step import chunkable


@dataclass(frozen=True)
class Completions:
    """Where a GRPO batch's scored completion tokens are, read from its masks on the host."""

    index: torch.Tensor  # (M,) flat positions in the (B x (P + C)) hidden states that predict a kept token
    targets: torch.Tensor  # (M,) the token each predicts
    place: torch.Tensor  # (M,) its flat position in the (B x C) output
    shape: tuple[int, int]  # (B, C)
    padded: bool  # the (B, P + C) attention mask has zeros (transformers would ask the device)

    @classmethod
    def of(cls, batch: dict) -> Completions:
        """From the batch as the loader gives it (masks on the CPU: then no device sync)."""
        mask = batch["completion_mask"]
        rows, width = mask.shape
        prompt = batch["prompt_ids"].shape[1]
        place = mask.reshape(-1).nonzero().squeeze(1)
        row, col = place // width, place % width
        index = row * (prompt + width) + prompt + col - 1
        padded = not bool(batch["prompt_mask"].all() and mask.all())
        return cls(index, batch["completion_ids"].reshape(-1)[place], place, (rows, width), padded)

    def to(self, device: torch.device) -> Completions:
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)
                 if torch.is_tensor(getattr(self, f.name))}  # fmt: skip
        return replace(self, **moved)


def model_inputs(batch: dict, device: torch.device) -> dict:
    """The forward's input_ids, attention_mask and position_ids: prompt then completion, moved (TRL's
    concatenation; a masked completion token, MASK_TRUNCATED_COMPLETIONS's, is masked in attention too, as
    there). The positions are the sampler's, counted from each prompt's first token (Rollout.forward_inputs):
    TRL passes none, so a left-padded prompt's completion is scored at other positions than it was drawn
    at; rotary models are indifferent, but GPT-2's learned positions then score other log-probs than the
    sampling's (tests/test_grpo_sampling.py)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    positions = torch.cat([batch["prompt_mask"], torch.ones_like(batch["completion_mask"])], 1).cumsum(1) - 1
    return {"input_ids": ids.to(device, non_blocking=True),
            "attention_mask": mask.to(device, non_blocking=True),
            "position_ids": positions.clamp(min=0).to(device, non_blocking=True)}  # fmt: skip


# COMPILE's length buckets. The completions are padded, not the prompts: more left padding would move
# every real token to a later position (the forward counts positions from the row's start, not the mask).
def widen(batch: dict, widths: tuple[int, ...], pad_id: int) -> dict:
    """The scored batch with its completions right-padded (pad_id, mask 0, log-probs 0) until prompt +
    completion is the smallest of `widths` that holds it (wider than the last: as it is), so the compiled
    forward meets a few widths. The padding follows every real token of its row, so causal attention never
    reads it, and the masks leave it out of every sum: the loss and its gradient are the unpadded ones."""
    prompt, width = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    extra = next((w for w in widths if w >= prompt + width), prompt + width) - prompt - width
    if extra == 0:
        return batch
    fill = {"completion_ids": pad_id, "completion_mask": 0, "old_per_token_logps": 0.0,
            "ref_per_token_logps": 0.0}  # fmt: skip
    pad = torch.nn.functional.pad
    return {k: pad(v, (0, extra), value=fill[k]) if k in fill else v for k, v in batch.items()}


def _scaled_chunk(h: torch.Tensor, w: torch.Tensor, inv_t: float) -> torch.Tensor:
    """A chunk's fp32 logits times 1 / TEMPERATURE (TRL's fused head multiplies by inv_t)."""
    logits = (h @ w.T).float()
    return logits.mul_(inv_t) if inv_t != 1.0 else logits


class _ChunkedCompletionLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, inv_t):
        # hidden (M, H) rows that predict targets (M,) through the head weight (V, H) -> (M,) fp32
        # log-probs and (M,) entropies of softmax(logits / T).
        dtype = _compute_dtype(hidden.device, hidden.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            entropy, lse_all = torch.empty_like(out), torch.empty_like(out)
            for lo in range(0, hidden.shape[0], chunk):
                t = targets[lo : lo + chunk]
                z = _scaled_chunk(hidden[lo : lo + chunk].to(dtype), w, inv_t)
                lse = torch.logsumexp(z, dim=-1)
                out[lo : lo + chunk] = z.gather(1, t[:, None])[:, 0] - lse
                lse_all[lo : lo + chunk] = lse
                # H = lse - sum_v p_v z_v (TRL's log_z - x_sum_exp / sum_exp)
                entropy[lo : lo + chunk] = lse - (z - lse[:, None]).exp_().mul_(z).sum(-1)
        ctx.chunk, ctx.dtype, ctx.inv_t = chunk, dtype, inv_t
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        if grad_out is None:
            return None, None, None, None, None
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk, dtype, inv_t = ctx.chunk, ctx.dtype, ctx.inv_t
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            grad_h = torch.empty_like(hidden) if want_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
            for lo in range(0, hidden.shape[0], chunk):
                h, t = hidden[lo : lo + chunk].to(dtype), targets[lo : lo + chunk]
                g = grad_out[lo : lo + chunk].float() * inv_t  # d(z / T) / dz = 1 / T
                # g_t x (one_hot(t) - softmax) in the recomputed logits' buffer
                grad = _scaled_chunk(h, w, inv_t).sub_(lse[lo : lo + chunk, None]).exp_().mul_(-g[:, None])
                grad[torch.arange(len(t), device=t.device), t] += g
                grad = grad.to(dtype)
                if want_h:
                    grad_h[lo : lo + chunk] = (grad @ w).to(hidden.dtype)
                if want_w:
                    grad_w += (grad.T @ h).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def token_logps_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        temperature: float = 1.0, chunk_tokens: int | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """((M,) fp32 log-probs, (M,) fp32 entropies, no gradient) of targets (M,) from hidden rows (M, H)
    through a bias-free head (V, H) at TEMPERATURE, chunk_tokens at a time (default CHUNK_ELEMENTS // V)."""
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // weight.shape[0])
    return _ChunkedCompletionLogps.apply(hidden, weight, targets, chunk, 1.0 / temperature)


def _from_logits(logits: torch.Tensor, where: Completions, inv_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A wrapper's forward (DDP, FSDP2, compiled) makes the logits whole: the same numbers from them."""
    z = logits.reshape(-1, logits.shape[-1]).index_select(0, where.index).float() * inv_t
    logp = z.log_softmax(-1)
    entropy = -(logp.detach().exp() * logp.detach()).sum(-1)
    return logp.gather(1, where.targets[:, None])[:, 0], entropy


def completion_logps(model, inputs: dict, where: Completions, temperature: float = 1.0,
                     chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """((B, C) fp32 per-token log-probs, (B, C) entropies without gradient) of the completion tokens, 0
    where the completion mask is 0, under the caller's autocast and grad mode (no_grad for the old and
    the reference log-probs). inputs: model_inputs(batch); where: Completions.of(batch).to(device)."""
    feed = dict(inputs)
    add_mask_of_ones(feed)
    inv_t = 1.0 / temperature
    register_no_sync_mask()  # sdpa's mask from the host's answer (where.padded), not the device's
    with host_padding(where.padded):
        if chunkable(model):
            hidden, weight = lm_hidden_and_head(model, **feed)
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, where.index)
            logps, entropy = token_logps_entropy(rows, weight, where.targets, temperature, chunk_tokens)
        else:
            logps, entropy = _from_logits(model(**feed).logits, where, inv_t)
    size = where.shape[0] * where.shape[1]
    # out-of-place index_put keeps the gradient path; every other place reads 0, as TRL's masked labels do
    full = [x.new_zeros(size).index_put((where.place,), x).view(where.shape) for x in (logps, entropy)]
    return full[0], full[1]
