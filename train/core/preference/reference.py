"""The reference model's log-probs, three ways, each a function preference_loss calls as
reference(policy, host batch, device inputs, responses) -> (2P,) summed log-probs, without grad:
  copy         a frozen copy of the policy as it starts (eval mode, no grad), run by the same forward
               code: a second model's memory and a second forward (no backward) per micro-step;
  precomputed  read from the batch, one float per pair (ref_chosen_logps, ref_rejected_logps), made
               once over the dataset by reference_over and cached: no second model, no second forward;
  adapters     a LoRA policy with its adapters switched off (peft's disable_adapter, done on the
               layers: the kit trains the transformers model with peft's layers inside, lora.wrap):
               the base model the adapters adapt, no copy.
The reference runs in eval mode (no dropout) in all three, so the three agree. The reference-free
losses (simpo, orpo) take none."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch

from train.core.device import autocast
from train.core.model import frozen_copy, unwrapped
from train.core.preference.logps import device_inputs, sequence_logps

PRECOMPUTED_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def copy_reference(model, layout) -> Callable:
    """A frozen copy of `model` (DDP's or compile's wrapper left out) as it is now."""
    frozen = frozen_copy(model)

    def logps(policy, batch, inputs, responses):
        with torch.no_grad():
            return sequence_logps(frozen, inputs, responses, layout=layout)

    return logps


def precomputed_reference(model=None, layout=None) -> Callable:
    """The batch's own ref_chosen_logps and ref_rejected_logps (P floats each, from reference_over)."""

    def logps(policy, batch, inputs, responses):
        missing = [key for key in PRECOMPUTED_KEYS if key not in batch]
        if missing:
            raise ValueError(f"the precomputed reference reads {' and '.join(missing)} from each batch: "
                             f"missing")
        both = torch.cat([batch[key].reshape(-1) for key in PRECOMPUTED_KEYS]).float()
        return both.to(responses.counts.device, non_blocking=True)

    return logps


@contextlib.contextmanager
def eval_mode(bare):
    """Inside: `bare` in eval mode (no dropout); after, each module as it was (one by one: train()
    would also switch children that were in eval mode on purpose)."""
    training = [m for m in bare.modules() if m.training]
    bare.eval()
    try:
        yield bare
    finally:
        for m in training:
            m.training = True


@contextlib.contextmanager
def adapters_off(model):
    """Inside: `model` with its peft adapters switched off and in eval mode; both restored after."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    bare = unwrapped(model)
    layers = [m for m in bare.modules() if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    if not layers:
        raise ValueError("the adapters reference is the base model under LoRA adapters: this model has none "
                         "(LORA_R)")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        with eval_mode(bare):
            yield bare
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_reference(model=None, layout=None) -> Callable:
    """The policy itself with its adapters off (no copy)."""

    def logps(policy, batch, inputs, responses):
        with torch.no_grad(), adapters_off(policy) as base:
            return sequence_logps(base, inputs, responses, layout=layout)

    return logps


REFERENCES = {"copy": copy_reference, "precomputed": precomputed_reference, "adapters": adapter_reference}


def build_reference(kind: str, model, *, layout) -> Callable:
    """The reference function of one of REFERENCES for the policy `model` (build it before training:
    copy takes the model as it is then). layout: the family's (train/models Family.layout)."""
    if kind not in REFERENCES:
        raise ValueError(f"reference {kind!r}: expected one of {', '.join(REFERENCES)}")
    return REFERENCES[kind](model, layout)


@torch.no_grad()
def reference_over(model, batches, device: torch.device, precision: str, *,
                   layout) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(chosen, rejected): the reference's summed response log-probs of every pair, float32 arrays in
    the order the batches come (give them unshuffled), to cache for the precomputed reference. model:
    the reference itself (the policy before its first step), run once in eval mode."""
    chosen, rejected = [], []
    with eval_mode(unwrapped(model)) as bare:
        for batch in batches:
            host = layout.responses(batch)
            with autocast(device, precision):
                sums = sequence_logps(bare, device_inputs(batch, device), host.to(device),
                                      layout=layout).float().cpu()
            chosen.append(sums[: host.pairs])
            rejected.append(sums[host.pairs :])
    if not chosen:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return torch.cat(chosen).numpy(), torch.cat(rejected).numpy()
