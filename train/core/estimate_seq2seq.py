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
"""

from __future__ import annotations

from train.core.seq2seq import span_lengths

HALF = ("fp16", "bf16")


def lengths(mode: str, max_length: int, target_length: int | None = None) -> tuple[int, int]:
    """(source, target) tokens per sample. T5 pretraining (span corruption): a MAX_LENGTH
    source and span_lengths' target (512 -> 114); SFT: target_length if given, else MAX_LENGTH
    for both (a bound: pairs are padded to at most MAX_LENGTH each)."""
    if target_length is not None:
        return max_length, target_length
    if mode == "pretrain":
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
    """'fused' (sdpa's kernels: GPUs; CPU without dropout) or 'math' (eager attention; CPU
    sdpa with dropout, which materialises the scores)."""
    if getattr(hf_cfg, "_attn_implementation", "sdpa") == "eager":
        return "math"
    return "math" if device_type == "cpu" and shapes(hf_cfg)["dropout"] > 0 else "fused"


def _per_score(s: dict, half: bool, kind: str) -> float:
    if kind == "math":
        return 10 if half else 12
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
    return {"encoder": encoder, "decoder": decoder, "cross_kv": 2 * ab * a}


def activation_bytes(
    hf_cfg, batch_size: int, source: int, target: int, precision: str, gradient_checkpointing: bool,
    kind: str = "fused", device_type: str = "cuda",
) -> dict:
    """Activation bytes at the peak of a micro-step of an encoder-decoder, with its parts."""
    s = shapes(hf_cfg)
    half = precision in HALF
    h, heads, vocab = s["hidden"], s["heads"], s["vocab"]
    src, tgt = batch_size * source, batch_size * target
    part = _token_parts(s, half, device_type)
    score = _per_score(s, half, kind)
    enc_layer = part["encoder"] * src + score * batch_size * heads * source**2
    dec_layer = (
        part["decoder"] * tgt + part["cross_kv"] * src + score * batch_size * heads * (target**2 + target * source)
    )
    drop_mask = (1 if device_type == "cuda" else (2 if half else 4)) if s["dropout"] > 0 else 0
    # Each stack's embedding and final norm (and their dropout masks); the encoder's output is
    # what every cross-attention reads; the bidirectional and causal bool masks.
    final = (12 * h + 2 * drop_mask * h) * (src + tgt) + batch_size * source**2 + target**2
    loss = 12 * vocab * tgt  # log-softmax output + its gradient + the logits' gradient, fp32
    n_enc, n_dec = s["enc_layers"], s["dec_layers"]
    stored = n_enc * enc_layer + n_dec * dec_layer
    if gradient_checkpointing:
        # Each block keeps its fp32 input; the encoder's output stays for the cross-attention;
        # backward recomputes one block at a time, after the loss tensors are gone, and grows
        # score-sized gradients (softmax's, the position bias's) while it frees the block's
        # saved tensors: about 8 bytes per score on top of the block, measured on CPU (fp32).
        kept = 4 * h * (n_enc * src + n_dec * tgt)
        grow = 8 * batch_size * heads
        per_token = 0
        recompute = max(
            enc_layer + grow * source**2 + per_token * src,
            dec_layer + grow * (target**2 + target * source) + per_token * tgt,
        )
        peak = kept + max(final + loss, final + recompute)
        stored = kept
    else:
        peak = stored + final + loss
    per_layer = (n_enc * enc_layer + n_dec * dec_layer) / max(1, n_enc + n_dec)
    return {"per_layer": per_layer, "stored": stored, "loss": loss, "final": final, "peak": peak}
