"""Validation: the held-out split, val_loss rows, the loss against a plain loop, best/."""

import json

import numpy as np
import pytest
import torch

from conftest import read_jsonl, run_cli
from train.config.flags import parse_training_args
from train.core.errors import UsageError
from train.data import text as data
from train.data.holdout import val_windows
from train.data.loader import make_val_loader
from train.models.family import CAUSAL_LM
from train.run.loop.evaluate import evaluate
from train.run.plan.build import build


def test_val_windows_arithmetic():
    assert val_windows(10_000, 0.01, 80) == 100  # the fraction already fills the passes
    assert val_windows(10_000, 0.001, 80) == 80  # raised to EVAL_BATCHES x VAL_ROWS
    assert val_windows(500, 0.01, 80) == 50  # ... but never past 10 % of the data
    assert val_windows(5, 0.01, 80) == 1  # tiny data: still one held-out window
    assert val_windows(10_000, 0.0, 80) == 0  # VAL_FRACTION=0: no validation
    assert val_windows(1, 0.2, 80) == 0  # nothing to hold out from a single window


def test_held_out_split_does_not_depend_on_batch_size():
    """Runs that differ only in BATCH_SIZE (make compare: baseline 8, optimized 32) train and
    validate on the same data."""
    from train.data.pretraining import split_pretraining

    def split(batch_size):
        cfg = parse_training_args("pretrain", ["--batch_size", str(batch_size), "--val_fraction", "0.001"])
        _, val = split_pretraining(
            cfg.data, cfg.run.eval_batches, list(range(5000)), None, None, 64, print, lambda *a: None
        )
        return list(val)

    assert split(4) == split(8) == split(32) == list(range(5000 - 160, 5000))  # 20 x 8 rows


