"""Per-sequence log-probs of the response tokens, the chosen and the rejected in one forward, without
the (tokens x vocab) logits.

A preference batch of P pairs is one batch of 2P rows, the chosen first: rows i and P+i are a pair.
A packed batch (PACKING=1, causal) holds the same 2P sequences side by side in fewer rows, each token
named by sequence_ids in that order; the model gets its position_ids and varlen indices, so every
sequence is embedded and attended as if alone, and the per-token log-probs are summed per sequence
by index_add over those ids, on the device, into the same (2P,) the padded batch gives.
Only response tokens count (labels != -100, after the causal shift for a causal LM). Where they are
is read from the labels on the host before the batch moves (`Responses.of`: no device sync), and
only those positions go through the LM head, so the prompt and the padding never pay for the
(vocab x width) matmul. A model behind DDP, FSDP2 or torch.compile runs its own forward and head
instead (full logits, as step.forward_loss does for them: their wrappers need their own forward).

The head runs a chunk of tokens at a time, as train/core/loss.py's chunked cross-entropy does, but
the output here is one log-prob per token (summed per row afterwards), and the gradient that comes
back differs per token: it is the DPO loss's weight of that token's sequence, known only after the
forward. loss.py's scheme (each chunk's gradient made in the forward and only scaled in backward)
works for one scalar; here it holds for the hidden states alone, since token t's log-prob depends
on its own hidden row only: d logp_t / d h_t can be made in the forward and scaled by token t's
weight later. The head's weight gradient is a sum over tokens of weight_t x (their outer products),
which cannot be made before the weights are known without one (vocab x width) matrix per
sequence. So:
  head trained (full fine-tuning): backward recomputes each chunk's logits from the saved hidden
    rows and each token's logsumexp (4 matmuls per chunk instead of the plain 3; saved: the
    gathered hidden rows and one float per token, never the logits);
  head frozen (LoRA, FREEZE=lm_head): the hidden-state gradient is made in the forward (2 matmuls,
    as the plain loss's forward and its input gradient) and backward scales it per token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace

import torch

from train.core.attention import add_mask_of_ones, host_padding, register_no_sync_mask
from train.core.loss import CHUNK_ELEMENTS, _compute_dtype, lm_hidden_and_head, shift_targets
from train.core.model import unwrapped
from train.core.step import VARLEN_INTS, chunkable
from train.core.units import IGNORE_INDEX


@dataclass(frozen=True)
class Responses:
    """Where a preference batch's response tokens are, read from its labels on the host."""

    # (M,) flat positions in the (rows x width) hidden states that predict a response token
    index: torch.Tensor
    targets: torch.Tensor  # (M,) the token each of them predicts
    # (M,) the sequence (of the 2P) each belongs to: its row, or a packed row's sequence_ids
    rows: torch.Tensor
    counts: torch.Tensor  # (2P,) response tokens per row (the length normalisation's divisor)
    pairs: int  # P
    chosen_tokens: int  # response tokens of the P chosen rows (the SFT term's divisor)
    padded: bool | None  # the 2D mask has zeros (attention.host_padding: no read-back); None: a 4D mask

    @classmethod
    def of(cls, batch: dict, shifted: bool) -> Responses:
        """From the batch as the loader gives it, labels on the CPU (then no device sync): (2P, T), or
        a packed batch's rows with sequence_ids (the shape of labels: each token's sequence in the 2P
        order, -1 on padding) and n_pairs. shifted: a causal LM's labels (position t predicts label
        t+1); False for an encoder-decoder's targets."""
        labels, mask = batch["labels"], batch.get("attention_mask")
        targets = shift_targets(labels) if shifted else labels
        valid = targets != IGNORE_INDEX
        index = valid.reshape(-1).nonzero().squeeze(1)
        sequence_ids = batch.get("sequence_ids")
        if sequence_ids is not None:  # a target's sequence is its label's, shifted as the labels
            pairs = int(batch["n_pairs"])
            rows = (shift_targets(sequence_ids) if shifted else sequence_ids).reshape(-1)[index]
            counts = torch.bincount(rows, minlength=2 * pairs)
        elif labels.shape[0] % 2:
            raise ValueError(f"a preference batch is 2P rows (P chosen, then P rejected); got "
                             f"{labels.shape[0]}")
        else:
            pairs, rows, counts = labels.shape[0] // 2, index // targets.shape[1], valid.sum(1)
        # a prepared (rows, 1, T, T) mask (packed, masked attention) is used as it is: None
        padded = None if mask is not None and mask.dim() != 2 else mask is not None and not bool(mask.all())
        return cls(index, targets.reshape(-1)[index], rows, counts, pairs, int(counts[:pairs].sum()), padded)

    def to(self, device: torch.device) -> Responses:
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)
                 if torch.is_tensor(getattr(self, f.name))}  # fmt: skip
        return replace(self, **moved)


