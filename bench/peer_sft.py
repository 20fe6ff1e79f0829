"""TRL's SFTTrainer on the kit's plan (bench/peers.py trl-sft-packed / trl-sft-padfree): the same
model (resized vocabulary and chat template included), the same conversations as token ids with
the kit's labels (-100 outside the replies; TRL keeps a given "labels" column as it is), the same
MAX_LENGTH, batch and precision (bench/peer_side.py says how each setting is matched).

--packing: TRL's packing=True, packing_strategy="bfd" (best-fit decreasing into rows of MAX_LENGTH,
which turns padding_free on: the rows of a batch flattened into one, position_ids restarting per
conversation), against the kit's PACKING=1 with the same rows per batch. Without it: padding_free=True,
one conversation per example, BATCH_SIZE of them flattened into one row per step, against the kit's
one-conversation-per-row runs (LENGTH_GROUPING=1). Attention is the model's default implementation
(sdpa: transformers finds the conversations from position_ids); flash_attention_2 where the flash_attn
package is installed, as TRL's docs advise for padding-free rows.

    python bench/peer_sft.py --kit DIR [--packing] [--json F] [--profile F]
"""

from __future__ import annotations

import argparse
import importlib.util

import peer_side


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer_side.add_args(p)
    p.add_argument("--packing", action="store_true", help="packing=True (bfd) instead of padding-free "
                                                          "examples")
    a = p.parse_args()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    s, examples, model_dir = peer_side.load_kit(a.kit)
    flash = peer_side.cuda() and s["precision"] in ("bf16", "fp16") and importlib.util.find_spec("flash_attn")
    attn = "flash_attention_2" if flash else None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = SFTConfig(
        **peer_side.training_kwargs(s, a.out, a.compile),
        packing=a.packing,
        packing_strategy="bfd",
        padding_free=True,
        max_length=s["max_length"] if a.packing else None,
        dataset_num_proc=None,
    )
    trainer = SFTTrainer(
        model=model, args=cfg, train_dataset=Dataset.from_list(examples), processing_class=tok
    )
    ran = {
        "packing": "bfd" if a.packing else False,
        "padding_free": True,
        "batch_size": s["batch_size"],
        "max_length": s["max_length"],
        "bf16": cfg.bf16,
        "fp16": cfg.fp16,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "torch_compile": cfg.torch_compile,
        "attn_implementation": model.config._attn_implementation,
        "optim": getattr(cfg.optim, "value", cfg.optim),
        "train_rows": len(trainer.train_dataset),
    }
    peer_side.run(trainer, s, "TRL SFTTrainer", ran, a)


if __name__ == "__main__":
    main()
