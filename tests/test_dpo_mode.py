"""Preference training as a mode of the kit (`python -m train dpo`, ./train_dpo.sh), end to end on tiny
real models: a GPT-2 from an SFT run (the default MODEL_PATH) and a T5; the first step with
REFERENCE=copy is ln 2 with rewards 0; the three references give the same losses; accumulation equals
one big batch; SIGKILL + RESUME=1 repeats the losses; bad knobs are one line, exit 2."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, launch, read_jsonl, run_cli, train_python

PAIRS = [
    {"prompt": f"Say {i}.", "chosen": f"{i} {i}.", "rejected": f"no {i % 5} way" * (1 + i % 3)}
    for i in range(40)
]
TRL_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")  # fmt: skip


def sft_and_pairs(base_model: Path, root: Path, output_dir: str, n: int) -> Path:
    """root with a completed SFT run (root/output_dir/sft) of the tiny pretrained GPT-2 on n conversations
    (DPO's default MODEL_PATH) and root/pairs.jsonl."""
    data = root / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Say {i}.", "response": f"{i} {i}."}) + "\n" for i in range(n))
    )
    argv = ["--model_path", str(base_model), "--data_path", str(data), "--output_dir", str(root / output_dir),
            "--cache_dir", str(root / "cache"), "--max_length", "64", "--batch_size", "4", "--max_steps", "2",
            "--run_name", "sft", "--num_workers", "0"]  # fmt: skip
    assert run_cli("sft", *argv) == 0
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return root


@pytest.fixture(scope="module")
def sft_runs(base_model, tmp_path_factory) -> Path:
    """OUTPUT_DIR holding a completed SFT run of the tiny pretrained GPT-2 (DPO's default MODEL_PATH)."""
    return sft_and_pairs(base_model, tmp_path_factory.mktemp("dpo"), "runs", 24)


def dpo_argv(root: Path, name: str, *more: str) -> list[str]:
    return [
        "dpo",
        "--data_path",
        str(root / "pairs.jsonl"),
        "--output_dir",
        str(root / "runs"),
        "--cache_dir",
        str(root / "cache"),
        "--max_length",
        "64",
        "--batch_size",
        "4",
        "--max_steps",
        "5",
        "--log_every",
        "1",
        "--num_workers",
        "0",
        "--run_name",
        name,
        "--overwrite",
        "1",
        *more,
    ]


