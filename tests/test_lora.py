"""LoRA (LORA_R ...) on a tiny real GPT-2 and T5: the kit's loss is peft's own forward, gradient
checkpointing still trains the adapters, N x B accumulation equals one batch of N*B, a run killed
by SIGKILL resumes to the uninterrupted run's losses, final/ (merged, no peft) gives the logits of
PeftModel(base, final/adapter), 2 DDP processes (gloo) equal one, and bad LORA_* input is one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_sft_data import make_tokenizer
from tiny_tools import one_thread

from conftest import ROOT, launch, read_jsonl, run_cli, train_python
from train.core.step import forward_loss
from train.core.units import IGNORE_INDEX
from train.models import FAMILIES, lora
from train.run.checkpoint.on_disk import list_checkpoints

PAIRS = [{"prompt": f"Say {i} twice.", "response": f"{i} {i}." * (1 + i % 4)} for i in range(48)]
STEPS = 8
SAME = ["--preset", "sft", "--max_length", "64", "--log_every", "1", "--num_workers", "0", "--seed", "7",
        "--lora_r", "4", "--lora_dropout", "0", "--warmup_steps", "1", "--learning_rate", "1e-2"]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tiny GPT-2 whose vocabulary is the tokenizer's (the chat markers make the kit resize it,
    so final/adapter carries embedding rows), a tiny T5, and prompt/response pairs."""
    from train.core.model import padded_vocab
    from train.models.build import build_config, build_model

    root = tmp_path_factory.mktemp("lora")
    tok = make_tokenizer()
    gpt2 = build_config("nano", None, len(tok), tok.eos_token_id)
    for key, value in dict(n_layer=2, n_embd=64, n_head=2, n_positions=64).items():
        setattr(gpt2, key, value)
    gpt2.resid_pdrop = gpt2.embd_pdrop = gpt2.attn_pdrop = 0.0
    tok.pad_token = tok.eos_token
    t5 = build_config("nano", None, padded_vocab(len(tok)), tok.eos_token_id, "t5")
    for key, value in dict(num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16,
                           dropout_rate=0.0).items():  # fmt: skip
        setattr(t5, key, value)
    for name, cfg in (("gpt2", gpt2), ("t5", t5)):
        build_model(cfg, gradient_checkpointing=False, seed=0).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return root