PACKED = ("position_ids", "varlen_index", "varlen_place", "cu_seq_lens_q", "cu_seq_lens_k")
"""A packed batch's tensors for the model (train/data/chat/packing.py): positions restarting per
sequence and the varlen kernel's indices, which keep every sequence apart in attention."""


def device_inputs(batch: dict, device: torch.device) -> dict:
    """The tensors the forward takes (input_ids, attention_mask, labels, a packed batch's PACKED),
    moved, and flash-attention's varlen host ints; the other host ints, sequence_ids (read by
    Responses.of) and the precomputed reference's columns stay where they are."""
    moved = {
        k: batch[k].to(device, non_blocking=True)
        for k in ("input_ids", "attention_mask", "labels", *PACKED)
        if k in batch
    }
    return {**moved, **{k: batch[k] for k in VARLEN_INTS if k in batch}}


def _model_inputs(inputs: dict) -> dict:
    """What the causal model's forward is given: inputs less the labels, with forward_loss's 2D
    mask of ones where a batch (a packed flat row) has none (attention.add_mask_of_ones)."""
    oom_guard = {k: v for k, v in inputs.items() if k != "labels"}
    add_mask_of_ones(oom_guard)
    return oom_guard


class _ChunkedLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, grads):
        # hidden (M, H) rows that predict targets (M,) through the head weight (V, H) -> (M,) fp32
        # log-probs. grads: grad mode was on outside (inside forward it is always off).
        want_h, want_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        dtype = _compute_dtype(hidden.device, hidden.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            lse_all = torch.empty_like(out) if want_w else None
            grad_h = torch.empty_like(hidden) if want_h and not want_w else None
            for lo in range(0, hidden.shape[0], chunk):
                t = targets[lo : lo + chunk]
                logits = (hidden[lo : lo + chunk].to(dtype) @ w.T).float()
                lse = torch.logsumexp(logits, dim=-1)
                out[lo : lo + chunk] = logits.gather(1, t[:, None])[:, 0] - lse
                if want_w:
                    lse_all[lo : lo + chunk] = lse
                elif want_h:  # d logp_t / d logits_t = one_hot(t) - softmax, in place in the logits buffer
                    grad = logits.sub_(lse[:, None]).exp_().neg_()
                    grad[torch.arange(len(t), device=t.device), t] += 1.0
                    grad_h[lo : lo + chunk] = (grad.to(dtype) @ w).to(hidden.dtype)
        ctx.chunk, ctx.dtype, ctx.recompute = chunk, dtype, bool(want_w)
        if want_w:
            ctx.save_for_backward(hidden, weight, targets, lse_all)
        else:
            ctx.save_for_backward(grad_h)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.recompute:
            (grad_h,) = ctx.saved_tensors
            gh = grad_h * grad_out[:, None].to(grad_h.dtype) if grad_h is not None else None
            return gh, None, None, None, None
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for lo in range(0, hidden.shape[0], chunk):
                h, t = hidden[lo : lo + chunk].to(dtype), targets[lo : lo + chunk]
                g = grad_out[lo : lo + chunk].float()
                # the chunk's logits again (module doc), then g_t x (one_hot(t) - softmax) in their buffer
                grad = (h @ w.T).float().sub_(lse[lo : lo + chunk, None]).exp_().mul_(-g[:, None])
                grad[torch.arange(len(t), device=t.device), t] += g
                grad = grad.to(dtype)
                if grad_h is not None:
                    grad_h[lo : lo + chunk] = (grad @ w).to(hidden.dtype)
                grad_w += (grad.T @ h).float()
        return grad_h, grad_w.to(weight.dtype), None, None, None


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int | None = None) -> torch.Tensor:  # fmt: skip
    """(M,) fp32 log-probs of targets (M,) from hidden rows (M, H) through a bias-free head (V, H),
    chunk_tokens at a time (default: CHUNK_ELEMENTS // V, as the chunked cross-entropy)."""
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // weight.shape[0])
    return _ChunkedLogps.apply(hidden, weight, targets, chunk, torch.is_grad_enabled())


