"""Never lose a run: periodic checkpoints, exact resume, Ctrl+C / SIGTERM, non-finite losses.

The loop calls a RunGuard at start (restore the state, position the data), after every
optimizer step (count skipped and non-finite steps on the device, save every SAVE_EVERY steps,
stop on a signal or NAN_PATIENCE) and at the end (save). Where the run starts (a fresh start, or
RESUME=1's checkpoint: step and sample counters, data position, schedule) is decided once in
train/run/guard/resume_state.py as a frozen ResumeState; the guard reads it and never changes it.
Exact resume also restores the weights, optimizer, GradScaler and every RNG, so a continued run
repeats the uninterrupted one step for step.
"""

from __future__ import annotations

import signal
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from train.distributed import process_group
from train.run.checkpoint.manager import CheckpointManager, ObjectiveState
from train.run.checkpoint.on_disk import DiskFull, checkpoint_name, list_checkpoints
from train.run.checkpoint.rng import RngStates
from train.run.guard import resume_state
from train.run.guard.health import Health, weights_finite
from train.run.guard.signals import StopSignals
from train.run.rundir.outputs import check_saveable

if TYPE_CHECKING:
    from train.run.plan.make import Plan


class RunGuard:
    """Checkpoints, resume, signals and non-finite losses for one run (see the module doc)."""

    def __init__(self, plan: Plan, run_path: Path, say, param_groups, asked=None):
        """Fresh run: the plan's schedule. RESUME=1: the newest valid checkpoint (weights go
        into plan.model) and the remaining steps (train/run/guard/resume_state.py), and only then the
        run folder touched. asked: the command's settings (TrainConfig), sealed into each checkpoint."""
        self.plan, self.cfg, self.say, self.run_path = plan, plan.cfg, say, Path(run_path)
        check_saveable(plan)  # what final/ needs, before a step is trained and the run folder touched
        self.effective = self.cfg.effective_batch_size(plan.world.world_size)
        self.checkpoints = CheckpointManager(
            plan, self.run_path / "checkpoints", say, asdict(asked) if asked else None
        )
        self.manager, self.sharding = self.checkpoints.manager, self.checkpoints.sharding
        self.signals = StopSignals(announce=plan.world.is_main)
        self.stop_signal: int | None = None
        self.stop_detail = ""
        self.write_error: str | None = None  # a checkpoint that did not fit: its one line
        self.loaded = None
        if self.cfg.run.resume:
            self.state, self.loaded = resume_state.from_checkpoint(
                plan, self.run_path, say, self.checkpoints, param_groups(), self.effective
            )
        else:
            self.state = resume_state.fresh(plan, self.effective)
        # The run's totals from here on belong to Health (train/run/guard/health.py), which counts them.
        self.counters = dict(self.state.counters)
        self.progress = resume_state.Progress(self.state, self.effective, plan.max_length)

    # Where this session starts and ends: read from the frozen ResumeState.
    first_step = property(lambda self: self.state.first_step)
    total_steps = property(lambda self: self.state.total_steps)
    warmup_steps = property(lambda self: self.state.warmup_steps)
    counted_before = property(lambda self: self.state.counted_before)
    replanned = property(lambda self: self.state.replanned)
    resuming = property(lambda self: self.state.resuming)
    complete = property(lambda self: self.state.complete)
    schedule = property(lambda self: self.state.schedule)

    def _generators(self) -> dict | None:
        """The objective's own random-number generators (GRPO's sampler), for the checkpoint's RNG entry."""
        own = getattr(self.plan.objective, "generators", None)
        return own() if own is not None else None

    # ---- the loop's calls -----------------------------------------------------------------

    def start(self, model, optimizer, scaler, oom_guard) -> None:
        """Hand the checkpoint manager the objects a checkpoint holds, apply the loaded state to
        them and open the oom_guard's batch stream at the saved data position (RNG restored last).
        oom_guard: the OOM guard (train/run/loop/oom.py), which owns the stream and the current
        micro-batch that checkpoints record."""
        self.scaler, self.oom_guard = scaler, oom_guard
        self.health = Health(scaler, self.counters)
        self.checkpoints.track(
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            rng=RngStates(self.plan.world, self._generators()),
            objective=ObjectiveState(self.plan.world, self.plan.objective, self.say),
            progress=self.progress,
            oom_guard=oom_guard,
            schedule=self.schedule,
            health=self.health,
        )
        position = {"epoch": self.state.epoch, "position": self.state.consumed}
        self.checkpoints.restore(self.loaded, position)
        self.loaded = None  # free the host copies of the optimizer state
        self.signals.install()

    def samples_at(self, steps_done: int) -> int:
        return self.progress.samples_at(steps_done)

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
        signum, streak = process_group.max_across(self.plan.world, [self.signals.received or 0, streak])
        if signum:
            self.stop_signal = signum
            return "interrupted"
        if streak >= r.nan_patience > 0:
            first_bad = steps_done - streak + 1
            last = self.checkpoints.last_saved or (list_checkpoints(self.manager.folder) or [None])[0]
            last = getattr(last, "name", last)
            return self.stop(
                "non_finite_loss",
                f"loss non-finite for {streak} steps in a row from step {first_bad} "
                f"(NAN_PATIENCE={r.nan_patience}); "
                f"newest good checkpoint: {last or 'none'}; lower LEARNING_RATE and resume with RESUME=1",
            )
        if save_due and not self.save(steps_done, counted):
            return "write_failed"
        return None

    def stop(self, reason: str, detail: str) -> str:
        """A stop for `reason`, with the line that says why (summary.json's stop_detail)."""
        self.stop_detail = detail
        self.say("stopping: " + detail)
        return reason

    def save(self, steps_done: int, counted=None) -> bool:
        """A checkpoint of this step (train/run/checkpoint/manager.py), with where the run is. False
        when it did not fit (a full disk, a file-size limit): the run then stops as a failed
        append stops it, with summary.json where the disk takes it and the resume command."""
        try:
            self.progress.at(steps_done, counted)
            self.checkpoints.save(steps_done)
        except DiskFull as err:
            self.write_error = str(err)
        # every rank stops at the same step, or one waits forever in a collective
        return not process_group.max_across(self.plan.world, [int(self.write_error is not None)])[0]

    def seconds_saving_since(self, t0: float, t1: float = float("inf")) -> float:
        return self.checkpoints.seconds_saving_since(t0, t1)

    def close(self) -> None:
        self.signals.restore()
        oom_guard = getattr(self, "oom_guard", None)
        if oom_guard is not None:
            oom_guard.close()

    def finish(self, steps_done: int, exit_reason: str, counted=None) -> str:
        """The checkpoint at the end (and after a stop signal), unless the run stopped on
        non-finite losses: then the newest checkpoint is the good one from before them. Returns
        the exit reason: non_finite_weights where the weights the run would save are not finite
        (fewer bad steps than NAN_PATIENCE, no validation to catch them): no final/ of them."""
        self.close()
        trained = self.health.trained
        if exit_reason in ("completed", "interrupted", "out_of_memory") and trained:
            finite = weights_finite(self.checkpoints.stateful["model"])
            if not process_group.max_across(self.plan.world, [int(not finite)])[0]:
                if self.checkpoints.last_saved != checkpoint_name(steps_done):
                    self.save(steps_done, counted)
            else:
                self.health.read()  # the non-finite steps, for the line
                last = self.checkpoints.last_saved or (list_checkpoints(self.manager.folder) or [None])[0]
                last = getattr(last, "name", last)
                exit_reason = self.stop(
                    "non_finite_weights",
                    f"the weights are non-finite (NaN or inf) after step {steps_done} "
                    f"({self.counters['non_finite_steps']} non-finite loss step(s)); "
                    f"no final/ written; newest good checkpoint: {last or 'none'}; lower LEARNING_RATE "
                    f"(now {self.cfg.optim.learning_rate:g}) or check MODEL_CONFIG / MODEL_PATH",
                )
        self.health.read()
        return exit_reason

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
            # a checkpoint that did not fit: the run ends as write_failed (train/run/rundir/outputs.py)
            **({"exit_reason": "write_failed", "write_error": self.write_error} if self.write_error else {}),
        }

    def exit_code(self, exit_reason: str) -> int:
        """0 completed; 128 + the signal number when stopped by one (130 Ctrl+C, 143 SIGTERM),
        as shells report it; 1 when non-finite losses or weights or repeated out-of-memory stopped the run."""
        if exit_reason == "interrupted":
            return 128 + (self.stop_signal or signal.SIGINT)
        return 1 if exit_reason in ("non_finite_loss", "non_finite_weights", "out_of_memory") else 0
