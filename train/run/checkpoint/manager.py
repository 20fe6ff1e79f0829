"""The one checkpoint manager of a run: it saves and restores one list of objects that each own
their state (state_dict / load_state_dict), as torchtitan's CheckpointManager does over Stateful
objects:
  model      the weights (model.safetensors, or shards/ with SHARDING)
  optimizer  AdamW's state (state.pt, or shards/)
  scaler     the GradScaler (state.pt)
  rng        every rank's random-number states (state.pt; rng.RngStates)
  progress   step, samples, tokens and the rows and tokens counted (meta.json)
  oom_guard  the data position: epoch and samples consumed (meta.json's data)
  schedule   the LR schedule in samples (meta.json)
  health     the skipped and non-finite steps (meta.json's counters)
  objective  the objective's own state, where it keeps one (state.pt; ObjectiveState): GRPO's scored
             micro-batches, which the steps of one generation share
It decides when a save is worth making (healthy weights on every rank), who writes (rank 0, or
every rank its own shards), records the settings and data identity a later RESUME=1 compares,
and the time spent saving (left out of throughput). The files are train/run/checkpoint/
checkpoint.py's. RESUME=1 reads the same entries back: the weights, the counters and the
schedule before the session is planned (train/run/guard/resume_state.py), the rest by restore()."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from train.config import knobs
from train.distributed import parallel, process_group
from train.run.checkpoint.on_disk import SHARDS, CheckpointFolder, checkpoint_name

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


class ObjectiveState:
    """The objective's own state (state_dict / load_state_dict, an optional hook of the objective) as one
    entry of the checkpoint: state.pt's objective, and objective_ranks with several processes, each rank's
    own, as the RNG states are kept. Nothing where the objective keeps no state."""

    def __init__(self, world, objective, say):
        self.world, self.say = world, say
        self.objective = objective if hasattr(objective, "load_state_dict") else None

    def state_dict(self) -> dict:
        """Every rank's state (a collective: every rank calls it at the same step)."""
        if self.objective is None:
            return {}
        states = process_group.gather(self.objective.state_dict())
        return {"objective": states[0], **({"objective_ranks": states} if len(states) > 1 else {})}

    def load_state_dict(self, state: dict | None) -> None:
        """Each rank its own. Saved by another number of processes, the states belong to another split of
        the data: none is taken (GRPO samples a new generation at the next step), and that is said."""
        if self.objective is None or not state:
            return
        ranks = state.get("objective_ranks")
        saved = len(ranks) if isinstance(ranks, list) else 1
        if saved != self.world.world_size:
            if self.world.is_main:
                self.say(f"the objective's state was saved by {saved} process(es), this run has "
                         f"{self.world.world_size}: it starts afresh (GRPO: a new generation next step)")
            if hasattr(self.objective, "load_progress"):  # the step count goes on (the rewards read it)
                self.objective.load_progress(state.get("objective"))
            return
        self.objective.load_state_dict(ranks[self.world.rank] if ranks else state["objective"])


