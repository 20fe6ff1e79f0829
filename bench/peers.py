"""The kit against its peers on the same model, data, lengths, batch and precision: this is the
kit's side, which hands a peer exactly what the kit's run trains on, then runs the peer.

    python bench/peers.py PEER --work DIR [--run KIT_RUN] [--json F] [--profile F] [--steps N]
                          [--peer-python PY] -- COMMAND FLAGS...

COMMAND FLAGS are the kit's own (`SHOW_COMMAND=1 ./train_sft_custom.sh` prints them after
`python -m train`). They are planned as a dry run plans them (train/run/plan: the same SFT or
preference cache, template, truncation, held-out split and resized vocabulary as the real run),
and DIR gets what the peer reads: model/ (the plan's model and tokenizer, chat tokens included),
examples.jsonl (the training examples as token ids, held-out ones left out; GRPO: the prompts, their
text and columns) and settings.json (batch, accumulation, MAX_LENGTH, precision, learning rate, weight
decay, clip, log interval, beta; GRPO: its "grpo" section). --run names the kit's run of those flags:
its decided batch, accumulation and precision (summary.json) are what the peer gets, so a batch the
kit chose at run time is matched too.

PEER (each a scratch environment's trainer, never the kit's requirements; bench/peer_wheels.sh
fetches them for a machine without an index):
  trl-sft-packed   TRL's SFTTrainer, packing=True (best-fit decreasing, padding-free rows)
  trl-sft-padfree  TRL's SFTTrainer, padding_free=True, one conversation per example
  trl-dpo          TRL's DPOTrainer (bench/dpo_trl_side.py --kit DIR)
  seq2seq-t5-sft   transformers' Seq2SeqTrainer on an encoder-decoder's source -> target pairs
  grpo-trl         TRL's GRPOTrainer (bench/grpo_trl_side.py --kit DIR): the prompts' token ids, their
                   columns, the sampling, loss and reward settings of the kit's GRPO plan
The peer prints one JSON line (bench/peer_side.py: steady real tokens/s over the steps after the
kit's warm-up share, peak memory, the settings it ran); --json writes it, --profile one step of
it under torch.profiler as train/tools/step_profile.py records the kit's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# peer -> (side script, its extra flags, the kit command it mirrors)
PEERS = {
    "trl-sft-packed": ("peer_sft.py", ["--packing"], "sft"),
    "trl-sft-padfree": ("peer_sft.py", [], "sft"),
    "trl-dpo": ("dpo_trl_side.py", [], "dpo"),
    "seq2seq-t5-sft": ("peer_seq2seq.py", [], "sft"),
    "grpo-trl": ("grpo_trl_side.py", [], "grpo"),
}


def examples_of(dataset):
    """The plan's training examples one by one: a packed dataset's rows give the examples they hold
    (PackedRows keeps them as .examples; a row read as a list is its examples)."""
    items = getattr(dataset, "examples", dataset)
    for i in range(len(items)):
        item = items[i]
        yield from (item if isinstance(item, list) else [item])


def grpo_prompts(plan):
    """GRPO's prompts as the plan holds them: each one's token ids, its text (the ids decoded: TRL's
    dataset rows key on it) and its columns (what the rewards read, e.g. the built-in task's answer)."""
    objective = plan.objective
    for i, ids in enumerate(objective.prompt_ids):
        _, columns = objective.for_rewards([i])
        yield {"prompt": plan.tokenizer.decode(ids), "prompt_ids": [int(t) for t in ids],
               **{k: v[0] for k, v in columns.items()}}


def grpo_settings(plan) -> dict:
    """The GRPO plan's loss knobs (GrpoKnobs), its sampling (TOP_P, TOP_K, the ids a completion stops
    at) and its rewards as REWARD_FUNCS resolved them (names, weights; REWARD_PATTERN, REWARD_LENGTH
    and whether the prompts are the built-in task's, whose pattern the format reward takes)."""
    import dataclasses

    objective, o = plan.objective, plan.cfg.optim
    sampling = objective.sampler.settings
    return {
        **dataclasses.asdict(objective.knobs), "top_p": sampling.top_p, "top_k": sampling.top_k,
        "eos_ids": list(objective.sampler.eos_ids), "reward_funcs": objective.rewards.names,
        "reward_weights": [r.weight for r in objective.rewards.rewards], "reward_pattern": o.reward_pattern,
        "reward_length": o.reward_length, "builtin_data": plan.cfg.data.data_path is None,
    }


def export(command: str, flags: list[str], work: Path, run: Path | None, steps: int, say) -> dict:
    """The dry-run plan of `python -m train COMMAND FLAGS` -> WORK/model, examples.jsonl, settings.json
    (with the peer's optimizer steps and the first ones its figures leave out, as the kit's meter)."""
    from train.config.flags import parse_training_args
    from train.core.model import unwrapped
    from train.run.loop.meter import steady_start
    from train.run.plan.build import build

    cfg = parse_training_args(command, [*flags, "--dry_run", "1"])
    plan = build(cfg, say)
    work.mkdir(parents=True, exist_ok=True)
    unwrapped(plan.model).save_pretrained(work / "model")
    plan.tokenizer.save_pretrained(work / "model")
    fields = ("prompt_ids", "chosen_ids", "rejected_ids") if command == "dpo" else ("input_ids", "labels")
    rows = (
        grpo_prompts(plan)
        if command == "grpo"
        else ({k: [int(t) for t in example[k]] for k in fields} for example in examples_of(plan.dataset))
    )
    n = 0
    with (work / "examples.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
            n += 1
    o, objective = plan.cfg.optim, plan.objective
    settings = {
        "command": command, "max_length": plan.max_length, "precision": plan.precision,
        "batch_size": o.batch_size, "gradient_accumulation_steps": o.gradient_accumulation_steps,
        "learning_rate": o.learning_rate, "weight_decay": o.weight_decay, "grad_clip": o.grad_clip,
        "optimizer": o.optimizer, "log_every": plan.cfg.run.log_every, "seed": plan.cfg.system.seed,
        "gradient_checkpointing": plan.cfg.model.gradient_checkpointing, "n_examples": n,
        "encoder_decoder": bool(getattr(plan.model.config, "is_encoder_decoder", False)),
        "beta": getattr(objective, "beta", None), "dpo_loss": getattr(objective, "loss_name", None),
        "steps": steps, "skip": steady_start(steps),
        **({"grpo": grpo_settings(plan)} if command == "grpo" else {}),
    }
    if run is not None:  # what the kit's run decided at run time wins over the dry run's plan
        summary = json.loads((run / "summary.json").read_text())
        settings.update({k: summary[k] for k in ("batch_size", "gradient_accumulation_steps", "precision")
                         if summary.get(k) is not None})
    (work / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")
    return settings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("peer", choices=sorted(PEERS))
    p.add_argument("--work", required=True, help="the folder the kit's plan is written to, for the peer")
    p.add_argument("--run", help="the kit's run of these flags (its summary.json's batch and precision win)")
    p.add_argument("--json", help="the peer's figures (one JSON object)")
    p.add_argument("--profile", help="one step of the peer under torch.profiler (step_profile's record)")
    p.add_argument(
        "--steps", type=int, default=30, help="optimizer steps the peer runs (the kit's parts: 30)"
    )
    p.add_argument("--peer-python", default=sys.executable, help="a Python with the peer (default: this one)")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after it, the kit's COMMAND FLAGS as they are
    a, kit = p.parse_args(argv[:cut]), argv[cut + 1 :]
    side, extra, command = PEERS[a.peer]
    if not kit or kit[0] != command:
        print(
            f"error: {a.peer} mirrors the kit's `{command}`; got {' '.join(kit[:1]) or 'no command'}",
            file=sys.stderr,
        )
        return 2
    run = Path(a.run) if a.run else None
    if run is not None and not (run / "summary.json").is_file():
        print(f"error: --run {run}: no summary.json (the kit's part did not finish)", file=sys.stderr)
        return 2
    work = Path(a.work)
    settings = export(command, kit[1:], work, run, a.steps, lambda line: print(line, flush=True))
    print(f"peers: {a.peer} on the kit's plan: {settings['n_examples']} examples, batch "
          f"{settings['batch_size']} x "
          f"{settings['gradient_accumulation_steps']}, MAX_LENGTH {settings['max_length']}, "
          f"{settings['precision']}",
          flush=True)
    argv = [a.peer_python, str(ROOT / "bench" / side), "--kit", str(work), *extra,
            *(["--json", a.json] if a.json else []), *(["--profile", a.profile] if a.profile else [])]
    return subprocess.run(argv).returncode


if __name__ == "__main__":
    sys.exit(main())
