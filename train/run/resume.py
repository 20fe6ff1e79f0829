"""Never lose a run: periodic checkpoints, exact resume, Ctrl+C / SIGTERM, non-finite losses.

The loop calls a RunGuard at start (restore the state, position the data), after every
optimizer step (count skipped and non-finite steps on the device, save every SAVE_EVERY steps,
stop on a signal or NAN_PATIENCE) and at the end (save). Exact resume restores the weights,
optimizer, GradScaler, every RNG, the step and sample counters and the data position (epoch and
samples consumed in it), so a continued run repeats the uninterrupted one step for step.

The LR schedule is a function of samples consumed, not of steps: with the same settings that is
the same curve step for step; with a changed BATCH_SIZE or GRADIENT_ACCUM the run continues at
the same sample, at the same point of the warm-up and cosine, and ends at the same sample.
"""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import replace
from pathlib import Path

import torch

from config import env_name
from train.core import files
from train.core.errors import UsageError
from train.core.step import Schedule
from train.distributed import distributed, parallel
from train.run.checkpoint import (
    SHARDS,
    checkpoint_name,
    list_checkpoints,
)
from train.run.checkpointer import COMPARED, Checkpointer
from train.run.health import Health
from train.run.rng import set_rng_state
from train.run.signals import StopSignals

BUDGET = ("max_steps", "epochs", "max_samples")


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


