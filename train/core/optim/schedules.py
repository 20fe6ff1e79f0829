"""LR_SCHEDULE: one entry per name in SCHEDULES, each the lr of an optimizer step as a function of
(step, peak, warmup, total, min_ratio); Schedule runs one over samples consumed, the loop's one
source of the lr (no torch LRScheduler object), made by optimizers.build_schedule. A new schedule
is an entry here: config.py's LR_SCHEDULES are SCHEDULES' names."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from train.core.checks import bad_value

ONECYCLE_DIV, ONECYCLE_FINAL_DIV = 25.0, 1e4  # OneCycleLR's div_factor and final_div_factor
RELATIVE_CAP = 1e-2  # Adafactor's relative step: min(1e-2, 1 / sqrt(step)) (Shazeer & Stern, 2018)


def _warmed(decay):
    """A curve after a linear warm-up to the peak over `warmup` steps (step 0: peak / warmup)."""

    def lr(step: float, peak: float, warmup: float, total: float, min_ratio: float) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        return peak * decay(min(1.0, (step - warmup) / max(1, total - warmup)), min_ratio)

    lr.__doc__ = decay.__doc__
    return lr


@_warmed
def cosine(progress: float, min_ratio: float) -> float:
    """Cosine decay to peak x min_ratio at `total`."""
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@_warmed
def linear(progress: float, min_ratio: float) -> float:
    """Linear decay to peak x min_ratio at `total`."""
    return min_ratio + (1 - min_ratio) * (1 - progress)


@_warmed
def constant(progress: float, min_ratio: float) -> float:
    """Flat at the peak."""
    return 1.0


def onecycle(step: float, peak: float, warmup: float, total: float, min_ratio: float = 0.0) -> float:
    """torch's OneCycleLR (anneal_strategy="cos", pct_start = warmup / total, three_phase=False)
    computed here, with its step ends (warmup - 1, total - 1): cosine from peak / 25 up to the peak
    at step warmup - 1, cosine down to peak / 25 / 1e4 at step total - 1; min_ratio unused. A one-step
    warm-up, where OneCycleLR would divide by zero, is the starting lr at step 0. Its momentum
    cycling is not done (OneCycleLR's cycle_momentum): the optimizers keep their own betas /
    momentum, and the kit sets only the lr."""
    initial = peak / ONECYCLE_DIV
    low = initial / ONECYCLE_FINAL_DIV
    rise_end = warmup - 1

    def anneal(start, end, pct):
        return end + (start - end) / 2.0 * (math.cos(math.pi * min(1.0, max(0.0, pct))) + 1)

    if step <= rise_end:
        return anneal(initial, peak, step / rise_end if rise_end > 0 else 0.0)
    return anneal(peak, low, (step - rise_end) / max(1e-9, total - 1 - rise_end))


def relative(
    step: float, peak: float = 0.0, warmup: float = 0.0, total: float = 0.0, min_ratio: float = 0.0
) -> float:
    """Adafactor's relative step size min(1e-2, 1 / sqrt(step)), step counted from 1 as its
    optimizer counts: not a LR_SCHEDULE choice but the curve of an optimizer that sets its own
    step (OPTIMIZERS' own_step), logged as the run's lr; peak, warm-up and decay unused."""
    return min(RELATIVE_CAP, 1.0 / math.sqrt(step + 1))


SCHEDULES = {"cosine": cosine, "linear": linear, "constant": constant, "onecycle": onecycle}
CURVES = {**SCHEDULES, "relative": relative}  # what a Schedule may run: LR_SCHEDULE's, and an optimizer's own


def steps_or_share(warmup: float | None) -> float | int | None:
    """WARMUP_STEPS as config.py keeps it: a whole number of steps (an int) from 0 up, or a share of
    the run between 0 and 1 (TRL 1.16's and transformers' float warmup_steps; warmup_ratio is gone
    there), which warmup_of turns into steps once the run's length is known. 2.5 steps is refused,
    where transformers would take int(2.5). 0 is the int 0: the flag's 0.0 would reach a checkpoint's
    warmup_samples as a float, which resume refuses."""
    if warmup is None or 0 < warmup < 1:
        return warmup
    if warmup % 1:
        raise bad_value(
            "warmup_steps", "a whole number of steps, or a share of the run below 1 (0.05: 5 %)", warmup
        )
    return int(warmup)


def warmup_of(warmup: float | int, total_steps: int) -> int:
    """Warm-up steps of a run of total_steps: WARMUP_STEPS itself, or a share of it rounded up
    (transformers' TrainingArguments.get_warmup_steps: ceil(total x share))."""
    return warmup if warmup >= 1 else math.ceil(total_steps * warmup)


def lr_at(
    step: float, peak: float, warmup: float, total: float, min_ratio: float, shape: str = "cosine"
) -> float:
    """The learning rate of optimizer step `step` (from 0; fractional under a changed batch, see
    Schedule) on curve `shape` (SCHEDULES, or "relative"). cosine, linear, constant: linear
    warm-up to the peak over `warmup` steps, then cosine or linear decay to peak x min_ratio at
    `total`, or flat. onecycle: torch's OneCycleLR shape (see onecycle)."""
    return CURVES[shape](step, peak, warmup, total, min_ratio)


@dataclass(frozen=True)
class Schedule:
    """lr_at over samples consumed, not steps: with the same settings that is the same curve step
    for step; with a changed BATCH_SIZE or GRADIENT_ACCUM (a resume) the run continues at the same
    sample, at the same point of the warm-up and decay, and ends at the same sample. unit: the
    samples of the run's first effective batch, so that an unchanged run gives lr_at exactly
    (step, WARMUP_STEPS, total steps). peak, min_ratio and shape: LEARNING_RATE, MIN_LR_RATIO and
    LR_SCHEDULE (or an own-step optimizer's curve). This is the one source of the lr, onecycle too."""

    unit: int
    warmup_samples: int
    budget_samples: int
    peak: float = 0.0
    min_ratio: float = 0.0
    shape: str = "cosine"

    def lr(self, samples: int) -> float:
        """The learning rate of a step that starts after `samples` samples."""
        u = self.unit
        return lr_at(samples / u, self.peak, self.warmup_samples / u, self.budget_samples / u, self.min_ratio,
                     self.shape)

    def state_dict(self) -> dict:
        """A checkpoint's meta.json "schedule": the curve in samples (peak and shape are the config's)."""
        return {
            "unit_samples": self.unit,
            "warmup_samples": self.warmup_samples,
            "budget_samples": self.budget_samples,
        }

    def load_state_dict(self, state: dict) -> Schedule:
        """The saved curve with this schedule's peak and shape (frozen: a new Schedule)."""
        return replace(self, unit=state["unit_samples"], warmup_samples=state["warmup_samples"],
                       budget_samples=state["budget_samples"])  # fmt: skip

