"""Validation: the loss over the held-out set (which the data front doors split off) and the
best model.

A pass runs the model in eval mode under no_grad and the run's autocast, sums the losses on the
device and reads them once (no per-batch .item(), which would stall the device every batch, as
the guides warn).
`evaluate` takes any loader of dict batches (input_ids, optional labels and attention_mask)
and goes through the loop's forward_loss, so SFT batches work unchanged.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch.utils.data import Subset

from train.data.holdout import VAL_ROWS
from train.data.loader import make_val_loader
from train.distributed import distributed, parallel
from train.observe.curves import read_metrics


def evaluate(model, loader, max_batches: int, device: torch.device, precision: str, *, layout,
             objective=None):  # fmt: skip
    """Mean loss per predicted token over the first max_batches batches of the loader.

    Each batch's mean loss is weighted by its predicted tokens (labels after the causal shift,
    or an encoder-decoder's every label, that are not IGNORE_INDEX), so a short last batch or
    masked SFT prompts count by their tokens.
    One host read per call. The model is put back in the mode it was in. objective: preference
    training's (the plan's): returns (mean loss, metrics), each the mean over the pairs read."""
    from train.core.step import forward_loss

    if objective is not None:
        return _evaluate_objective(model, loader, max_batches, device, precision, objective)
    was_training = model.training
    model.eval()
    dtype = torch.float32 if device.type == "mps" else torch.float64  # mps has no float64
    loss_sum = torch.zeros((), device=device, dtype=dtype)
    token_sum = torch.zeros((), device=device, dtype=dtype)
    try:
        with torch.no_grad():
            for index, batch in enumerate(loader):
                if index >= max_batches:
                    break
                tokens = layout.count_targets(batch)  # an encoder-decoder's every label counts  # host labels: no sync
                loss = forward_loss(model, batch, device, precision, layout=layout)
                loss_sum += loss.to(dtype) * tokens
                token_sum += tokens
    finally:
        model.train(was_training)
    total = torch.stack([loss_sum, token_sum]).tolist()  # the one sync of the pass
    return total[0] / total[1] if total[1] > 0 else None


def _evaluate_objective(model, loader, max_batches: int, device, precision: str, objective):
    """(the pairs' mean loss, TRL's metrics as their means) over the first max_batches batches: each
    batch's share is its own mean, weighted by its pairs; one host read."""
    was_training = model.training
    model.eval()
    sums, pairs = {}, 0
    try:
        with torch.no_grad():
            for index, batch in enumerate(loader):
                if index >= max_batches:
                    break
                counts = objective.counts([batch])  # host labels: no sync
                loss, metrics = objective.loss(model, batch, device, precision, counts)
                for name, value in {"loss": loss, **metrics}.items():
                    sums[name] = sums.get(name, 0) + value.double() * counts[0]
                pairs += counts[0]
    finally:
        model.train(was_training)
    if not pairs:
        return None, {}
    means = dict(zip(sums, (torch.stack(list(sums.values())) / pairs).tolist(), strict=True))  # the one sync
    return means.pop("loss"), means


def perplexity(loss: float | None) -> float | None:
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(loss) if loss < 700 else math.inf