class RunGuard:
    """Checkpoints, resume, signals and non-finite losses for one run (see the module doc)."""

    def __init__(self, b, run_path: Path, say, param_groups):
        """Fresh run: plan the schedule. RESUME=1: find the newest valid checkpoint (weights
        go into b.model), re-plan the remaining steps, and only then touch the run folder."""
        self.b, self.cfg, self.say, self.run_path = b, b.cfg, say, Path(run_path)
        r = self.cfg.run
        self.effective = self.cfg.effective_batch_size(b.world.world_size)
        self.checkpoints = Checkpointer(b, self.run_path / "checkpoints", say)
        self.manager, self.sharding = self.checkpoints.manager, self.checkpoints.sharding
        self.signals = StopSignals(announce=b.world.is_main)
        self.stop_signal: int | None = None
        self.counted_before: tuple[int, int] | None = None  # the same at the checkpoint resumed
        self.loaded = None
        self.first_step = self.base_samples = self.epoch = self.consumed = 0
        e = self.effective
        self.schedule = Schedule(unit=e, warmup_samples=b.warmup_steps * e, budget_samples=b.total_steps * e)
        # This session's span: the plan's, or RESUME=1's continuation (the plan is never changed)
        self.total_steps, self.warmup_steps = b.total_steps, b.warmup_steps
        self.replanned: dict | None = None  # RESUME=1's total_steps decision, with its reason
        self.counters = {"skipped_steps": 0, "non_finite_steps": 0}
        self.stop_detail = ""
        self.resuming = r.resume
        self.complete = False  # RESUME=1 of a run that has nothing left to train
        if r.resume:
            self._resume(param_groups())

    # ---- resume ---------------------------------------------------------------------------

    def _resume(self, param_groups) -> None:
        loaded, rejected = self.manager.newest_valid(
            self.b.model, param_groups, self.sharding, self.checkpoints.settings()
        )
        if loaded is None:
            reasons = "; ".join(f"{p.name}: {why}" for p, why in rejected) or "none saved"
            raise UsageError(f"RESUME=1: no usable checkpoint in {self.manager.folder} ({reasons})")
        names = distributed.gather(loaded.path.name)
        if len(set(names)) > 1:  # a checkpoint folder not shared by every machine
            raise UsageError(f"RESUME=1: the processes found different newest checkpoints ({', '.join(names)})")
        self.loaded, meta = loaded, loaded.meta
        self._take_counts(meta)
        say, saved = self.say, meta["settings"]
        samples = self.counted_before[0] if self.counted_before else meta["samples"]
        say(
            f"resuming {self.run_path} from checkpoint {loaded.path.name}: step {meta['step']}, "
            f"{samples:,} samples, epoch {meta['data']['epoch']} position {meta['data']['position']:,}"
        )
        self._compare_settings(saved)
        self._position_data(meta["data"])
        remaining = max(0, math.ceil((self.schedule.budget_samples - self.base_samples) / self.effective))
        if remaining == 0 and self._finished(loaded.path.name):
            return
        self._replan(remaining, saved)
        # Everything checked: now the run folder may change (rank 0 alone, once every rank has
        # read its checkpoint).
        distributed.agree(None)
        if not self.b.world.is_main:
            return
        self.manager.set_aside(rejected)
        self.manager.clean_temporary()
        dropped = trim_metrics(self.run_path / "metrics.jsonl", self.first_step)
        if dropped:
            say(f"dropped {dropped} metrics row(s) written after step {self.first_step} by the stopped run")

    def _take_counts(self, meta: dict) -> None:
        """Step, samples, counted rows and tokens, counters and the schedule, as saved."""
        self.first_step, self.base_samples = meta["step"], meta["samples"]
        counted = meta.get("counted")
        if isinstance(counted, dict) and all(isinstance(counted.get(k), int) for k in ("samples", "tokens")):
            self.counted_before = (counted["samples"], counted["tokens"])
        self.counters.update(meta.get("counters", {}))
        sched = meta["schedule"]
        self.schedule = Schedule(sched["unit_samples"], sched["warmup_samples"], sched["budget_samples"])

    def _compare_settings(self, saved: dict) -> None:
        """Say what changed since the checkpoint; a changed length or warm-up re-plans them."""
        now = self.checkpoints.settings()
        changed = [f"{env_name(k)} {saved.get(k)} -> {now[k]}" for k in COMPARED if saved.get(k) != now[k]]
        if changed:
            self.say("changed since the checkpoint: " + ", ".join(changed))
        if any(saved.get(k) != now[k] for k in BUDGET):
            self.schedule = replace(self.schedule, budget_samples=self.b.total_steps * self.effective)
            self.say(f"the run's length changed: the schedule now ends at {self.schedule.budget_samples:,} samples")
        if saved.get("warmup_steps") != now["warmup_steps"]:
            self.schedule = replace(self.schedule, warmup_samples=self.b.warmup_steps * self.effective)

    def _position_data(self, data: dict) -> None:
        """The saved data position, where the data is the same; else the start of a new epoch."""
        saved_world, world = data.get("world_size", 1), self.b.world.world_size
        if data["identity"] == self.checkpoints.data_identity():
            self.epoch, self.consumed = data["epoch"], data["position"]
            if saved_world != world:
                self.say(
                    f"{saved_world} process(es) saved this checkpoint, {world} continue it: the data position "
                    f"carries over (each takes its share of the epoch from sample {self.consumed:,})"
                )
        else:
            self.epoch, self.consumed = data["epoch"] + 1, 0
            self.say(
                "the data changed since the checkpoint (sequences, MAX_LENGTH, SEED or DATA_PATH): its position "
                "cannot carry over, so the new data is read from the start of a new epoch"
            )

    def _finished(self, name: str) -> bool:
        """Nothing left to train. Complete (True) only with its summary.json and a whole final/ of
        this step (a full disk may have stopped it writing them): then nothing of the run folder
        is touched. Else the session writes them. Rank 0 reads, every rank agrees."""
        from train.run.rundir import unfinished

        missing = distributed.on_main(self.b.world, lambda: unfinished(self.run_path, self.first_step))
        if missing is None:  # a finished run (a scheduler's requeue, a repeated command)
            self.complete = True
            self.say(
                f"{self.run_path} is complete: its checkpoint {name} is at {self.base_samples:,} of "
                f"the schedule's {self.schedule.budget_samples:,} samples; nothing to do (raise MAX_STEPS, EPOCHS or "
                "MAX_SAMPLES to train it further)"
            )
            return True
        self.say(
            f"{self.run_path} is trained to the end but {missing}: writing final/ and summary.json from "
            f"checkpoint {name}"
        )
        return False

    def _replan(self, remaining: int, saved: dict) -> None:
        """The steps left, as a decision with its reason."""
        planned = self.b.total_steps
        self.total_steps = self.first_step + remaining
        self.warmup_steps = math.ceil(self.schedule.warmup_samples / self.effective)
        progress = min(1.0, self.base_samples / max(1, self.schedule.budget_samples))
        why = (
            f"resumed at step {self.first_step} ({progress:.0%} of the schedule's {self.schedule.budget_samples:,} samples); "
            f"{remaining} steps of {self.effective} sequences remain"
        )
        if saved.get("effective_batch_size") != self.effective:
            why += (
                f"; effective batch {saved.get('effective_batch_size')} -> {self.effective}: same sample position, "
                f"the LR schedule keeps its progress in samples (steps continue from {self.first_step})"
            )
        if planned != self.total_steps:
            why += f"; a new run with these settings would plan {planned} steps"
        self.replanned = {"setting": "total_steps", "value": self.total_steps, "reason": why}
        self.say(f"  total_steps = {self.total_steps}  ({why})")

    # ---- the loop's calls -----------------------------------------------------------------

    def start(self, model, optimizer, scaler, feed) -> None:
        """Apply the loaded state and open the feed's batch stream at the saved data position
        (RNG restored last). feed: the OOM guard (train/run/oom.py), which owns the stream and
        the current micro-batch that checkpoints record."""
        self.model, self.optimizer, self.scaler, self.feed = model, optimizer, scaler, feed
        if self.loaded is not None and self.sharding != "none":
            parallel.load_sharded(self.loaded.path / SHARDS, model, optimizer)
        elif self.loaded is not None:
            optimizer.load_state_dict(self.loaded.optimizer)
            if scaler.is_enabled() and self.loaded.scaler:
                scaler.load_state_dict(self.loaded.scaler)
        feed.open(self.epoch, self.consumed)
        if self.loaded is not None:
            ranks, world = self.loaded.rng_ranks, self.b.world
            # each rank its own states; with another number of processes, rank 0's for all
            set_rng_state(ranks[world.rank] if ranks and len(ranks) == world.world_size else self.loaded.rng)
            self.loaded = None  # free the host copies of the optimizer state
        self.health = Health(scaler, self.counters)
        self.signals.install()

    def samples_at(self, steps_done: int) -> int:
        return self.base_samples + (steps_done - self.first_step) * self.effective

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (from 0), by samples consumed (core/step.py Schedule)."""
        o = self.cfg.optim
        return self.schedule.lr(self.samples_at(step), o.learning_rate, o.min_lr_ratio)

    def step_done(self, steps_done: int, loss: torch.Tensor, synced: bool, counted=None) -> str | None:
        """After each optimizer step. Counts on the device (no host sync); reads the counts only
        where the loop already synced (a log line) or is about to save. Returns a stop reason.
        counted: () -> (samples, tokens) trained so far, all ranks (a collective; the meter's)."""
        self.health.step(loss)
        r = self.cfg.run
        save_due = r.save_every > 0 and steps_done % r.save_every == 0 and steps_done < self.total_steps
        streak = self.health.streak_now() if (synced or save_due) and r.nan_patience > 0 else 0
        # Every rank stops at the same step, or one waits forever in a collective: a signal seen
        # by any rank (torchrun forwards one to each, at different moments) and the longest
        # non-finite streak are shared, one small all-reduce per step on the host.
        signum, streak = distributed.max_across(self.b.world, [self.signals.received or 0, streak])
        if signum:
            self.stop_signal = signum
            return "interrupted"
        if streak >= r.nan_patience > 0:
            first_bad = steps_done - streak + 1
            last = self.checkpoints.last_saved or (list_checkpoints(self.manager.folder) or [None])[0]
            last = getattr(last, "name", last)
            return self.stop(
                "non_finite_loss",
                f"loss non-finite for {streak} steps in a row from step {first_bad} (NAN_PATIENCE={r.nan_patience}); "
                f"newest good checkpoint: {last or 'none'}; lower LEARNING_RATE and resume with RESUME=1",
            )
        if save_due:
            self.save(steps_done, counted)
        return None

    def stop(self, reason: str, detail: str) -> str:
        """A stop for `reason`, with the line that says why (summary.json's stop_detail)."""
        self.stop_detail = detail
        self.say("stopping: " + detail)
        return reason

    def save(self, steps_done: int, counted=None) -> None:
        """A checkpoint of this step (train/run/checkpointer.py), with where the run is."""
        counts = counted or (lambda: None)
        self.checkpoints.save(
            steps_done, self.model, self.optimizer, self.scaler, self.health, lambda: self._meta(steps_done, counts())
        )

    def seconds_saving_since(self, t0: float, t1: float = float("inf")) -> float:
        return self.checkpoints.seconds_saving_since(t0, t1)

    def close(self) -> None:
        self.signals.restore()
        feed = getattr(self, "feed", None)
        if feed is not None:
            feed.close()

    def finish(self, steps_done: int, exit_reason: str, counted=None) -> None:
        """The checkpoint at the end (and after a stop signal), unless the run stopped on
        non-finite losses: then the newest checkpoint is the good one from before them."""
        self.close()
        trained = self.health.trained
        if (
            exit_reason in ("completed", "interrupted", "out_of_memory")
            and trained
            and self.checkpoints.last_saved != checkpoint_name(steps_done)
        ):
            self.save(steps_done, counted)
        self.health.read()

    # ---- state ----------------------------------------------------------------------------

    def _meta(self, steps_done: int, counted: tuple[int, int] | None) -> dict:
        samples = self.samples_at(steps_done)  # in the schedule's units: steps x effective batch
        return {
            "samples": samples,
            "tokens": samples * self.b.max_length,
            # rows and real tokens as counted (SFT batches vary in both), for the figures
            "counted": {"samples": counted[0], "tokens": counted[1]} if counted else None,
            "data": {
                "epoch": self.feed.stream.epoch,
                "position": self.feed.stream.consumed,  # global: samples of the epoch all ranks consumed
                "world_size": self.b.world.world_size,
                "identity": self.checkpoints.data_identity(),
            },
            "sharding": self.sharding,
            "schedule": {
                "unit_samples": self.schedule.unit,
                "warmup_samples": self.schedule.warmup_samples,
                "budget_samples": self.schedule.budget_samples,
            },
            "settings": self.checkpoints.settings(self.feed),
            "counters": dict(self.counters),
        }

    def summary(self) -> dict:
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        return {
            "resumed_from_step": self.first_step if self.resuming else None,
            "checkpoint": self.checkpoints.last_saved,
            "skipped_steps": self.counters["skipped_steps"],
            "non_finite_steps": self.counters["non_finite_steps"],
            "loss_scale": scale,
            "stop_signal": signal.Signals(self.stop_signal).name if self.stop_signal else None,
            "stop_detail": self.stop_detail or None,
        }

    def exit_code(self, exit_reason: str) -> int:
        """0 completed; 128 + the signal number when stopped by one (130 Ctrl+C, 143 SIGTERM),
        as shells report it; 1 when non-finite losses or repeated out-of-memory stopped the run."""
        if exit_reason == "interrupted":
            return 128 + (self.stop_signal or signal.SIGINT)
        return 1 if exit_reason in ("non_finite_loss", "out_of_memory") else 0
