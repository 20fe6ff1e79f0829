"""The llama family (MODEL_FAMILY=llama: RMSNorm, rotary positions, SwiGLU, grouped-query
attention), added as one registry entry, through the kit's features: its sizes, the memory
estimate against a tracked step, FLOPs per token against torch's counter, pretraining and
resume, SFT from scratch, LoRA on a saved llama, and 2-process DDP equal to one process. Each
check runs for qwen3 too (llama's block with q/k norms, another one-entry family: test_qwen3.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_distributed import flat, spawn
from test_resume import copy_run
from tiny_tools import one_thread

from conftest import read_jsonl, run_cli
from train.core.optim.registry import build_optimizer
from train.core.step import train_step
from train.models import FAMILIES
from train.models.build import build_model
from train.models.estimate import count_params, estimate_memory
from train.models.family import CAUSAL_LM, family_of, set_dropout

CPU = torch.device("cpu")
# The families of llama's block, and the transformers class each builds.
BLOCKS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Head size 64 as every MODEL_SIZE has (sdpa's CPU kernel saves more per element at tiny head sizes).
TINY = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=352, max_position_embeddings=128)  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_thread()


def tiny_llama(vocab: int = 512, seed: int = 0, family: str = "llama"):
    # The family's own make_config at TINY's shape: Qwen3's layer_types has one entry per layer from the
    # start.
    cfg = FAMILIES[family].make_config(TINY, vocab, 0)
    set_dropout(cfg, 0.0)  # as build_config does for MODEL_SIZE
    return cfg, build_model(cfg, False, seed)


@pytest.mark.parametrize("family", BLOCKS)
def test_llama_is_one_entry_with_the_published_shape(family):
    llama = FAMILIES[family]
    assert (
        not llama.layout.encoder_decoder
        and llama.auto == "AutoModelForCausalLM"
        and llama.peft_task_type == "CAUSAL_LM"
    )
    counts = {}
    for size in ("nano", "tiny", "small", "medium"):
        cfg = llama.config_for(size, 8192, 0)
        assert cfg.model_type == family and cfg.hidden_act == "silu" and cfg.tie_word_embeddings
        assert cfg.head_dim == 64 and cfg.rope_parameters["rope_theta"] == 10000.0
        assert cfg.num_attention_heads == 2 * cfg.num_key_value_heads or size in ("small",)  # grouped-query
        counts[size] = round(count_params(cfg) / 1e6, 1)
    # llama.py's (qwen3.py's) docstring
    assert counts == {"nano": 5.0, "tiny": 27.8, "small": 81.8, "medium": 291.6}
    cfg, model = tiny_llama(family=family)
    assert family_of(model) is llama and type(model).__name__ == BLOCKS[family]


@pytest.mark.parametrize("family", BLOCKS)
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_matches_a_tracked_llama_step(checkpointing, chunked, family, monkeypatch):
    """torch's MemTracker under FakeTensorMode over two real train_steps of a tiny llama (SwiGLU,
    RMSNorm, rotary, grouped-query attention): the estimate within 10 %."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    import config
    from train.core import step

    if not chunked:
        monkeypatch.setattr(step, "chunkable", lambda model: False)
    cfg = config.resolve(None, {"batch_size": 16})
    hf, _ = tiny_llama(family=family)
    with FakeTensorMode():
        model = build_model(hf, checkpointing, 0)
        optimizer, _ = build_optimizer(cfg.optim, model, CPU)
        ids = torch.randint(0, 512, (16, 128))
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            for _ in range(2):  # the second step has AdamW's state
                scaler = torch.amp.GradScaler("cpu", enabled=False)
                train_step(
                    model,
                    optimizer,
                    scaler,
                    iter([{"input_ids": ids}]),
                    1,
                    1.0,
                    CPU,
                    "fp32",
                    layout=CAUSAL_LM,
                )
                tracker.reset_mod_stats()
        measured = tracker.get_tracker_snapshot("peak")[CPU]["Total"]
    est = estimate_memory(hf, count_params(hf), batch_size=16, max_length=128, precision="fp32",
                          gradient_checkpointing=checkpointing, device_type="cpu", chunked_loss=chunked)
    assert est["peak"] == pytest.approx(measured, rel=0.1)


