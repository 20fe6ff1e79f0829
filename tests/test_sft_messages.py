"""What an SFT run says about the settings it changes: the embedding resize for the chat
markers in one line of the kit's (no transformers paragraph, no weight-loading bar), and a
VAL_FRACTION raised for a small set as a decision saved in config.json. `make help` names the
three SFT batching modes that sft-bench compares."""

from __future__ import annotations

import json
import subprocess

from conftest import ROOT, run_cli


def test_small_sft_run_says_what_it_changed(base_model, tmp_path, capfd):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # a model whose embeddings have no spare rows, so the chat markers make SFT resize them
    exact = tmp_path / "exact"
    tok = AutoTokenizer.from_pretrained(base_model, local_files_only=True, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(base_model, local_files_only=True, trust_remote_code=False)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.save_pretrained(exact)
    tok.save_pretrained(exact)
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Say {i}.", "response": f"{i}."}) + "\n" for i in range(40))
    )
    capfd.readouterr()
    argv = ["--model_path", str(exact), "--data_path", str(data), "--output_dir", str(tmp_path / "runs"),
            "--max_length", "64", "--batch_size", "4", "--max_steps", "1", "--run_name", "s"]  # fmt: skip
    assert run_cli("sft", *argv) == 0
    out = "".join(capfd.readouterr())
    rows = len(tok)
    assert (f"resized embeddings {rows} -> {(rows + 7 + 63) // 64 * 64} for 7 token(s) beyond its vocabulary "
            "(TEMPLATE's chat tokens)") in out
    assert "mean_resizing" not in out and "multivariate" not in out and "Loading weights" not in out
    decisions = {
        d["setting"]: d
        for d in json.loads((tmp_path / "runs" / "s" / "config.json").read_text())["decisions"]
    }
    # the fine-tuned model generates with the KV cache too (SFT turns it off for training)
    assert (
        json.loads((tmp_path / "runs" / "s" / "final" / "generation_config.json").read_text())["use_cache"]
        is True
    )
    raised = decisions["val_fraction"]
    assert raised["value"] == 0.1 and "VAL_FRACTION=0.01 holds out 1 of 40 conversations" in raised["reason"]


def test_make_help_names_the_three_sft_bench_modes():
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if "sft-bench" in line)
    assert "three" in line and "LENGTH_GROUPING=1" in line and "PACKING=1" in line and "plain" in line
