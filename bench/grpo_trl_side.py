"""TRL 1.16's GRPOTrainer on the prompts bench/grpo_vs_trl.py wrote, run in a scratch venv with TRL (never the
kit's): the same model folder, NUM_GENERATIONS, completion length, learning rate, loss (dapo, BETA 0), the
kit's own built-in reward functions (imported from the kit: torch and re only), fp32 on the CPU with bf16 and
gradient checkpointing off. Prints one JSON line: each optimizer step's end time, the seconds spent in
_generate_and_score_completions (sampling, rewards, advantages: the kit's rollout) and in _generate (sampling
alone), and the completions' mean length.

    /tmp/venv-trl/bin/python bench/grpo_trl_side.py PROMPTS.json MODEL_DIR STEPS BATCH G LENGTH LR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(KIT))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from train.core.reward.builtin import accuracy, format_reward  # noqa: E402
from train.data.prompt.arithmetic import TASK_PATTERN  # noqa: E402


class Clock(TrainerCallback):
    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def timed(obj, name: str, box: list) -> None:
    """obj.name wrapped: each call's seconds appended to box."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            box.append(time.perf_counter() - start)

    setattr(obj, name, wrapper)


def main() -> None:
    prompts_file, model_dir, steps, batch, g, length, lr = sys.argv[1:8]
    steps, batch, g, length, lr = int(steps), int(batch), int(g), int(length), float(lr)
    records = json.loads(Path(prompts_file).read_text())
    data = Dataset.from_list(records)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tok.padding_side = "left"
    fmt = format_reward(TASK_PATTERN)
    fmt.__name__ = "format"
    args = GRPOConfig(
        output_dir=str(Path(prompts_file).parent / "trl-out"),
        per_device_train_batch_size=batch * g,
        num_generations=g,
        max_completion_length=length,
        learning_rate=lr,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        beta=0.0,
        loss_type="dapo",
        temperature=1.0,
        seed=1337,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=[accuracy, fmt], args=args, train_dataset=data,
                          processing_class=tok, callbacks=[clock])  # fmt: skip
    rollout, sampling = [], []
    timed(trainer, "_generate_and_score_completions", rollout)
    timed(trainer, "_generate", sampling)
    start = time.perf_counter()
    trainer.train()
    lengths = [
        r["completions/mean_length"] for r in trainer.state.log_history if "completions/mean_length" in r
    ]
    print(json.dumps({"start": start, "ends": clock.ends, "rollout_s": rollout, "sampling_s": sampling,
                      "mean_length": sum(lengths) / max(1, len(lengths))}))


if __name__ == "__main__":
    main()
