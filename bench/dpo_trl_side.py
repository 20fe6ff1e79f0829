"""TRL's side of bench/dpo_vs_trl.py: DPOTrainer (trl 1.16) on the same model folder, pairs, batch and
length as the kit's run, one thread, CPU; prints one JSON line with the steady pairs/s (the first
steps left out) and the losses. Runs in a scratch venv that has trl (never the kit's .venv):

    python3 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 transformers==5.23.0 trl==1.16.0
    /tmp/trlvenv/bin/python bench/dpo_trl_side.py MODEL_DIR PAIRS.jsonl --batch 8 --max_length 128 --steps 12
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("pairs")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--out", default="/tmp/trl-dpo-out")
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in open(a.pairs)]
    data = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    tok = AutoTokenizer.from_pretrained(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    cfg = DPOConfig(output_dir=a.out, per_device_train_batch_size=a.batch, gradient_accumulation_steps=1,
                    max_length=a.max_length, beta=a.beta, learning_rate=a.lr, max_steps=a.steps, logging_steps=1,
                    report_to="none", use_cpu=True, save_strategy="no", dataloader_num_workers=0, seed=0,
                    lr_scheduler_type="constant", warmup_steps=0)
    trainer = DPOTrainer(model=model, args=cfg, train_dataset=data, processing_class=tok, callbacks=[Clock()])
    trainer.train()
    steady = stamps[a.skip:]
    per_step = (steady[-1] - steady[0]) / (len(steady) - 1)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"pairs_per_sec": a.batch / per_step, "step_s": per_step, "losses": losses}))


if __name__ == "__main__":
    main()
