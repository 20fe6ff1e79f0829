"""Validation: the held-out split, the loss over it, and the best model.

The split is the last part of the packed token stream (VAL_FRACTION) or a separate file
(VAL_PATH), so training and validation windows never overlap. A pass runs the model in eval
mode under no_grad and the run's autocast, sums the losses on the device and reads them once
(no per-batch .item(), which would stall the device every batch, as the guides warn).
`evaluate` takes any loader of dict batches (input_ids, optional labels and attention_mask)
and goes through the loop's forward_loss, so SFT batches work unchanged.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Subset

from train.core.errors import UsageError
from train.data import text as data
from train.distributed import distributed, parallel

MAX_AUTO_FRACTION = 0.1  # filling EVAL_BATCHES x VAL_ROWS never holds out more than this
# The held-out set is sized in rows of 8 (the baseline launcher's micro-batch), not BATCH_SIZE:
# runs that differ only in BATCH_SIZE (make compare, ./train_sft_custom.sh 16 vs 20) must train
# and validate on the same data.
VAL_ROWS = 8


def val_windows(n_windows: int, fraction: float, want: int) -> int:
    """How many of n_windows to hold out: ceil(fraction x n), raised towards `want` sequences
    (EVAL_BATCHES x VAL_ROWS) but never past MAX_AUTO_FRACTION of the data, and at least one."""
    if fraction <= 0 or n_windows < 2:
        return 0
    n_val = max(1, math.ceil(fraction * n_windows))
    if n_val < want:
        n_val = max(n_val, min(want, int(MAX_AUTO_FRACTION * n_windows)))
    return min(n_val, n_windows - 1)


def split_pretraining(cfg, dataset, tok, cache_dir: Path, max_length: int, say, decide, window: int | None = None):
    """(train dataset, validation dataset or None) for packed pretraining windows of `window`
    tokens (MAX_LENGTH, or the raw windows span corruption makes MAX_LENGTH-token sources of)."""
    window = window or max_length
    if cfg.data.val_path is not None:
        files = data.corpus_files(cfg.data.val_path)
        key = data.corpus_fingerprint(files, cfg.data.text_field, cache_dir / "sums", "VAL_PATH")
        tokens = data.token_cache(files, key, tok, cache_dir, say, cfg.data.text_field, cfg.data.tokenize_workers)
        val = data.PackedDataset(tokens, window)
        if len(val) == 0:
            raw = f" (a raw window of {window} before span corruption)" if window != max_length else ""
            raise UsageError(f"VAL_PATH: {len(tokens)} tokens are fewer than one MAX_LENGTH={max_length} sequence{raw}")
        decide("validation", f"{len(val)} sequences", f"VAL_PATH={cfg.data.val_path}")
        return dataset, val
    want = cfg.run.eval_batches * VAL_ROWS
    n_val = val_windows(len(dataset), cfg.data.val_fraction, want)
    if n_val == 0:
        reason = "VAL_FRACTION=0" if cfg.data.val_fraction == 0 else "too little data to hold any out"
        decide("validation", "off", reason)
        return dataset, None
    n_train = len(dataset) - n_val
    reason = (
        f"the last {n_val / len(dataset):.1%} of the token stream (VAL_FRACTION={cfg.data.val_fraction:g}"
    )
    if n_val > math.ceil(cfg.data.val_fraction * len(dataset)):
        reason += f", raised towards EVAL_BATCHES x {VAL_ROWS} = {want}"
    decide("validation", f"{n_val} sequences", reason + "); never trained on")
    # Subset over a range pickles as two numbers, so workers still reopen the memmap.
    return Subset(dataset, range(n_train)), Subset(dataset, range(n_train, len(dataset)))


def make_val_loader(dataset, batch_size: int, device: torch.device, collate_fn=None) -> DataLoader:
    """In order, no workers (a few batches from a memmap; starting workers per pass costs more),
    last partial batch kept: every pass sees the same sequences."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        drop_last=False,
        num_workers=0,
        pin_memory=device.type == "cuda",
        collate_fn=collate_fn,
    )


