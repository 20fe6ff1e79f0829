"""SFT end to end on a tiny real model: every format trains, the loss mask holds through the
real forward_loss, Chinese survives tokenization and generation, length grouping cuts padding,
bad input is one line with exit code 2, and the launchers pass the micro-batch through."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from conftest import KIT_PY, launch, read_jsonl, run_cli
from train.core.step import forward_loss
from train.core.units import IGNORE_INDEX
from train.data.chat.encode import PadCollator, encode_conversations, ensure_special_tokens
from train.models.family import CAUSAL_LM

FORMATS = {
    "alpaca": lambda i: {"instruction": f"Name fruit {i}.", "input": "", "output": "An apple." * (1 + i % 3)},
    "messages": lambda i: {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"Count to {i}."},
            {"role": "assistant", "content": " ".join(map(str, range(i % 5 + 1)))},
            {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": "Done."},
        ]
    },
    "sharegpt": lambda i: {
        "conversations": [
            {"from": "human", "value": f"Hi {i}"},
            {"from": "gpt", "value": "Hello there." * (1 + i % 2)},
        ]
    },
    "prompt_response": lambda i: {"prompt": f"Say {i}.", "response": f"{i} it is."},
}


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture
def sft_flags(base_model, tmp_path):
    return ["--model_path", str(base_model), "--output_dir", str(tmp_path / "runs"), "--max_length", "64",
            "--batch_size", "4", "--log_every", "1", "--num_workers", "0"]  # fmt: skip


def summary_of(tmp_path, name):
    return json.loads((tmp_path / "runs" / name / "summary.json").read_text())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_trains(fmt, sft_flags, tmp_path):
    suffix = ".json" if fmt == "alpaca" else ".jsonl"
    records = [FORMATS[fmt](i) for i in range(12)]
    path = tmp_path / f"data{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        write_jsonl(path, records)
    assert run_cli("sft", *sft_flags, "--data_path", str(path), "--max_steps", "2", "--run_name", "f") == 0
    summary = summary_of(tmp_path, "f")
    assert summary["mode"] == "sft" and summary["steps"] == 2 and summary["data_format"] == fmt
    assert summary["n_conversations"] == 12 and summary["final_loss"] > 0
    assert f"format {fmt}" in (tmp_path / "runs" / "f" / "train.log").read_text()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "runs" / "f" / "final", local_files_only=True)
    assert tok.chat_template and "<|assistant|>" in tok.get_vocab()


def test_sft_validation_rows(sft_flags, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [FORMATS["messages"](i) for i in range(40)])
    argv = [
        "--data_path",
        path,
        "--max_steps",
        "4",
        "--eval_every",
        "2",
        "--val_fraction",
        "0.1",
        "--run_name",
        "v",
    ]
    assert run_cli("sft", *sft_flags, *argv) == 0
    rows = read_jsonl(tmp_path / "runs" / "v" / "metrics.jsonl")
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4] and all(r["val_loss"] > 0 for r in val)
    summary = summary_of(tmp_path, "v")
    assert summary["n_val_conversations"] >= 4 and summary["final_val_loss"] == val[-1]["val_loss"]


def test_loss_mask_through_forward_loss(base_model):
    """A user turn after the reply changes only prompt tokens' targets (causal attention keeps
    the reply's logits): the loss must not move. Unmasked, the same change moves it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_model, local_files_only=True)
    ensure_special_tokens(tok)
    model = AutoModelForCausalLM.from_pretrained(base_model, local_files_only=True)
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
    model.eval()  # no dropout: two forwards must be comparable
    fixed = [{"role": "user", "content": "the quick fox"}, {"role": "assistant", "content": "a lazy dog"}]

    def batch(tail: str) -> dict:
        convs = [fixed, [*fixed, {"role": "user", "content": tail}]]
        examples, _ = encode_conversations(convs, tok, 64)
        return PadCollator(tok.pad_token_id)(examples)

    a, b = batch("wine and bread"), batch("summer winter light darkness under heaven")
    assert a["input_ids"].shape != b["input_ids"].shape  # the prompt tail really differs
    cpu = torch.device("cpu")
    with torch.no_grad():
        masked = abs(
            forward_loss(model, a, cpu, "fp32", layout=CAUSAL_LM)
            - forward_loss(model, b, cpu, "fp32", layout=CAUSAL_LM)
        )
        for x in (a, b):  # the control: train on every real token
            x["labels"] = x["input_ids"].masked_fill(x["attention_mask"] == 0, IGNORE_INDEX)
        unmasked = abs(
            forward_loss(model, a, cpu, "fp32", layout=CAUSAL_LM)
            - forward_loss(model, b, cpu, "fp32", layout=CAUSAL_LM)
        )
    assert masked < 1e-5 and unmasked > 1e-4, (masked, unmasked)


