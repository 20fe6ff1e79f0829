"""Activation memory of an encoder-decoder (T5, and BART-style models approximately): the
encoder at the source length, the decoder at the target length (self-attention over the
target, cross-attention from target to source), and the logits at the target length.

Counted from what autograd saves in transformers' T5 blocks (read with saved_tensors_hooks on
a tiny T5, CPU, fp32; see tests/test_t5_measure.py), per token and layer, with h the width, a
the attention width (heads x d_kv) and f the feed-forward width:
- every T5LayerNorm saves its input, the normalised copy and its output (what the next matmul
  saves): 12h in fp32; under autocast the output's half-precision cast on top (14h);
- self-attention saves q, k, v and the output: 16a in fp32 (8a in half precision); the
  cross-attention saves q and the output per target token, and its k and v per source token;
- the ReLU feed-forward saves the activation (4f), with dropout its mask and the dropped copy
  (which the output projection saves: T5 keeps that projection's input in the weight's fp32);
- dropout masks: 1 byte per element on CUDA (native_dropout), a tensor of the input's dtype on
  CPU (ATen's CPU dropout multiplies by a float mask);
- attention scores: T5's relative position bias is a float mask of batch x heads x query x key
  that sdpa saves (the fused kernels); on CPU with dropout sdpa takes its math path and saves
  softmax, mask and dropped probabilities (12 bytes per score in fp32, 10 under autocast).
The peak is at the start of backward: everything saved, plus the loss's (target tokens x vocab)
fp32 tensors (log-softmax output, its gradient and the logits' gradient: the kit's
seq2seq_loss_sum takes the full logits).
Under gradient checkpointing (non-reentrant: a block keeps its inputs, recomputes its saved
tensors in the backward pass) the peak is the largest of the loss's moment and each stack's
block 0 recomputed late in the backward pass, with the other blocks' parameter gradients
allocated by then (_checkpointed_backward; read with MemTracker on CPU, the same test).
"""

from __future__ import annotations

from train.core.objective import mode_of
from train.core.seq2seq import span_lengths
from train.models.estimate_terms import cuda_math_per_score, t5_takes_math_on_cuda

HALF = ("fp16", "bf16")


def lengths(mode: str, max_length: int, target_length: int | None = None) -> tuple[int, int]:
    """(source, target) tokens per sample. A mode whose targets are span corruption's (T5 pretraining,
    train/core/objective.py span_targets): a MAX_LENGTH source and span_lengths' target (512 -> 114); SFT:
    target_length if given, else MAX_LENGTH for both (a bound: pairs are padded to at most MAX_LENGTH
    each)."""
    if target_length is not None:
        return max_length, target_length
    if mode_of(mode).span_targets:
        return max_length, span_lengths(max_length)[1]
    return max_length, max_length


