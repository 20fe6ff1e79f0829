"""Peak device memory of a training step, counted the way the guides count it: weights,
gradients and optimizer state by precision, plus activations by batch, length and
gradient checkpointing. Plain functions of a transformers config and the settings.

The kit keeps parameters in fp32 (they are the master weights); fp16/bf16 autocast adds a half-precision copy
of each matmul weight for the step. Gradients and optimizer state exist only for trainable parameters (FREEZE,
or an adapter's own count: trainable_params): AdamW holds two fp32 states per parameter, SGD one (momentum),
Adafactor one per row and per column of each matrix (and a whole vector's), plus, in its foreach step, an fp32
update per parameter. Activations are the tensors autograd saves for the backward pass, counted per token for
the kit's GPT-2 block (transformers' implementation: its Python tanh-GELU saves five tensors of the MLP width,
the guides' fused-GELU formula assumes two). The peak comes at the start of the backward pass, when every
activation is alive and the loss adds its part: with transformers' loss three fp32 tensors of batch x length x
vocab (log-softmax output, its gradient and the logits' gradient); with the kit's chunked loss
(train/core/loss.py, on a bare model) the gradient of the hidden states and of the LM head's weight, kept from
the forward pass, plus one chunk's logits and their gradient while it runs; with one micro-step per optimizer
step the gradients are allocated only as the activations are freed, so they count at the peak only with
accumulation.

Checked without a GPU against the allocator's peak of real CPU steps of every path
(tests/test_estimate_paths.py, bench/estimate_memory.py); what only a GPU adds is estimate_terms.py's, each
term with its assumption.
"""

from __future__ import annotations

from train.core.device import memory_capacity
from train.core.errors import UsageError
from train.core.loss import CHUNK_ELEMENTS
from train.core.objective import mode_of
from train.core.optim.registry import OPTIMIZERS
from train.core.reward.kv_cache import cache_dtype, kv_cache_bytes
from train.models import estimate_seq2seq, estimate_terms, lora

# (count_params: read here too)
from train.models.checks import count_params, meta_model, refuse_unbuilt  # noqa: F401
from train.models.estimate_terms import PackedGrid
from train.models.family import family_of
from train.models.freeze import Trainable, trainable_for

HALF = ("fp16", "bf16")
FUSED_GELU = ("gelu", "gelu_pytorch_tanh", "gelu_fast", "relu", "quick_gelu")
GATED = ("silu", "swish", "gelu_pytorch_tanh_gated", "geglu")


def optimizer_bytes(
    optimizer: str, trainable_params: int, factored_state: int | None = None
) -> tuple[int, int]:
    """(state, the step's own temporaries) in bytes. factored_state: Adafactor's state elements
    (Trainable.factored); without it, one per parameter (an upper bound). Each optimizer's own
    count is its OPTIMIZERS entry's (train/core/optim/registry.py)."""
    return OPTIMIZERS[optimizer].state_bytes(trainable_params, factored_state)


