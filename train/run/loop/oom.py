"""Out of memory during training: free, halve the micro-batch, double accumulation, redo the step.

The effective batch (BATCH_SIZE x GRADIENT_ACCUM) stays what the user asked for, so the learning
rate and the schedule stay right; the loader restarts at the sample the failed step started at,
so no step is lost and the redone step trains the same samples (with the same dropout: the RNG
state is restored too). After MAX_FAILURES the run stops with the guides' remedies and the model
trained so far is saved by the caller.

Under DDP an OOM on one rank leaves the others waiting in an all-reduce; recovery there needs
the ranks to agree first, which this module does not do yet.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from train.run.plan.make import Plan

MAX_FAILURES = 3
# HIP (ROCm) raises the same torch.OutOfMemoryError from the allocator, but a kernel or library
# call (hipBLAS, rccl) reports it as a RuntimeError with one of these in the message.
_OOM_WORDS = ("out of memory", "hiperroroutofmemory", "can't allocate memory", "failed to allocate")


def is_oom(err: BaseException) -> bool:
    """torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class) or a device error
    whose message says out of memory (CUDA, HIP, MPS, CPU allocator)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(w in str(err).lower() for w in _OOM_WORDS)


def free_memory(device: torch.device, optimizer=None) -> None:
    """Drop half-accumulated gradients and cached blocks so the retry starts clean."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    gc.collect()  # the exception's frames held activations; they are unreachable only now
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def smaller_micro_batch(batch_size: int, per_rank_effective: int) -> int | None:
    """The largest micro-batch at most half the current one that divides the effective batch
    (so accumulation can make it up exactly); None when there is none."""
    for size in range(batch_size // 2, 0, -1):
        if per_rank_effective % size == 0:
            return size
    return None


def remedies(
    cfg, max_length: int, precision: str, hint: bool = True, micro: tuple[int, int] | None = None
) -> str:
    """The guides' fixes for a run that does not fit, as variables to set, most effective first.
    micro: the (micro-batch, accumulation) that ran out (default: the config's)."""
    o = cfg.optim
    batch_size, accum = micro or (o.batch_size, o.gradient_accumulation_steps)
    effective = batch_size * accum
    steps = []
    smaller = smaller_micro_batch(batch_size, effective)
    if smaller:
        steps.append(f"BATCH_SIZE={smaller} GRADIENT_ACCUM={effective // smaller} (same effective batch)")
    if precision == "fp32":
        steps.append("PRECISION=bf16 (fp16 before Ampere)")
    if not cfg.model.gradient_checkpointing:
        steps.append("ENABLE_GRAD_CKPT=1")
    if max_length >= 4:  # attention memory grows with the square of the length
        steps.append(f"MAX_LENGTH={max_length // 2}")
    if hint:
        steps.append("make find-batch (or AUTO_BATCH=1) for the largest micro-batch that fits")
    return "; ".join(steps)


class OutOfMemoryStop(Exception):
    """Raised by OomGuard.step after MAX_FAILURES: the message is the one line to show."""


class OomGuard:
    """Owns the batch stream of a run and its current micro-batch, so that a failed step can be
    redone from its first sample with a smaller one. The plan keeps the micro-batch it chose.
    Held as `oom_guard` (Parts.oom_guard, RunGuard.start, the checkpoint manager, whose data position it
    owns: state_dict / load_state_dict).

    batches() is the micro-batch iterator train_step reads; step(fn) runs one optimizer step and,
    on OOM, halves batch_size, doubles accumulation and retries. The stream's sampler is
    data.EpochSampler (set_position(epoch, start) skips the first samples of an epoch).
    """

    def __init__(self, plan: Plan, open_stream, optimizer, scaler, say):
        """open_stream(batch_size, epoch, start): a positioned batch stream (train/data/stream.py
        BatchStream, with epoch, consumed and sampler) of that micro-batch."""
        self.plan, self.open_stream, self.optimizer, self.scaler, self.say = (
            plan,
            open_stream,
            optimizer,
            scaler,
            say,
        )
        o = plan.cfg.optim
        self.batch_size, self.accumulation = o.batch_size, o.gradient_accumulation_steps
        self.failures = 0
        self.retries = 0
        self.events: list[dict] = []
        self.step_index = 0
        self.stream = None

    def open(self, epoch: int = 0, consumed: int = 0):
        """The stream at a data position (the run's start, or a resume's)."""
        self.stream = self.open_stream(self.batch_size, epoch, consumed)
        return self.stream

    def state_dict(self) -> dict:
        """The data position for a checkpoint (meta.json's data): the epoch and the samples of it
        all ranks consumed (global), and how many processes consumed them."""
        return {
            "epoch": self.stream.epoch,
            "position": self.stream.consumed,
            "world_size": self.plan.world.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Open the stream at a saved (or a fresh run's) data position."""
        self.open(state["epoch"], state["position"])

    def batches(self):
        while True:
            yield next(self.stream)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()

    # -- one step, redone on OOM --

    def step(self, fn):
        mark = (self.stream.epoch, self.stream.consumed)
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state() if self.plan.device.type == "cuda" else None
        objective = self.plan.objective
        kept = _objective_state(objective)
        while True:
            try:
                out = fn()
                self.step_index += 1
                return out
            except Exception as err:  # anything but OOM is re-raised at once
                if not is_oom(err):
                    raise
                reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
            # Out of the except block: the traceback (and the activations its frames hold) is gone.
            self._recover(mark, reason)
            _restore_objective(objective, kept)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng)

    def _recover(self, mark: tuple[int, int], reason: str) -> None:
        free_memory(self.plan.device, self.optimizer)
        if hasattr(self.scaler, "_per_optimizer_states"):
            # an OOM after unscale_ would make the retry's unscale_ refuse ("already called")
            self.scaler._per_optimizer_states.clear()
        self.failures += 1
        old = self.batch_size
        effective = old * self.accumulation
        smaller = smaller_micro_batch(old, effective)
        step = self.step_index + 1
        if self.failures >= MAX_FAILURES or smaller is None:
            why = f"out of memory {self.failures} time(s)" + ("" if smaller else f" at micro-batch {old}")
            plan = self.plan
            fixes = remedies(plan.cfg, plan.max_length, plan.precision, micro=(old, self.accumulation))
            raise OutOfMemoryStop(
                f"stopped at step {step}: {why} ({reason}); the model trained so far is saved in final/. "
                f"Try: {fixes}"
            )
        self.batch_size, self.accumulation = smaller, effective // smaller
        self.retries += 1
        self.events.append({"step": step, "batch_size_from": old, "batch_size_to": smaller, "reason": reason})
        self.say(
            f"out of memory at step {step} with micro-batch {old} ({reason}): retrying the step with "
            f"BATCH_SIZE={smaller} GRADIENT_ACCUM={self.accumulation} (effective batch {effective} kept)"
        )
        epoch, offset = mark
        if self.stream.remaining(offset) < old:
            epoch, offset = epoch + 1, 0  # the old loader would have ended the epoch here (drop_last)
        self.stream.close()
        self.open(epoch, offset)


def _objective_state(objective) -> tuple[dict | None, dict]:
    """What an objective with a state of its own (GRPO's: a generation's scored completions and how many
    steps used them; its sampler's generator) holds before a step, for the redone step to start from:
    a failed attempt's rollout must not count as a use, nor move the draws on."""
    state = objective.state_dict() if hasattr(objective, "state_dict") else None
    generators = getattr(objective, "generators", dict)()
    return state, {name: g.get_state() for name, g in generators.items()}


def _restore_objective(objective, kept: tuple[dict | None, dict]) -> None:
    state, draws = kept
    if state is not None:
        objective.load_state_dict(state)
    for name, g in getattr(objective, "generators", dict)().items():
        g.set_state(draws[name])