@pytest.mark.parametrize("family", BLOCKS)
def test_flops_per_token_match_torch_flop_counter(family):
    """6N + 12·L·H·Q·T against FlopCounterMode over a tiny llama's forward and backward (sdpa's
    math path on CPU with dropout: every matmul an mm or bmm it counts), within 2 %: the tied head is counted
    once in N, the key/value projections at their grouped width, attention at every query head."""
    from torch.utils.flop_counter import FlopCounterMode

    from train.models.flops import model_flops_per_token

    hf, _ = tiny_llama(vocab=512, family=family)
    hf.attention_dropout = 0.1  # sdpa's math path on CPU (the counter does not see its fused kernel)
    model = build_model(hf, False, 0)
    model.train()
    batch, length = 4, 96
    ids = torch.randint(0, 512, (batch, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    formula = model_flops_per_token(model, length) * batch * length
    assert formula == pytest.approx(counter.get_total_flops(), rel=0.02)


@pytest.fixture(scope="module", params=BLOCKS)
def llama_runs(request, corpus, cache_dir, tmp_path_factory):
    runs = tmp_path_factory.mktemp(request.param) / "runs"
    flags = [
        "--model_family",
        request.param,
        "--model_size",
        "nano",
        "--data_path",
        str(corpus),
        "--vocab_size",
        "512",
        "--cache_dir",
        str(cache_dir),
        "--output_dir",
        str(runs),
        "--max_length",
        "64",
        "--batch_size",
        "4",
        "--max_steps",
        "8",
        "--save_every",
        "4",
        "--keep_checkpoints",
        "5",
        "--log_every",
        "1",
        "--seed",
        "3",
    ]
    assert run_cli("pretrain", *flags, "--run_name", "ref") == 0
    return runs, flags, request.param


def test_llama_pretrains_and_resumes_exactly(llama_runs):
    runs, flags, family = llama_runs
    summary = json.loads((runs / "ref" / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["steps"] == 8 and summary["model_size"] == "nano"
    saved = json.loads((runs / "ref" / "final" / "config.json").read_text())
    assert saved["model_type"] == family and saved["num_key_value_heads"] == 2
    reference = [r for r in read_jsonl(runs / "ref" / "metrics.jsonl") if "loss" in r]
    assert reference[-1]["loss"] < reference[0]["loss"]
    run = copy_run(runs, "resumed", keep_up_to=4)
    assert run_cli("pretrain", *flags, "--run_name", "resumed", "--resume", "1") == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    torch.testing.assert_close(
        [r["loss"] for r in rows[4:]], [r["loss"] for r in reference[4:]], rtol=0, atol=1e-5
    )
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_pretrained(runs / "ref" / "final")).__name__ == BLOCKS[family]


def test_llama_sft_from_scratch_and_lora_on_a_saved_llama(llama_runs, tmp_path):
    runs, _, family = llama_runs
    common = [
        "--output_dir",
        str(tmp_path / "runs"),
        "--max_length",
        "64",
        "--max_steps",
        "2",
        "--batch_size",
        "4",
        "--cache_dir",
        str(tmp_path / "cache"),
    ]
    assert run_cli("sft", "--model_family", family, "--model_size", "nano", "--vocab_size", "512", *common,
                   "--run_name", "scratch") == 0
    scratch = json.loads((tmp_path / "runs" / "scratch" / "summary.json").read_text())
    assert (scratch["model_kind"], scratch["exit_reason"]) == ("causal", "completed")
    assert (
        json.loads((tmp_path / "runs" / "scratch" / "final" / "config.json").read_text())["model_type"]
        == family
    )
    assert run_cli("sft", "--model_path", str(runs / "ref" / "final"), "--lora_r", "4", *common,
                   "--run_name", "lora") == 0
    lora_run = tmp_path / "runs" / "lora"
    config = json.loads((lora_run / "config.json").read_text())
    targets = next(d["value"] for d in config["decisions"] if d["setting"] == "lora_targets")
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(targets.split(","))
    assert (lora_run / "final" / "adapter" / "adapter_config.json").is_file()
    assert json.loads((lora_run / "summary.json").read_text())["exit_reason"] == "completed"


def _ddp_worker(rank, world_size, port, family):
    import torch.distributed as dist

    from config import DataConfig
    from train.data.loader import make_loader
    from train.distributed import parallel, process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        world = process_group.Dist(rank=rank, local_rank=rank, world_size=world_size)
        gen = torch.Generator().manual_seed(0)
        rows = [{"input_ids": row} for row in torch.randint(0, 512, (16, 32), generator=gen)]
        loader, _ = make_loader(rows, DataConfig(), 2, 5, CPU, rank=world.rank, world_size=world.world_size)
        ddp = parallel.wrap(tiny_llama(family=family)[1], world, "none", False, CPU)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        train_step(ddp, torch.optim.SGD(ddp.parameters(), lr=1.0), scaler, iter(loader), 2, 0.0, CPU, "fp32",
                   parallel.sync_context(ddp), layout=CAUSAL_LM)
        if world.rank == 0:
            reference = tiny_llama(family=family)[1]
            big, _ = make_loader(rows, DataConfig(), 8, 5, CPU)
            train_step(
                reference,
                torch.optim.SGD(reference.parameters(), lr=1.0),
                scaler,
                iter(big),
                1,
                0.0,
                CPU,
                "fp32",
                layout=CAUSAL_LM,
            )
            torch.testing.assert_close(flat(ddp.module), flat(reference), rtol=1e-5, atol=1e-6)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    process_group.exit_process(0, group_used=True)


@pytest.mark.parametrize("family", BLOCKS)
def test_two_rank_ddp_of_a_llama_equals_one_big_batch(family):
    """2 ranks x (2 micro-batches of 2) of a tiny llama = one process on batch 8, gloo on CPU."""
    spawn(_ddp_worker, family)