def shapes(hf_cfg) -> dict:
    """Hidden size, layers, heads, MLP width and vocabulary, under any of the usual names."""
    hidden = hf_cfg.hidden_size
    width = getattr(hf_cfg, "intermediate_size", None) or getattr(hf_cfg, "n_inner", None) or 4 * hidden
    act = getattr(hf_cfg, "activation_function", None) or getattr(hf_cfg, "hidden_act", None) or "gelu_new"
    return {
        "hidden": hidden,
        "layers": hf_cfg.num_hidden_layers,
        "heads": hf_cfg.num_attention_heads,
        "kv": (getattr(hf_cfg, "num_key_value_heads", None) or hf_cfg.num_attention_heads)
        * (getattr(hf_cfg, "head_dim", None) or hidden // hf_cfg.num_attention_heads),
        "width": width,
        "vocab": hf_cfg.vocab_size,
        "act": act,
        "gated": getattr(hf_cfg, "model_type", "") != "gpt2" and act in GATED,
        "dropout": float(
            getattr(hf_cfg, "resid_pdrop", None) or getattr(hf_cfg, "hidden_dropout", None) or 0.0
        ),
        "attn_dropout": float(
            getattr(hf_cfg, "attn_pdrop", None) or getattr(hf_cfg, "attention_dropout", None) or 0.0
        ),
    }


def attention_kind(hf_cfg, device_type: str) -> str:
    """'fused': sdpa's flash / memory-efficient kernels save only the output and a log-sum-exp
    (GPUs; CPU without attention dropout). 'math': the scores are materialised and saved
    (eager attention; CPU sdpa with dropout)."""
    if getattr(hf_cfg, "_attn_implementation", "sdpa") == "eager":
        return "math"
    if device_type == "cpu" and shapes(hf_cfg)["attn_dropout"] > 0:
        return "math"
    return "fused"


def layer_bytes_per_token(hf_cfg, precision: str) -> float:
    """Bytes autograd saves per token in one transformer block (attention scores aside)."""
    s = shapes(hf_cfg)
    h, f = s["hidden"], s["width"]
    half = precision in HALF
    masks = 2 * h if s["dropout"] > 0 else 0  # dropout keeps a 1-byte mask per element
    if not s["gated"]:
        # GPT-2 block: residual x and x2 stay fp32 (the embeddings are fp32); layer norms run in
        # fp32 under autocast and the next matmul saves its half-precision cast; q,k,v (3h),
        # the attention output. Two h-sized copies fewer than with a mask: the kit hands sdpa no
        # mask for an unpadded batch (is_causal), and its fused kernel keeps none (measured:
        # 8h bytes a token less in fp32, 4h under bf16 autocast, tests/test_estimate.py).
        attn = 4 * h + 2 * h + 6 * h + 2 * h + 4 * h if half else 28 * h
        if s["act"] in FUSED_GELU:
            mlp = 4 * f if half else 8 * f  # fc output and activation output
        else:
            # Python tanh-GELU: pow's input, tanh's output, 0.5x, 1+tanh, and the product that
            # the projection saves; under autocast pow and tanh run in fp32.
            mlp = 16 * f if half else 20 * f
        return attn + mlp + masks
    # Llama block (RMSNorm, rotary, grouped-query sdpa, SwiGLU), counted from autograd's saved
    # tensors at head size 64: eight h-wide fp32 tensors (two RMS norms' input, normalised copy and
    # output; rotated q; the attention output and its copy for o_proj); k and v at their grouped
    # width; gate, its activation, up and the product. Under autocast the norms stay fp32 and the
    # rest is half: 30h + 4kv + 8f bytes (measured, tests/test_llama.py).
    kv = s["kv"]
    layer = (30 * h + 4 * kv + 8 * f if half else 32 * h + 8 * kv + 16 * f) + masks
    family = family_of(hf_cfg)
    if family is not None and family.qk_norm:
        # Qwen3's q/k norms keep their fp32 input and normalised copy (under autocast the copy is cast to
        # half): 8 bytes an element of q and k, 6 under autocast (measured, tests/test_estimate_paths.py).
        q = s["heads"] * (getattr(hf_cfg, "head_dim", None) or h // s["heads"])
        layer += (6 if half else 8) * (q + kv)
    return layer


def attention_scores_bytes(hf_cfg, batch_size: int, max_length: int, precision: str, kind: str) -> float:
    """Per layer, the saved score-sized tensors of unfused attention: softmax output (fp32),
    dropout mask, dropped probabilities and the scaled scores (about 12 bytes per score in
    fp32, measured; 10 under autocast)."""
    if kind != "math":
        return 0.0
    s = shapes(hf_cfg)
    per_score = 10 if precision in HALF else 12
    return per_score * batch_size * s["heads"] * max_length**2


def activation_bytes(
    hf_cfg,
    batch_size: int,
    max_length: int,
    precision: str,
    gradient_checkpointing: bool,
    kind: str = "fused",
    chunked_loss: bool = False,
    packed: PackedGrid | None = None,
) -> dict:
    """Activation bytes at the peak of a micro-step, with its parts. packed: PACKING=1's rows, whose
    attention runs on the grid of their conversations (estimate_terms.PackedGrid)."""
    s = shapes(hf_cfg)
    tokens = batch_size * max_length
    half = precision in HALF
    h, n_layer = s["hidden"], s["layers"]
    layer = layer_bytes_per_token(hf_cfg, precision) * tokens + attention_scores_bytes(
        hf_cfg, batch_size, max_length, precision, kind
    )
    if packed is not None:
        per_score = attention_scores_bytes(hf_cfg, 1, 1, precision, kind) / s["heads"]
        layer += estimate_terms.packed_extra(packed, batch_size, max_length, h, s["heads"], half, per_score)
    # Final norm: its fp32 input and the (cast) input of the LM head; embedding dropout mask.
    final = (4 * h + (2 if half else 4) * h + (h if s["dropout"] > 0 else 0)) * tokens
    if chunked_loss:  # grad of hidden (fp32) and of the head (fp32), one chunk's logits + gradient
        loss = 4 * h * tokens + 4 * s["vocab"] * h + 8 * min(tokens * s["vocab"], CHUNK_ELEMENTS)
    else:
        loss = 12 * s["vocab"] * tokens  # log-softmax output + its gradient + the logits' gradient, fp32
    if gradient_checkpointing:
        # Each block keeps only its fp32 input; in the backward pass one block at a time is
        # recomputed, after the loss tensors are gone, and its backward holds two MLP-wide
        # fp32 gradients at once (measured: the peak of that phase).
        kept = n_layer * 4 * h * tokens
        peak = kept + max(final + loss, layer + (4 * h + 8 * s["width"]) * tokens)
        stored = kept
    else:
        stored = n_layer * layer
        peak = stored + final + loss
    return {"per_layer": layer, "stored": stored, "loss": loss, "final": final, "peak": peak}


def estimate_memory(
    hf_cfg,
    n_params: int,
    *,
    batch_size: int,
    max_length: int,
    precision: str,
    gradient_checkpointing: bool = False,
    gradient_accumulation_steps: int = 1,
    device_type: str = "cuda",
    chunked_loss: bool = False,
    target_length: int | None = None,
    optimizer: str = "adamw",
    trainable_params: int | None = None,
    factored_state: int | None = None,
    packed: PackedGrid | None = None,
) -> dict:
    """Bytes of each part and of the peak (the larger of the backward-start peak and the
    optimizer-step peak: weights + gradients + optimizer state). An encoder-decoder: max_length is
    the source length, target_length the target's (default: max_length). trainable_params: the
    parameters with gradients and optimizer state (default n_params; FREEZE or adapters fewer),
    factored_state their Adafactor state elements. Activations are counted as for a model that
    trains whole (a frozen encoder saves fewer: an upper bound). packed: PACKING=1's grid. On CUDA
    the cuBLAS workspaces come on top (estimate_terms)."""
    seq2seq = family_of(hf_cfg).layout.encoder_decoder
    s = estimate_seq2seq.shapes(hf_cfg) if seq2seq else shapes(hf_cfg)
    layers = s["enc_layers"] + s["dec_layers"] if seq2seq else s["layers"]
    half = precision in HALF
    trainable = n_params if trainable_params is None else trainable_params
    weights = 4 * n_params  # fp32: the master weights themselves
    gradients = 4 * trainable  # fp32, like the parameters
    state, step_temporaries = optimizer_bytes(optimizer, trainable, factored_state)
    embed = s["vocab"] * s["hidden"]
    if not half:
        copies = 0
    elif gradient_checkpointing:
        # Recomputed blocks cast again and free their casts; the LM head's stays until backward.
        copies = 2 * (embed + (n_params - embed) / max(1, layers))
    else:
        copies = 2 * n_params  # the guides' 6 bytes per parameter for mixed-precision weights
    if seq2seq:
        target = max_length if target_length is None else target_length
        acts = estimate_seq2seq.activation_bytes(
            hf_cfg, batch_size, max_length, target, precision, gradient_checkpointing,
            estimate_seq2seq.attention_kind(hf_cfg, device_type), device_type,
            n_params=trainable if gradient_accumulation_steps == 1 else 0,  # else held: counted below
        )  # fmt: skip
    else:
        acts = activation_bytes(
            hf_cfg,
            batch_size,
            max_length,
            precision,
            gradient_checkpointing,
            attention_kind(hf_cfg, device_type),
            chunked_loss,
            packed,
        )
    held_grads = gradients if gradient_accumulation_steps > 1 else 0
    backward_peak = weights + copies + state + held_grads + acts["peak"]
    step_peak = weights + gradients + state + step_temporaries
    workspace = estimate_terms.CUBLAS_WORKSPACE_BYTES if device_type == "cuda" else 0
    parts = {
        "weights": weights,
        "weight_copies": copies,
        "gradients": gradients,
        "optimizer": state,
        "activations": acts["peak"],
        "activations_per_layer": acts["per_layer"],
        "loss_logits": acts["loss"],
        "workspace": workspace,
    }
    if seq2seq:
        parts.update(source_length=max_length, target_length=target)
    return {**parts, "peak": max(backward_peak, step_peak) + workspace, "n_params": n_params}


def estimate_for_run(
    hf_cfg, n_params: int, cfg, max_length: int, precision: str, device_type: str, world_size: int = 1,
    trainable: Trainable | None = None, *, target_length: int | None = None, packed: PackedGrid | None = None,
) -> dict:
    """estimate_memory with a run's settings. The chunked loss runs on a bare causal model: not
    under DDP (several processes), FSDP2 (SHARDING) or torch.compile (core/step.py chunkable). An
    encoder-decoder: source and target lengths from the mode (estimate_seq2seq.lengths). trainable: the built
    model's (freeze.trainable_of: FREEZE, adapters); None: from FREEZE. max_length (and target_length): the
    longest rows the data gives (default: the mode's bound); packed: PACKING=1's grid."""
    seq2seq = family_of(hf_cfg).layout.encoder_decoder
    target = estimate_seq2seq.lengths(cfg.run.mode, max_length, target_length)[1] if seq2seq else None
    trainable = trainable or _trainable_of_run(hf_cfg, n_params, cfg)
    mode = mode_of(cfg.run.mode)
    # BATCH_SIZE pairs: 2 x BATCH_SIZE sequences in one forward; GRPO's prompts: NUM_GENERATIONS rows each
    rows = cfg.optim.num_generations if mode.sampled else mode.rows_per_sample
    est = estimate_memory(
        hf_cfg,
        n_params,
        batch_size=cfg.optim.batch_size * rows,
        max_length=max_length,
        precision=precision,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        gradient_accumulation_steps=cfg.optim.gradient_accumulation_steps,
        device_type=device_type,
        chunked_loss=world_size == 1
        and cfg.system.sharding == "none"
        and not cfg.model.compile
        and not seq2seq,
        target_length=target,
        packed=packed,
        **_optimizer_args(cfg, trainable),
    )
    if cfg.model.reference == "copy":  # a frozen fp32 copy of the weights beside the policy
        est["reference"] = n_params * 4
        if not seq2seq:  # its forward after the policy's, whose activations are all alive then
            s = shapes(hf_cfg)
            mlp = "gated" if s["gated"] else "fused" if s["act"] in FUSED_GELU else "python_gelu"
            forward = estimate_terms.reference_forward_bytes(s["hidden"], s["width"], s["vocab"],
                                                             rows * cfg.optim.batch_size * max_length,
                                                             precision in HALF, mlp, CHUNK_ELEMENTS)
            moment = est["peak"] - est["loss_logits"] + forward if not cfg.model.gradient_checkpointing else 0
            est["reference_forward"] = forward
            est["peak"] = max(est["peak"], moment)
        est["peak"] += est["reference"]
    if mode.sampled:  # sampling's cache, before the step's forwards: no activations or gradients beside it
        est["kv_cache"] = kv_cache_bytes(
            hf_cfg, rows * cfg.optim.batch_size, max_length, cache_dtype(hf_cfg, precision)
        )
        est["peak"] = max(est["peak"], est["peak"] - est["activations"] - est["gradients"] + est["kv_cache"])
    return est


def _trainable_of_run(hf_cfg, n_params: int, cfg) -> Trainable:
    # all; the state needs no shapes
    if not cfg.model.freeze and not OPTIMIZERS[cfg.optim.optimizer].factored:
        return Trainable(n_params, n_params)
    return trainable_for(hf_cfg, cfg.model.freeze)


def _optimizer_args(cfg, trainable: Trainable) -> dict:
    return {"optimizer": cfg.optim.optimizer, "trainable_params": trainable.params,
            "factored_state": trainable.factored}


def lora_of_run(hf_cfg, cfg) -> tuple[Trainable, int] | None:
    """(LoRA's adapters, layers adapted) for LORA_R, counted on the meta device (lora.adapter_count);
    None without LORA_R, or for a config not built here (its own code: the run's build checks it)."""
    if not cfg.model.lora_r:
        return None
    try:
        model = meta_model(hf_cfg)
    except Exception:
        return None
    return lora.adapter_count(model, cfg.model.lora_r, cfg.model.lora_targets)


def least_bytes(hf_cfg, n_params: int, cfg, max_length: int, precision: str, device_type: str,
                world_size: int = 1, adapters: Trainable | None = None) -> int:
    """The least device memory one training step of this model can take: one sequence per
    micro-batch (where out-of-memory retries end), no accumulation; under SHARDING the weights,
    gradients and optimizer state are split over the processes. adapters: LoRA's (lora_of_run),
    the only parameters with gradients and optimizer state."""
    target = (
        estimate_seq2seq.lengths(cfg.run.mode, max_length)[1]
        if family_of(hf_cfg).layout.encoder_decoder
        else None
    )
    trainable = adapters or _trainable_of_run(hf_cfg, n_params, cfg)
    est = estimate_memory(
        hf_cfg, n_params + (adapters.params if adapters else 0), batch_size=1, max_length=max_length,
        precision=precision, gradient_checkpointing=cfg.model.gradient_checkpointing, device_type=device_type,
        target_length=target, **_optimizer_args(cfg, trainable),
    )  # fmt: skip
    shards = world_size if cfg.system.sharding != "none" else 1
    state = (est["weights"] + est["gradients"] + est["optimizer"]) / shards
    return int(state + max(0, est["peak"] - est["weights"] - est["gradients"] - est["optimizer"]))


def refuse_unfit(hf_cfg, cfg, max_length: int, precision: str, device, world_size: int, variable: str) -> int:
    """Stop before any allocation when even the smallest step cannot fit the memory the run has
    (memory_capacity), LoRA's adapters with their gradients and state counted (a large LORA_R ran out of
    memory). Returns n_params."""
    n_params = refuse_unbuilt(hf_cfg, variable)
    if cfg.system.offload_optimizer:  # the state lives in host memory: the device holds little
        return n_params
    capacity, what = memory_capacity(device, cfg.system.max_memory_mb)
    adapters, layers = lora_of_run(hf_cfg, cfg) or (None, 0)
    need = least_bytes(hf_cfg, n_params, cfg, max_length, precision, device.type, world_size, adapters)
    if capacity is None or need <= capacity:
        return n_params
    optimizer, have, need = cfg.optim.optimizer, _size(capacity), _size(need)
    if adapters is not None:
        raise UsageError(
            f"LORA_R={cfg.model.lora_r}: the adapters ({_count(adapters.params)} parameters: r x (in + out) "
            f"on each "
            f"of {layers} layers) with their gradients and {optimizer} state, beside the {_count(n_params)} "
            f"frozen "
            f"parameters of {variable}, need at least {need} (one sequence of {max_length} tokens); {what} "
            f"has {have}; lower LORA_R (8 to 64 is usual)"
        )
    raise UsageError(
        f"{variable}: this model ({n_params / 1e9:,.2f}B parameters) cannot fit: training it needs at least "
        f"{need} (fp32 weights, gradients and {optimizer} state, one sequence of {max_length} tokens), "
        f"{what} has {have}; choose a smaller model"
    )


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M"
