"""A tokenizer that knows little of the data's language is named at run time (issue 37): Chinese on
the default BPE spent 2.97 tokens per character and 70 % of the records were cut, without a word.
When the tokenizer's tokens per byte on the data's first records are far above its rate on its own
kind of text (English and Python), a note points to VOCAB_SIZE (a BPE trained on the data) and
TOKENIZER_PATH; a BPE trained on the SFT data says so in its log line."""

from __future__ import annotations

import json
import random

from test_bad_records import train_here

from conftest import TINY_CONFIG, make_text
from train.data import text as data

HAN = ("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得"
       "就那要下以生会自着去之过家学对可她里后小么心多天而能"
       "好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意")


def chinese(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "，".join("".join(rng.choice(HAN) for _ in range(rng.randint(4, 12))) for _ in range(n)) + "。"


def chinese_sft(path, n: int = 60):
    path.write_text(
        "".join(
            json.dumps({"prompt": chinese(3, i), "response": chinese(8, i + 1000)}, ensure_ascii=False) + "\n"
            for i in range(n)
        ),
        encoding="utf-8",
    )
    return path


def test_chinese_data_on_an_english_bpe_gets_a_note_english_does_not(base_model, tmp_path, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_model)
    notes: list[str] = []
    data.language_note(tok, [chinese(400, 1)], notes.append)
    (note,) = notes
    per_char = float(note.split(" tokens per character")[0].rsplit(" ", 1)[1])
    assert 2.5 < per_char <= 3.0 and "VOCAB_SIZE" in note and "TOKENIZER_PATH" in note
    data.language_note(tok, [make_text(1, 400)], notes.append)
    assert len(notes) == 1


def test_the_note_in_a_real_sft_run_and_none_for_a_bpe_trained_on_the_data(base_model, tmp_path, capsys):
    rows = chinese_sft(tmp_path / "zh.jsonl")
    common = [
        "--data_path",
        str(rows),
        "--max_length",
        "64",
        "--batch_size",
        "2",
        "--max_steps",
        "1",
        "--cache_dir",
        str(tmp_path / "cache"),
        "--output_dir",
        str(tmp_path / "runs"),
        "--tokenize_workers",
        "1",
    ]
    result = train_here(capsys, "sft", *common, "--model_path", str(base_model), "--run_name", "given")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "note: the tokenizer spends" in result.stdout and ("tokens per character on DATA_PATH's first "
                                                              "records") in result.stdout
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    result = train_here(
        capsys, "sft", *common, "--model_config", str(config), "--vocab_size", "1024", "--run_name", "own"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        "training a byte-level BPE tokenizer (vocab 1024) on the SFT data; cached for next time"
        in result.stdout
    )
    assert "note: the tokenizer spends" not in result.stdout  # it learned the characters
