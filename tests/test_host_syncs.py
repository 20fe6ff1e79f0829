"""Host syncs (issue 26, A1): the counter catches what makes a GPU's host wait (planted .item(),
nonzero, bool(tensor), boolean indexing, .tolist()), and real runs through the kit's loop and
train_step (GPT-2 and T5 pretraining, SFT plain / grouped / packed / token budget, T5 SFT) take
none in a quiet optimizer step with accumulation 2, so none inside a micro-step. The count comes
from the run's own summary.json (host_syncs_per_step), which names each sync's line."""

from __future__ import annotations

import json

import pytest
import torch
from test_t5_sft import t5_folder  # noqa: F401  (the tiny T5 SFT fixture)
from tiny_tools import one_thread

from config import OptimConfig
from conftest import run_cli
from train.core.measure.syncs import HostSyncs
from train.core.optim.registry import build_optimizer
from train.core.step import train_step
from train.models.family import CAUSAL_LM

QUIET = ["--gradient_accumulation_steps", "2", "--max_steps", "4", "--log_every", "100", "--num_workers", "0"]
TINY_T5 = {
    "model_type": "t5", "d_model": 32, "d_ff": 64, "num_layers": 1, "num_decoder_layers": 1, "num_heads": 2,
    "d_kv": 16, "dropout_rate": 0.0, "feed_forward_proj": "relu", "tie_word_embeddings": True,
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


def batches_of(x):
    while True:
        yield {"input_ids": x.clone()}


def test_counter_catches_planted_syncs_and_names_the_line():
    model = torch.nn.Linear(4, 4)
    with HostSyncs("cpu") as s:
        batch = next(s.host_batches(batches_of(torch.ones(2, 4))))
        host_count = int(batch["input_ids"].sum())  # a host tensor: no sync on a GPU either
        assert torch.tensor([3, 4]).tolist() == [3, 4]  # Python data on the host (a host all-reduce's box)
        y = model(batch["input_ids"].to("cpu"))
        y.sum().backward()
        assert s.count == 0, s.summary()
        y.sum().item()
        y.nonzero()
        bool((y > 0).any())
        y[y > 0]
        y.tolist()
        y.repeat_interleave(torch.ones(2, dtype=torch.long), dim=0)  # repeats on the device
        # the host said the size: no sync
        y.repeat_interleave(torch.ones(2, dtype=torch.long), dim=0, output_size=2)
    assert host_count == 8
    ops = [sync.op for sync in s.syncs]
    assert len(ops) == 6, s.summary()
    assert "aten._local_scalar_dense" in ops[0] and "nonzero" in ops[1] and "_local_scalar_dense" in ops[2]
    assert "boolean-mask" in ops[3] and ops[4] == "Tensor.tolist" and "repeat_interleave" in ops[5]
    assert all("test_host_syncs.py" in sync.where for sync in s.syncs), s.summary()


def test_train_step_counts_a_sync_planted_in_the_loss(monkeypatch):
    """The counter over the real train_step: clean, then one .item() per micro-step shows up twice."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import train.core.step as step

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    # the kit's (fused) AdamW
    opt, _ = build_optimizer(OptimConfig(learning_rate=1e-3, weight_decay=0.1), model, torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x = torch.randint(0, 64, (2, 8))

    def run():
        with HostSyncs("cpu") as s:
            train_step(
                model,
                opt,
                scaler,
                s.host_batches(batches_of(x)),
                2,
                1.0,
                torch.device("cpu"),
                "fp32",
                layout=CAUSAL_LM,
            )
        return s

    assert run().count == 0, run().summary()
    real = step.token_mean_share

    def planted(total, *args):
        total.item()
        return real(total, *args)

    monkeypatch.setattr(step, "token_mean_share", planted)
    s = run()
    assert s.count == 2 and all("planted" in sync.where for sync in s.syncs), s.summary()


def quiet_run(tmp_path, mode: str, *argv: str) -> dict:
    out = tmp_path / "runs"
    assert run_cli(mode, *argv, *QUIET, "--output_dir", str(out), "--run_name", "q") == 0
    summary = json.loads((out / "q" / "summary.json").read_text())
    assert summary["host_syncs_per_step"] == 0, summary["host_syncs"]
    return summary


def test_pretraining_gpt2_and_t5_take_no_sync(tiny_flags, tmp_path):
    quiet_run(tmp_path / "gpt2", "pretrain", *tiny_flags, "--batch_size", "4")
    folder = tmp_path / "t5"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_T5))
    flags = [f if f != tiny_flags[1] else str(folder) for f in tiny_flags]
    quiet_run(tmp_path / "t5run", "pretrain", *flags, "--batch_size", "4", "--max_length", "32")


SFT_MODES = {
    "plain": [],
    "grouped": ["--length_grouping", "1"],
    "packed": ["--packing", "1"],
    "token_budget": ["--token_budget", "160"],
}


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    records = [{"prompt": f"Item {i}.", "response": "the quick fox " * (1 + (i * 7) % 9)} for i in range(48)]
    path = tmp_path_factory.mktemp("sft") / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("kind", list(SFT_MODES))
def test_sft_takes_no_sync(kind, base_model, sft_data, tmp_path):
    summary = quiet_run(tmp_path, "sft", "--model_path", str(base_model), "--data_path", sft_data,
                        "--max_length", "64", "--batch_size", "4", "--cache_dir", str(tmp_path / "c"),
                        *SFT_MODES[kind])  # fmt: skip
    if kind == "packed":
        assert summary["attention"] == "varlen_sdpa"


def test_t5_sft_takes_no_sync(t5_folder, sft_data, tmp_path):  # noqa: F811
    quiet_run(tmp_path, "sft", "--model_path", str(t5_folder), "--data_path", sft_data, "--max_length", "64",
              "--batch_size", "4", "--cache_dir", str(tmp_path / "c"), "--tokenize_workers", "1")  # fmt: skip
