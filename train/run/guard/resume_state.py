"""Where a run starts, decided once: a fresh run's start, or RESUME=1's checkpoint read, checked
and turned into one frozen value (ResumeState) beside the plan. Nothing changes it afterwards;
the loop's running counts live in the objects that own them (Health's counters, the stream's
position, the OOM guard's micro-batch).

Exact resume restores the step and sample counters and the data position (epoch and samples
consumed in it). The LR schedule is a function of samples consumed, not of steps: with the same
settings that is the same curve step for step; with a changed BATCH_SIZE or GRADIENT_ACCUM the
run continues at the same sample, at the same point of the warm-up and cosine, and ends at the
same sample.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from config import env_name
from train.core import files
from train.core.errors import UsageError
from train.core.optim.registry import build_schedule
from train.core.optim.schedules import Schedule
from train.distributed import process_group
from train.run.checkpoint.manager import COMPARED, CheckpointManager

if TYPE_CHECKING:
    from train.run.plan.make import Plan

BUDGET = ("max_steps", "epochs", "max_samples")


@dataclass(frozen=True)
class ResumeState:
    """This session's start and span. The plan (plan.total_steps ...) is never changed: a resume's
    continuation is total_steps here, with its reason in `replanned`."""

    schedule: Schedule
    total_steps: int
    warmup_steps: int
    first_step: int = 0
    base_samples: int = 0  # the schedule's samples (steps x effective batch) at first_step
    epoch: int = 0
    consumed: int = 0  # samples of `epoch` all ranks consumed
    counted_before: tuple[int, int] | None = None  # rows and real tokens counted up to first_step
    counters: dict = field(default_factory=lambda: {"skipped_steps": 0, "non_finite_steps": 0})
    replanned: dict | None = None  # RESUME=1's total_steps decision, with its reason
    resuming: bool = False
    complete: bool = False  # RESUME=1 of a run that has nothing left to train


class Progress:
    """The run's counters as a checkpoint holds them (meta.json's samples, tokens and counted):
    the loop's step, set before each save, and the rows and real tokens counted (SFT batches
    vary in both). Samples and tokens are in the schedule's units: steps x effective batch."""

    def __init__(self, state: ResumeState, effective: int, max_length: int):
        self.state, self.effective, self.max_length = state, effective, max_length
        self.step, self.counted = state.first_step, None

    def at(self, steps_done: int, counted=None) -> Progress:
        """Where the next save is: counted () -> (samples, tokens) all ranks (the meter's collective)."""
        self.step, self.counted = steps_done, counted
        return self

    def samples_at(self, steps_done: int) -> int:
        return self.state.base_samples + (steps_done - self.state.first_step) * self.effective

    def state_dict(self) -> dict:
        samples, counted = self.samples_at(self.step), self.counted() if self.counted else None
        return {
            "samples": samples,
            "tokens": samples * self.max_length,
            "counted": {"samples": counted[0], "tokens": counted[1]} if counted else None,
        }


def fresh(plan: Plan, effective: int) -> ResumeState:
    """A new run: the plan's span, the schedule in samples."""
    schedule = build_schedule(plan.cfg.optim, effective, plan.warmup_steps, plan.total_steps)
    return ResumeState(schedule, plan.total_steps, plan.warmup_steps)


def trim_metrics(path: Path, step: int) -> int:
    """Drop metrics rows after `step` (written after the checkpoint, by the run that died), so
    metrics.jsonl stays one clean record. Returns how many were dropped."""
    if not os.path.lexists(path):
        return 0
    kept, dropped = [], 0
    for line in files.read_text(path).splitlines():  # a link there is refused, never read
        try:
            row_step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            dropped += 1  # half a line from a kill mid-write
            continue
        if row_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        files.atomic_write(path, "".join(line + "\n" for line in kept))
    return dropped


def from_checkpoint(
    plan: Plan, run_path: Path, say, checkpoints: CheckpointManager, param_groups, effective: int
):
    """RESUME=1: the newest valid checkpoint (its weights go into plan.model), checked against the
    settings, the data positioned, the remaining steps re-planned; only then is the run folder
    touched. Returns (ResumeState, the loaded checkpoint or None when the run is complete)."""
    manager = checkpoints.manager
    loaded, rejected = manager.newest_valid(
        plan.model, param_groups, checkpoints.sharding, checkpoints.settings(), plan.objective
    )
    if loaded is None:
        reasons = "; ".join(f"{p.name}: {why}" for p, why in rejected) or "none saved"
        raise UsageError(f"RESUME=1: no usable checkpoint in {manager.folder} ({reasons})")
    names = process_group.gather(loaded.path.name)
    if len(set(names)) > 1:  # a checkpoint folder not shared by every machine
        raise UsageError(f"RESUME=1: the processes found different newest checkpoints ({', '.join(names)})")
    meta, saved = loaded.meta, loaded.meta["settings"]
    state = _counts(meta, fresh(plan, effective))
    samples = state.counted_before[0] if state.counted_before else meta["samples"]
    say(
        f"resuming {run_path} from checkpoint {loaded.path.name}: step {meta['step']}, "
        f"{samples:,} samples, epoch {meta['data']['epoch']} position {meta['data']['position']:,}"
    )
    state = _compare_settings(plan, state, saved, checkpoints.settings(), effective, say)
    state = _position_data(plan, state, meta["data"], checkpoints.data_identity(), say)
    remaining = max(0, math.ceil((state.schedule.budget_samples - state.base_samples) / effective))
    if remaining == 0 and _finished(plan, run_path, state, loaded.path.name, say):
        return replace(state, complete=True), None
    state = _replan(plan, state, remaining, saved, effective, say)
    # Everything checked: now the run folder may change (rank 0 alone, once every rank has
    # read its checkpoint).
    process_group.agree(None)
    if plan.world.is_main:
        manager.set_aside(rejected)
        manager.clean_temporary()
        dropped = trim_metrics(run_path / "metrics.jsonl", state.first_step)
        if dropped:
            say(f"dropped {dropped} metrics row(s) written after step {state.first_step} by the stopped run")
    return state, loaded