def test_chinese_round_trips_through_tokenization_and_generation(base_model, sft_flags, tmp_path, capsys):
    from transformers import AutoTokenizer

    prompt, reply = "你好吗？", "我很好，谢谢。"
    tok = AutoTokenizer.from_pretrained(base_model, local_files_only=True)
    ensure_special_tokens(tok)
    for text in (prompt, reply, "混合 mixed 文本"):
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    data = write_jsonl(tmp_path / "zh.jsonl", [{"prompt": prompt, "response": reply}] * 8)
    argv = [
        *sft_flags,
        "--data_path",
        data,
        "--max_steps",
        "24",
        "--learning_rate",
        "1e-2",
        "--warmup_steps",
        "2",
        "--weight_decay",
        "0",
        "--run_name",
        "zh",
        "--log_every",
        "24",
    ]
    assert run_cli("sft", *argv) == 0
    capsys.readouterr()
    final = str(tmp_path / "runs" / "zh" / "final")
    assert (
        run_cli(
            "generate", "--model", final, "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "30"
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == reply


def test_length_grouping_raises_padding_efficiency(sft_flags, tmp_path):
    records = [{"prompt": f"Item {i}.", "response": "the quick fox " * (1 + (i * 7) % 15)} for i in range(64)]
    data = write_jsonl(tmp_path / "mixed.jsonl", records)
    efficiency = {}
    for grouping in ("0", "1"):
        argv = [
            *sft_flags,
            "--data_path",
            data,
            "--batch_size",
            "8",
            # grouping draws from the samples the run trains (a plain order's, under a budget): all
            "--epochs",
            "1",
            "--run_name",
            f"g{grouping}",
        ]
        assert run_cli("sft", *argv, "--length_grouping", grouping) == 0
        efficiency[grouping] = summary_of(tmp_path, f"g{grouping}")["padding_efficiency"]
    assert efficiency["1"] > efficiency["0"] + 0.15 and efficiency["1"] > 0.85, efficiency
    argv = [*sft_flags, "--data_path", data, "--token_budget", "160", "--max_steps", "3", "--run_name", "tb"]
    assert run_cli("sft", *argv) == 0
    summary = summary_of(tmp_path, "tb")
    assert summary["token_budget"] == 160 and summary["padding_efficiency"] > 0.85
    assert summary["tokens"] <= summary["samples"] * 64 and summary["batch_size"] != 4  # sized by tokens


def test_pretraining_is_packed(base_model):
    summary = json.loads((base_model.parent / "summary.json").read_text())
    assert summary["padding_efficiency"] == 1.0 and summary["tokens"] == summary["samples"] * 64


BAD = {
    "malformed": (
        '{"prompt": "a", "response": "b"}\n{"prompt": oops\n',
        ["bad.jsonl line 2", "not valid JSON"],
    ),
    "empty": ("", ["no records"]),
    "no_response": ('{"prompt": "a", "response": "  "}\n', ["line 1", "no response"]),
    "unknown": ('{"question": "a", "answer": "b"}\n', ["unknown SFT format", "alpaca"]),
}


@pytest.mark.parametrize("case", [*BAD, "not_a_model", "broken_model", "no_pretrain_run", "pretrain_knob"])
def test_bad_input_is_one_line_exit_2(case, sft_flags, tmp_path, capsys):
    argv = list(sft_flags)
    expect = []
    if case in BAD:
        content, expect = BAD[case]
        (tmp_path / "bad.jsonl").write_text(content)
        argv += ["--data_path", str(tmp_path / "bad.jsonl")]
    elif case == "not_a_model":
        argv[1], expect = str(tmp_path), ["MODEL_PATH", "not a model folder"]
    elif case == "broken_model":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text('{"model_type": "no-such-arch"}')
        argv[1], expect = str(tmp_path / "m"), ["MODEL_PATH", "TRUST_REMOTE_CODE=1"]
    elif case == "no_pretrain_run":
        argv = argv[2:]
        expect = ["MODEL_PATH is empty", "MODEL_SIZE=nano MAX_STEPS=200 ./run_single_gpu_optimized.sh"]
    command = "pretrain" if case == "pretrain_knob" else "sft"
    expect = expect or ["MODEL_PATH (--model_path) does not apply to pretraining"]
    assert run_cli(command, *argv, "--max_steps", "1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(e in err for e in expect), err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing written


def test_skip_bad_records_prints_the_count(sft_flags, tmp_path, capsys):
    good = [json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) for i in range(8)]
    (tmp_path / "d.jsonl").write_text("\n".join([*good[:4], "{broken", *good[4:]]) + "\n")
    assert run_cli("sft", *sft_flags, "--data_path", str(tmp_path / "d.jsonl"), "--max_steps", "1") == 2
    assert "SKIP_BAD_RECORDS=1" in capsys.readouterr().err
    argv = [*sft_flags, "--data_path", str(tmp_path / "d.jsonl"), "--max_steps", "1", "--run_name", "s"]
    assert run_cli("sft", *argv, "--skip_bad_records", "1") == 0
    assert "skipped 1 bad record" in (tmp_path / "runs" / "s" / "train.log").read_text()
    assert summary_of(tmp_path, "s")["n_skipped"] == 1


def test_generate_refuses_a_folder_that_is_no_model(tmp_path, capsys):
    assert run_cli("generate", "--model", str(tmp_path), "--prompt", "hi") == 2
    err = capsys.readouterr().err.strip()
    assert "--model" in err and len(err.splitlines()) == 1


def test_chat_reads_lines_until_an_empty_one(base_model, sft_flags, tmp_path, capsys, monkeypatch):
    import io

    data = write_jsonl(tmp_path / "d.jsonl", [FORMATS["prompt_response"](i) for i in range(8)])
    assert run_cli("sft", *sft_flags, "--data_path", data, "--max_steps", "1", "--run_name", "c") == 0
    capsys.readouterr()
    stdin = io.StringIO("Say 1.\nSay 2.\n\nSay 3.\n")
    monkeypatch.setattr("sys.stdin", stdin)
    final = str(tmp_path / "runs" / "c" / "final")
    assert run_cli("generate", "--model", final, "--max_new_tokens", "4", "--temperature", "0") == 0
    assert stdin.read() == "Say 3.\n"  # the empty line ended the chat


def show(script, env, *args):
    result = launch(script, {"SHOW_COMMAND": "1", **env}, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_custom_launcher_takes_the_micro_batch_first():
    argv = shlex.split(show("train_sft_custom.sh", {}, "20", "--seed", "3")[-1])
    assert argv[:4] == [KIT_PY, "-m", "train", "sft"]
    assert argv[argv.index("--preset") + 1] == "sft" and argv[argv.index("--batch_size") + 1] == "20"
    assert argv[-2:] == ["--seed", "3"]  # further flags passed through, last
    argv = shlex.split(show("train_sft_custom.sh", {}, "--seed", "3")[-1])
    assert argv[argv.index("--batch_size") + 1] == "16"  # the default when the first argument is a flag


def test_quick_start_trains_and_prints_the_effective_batch(base_model, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [FORMATS["messages"](i) for i in range(24)])
    env = {
        "MODEL_PATH": str(base_model),
        "DATA_PATH": data,
        "OUTPUT_DIR": str(tmp_path / "runs"),
        "RUN_NAME": "q",
        "BATCH_SIZE": "4",
        "MAX_STEPS": "2",
        "MAX_LENGTH": "64",
    }
    result = launch("quick_start_sft_fast.sh", env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "effective batch = BATCH_SIZE 4 x GRADIENT_ACCUM 2 = 8" in result.stdout
    summary = summary_of(tmp_path, "q")
    assert (summary["mode"], summary["batch_size"], summary["gradient_accumulation_steps"]) == ("sft", 4, 2)
    assert summary["effective_batch_size"] == 8 and summary["num_workers"] == 2 and summary["length_grouping"]
    assert (
        summary["samples"] == 16
        and len([r for r in read_jsonl(tmp_path / "runs" / "q" / "metrics.jsonl") if "loss" in r]) == 2
    )