def test_eval_rows_and_val_loss_equal_a_plain_loop(tiny_flags, tmp_path, corpus, cache_dir):
    argv = [*tiny_flags, "--batch_size", "4", "--max_steps", "10", "--eval_every", "5", "--eval_batches", "3"]
    assert run_cli("pretrain", *argv, "--keep_best", "1", "--run_name", "v", "--seed", "7") == 0
    run = tmp_path / "runs" / "v"
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r]
    assert [(r["step"], r["samples"]) for r in rows] == [(5, 20), (10, 40)]
    assert all(r["val_ppl"] == pytest.approx(np.exp(r["val_loss"])) for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_val_loss"] == rows[-1]["val_loss"]
    assert summary["best_val_loss"] == min(r["val_loss"] for r in rows)
    assert (run / "best" / "model.safetensors").exists() and (run / "final" / "model.safetensors").exists()
    log = (run / "train.log").read_text()
    assert "eval step 10: val_loss" in log and "resolved config:" in log
    assert "step 10/10 loss" in log and " ETA 0:00" in log

    # The plain loop: the last val_sequences windows of the token stream, batches of 4 in
    # order, model(**batch, labels=...) on the saved final model in eval mode.
    from transformers import AutoModelForCausalLM

    files = data.corpus_files(str(corpus))
    key = data.corpus_fingerprint(files)
    tok = data.load_tokenizer(None, files, key, 512, cache_dir, print)
    tokens = data.token_cache(files, key, tok, cache_dir, print)
    n_windows, n_val = len(tokens) // 64, summary["val_sequences"]
    windows = np.asarray(tokens[: n_windows * 64], dtype=np.int64).reshape(n_windows, 64)[n_windows - n_val :]
    model = AutoModelForCausalLM.from_pretrained(run / "final", local_files_only=True).eval()
    losses = []
    with torch.no_grad():
        for i in range(n_val // 4):  # EVAL_BATCHES x 8 sequences, read 4 at a time
            ids = torch.from_numpy(windows[4 * i : 4 * i + 4])
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    assert summary["final_val_loss"] == pytest.approx(np.mean(losses), rel=1e-6)


def test_split_is_the_tail_and_never_trained_on(tiny_flags):
    cfg = parse_training_args("pretrain", [*tiny_flags, "--batch_size", "4", "--max_steps", "1"])
    b = build(cfg, lambda line: None)
    n_train, n_val = len(b.dataset), len(b.val_dataset)
    assert list(b.val_dataset.indices) == list(range(n_train, n_train + n_val))
    assert max(b.dataset.indices) < min(b.val_dataset.indices)
    assert any(d["setting"] == "validation" for d in b.decisions)


def test_val_fraction_zero_and_val_path(tiny_flags, tmp_path):
    cfg = parse_training_args("pretrain", [*tiny_flags, "--max_steps", "1", "--val_fraction", "0"])
    b = build(cfg, lambda line: None)
    assert b.val_dataset is None and len(b.dataset) > 0
    held = tmp_path / "held.txt"
    held.write_text("Seven wise kings sang about rivers and bread.\n" * 60)
    cfg = parse_training_args("pretrain", [*tiny_flags, "--max_steps", "1", "--val_path", str(held)])
    b = build(cfg, lambda line: None)
    assert len(b.val_dataset) > 0 and not hasattr(b.dataset, "indices")  # all of DATA_PATH trains


def test_evaluate_weights_by_predicted_tokens_and_restores_mode():
    """SFT-style batches (labels with -100, attention_mask) go through unchanged; the mean is
    per predicted token, like one big batch."""
    from test_train_core import tiny_model

    model = tiny_model()
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (5, 16))
    labels = ids.clone()
    labels[:, :6] = -100  # a prompt that carries no loss
    labels[4, 6:12] = -100
    rows = [
        {"input_ids": ids[i], "labels": labels[i], "attention_mask": torch.ones(16, dtype=torch.long)}
        for i in range(5)
    ]
    loader = make_val_loader(rows, 2, torch.device("cpu"))  # batches of 2, 2, 1
    model.train()
    loss = evaluate(model, loader, 10, torch.device("cpu"), "fp32", layout=CAUSAL_LM)
    assert model.training
    model.eval()
    with torch.no_grad():
        whole = model(input_ids=ids, labels=labels).loss.item()
    assert loss == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize(
    "argv, variable",
    [
        (["--val_fraction", "0.7"], "VAL_FRACTION"),
        (["--val_fraction", "-0.1"], "VAL_FRACTION"),
        (["--val_path", "/no/such/val.txt"], "VAL_PATH"),
        (["--eval_every", "-1"], "EVAL_EVERY"),
        (["--eval_batches", "0"], "EVAL_BATCHES"),
        (["--keep_best", "maybe"], "KEEP_BEST"),
    ],
)
def test_bad_eval_settings_name_the_variable(argv, variable):
    with pytest.raises(UsageError) as err:
        parse_training_args("pretrain", argv)
    assert variable in str(err.value) and "\n" not in str(err.value)


def test_train_log_gets_library_warnings(tmp_path):
    import logging
    import warnings

    from train.run.rundir.folder import RunDir
    from train.run.rundir.runlog import Console, capture_warnings

    console = Console()
    shown = warnings.showwarning
    with capture_warnings(console):
        logging.getLogger("transformers.modeling_utils").warning("before the run folder\nsecond line")
        console.attach(RunDir(tmp_path / "run", overwrite=False))
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a deprecated knob", FutureWarning, stacklevel=1)
    assert warnings.showwarning is shown  # hooks removed after the run
    logging.getLogger("transformers").warning("after the run: not logged")
    console.run_dir.close()
    lines = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert lines == [
        "warning: [transformers] before the run folder",
        "warning: FutureWarning: a deprecated knob",
    ]


def test_a_resumed_keep_best_run_remembers_the_best_before_it(tiny_flags, tmp_path):
    """best/ holds the lowest validation loss of the whole run, not of the part after a resume (a
    resumed run started with no best, so its first pass overwrote best/ however worse)."""
    import json
    import shutil

    from conftest import run_cli
    from train.run.checkpoint.on_disk import list_checkpoints

    argv = [*tiny_flags, "--batch_size", "4", "--eval_every", "1", "--eval_batches", "1", "--keep_best", "1",
            "--save_every", "1", "--keep_checkpoints", "3", "--run_name", "r"]  # fmt: skip
    assert run_cli("pretrain", *argv, "--max_steps", "3") == 0
    run = tmp_path / "runs" / "r"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # step 1's pass made the best by far: what a resume must not forget
        row["val_loss"] = 0.001 if row.get("step") == 1 and "val_loss" in row else row.get("val_loss")
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in rows)
    )
    shutil.rmtree(list_checkpoints(run / "checkpoints")[-1])  # resume from step 2
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    best_before = (run / "best" / "model.safetensors").read_bytes()
    assert run_cli("pretrain", *argv, "--max_steps", "3", "--resume", "1") == 0
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["best_val_loss"], summary["best_val_step"]) == (0.001, 1)
    assert (run / "best" / "model.safetensors").read_bytes() == best_before
