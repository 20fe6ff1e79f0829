"""What every peer side shares (bench/peer_sft.py, bench/peer_seq2seq.py, bench/dpo_trl_side.py --kit,
bench/grpo_trl_side.py --kit): the kit's plan as bench/peers.py wrote it, the training arguments that
make a peer do the kit's work, and the figures, taken the way the kit's meter takes them. Runs in the
peer's Python (a scratch venv, or the GPU machine's with the carried wheels); imports nothing of train/
but step_profile's global optimizer-step hook (torch alone; GRPO's side also the kit's rewards).

Set to do the kit's work, no more and no less (the trainers' own defaults differ):
- precision: the kit run's. bf16 / fp16 autocast on CUDA; fp32 on a CPU. TRL's configs turn
  bf16=None into True, also on a CPU without bf16 hardware: set explicitly (bench/RESULTS.md,
  "Preference training against TRL": a first CPU comparison that kept it was 13-27x off).
- gradient checkpointing: the kit run's (off by default); TRL defaults it on.
- batch, accumulation, learning rate, weight decay, clip, log interval: the kit run's; fused AdamW
  for the kit's adamw (adafactor: transformers' Adafactor), a constant learning rate (the schedule
  costs nothing either way); DataLoader in the training process (the GPU report's kit parts run
  NUM_WORKERS=0); no evaluation, no checkpoint.
- torch.compile: the peer's default (off), as a user of the peer runs it; --compile turns it on.

Figures: real tokens (attention_mask, or every position of a padding-free row; an encoder-decoder
adds its labels that are not -100) and samples counted in the collator, on the host; time from the
end of optimizer step `skip` to the end of the last one, a device sync at both ends only (the
kit's meter also leaves its first steps out: train/run/loop/meter.py steady_start, the count
bench/peers.py wrote); peak memory is torch.cuda.max_memory_allocated, as the kit's peak_vram_mb.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OPTIM = {
    "adamw": "adamw_torch_fused",
    "adafactor": "adafactor",
    "adafactor_relative": "adafactor",
    "sgd": "sgd",
}


def load_kit(folder: str) -> tuple[dict, list[dict], str]:
    """(settings, examples as token ids, the model folder) from bench/peers.py's export."""
    kit = Path(folder)
    settings = json.loads((kit / "settings.json").read_text())
    examples = [json.loads(line) for line in (kit / "examples.jsonl").read_text().splitlines()]
    return settings, examples, str(kit / "model")


def cuda() -> bool:
    return torch.cuda.is_available()


def training_kwargs(s: dict, out: str, compile_: bool = False) -> dict:
    """transformers.TrainingArguments fields (TRL's configs extend them) for the kit run's settings `s`."""
    precision = s["precision"] if cuda() else "fp32"
    return dict(
        output_dir=out, per_device_train_batch_size=s["batch_size"],
        gradient_accumulation_steps=s["gradient_accumulation_steps"], max_steps=s["steps"],
        learning_rate=s["learning_rate"], weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"] or 0.0,
        optim=OPTIM.get(s["optimizer"], "adamw_torch_fused"), lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=s["log_every"], bf16=precision == "bf16", fp16=precision == "fp16",
        gradient_checkpointing=bool(s["gradient_checkpointing"]), torch_compile=compile_, use_cpu=not cuda(),
        dataloader_num_workers=0, report_to="none", save_strategy="no", eval_strategy="no", seed=s["seed"],
        disable_tqdm=True,
    )


def count_tokens(batch: dict, seq2seq: bool) -> tuple[int, int, int]:
    """(samples, real tokens, padded tokens) of one collated batch, on the host."""
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    real, padded = (int(mask.sum()) if mask is not None else ids.numel()), ids.numel()
    if seq2seq:
        labels = batch["labels"]
        real, padded = real + int((labels != -100).sum()), padded + labels.numel()
    if "cu_seq_lens_q" in batch:  # padding-free: one row of several sequences
        samples = batch["cu_seq_lens_q"].numel() - 1
    elif "completion_mask" in batch:  # TRL's preference batch: the chosen rows, then the rejected ones
        samples = ids.shape[0] // 2
    else:
        samples = ids.shape[0]
    return samples, real, padded