def flags(root: Path, model: str, *extra: str) -> list[str]:
    return ["--model_path", str(root / model), "--data_path", str(root / "d.jsonl"), "--output_dir",
            str(root / "runs"), "--cache_dir", str(root / "cache"), *SAME, *extra]  # fmt: skip


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def runs(root):
    """The shared runs: GPT-2 4 x 2 (STEPS, a checkpoint every step) with a copy of it killed by
    SIGKILL in a child process, then resumed; GPT-2 8 x 1; T5 4 x 2 and 8 x 1."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    ref = flags(
        root,
        "gpt2",
        "--batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--max_steps",
        str(STEPS),
        "--save_every",
        "1",
        "--keep_checkpoints",
        "20",
    )
    child = subprocess.Popen(
        [train_python(), "-m", "train", "sft", *ref, "--run_name", "killed"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert run_cli("sft", *ref, "--run_name", "ref") == 0  # while the child imports
    metrics, deadline = root / "runs" / "killed" / "metrics.jsonl", time.monotonic() + 120
    while child.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            os.killpg(child.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, err[-2000:]
    assert run_cli("sft", *ref, "--run_name", "killed", "--resume", "1") == 0
    assert (
        run_cli("sft", *flags(root, "gpt2", "--batch_size", "8", "--max_steps", "2", "--run_name", "b8")) == 0
    )
    for name, batch, accum in (("t5", "4", "2"), ("t5b8", "8", "1")):
        argv = flags(
            root,
            "t5",
            "--batch_size",
            batch,
            "--gradient_accumulation_steps",
            accum,
            "--max_steps",
            "3",
            "--save_every",
            "1",
            "--keep_checkpoints",
            "5",
            "--run_name",
            name,
        )
        assert run_cli("sft", *argv) == 0
    return root / "runs"


def kit_and_peft(folder: Path):
    """(the kit's model after lora.wrap, peft's own PeftModel of a copy): the same adapter weights,
    lora_B made non-zero (at init B = 0 and the adapter adds nothing)."""
    from peft import PeftModel

    from train.data.chat.encode import stop_token_ids
    from train.data.tokenizer import chat_tokens, folder_tokenizer
    from train.models import load

    tok = folder_tokenizer(folder, f"MODEL_PATH={folder}", False)
    chat_tokens(tok)
    model = load.load_pretrained(folder, False, load.family_of_folder(folder, False))
    load.fit_tokenizer(model, tok, stop_token_ids(tok), lambda *a: None)
    load.ready(model, False)
    model.eval()
    base = type(model).from_pretrained(folder, local_files_only=True).eval()
    base.resize_token_embeddings(model.get_input_embeddings().num_embeddings)
    base.load_state_dict(model.state_dict())  # the same resized rows
    model = lora.wrap(model, 4, None, 0.0, None, lambda *a: None)
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    folder_out = folder.parent / f"adapter-{folder.name}"
    lora.save_adapter(model, folder_out)
    peft = PeftModel.from_pretrained(base, folder_out).eval()
    return model, peft, tok


def batch_of(tok, seq2seq: bool) -> dict:
    texts = ["Say 3 twice. 3 3.", "Say 12 twice. 12 12. 12 12. 12 12."]
    enc = tok(texts, padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, IGNORE_INDEX)
    labels[:, :3] = IGNORE_INDEX  # the prompt
    if seq2seq:
        return {
            "input_ids": enc["input_ids"][:, :5],
            "attention_mask": enc["attention_mask"][:, :5],
            "labels": labels,
        }
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_the_kits_loss_is_peft_forward_and_checkpointing_trains_the_adapters(root, name):
    model, peft, tok = kit_and_peft(root / name)
    batch = batch_of(tok, name == "t5")
    with torch.no_grad():
        ours = forward_loss(model, dict(batch), torch.device("cpu"), "fp32", layout=FAMILIES[name].layout)
        theirs = peft(**batch).loss
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert ours.item() > 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)  # the model itself frozen
    from train.core.model import enable_checkpointing

    enable_checkpointing(model)
    model.train()
    forward_loss(model, dict(batch), torch.device("cpu"), "fp32", layout=FAMILIES[name].layout).backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_accumulation_of_n_batches_equals_one_batch_of_n_times_b(runs):
    np.testing.assert_allclose(losses(runs / "b8"), losses(runs / "ref")[:2], rtol=0, atol=1e-5)
    np.testing.assert_allclose(losses(runs / "t5b8"), losses(runs / "t5")[:3], rtol=0, atol=1e-5)
    assert losses(runs / "ref")[-1] < losses(runs / "ref")[0]  # the adapters learn


def test_resume_after_sigkill_repeats_the_uninterrupted_losses(runs):
    summary = json.loads((runs / "killed" / "summary.json").read_text())
    assert summary["resumed_from_step"] >= 1 and summary["steps"] == STEPS
    np.testing.assert_allclose(losses(runs / "killed"), losses(runs / "ref"), rtol=0, atol=1e-5)
    # a checkpoint holds the adapters alone; the frozen weights are MODEL_PATH's
    from safetensors.torch import load_file

    saved = load_file(list_checkpoints(runs / "ref" / "checkpoints")[0] / "model.safetensors")
    assert saved and all(".lora_" in key for key in saved)
    decisions = {d["setting"]: d for d in json.loads((runs / "ref" / "config.json").read_text())["decisions"]}
    assert decisions["lora_targets"]["value"] == "c_attn,c_fc,c_proj"
    assert decisions["trainable_params"]["value"] == sum(t.numel() for t in saved.values())


def test_t5_resumes_from_a_checkpoint_to_the_same_losses(runs):
    again = runs / "t5again"
    shutil.copytree(runs / "t5", again, symlinks=True)
    for path in list_checkpoints(again / "checkpoints")[:-1]:  # keep step 1 only
        shutil.rmtree(path)
    shutil.rmtree(again / "final")
    (again / "summary.json").unlink()
    argv = flags(
        runs.parent,
        "t5",
        "--batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--max_steps",
        "3",
        "--save_every",
        "1",
        "--keep_checkpoints",
        "5",
        "--run_name",
        "t5again",
        "--resume",
        "1",
    )
    assert run_cli("sft", *argv) == 0
    np.testing.assert_allclose(losses(again), losses(runs / "t5"), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["ref", "t5"])
def test_final_is_the_merged_model_and_adapter_plus_base_gives_its_logits(runs, name):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if name == "t5" else AutoModelForCausalLM
    final = runs / name / "final"
    merged = auto.from_pretrained(final, local_files_only=True).eval()  # plain transformers: no peft
    assert not any("lora" in key or "base_layer" in key for key in merged.state_dict())
    adapter = json.loads((final / "adapter" / "adapter_config.json").read_text())
    base = auto.from_pretrained(adapter["base_model_name_or_path"], local_files_only=True)
    base.resize_token_embeddings(merged.config.vocab_size)  # the kit's chat markers (GPT-2 here)
    with_adapter = PeftModel.from_pretrained(base, final / "adapter").eval()
    ids = torch.randint(0, 360, (2, 12), generator=torch.Generator().manual_seed(0))
    extra = {"decoder_input_ids": ids[:, :7]} if name == "t5" else {}
    with torch.no_grad():
        a, b = merged(input_ids=ids, **extra).logits, with_adapter(input_ids=ids, **extra).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    plain = auto.from_pretrained(adapter["base_model_name_or_path"], local_files_only=True).eval()
    plain.resize_token_embeddings(merged.config.vocab_size)
    with torch.no_grad():
        # it trained
        assert (plain(input_ids=ids, **extra).logits[..., :300] - a[..., :300]).abs().max() > 1e-3


def test_peft_auto_loader_takes_final_adapter_offline(runs, monkeypatch):
    """AutoPeftModelForCausalLM.from_pretrained(final/adapter) once failed (8256 rows vs MODEL_PATH's
    8192) wherever the kit resized the embeddings: the adapter names the resized base it applies to."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    final = runs / "ref" / "final"
    adapter = json.loads((final / "adapter" / "adapter_config.json").read_text())
    # not the temporary name
    assert adapter["base_model_name_or_path"] == str(final.absolute() / "adapter" / "base")
    with_adapter = AutoPeftModelForCausalLM.from_pretrained(final / "adapter", local_files_only=True).eval()
    merged = AutoModelForCausalLM.from_pretrained(final, local_files_only=True).eval()
    ids = torch.randint(0, 360, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=0, atol=1e-5
        )


