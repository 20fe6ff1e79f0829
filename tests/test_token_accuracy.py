"""mean_token_accuracy (issue 27, item 9; TRL logs it): the share of trained tokens whose argmax
prediction is the label, after the causal shift (a T5: its decoder labels). It equals a plain
forward's on every loss path (chunked, transformers' own, packed, T5), is counted on the device
without a host sync, and a real SFT run's metrics row holds the recomputed value."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from conftest import read_jsonl, run_cli, tiny_model
from train.core import step
from train.core.loss import chunked_cross_entropy, lm_hidden_and_head, shift_targets
from train.core.measure.syncs import HostSyncs
from train.core.units import IGNORE_INDEX
from train.data.chat.batching import PadCollator
from train.data.chat.packing import SDPA, PackedCollator, PackedRows, pack
from train.models.family import CAUSAL_LM, ENCODER_DECODER

CPU = torch.device("cpu")


def plain_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    trained = targets != IGNORE_INDEX
    return int(((logits.argmax(-1) == targets) & trained).sum()) / int(trained.sum())


def conversations(model, seed: int, lengths) -> list[dict]:
    """Conversations whose labels are, at a random half of the trained positions, what the model
    itself predicts there (its argmax alone), so the accuracy is far from 0 and 1."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(3, 500) for _ in range(n)]
        prompt = rng.randrange(0, n // 2)
        with torch.no_grad():
            predicted = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        labels = [IGNORE_INDEX] * prompt + [
            predicted[t - 1] if t > 0 and rng.random() < 0.5 else ids[t] for t in range(prompt, n)
        ]
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=2).eval()


def test_every_causal_path_equals_a_plain_forward(model, monkeypatch):
    batch = PadCollator(pad_token_id=0)(conversations(model, 0, (9, 30, 17, 44)))
    tensors = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    with torch.no_grad():
        expected = plain_accuracy(model(**tensors).logits, shift_targets(batch["labels"]))
        assert 0.2 < expected < 0.8
        # the chunked loss counts inside its chunks (several chunks per row, and one token each)
        hidden, weight = lm_hidden_and_head(
            model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        )
        targets = int((shift_targets(batch["labels"]) != IGNORE_INDEX).sum())
        for chunk in (1, 7, 1000):
            _, count, hits = chunked_cross_entropy(
                hidden, weight, batch["labels"], chunk_tokens=chunk, correct=True
            )
            assert count.item() == targets and hits.item() / targets == pytest.approx(expected, abs=1e-9)
        assert step.chunkable(model)
        _, chunked = step.forward_loss(model, dict(batch), CPU, "fp32", accuracy=True, layout=CAUSAL_LM)
        monkeypatch.setattr(step, "chunkable", lambda m: False)  # transformers' loss (DDP, FSDP2, compile)
        _, plain = step.forward_loss(model, dict(batch), CPU, "fp32", accuracy=True, layout=CAUSAL_LM)
    assert chunked.item() == pytest.approx(expected, abs=1e-6) and plain.item() == pytest.approx(
        expected, abs=1e-6
    )


def test_packed_rows_count_each_conversation_alone(model):
    examples = conversations(model, 1, (23, 9, 31, 17, 12, 40, 5, 27))
    rows = pack([len(e["input_ids"]) for e in examples], 64).rows
    packed = PackedRows(examples, rows)
    batch = PackedCollator(pad_token_id=0, attention=SDPA)([packed[k] for k in range(len(packed))])
    hits = total = 0
    with torch.no_grad():
        for e in examples:  # each conversation on its own: nothing crosses a packed boundary
            logits = model(torch.tensor([e["input_ids"]])).logits[0]
            targets = shift_targets(torch.tensor(e["labels"]))
            trained = targets != IGNORE_INDEX
            hits += int(((logits.argmax(-1) == targets) & trained).sum())
            total += int(trained.sum())
        _, accuracy = step.forward_loss(model, dict(batch), CPU, "fp32", accuracy=True, layout=CAUSAL_LM)
    assert len(rows) < len(examples) and accuracy.item() == pytest.approx(hits / total, abs=1e-6)