def train_rows(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def test_a_dpo_run_from_the_newest_sft_run_starts_at_ln2_and_writes_trls_metrics(sft_runs, capsys):
    assert run_cli(*dpo_argv(sft_runs, "copy", "--reference", "copy", "--max_steps", "3")) == 0
    out = capsys.readouterr().out
    assert f"model_path = {sft_runs / 'runs' / 'sft' / 'final'}" in out  # the default, as a decision
    run = sft_runs / "runs" / "copy"
    rows = train_rows(run)
    first = rows[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert first[name] == pytest.approx(0.0, abs=1e-6)
    assert all(name in row for row in rows for name in TRL_NAMES)
    assert rows[-1]["loss"] < first["loss"] and rows[-1]["rewards/margins"] > 0  # it learns the preference
    val = [r for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r]
    assert val and all(f"val_{name}" in val[-1] for name in TRL_NAMES)
    summary = json.loads((run / "summary.json").read_text())
    # a preference loss is no token loss: no perplexity of it, in the rows, the summary or the log line
    assert val[-1]["val_ppl"] is None and summary["final_val_ppl"] is None  # was exp(val_loss)
    assert summary["final_val_loss"] == pytest.approx(val[-1]["val_loss"]) and "val_ppl" not in out
    assert summary["mode"] == "dpo" and summary["dpo_loss"] == "sigmoid" and summary["beta"] == 0.1
    assert summary["reference"] == "copy" and summary["final_loss"] == pytest.approx(rows[-1]["loss"])
    assert summary["final_rewards/accuracies"] == pytest.approx(rows[-1]["rewards/accuracies"])
    assert summary["samples"] == 3 * 4  # pairs, not sequences
    assert "step 3/3 loss" in out and " margin " in out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(run / "final", local_files_only=True)
    ids = tok("Say 3.", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] > ids.shape[1]


def test_precomputed_and_adapters_give_the_losses_of_a_copy(sft_runs, capsys):
    """With LoRA the policy starts as its base, so the three references are the same model: five steps
    of each give the same losses; the second precomputed run reads the cached log-probs."""
    losses = {}
    for reference in ("copy", "precomputed", "adapters", "precomputed"):
        assert run_cli(*dpo_argv(sft_runs, f"ref-{reference}", "--reference", reference, "--lora_r", "4",
                                 "--learning_rate", "1e-2", "--val_fraction", "0")) == 0  # fmt: skip
        losses[reference] = [r["loss"] for r in train_rows(sft_runs / "runs" / f"ref-{reference}")]
    out = capsys.readouterr().out
    assert "reference log-probs: reused" in out  # the second precomputed run
    assert len(losses["copy"]) == 5 and losses["copy"][-1] < losses["copy"][0]
    for reference in ("precomputed", "adapters"):
        np.testing.assert_allclose(losses[reference], losses["copy"], rtol=0, atol=1e-5)


def test_accumulation_4_x_2_equals_a_batch_of_8(sft_runs):
    runs = {}
    for name, batch, accum in (("big", "8", "1"), ("accum", "2", "4")):
        assert run_cli(*dpo_argv(sft_runs, name, "--reference", "copy", "--batch_size", batch,
                                 "--gradient_accumulation_steps", accum, "--max_steps", "3",
                                 "--learning_rate", "1e-3")) == 0  # fmt: skip
        runs[name] = train_rows(sft_runs / "runs" / name)
    for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        np.testing.assert_allclose(
            [r[key] for r in runs["accum"]], [r[key] for r in runs["big"]], rtol=0, atol=1e-5
        )
    assert [r["samples"] for r in runs["accum"]] == [8, 16, 24]


def test_the_kit_decides_the_reference_and_says_why(sft_runs, capsys):
    assert run_cli(*dpo_argv(sft_runs, "auto", "--max_steps", "1", "--lora_r", "4", "--dry_run", "1")) == 0
    assert "reference = adapters  (LORA_R is set" in capsys.readouterr().out
    assert run_cli(*dpo_argv(sft_runs, "auto", "--max_steps", "1", "--dry_run", "1")) == 0
    assert "reference = copy  (a short run reads 4 of" in capsys.readouterr().out
    assert run_cli(*dpo_argv(sft_runs, "auto", "--epochs", "1", "--max_steps", "", "--dry_run", "1")) == 0
    said = re.search(r"reference = precomputed  \(the run reads (\d+) pairs, every one of the (\d+) at least "
                     r"once: one "
                     r"forward pass over the \2 before training \(cached\)", capsys.readouterr().out)
    # was "the run reads 120 pair(s) of 108: one forward pass over them"
    assert said and int(said[1]) >= int(said[2])


def test_a_gpu_fill_leaves_room_for_a_copy_only_where_the_run_may_take_one(sft_runs, monkeypatch, capsys):
    """No BATCH_SIZE on a (fake) GPU: the fill sizes the micro-batch before REFERENCE is decided. It left
    room for a frozen copy even where the run then took the precomputed pass; now only where a copy may be
    chosen (a short run), so the run that reads every pair is sized without one."""
    from tiny_tools import plan_on_a_fake_gpu

    plan_on_a_fake_gpu(monkeypatch, 24)
    fills, references = {}, {}
    for name, more in (("short", ("--max_steps", "1")), ("whole", ("--epochs", "2", "--max_steps", ""))):
        argv = dpo_argv(sft_runs, "filled", *more, "--dry_run", "1")
        at = argv.index("--batch_size")
        del argv[at : at + 2]  # the fill's: no BATCH_SIZE of the user's
        assert run_cli(*argv) == 0
        out = capsys.readouterr().out
        fills[name] = re.search(r"batch_size = \d+  \(BATCH_SIZE not set: estimated peak ([\d,]+) MB "
                                r"at (\d+).*", out)  # fmt: skip
        references[name] = re.search(r"reference = (\w+)", out)[1]
    assert references == {"short": "copy", "whole": "precomputed"}
    assert fills["short"][2] == fills["whole"][2]  # the same micro-batch: its peak with and without the copy
    assert int(fills["whole"][1].replace(",", "")) < int(fills["short"][1].replace(",", ""))  # was equal
    assert "with room for REFERENCE=copy" in fills["short"][0] and "room for" not in fills["whole"][0]


@pytest.mark.parametrize(
    "mode, argv, message",
    [
        # GRPO's 0: none
        ("dpo", ["--beta", "0"], "BETA=0: preference training's beta scales the log-ratios; above 0"),
        (
            "dpo",
            ["--dpo_loss", "kto"],
            "DPO_LOSS (--dpo_loss): expected sigmoid | ipo | hinge | simpo | orpo",
        ),
        (
            "dpo",
            ["--label_smoothing", "0.5"],
            "LABEL_SMOOTHING (--label_smoothing): expected a number from 0 to below 0.5",
        ),
        ("dpo", ["--reference", "adapters"], "REFERENCE=adapters: the reference is the base model"),
        (
            "dpo",
            ["--dpo_loss", "simpo", "--reference", "copy"],
            "REFERENCE=copy: DPO_LOSS=simpo is reference-free",
        ),
        (
            "dpo",
            ["--dpo_loss", "ipo", "--label_smoothing", "0.1"],
            "LABEL_SMOOTHING=0.1: DPO_LOSS=ipo ignores it",
        ),
        (
            "dpo",
            ["--simpo_gamma", "0.3"],
            "SIMPO_GAMMA=0.3: DPO_LOSS=sigmoid ignores it (it reads BETA, LABEL_SMOOTHING)",
        ),
        ("dpo", ["--dpo_loss", "orpo", "--simpo_gamma", "0"], "SIMPO_GAMMA=0: DPO_LOSS=orpo ignores it"),
        ("dpo", ["--model_size", "nano"], "MODEL_SIZE (--model_size) does not apply to preference training"),
        ("dpo", ["--loss_mean", "tokens"], "LOSS_MEAN (--loss_mean) does not apply to preference training"),
        ("dpo", ["--text_field", "body"], "TEXT_FIELD (--text_field) does not apply to preference training"),
        (
            "sft",
            ["--beta", "0.2"],
            "BETA (--beta) does not apply to SFT (`python -m train sft`): it is read by "
            "preference training and reward training only",
        ),
        ("pretrain", ["--reference", "copy"], "REFERENCE (--reference) does not apply to pretraining"),
    ],
)
def test_a_bad_dpo_knob_is_one_line_exit_2(sft_runs, capsys, mode, argv, message):
    base = dpo_argv(sft_runs, "bad")[1:] if mode == "dpo" else ["--output_dir", str(sft_runs / "runs"),
                                                                 "--run_name", "bad"]  # fmt: skip
    assert run_cli(mode, *base, *argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (sft_runs / "runs" / "bad").exists()


def test_the_launcher_trains_pairs_with_its_micro_batch(sft_runs):
    env = {
        "DATA_PATH": str(sft_runs / "pairs.jsonl"),
        "OUTPUT_DIR": str(sft_runs / "runs"),
        "RUN_NAME": "launched",
        "CACHE_DIR": str(sft_runs / "cache"),
        "MAX_LENGTH": "64",
        "MAX_STEPS": "2",
        "NUM_WORKERS": "0",
        "DPO_LOSS": "ipo",
        "OMP_NUM_THREADS": "1",
    }
    proc = launch("train_dpo.sh", env, "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((sft_runs / "runs" / "launched" / "summary.json").read_text())
    assert summary["mode"] == "dpo" and summary["batch_size"] == 2 and summary["dpo_loss"] == "ipo"
    config = json.loads((sft_runs / "runs" / "launched" / "config.json").read_text())["config"]
    assert config["optim"]["learning_rate"] == 5e-6  # the dpo preset


def test_sigkill_then_resume_repeats_the_losses(sft_runs):
    argv = dpo_argv(sft_runs, "whole", "--reference", "copy", "--max_steps", "8", "--save_every", "2",
                    "--learning_rate", "1e-3")  # fmt: skip
    assert run_cli(*argv) == 0
    whole = train_rows(sft_runs / "runs" / "whole")
    killed = [a if a != "whole" else "killed" for a in argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [train_python(), "-m", "train", *killed],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    metrics, deadline = sft_runs / "runs" / "killed" / "metrics.jsonl", time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    at = killed.index("--overwrite")
    assert run_cli(*killed[:at], *killed[at + 2 :], "--resume", "1") == 0
    rows = train_rows(sft_runs / "runs" / "killed")
    assert [r["step"] for r in rows] == list(range(1, 9))
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in whole], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def t5_root(tmp_path_factory) -> Path:
    """A tiny T5 saved with the kit-style tokenizer, and the pairs."""
    from test_t5_sft import TINY_T5, make_tokenizer

    from train.core.model import padded_vocab
    from train.models.build import build_config, build_model

    tok = make_tokenizer()
    tok.pad_token = tok.eos_token
    cfg = build_config("nano", None, padded_vocab(len(tok)), tok.eos_token_id, "t5")
    for key, value in TINY_T5.items():
        setattr(cfg, key, value)
    root = tmp_path_factory.mktemp("dpo_t5")
    build_model(cfg, gradient_checkpointing=False, seed=0).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return root


def test_t5_dpo_runs_its_encoder_once_and_starts_at_ln2(t5_root):
    assert (
        run_cli(
            *dpo_argv(
                t5_root,
                "t5",
                "--model_path",
                str(t5_root / "model"),
                "--reference",
                "copy",
                "--template",
                "none",
                "--max_steps",
                "3",
                "--learning_rate",
                "1e-3",
            )
        )
        == 0
    )
    run = t5_root / "runs" / "t5"
    rows = train_rows(run)
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mode"] == "dpo" and summary["model_kind"] == "seq2seq" and summary["samples"] == 12
    from transformers import AutoModelForSeq2SeqLM

    assert (
        AutoModelForSeq2SeqLM.from_pretrained(run / "final", local_files_only=True).config.model_type == "t5"
    )
    resolved = next(
        line for line in (run / "train.log").read_text().splitlines() if line.startswith("  model: ")
    )
    assert " MODEL_FAMILY=t5 " in resolved, resolved  # the folder's family, not MODEL_FAMILY's default gpt2
    assert json.loads((run / "config.json").read_text())["resolved"]["model_family"] == "t5"
