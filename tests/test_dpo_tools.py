"""Preference training through the kit's tools: train_dpo.sh's generated knob block (no knob the mode
refuses, MODEL_PATH said as DPO takes it), and find-batch / AUTO_BATCH, autotune and the doctor timing
the preference objective on pair batches, with tiny real models."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import replace

import pytest
import torch

from conftest import ROOT, read_jsonl, run_cli
from train.config import knob_docs
from train.tools.find_batch import RESULT_FILE


@contextlib.contextmanager
def one_thread_here():
    """One thread while timing (tiny_tools.one_thread's reason: two spin against each other here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_the_dpo_launcher_leaves_out_what_the_mode_refuses_and_says_its_own_model_path():
    dpo = next(lw for lw in knob_docs.launchers() if lw.path.name == "train_dpo.sh")
    block = {
        line.split("=")[0]: line for line in knob_docs.launcher_block(dpo) if knob_docs.KNOB_LINE.match(line)
    }
    new_model = {"MODEL_SIZE", "MODEL_CONFIG", "VOCAB_SIZE", "MODEL_FAMILY", "TEXT_FIELD",
                 "TOKENIZER_SAMPLE_MB"}
    assert not new_model & set(block) and "PACKING" in block
    assert "pairs per micro-batch" in block["BATCH_SIZE"] and "built-in pairs" in block["DATA_PATH"]
    assert (
        "the newest completed SFT run's final/" in block["MODEL_PATH"]
        and "pretraining" not in block["MODEL_PATH"]
    )
    sft = next(lw for lw in knob_docs.launchers() if lw.path.name == "train_sft_custom.sh")
    sft_block = "\n".join(knob_docs.launcher_block(sft))
    assert "MODEL_SIZE=" in sft_block and "VOCAB_SIZE=" in sft_block
    assert "else the newest pretraining run's final/" in sft_block and "completed SFT run" not in sft_block
    assert "\n".join(knob_docs.launcher_block(dpo)) in (ROOT / "train_dpo.sh").read_text()  # regenerated
    doc = "\n".join(knob_docs.markdown())
    group = doc.split("## Pretraining and SFT\n")[1].split("\n## ")[0]  # what DPO does not read
    assert "Read by `python -m train pretrain | sft` only" in group and "| MODEL_SIZE |" in group


def test_the_marker_and_the_mode_parts_of_a_docstring():
    knob = next(k for k in knob_docs.all_knobs() if k.name == "model_size")
    assert knob.modes == {"pretrain", "sft"} and knob_docs.applies(knob, "sft")
    assert not knob_docs.applies(knob, "dpo")
    assert knob_docs.applies(replace(knob, modes=frozenset({"dpo"})), "dpo")
    doc = "SFT: the model. Empty: a new one. DPO: the chat model. Empty: the newest SFT run."
    assert knob_docs.mode_doc(doc, "dpo") == "DPO: the chat model. Empty: the newest SFT run."
    assert knob_docs.mode_doc(doc, "sft") == knob_docs.mode_doc(doc, "pretrain") == ("SFT: the model. Empty: "
                                                                                     "a new one.")
    path = replace(knob, name="model_path", doc=doc, modes=frozenset({"sft", "dpo"}), default=None,
                   choices=())
    assert (
        knob_docs.summary(path, "dpo") == "the chat model" and knob_docs.summary(path, "sft") == "the model"
    )
    assert knob_docs.empty_means(path, None, "dpo") == "empty: the newest SFT run"
    assert knob_docs.empty_means(path, None, "sft") == "empty: a new one"


PAIRS = [
    {"prompt": f"Say {i}.", "chosen": f"{i} {i}.", "rejected": f"no {i % 5} way" * (1 + i % 3)}
    for i in range(24)
]


@pytest.fixture
def pairs_flags(base_model, tmp_path) -> list[str]:
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    return [
        "--model_path",
        str(base_model),
        "--data_path",
        str(data),
        "--output_dir",
        str(tmp_path / "runs"),
        "--cache_dir",
        str(tmp_path / "cache"),
        "--max_length",
        "64",
        "--num_workers",
        "0",
        "--max_steps",
        "2",
        "--batch_size",
        "2",
        "--gradient_accumulation_steps",
        "4",
        "--max_memory_mb",
        "100000",
    ]


def test_find_batch_in_dpo_mode_times_the_preference_step_and_auto_batch_takes_its_answer(
    pairs_flags, tmp_path, capsys
):
    with one_thread_here():
        assert run_cli("find-batch", "dpo", *pairs_flags) == 0
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "runs" / RESULT_FILE).read_text())
    assert saved["unit"] == "pairs" and saved["objective"] == "preference loss sigmoid, reference copy"
    assert saved["key"]["mode"] == "dpo" and saved["key"]["reference"] == "copy"
    assert saved["batch_size"] * saved["gradient_accumulation_steps"] == 8
    first = saved["trials"][0]
    # The policy is its reference at the first step: DPO's loss is ln 2 (the token loss would be ~6).
    assert first["batch_size"] == 1 and first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert {t["batch_size"] for t in saved["trials"]} == {1, 2, 4, 8}
    assert "pairs/s" in out and "effective batch 8 pairs kept" in out

    argv = [*pairs_flags, "--auto_batch", "1", "--run_name", "auto", "--log_every", "1"]
    assert run_cli("dpo", *argv) == 0
    run = tmp_path / "runs" / "auto"
    log = (run / "train.log").read_text()
    size, accum = saved["batch_size"], saved["gradient_accumulation_steps"]
    assert f"AUTO_BATCH=1: BATCH_SIZE={size} GRADIENT_ACCUM={accum}" in log and "saved by find-batch" in log
    s = json.loads((run / "summary.json").read_text())
    assert (s["batch_size"], s["gradient_accumulation_steps"], s["reference"]) == (size, accum, "copy")
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and "rewards/margins" in rows[0]


