"""The qwen3 family (MODEL_FAMILY=qwen3: llama's block with an RMSNorm on each head's queries and keys), the
proof that a family is one entry. tests/test_llama.py runs every llama check for qwen3 too (sizes, the memory
estimate against a tracked step, FLOPs, pretraining and resume, SFT from scratch, LoRA, DDP); here what is
qwen3's own: the kit's model is transformers' Qwen3ForCausalLM to the bit, its saved folder is a plain Qwen3
one whose q/k norms are trained weights, and DPO and generate run on it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from test_generation_options import reference, tool
from test_llama import tiny_llama
from test_reference_cache import PAIRS
from tiny_tools import one_thread

from conftest import read_jsonl, run_cli
from train.models.family import family_of
from train.models.load import family_of_folder, load_pretrained


@pytest.fixture(autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def qwen3_run(corpus, cache_dir, tmp_path_factory):
    runs = tmp_path_factory.mktemp("qwen3") / "runs"
    assert (
        run_cli(
            "pretrain",
            "--model_family",
            "qwen3",
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
            "4",
            "--run_name",
            "base",
        )
        == 0
    )
    return runs / "base" / "final"


def logits(model, ids):
    model.eval()
    with torch.inference_mode():
        return model(input_ids=ids).logits


def test_the_kits_qwen3_is_transformers_qwen3_to_the_bit(qwen3_run, tmp_path):
    """The kit's new model (build_model) and its loaded one (MODEL_PATH's door) against a plain
    Qwen3ForCausalLM.from_pretrained of the same saved folder: equal logits in fp32, exactly."""
    from transformers import Qwen3ForCausalLM

    # the run's vocabulary: 448
    ids = torch.randint(0, 448, (2, 48), generator=torch.Generator().manual_seed(0))
    _, built = tiny_llama(family="qwen3", seed=5)
    built.save_pretrained(tmp_path / "built")
    plain = Qwen3ForCausalLM.from_pretrained(tmp_path / "built", local_files_only=True)
    assert type(built) is Qwen3ForCausalLM and plain.config.model_type == "qwen3"
    torch.testing.assert_close(logits(built, ids), logits(plain, ids), rtol=0, atol=0)

    loaded = load_pretrained(qwen3_run, False, family_of_folder(qwen3_run, False))
    assert family_of(loaded).name == "qwen3"
    plain = Qwen3ForCausalLM.from_pretrained(qwen3_run, local_files_only=True)
    torch.testing.assert_close(logits(loaded, ids), logits(plain, ids), rtol=0, atol=0)


def test_the_saved_folder_holds_trained_q_and_k_norms(qwen3_run):
    saved = json.loads((qwen3_run / "config.json").read_text())
    assert saved["model_type"] == "qwen3" and saved["architectures"] == ["Qwen3ForCausalLM"]
    assert saved["head_dim"] == 64 and saved["tie_word_embeddings"] and not saved["use_sliding_window"]
    with safe_open(qwen3_run / "model.safetensors", "pt") as f:
        names = set(f.keys())
        for layer in range(saved["num_hidden_layers"]):
            for norm in ("q_norm", "k_norm"):
                weight = f.get_tensor(f"model.layers.{layer}.self_attn.{norm}.weight")
                assert weight.shape == (64,)
                assert not torch.equal(weight, torch.ones_like(weight))  # trained from its initial ones
    assert "lm_head.weight" not in names  # tied to the embeddings, as llama's


def test_dpo_on_a_saved_qwen3_and_generate_from_it(qwen3_run, tmp_path, capsys):
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    assert (
        run_cli(
            "dpo",
            "--model_path",
            str(qwen3_run),
            "--data_path",
            str(tmp_path / "pairs.jsonl"),
            "--output_dir",
            str(tmp_path / "runs"),
            "--cache_dir",
            str(tmp_path / "cache"),
            "--max_length",
            "64",
            "--batch_size",
            "4",
            "--max_steps",
            "2",
            "--log_every",
            "1",
            "--val_fraction",
            "0",
            "--run_name",
            "dpo",
        )
        == 0
    )
    run = tmp_path / "runs" / "dpo"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["steps"] == 2
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r] == [1, 2]
    final = run / "final"
    assert json.loads((final / "config.json").read_text())["model_type"] == "qwen3"
    mine = tool(capsys, final, "--greedy", "--max_new_tokens", "8")
    assert mine and mine == reference(final, do_sample=False, max_new_tokens=8)