class CheckpointManager:
    def __init__(self, plan, folder: Path, say, asked: dict | None = None):
        """asked: the settings the session's command gave (config.json's "asked", nested by section),
        sealed into each checkpoint: RESUME=1 takes them from here, never from an edited config.json."""
        self.plan, self.cfg, self.say, self.asked = plan, plan.cfg, say, asked
        # Rank 0 of a DDP run saves for all (every rank holds the same weights); with SHARDING
        # every rank writes its own shards (train/run/checkpoint/on_disk.py).
        self.sharding = self.cfg.system.sharding
        self.saves = plan.world.is_main or self.sharding != "none"
        self.manager = CheckpointFolder(folder, self.cfg.run.keep_checkpoints, say)
        self.effective = self.cfg.effective_batch_size(plan.world.world_size)
        self.saving_s: list[tuple[float, float]] = []
        self.others_saved: str | None = None  # ranks that do not write: the name rank 0 gave it
        self.stateful: dict = {}  # what a checkpoint holds (the module doc), from track()

    @property
    def last_saved(self) -> str | None:
        return self.manager.last_saved or self.others_saved

    def settings(self, oom_guard=None) -> dict:
        """What a later RESUME=1 compares. oom_guard: the OOM guard, whose micro-batch is the one trained
        now."""
        settings = {k: knobs.value(self.cfg, k) for k in COMPARED}
        if oom_guard is not None:  # smaller than the plan's after an out-of-memory
            settings.update(
                batch_size=oom_guard.batch_size, gradient_accumulation_steps=oom_guard.accumulation
            )
        settings.update(precision=self.plan.precision, num_workers=self.cfg.data.num_workers)
        settings.update(
            effective_batch_size=self.effective,
            model_size=self.plan.model_size,
            max_length=self.plan.max_length,
        )
        # what chose the model, for the changed-model message of a later RESUME=1
        settings.update(
            model_config=self.cfg.model.model_config, model_path=self.plan.summary_extra.get("model_path")
        )
        settings.update(model_family=self.cfg.model.model_family, tokenizer=self.tokenizer_digest())
        settings.update(data_path=self.cfg.data.data_path, tokenizer_path=self.cfg.data.tokenizer_path)
        return settings

    def tokenizer_digest(self) -> str | None:
        """What the token ids mean: a digest of the tokenizer's vocabulary and merges (not its
        padding or truncation state), so RESUME=1 can tell a tokenizer trained on other data
        (train/run/guard/resume_state.py). Computed once per run."""
        if not hasattr(self, "_tokenizer_digest"):
            self._tokenizer_digest = tokenizer_digest(getattr(self.plan, "tokenizer", None))
        return self._tokenizer_digest

    def data_identity(self) -> dict:
        ds = self.plan.dataset
        # T5: span corruption over the packed windows
        windows = getattr(getattr(ds, "dataset", ds), "windows", None)
        source = getattr(ds if windows is None else windows, "_source", None)
        return {
            "sequences": len(self.plan.dataset),
            "max_length": self.plan.max_length,
            "seed": self.cfg.system.seed,
            "source": Path(str(source[0])).name if source else type(self.plan.dataset).__name__,
        }

    def track(self, **stateful) -> None:
        """The objects a checkpoint holds (the module doc's list, by those names)."""
        self.stateful = stateful

    def restore(self, loaded, position: dict) -> None:
        """A loaded checkpoint's state into the tracked objects, RNG last (the weights are in
        the model already, checked on load); with none (a fresh run) the oom_guard only, at `position`.
        A sharded checkpoint's weights and optimizer state are read here, into the sharded model."""
        s = self.stateful
        if loaded is not None and self.sharding != "none":
            parallel.load_sharded(loaded.path / SHARDS, s["model"], s["optimizer"])
        elif loaded is not None:
            s["optimizer"].load_state_dict(loaded.optimizer)
            if s["scaler"].is_enabled() and loaded.scaler:
                s["scaler"].load_state_dict(loaded.scaler)
        s["oom_guard"].load_state_dict(position)
        if loaded is not None and "objective" in s:
            s["objective"].load_state_dict(loaded.objective)
        if loaded is not None:
            s["rng"].load_state_dict({"rng": loaded.rng, "rng_ranks": loaded.rng_ranks})

    def save(self, steps_done: int) -> None:
        """Save unless the model is unhealthy (a non-finite loss at this step or non-finite
        weights on any rank): a checkpoint must be one worth resuming from. Every rank calls
        it at the same step (the RNG states and counts are gathered); rank 0 writes, or with
        SHARDING every rank writes its shards."""
        s = self.stateful
        start = time.perf_counter()
        if process_group.max_across(self.plan.world, [int(not s["health"].worth_saving(s["model"]))])[0]:
            self.say(f"not saving at step {steps_done}: the loss or weights are non-finite")
            return
        rng = s["rng"].state_dict()  # collectives, on every rank in this order
        objective = s["objective"].state_dict() if "objective" in s else {}
        progress = s["progress"].state_dict()
        if not self.saves:
            self.others_saved = checkpoint_name(steps_done)  # as rank 0 will have it
            return
        record = {
            **progress,
            "data": {**s["oom_guard"].state_dict(), "identity": self.data_identity()},
            "sharding": self.sharding,
            "schedule": s["schedule"].state_dict(),
            "settings": self.settings(s["oom_guard"]),
            "counters": s["health"].state_dict(),
            **({"asked": self.asked} if self.asked is not None else {}),
        }
        sharded = self.sharding != "none"  # then the optimizer's state is in the shards
        state = {
            "optimizer": {} if sharded else s["optimizer"].state_dict(),
            "scaler": s["scaler"].state_dict(),
            **rng,
            **objective,
        }
        if sharded:
            self.manager.save_sharded(steps_done, s["model"], s["optimizer"], state, record, self.plan.world)
        else:
            self.manager.save(steps_done, s["model"], s["optimizer"], state, record)
        self.saving_s.append((start, time.perf_counter() - start))
        self.say(f"saved checkpoint {self.manager.last_saved} ({time.perf_counter() - start:.1f} s)")

    def seconds_saving_since(self, t0: float, t1: float = float("inf")) -> float:
        """Time spent saving inside the loop between t0 and t1 (left out of the throughput
        figures); the save at the end, after the loop's clock stopped, is not inside."""
        return sum(span for start, span in self.saving_s if t0 <= start < t1)
