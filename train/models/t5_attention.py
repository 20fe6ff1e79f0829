"""T5's attention with its relative position bias made once per forward (T5_SDPA), not once per layer.

transformers' T5 runs sdpa with the bias as a float mask, but builds that mask again in every layer
(create_position_bias_mask: the bias and the padding mask combined by torch.where, a fresh (B, H, T, T)
tensor, then made contiguous), and hands the cross-attention a bias of zeros it builds in its first
layer, so each cross-attention layer makes a (B, H, T_target, T_source) mask that only says which
source tokens are padding, and on a GPU sdpa cannot take its flash kernel for it. The bias is the
same for every layer (the first layer computes it and T5 passes it down), and so is the mask.

Here a forward pre-hook on each stack's first self-attention (the one that owns the bias table)
computes the bias itself and folds the mask in, once: where the batch has no padding (pretraining's
windows) the bias alone, (1, H, T, T), broadcast over the batch by sdpa; with padding, the (B, H, T, T)
float mask made once; in the decoder the causal pattern too. T5 hands that on to every later layer
as position_bias (the same hook on those only marks the call, FOLDED), and t5_sdpa_attention passes
it to scaled_dot_product_attention as attn_mask with scale 1.0 (T5 does not scale by 1/sqrt(d)).
Cross-attention ignores T5's zeros and takes the padding mask alone, made additive once per forward
(additive_mask; None without padding: sdpa's flash kernel on a GPU). Under autocast the folded mask
is cast to the compute dtype once, not by autocast in each layer. Gradients reach the bias table
through the one mask: sdpa's gradient of attn_mask from each layer adds up in it.

With ENABLE_GRAD_CKPT and a padded batch the self-attentions keep transformers' per-layer mask: the
checkpointed blocks keep their inputs, and a folded (B, H, T, T) one would stay the whole backward
pass (measured: a higher peak). Generation with a cache, or a model switched to another
implementation: transformers' own path, unchanged. Nothing of this is saved: final/ holds weights
and a config, and loads and generates with plain transformers (its sdpa).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

T5_SDPA = "t5_sdpa"
FOLDED = "t5_bias_folded"
"""The keyword the hooks add to a self-attention call whose position_bias has the mask folded in."""
ALIGN = 8


def additive_mask(*args, **kwargs):
    """T5_SDPA's masks: sdpa's (through the kit's no_sync_mask, which reads no mask back to ask about
    padding); the decoder's (the cross-attention's padding) made additive once per forward, 0 where
    attended and the dtype's lowest where not, in the dtype the attention runs in, so that no layer
    converts a boolean mask again (sdpa would, in each call). The encoder's stays boolean (a quarter
    of the bytes): only the fold reads it."""
    from train.core.attention import no_sync_mask

    mask = no_sync_mask(*args, **kwargs)
    if mask is None or mask.dtype != torch.bool or not getattr(kwargs.get("config"), "is_decoder", False):
        return mask
    kind = mask.device.type
    dtype = (
        torch.get_autocast_dtype(kind)
        if torch.is_autocast_enabled(kind)
        else kwargs.get("dtype", torch.float32)
    )
    return torch.full_like(mask, torch.finfo(dtype).min, dtype=dtype).masked_fill_(mask, 0.0)


def _folded_bias(module, hidden_states, mask):
    """The first layer's bias with the mask folded in: (1 or B, H, T, T), causal in the decoder."""
    length = hidden_states.shape[1]
    bias = module.compute_bias(length, length, device=hidden_states.device)  # (1, H, T, T)
    if mask is not None:  # (B, 1, T, T), the causal pattern included in the decoder's
        bias = (
            bias + mask if mask.is_floating_point() else torch.where(mask, bias, torch.finfo(bias.dtype).min)
        )
    elif module.is_decoder:  # no padding: only the causal pattern, the same for every row
        keep = torch.ones(length, length, dtype=torch.bool, device=bias.device).tril()
        bias = bias.masked_fill(~keep, torch.finfo(bias.dtype).min)
    if torch.is_autocast_enabled(bias.device.type):
        bias = bias.to(torch.get_autocast_dtype(bias.device.type))
    if bias.device.type == "cuda" and length % ALIGN:
        # sdpa's memory-efficient kernel pads a mask whose rows are not 8-aligned, in every layer
        # (aten preprocess_mask): padded here once, its view of the real keys passes as aligned
        bias = F.pad(bias, (0, ALIGN - length % ALIGN))[..., :length]
    return bias


def _fold_hook(module, args, kwargs):
    """A self-attention's forward pre-hook: the first layer's bias made once with the mask folded in,
    and every layer told so (FOLDED). Inert under a cache (generation) or another implementation."""
    if module.config._attn_implementation != T5_SDPA or kwargs.get("past_key_values") is not None:
        return None
    mask = kwargs.get("mask")
    if mask is not None and module.training and module.gradient_checkpointing:
        # checkpointing saves every block's inputs: a folded (B, H, T, T) mask would stay for the whole
        # backward pass and be made again in block 0's recompute; per layer it lives one block only
        return None
    if module.has_relative_attention_bias:
        hidden = args[0] if args else kwargs["hidden_states"]
        kwargs["position_bias"] = _folded_bias(module, hidden, mask)
    elif kwargs.get("position_bias") is None:
        return None
    return args, {**kwargs, FOLDED: True}


def t5_sdpa_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_bias=None,
    **kwargs,
):
    """transformers' attention-interface signature, as its sdpa_attention_forward: returns
    ((batch, tokens, heads, dim), None)."""
    folded = kwargs.pop(FOLDED, False)
    if folded:
        mask = position_bias
    elif module.is_decoder and not module.is_causal:  # cross-attention: T5's bias there is zeros
        mask = attention_mask
    else:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            position_bias=position_bias,
            **kwargs,
        )
    if mask is not None and mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)  # a query in another dtype than autocast's (sdpa takes no mix)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                         scale=1.0 if scaling is None else scaling)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def register() -> None:
    """T5_SDPA as an attn_implementation transformers accepts, with its masks (additive_mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(T5_SDPA, t5_sdpa_attention)
    AttentionMaskInterface.register(T5_SDPA, additive_mask)


def install(model) -> None:
    """The kit's T5 attention on a T5 model (T5ForConditionalGeneration, T5Model...): T5_SDPA, and the
    fold hook on every self-attention (once; a second install changes nothing)."""
    from transformers.models.t5.modeling_t5 import T5LayerSelfAttention

    register()
    model.set_attn_implementation(T5_SDPA)
    for layer in model.modules():
        if isinstance(layer, T5LayerSelfAttention):
            attention = layer.SelfAttention
            if _fold_hook not in attention._forward_pre_hooks.values():
                attention.register_forward_pre_hook(_fold_hook, with_kwargs=True)
