"""Packed attention without a dense mask: every conversation of a flattened row attends only to
itself, through scaled_dot_product_attention's causal kernels, with no (T x T) mask anywhere.

The collator's varlen form gives the model one row (1, N) of every conversation end to end,
position_ids restarting at 0, and two index tensors made on the host from the lengths
(`varlen_indices`): varlen_index (conversations, longest), each conversation's token positions
in the row, right-padded, and varlen_place (N,), each token's place in that grid. Their shapes
carry the longest length, so the device never has to be asked for it (no host sync).
`varlen_sdpa_attention` (registered with transformers as VARLEN_SDPA) gathers the tokens into
(conversations, heads, longest, head_dim) and runs one causal sdpa: a query at position t of a
conversation sees keys 0..t of the same conversation, all real, so the padding needs no mask and
drops out when the output is gathered back. The work is conversations x longest^2 instead of
rows x T^2, attention dropout works as in sdpa, and the kernel is whatever sdpa picks (flash /
memory-efficient on a GPU, the fused CPU kernel here). Feed-forward and embeddings run on the
N real tokens, unpadded.

Why not the others on this torch (2.13): FlexAttention has no backward on CPU and no dropout;
torch.nn.attention.varlen runs only on CUDA in half precision and has no dropout either; nested
(jagged) tensors find no sdpa backend on CPU. Batches without varlen_index (an unpacked
validation batch, generation) take transformers' own sdpa path and mask unchanged.

Host syncs: transformers asks the device twice where the host already knows the answer: it
looks for packing in position_ids when no 2D mask is given (find_packed_sequence_indices), and
sdpa's mask asks whether the mask has any padding (to run is_causal instead). Each is a read
back per forward on a GPU. The kit's forward (core/step.py) therefore always hands over a 2D
mask (ones where the batch had none) and says, under `host_padding`, whether the batch as the
host built it has padding; `no_sync_mask` (registered for sdpa and varlen_sdpa) answers from
that: no mask for an unpadded batch, the same dense mask transformers builds for a padded one.
Under torch.compile the mask is traced, so the answer is taken from the host only for batches
that came with no mask (pretraining's windows, packed rows): no mask, is_causal. Without the 2D
mask transformers' look for packing, which cannot be answered while tracing, handed sdpa a dense
(T x T) mask for every such batch (on an H200, 2026-11-27: GPT-2 small pretraining's attention
took 106 ms of a 282 ms step, 43 ms without). Batches that carry a mask (SFT's, preference
pairs) keep the traced mask, padded or not. Outside the kit's forward (generation, any other
caller) it is transformers' own mask unchanged.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

VARLEN_SDPA = "varlen_sdpa"
_PADDED: bool | None = None
_MASKLESS = False
"""What host_padding says of the batch running forward, as plain globals: dynamo reads them as
constants and guards them (it cannot trace a ContextVar's get), so a value that changes recompiles."""


@contextlib.contextmanager
def host_padding(padded: bool, maskless: bool = False):
    """Inside: the batch running forward has padding (True) or none (False), as its host tensors
    said. maskless: it came with no mask at all (pretraining's windows, a packed row), never padded."""
    global _PADDED, _MASKLESS
    before = _PADDED, _MASKLESS
    _PADDED, _MASKLESS = padded, maskless
    try:
        yield
    finally:
        _PADDED, _MASKLESS = before


def add_mask_of_ones(inputs: dict) -> None:
    """Give a batch that came with no mask (pretraining's windows, a packed row) the 2D mask of
    ones, in place. It keeps transformers from asking the device whether position_ids restart (a
    packed row): eager a read-back; compiled, where that look cannot be answered while tracing, a
    dense (T x T) mask for every batch and sdpa without its causal kernel (no_sync_mask answers
    from host_padding instead: no mask for it). Not for flash-attention's varlen row (cu_seq_lens),
    which a mask would turn into one sequence."""
    if not ({"attention_mask", "cu_seq_lens_q"} & inputs.keys()):
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])


def _known_padding() -> bool | None:
    """host_padding's answer. Eager: this batch's. Compiled: "unpadded" for a maskless batch, else
    None (the traced mask): a run's batches are all maskless or all carry masks, so the guarded
    value never changes, where padded / unpadded would recompile at every switch."""
    if torch.compiler.is_compiling():
        return False if _MASKLESS else None
    return _PADDED


