"""What every model is, whatever its family: the transformers model inside a wrapper, its
parameter count, the vocabulary's padded size, gradient checkpointing. What differs between
families (sizes, configs, the Auto class, building and loading) is train/models/'s."""

from __future__ import annotations

import contextlib
import copy


def unwrapped(model):
    """The transformers model inside DDP (.module) or torch.compile (._orig_mod); FSDP2 keeps
    the model's own class."""
    for attr in ("module", "_orig_mod"):
        model = getattr(model, attr, model)
    return model


def frozen_copy(model):
    """A frozen copy of `model` as it is now (DDP's or compile's wrapper left out), in eval mode: the
    reference of REFERENCE=copy (preference and reward training)."""
    return copy.deepcopy(unwrapped(model)).eval().requires_grad_(False)


def padded_vocab(n: int, multiple: int = 64) -> int:
    """Round the vocabulary up to a multiple of 64: tensor-core friendly matmul shapes
    (nanoGPT's 50257 -> 50304 gave ~25 % on the LM head)."""
    return (n + multiple - 1) // multiple * multiple


def shape(cfg) -> dict:
    """Layers, heads and head size for the FLOPs count (6N + 12·L·H·Q·T)."""
    n_layer = cfg.num_hidden_layers
    n_head = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    return {"n_layer": n_layer, "n_head": n_head, "head_dim": head_dim}


def enable_checkpointing(model) -> None:
    """ENABLE_GRAD_CKPT: recompute each block's activations in the backward pass (non-reentrant,
    the form torch recommends). transformers 5.2x renamed the call; older ones have only the
    old name, which newer ones still accept with a FutureWarning."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def count_params(model) -> int:
    """Unique parameters (tied input/output embeddings counted once, as HF and nanoGPT do)."""
    return sum(p.numel() for p in model.parameters())


@contextlib.contextmanager
def quiet_saving():
    """save_pretrained / from_pretrained without transformers' progress bar ("Writing model shards",
    "Loading weights"): one file for these sizes, and "shards" on the console reads as if SHARDING
    were on."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
