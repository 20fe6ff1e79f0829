"""Training FLOPs per counted token of a model, by its family: 6N + 12·L·H·Q·T for a causal LM
(train/core/measure/mfu.py flops_per_token, as nanoGPT and torchtitan count it), the encoder and
decoder counted apart for an encoder-decoder (each weight times the tokens it sees). MFU is
tokens/s x this / the device's peak."""

from __future__ import annotations

from train.core.measure.mfu import flops_per_token
from train.core.model import count_params, shape, unwrapped
from train.models.family import Family, family_of

# The cross-attention's key and value projections read the encoder's output: source tokens.
CROSS_KV = ("EncDecAttention.k.", "EncDecAttention.v.", "encoder_attn.k_proj.", "encoder_attn.v_proj.")


def encoder_decoder_flops(n_encoder: int, n_decoder: int, n_cross_kv: int, n_head: int, enc_layers: int,
                          dec_layers: int, heads: int, head_dim: int, source: int, target: int) -> float:
    """Training FLOPs of one (source, target) sample of an encoder-decoder: 6 x weights x the
    tokens each weight sees (encoder: source; decoder: target, but the cross-attention's k and
    v: source; LM head: target) plus the attention matmuls (12 x heads x head_dim per
    query-key pair and layer: encoder self over source x source, decoder self over target x
    target, cross over target x source). Weights are matrices only (n_decoder without the
    cross k, v): the shared embedding is a lookup, norms and position biases no matmul."""
    attention = 12 * heads * head_dim * (enc_layers * source**2 + dec_layers * (target**2 + target * source))
    return float(6 * ((n_encoder + n_cross_kv) * source + (n_decoder + n_head) * target) + attention)


def seq2seq_flops_per_token(model, source: int, target: int) -> float:
    """encoder_decoder_flops of a transformers encoder-decoder (T5, BART) per counted token: the
    kit counts source + target tokens (train/run/loop/meter.py), so MFU = tokens/s x this / peak.
    Checked against torch's FlopCounterMode (tests/test_t5_measure.py)."""
    cfg = model.config
    embed = {id(p) for p in model.get_input_embeddings().parameters()}

    def weights(module, cross: bool | None = None) -> int:
        return sum(
            p.numel()
            for name, p in module.named_parameters()
            if p.dim() >= 2
            and id(p) not in embed
            and (cross is None or cross == any(k in name for k in CROSS_KV))
        )

    head = model.get_output_embeddings().weight.numel()
    heads = getattr(cfg, "num_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "d_kv", None) or cfg.hidden_size // heads
    enc_layers = getattr(cfg, "num_layers", None) or cfg.encoder_layers
    dec_layers = getattr(cfg, "num_decoder_layers", None) or cfg.decoder_layers
    decoder = model.get_decoder()
    per_sample = encoder_decoder_flops(
        weights(model.get_encoder()), weights(decoder, False), weights(decoder, True), head,
        enc_layers, dec_layers, heads, head_dim, source, target,
    )  # fmt: skip
    return per_sample / (source + target)


def model_flops_per_token(model, seq_len: int, target: int | None = None) -> float:
    """Training FLOPs per counted token of a transformers model: flops_per_token for a causal LM
    (seq_len its window), seq2seq_flops_per_token for an encoder-decoder (seq_len the source
    length, target the target's)."""
    model = unwrapped(model)
    if family_of(model).layout.encoder_decoder:
        return seq2seq_flops_per_token(model, seq_len, seq_len if target is None else target)
    return flops_per_token(count_params(model), **shape(model.config), seq_len=seq_len)


def sample_lengths(family: Family, mode: str, max_length: int) -> tuple[int, int | None]:
    """(window, None) for a causal LM; (source, target) for an encoder-decoder in this mode."""
    return family.layout.sample_lengths(mode, max_length)
