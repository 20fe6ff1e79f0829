"""OPTIMIZER=adafactor_relative: Adafactor (Shazeer & Stern, 2018) with a relative step and
parameter scaling, the optimizer ChatLM-mini-Chinese trains with (torch_optimizer.Adafactor with
no lr), written to step exactly as transformers' Adafactor(lr=None, relative_step=True,
scale_parameter=True, warmup_init=False) does (tests/test_adafactor_relative.py holds the two
equal). Each parameter's step is min(1e-2, 1 / sqrt(step)) x max(1e-3, RMS(parameter)): the
learning rate is its own, and the group's "lr" (the loop's schedule value) is never read.

Kept apart from transformers' class for the kit's contracts: the step count is a host tensor and
the step size a device tensor, so a step reads nothing back from the GPU (transformers' takes
max(eps, RMS) on the host, a sync per parameter); the factored second moment is kept as a row
(..., R, 1) and a column (..., 1, C), shapes the resume check reads as factors of the parameter
(train/run/checkpoint/verify.py), and the state is tensors only, which a checkpoint
loads with weights_only=True."""

from __future__ import annotations

import math

import torch

from train.core.optim.schedules import relative

HALF = (torch.float16, torch.bfloat16)


class RelativeAdafactor(torch.optim.Optimizer):
    """No first moment (beta1 None), second moment decaying as 1 - step^-0.8, updates clipped to
    an RMS of 1, weight decay (a group's) scaled by the step size. One parameter at a time."""

    def __init__(self, params, eps=(1e-30, 1e-3), clip_threshold: float = 1.0, decay_rate: float = -0.8,
                 weight_decay: float = 0.0):
        defaults = {"lr": 0.0, "eps": tuple(eps), "clip_threshold": clip_threshold, "decay_rate": decay_rate,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group)
        return loss

    def _step_one(self, p: torch.Tensor, group: dict) -> None:
        eps_sq, eps_scale = group["eps"]
        grad = p.grad.float() if p.grad.dtype in HALF else p.grad
        if grad.is_sparse:
            raise RuntimeError("Adafactor does not take sparse gradients")
        state = self.state[p]
        factored = grad.dim() >= 2
        if not state:
            # "step" keeps its dtype and device through load_state_dict (torch's rule for that key)
            state["step"] = torch.zeros((), dtype=torch.float64)
            if factored:
                state["row"] = grad.new_zeros((*grad.shape[:-1], 1))
                state["col"] = grad.new_zeros((*grad.shape[:-2], 1, grad.shape[-1]))
            else:
                state["sq"] = torch.zeros_like(grad)
        state["step"] += 1
        t = float(state["step"])  # a host tensor: no device read
        weights = p.float() if p.dtype in HALF else p
        step_size, rms = relative(t - 1), _rms(weights)
        # max(eps, RMS) x step without reading RMS back: where RMS <= eps the product is taken in double
        # and rounded once, as transformers' float product is (an ulp apart, the two drift on parameters
        # whose gradient is rounding noise: a key bias, which softmax ignores)
        lr = torch.where(rms > eps_scale, rms * step_size, rms.new_tensor(eps_scale * step_size))
        beta = 1.0 - math.pow(t, group["decay_rate"])
        update = grad**2 + eps_sq
        if factored:
            row, col = state["row"], state["col"]
            row.mul_(beta).add_(update.mean(dim=-1, keepdim=True), alpha=1.0 - beta)
            col.mul_(beta).add_(update.mean(dim=-2, keepdim=True), alpha=1.0 - beta)
            update = torch.mul((row / row.mean(dim=-2, keepdim=True)).rsqrt_(), col.rsqrt()).mul_(grad)
        else:
            sq = state["sq"]
            sq.mul_(beta).add_(update, alpha=1.0 - beta)
            update = sq.rsqrt().mul_(grad)
        update.div_((_rms(update) / group["clip_threshold"]).clamp_(min=1.0))
        update.mul_(lr)
        if group["weight_decay"] != 0:
            # transformers' add_(p, alpha=-wd x lr), no sync
            weights.addcmul_(weights, -group["weight_decay"] * lr)
        weights.sub_(update)
        if weights is not p:
            p.copy_(weights)


def _rms(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.norm(2) / (tensor.numel() ** 0.5)
