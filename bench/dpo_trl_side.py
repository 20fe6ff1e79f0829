"""TRL's side of bench/dpo_vs_trl.py: DPOTrainer (trl 1.16) on the same model folder, pairs, batch and
length as the kit's run, one thread, CPU; prints one JSON line with the per-step clocks (wall and this
process's CPU time), the real tokens of each step, the thread count and the losses. Runs in a scratch
venv that has trl (never the kit's .venv):

    python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 transformers==5.23.0
    trl==1.16.0 /tmp/trlvenv/bin/python bench/dpo_trl_side.py MODEL_DIR PAIRS.jsonl --batch 8 --max_length 192
    --steps 20

Set to do the kit's work, no more and no less (TRL's own defaults differ on a CPU):
- bf16=False: TrainingArguments' bf16 is None and TRL's base config turns None into True, so on a CPU
  every matmul ran under bf16 autocast, emulated without AMX (the 27x of the first run); the kit is fp32.
- gradient_checkpointing=False: TRL defaults it on (each layer's forward runs twice); the kit's is off.
- the prompt ends with eos, as the kit's TEMPLATE=none writes it (TRL adds eos to the replies only), so
  both sides train on the same token sequences; max_length leaves every pair whole on both sides.
- the same optimizer (fused AdamW, weight decay 0.1, clip 1.0), constant LR, dropout off (TRL's default,
  the kit's too), a log line every step on both sides. Tokenizing (dataset.map) is before train(), the
  kit's before its loop: neither is in the steady figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def kit_main() -> int:
    """TRL's DPOTrainer on bench/peers.py's export of the kit's plan."""
    import peer_side

    p = argparse.ArgumentParser(description="TRL's DPOTrainer on the kit's plan")
    peer_side.add_args(p)
    a = p.parse_args()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    s, examples, model_dir = peer_side.load_kit(a.kit)
    if s["dpo_loss"] not in TRL_LOSSES:
        print(f"error: DPO_LOSS={s['dpo_loss']}: TRL's DPOTrainer has no such loss ({', '.join(TRL_LOSSES)})")
        return 2

    class KitIds(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset  # already the kit's token ids: prompt_ids, chosen_ids, rejected_ids

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = DPOConfig(
        **peer_side.training_kwargs(s, a.out, a.compile),
        max_length=s["max_length"],
        beta=s["beta"],
        loss_type=[s["dpo_loss"]],
        disable_dropout=True,
        precompute_ref_log_probs=False,
    )
    trainer = KitIds(model=model, args=cfg, train_dataset=Dataset.from_list(examples), processing_class=tok)
    ran = {"batch_size": s["batch_size"], "max_length": s["max_length"], "bf16": cfg.bf16, "fp16": cfg.fp16,
           "gradient_checkpointing": cfg.gradient_checkpointing, "torch_compile": cfg.torch_compile,
           "reference": type(trainer.ref_model).__name__ + " (a frozen copy)", "beta": cfg.beta,
           "loss_type": cfg.loss_type, "attn_implementation": model.config._attn_implementation,
           "optim": getattr(cfg.optim, "value", cfg.optim)}
    peer_side.run(trainer, s, "TRL DPOTrainer", ran, a)
    return 0


TRL_LOSSES = ("sigmoid", "ipo", "hinge")


def main() -> None:
    if "--kit" in sys.argv:
        sys.exit(kit_main())
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("pairs")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max_length", type=int, default=192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--out", default="/tmp/trl-dpo-out")
    p.add_argument("--profile", help="write a torch.profiler table of steps 3-4 to this file")
    p.add_argument("--trl-defaults", action="store_true", help="keep TRL's bf16 and gradient checkpointing")
    p.add_argument("--compact-head", action="store_true",
                   help="diagnostic: score only the response positions in the LM head, as TRL does on "
                        "CUDA/XPU")
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    if a.compact_head:  # TRL compacts to labelled positions only where Triton runs; its tiles stay torch ops
        import trl.trainer.utils

        trl.trainer.utils._use_triton = lambda device: True

    tok = AutoTokenizer.from_pretrained(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rows = [json.loads(line) for line in open(a.pairs)]
    data = Dataset.from_list([{"prompt": r["prompt"] + tok.eos_token, "chosen": r["chosen"],
                               "rejected": r["rejected"]} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    wall: list[float] = []
    cpu: list[float] = []
    tokens: list[int] = []
    longest: list[int] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            wall.append(time.perf_counter())
            cpu.append(time.process_time())

    class Counted(DPOTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            mask = inputs["attention_mask"]
            tokens.append(int(mask.sum()))
            longest.append(int(mask.shape[1]))
            return super().training_step(model, inputs, *args, **kwargs)

    cfg = DPOConfig(
        output_dir=a.out,
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=1,
        max_length=a.max_length,
        beta=a.beta,
        learning_rate=a.lr,
        max_steps=a.steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=None if a.trl_defaults else False,
        gradient_checkpointing=a.trl_defaults,
        optim="adamw_torch_fused",
        weight_decay=0.1,
        max_grad_norm=1.0,
        disable_dropout=True,
        precompute_ref_log_probs=False,
        disable_tqdm=True,
    )
    trainer = Counted(model=model, args=cfg, train_dataset=data, processing_class=tok, callbacks=[Clock()])
    lengths = [len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"]))
               for r in trainer.train_dataset]
    if a.profile:
        profile_steps(trainer, a.profile)
        return
    trainer.train()
    print(
        json.dumps(
            {
                "wall": wall,
                "cpu": cpu,
                "tokens": tokens,
                "longest": longest,
                "threads": torch.get_num_threads(),
                "bf16": cfg.bf16,
                "gradient_checkpointing": cfg.gradient_checkpointing,
                "ref_model": type(trainer.ref_model).__name__,
                "optimizer": type(trainer.optimizer).__name__,
                "cut_pairs": sum(n > a.max_length for n in lengths),
                "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            }
        )
    )


def profile_steps(trainer, path: str) -> None:
    """torch.profiler over steps 3 and 4 (after two warm-up steps), its table by self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    prof = profile(activities=[ProfilerActivity.CPU])

    class Window(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                prof.__enter__()
            elif state.global_step == 4:
                prof.__exit__(None, None, None)

    trainer.add_callback(Window())
    trainer.args.max_steps = 4
    trainer.train()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