def shapes(hf_cfg) -> dict:
    """Widths, layers and heads of an encoder-decoder under T5's or BART's names."""

    def first(*names, default=None):
        for name in names:
            value = getattr(hf_cfg, name, None)
            if value is not None:
                return value
        return default

    hidden = first("d_model", "hidden_size")
    heads = first("num_heads", "encoder_attention_heads", "num_attention_heads")
    return {
        "hidden": hidden,
        "attn": heads * first("d_kv", default=hidden // heads),
        "heads": heads,
        "width": first("d_ff", "encoder_ffn_dim", default=4 * hidden),
        "enc_layers": first("num_layers", "encoder_layers"),
        "dec_layers": first("num_decoder_layers", "decoder_layers", "num_layers"),
        "vocab": hf_cfg.vocab_size,
        "gated": bool(getattr(hf_cfg, "is_gated_act", False)),
        "dropout": float(first("dropout_rate", "dropout", default=0.0)),
        "bias_mask": getattr(hf_cfg, "relative_attention_num_buckets", None) is not None,
    }


def attention_kind(hf_cfg, device_type: str) -> str:
    """'fused' (sdpa's kernels: CPU without dropout) or 'math' (eager attention; CPU sdpa with
    dropout, which materialises the scores; CUDA's sdpa with T5's trained position bias:
    estimate_terms.t5_takes_math_on_cuda)."""
    s = shapes(hf_cfg)
    if getattr(hf_cfg, "_attn_implementation", "sdpa") == "eager":
        return "math"
    if device_type == "cuda":
        return "math" if t5_takes_math_on_cuda(s) else "fused"
    return "math" if s["dropout"] > 0 else "fused"


def _per_score(s: dict, half: bool, kind: str, device_type: str = "cpu") -> float:
    if kind == "math" and device_type == "cuda":
        return cuda_math_per_score(s["dropout"] > 0)
    if kind == "math":  # T5's fp32 position-bias mask promotes CPU autocast's scores to fp32: softmax,
        # dropout mask and dropped probabilities 4 bytes each, and the value matmul's bf16 cast (read on CPU)
        return (14 if s["bias_mask"] else 10) if half else 12
    return (2 if half else 4) if s["bias_mask"] else 0  # the saved position-bias mask


def _token_parts(s: dict, half: bool, device_type: str) -> dict:
    """Bytes per token of one encoder layer, one decoder layer (per target token) and the
    cross-attention's k, v (per source token, per decoder layer)."""
    h, a, f = s["hidden"], s["attn"], s["width"]
    ab = 2 if half else 4  # what a matmul saves under autocast / in fp32
    norm = 14 * h if half else 12 * h
    drop = s["dropout"] > 0
    mask = (1 if device_type == "cuda" else ab) if drop else 0  # bytes per dropped element
    if s["gated"]:  # wi_0 output, activation, wi_1 output, product (approximate)
        ff = 4 * ab * f + (mask + ab) * f * drop
    elif half:  # the activation, the projection's cast of it (via fp32), the dropout mask
        ff = 4 * f + mask * f
    else:  # the activation; with dropout its mask and the dropped copy the projection saves
        ff = 4 * f + ((mask + 4) * f if drop else 0)
    small = 4  # each norm's per-token rsqrt (fp32)
    encoder = 2 * norm + 4 * ab * a + ff + 2 * mask * h + 2 * small
    decoder = 3 * norm + 6 * ab * a + ff + 3 * mask * h + 3 * small
    return {"encoder": encoder, "decoder": decoder, "cross_kv": 2 * ab * a, "ff": ff, "norm": norm}


# _relative_position_bucket's int64 and fp32 temporaries at their widest, bytes per (query, key)
# position pair: bidirectional (the encoder) and causal (the decoder); read on CPU.
BUCKET_BYTES = {"encoder": 49, "decoder": 41}


def _block_params(s: dict, cross: bool) -> int:
    """Parameters of one encoder block (cross=False) or decoder block (cross=True)."""
    h, a, f = s["hidden"], s["attn"], s["width"]
    return (8 if cross else 4) * h * a + (3 if s["gated"] else 2) * h * f + (3 if cross else 2) * h


def _recompute(
    s: dict,
    half: bool,
    part: dict,
    layer: float,
    tokens: int,
    scores: int,
    pairs: int,
    stack: str,
    per_score: float = 0,
    math: bool = False,
):
    """One checkpointed block 0 in the backward pass, above what stays alive around it: its saved
    tensors recomputed (layer, with the position bias's own) plus the largest of three moments: the
    feed-forward's backward (wo's input gradient, and relu's without dropout, with the residual stream's fp32
    gradients); the attention's backward (one score-sized gradient, of the probabilities or of the
    position-bias mask, which T5 trains, once the feed-forward's tensors are freed; on sdpa's math path, CPU's
    for T5 because its bias requires grad, the forward's softmax moment instead where larger); the position
    buckets' temporaries while the
    recompute starts (before the block's own tensors exist)."""
    h, a, f = s["hidden"], s["attn"], s["width"]
    ab = 2 if half else 4
    # the bucket ids the relative-attention embedding saves; the fp32 position-bias mask (no batch
    # dimension) the attention saves, a copy of the bias (the decoder's: with the causal mask)
    layer += 8 * pairs + (4 * s["heads"] * pairs if s["bias_mask"] else 0)
    ff = ((1 if s["dropout"] > 0 else 2) * ab * f + 8 * h) * tokens
    attention = ab * scores - (part["ff"] + part["norm"]) * tokens
    if math:  # the recompute's softmax: raw, biased and normalised scores at once, before the FF
        attention = max(attention, (3 * ab - per_score) * scores - (part["ff"] + part["norm"]) * tokens)
    buckets = BUCKET_BYTES[stack] * pairs - layer + (part["norm"] + 3 * ab * a) * tokens
    return layer + max(ff, attention, buckets)


def _checkpointed_backward(
    s: dict,
    half: bool,
    device_type: str,
    sizes: dict,
    part: dict,
    enc_layer,
    dec_layer,
    score: float = 0,
    math: bool = False,
):
    """The peaks of a checkpointed backward pass after the loss's: decoder block 0 (the encoder's
    tensors all alive, the encoder output's gradient growing) and encoder block 0 (every other
    block's gradients allocated). Each stack's block 0 also holds the position bias's gradient
    from the blocks above (4 bytes per head and position pair); the cross-attention's zero bias
    is a leaf that requires grad (transformers under checkpointing): it and its gradient, kept
    for the forward and again for the recompute, stay to the end. A block above block 0 keeps
    its input but not yet its parameters' gradients: counted where the input is the larger."""
    h, heads, n_params = s["hidden"], s["heads"], sizes["n_params"]
    batch, source, target = sizes["batch"], sizes["source"], sizes["target"]
    src, tgt = batch * source, batch * target
    ab = 2 if half else 4
    drop = ((1 if device_type == "cuda" else ab) if s["dropout"] > 0 else 0) * h  # a dropout mask per token
    enc_params, dec_params = _block_params(s, False), _block_params(s, True)

    def grads(pending: int) -> int:  # parameter gradients allocated while `pending` have none yet
        return 4 * max(0, n_params - pending) if n_params else 0

    def upper(n: int, kept: int, params: int) -> int:
        return max(0, (n - 1) * (kept - (4 * params if n_params else 0)))

    n_enc, n_dec = s["enc_layers"], s["dec_layers"]
    cross_leaf = 4 * ab * heads * target * source if n_dec else 0
    enc_bias = 4 * heads * source**2 if n_enc > 1 else 0
    dec_bias = 4 * heads * target**2 if n_dec > 1 else 0
    encoder = (
        grads(enc_params)
        + (4 * h + drop) * src
        + upper(n_enc, 4 * h * src, enc_params)
        + cross_leaf
        + enc_bias
        + _recompute(
            s, half, part, enc_layer, src, batch * heads * source**2, source**2, "encoder", score, math
        )
    )
    # the encoder: its blocks' inputs, embedding mask, final norm and dropout, output's gradient
    kept_encoder = (4 * h * n_enc + drop + 12 * h + 2 * drop + 4 * h) * src
    decoder = (
        grads(n_enc * enc_params + dec_params) + kept_encoder + (4 * h + drop) * tgt
        + upper(n_dec, 4 * h * tgt, dec_params) + cross_leaf + dec_bias
        + _recompute(s, half, part, dec_layer, tgt, batch * heads * max(target, source) * target,
                     target**2, "decoder", score, math)
    )
    return encoder, decoder


def activation_bytes(
    hf_cfg, batch_size: int, source: int, target: int, precision: str, gradient_checkpointing: bool,
    kind: str = "fused", device_type: str = "cuda", n_params: int = 0,
) -> dict:
    """Activation bytes at the peak of a micro-step of an encoder-decoder, with its parts. Under
    checkpointing the peak may come late in the backward pass, when most gradients exist:
    n_params are the parameters whose gradients this backward allocates (0 when they are held
    from an earlier micro-step and counted apart)."""
    s = shapes(hf_cfg)
    half = precision in HALF
    h, heads, vocab = s["hidden"], s["heads"], s["vocab"]
    src, tgt = batch_size * source, batch_size * target
    part = _token_parts(s, half, device_type)
    score = _per_score(s, half, kind, device_type)
    enc_layer = part["encoder"] * src + score * batch_size * heads * source**2
    dec_layer = (
        part["decoder"] * tgt
        + part["cross_kv"] * src
        + score * batch_size * heads * (target**2 + target * source)
    )
    drop_mask = (1 if device_type == "cuda" else (2 if half else 4)) if s["dropout"] > 0 else 0
    # Each stack's embedding and final norm (and their dropout masks); the encoder's output is
    # what every cross-attention reads; the bidirectional and causal bool masks.
    final = (12 * h + 2 * drop_mask * h) * (src + tgt) + batch_size * source**2 + target**2
    loss = 12 * vocab * tgt  # log-softmax output + its gradient + the logits' gradient, fp32
    n_enc, n_dec = s["enc_layers"], s["dec_layers"]
    stored = n_enc * enc_layer + n_dec * dec_layer
    if gradient_checkpointing:
        stored = 4 * h * (n_enc * src + n_dec * tgt)  # each block keeps only its fp32 input
        sizes = {"batch": batch_size, "source": source, "target": target, "n_params": n_params}
        math = kind == "math" or device_type == "cpu"
        phases = _checkpointed_backward(s, half, device_type, sizes, part, enc_layer, dec_layer, score, math)
        peak = max(stored + final + loss, *phases)
    else:
        peak = stored + final + loss
    per_layer = (n_enc * enc_layer + n_dec * dec_layer) / max(1, n_enc + n_dec)
    return {"per_layer": per_layer, "stored": stored, "loss": loss, "final": final, "peak": peak}
