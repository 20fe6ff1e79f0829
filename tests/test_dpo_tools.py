"""Preference training through the kit's tools: train_dpo.sh's generated knob block (no knob the mode
refuses, MODEL_PATH said as DPO takes it), and find-batch / AUTO_BATCH, autotune and the doctor timing
the preference objective on pair batches, with tiny real models."""

from __future__ import annotations

from dataclasses import replace

from conftest import ROOT
from train.config import knob_docs


def test_the_dpo_launcher_leaves_out_what_the_mode_refuses_and_says_its_own_model_path():
    dpo = next(lw for lw in knob_docs.launchers() if lw.path.name == "train_dpo.sh")
    block = {line.split("=")[0]: line for line in knob_docs.launcher_block(dpo) if knob_docs.KNOB_LINE.match(line)}
    assert not {"MODEL_SIZE", "MODEL_CONFIG", "VOCAB_SIZE"} & set(block)
    assert "the newest completed SFT run's final/" in block["MODEL_PATH"] and "pretraining" not in block["MODEL_PATH"]
    sft = next(lw for lw in knob_docs.launchers() if lw.path.name == "train_sft_custom.sh")
    sft_block = "\n".join(knob_docs.launcher_block(sft))
    assert "MODEL_SIZE=" in sft_block and "VOCAB_SIZE=" in sft_block
    assert "else the newest pretraining run's final/" in sft_block and "completed SFT run" not in sft_block
    assert "\n".join(knob_docs.launcher_block(dpo)) in (ROOT / "train_dpo.sh").read_text()  # regenerated
    doc = "\n".join(knob_docs.markdown())
    row = next(line for line in doc.splitlines() if line.startswith("| MODEL_SIZE |"))
    assert "Not for `python -m train dpo`: left out of its launchers." in row


def test_the_marker_and_the_mode_parts_of_a_docstring():
    knob = next(k for k in knob_docs.all_knobs() if k.name == "model_size")
    assert knob.not_modes == {"dpo"} and not knob_docs.applies(knob, "dpo") and knob_docs.applies(knob, "sft")
    assert knob_docs.applies(replace(knob, not_modes=frozenset()), "dpo")
    doc = "SFT: the model. Empty: a new one. DPO: the chat model. Empty: the newest SFT run."
    assert knob_docs.mode_doc(doc, "dpo") == "DPO: the chat model. Empty: the newest SFT run."
    assert knob_docs.mode_doc(doc, "sft") == knob_docs.mode_doc(doc, "pretrain") == "SFT: the model. Empty: a new one."
    path = replace(knob, name="model_path", doc=doc, modes=frozenset({"sft", "dpo"}), not_modes=frozenset(), default=None,
                   choices=())  # fmt: skip
    assert knob_docs.summary(path, "dpo") == "the chat model" and knob_docs.summary(path, "sft") == "the model"
    assert knob_docs.empty_means(path, None, "dpo") == "empty: the newest SFT run"
    assert knob_docs.empty_means(path, None, "sft") == "empty: a new one"
