"""transformers' Seq2SeqTrainer on the kit's T5 SFT plan (bench/peers.py seq2seq-t5-sft), as
ChatLM-mini-Chinese's sft_train.py trains its T5: Seq2SeqTrainer with DataCollatorForSeq2Seq
(each batch padded to its longest source and target, labels padded with -100, decoder inputs
from the labels), here on the kit's source -> target pairs as token ids (its template and
truncation), the kit run's batch, MAX_LENGTH, precision and optimizer (ChatLM's own is
Adafactor, the kit's default AdamW: the kit run's is used, bench/peer_side.py says how each
setting is matched).

    python bench/peer_seq2seq.py --kit DIR [--json F] [--profile F]
"""

from __future__ import annotations

import argparse

import peer_side


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer_side.add_args(p)
    a = p.parse_args()
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
    )

    s, examples, model_dir = peer_side.load_kit(a.kit)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = Seq2SeqTrainingArguments(**peer_side.training_kwargs(s, a.out, a.compile))
    collator = DataCollatorForSeq2Seq(tok, model=model, label_pad_token_id=-100)
    trainer = Seq2SeqTrainer(
        model=model,
        args=cfg,
        train_dataset=Dataset.from_list(examples),
        data_collator=collator,
        processing_class=tok,
    )
    ran = {
        "batch_size": s["batch_size"],
        "max_length": s["max_length"],
        "bf16": cfg.bf16,
        "fp16": cfg.fp16,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "torch_compile": cfg.torch_compile,
        "attn_implementation": model.config._attn_implementation,
        "optim": getattr(cfg.optim, "value", cfg.optim),
        "collator": "DataCollatorForSeq2Seq (longest in the batch)",
    }
    peer_side.run(trainer, s, "transformers Seq2SeqTrainer", ran, a, seq2seq=True)


if __name__ == "__main__":
    main()
