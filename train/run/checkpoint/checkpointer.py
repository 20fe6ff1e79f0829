"""Saving a run's checkpoints as the loop goes: when a save is worth making (healthy weights on
every rank), who writes (rank 0, or every rank its own shards with SHARDING), the settings and
data identity a later RESUME=1 compares, and the time spent saving (left out of throughput).
The files themselves are train/run/checkpoint/checkpoint.py's; where the run is (step, samples, data
position, schedule) is the resume state's (train/run/guard/resume.py), handed in as `meta`."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from train.config import knobs
from train.distributed import distributed
from train.run.checkpoint.checkpoint import CheckpointManager, checkpoint_name
from train.run.checkpoint.rng import rng_state

# Settings compared with the checkpoint's on resume, to say what changed: config.py's fields
# marked "compared".
COMPARED = knobs.marked("compared")


def tokenizer_digest(tok) -> str | None:
    if tok is None:
        return None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        raw = json.loads(backend.to_str())
        what = {"model": raw.get("model"), "added": raw.get("added_tokens")}
    else:
        what = sorted(tok.get_vocab().items())
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


class Checkpointer:
    def __init__(self, b, folder: Path, say):
        self.b, self.cfg, self.say = b, b.cfg, say
        # Rank 0 of a DDP run saves for all (every rank holds the same weights); with SHARDING
        # every rank writes its own shards (train/run/checkpoint/checkpoint.py).
        self.sharding = self.cfg.system.sharding
        self.saves = b.world.is_main or self.sharding != "none"
        self.manager = CheckpointManager(folder, self.cfg.run.keep_checkpoints, say)
        self.effective = self.cfg.effective_batch_size(b.world.world_size)
        self.saving_s: list[tuple[float, float]] = []
        self.others_saved: str | None = None  # ranks that do not write: the name rank 0 gave it

    @property
    def last_saved(self) -> str | None:
        return self.manager.last_saved or self.others_saved

    def settings(self, feed=None) -> dict:
        """What a later RESUME=1 compares. feed: the OOM guard, whose micro-batch is the one trained now."""
        settings = {k: knobs.value(self.cfg, k) for k in COMPARED}
        if feed is not None:  # smaller than the plan's after an out-of-memory
            settings.update(batch_size=feed.batch_size, gradient_accumulation_steps=feed.accumulation)
        settings.update(precision=self.b.precision, num_workers=self.cfg.data.num_workers)
        settings.update(effective_batch_size=self.effective, model_size=self.b.model_size, max_length=self.b.max_length)
        # what chose the model, for the changed-model message of a later RESUME=1
        settings.update(model_config=self.cfg.model.model_config, model_path=self.b.summary_extra.get("model_path"))
        settings.update(model_family=self.cfg.model.model_family, tokenizer=self.tokenizer_digest())
        settings.update(data_path=self.cfg.data.data_path, tokenizer_path=self.cfg.data.tokenizer_path)
        return settings

    def tokenizer_digest(self) -> str | None:
        """What the token ids mean: a digest of the tokenizer's vocabulary and merges (not its
        padding or truncation state), so RESUME=1 can tell a tokenizer trained on other data
        (train/run/guard/resume_state.py). Computed once per run."""
        if not hasattr(self, "_tokenizer_digest"):
            self._tokenizer_digest = tokenizer_digest(getattr(self.b, "tokenizer", None))
        return self._tokenizer_digest

    def data_identity(self) -> dict:
        ds = self.b.dataset
        windows = getattr(getattr(ds, "dataset", ds), "windows", None)  # T5: span corruption over the packed windows
        source = getattr(ds if windows is None else windows, "_source", None)
        return {
            "sequences": len(self.b.dataset),
            "max_length": self.b.max_length,
            "seed": self.cfg.system.seed,
            "source": Path(str(source[0])).name if source else type(self.b.dataset).__name__,
        }

    def save(self, steps_done: int, model, optimizer, scaler, health, meta) -> None:
        """Save unless the model is unhealthy (a non-finite loss at this step or non-finite
        weights on any rank): a checkpoint must be one worth resuming from. Every rank calls
        it at the same step (the RNG states and counts are gathered); rank 0 writes, or with
        SHARDING every rank writes its shards. meta: () -> the checkpoint's record (a collective)."""
        start = time.perf_counter()
        healthy = health.worth_saving(model)
        if distributed.max_across(self.b.world, [int(not healthy)])[0]:
            self.say(f"not saving at step {steps_done}: the loss or weights are non-finite")
            return
        rngs = distributed.gather(rng_state())
        record = meta()
        if not self.saves:
            self.others_saved = checkpoint_name(steps_done)  # as rank 0 will have it
            return
        health.read()
        record["counters"] = dict(health.counters)
        if self.sharding != "none":
            self.manager.save_sharded(steps_done, model, optimizer, scaler, record, self.b.world, rngs)
        else:
            self.manager.save(steps_done, model, optimizer, scaler, record, rngs)
        self.saving_s.append((start, time.perf_counter() - start))
        self.say(f"saved checkpoint {self.manager.last_saved} ({time.perf_counter() - start:.1f} s)")

    def seconds_saving_since(self, t0: float, t1: float = float("inf")) -> float:
        """Time spent saving inside the loop between t0 and t1 (left out of the throughput
        figures); the save at the end, after the loop's clock stopped, is not inside."""
        return sum(span for start, span in self.saving_s if t0 <= start < t1)