def _counts(meta: dict, state: ResumeState) -> ResumeState:
    """Step, samples, counted rows and tokens, counters and the schedule, as saved."""
    counted = meta.get("counted")
    before = None
    if isinstance(counted, dict) and all(isinstance(counted.get(k), int) for k in ("samples", "tokens")):
        before = (counted["samples"], counted["tokens"])
    return replace(
        state, first_step=meta["step"], base_samples=meta["samples"], counted_before=before,
        counters={**state.counters, **meta.get("counters", {})}, resuming=True,
        schedule=state.schedule.load_state_dict(meta["schedule"]),
    )  # fmt: skip


def _compare_settings(
    plan: Plan, state: ResumeState, saved: dict, now: dict, effective: int, say
) -> ResumeState:
    """Say what changed since the checkpoint; a changed length or warm-up re-plans them."""
    changed = [f"{env_name(k)} {saved.get(k)} -> {now[k]}" for k in COMPARED if saved.get(k) != now[k]]
    if changed:
        say("changed since the checkpoint: " + ", ".join(changed))
    schedule = state.schedule
    if any(saved.get(k) != now[k] for k in BUDGET):
        budget = plan.total_steps * effective
        steps = now["max_steps"]
        if steps is not None and steps != saved.get("max_steps") and plan.total_steps == steps:
            # MAX_STEPS given again counts steps: the run ends at that step, whatever batch it had
            if steps < state.first_step:
                raise UsageError(
                    f"RESUME=1: MAX_STEPS={steps} is below the step the checkpoint is at "
                    f"({state.first_step}): "
                    f"set MAX_STEPS above {state.first_step}, or leave it out to finish the run's own "
                    f"{saved.get('max_steps') or 'length'}"
                )
            budget = state.base_samples + (steps - state.first_step) * effective
        schedule = replace(schedule, budget_samples=budget)
        say(f"the run's length changed: the schedule now ends at {schedule.budget_samples:,} samples")
    if saved.get("warmup_steps") != now["warmup_steps"]:
        schedule = replace(schedule, warmup_samples=plan.warmup_steps * effective)
    return replace(state, schedule=schedule)


def _position_data(plan: Plan, state: ResumeState, data: dict, identity: dict, say) -> ResumeState:
    """The saved data position, where the data is the same; else the start of a new epoch."""
    saved_world, world = data.get("world_size", 1), plan.world.world_size
    if data["identity"] != identity:
        say(
            "the data changed since the checkpoint (sequences, MAX_LENGTH, SEED or DATA_PATH): its position "
            "cannot carry over, so the new data is read from the start of a new epoch"
        )
        return replace(state, epoch=data["epoch"] + 1, consumed=0)
    if saved_world != world:
        say(
            f"{saved_world} process(es) saved this checkpoint, {world} continue it: the data position "
            f"carries over (each takes its share of the epoch from sample {data['position']:,})"
        )
    return replace(state, epoch=data["epoch"], consumed=data["position"])


def _finished(plan: Plan, run_path: Path, state: ResumeState, name: str, say) -> bool:
    """Nothing left to train. Complete (True) only with its summary.json and a whole final/ of
    this step (a full disk may have stopped it writing them): then nothing of the run folder
    is touched. Else the session writes them. Rank 0 reads, every rank agrees."""
    from train.run.rundir.folder import unfinished

    missing = process_group.on_main(plan.world, lambda: unfinished(run_path, state.first_step))
    if missing is None:  # a finished run (a scheduler's requeue, a repeated command)
        say(
            f"{run_path} is complete: its checkpoint {name} is at {state.base_samples:,} of "
            f"the schedule's {state.schedule.budget_samples:,} samples; nothing to do (raise MAX_STEPS, "
            f"EPOCHS or MAX_SAMPLES to train it further)"
        )
        return True
    say(f"{run_path} is trained to the end but {missing}: writing final/ and summary.json from checkpoint "
        f"{name}")
    return False


def _replan(plan: Plan, state: ResumeState, remaining: int, saved: dict, effective: int, say) -> ResumeState:
    """The steps left, as a decision with its reason."""
    planned, first, schedule = plan.total_steps, state.first_step, state.schedule
    total = first + remaining
    progress = min(1.0, state.base_samples / max(1, schedule.budget_samples))
    why = (
        f"resumed at step {first} ({progress:.0%} of the schedule's {schedule.budget_samples:,} samples); "
        f"{remaining} steps of {effective} sequences remain"
    )
    if saved.get("effective_batch_size") != effective:
        why += (
            f"; effective batch {saved.get('effective_batch_size')} -> {effective}: same sample position, "
            f"the LR schedule keeps its progress in samples (steps continue from {first})"
        )
    if planned != total:
        why += f"; a new run with these settings would plan {planned} steps"
    say(f"  total_steps = {total}  ({why})")
    return replace(
        state, total_steps=total, warmup_steps=math.ceil(schedule.warmup_samples / effective),
        replanned={"setting": "total_steps", "value": total, "reason": why},
    )  # fmt: skip