def no_sync_mask(attention_mask=None, **kwargs):
    """transformers' sdpa mask without the read-backs (module doc): None for a batch the host knows
    is unpadded (is_causal, or no mask at all for bidirectional attention), the dense mask
    otherwise."""
    from transformers.masking_utils import sdpa_mask

    known = _known_padding()
    if known is None:
        return sdpa_mask(attention_mask=attention_mask, **kwargs)
    padded = known and attention_mask is not None  # no mask given (a T5 decoder): nothing padded
    same = kwargs.get("q_length") == kwargs.get("kv_length") and kwargs.get("local_size") is None
    causal_skip = kwargs.get("allow_is_causal_skip", True) and same
    if not padded and (causal_skip or kwargs.get("allow_is_bidirectional_skip", False)):
        return None
    return sdpa_mask(attention_mask=attention_mask, **{**kwargs, "allow_is_causal_skip": False,
                                                       "allow_is_bidirectional_skip": False})


def varlen_indices(lengths, total: int | None = None, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(varlen_index, varlen_place) for conversations of these lengths laid end to end. The
    padding of a short conversation reads the tokens after its own (wrapping round the row):
    causality keeps every real query of it away from those keys, and its outputs are never
    gathered, so what it reads adds exactly zero to any gradient. Spread, not all on one token:
    the gather's backward scatter-adds into every token read, and with every pad slot on the
    row's first token that one add serialized (19.4 ms of a 293 ms packed SFT step on an H200,
    2026-11-27, the step's largest kernel); now no token is read more than once per conversation.

    total (a row padded past its real tokens, for shapes that repeat under torch.compile): the
    row's pad tokens all take the first slot's output; nothing real ever reads a pad token
    (no index points at one), and their labels are -100, so they change no loss and no
    gradient. multiple: the longest rounded up to a multiple of it, and at least 2 of both
    conversations and longest (a padded conversation reads the first token, and its output is
    never gathered), so neither size is ever 1, which dynamo would specialize on."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    longest = max(1, int(lengths.max())) if len(lengths) else 1
    rows = len(lengths)
    if total is not None:
        longest, rows = max(2, -(-longest // multiple) * multiple), max(2, rows)
    starts = torch.cumsum(lengths, 0) - lengths
    offsets = torch.arange(longest)
    inside = torch.zeros((rows, longest), dtype=torch.bool)
    inside[: len(lengths)] = offsets[None, :] < lengths[:, None]
    real = max(1, int(lengths.sum())) if len(lengths) else 1
    row_starts = torch.zeros(rows, dtype=torch.long)
    row_starts[: len(lengths)] = starts
    index = (row_starts[:, None] + offsets[None, :]) % real
    place = torch.arange(rows * longest).view(-1, longest)[inside]
    if total is not None and total > len(place):
        place = torch.cat([place, place.new_zeros(total - len(place))])
    return index, place


def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """transformers' attention-interface signature: query/key/value (batch, heads, tokens, dim);
    returns ((batch, tokens, heads, dim), None) as its sdpa_attention_forward does. A call
    without varlen_index (an unpacked batch, generation) is transformers' sdpa, unchanged."""
    index, place = kwargs.pop("varlen_index", None), kwargs.pop("varlen_place", None)
    if index is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if query.shape[0] != 1 or query.shape[2] != key.shape[2] or query.shape[2] != place.shape[0]:
        # anything else would run attention across conversations without a word
        raise ValueError(f"varlen_index/varlen_place need one flat row of {place.shape[0]} tokens, "
                         f"got query {tuple(query.shape)} and key {tuple(key.shape)}")
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each kv head serves a group
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    # (1, H, N, D)[0][:, index] -> (H, C, L, D) -> (C, H, L, D)
    q, k, v = (x[0][:, index].transpose(0, 1) for x in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True)
    heads, dim = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(-1, heads, dim)[place]  # (N, H, D), back in row order
    return out[None], None


def varlen_mask(attention_mask=None, **kwargs):
    """The mask for VARLEN_SDPA: none where the 2D mask is none (a packed row, whose restarting
    position_ids would otherwise make transformers build the (N x N) block mask; or an unpadded
    batch, which sdpa runs with is_causal), sdpa's own where padding must be masked."""
    if attention_mask is None or _known_padding() is False:  # a flat row
        return None
    return no_sync_mask(attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Make VARLEN_SDPA an attn_implementation transformers accepts (any model whose attention
    goes through transformers' AttentionInterface, as every sdpa-capable one does)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, varlen_mask)


@functools.cache
def register_no_sync_mask() -> None:
    """sdpa's mask through no_sync_mask: transformers' own wherever host_padding is not set."""
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register("sdpa", no_sync_mask)


def use_attention(model, kind: str) -> None:
    """Switch a transformers model to attn_implementation `kind` (registering VARLEN_SDPA first);
    raises what transformers raises for a model that cannot take it."""
    if kind == VARLEN_SDPA:
        register()
    model.set_attn_implementation(kind)
