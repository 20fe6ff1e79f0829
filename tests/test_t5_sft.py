"""SFT of an encoder-decoder (T5) on a tiny real model: conversations -> (source, target) pairs
with the exact tokens each side holds, golden losses for a seeded run, the SFT cache keyed by
the model kind, length grouping and token budgets on (source, target) lengths, one-line
refusals (PACKING=1, a BERT folder), and the launcher's final/ loading with
AutoModelForSeq2SeqLM offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_sft_data import make_tokenizer

from conftest import launch, read_jsonl, run_cli
from train.core.units import IGNORE_INDEX
from train.data.chat.batching import BudgetSampler, GroupedSampler, Seq2SeqCollator
from train.data.chat.conversation_cache import sft_cache
from train.data.chat.encode import encode_pairs, ensure_special_tokens, prompt_for_generation
from train.models import KINDS

GOLDEN = Path(__file__).parent / "golden" / "t5_sft_losses.json"
TINY_T5 = dict(
    num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16, dropout_rate=0.0
)
PAIRS = [{"prompt": f"Say {i} twice.", "response": f"{i} {i}." * (1 + i % 4)} for i in range(24)]
MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Count to 2."},
    {"role": "assistant", "content": "1 2"},
    {"role": "user", "content": "Again?"},
    {"role": "assistant", "content": "Done."},
]


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory) -> Path:
    """A tiny T5 (build_config's t5 family, shrunk) saved beside the kit-style BPE tokenizer."""
    from train.core.model import padded_vocab
    from train.models.build import build_config, build_model

    tok = make_tokenizer()
    tok.pad_token = tok.eos_token  # as the kit's own tokenizer: pad = eos = the decoder start
    cfg = build_config("nano", None, padded_vocab(len(tok)), tok.eos_token_id, "t5")
    for key, value in TINY_T5.items():
        setattr(cfg, key, value)
    folder = tmp_path_factory.mktemp("t5") / "model"
    build_model(cfg, gradient_checkpointing=False, seed=0).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture
def tok(t5_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(t5_folder, local_files_only=True)
    ensure_special_tokens(tokenizer)
    return tokenizer


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def sft_argv(t5_folder, tmp_path, data: str, *more: str) -> list[str]:
    return [
        "sft",
        "--model_path",
        str(t5_folder),
        "--data_path",
        data,
        "--output_dir",
        str(tmp_path / "runs"),
        "--cache_dir",
        str(tmp_path / "cache"),
        "--max_length",
        "64",
        "--batch_size",
        "4",
        "--log_every",
        "1",
        "--num_workers",
        "0",
        "--tokenize_workers",
        "1",
        *more,
    ]


def test_pairs_hold_the_exact_source_and_target_tokens(tok):
    """Prompt/response: the source is the rendered prompt up to the assistant marker, the target
    the reply + eos (no <|end|>). Multi-turn: one pair per assistant turn; the second pair's
    source holds the first reply as the template renders it."""
    eos = tok.eos_token_id
    one = [{"role": "user", "content": "Say 1."}, {"role": "assistant", "content": "1 it is."}]
    (pair,), cut = encode_pairs([one], tok, 64)
    assert cut == 0
    assert pair["input_ids"] == ids(tok, "<|user|>\nSay 1.<|end|>\n<|assistant|>\n")
    # what inference feeds the encoder
    assert pair["input_ids"] == ids(tok, prompt_for_generation(tok, one[:1]))
    assert pair["labels"] == ids(tok, "1 it is.") + [eos]
    first, second = encode_pairs([MULTI], tok, 64)[0]
    system = "<|system|>\nBe brief.<|end|>\n<|user|>\nCount to 2.<|end|>\n<|assistant|>\n"
    assert first == {"input_ids": ids(tok, system), "labels": ids(tok, "1 2") + [eos]}
    again = system + "1 2<|end|>\n<|user|>\nAgain?<|end|>\n<|assistant|>\n"
    assert second == {"input_ids": ids(tok, again), "labels": ids(tok, "Done.") + [eos]}
    # The collator: the brief's batch contract, both sides padded to their own longest.
    batch = Seq2SeqCollator(tok.pad_token_id)([first, second])
    assert set(batch) == {"input_ids", "attention_mask", "labels", "n_real_tokens", "n_padded_tokens"}
    assert batch["attention_mask"].sum(1).tolist() == [len(first["input_ids"]), len(second["input_ids"])]
    assert batch["labels"][0].tolist() == first["labels"] + [IGNORE_INDEX] * (
        len(second["labels"]) - len(first["labels"])
    )
    assert batch["n_padded_tokens"] == 2 * (len(second["input_ids"]) + len(second["labels"]))


def test_truncation_keeps_the_end_of_a_source_and_the_start_of_a_target(tok):
    long = [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "reply " * 60}]
    (pair,), cut = encode_pairs([long], tok, 16)
    whole, _ = encode_pairs([long], tok, 10_000)
    assert cut == 1 and len(pair["input_ids"]) == len(pair["labels"]) == 16
    assert pair["input_ids"] == whole[0]["input_ids"][-16:]  # ends with the assistant marker
    # the start, and the eos: the reply ends
    assert pair["labels"] == whole[0]["labels"][:15] + [tok.eos_token_id]


def test_cache_is_keyed_by_model_kind_max_length_and_template(tmp_path, tok):
    data = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    lines: list[str] = []

    def cached(kind, max_length=64):
        return sft_cache(
            data, None, tok, max_length, False, tmp_path / "c", 1, lines.append, KINDS[kind].layout
        )

    pairs, done = cached("seq2seq")
    assert done.startswith("SFT cache: built") and pairs.meta.kind == "seq2seq"
    expected, _ = encode_pairs(
        [
            [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}]
            for r in PAIRS
        ],
        tok,
        64,
    )
    assert [pairs[i] for i in range(len(pairs))] == expected
    assert list(pairs.source_lengths) == [len(e["input_ids"]) for e in expected]
    assert list(pairs.lengths) == [len(e["input_ids"]) + len(e["labels"]) for e in expected]
    assert pairs[3:5][1] == expected[4]  # a slice (the validation split) maps the same files
    assert cached("seq2seq")[1].startswith("SFT cache: reused")
    causal, done = cached("causal")  # a GPT-2 cache is never read for T5, and back
    assert (
        done.startswith("SFT cache: built")
        and causal.folder != pairs.folder
        and causal.source_lengths is None
    )
    shorter, done = cached("seq2seq", max_length=8)
    assert (
        done.startswith("SFT cache: built")
        and shorter.meta.n_truncated > 0
        and max(shorter.source_lengths) == 8
    )
    tok.chat_template = tok.chat_template.replace("<|end|>\n", "<|end|>\n\n")
    assert cached("seq2seq")[1].startswith("SFT cache: built")


