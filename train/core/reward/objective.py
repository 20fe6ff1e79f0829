"""Reward training's objective (train/core/objective.py's protocol): a micro-batch of prompts becomes
NUM_GENERATIONS scored completions each under the current weights (rollout), then GRPO's clipped policy
loss (loss.grpo_loss) is each micro-batch's share of the step.

rollout is the one hook the shared step asks of an objective beyond the protocol's methods: train_step
calls it, where an objective has it, with the step's micro-batches of prompts before counting the step,
and trains on what it returns. Here it samples every micro-batch (sampling.Sampler), scores all the step's
completions at once with the rewards (guard.RewardSet), makes the group-relative advantages over the
whole step (SCALE_REWARDS=batch needs the step's, as TRL's generation batch), keeps the policy's
log-probs where NUM_ITERATIONS > 1 and the reference's where BETA > 0, and returns one scored micro-batch
per prompt micro-batch. With NUM_ITERATIONS = mu the same scored micro-batches serve mu optimizer steps
(the prompts fetched for the mu - 1 later steps are not sampled: TRL repeats a generation batch's prompts
mu times; here they are the stream's next ones, left unused). The seconds it takes are rollout_seconds,
which the meter reports apart (generation_frac), as it reports data wait.
Under DDP (`gather`, the plan's) the rewards and completion lengths of every rank are gathered first, as
TRL gathers them: the advantages are made over the whole generation batch and each rank keeps its own
slice (SCALE_REWARDS=batch divides by the std of all ranks' rewards), and the reward and completion
metrics are the whole batch's, the same on every rank.
state_dict() / load_state_dict() (a checkpoint's "objective" entry): what the steps of one generation
share (its scored micro-batches, the steps left on them, its metrics, the step count the rewards see),
so RESUME=1 from any step repeats the uninterrupted run.
Imports torch and train/core only."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from train.core.device import autocast
from train.core.reward.advantages import completion_metrics, group_advantages, loss_mask
from train.core.reward.guard import Logged, RewardSet, State
from train.core.reward.knobs import GrpoKnobs
from train.core.reward.logps import Completions, completion_logps, model_inputs, widen
from train.core.reward.loss import StepCounts, grpo_loss
from train.core.reward.sampling import Sampler

VAL_SEED = 1 << 32  # validation's generators, apart from the training ones (SEED + rank)
MADE = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"}
"""What _score makes of every micro-batch (the log-probs besides, as the knobs ask)."""


@dataclass
class GRPOObjective:
    """GRPO's loss over sampled, scored completions (the module doc); its sampler owns the draws' generator
    (generators(): a checkpoint's, so RESUME=1 draws what the uninterrupted run drew)."""

    rows_per_sample: ClassVar[int] = 1  # a prompt; its NUM_GENERATIONS rows are made by the rollout
    unit: ClassVar[str] = "prompts"
    trial_on_longest: ClassVar[bool] = True
    layout: object  # the model's family's Layout (train/models/family.py); GRPO trains causal LMs
    knobs: GrpoKnobs
    sampler: Sampler
    rewards: RewardSet
    prompt_ids: list[list[int]]
    """Every prompt's token ids, by the index the prompt batches carry."""
    for_rewards: Callable[[list[int], int], tuple[list, dict]]
    """(indices, repeat) -> (prompts, columns) as the rewards get them (PromptSet.for_rewards)."""
    reference: str | None = None
    """BETA > 0: copy (ref_model, made by the caller) or adapters (the policy with its LoRA off)."""
    ref_model: torch.nn.Module | None = None
    held_out: object | None = None
    """Validation's prompts (VAL_PATH's or VAL_FRACTION's PromptSet: ids, for_rewards), by their batches'
    index; None: no validation."""
    max_steps: int = 0
    device: torch.device = torch.device("cpu")
    precision: str = "fp32"
    widths: tuple[int, ...] | None = None
    """COMPILE's length buckets: each scored micro-batch's prompt + completion width is one of these
    (logps.widen); None: its own."""
    rollout_seconds: float = 0.0
    """Seconds spent in rollout so far (sampling, rewards, the extra log-prob passes), host clock."""
    gather: Callable[[torch.Tensor], tuple[torch.Tensor, int]] | None = None
    """Under DDP: a host tensor's rows from every rank in rank order, and where this rank's start
    (distributed.process_group.gather_rows); None: one process."""
    gather_names: Callable[[list[str]], list[str]] | None = None
    """Under DDP: the sorted union of every rank's names (distributed.process_group.gather_names)."""
    trained: list[int] = field(default_factory=lambda: [0, 0])
    """[real, padded] tokens the steps trained on so far (prompt + completion of every row, each step of a
    generation again): the meter's token count (tokens_per_sec, MFU of the training part), as TRL's
    num_tokens counts prompt and completion."""
    _cached: list | None = field(default=None, repr=False)
    _uses: int = 0
    _metrics: dict = field(default_factory=dict, repr=False)
    _steps: int = 0
    _micro: int = 1

    # the hook
    def rollout(self, model, micro_batches: list[dict]) -> list[dict]:
        """The step's scored micro-batches (the module doc), one per prompt micro-batch."""
        if self._cached is not None and self._uses < self.knobs.num_iterations:
            sizes = [len(b["index"]) * self.knobs.num_generations for b in micro_batches]
            held = [b["advantages"].shape[0] for b in self._cached]
            if sizes != held and sum(sizes) == sum(held):  # the OOM guard's smaller micro-batch since
                self._cached = regroup(self._cached, sizes)
            if sizes == held or sum(sizes) == sum(held):
                self._uses += 1
                self._steps += 1
                return self._count(self._cached)
            # a resumed run whose step holds another number of rows (BATCH_SIZE, accumulation or the
            # processes changed): the generation cannot serve it, a new one is sampled
            self._cached, self._uses = None, 0
        start = time.perf_counter()
        scored = self._score(model, micro_batches)
        self._cached, self._uses = scored, 1
        self._steps += 1
        self.rollout_seconds += time.perf_counter() - start
        return self._count(scored)

    def _count(self, scored: list[dict]) -> list[dict]:
        for b in scored:  # host masks: no sync
            self.trained[0] += int(b["prompt_mask"].sum()) + int(b["completion_mask"].sum())
            self.trained[1] += b["prompt_mask"].numel() + b["completion_mask"].numel()
        return scored

    def _score(self, model, micro_batches: list[dict], everyone: bool = True) -> list[dict]:
        g = self.knobs.num_generations
        rolls = [self.sampler.sample(model, [self.prompt_ids[i] for i in b["index"].tolist()])
                 for b in micro_batches]  # fmt: skip
        index = [i for b in micro_batches for i in b["index"].tolist()]
        prompts, columns = self.for_rewards(index, g)
        texts = [t for r in rolls for t in r.texts]
        ids = [
            row[:n]
            for r in rolls
            for row, n in zip(r.completion_ids.tolist(), r.lengths.tolist(), strict=True)
        ]
        scores = self.rewards.score(prompts, texts, ids, columns, State(self._steps, self.max_steps))
        lengths = torch.cat([r.lengths.cpu() for r in rolls])
        truncated = torch.cat([r.is_truncated.cpu() for r in rolls])
        scores, lengths, truncated, mine = self._whole_batch(scores, lengths, truncated, everyone)
        advantages, metrics = group_advantages(scores, self.rewards.names, self.knobs)
        advantages = advantages[mine]
        metrics.update(completion_metrics(lengths, truncated))
        self._metrics = metrics
        out, at = [], 0
        for roll in rolls:
            rows = roll.completion_ids.shape[0]
            batch = {
                "prompt_ids": roll.prompt_ids.cpu(),
                "prompt_mask": roll.prompt_mask.cpu(),
                "completion_ids": roll.completion_ids.cpu(),
                "completion_mask": loss_mask(roll.completion_mask.cpu(), roll.is_truncated.cpu(), self.knobs),
                "advantages": advantages[at : at + rows],
            }
            at += rows
            out.append(self._kept(model, batch))
        return out

    def _whole_batch(self, scores, lengths, truncated, everyone: bool):
        """(scores, lengths, truncated) of every rank's completions and the slice of them that is this
        rank's: one host gather (TRL gathers them too: a group lives on one rank, but the batch std and the
        logged figures are the whole batch's). Validation stays each rank's own (`everyone` False): its
        batches need not be as many on every rank."""
        if self.gather is None or not everyone:
            return scores, lengths, truncated, slice(None)
        rows = torch.cat([scores.float(), lengths[:, None].float(), truncated[:, None].float()], dim=1)
        every, start = self.gather(rows)
        whole = every[:, :-2].contiguous(), every[:, -2].long(), every[:, -1].bool()
        return (*whole, slice(start, start + rows.shape[0]))

    def _kept(self, model, batch: dict) -> dict:
        """The scored batch widened to its length bucket, with the log-probs the loss will read: the
        policy's where NUM_ITERATIONS > 1, the reference's where BETA > 0."""
        if self.widths is not None:
            batch = widen(batch, self.widths, self.sampler.pad_id)
        if self.knobs.num_iterations > 1:
            batch["old_per_token_logps"] = self._logps(model, batch)
        if self.knobs.beta != 0.0:
            batch["ref_per_token_logps"] = self._reference_logps(model, batch)
        return batch

    @property
    def length_varies(self) -> bool:
        """COMPILE: the forward's widths are the length buckets' (one graph, its lengths dynamic)."""
        return self.widths is not None

    def trial_batch(self, model, batch: dict) -> dict:
        """COMPILE's trial step (train/run/compile/wrapper.py) from a batch of prompts: its NUM_GENERATIONS
        rows with completions as long as MAX_COMPLETION_LENGTH allows, every token kept, advantages 0, and
        the log-probs the rollout keeps, through `model` as the rollout makes them: the trial compiles every
        forward training calls (the no-grad one of NUM_ITERATIONS > 1 too). Nothing is sampled or scored,
        so the sampler's generator and the rewards' state are untouched."""
        g, room = self.knobs.num_generations, self.knobs.max_completion_length
        ids = batch["input_ids"].repeat_interleave(g, 0)
        rows = ids.shape[0]
        scored = {
            "prompt_ids": ids,
            "prompt_mask": batch["attention_mask"].repeat_interleave(g, 0),
            "completion_ids": torch.full((rows, room), self.sampler.pad_id, dtype=torch.long),
            "completion_mask": torch.ones((rows, room), dtype=torch.long),
            "advantages": torch.zeros(rows),
        }
        return self._kept(model, scored)

    def _logps(self, model, batch: dict) -> torch.Tensor:
        """Per-token log-probs under `model`, no gradient, on the host (the loss moves them)."""
        where = Completions.of(batch).to(self.device)
        with torch.no_grad(), autocast(self.device, self.precision):
            logps, _ = completion_logps(
                model, model_inputs(batch, self.device), where, self.knobs.temperature
            )
        return logps.float().cpu()

    def _reference_logps(self, model, batch: dict) -> torch.Tensor:
        if self.reference == "adapters":
            from train.core.preference.reference import adapters_off

            with adapters_off(model) as base:
                return self._logps(base, batch)
        if self.ref_model is None:
            raise ValueError(f"BETA={self.knobs.beta}: no reference model (REFERENCE)")
        return self._logps(self.ref_model, batch)

    # the protocol
    def counts(self, micro_batches) -> tuple[int, int]:
        self._micro = len(micro_batches)
        sequences = sum(b["completion_mask"].shape[0] for b in micro_batches)
        return sequences, sum(int(b["completion_mask"].sum()) for b in micro_batches)  # host masks: no sync

    def loss(self, model, batch, device, precision, counts, world_size: int = 1, accuracy: bool = False):
        step = StepCounts(counts[0], counts[1], self._micro)
        return grpo_loss(model, batch, device, precision, step, world_size, knobs=self.knobs)

    def returned(self, sums: dict) -> dict:
        """The loss's metrics summed over the micro-steps (device tensors), then the rollout's (host floats,
        put on the device: a copy, no sync), in one order every step. A name a reward logs that the kit's
        own figures use (reward, kl, ...) is kept apart as log_metric/<name>."""
        taken = set(self._metrics) | set(sums)
        logged = {f"log_metric/{k}" if k in taken else k: v for k, v in self._reward_logged().items()}
        figures = {**self._metrics, **logged}
        host = {k: torch.tensor(v, dtype=torch.float32, device=self.device) for k, v in figures.items()}
        return {**host, **sums}

    def _reward_logged(self) -> dict[str, float]:
        """What the rewards logged with log_metric since the last log line, each name's mean over its calls
        (over every rank's calls with several processes, as TRL averages them: the names gathered first,
        so that every rank reports the same figures in the same order)."""
        logged = self.rewards.logged
        names = sorted(logged.metrics)
        if self.gather_names is not None:
            names = self.gather_names(names)
        sums, counts = logged.take_totals(names)
        if self.gather is not None and names:
            every, _ = self.gather(torch.tensor([sums + counts], dtype=torch.float64))
            total = every.sum(0).tolist()
            sums, counts = total[: len(names)], total[len(names) :]
        return {n: s / c for n, s, c in zip(names, sums, counts, strict=True) if c}

    def named(self, returned: dict) -> dict:
        return returned

    def samples(self, batch: dict) -> int:
        return int(batch["index"].numel())

    def shown(self, row: dict) -> str:
        return (f"reward {row['reward']:.3f} reward_std {row['reward_std']:.3f} "
                f"len {row['completions/mean_length']:.1f}")

    def evaluate(self, model, batch: dict, device, precision: str):
        """Held-out prompts sampled and scored under the current weights, no gradient: (prompts, the policy
        loss, the reward metrics). A view of this objective on the held-out prompts does it, drawing from a
        generator of its own seeded SEED + VAL_SEED + the batch's first prompt: the training draws (the
        sampler's generator, a checkpoint's) are untouched, and every pass draws alike (RESUME=1 too), so
        passes differ by the weights alone. NUM_ITERATIONS is 1 there: with no step between the sampling
        and the loss the old log-probs are the policy's own, and their extra forward is saved."""
        if self.held_out is None:
            raise ValueError("evaluate: no held-out prompts (VAL_PATH or VAL_FRACTION)")
        sampler = copy.copy(self.sampler)
        sampler.generator = torch.Generator(device=sampler.device)
        sampler.generator.manual_seed(sampler.seed + VAL_SEED + int(batch["index"][0]))
        # its own log of what the rewards log_metric (not the training's next log line), its own token count
        rewards = replace(self.rewards, logged=Logged())
        view = replace(self, sampler=sampler, knobs=replace(self.knobs, num_iterations=1), rewards=rewards,
                       trained=[0, 0],
                       prompt_ids=self.held_out.ids, for_rewards=self.held_out.for_rewards, _cached=None,
                       _metrics={})  # fmt: skip
        with torch.no_grad():
            scored = view._score(model, [batch], everyone=False)
            loss, _ = view.loss(model, scored[0], device, precision, view.counts(scored))
        metrics = {k: torch.tensor(v, dtype=torch.float32) for k, v in view._metrics.items()
                   if k == "reward" or k.startswith("rewards/")}  # fmt: skip
        return view.samples(batch), loss, metrics

    def perplexity(self, loss: float | None) -> None:
        return None

    def eval_shown(self, loss: float, metrics: dict) -> str:
        reward = metrics.get("reward")
        return "" if reward is None else f"val_reward {float(reward):.3f}"

    def kept(self, metrics: dict) -> dict:
        return {
            k: v
            for k, v in metrics.items()
            if k.startswith(("reward", "rewards/", "completions/mean_length"))
        }

    def describe(self) -> str:
        return (f"GRPO loss (LOSS_TYPE={self.knobs.loss_type}, {self.knobs.num_generations} completions per "
                f"prompt)")

    def generators(self) -> dict[str, torch.Generator]:
        """The random-number generators this objective draws from, by name (a checkpoint keeps their
        state)."""
        return {"sampler": self.sampler.generator}

    def state_dict(self) -> dict:
        """What one generation's steps share, for a checkpoint (plain values and host tensors): the step
        count, the last generation's metrics, and, where steps of it are left (NUM_ITERATIONS > 1 and the
        checkpoint mid-generation), its scored micro-batches and how many steps used them."""
        live = self._cached is not None and self._uses < self.knobs.num_iterations
        logged = {k: list(v) for k, v in self.rewards.logged.metrics.items() if v}
        return {"steps": self._steps, "metrics": dict(self._metrics), "uses": self._uses if live else 0,
                "cached": [dict(b) for b in self._cached] if live else [], "logged": logged}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state_dict(); ValueError, before anything changes, where it is malformed. Scored
        micro-batches the knobs no longer fit (BETA set since, and no reference log-probs) are dropped:
        the next step samples a new generation."""
        steps, uses, metrics, cached = (state.get(k) if isinstance(state, dict) else None
                                        for k in ("steps", "uses", "metrics", "cached"))  # fmt: skip
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (steps, uses)):
            raise ValueError("the objective's steps and uses are not counts")
        if not isinstance(metrics, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) for k, v in metrics.items()
        ):
            raise ValueError("the objective's metrics are not numbers by name")
        if not isinstance(cached, list) or not all(
            isinstance(b, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in b.items())
            for b in cached
        ):
            raise ValueError("the objective's scored micro-batches are not tensors by name")
        if any(not MADE <= set(b) for b in cached):
            raise ValueError("the objective's scored micro-batches lack their completions or advantages")
        if (uses > 0) != bool(cached):
            raise ValueError(f"the objective holds {len(cached)} scored micro-batches used by {uses} steps")
        logged = state.get("logged", {})  # what the rewards logged since the last log line (absent: older)
        if not isinstance(logged, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)
            for k, v in logged.items()
        ):
            raise ValueError("the objective's logged reward metrics are not lists of numbers by name")
        needed = {"old_per_token_logps"} if self.knobs.num_iterations > 1 else set()
        needed |= {"ref_per_token_logps"} if self.knobs.beta != 0.0 else set()
        fits = bool(cached) and all(needed <= set(b) for b in cached)
        self._steps, self._metrics = steps, dict(metrics)
        self._cached, self._uses = (cached, uses) if fits else (None, 0)
        self.rewards.logged.metrics.clear()
        self.rewards.logged.metrics.update({k: list(v) for k, v in logged.items()})

    def load_progress(self, state: dict) -> None:
        """The step count and last metrics of a state saved by another number of processes: its generation
        belongs to another split of the prompts, not taken (ValueError as load_state_dict's)."""
        if not isinstance(state, dict):
            raise ValueError("the objective's state is not a dict")
        self.load_state_dict({**state, "uses": 0, "cached": [], "logged": {}})


LEFT_PADDED = ("prompt_ids", "prompt_mask")  # a prompt sits at the right end of its row


def regroup(batches: list[dict], sizes: list[int]) -> list[dict]:
    """Scored micro-batches cut again into micro-batches of `sizes` rows (a generation the OOM guard's
    smaller micro-batch reuses): every field's rows side by side, the narrower ones padded where their
    mask says nothing (prompts on the left, completions and their log-probs on the right: inert)."""
    if sum(sizes) != sum(b["advantages"].shape[0] for b in batches):
        raise ValueError(f"regroup: {sum(sizes)} rows asked of a generation of another size")
    whole = {}
    for key in batches[0]:
        parts = [b[key] for b in batches]
        if parts[0].dim() == 2:
            width = max(p.shape[1] for p in parts)
            pad = [(width - p.shape[1], 0) if key in LEFT_PADDED else (0, width - p.shape[1]) for p in parts]
            parts = [torch.nn.functional.pad(p, where) for p, where in zip(parts, pad, strict=True)]
        whole[key] = torch.cat(parts)
    return [{k: v.split(sizes)[i] for k, v in whole.items()} for i in range(len(sizes))]
