"""TRL 1.16's GRPOTrainer on the prompts bench/grpo_vs_trl.py wrote, run in a scratch venv with TRL (never the
kit's): the same model folder, NUM_GENERATIONS, completion length, learning rate, loss (dapo, BETA 0), the
kit's own built-in reward functions (imported from the kit: torch and re only), fp32 on the CPU with bf16 and
gradient checkpointing off. Prints one JSON line: each optimizer step's end time, the seconds spent in
_generate_and_score_completions (sampling, rewards, advantages: the kit's rollout) and in _generate (sampling
alone), and the completions' mean length.

    /tmp/venv-trl/bin/python bench/grpo_trl_side.py PROMPTS.json MODEL_DIR STEPS BATCH G LENGTH LR

--kit DIR (bench/peers.py grpo-trl, the GPU report's grpo-trl part): GRPOTrainer on the kit's GRPO plan as
bench/peers.py exported it, through bench/peer_side.py (precision, batch, optimizer, the steady-state clock,
peak memory, one profiled step): the plan's model, its prompts' token ids (TRL's _tokenize_prompts answers
with them, so both sides sample after the same tokens), BATCH_SIZE prompts x NUM_GENERATIONS rows per
micro-batch, MAX_COMPLETION_LENGTH, TEMPERATURE, TOP_P, TOP_K, the ids a completion stops at (the
generation config's eos), the loss knobs, dropout off, and REWARD_FUNCS as the kit resolved them, its own
functions (train/run/plan/reward_funcs.py). No vLLM: transformers' generate(), as TRL runs without it. Adds
to peer_side's figures: generation_frac (the steady steps' share in _generate_and_score_completions: sampling,
rewards, advantages, as the kit's rollout), the completions' mean length, and tokens counted as the kit's
meter counts GRPO's: completion tokens (completion_mask), samples as prompts.

    python bench/grpo_trl_side.py --kit DIR [--json F] [--profile F]
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


class Generations:
    """TRL's _generate_and_score_completions counted, per call: the optimizer step it serves (global_step
    at the call), prompts, completion tokens (completion_mask), completion slots, and its seconds."""

    def __init__(self, g: int):
        self.g, self.calls = g, []

    def install(self, trainer) -> None:
        inner = trainer._generate_and_score_completions

        def counted(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            mask = out["completion_mask"]
            real = int(mask.sum())  # a host read: TRL's own decode of the completions already waited
            self.calls.append((trainer.state.global_step, mask.shape[0] // self.g, real, mask.numel(),
                               time.perf_counter() - start))  # fmt: skip
            return out

        trainer._generate_and_score_completions = counted

    def _between(self, skip: int, steps: int) -> list[tuple]:
        return [c for c in self.calls if skip <= c[0] < steps]

    def steady(self, skip: int, steps: int, accum: int) -> list[tuple[int, int, int]]:
        """(prompts, completion tokens, completion slots) of the generations of steps skip+1 .. steps."""
        return [c[1:4] for c in self._between(skip, steps)]

    def figures(self, s: dict, result: dict) -> dict:
        calls = self._between(s["skip"], s["steps"])
        span = result["step_time_ms"] * result["steady_state_steps"] / 1000
        rows, tokens = sum(c[1] for c in calls) * self.g, sum(c[2] for c in calls)
        return {"generation_s": sum(c[4] for c in calls), "generation_frac": sum(c[4] for c in calls) / span,
                "completion_mean_length": tokens / rows if rows else None, "generations": len(calls)}


def kit_main() -> int:
    """TRL's GRPOTrainer on bench/peers.py's export of the kit's GRPO plan (the module doc)."""
    import argparse

    import peer_side

    from train.run.plan.reward_funcs import build_rewards

    p = argparse.ArgumentParser(description="TRL's GRPOTrainer on the kit's GRPO plan")
    peer_side.add_args(p)
    a = p.parse_args()
    s, examples, model_dir = peer_side.load_kit(a.kit)
    g = s["grpo"]
    rewards = build_rewards(",".join(g["reward_funcs"]), g["reward_weights"],
                            pattern=g["reward_pattern"] or "", length=g["reward_length"] or 0,
                            builtin_data=g["builtin_data"])  # fmt: skip
    funcs = [r.fn for r in rewards.rewards]
    ids = {e["prompt"]: e["prompt_ids"] for e in examples}

    class KitPrompts(GRPOTrainer):
        def _tokenize_prompts(self, prompts: list):
            return [list(ids[p]) for p in prompts], None, {}  # the kit's ids, no images, no extra fields

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = list(g["eos_ids"])  # TRL stops at these and the tokenizer's eos
    tok = AutoTokenizer.from_pretrained(model_dir)
    n = g["num_generations"]
    cfg = GRPOConfig(
        **peer_side.training_kwargs({**s, "batch_size": s["batch_size"] * n}, a.out, a.compile),
        num_generations=n, max_completion_length=g["max_completion_length"], temperature=g["temperature"],
        top_p=g["top_p"], top_k=g["top_k"], loss_type=g["loss_type"], beta=g["beta"], epsilon=g["epsilon"],
        epsilon_high=g["epsilon_high"], delta=g["delta"], scale_rewards=g["scale_rewards"],
        importance_sampling_level=g["importance_sampling_level"], num_iterations=g["num_iterations"],
        mask_truncated_completions=g["mask_truncated_completions"],
        multi_objective_aggregation=g["multi_objective_aggregation"],
        sapo_temperature_pos=g["sapo_temperature_pos"], sapo_temperature_neg=g["sapo_temperature_neg"],
        use_bias_correction_kl=g["use_bias_correction_kl"], reward_weights=g["reward_weights"],
        disable_dropout=True, use_vllm=False, log_completions=False,
    )  # fmt: skip
    data = Dataset.from_list([{k: v for k, v in e.items() if k != "prompt_ids"} for e in examples])
    trainer = KitPrompts(model=model, reward_funcs=funcs, args=cfg, train_dataset=data,
                         processing_class=tok)  # fmt: skip
    ran = {"batch_size": s["batch_size"], "num_generations": n, "rows": cfg.per_device_train_batch_size,
           "max_completion_length": cfg.max_completion_length, "max_length": s["max_length"],
           "bf16": cfg.bf16, "fp16": cfg.fp16, "gradient_checkpointing": cfg.gradient_checkpointing,
           "torch_compile": cfg.torch_compile, "use_vllm": cfg.use_vllm, "loss_type": cfg.loss_type,
           "beta": cfg.beta, "temperature": cfg.temperature, "eos_ids": trainer.eos_token_ids,
           "reward_funcs": rewards.names, "attn_implementation": model.config._attn_implementation,
           "optim": getattr(cfg.optim, "value", cfg.optim)}  # fmt: skip
    counting = Generations(n)
    peer_side.run(trainer, s, "TRL GRPOTrainer", ran, a, counting=counting,
                  extra=lambda result: counting.figures(s, result))  # fmt: skip
    return 0


def main() -> None:
    if "--kit" in sys.argv:
        sys.exit(kit_main())
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