def test_t5_counts_its_decoder_labels():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=128,
        d_model=32,
        d_ff=64,
        d_kv=16,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    t5 = T5ForConditionalGeneration(config).eval()
    source = torch.randint(2, 128, (3, 11))
    labels = torch.randint(2, 128, (3, 7))
    with torch.no_grad():
        predicted = t5(input_ids=source, labels=labels).logits.argmax(-1)
    labels = torch.where(
        torch.rand(labels.shape, generator=torch.Generator().manual_seed(0)) < 0.5, predicted, labels
    )
    labels[0, 5:] = IGNORE_INDEX  # padding of a shorter target
    batch = {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": labels}
    with torch.no_grad():
        expected = plain_accuracy(t5(input_ids=source, labels=labels).logits, labels)
        _, accuracy = step.forward_loss(t5, dict(batch), CPU, "fp32", accuracy=True, layout=ENCODER_DECODER)
    assert 0.2 < expected < 0.9 and accuracy.item() == pytest.approx(expected, abs=1e-6)
    # through train_step: a log step's figure, counted without a host sync
    optimizer = torch.optim.SGD(t5.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with HostSyncs("cpu") as syncs:
        out = step.train_step(
            t5,
            optimizer,
            scaler,
            syncs.host_batches(iter([dict(batch)])),
            1,
            0.0,
            CPU,
            "fp32",
            accuracy=True,
            layout=ENCODER_DECODER,
        )
    assert syncs.count == 0, syncs.summary()
    assert len(out) == 4 and out[3].item() == pytest.approx(expected, abs=1e-6)


def test_accumulated_step_is_the_token_mean_and_takes_no_sync(model):
    """Two micro-batches of uneven target counts: the step's accuracy is over all their targets
    (one big batch's), not a mean of the two shares; no host sync for it."""
    data = conversations(model, 2, (5, 9, 40, 33))
    collate = PadCollator(pad_token_id=0)
    micro = [collate(data[:2]), collate(data[2:])]
    expected_hits = expected_total = 0
    with torch.no_grad():
        for b in micro:
            logits = model(**{k: v for k, v in b.items() if torch.is_tensor(v)}).logits
            targets = shift_targets(b["labels"])
            expected_hits += int(((logits.argmax(-1) == targets) & (targets != IGNORE_INDEX)).sum())
            expected_total += int((targets != IGNORE_INDEX).sum())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with HostSyncs("cpu") as syncs:
        out = step.train_step(model, optimizer, scaler, syncs.host_batches(iter(micro)), 2, 1.0, CPU, "fp32",
                              accuracy=True, layout=CAUSAL_LM)  # fmt: skip
    assert syncs.count == 0, syncs.summary()
    assert out[3].item() == pytest.approx(expected_hits / expected_total, abs=1e-6)
    assert (
        len(step.train_step(model, optimizer, scaler, iter(micro), 2, 1.0, CPU, "fp32", layout=CAUSAL_LM))
        == 3
    )  # not asked: none


def test_sft_metrics_row_equals_a_plain_forward_on_its_batch(base_model, cache_dir, tmp_path):
    """One SFT step, LOG_EVERY=1, the whole data set one batch: the row's mean_token_accuracy is
    the plain forward's on that batch, from the model as the plan builds it (dropout off)."""
    from train.config.flags import parse_training_args
    from train.run.plan.build import build

    folder = tmp_path / "base"
    shutil.copytree(base_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0})
    )
    # A barely trained model with tied embeddings tends to predict the token it reads: a repeated
    # word gives an accuracy well above 0 (the check is not 0 == 0).
    records = [{"prompt": f"Sing {w} of the river.", "response": f" {w}" * (4 + i)}
               for i, w in enumerate(("summer", "winter", "bread", "wine", "light", "kings"))]  # fmt: skip
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = [
        "--model_path",
        str(folder),
        "--data_path",
        str(data),
        "--output_dir",
        str(tmp_path / "runs"),
        "--max_length",
        "64",
        "--batch_size",
        str(len(records)),
        "--max_steps",
        "1",
        "--log_every",
        "1",
        "--num_workers",
        "0",
        "--val_fraction",
        "0",
        "--cache_dir",
        str(cache_dir),
        "--run_name",
        "a",
    ]
    assert run_cli("sft", *argv) == 0
    row = read_jsonl(tmp_path / "runs" / "a" / "metrics.jsonl")[0]
    assert "acc " in (tmp_path / "runs" / "a" / "train.log").read_text()

    plan = build(parse_training_args("sft", argv), say=lambda *_: None)
    assert len(plan.dataset) == len(records)
    batch = plan.collate([plan.dataset[i] for i in range(len(plan.dataset))])
    with torch.no_grad():
        logits = plan.model(**{k: v for k, v in batch.items() if torch.is_tensor(v) and k != "labels"}).logits
    expected = plain_accuracy(logits, shift_targets(batch["labels"]))
    assert expected > 0.1 and row["mean_token_accuracy"] == pytest.approx(expected, abs=1e-6)
