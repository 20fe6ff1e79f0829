"""T5 pretraining on raw text with span corruption, on a tiny real T5 (2+2 layers, width 32):
the noise mask and sentinel layout on a known window, token-correct accumulation on uneven
targets, golden losses of a seeded run, SIGKILL then RESUME=1 equal to the uninterrupted run, a
2-process DDP run (torchrun, gloo) equal to it too, final/ generating with AutoModelForSeq2SeqLM
offline, and a BERT config refused in one line.

The killed run and the DDP run start first, in child processes, so their torch imports overlap
the reference run trained here."""

import json
import os
import random
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from tiny_tools import one_thread

from conftest import ROOT, launcher_env, read_jsonl, run_cli, train_python
from train.core.seq2seq import corrupted_lengths, span_lengths
from train.data import span_corruption as sc
from train.data.chat.batching import Seq2SeqCollator
from train.models.family import ENCODER_DECODER

GOLDEN = ROOT / "tests" / "golden" / "t5_span_losses.json"
STEPS = 40
TINY_T5 = {
    "model_type": "t5",
    "d_model": 32,
    "d_ff": 64,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 2,
    "d_kv": 16,
    "n_positions": 512,
    "dropout_rate": 0.0,
    "feed_forward_proj": "relu",
    "tie_word_embeddings": True,
}
# One process at 4 x accumulation 2 and two processes at 4 each take the same 8 samples a step.
RUN = [
    "--max_steps",
    str(STEPS),
    "--save_every",
    "4",
    "--keep_checkpoints",
    "20",
    "--seed",
    "7",
    "--log_every",
    "1",
]
ONE = ["--batch_size", "4", "--gradient_accumulation_steps", "2"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def base(corpus, cache_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("t5")
    (folder / "t5").mkdir()
    (folder / "t5" / "config.json").write_text(json.dumps(TINY_T5))
    runs = folder / "runs"
    flags = [
        "--model_config", str(folder / "t5"), "--data_path", str(corpus), "--vocab_size", "512",
        "--cache_dir", str(cache_dir), "--output_dir", str(runs), "--max_length", "32",
    ]  # fmt: skip
    return runs, flags


def child_env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)


@pytest.fixture(scope="module")
def runs(base):
    """The reference run (here), a run SIGKILLed at a random step and a 2-process DDP run."""
    runs, flags = base
    # The shared token cache and tokenizer first, so the children find them built.
    assert run_cli("pretrain", *flags, "--max_steps", "1", "--batch_size", "4", "--run_name", "warm") == 0
    argv = [train_python(), "-m", "train", "pretrain", *flags, *RUN, *ONE, "--run_name", "killed"]
    killed = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    config, data, cache = flags[1], flags[3], flags[7]
    ddp_env = launcher_env(
        dict(  # torchrun and its ranks forks of the tests' server (KIT_PYTHON)
            OMP_NUM_THREADS="1",
            NPROC_PER_NODE="2",
            MODEL_CONFIG=config,
            DATA_PATH=data,
            VOCAB_SIZE="512",
            CACHE_DIR=cache,
            OUTPUT_DIR=str(runs),
            MAX_LENGTH="32",
            BATCH_SIZE="4",
            GRADIENT_ACCUM="1",
            NUM_WORKERS="0",
            MAX_STEPS=str(STEPS),
            SEED="7",
            LOG_EVERY="1",
            RUN_NAME="ddp",
        )
    )
    ddp = subprocess.Popen(
        ["bash", str(ROOT / "run_single_gpu_optimized.sh")],
        env=ddp_env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    at, metrics = random.randint(6, STEPS - 20), runs / "killed" / "metrics.jsonl"

    def kill_at_step() -> None:  # beside the reference run: on a loaded machine the child can finish first
        deadline = time.monotonic() + 200
        while killed.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= at:
                os.killpg(killed.pid, signal.SIGKILL)
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=kill_at_step, daemon=True)
    watcher.start()
    assert run_cli("pretrain", *flags, *RUN, *ONE, "--run_name", "ref") == 0
    watcher.join(timeout=200)
    try:
        _, err = killed.communicate(timeout=60)  # the kill lands, or the run ended by itself
    except subprocess.TimeoutExpired:
        os.killpg(killed.pid, signal.SIGKILL)
        pytest.fail(f"the run to kill did not reach step {at} in 200 s")
    if killed.returncode != -signal.SIGKILL:
        pytest.fail(f"the run to kill ended (exit {killed.returncode}) before step {at}: {err[-2000:]}")
    try:
        out, err = ddp.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(ddp.pid, signal.SIGKILL)
        pytest.fail("the 2-process run did not finish in 300 s")
    assert ddp.returncode == 0, err[-3000:]
    return {"ref": runs / "ref", "killed": (killed.returncode, at), "ddp": runs / "ddp"}


def losses(run) -> list[float]:
    return [row["loss"] for row in read_jsonl(run / "metrics.jsonl") if "loss" in row]


def test_noise_mask_and_sentinels_on_a_known_window():
    window = np.arange(100, 120)  # 20 tokens: 3 noise tokens in 1 span, at the end
    sentinels = [900 + k for k in range(100)]  # <extra_id_0> = 900, <extra_id_1> = 901 ...
    mask = sc.random_spans_noise_mask(len(window), np.random.default_rng([7, 3]))
    source, target = sc.corrupt(window, mask, sentinels, eos_id=0)
    assert np.flatnonzero(mask).tolist() == [17, 18, 19]
    assert source.tolist() == [*range(100, 117), 900, 0] and target.tolist() == [900, 117, 118, 119, 0]
    # 70 tokens: 10 noise tokens in 3 spans; kept and noise runs alternate, span k -> sentinel k.
    window = np.arange(1000, 1070)
    mask = sc.random_spans_noise_mask(len(window), np.random.default_rng([7, 11]))
    source, target = sc.corrupt(window, mask, sentinels, eos_id=0)
    assert np.flatnonzero(mask).tolist() == [29, 30, 35, 36, 37, 38, 39, 40, 68, 69]
    assert source.tolist() == [*range(1000, 1029), 900, *range(1031, 1035), 901, *range(1041, 1068), 902, 0]
    assert target.tolist() == [900, 1029, 1030, 901, *range(1035, 1041), 902, 1068, 1069, 0]
    assert (len(source), len(target)) == corrupted_lengths(70) == (64, 14)
    for length in (3, 34, 70, 568, 1001):  # every length: T5's counts, the window ends in noise
        mask = sc.random_spans_noise_mask(length, np.random.default_rng([1, length]))
        src, tgt = sc.corrupt(np.arange(length) + 200, mask, list(range(5000, 5200)), 1)
        assert (len(src), len(tgt)) == corrupted_lengths(length) and mask[-1] and not mask[0]
    assert span_lengths(32) == (34, 8) and span_lengths(512) == (568, 114)


def test_samples_are_a_function_of_seed_and_index():
    windows = [{"input_ids": torch.arange(i * 70, i * 70 + 70)} for i in range(6)]
    a, b = (sc.SpanCorruptionDataset(windows, list(range(5000, 5100)), 0, seed=7) for _ in range(2))
    reverse = [b[i] for i in reversed(range(6))][::-1]  # another order, a fresh object: the same samples
    assert all(torch.equal(a[i]["input_ids"], reverse[i]["input_ids"]) for i in range(6))
    masks = {tuple(int(t) >= 5000 for t in a[i]["input_ids"]) for i in range(6)}
    assert len(masks) > 1  # another index, another mask
    other = sc.SpanCorruptionDataset(windows, list(range(5000, 5100)), 0, seed=8)
    assert any(not torch.equal(a[i]["labels"], other[i]["labels"]) for i in range(6))


def tiny_t5():
    from transformers import T5Config

    from train.models.build import build_model, set_special_tokens

    cfg = T5Config(vocab_size=128, **{k: v for k, v in TINY_T5.items() if k != "model_type"})
    set_special_tokens(cfg, eos_id=1, pad_id=0)
    return build_model(cfg, gradient_checkpointing=False, seed=0)


def test_accumulation_on_uneven_targets_equals_one_big_batch():
    """4 x micro-batch 2 == one batch of 8, with sources and targets of different lengths (the
    contract's padding: pad in the source, -100 in the labels) through the real train_step."""
    from train.core.step import train_step

    gen = torch.Generator().manual_seed(0)
    rows = [
        {
            "input_ids": torch.randint(2, 128, (int(s),), generator=gen),
            "labels": torch.randint(2, 128, (int(t),), generator=gen),
        }
        for s, t in zip(
            torch.randint(3, 12, (8,), generator=gen), torch.randint(1, 9, (8,), generator=gen), strict=True
        )
    ]
    collate = Seq2SeqCollator(0)
    assert len({len(r["labels"]) for r in rows}) > 3
    big = collate(rows)
    assert (
        big["labels"].eq(-100).any()
        and big["attention_mask"].eq(0).any()
        and big["n_real_tokens"] < big["n_padded_tokens"]
    )
    weights = []
    for micro, accum in ((8, 1), (2, 4)):
        model = tiny_t5()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        stream = iter(collate(rows[i : i + micro]) for i in range(0, 8, micro))
        train_step(
            model, optimizer, scaler, stream, accum, 0.0, torch.device("cpu"), "fp32", layout=ENCODER_DECODER
        )
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.equal(weights[0], torch.cat([p.detach().flatten() for p in tiny_t5().parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-5, atol=1e-6)


def test_seeded_run_matches_golden_losses_and_final_generates(runs, capsys):
    ref = runs["ref"]
    rows = read_jsonl(ref / "metrics.jsonl")
    got = {"losses": losses(ref), "val_loss": [r["val_loss"] for r in rows if "val_loss" in r]}
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    for key in golden:  # key by key: a missing key fails as loudly as a changed number
        np.testing.assert_allclose(got[key], golden[key], rtol=2e-4, err_msg=key)
    assert got["losses"][-1] < got["losses"][0]
    summary = json.loads((ref / "summary.json").read_text())
    assert (
        summary["max_length"] == 32
        and summary["samples"] == STEPS * 8
        and summary["tokens"] == STEPS * 8 * (32 + 8)
    )  # source + target tokens
    decided = {d["setting"]: d for d in json.loads((ref / "config.json").read_text())["decisions"]}
    assert "raw windows of 34 tokens -> source 32, target 8" in decided["objective"]["reason"]

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    final = ref / "final"
    model = AutoModelForSeq2SeqLM.from_pretrained(final, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(final, local_files_only=True)
    gen = json.loads((final / "generation_config.json").read_text())
    assert gen["use_cache"] is True and gen["decoder_start_token_id"] == model.config.pad_token_id
    sentinel = tok.convert_tokens_to_ids("<extra_id_0>")
    assert tok("a <extra_id_0> b")["input_ids"].count(sentinel) == 1  # one id, never split
    assert "<extra_id_99>" in tok.get_vocab() and model.config.vocab_size >= len(tok)
    ids = tok("the quick <extra_id_0> over a lazy dog", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (1, 7) and out[0, 0] == model.config.decoder_start_token_id
    capsys.readouterr()
    assert (
        run_cli(
            "generate",
            "--model",
            str(final),
            "--prompt",
            "the quick <extra_id_0> dog",
            "--temperature",
            "0",
            "--max_new_tokens",
            "5",
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "encoder's source" in captured.err and captured.out.strip()


def test_sigkill_then_resume_matches_the_uninterrupted_run(base, runs):
    _, flags = base
    (rc, at), killed = runs["killed"], runs["ref"].parent / "killed"
    assert rc == -signal.SIGKILL and not (killed / "summary.json").exists()
    assert run_cli("pretrain", *flags, *RUN, *ONE, "--run_name", "killed", "--resume", "1") == 0
    summary = json.loads((killed / "summary.json").read_text())
    resumed = summary["resumed_from_step"]
    assert 4 <= resumed and summary["steps"] == STEPS, (at, resumed)
    rows = [r for r in read_jsonl(killed / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    np.testing.assert_allclose(losses(killed)[resumed:], losses(runs["ref"])[resumed:], rtol=0, atol=1e-5)


def test_two_process_ddp_run_equals_one_process(runs):
    ddp = runs["ddp"]
    summary = json.loads((ddp / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["effective_batch_size"] == 8 and summary["steps"] == STEPS
    # Span corruption gives every sample the same target length: the ranks' token means average
    # to the one-process mean, so the two runs take the same steps.
    np.testing.assert_allclose(losses(ddp), losses(runs["ref"]), rtol=2e-4)


def test_bert_config_is_refused_in_one_line(tmp_path, tiny_flags, capsys):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(
        json.dumps(
            {
                "model_type": "bert",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 128,
            }
        )
    )
    flags = [*tiny_flags]
    flags[flags.index("--model_config") + 1] = str(tmp_path / "bert")
    capsys.readouterr()
    assert run_cli("pretrain", *flags, "--max_steps", "1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'bert'" in err[0] and "t5" in err[0] and "Config" not in err[0], err
    assert not (tmp_path / "runs").exists()
