"""FREEZE: parameters left untrained, chosen by part or by name before the optimizer is built.

A frozen parameter gets requires_grad=False before DDP or FSDP2 wraps the model and before the
optimizer is built, so it gets no gradient, no optimizer state and no weight decay (the optimizer
is given only what requires grad), and DDP leaves it out of its gradient buckets. The parts:
- embeddings: the embedding tables outside the blocks (input embeddings, GPT-2's positions,
  T5's shared table; T5's relative position biases live in a block and are not among them);
- encoder / decoder: an encoder-decoder's stacks without those tables (its blocks, final norm);
  decoder on a causal LM: its blocks and final norm. encoder on a causal LM is refused;
- lm_head: the output projection;
- anything else: an fnmatch pattern of parameter names ("transformer.h.0.*").
Tied weights are one tensor under two names (GPT-2's lm_head and wte, T5's shared table and its
stacks' embed_tokens): freezing either freezes both, and the decision says so.
trainable_for counts what FREEZE leaves trained on the meta device, before any build (the estimate's).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch

from train.core.errors import UsageError
from train.models.checks import meta_model, with_layers
from train.models.family import family_of

PARTS = ("embeddings", "encoder", "decoder", "lm_head")


@dataclass(frozen=True)
class Trainable:
    """What the optimizer holds state for: the parameters that require grad, and Adafactor's
    state elements for them (a matrix's rows + columns, a vector whole)."""

    params: int
    factored: int


def trainable_of(model: torch.nn.Module) -> Trainable:
    """Count the unique parameters that require grad (tied ones once)."""
    params = [p for p in model.parameters() if p.requires_grad]
    factored = sum(
        p.shape[:-2].numel() * (p.shape[-2] + p.shape[-1]) if p.dim() >= 2 else p.numel() for p in params
    )
    return Trainable(sum(p.numel() for p in params), factored)


def _embedding_tables(model) -> list[torch.nn.Parameter]:
    tables = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
              and not any(part.isdigit() for part in name.split("."))]  # fmt: skip
    return [p for m in [model.get_input_embeddings(), *tables] for p in m.parameters()]


def _part(model, part: str, spec: str) -> list[torch.nn.Parameter]:
    if part == "embeddings":
        return _embedding_tables(model)
    if part == "lm_head":
        head = model.get_output_embeddings()
        return [] if head is None else list(head.parameters())
    if part == "encoder" and not family_of(model).layout.encoder_decoder:
        raise UsageError(
            f"FREEZE={spec}: encoder names an encoder-decoder's encoder, and this model is a causal LM "
            "(decoder only); use decoder, embeddings, lm_head or name patterns"
        )
    stack = (
        model.get_encoder()
        if part == "encoder"
        else model.get_decoder()
        if family_of(model).layout.encoder_decoder
        else model.base_model
    )
    tables = {id(p) for p in _embedding_tables(model)}
    return [p for p in stack.parameters() if id(p) not in tables]


def _chosen(model, spec: str) -> dict[int, torch.nn.Parameter]:
    """The parameters (by identity, so tied names count once) each item of FREEZE names."""
    named = list(model.named_parameters(remove_duplicate=False))
    chosen: dict[int, torch.nn.Parameter] = {}
    for item in (i.strip() for i in spec.split(",")):
        if not item:
            continue
        params = (
            _part(model, item, spec)
            if item in PARTS
            else [p for n, p in named if fnmatch.fnmatchcase(n, item)]
        )
        if not params:
            example = named[min(1, len(named) - 1)][0] if named else "?"
            raise UsageError(
                f"FREEZE={spec}: {item!r} matches no parameter of this model (parts: {' | '.join(PARTS)}, or "
                f"name patterns such as {example!r})"
            )
        chosen.update((id(p), p) for p in params)
    return chosen


def apply_freeze(model: torch.nn.Module, spec: str | None) -> str | None:
    """Set requires_grad=False on what FREEZE names; returns the decision's reason (counts and
    tied names), or None when nothing is frozen."""
    if not spec or not spec.strip(","):
        return None
    chosen = _chosen(model, spec)
    if all(id(p) in chosen or not p.requires_grad for p in model.parameters()):  # LoRA froze the rest already
        raise UsageError(f"FREEZE={spec}: that freezes every parameter still trained (with LORA_R: the "
                         f"adapters too); nothing would train")
    for p in chosen.values():
        p.requires_grad_(False)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied = ["=".join(names[key]) for key in chosen if len(names.get(key, ())) > 1]
    frozen = sum(p.numel() for p in chosen.values())
    trainable = trainable_of(model).params
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    why = f"{frozen:,} parameters frozen, {trainable:,} of {total:,} trainable ({trainable / total:.1%})"
    if tied:
        why += f"; tied, so frozen together: {', '.join(tied)}"
    return why


def _meta_trainable(hf_cfg, freeze: str | None) -> Trainable:
    model = meta_model(hf_cfg)
    apply_freeze(model, freeze)  # a FREEZE that names nothing stops here, before any data work
    return trainable_of(model)


def trainable_for(hf_cfg, freeze: str | None = None) -> Trainable:
    """What the optimizer of a model built from this config trains, with FREEZE applied, counted
    on the meta device as count_params counts (a deep causal model from its one- and two-block
    versions, unless a name pattern could pick out single blocks)."""
    layers = hf_cfg.num_hidden_layers
    parts_only = all(item.strip() in PARTS for item in (freeze or "").split(",") if item.strip())
    if layers > 2 and not family_of(hf_cfg).layout.encoder_decoder and parts_only:
        try:
            one, two = (_meta_trainable(with_layers(hf_cfg, n), freeze) for n in (1, 2))
            return Trainable(*(a + (layers - 1) * (b - a) for a, b in zip(
                (one.params, one.factored), (two.params, two.factored), strict=True)))
        except UsageError:
            raise
        except Exception:
            pass
    return _meta_trainable(hf_cfg, freeze)