def test_length_grouping_and_token_budget_on_source_and_target():
    rng = np.random.default_rng(0)
    sources, targets = rng.integers(2, 60, 200), rng.integers(1, 40, 200)
    lengths = sources + targets
    budget = BudgetSampler(lengths, 256, seed=1, source_lengths=sources)
    batches = budget.batches()
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:  # padded tokens of both sides: rows x (longest source + longest target)
        assert len(b) == 1 or len(b) * (sources[b].max() + targets[b].max()) <= 256
    one_sided = BudgetSampler(lengths, 256, seed=1).batches()  # the control: budgeting the sums alone
    assert any(len(b) * (sources[b].max() + targets[b].max()) > 256 for b in one_sided)
    grouped = GroupedSampler(lengths, 8, seed=1)
    spread = np.mean([np.ptp(lengths[b]) for b in grouped.batches()])
    shuffled = np.mean([np.ptp(lengths[rng.permutation(200)[:8]]) for _ in range(25)])
    assert spread < shuffled / 3, (spread, shuffled)


def test_t5_sft_matches_golden_losses(t5_folder, tmp_path):
    """A seeded run with accumulation over uneven pairs, token budgets and a validation split."""
    chats = [
        {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["response"]},
            ]
        }
        for r in PAIRS
    ]
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": MULTI}] * 4 + chats)
    argv = sft_argv(t5_folder, tmp_path, data, "--token_budget", "160", "--gradient_accumulation_steps", "2",
                    "--max_steps", "6", "--seed", "1234", "--val_fraction", "0.2", "--eval_every", "3",
                    "--learning_rate", "3e-3", "--run_name", "g")  # fmt: skip
    assert run_cli(*argv) == 0
    run = tmp_path / "runs" / "g"
    rows = read_jsonl(run / "metrics.jsonl")
    got = {
        "losses": [r["loss"] for r in rows if "loss" in r],
        "val_losses": [r["val_loss"] for r in rows if "val_loss" in r],
    }
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(golden)
    for key in golden:
        np.testing.assert_allclose(got[key], golden[key], rtol=2e-4, err_msg=key)
    assert got["losses"][-1] < got["losses"][0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model_kind"] == "seq2seq" and summary["n_conversations"] == 8 + len(PAIRS)
    log = (run / "train.log").read_text()
    assert "32 source -> target pairs (one per assistant turn" in log and "source lengths in tokens" in log


def refused(capsys, *argv) -> str:
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_packing_and_a_bert_folder_are_refused_in_one_line(t5_folder, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    err = refused(capsys, *sft_argv(t5_folder, tmp_path, data, "--packing", "1", "--max_steps", "1"))
    assert "PACKING=1" in err and "encoder-decoder" in err and "not built" in err
    assert not (tmp_path / "cache").exists()  # refused before any data work
    from transformers import BertConfig

    bert = tmp_path / "bert"
    BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    ).save_pretrained(bert)
    err = refused(capsys, *sft_argv(bert, tmp_path, data, "--max_steps", "1"))
    assert "MODEL_PATH" in err and "'bert'" in err and "causal LM" in err and "t5" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_launcher_run_ends_with_a_final_that_seq2seq_loads_and_generates(t5_folder, tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    env = {
        "MODEL_PATH": str(t5_folder),
        "OUTPUT_DIR": str(tmp_path / "runs"),
        "CACHE_DIR": str(tmp_path / "cache"),
        "RUN_NAME": "l",
        "MAX_STEPS": "2",
        "MAX_LENGTH": "48",
        "NUM_WORKERS": "0",
        "TOKENIZE_WORKERS": "1",
    }
    result = launch("train_sft_custom.sh", env, "20")
    assert result.returncode == 0, result.stderr[-2000:]
    run = tmp_path / "runs" / "l"
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["mode"], summary["steps"], summary["batch_size"], summary["model_kind"]) == (
        "sft",
        2,
        20,
        "seq2seq",
    )
    assert "format built-in" in (run / "train.log").read_text()
    model = AutoModelForSeq2SeqLM.from_pretrained(run / "final", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(run / "final", local_files_only=True)
    prompt = prompt_for_generation(tok, "Write a Python function `def f(x)`: Return x.")
    out = model.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 1 and 1 < out.shape[1] <= 6
    assert torch.equal(out[0, :1], torch.tensor([model.config.decoder_start_token_id]))


def test_a_decoder_without_a_start_token_starts_from_pad(t5_folder):
    """A T5/BART config.json without decoder_start_token_id (or pad_token_id): the decoder starts
    from the pad id (T5's rule, said as a decision), not a traceback at the first step."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from train.models.load import fit_tokenizer

    for config_pad in (True, False):
        decided = {}
        model = AutoModelForSeq2SeqLM.from_pretrained(t5_folder, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(t5_folder, local_files_only=True)
        model.config.decoder_start_token_id = None
        if not config_pad:
            model.config.pad_token_id = None
        fit_tokenizer(
            model, tok, [tok.eos_token_id], lambda name, value, why, d=decided: d.update({name: value})
        )
        assert model.config.decoder_start_token_id == decided["decoder_start_token_id"] == tok.pad_token_id
        loss = model(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[8, 9]])).loss
        assert torch.isfinite(loss)