class Counting:
    """The trainer's collator, counting each batch it makes (in order: batch i is micro-step i)."""

    def __init__(self, collate, seq2seq: bool):
        self.collate, self.seq2seq, self.counts = collate, seq2seq, []

    def __call__(self, examples):
        batch = self.collate(examples)
        self.counts.append(count_tokens(batch, self.seq2seq))
        return batch

    def install(self, trainer) -> None:
        trainer.data_collator = self

    def steady(self, skip: int, steps: int, accum: int) -> list[tuple[int, int, int]]:
        """The counts of optimizer steps skip+1 .. steps (accum micro-steps each)."""
        return self.counts[skip * accum : steps * accum]


def run(trainer, s: dict, trainer_name: str, settings_ran: dict, args, seq2seq: bool = False,
        counting=None, extra=None) -> dict:
    """Train `trainer` for s["steps"] optimizer steps; its figures (see the module doc), printed as
    one JSON line and written to args.json; args.profile gets step 2 under torch.profiler. counting:
    what counts the samples and tokens (install(trainer), steady(skip, steps, accum); default: the
    collator's Counting); extra(result): figures of the peer's own, added to the result."""
    from transformers import TrainerCallback

    sys.path.insert(0, str(ROOT))  # step_profile's hook: torch alone, the kit's own record format
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from train.tools.step_profile import OneStep

    skip, stamps = s["skip"], {}

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step in (skip, s["steps"]):
                if cuda():
                    torch.cuda.synchronize()
                stamps[state.global_step] = time.perf_counter()

    counting = counting or Counting(trainer.data_collator, seq2seq)
    counting.install(trainer)
    trainer.add_callback(Clock())
    hook = OneStep(2) if args.profile else None
    handle = register_optimizer_step_post_hook(hook) if hook else None
    if cuda():
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.train()
    finally:
        if handle:
            handle.remove()
    accum = s["gradient_accumulation_steps"]
    steady = counting.steady(skip, s["steps"], accum)
    span = stamps[s["steps"]] - stamps[skip]
    steps = s["steps"] - skip
    samples, real, padded = (sum(c[i] for c in steady) for i in range(3))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {
        "trainer": trainer_name,
        "versions": versions(),
        "device": torch.cuda.get_device_name(0) if cuda() else "cpu",
        "settings": settings_ran,
        "steps": s["steps"],
        "steady_state_steps": steps,
        "tokens_per_sec": real / span,
        "samples_per_sec": samples / span,
        "step_time_ms": 1000 * span / steps,
        "padding_efficiency": real / padded if padded else None,
        "peak_vram_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda() else None,
        "vram_total_mb": torch.cuda.get_device_properties(0).total_memory / 2**20 if cuda() else None,
        "final_loss": losses[-1] if losses else None,
        "threads": torch.get_num_threads(),
    }
    result.update(extra(result) if extra else {})
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.profile:
        record = hook.result or {"step": 2, "error": f"the run ended after {hook.done} optimizer step(s)"}
        Path(args.profile).write_text(json.dumps({"command": trainer_name, **record}, indent=1) + "\n")
    return result


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "trl", "datasets", "accelerate"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def add_args(p) -> None:
    """The flags every side takes from bench/peers.py."""
    p.add_argument(
        "--kit", required=True, help="the folder bench/peers.py wrote (model/, examples, settings)"
    )
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--profile", help="step 2 under torch.profiler, as train/tools/step_profile.py records it")
    p.add_argument("--compile", action="store_true", help="the trainer's torch_compile (off by default)")
    p.add_argument("--out", default="/tmp/peer-out", help="the trainer's output_dir (nothing is saved)")