def evaluate(model, loader, max_batches: int, device: torch.device, precision: str) -> float | None:
    """Mean loss per predicted token over the first max_batches batches of the loader.

    Each batch's mean loss is weighted by its predicted tokens (labels after the causal shift,
    or an encoder-decoder's every label, that are not IGNORE_INDEX), so a short last batch or
    masked SFT prompts count by their tokens.
    One host read per call. The model is put back in the mode it was in."""
    from train.core.loss import count_targets
    from train.core.model import is_seq2seq
    from train.core.step import forward_loss

    seq2seq = is_seq2seq(model)  # every target label counts (no causal shift)
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
                tokens = count_targets(batch, shifted=not seq2seq)  # host labels: no sync
                loss = forward_loss(model, batch, device, precision)
                loss_sum += loss.to(dtype) * tokens
                token_sum += tokens
    finally:
        model.train(was_training)
    total = torch.stack([loss_sum, token_sum]).tolist()  # the one sync of the pass
    return total[0] / total[1] if total[1] > 0 else None


def perplexity(loss: float | None) -> float | None:
    if loss is None or not math.isfinite(loss):
        return None
    return math.exp(loss) if loss < 700 else math.inf


class Evaluator:
    """Runs the passes a run is due (every EVAL_EVERY steps and at the end), writes the rows,
    keeps the best loss and, with KEEP_BEST=1, the best model in best/."""

    def __init__(self, b, run_dir, say, collate_fn=None, micro_batch=None):
        """micro_batch: () -> the training micro-batch now (the OOM guard's; default the plan's)."""
        self.b, self.run_dir, self.say = b, run_dir, say
        self.micro_batch = micro_batch or (lambda: b.cfg.optim.batch_size)
        run = b.cfg.run
        self.every, self.batches, self.keep_best = run.eval_every, run.eval_batches, run.keep_best
        dataset = getattr(b, "val_dataset", None)
        self.dataset, self.collate_fn = dataset, collate_fn
        self.loader = (
            None
            if dataset is None
            else make_val_loader(dataset, b.cfg.optim.batch_size, b.device, collate_fn)
        )
        self.sequences = self.batches * b.cfg.optim.batch_size  # the same held-out sequences every pass
        self.last = self.best = self.best_step = None
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
        loss = evaluate(self.b.model, self.loader, self.batches, self.b.device, self.b.precision)
        self.passes += 1
        self.last = loss
        ppl = perplexity(loss)
        self.run_dir.metrics({"step": step, "samples": samples, "val_loss": loss, "val_ppl": ppl})
        if loss is None:
            line = "eval: no tokens"
        else:  # a non-finite loss has no perplexity: n/a, and the loop stops the run
            line = f"eval step {step}: val_loss {loss:.4f} val_ppl {'n/a' if ppl is None else format(ppl, '.2f')}"
        improved = loss is not None and math.isfinite(loss) and (self.best is None or loss < self.best)
        if self.keep_best:
            # Saving best/ is collective (a gather, then every rank learns whether rank 0's save
            # worked): ranks whose losses differ in the last bit must still agree it is due.
            improved = bool(distributed.max_across(self.b.world, [int(improved)])[0])
        if improved:
            self.best, self.best_step = loss, step
            if self.keep_best:
                from train.run.rundir import save_model

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
    from train.run.checkpoint import list_checkpoints

    saved = list_checkpoints(guard.manager.folder)
    if saved:
        then = f"newest good checkpoint: {saved[0].name}; lower LEARNING_RATE and resume with RESUME=1"
    else:
        then = "no checkpoint yet; lower LEARNING_RATE and start again"
    return guard.stop("non_finite_loss", f"validation loss is {loss} at step {steps_done}; {then}")