def _from_logits(logits: torch.Tensor, responses: Responses) -> torch.Tensor:
    """Per-token log-probs from logits a wrapper's forward made whole (DDP, FSDP2, compiled: as
    step.forward_loss, those keep the model's own head)."""
    picked = logits.reshape(-1, logits.shape[-1]).index_select(0, responses.index).float()
    return picked.log_softmax(-1).gather(1, responses.targets[:, None])[:, 0]


def seq2seq_tokens(model, inputs: dict, responses: Responses, chunk_tokens: int | None) -> torch.Tensor:
    """An encoder-decoder's per-token log-probs: the encoder once on the P sources, the decoder on
    the 2P targets against the encoder states repeated (a pair's chosen and rejected share their
    source). A wrapped model (DDP, FSDP2, compiled) must run its own forward, so it takes TRL's way,
    the source twice; so does a decoder this does not know how to scale into the head."""
    bare = unwrapped(model)
    labels = inputs["labels"]
    decoder_input_ids = bare.prepare_decoder_input_ids_from_labels(labels=labels)
    mask = inputs.get("attention_mask")
    twice = None if mask is None else torch.cat([mask, mask])
    if not chunkable(model):
        sources = torch.cat([inputs["input_ids"], inputs["input_ids"]])
        logits = model(input_ids=sources, attention_mask=twice, decoder_input_ids=decoder_input_ids).logits
        return _from_logits(logits, responses)
    encoded = bare.get_encoder()(input_ids=inputs["input_ids"], attention_mask=mask).last_hidden_state
    states = torch.cat([encoded, encoded])
    scale = getattr(bare.config, "scale_decoder_outputs", None)  # T5: d_model ** -0.5 before a tied head
    if scale is None or getattr(bare, "final_logits_bias", None) is not None:
        logits = bare(
            encoder_outputs=(states,), attention_mask=twice, decoder_input_ids=decoder_input_ids
        ).logits
        return _from_logits(logits, responses)
    hidden = bare.get_decoder()(input_ids=decoder_input_ids, encoder_hidden_states=states,
                                encoder_attention_mask=twice).last_hidden_state  # fmt: skip
    if scale:
        hidden = hidden * bare.config.d_model**-0.5
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, responses.index)
    return token_logps(rows, bare.get_output_embeddings().weight, responses.targets, chunk_tokens)


def causal_tokens(model, inputs: dict, responses: Responses, chunk_tokens: int | None) -> torch.Tensor:
    """A causal LM's per-token log-probs: its base model once on the 2P rows (or the packed rows holding
    them) and the head on the response tokens only (chunked, module doc); a wrapped model (DDP, FSDP2,
    compiled) runs its own forward and head."""
    if not chunkable(model):
        return _from_logits(model(**_model_inputs(inputs)).logits, responses)
    hidden, weight = lm_hidden_and_head(model, **_model_inputs(inputs))
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, responses.index)
    return token_logps(rows, weight, responses.targets, chunk_tokens)


def sequence_logps(model, inputs: dict, responses: Responses, chunk_tokens: int | None = None, *,
                   layout) -> torch.Tensor:  # fmt: skip
    """(2P,) fp32: each sequence's summed log-prob of its response tokens, under the caller's autocast
    and grad mode. inputs: device_inputs(the batch); responses: layout.responses(the host batch).to(device).
    layout: the model's family's (train/models Family.layout), whose token_logps is causal_tokens or
    seq2seq_tokens."""
    register_no_sync_mask()
    maskless = "attention_mask" not in inputs
    padding = (
        host_padding(responses.padded, maskless) if responses.padded is not None else contextlib.nullcontext()
    )
    with padding:
        per_token = layout.token_logps(model, inputs, responses, chunk_tokens)
    # per sequence: a row's sum, or a packed row's sequences' (sequence_ids), by index_add on the device
    return per_token.new_zeros(responses.counts.shape[0]).index_add(0, responses.rows, per_token)
