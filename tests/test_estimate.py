"""Dry run and the peak-memory estimate: hand counts for GPT-2 small, a tracked step, and a
dry run that allocates nothing and writes no run folder."""

import pytest
import torch

import config
from conftest import launch, run_cli
from train.config.flags import parse_training_args
from train.core.model import padded_vocab
from train.core.optim.registry import build_optimizer
from train.core.step import train_step
from train.models.build import build_config, build_model
from train.models.estimate import count_params, estimate_memory
from train.models.family import CAUSAL_LM
from train.run.plan.build import build

GPT2_SMALL = 124_439_808  # tied embeddings, vocab 50257 (the published count)


def test_gpt2_small_weights_gradients_optimizer_by_hand():
    from transformers import GPT2Config

    hf = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    # By hand: embeddings V*h + P*h; per layer 12h^2 + 13h (qkv, proj, fc, proj weights and
    # biases, two layer norms); final norm 2h; the LM head is tied to the embeddings.
    h, layers = 768, 12
    hand = 50257 * h + 1024 * h + layers * (12 * h * h + 13 * h) + 2 * h
    assert hand == GPT2_SMALL == count_params(hf)
    fp32 = estimate_memory(hf, hand, batch_size=8, max_length=1024, precision="fp32")
    assert fp32["weights"] == 4 * GPT2_SMALL  # fp32 weights: 498 MB
    assert fp32["gradients"] == 4 * GPT2_SMALL
    assert fp32["optimizer"] == 8 * GPT2_SMALL  # AdamW: two fp32 states
    assert fp32["weight_copies"] == 0
    bf16 = estimate_memory(hf, hand, batch_size=8, max_length=1024, precision="bf16")
    assert bf16["weights"] == 4 * GPT2_SMALL  # fp32 master weights stay
    assert bf16["weight_copies"] == 2 * GPT2_SMALL  # the guides' 6 bytes/param for mixed precision
    assert bf16["optimizer"] == 8 * GPT2_SMALL and bf16["gradients"] == 4 * GPT2_SMALL
    # The loss tensors: three fp32 batch x length x vocab tensors (log-softmax, two gradients).
    assert fp32["loss_logits"] == 12 * 8 * 1024 * 50257
    ckpt = estimate_memory(
        hf, hand, batch_size=8, max_length=1024, precision="fp32", gradient_checkpointing=True
    )
    assert ckpt["activations"] < fp32["activations"] / 2
    # The kit pads the vocabulary to a multiple of 64: 47 more embedding rows.
    kit = build_config("small", None, padded_vocab(50257), 50256)
    assert count_params(kit) == GPT2_SMALL + (50304 - 50257) * h


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_matches_a_tracked_step(checkpointing, chunked, monkeypatch):
    """torch's MemTracker under FakeTensorMode counts every tensor of two real train_steps
    (CPU kernels, fp32) without allocating them; the estimate lands within 10 %, with the
    kit's chunked loss and with transformers' own (what DDP, FSDP2 and compile use)."""
    from train.core import step

    if not chunked:
        monkeypatch.setattr(step, "chunkable", lambda model: False)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    hf = build_config("nano", None, 512, 0)
    hf.n_layer, hf.n_embd, hf.n_head, hf.n_positions = 2, 64, 2, 128
    hf.resid_pdrop = hf.embd_pdrop = hf.attn_pdrop = 0.0
    cfg = config.resolve(None, {"batch_size": 16})
    cpu = torch.device("cpu")
    with FakeTensorMode():
        model = build_model(hf, checkpointing, 0)
        optimizer, _ = build_optimizer(cfg.optim, model, cpu)
        ids = torch.randint(0, 512, (16, 128))
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            for _ in range(2):  # the second step has AdamW's state
                batches = iter([{"input_ids": ids}])
                train_step(
                    model,
                    optimizer,
                    torch.amp.GradScaler("cpu", enabled=False),
                    batches,
                    1,
                    1.0,
                    cpu,
                    "fp32",
                    layout=CAUSAL_LM,
                )
                tracker.reset_mod_stats()
        measured = tracker.get_tracker_snapshot("peak")[cpu]["Total"]
    est = estimate_memory(
        hf, count_params(hf), batch_size=16, max_length=128, precision="fp32",
        gradient_checkpointing=checkpointing, device_type="cpu", chunked_loss=chunked,
    )  # fmt: skip
    assert est["peak"] == pytest.approx(measured, rel=0.1)


def test_dry_run_allocates_nothing_and_writes_no_run(tiny_flags, tmp_path, capsys):
    argv = [*tiny_flags, "--batch_size", "4", "--max_steps", "50", "--dry_run", "1"]
    assert run_cli("pretrain", *argv) == 0
    out = capsys.readouterr().out
    for text in ("parameters", "effective batch 4", "tokens per optimizer step", "steps per epoch",
                 "50 optimizer steps", "warm-up", "estimated peak", "resolved config:"):  # fmt: skip
        assert text in out, text
    assert not (tmp_path / "runs").exists()
    b = build(parse_training_args("pretrain", argv), lambda line: None)
    assert {p.device.type for p in b.model.parameters()} == {"meta"}


def test_dry_run_through_the_launcher(tmp_path, corpus, cache_dir):
    env = {
        "DRY_RUN": "1",
        "MODEL_SIZE": "small",
        "DATA_PATH": str(corpus),
        "VOCAB_SIZE": "512",
        "CACHE_DIR": str(cache_dir),
        "OUTPUT_DIR": str(tmp_path / "runs"),
        "MAX_LENGTH": "128",
    }
    result = launch("run_single_gpu_optimized.sh", env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "effective batch 128 = BATCH_SIZE 32 x GRADIENT_ACCUM 4" in result.stdout
    assert "estimated peak" in result.stdout and "86,186,496 parameters" in result.stdout
    assert not (tmp_path / "runs").exists()