def best_so_far(metrics: Path) -> tuple[float | None, int | None]:
    """The lowest finite val_loss in a resumed run's metrics.jsonl (trimmed to its checkpoint) and its
    step: without it a resumed KEEP_BEST=1 run saved its first pass over best/, however worse."""
    best = step = None
    for row in read_metrics(metrics) if not metrics.is_symlink() else ():
        loss = row.get("val_loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss) and (best is None or loss < best):
            best, step = float(loss), row.get("step")
    return best, step


class Evaluator:
    """Runs the passes a run is due (every EVAL_EVERY steps and at the end), writes the rows,
    keeps the best loss and, with KEEP_BEST=1, the best model in best/."""

    def __init__(self, b, run_dir, say, collate_fn=None, micro_batch=None):
        """micro_batch: () -> the training micro-batch now (the OOM guard's; default the plan's)."""
        self.b, self.run_dir, self.say = b, run_dir, say
        self.micro_batch = micro_batch or (lambda: b.cfg.optim.batch_size)
        run = b.cfg.run
        self.every, self.keep_best = run.eval_every, run.keep_best
        dataset = getattr(b, "val_dataset", None)
        # EVAL_BATCHES x 8 sequences a pass, in rows of 8 as the held-out set is sized: the same
        # sequences whatever BATCH_SIZE (compare-sft's batch 1 read 20 where batch 16 read 160).
        self.sequences = 0 if dataset is None else min(len(dataset), run.eval_batches * VAL_ROWS)
        if dataset is not None and self.sequences < len(dataset):
            dataset = Subset(dataset, range(self.sequences))
        self.dataset, self.collate_fn = dataset, collate_fn
        batch_size = b.cfg.optim.batch_size
        self.loader = None if dataset is None else make_val_loader(dataset, batch_size, b.device, collate_fn)
        self.batches = -(-self.sequences // batch_size)  # the last one partial
        self.last, self.last_metrics = None, {}
        self.best, self.best_step = best_so_far(Path(run_dir.path) / "metrics.jsonl")  # a fresh run: none
        self.passes, self.seconds = 0, 0.0

    def due(self, step: int, last: bool) -> bool:
        return self.loader is not None and (last or (self.every > 0 and step % self.every == 0))

    def run(self, step: int, samples: int) -> float:
        """One pass; returns the seconds it took, which the loop keeps out of throughput."""
        start = time.perf_counter()
        batch_size = self.micro_batch()
        if self.loader.batch_size != batch_size:  # the micro-batch shrank after an out-of-memory
            self.loader = make_val_loader(self.dataset, batch_size, self.b.device, self.collate_fn)
            self.batches = -(-self.sequences // batch_size)
        # The eager model: a compiled one would recompile for eval mode and no_grad.
        objective = getattr(self.b, "objective", None)
        loss = evaluate(self.b.model, self.loader, self.batches, self.b.device, self.b.precision,
                        layout=self.b.family.layout, objective=objective)
        loss, metrics = loss if objective is not None else (loss, {})
        self.passes += 1
        self.last, self.last_metrics = loss, metrics
        ppl = perplexity(loss) if objective is None else None  # a preference loss is no token loss
        self.run_dir.metrics({"step": step, "samples": samples, "val_loss": loss, "val_ppl": ppl,
                              **{f"val_{name}": value for name, value in metrics.items()}})
        if loss is None:
            line = "eval: no tokens"
        else:  # a non-finite loss has no perplexity: n/a, and the loop stops the run
            line = f"eval step {step}: val_loss {loss:.4f} val_ppl {'n/a' if ppl is None else format(ppl, '.2f')}"
            if "rewards/accuracies" in metrics:
                line = (f"eval step {step}: val_loss {loss:.4f} val_rewards/accuracies "
                        f"{metrics['rewards/accuracies']:.3f} val_rewards/margins {metrics['rewards/margins']:.3f}")
        improved = loss is not None and math.isfinite(loss) and (self.best is None or loss < self.best)
        if self.keep_best:
            from train.run.guard.health import weights_finite

            improved = improved and weights_finite(self.b.model)  # a finite loss can hide a NaN weight
            # Saving best/ is collective (a gather, then every rank learns whether rank 0's save
            # worked): ranks whose losses differ in the last bit must still agree it is due.
            improved = bool(distributed.max_across(self.b.world, [int(improved)])[0])
        if improved:
            self.best, self.best_step = loss, step
            if self.keep_best:
                from train.run.rundir.rundir import save_model

                state = parallel.full_state_dict(self.b.model)  # sharded: a gather every rank joins
                # One writer (the other ranks hold the same weights); a failed save stops every rank.
                distributed.on_main(
                    self.b.world, lambda: save_model(self.b, self.run_dir.path / "best", step, state)
                )
                line += " (best so far; saved to best/)"
        self.say(line)
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        return elapsed

    def summary(self) -> dict:
        return {
            "final_val_loss": self.last,
            "final_val_ppl": perplexity(self.last),
            **{f"final_val_{name}": value for name, value in self.last_metrics.items() if name.startswith("rewards/")},
            "best_val_loss": self.best,
            "best_val_step": self.best_step,
            "val_sequences": None if self.loader is None else len(self.loader.dataset),
            "eval_passes": self.passes,
            "eval_time_s": self.seconds,
        }


def val_stop(b, evaluator: Evaluator, guard, steps_done: int, say) -> str | None:
    """A non-finite validation loss means non-finite weights, whatever the training loss said:
    the same stop as NAN_PATIENCE non-finite training losses (no final/ of those weights)."""
    if b.cfg.run.nan_patience == 0:
        return None
    loss = evaluator.last
    bad = loss is not None and not math.isfinite(loss)
    if not distributed.max_across(b.world, [int(bad)])[0]:  # every rank stops at the same step
        return None
    from train.run.checkpoint.checkpoint import list_checkpoints

    saved = list_checkpoints(guard.manager.folder)
    if saved:
        then = f"newest good checkpoint: {saved[0].name}; lower LEARNING_RATE and resume with RESUME=1"
    else:
        then = "no checkpoint yet; lower LEARNING_RATE and start again"
    return guard.stop("non_finite_loss", f"validation loss is {loss} at step {steps_done}; {then}")