def test_autotune_in_dpo_mode_starts_from_the_dpo_preset_and_times_the_preference_step(pairs_flags, tmp_path,
                                                                                       capsys):
    from train.config.flags import parse_training_args
    from train.tools.autotune import ENV_FILE, tune

    cfg = parse_training_args("dpo", [*pairs_flags, "--reference", "precomputed"])
    with one_thread_here():
        winner, preset, outcomes = tune(cfg, print, steps=1, skip=("precision", "workers", "compile"))
    assert preset.candidate.label() == "8 x 1, 2 workers, fp32 (dpo preset)"  # the dpo preset's 8 pairs, of 8
    assert all(o.loss == pytest.approx(math.log(2), abs=1e-5) for o in outcomes if o.status == "ok")
    assert "effective batch 8 pairs" in capsys.readouterr().out
    with one_thread_here():
        assert (
            run_cli("autotune", "dpo", *pairs_flags, "--steps", "1", "--skip", "precision,workers,compile")
            == 0
        )
    out = capsys.readouterr().out
    env = (tmp_path / "runs" / ENV_FILE).read_text()
    assert env.startswith("# python -m train autotune dpo,") and "pairs/s" in env.splitlines()[0]
    assert "./train_dpo.sh" in out and "pairs/s" in out


def test_the_doctor_profiles_a_dpo_run_and_offers_the_precomputed_reference_for_a_copy_that_crowds_memory(
        pairs_flags, tmp_path, capsys):
    # A budget the process alone fills (MAX_MEMORY_MB=64): memory-bound, and the run holds a frozen copy.
    flags = [f for f in pairs_flags if f != "100000"]
    flags[flags.index("--max_memory_mb") + 1:flags.index("--max_memory_mb") + 1] = ["64"]
    assert run_cli("doctor", "dpo", *flags, "--steps", "2", "--reference", "copy") == 0
    out = capsys.readouterr().out
    assert "profiling 2 steps of your dpo config" in out and "pairs/s" in out
    assert "try: REFERENCE=precomputed" in out
    run = next((tmp_path / "runs").glob("doctor-before*"))
    record = json.loads((run / "doctor.json").read_text())
    assert record["before"]["mode"] == "dpo" and record["before"]["reference"] == "copy"
    assert record["verdict"]["kind"] == "memory-bound" and record["verdict"]["changes"] == {
        "reference": "precomputed"
    }
    row = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r][-1]  # one log line, at step 2
    assert "rewards/accuracies" in row and 0 < row["loss"] < 1  # DPO's, near ln 2 (the token loss: about 6)
