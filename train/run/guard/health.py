"""Is the run healthy? Non-finite losses (the streak NAN_PATIENCE stops on, and the total),
steps the fp16 GradScaler skipped, and whether the weights are finite before a save. Counted
on the device, so no step waits for the host; read only where the loop syncs anyway."""

from __future__ import annotations

import torch

from train.distributed import parallel


class Health:
    def __init__(self, scaler, counters: dict):
        self.scaler, self.counters = scaler, counters  # counters: the run's totals (a checkpoint's too)
        self.streak = self._nonfinite = self._skipped = self._last_scale = None

    @property
    def trained(self) -> bool:
        """At least one step was counted in this session."""
        return self.streak is not None

    def step(self, loss: torch.Tensor) -> None:
        """After each optimizer step: device-side counts only."""
        bad = (~torch.isfinite(loss)).to(torch.int64)
        if self.streak is None:
            self.streak, self._nonfinite = torch.zeros_like(bad), torch.zeros_like(bad)
            self._skipped = torch.zeros_like(bad)
        self.streak = (self.streak + 1) * bad
        self._nonfinite += bad
        scale = getattr(self.scaler, "_scale", None) if self.scaler.is_enabled() else None
        if scale is not None:
            # GradScaler lowers its scale exactly when it skipped the step (inf/NaN gradients).
            previous = (
                self._last_scale
                if self._last_scale is not None
                else torch.full_like(scale, self.scaler._init_scale)
            )
            self._skipped += (scale < previous).to(torch.int64).reshape(())
            self._last_scale = scale.clone()

    def streak_now(self) -> int:
        """Non-finite losses in a row up to now: a host sync, so only where one is due anyway."""
        return int(self.streak.item()) if self.streak is not None else 0

    def worth_saving(self, model) -> bool:
        """No non-finite loss at this step and finite weights: a checkpoint worth resuming from."""
        return self.streak_now() == 0 and weights_finite(model)

    def state_dict(self) -> dict:
        """The run's totals for a checkpoint (meta.json's counters): the device counts read first.
        RESUME=1 hands them back through the ResumeState (the counters this Health is made with)."""
        self.read()
        return dict(self.counters)

    def read(self) -> None:
        """Fold the device counts into the totals (a sync: at saves and at the end)."""
        if self.streak is not None:
            self.counters["non_finite_steps"] += int(self._nonfinite.item())
            self.counters["skipped_steps"] += int(self._skipped.item())
            self._nonfinite.zero_()
            self._skipped.zero_()


def weights_finite(model) -> bool:
    """Every parameter finite (one sync): final/, best/ and checkpoints never hold NaN or inf."""
    flags = [torch.isfinite(parallel.local(p)).all() for p in model.parameters()]
    return bool(torch.stack(flags).all().item()) if flags else True