def test_two_ddp_processes_equal_one(runs):
    """2 processes x batch 4 (gloo, through the launcher) take the step's 8 rows one process takes."""
    root = runs.parent
    env = {
        "NPROC_PER_NODE": "2",
        "MODEL_PATH": str(root / "gpt2"),
        "DATA_PATH": str(root / "d.jsonl"),
        "OUTPUT_DIR": str(root / "runs"),
        "CACHE_DIR": str(root / "cache"),
        "RUN_NAME": "ddp",
        "MAX_LENGTH": "64",
        "MAX_STEPS": "2",
        "NUM_WORKERS": "0",
        "LOG_EVERY": "1",
        "SEED": "7",
        "LORA_R": "4",
        "LORA_DROPOUT": "0",
        "WARMUP_STEPS": "1",
        "LEARNING_RATE": "1e-2",
        "OMP_NUM_THREADS": "1",
    }
    result = launch("train_sft_custom.sh", env, "4", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((runs / "ddp" / "summary.json").read_text())["world_size"] == 2
    np.testing.assert_allclose(losses(runs / "ddp"), losses(runs / "b8"), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "extra, line",
    [
        (["--lora_targets", "c_attn,nope"], "LORA_TARGETS=c_attn,nope: 'nope' names no layer of this gpt2 "
                                            "model"),
        (["--lora_targets", "ln_1"], "LORA_TARGETS=ln_1:"),
        # once failed at the save
        (["--lora_targets", "wte"], "LORA_TARGETS=wte: 'wte' is the token embeddings"),
        (["--lora_targets", "c_attn,lm_head"], "LORA_TARGETS=c_attn,lm_head: 'lm_head' is the output head"),
        # once an OOM
        (["--lora_r", "100000"], "LORA_R=100000: above the rank of every adapted layer (at most "),
        (["--lora_dropout", "1"], "LORA_DROPOUT=1.0: expected a probability below 1"),
        (["--sharding", "zero2"], "LORA_R=4 with SHARDING=zero2: not built"),
        (["--lora_r", "-1"], "LORA_R (--lora_r): expected a whole number >= 0"),
    ],
)
def test_bad_lora_settings_are_one_line_exit_2(root, extra, line, capsys):
    assert run_cli("sft", *flags(root, "gpt2", "--run_name", "bad", "--max_steps", "1", *extra)) == 2
    err = capsys.readouterr().err
    assert line in err and "Traceback" not in err
    assert not (root / "runs" / "bad").exists()


def test_a_resume_with_another_lora_r_is_one_line(runs, capsys):
    before = (runs / "ref" / "metrics.jsonl").read_text()
    for extra, now in ((["--lora_r", "8"], "8"), (["--lora_r", "0"], "(empty)")):
        argv = flags(
            runs.parent,
            "gpt2",
            "--batch_size",
            "4",
            "--gradient_accumulation_steps",
            "2",
            "--max_steps",
            str(STEPS + 2),
            "--run_name",
            "ref",
            "--resume",
            "1",
            *extra,
        )
        assert run_cli("sft", *argv) == 2
        assert (
            f"holds LoRA adapters of LORA_R=4, this run has LORA_R={now}; resume with LORA_R=4"
            in capsys.readouterr().err
        )
    assert (runs / "ref" / "metrics.jsonl").read_text() == before


def test_lora_on_a_model_sft_builds_new_is_refused_before_any_work(tmp_path, capsys):
    argv = ["--model_size", "nano", "--lora_r", "4", "--output_dir", str(tmp_path / "runs"),
            "--cache_dir", str(tmp_path / "cache"), "--max_steps", "1", "--run_name", "new"]  # fmt: skip
    assert run_cli("sft", *argv) == 2
    err = capsys.readouterr().err
    assert "LORA_R=4: SFT builds this model new (MODEL_CONFIG / MODEL_SIZE)" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()  # no tokenizer trained


def test_freeze_over_every_adapter_is_one_line(root, capsys):
    assert (
        run_cli(
            "sft", *flags(root, "gpt2", "--run_name", "frozen", "--max_steps", "1", "--freeze", "decoder")
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "FREEZE=decoder: that freezes every parameter still trained (with LORA_R: the adapters too)" in err
    assert "Traceback" not in err and not (root / "runs" / "frozen").exists()


def test_lora_settings_without_lora_r_are_one_line(root, capsys):
    argv = [
        a
        for a in flags(root, "gpt2", "--run_name", "stray", "--max_steps", "1")
        if a not in ("--lora_r", "4")
    ]
    assert run_cli("sft", *argv, "--lora_targets", "c_attn") == 2
    assert "LORA_TARGETS set but LORA_R is empty" in capsys.readouterr().err
