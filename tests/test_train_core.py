"""The training core on tiny real models: accumulation, precisions, token cache, golden
losses, run-folder outputs."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import read_jsonl, run_cli, tiny_model
from train.core.optim.schedules import lr_at
from train.core.step import train_step
from train.data import text as data
from train.models.family import CAUSAL_LM

GOLDEN = Path(__file__).parent / "golden" / "tiny_losses.json"




def test_accumulation_4x8_equals_one_batch_of_32():
    torch.manual_seed(0)
    batch = torch.randint(0, 512, (32, 32))
    weights = []
    for micro, accum in ((32, 1), (8, 4)):
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # new weights = old - grad
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        stream = iter({"input_ids": chunk} for chunk in batch.split(micro))
        train_step(
            model, optimizer, scaler, stream, accum, 0.0, torch.device("cpu"), "fp32", layout=CAUSAL_LM
        )
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains_on_cpu(precision, tiny_flags, tmp_path):
    flag = f"--{precision}"
    assert (
        run_cli("pretrain", *tiny_flags, flag, "--batch_size", "4", "--max_steps", "4", "--run_name", "p")
        == 0
    )
    summary = json.loads((tmp_path / "runs" / "p" / "summary.json").read_text())
    assert summary["precision"] == precision
    losses = [row["loss"] for row in read_jsonl(tmp_path / "runs" / "p" / "metrics.jsonl") if "loss" in row]
    assert len(losses) == 4 and all(np.isfinite(losses))


def test_fp16_on_a_device_without_it_stops(tiny_flags, monkeypatch, capsys):
    import train.core.device

    monkeypatch.setattr(train.core.device, "supports", lambda device, precision: precision == "fp32")
    assert run_cli("pretrain", *tiny_flags, "--fp16", "--max_steps", "2") == 2
    err = capsys.readouterr().err.strip()
    assert "ENABLE_FP16" in err and len(err.splitlines()) == 1


def test_token_cache_reused_and_keyed_by_content(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world, this is a small text.\n" * 200)
    files = [text]
    key = data.corpus_fingerprint(files)
    tok = data.load_tokenizer(None, files, key, 300, tmp_path / "cache", print)
    tokens = data.token_cache(files, key, tok, tmp_path / "cache", print)
    cached = next((tmp_path / "cache" / "tokens").glob("*/shard-*.bin"))
    mtime = cached.stat().st_mtime_ns
    again = data.token_cache(files, key, tok, tmp_path / "cache", print)
    assert cached.stat().st_mtime_ns == mtime  # read back, not re-tokenized
    assert isinstance(again, np.memmap) and np.array_equal(tokens, again)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    assert tokens[-1] == eos
    assert tok.decode(tokens[:-1].tolist()) == text.read_text()  # round-trips exactly
    text.write_text("different text now.\n" * 200)
    assert data.corpus_fingerprint(files) != key


def test_warm_start_does_not_read_the_corpus_again(tmp_path, monkeypatch):
    """Each source's digest is remembered by path, size, mtime, ctime and inode (CACHE_DIR/sums):
    a second start finds its cache without reading the corpus; a rewritten file is read again."""
    monkeypatch.setattr(data.cache_files, "SETTLED_NS", 0)  # a fresh file's ctime cannot be set back
    text, sums = tmp_path / "a.txt", tmp_path / "cache" / "sums"
    text.write_text("some corpus text\n" * 100)
    key = data.corpus_fingerprint([text], sums=sums)
    assert key == data.corpus_fingerprint([text])  # the same key with or without the memo
    (memo,) = sums.glob("*.json")
    memo.write_text(json.dumps({**json.loads(memo.read_text()), "sha256": "0" * 64}))  # not the bytes' hash
    assert data.corpus_fingerprint([text], sums=sums) != key  # the memo was used, the file not read
    text.write_text("other corpus text\n" * 100)  # new size and mtime: read again
    assert data.corpus_fingerprint([text], sums=sums) == data.corpus_fingerprint([text])


def test_packed_dataset_windows(tmp_path):
    path = tmp_path / "t.bin"
    arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(100,))
    arr[:] = np.arange(100)
    arr.flush()
    ds = data.PackedDataset(np.memmap(path, dtype=np.uint16, mode="r", shape=(100,)), 32)
    assert len(ds) == 3
    assert ds[1]["input_ids"].tolist() == list(range(32, 64))
    import pickle

    clone = pickle.loads(pickle.dumps(ds))  # what a spawned worker receives: no token copy
    assert clone.tokens is None and clone[2]["input_ids"][0].item() == 64


def test_lr_schedule_warmup_then_cosine():
    assert lr_at(0, 1.0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 1.0, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_at(99, 1.0, 10, 100, 0.1) == pytest.approx(0.1, abs=1e-3)
    assert lr_at(55, 1.0, 10, 100, 0.1) == pytest.approx(0.55, abs=1e-2)


def test_seeded_run_matches_golden_losses(tiny_flags, tmp_path):
    argv = [*tiny_flags, "--batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "8"]
    assert run_cli("pretrain", *argv, "--run_name", "g", "--seed", "1234") == 0
    run = tmp_path / "runs" / "g"
    losses = [row["loss"] for row in read_jsonl(run / "metrics.jsonl") if "loss" in row]
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({"losses": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    np.testing.assert_allclose(losses, golden, rtol=2e-4)
    assert losses[-1] < losses[0]


def test_run_folder_contract_and_final_loads_offline(tiny_flags, tmp_path):
    assert run_cli("pretrain", *tiny_flags, "--batch_size", "4", "--max_steps", "12", "--run_name", "r") == 0
    run = tmp_path / "runs" / "r"
    summary = json.loads((run / "summary.json").read_text())
    required = (
        "mode device device_name world_size model_size n_params precision batch_size "
        "gradient_accumulation_steps "
        "effective_batch_size max_length num_workers steps samples tokens wall_time_s samples_per_sec "
        "tokens_per_sec data_wait_frac peak_vram_mb avg_gpu_util mfu final_loss exit_reason"
    ).split()
    assert [k for k in required if k not in summary] == []
    assert summary["mode"] == "pretrain" and summary["steps"] == 12 and summary["samples"] == 48
    assert summary["tokens"] == 48 * 64 and summary["samples_per_sec"] > 0
    assert summary["mfu"] is None  # CPU: no known peak, never a guess
    losses = [row["loss"] for row in read_jsonl(run / "metrics.jsonl") if "loss" in row]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    cfg = json.loads((run / "config.json").read_text())
    assert any(d["setting"] == "total_steps" for d in cfg["decisions"])
    assert "step 12/12" in (run / "train.log").read_text()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(run / "final", local_files_only=True)
    ids = tok("the quick brown fox", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] == ids.shape[1] + 5


def test_existing_run_name_is_refused_and_kept(tiny_flags, tmp_path, capsys):
    run = tmp_path / "runs" / "keep"
    run.mkdir(parents=True)
    (run / "summary.json").write_text('{"precious": true}')
    assert run_cli("pretrain", *tiny_flags, "--max_steps", "1", "--run_name", "keep") == 2
    assert "OVERWRITE=1" in capsys.readouterr().err
    assert json.loads((run / "summary.json").read_text()) == {"precious": True}
