"""Reward training's held-out prompts (VAL_PATH, VAL_FRACTION) on a tiny real GPT-2 (the tests' pretraining
run's final/ as MODEL_PATH): a validation pass every EVAL_EVERY steps and at the end logs val_reward and
val_rewards/<name>/mean (metrics.jsonl, the log line, summary.json's final_val_*), with no perplexity; its
draws come from generators of its own, so a run with validation trains on exactly the completions a run
without draws, and a resumed one repeats both; the refusals are one line, exit 2, no run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import read_jsonl, run_cli

SAME = ("--lr_schedule", "constant", "--warmup_steps", "1", "--save_every", "2")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Prompts with an answer (DATA_PATH), other ones held out (VAL_PATH, another format): 4, no more than a
    2-step run evaluates (make.sized_validation), so a run stopped there and resumed holds out the same."""
    root = tmp_path_factory.mktemp("grpo-val")
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n"
                                              for i in range(12)))  # fmt: skip
    (root / "val.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)})
        + "\n" for i in range(4)))  # fmt: skip
    return root


def argv(root: Path, model: Path, name: str, *more: str, fresh: bool = True) -> list[str]:
    return ["grpo", "--model_path", str(model), "--data_path", str(root / "train.jsonl"),
            "--output_dir", str(root / "runs"), "--cache_dir", str(root / "cache"), "--batch_size", "2",
            "--num_generations", "4", "--max_completion_length", "6", "--max_steps", "3", "--log_every", "1",
            "--learning_rate", "1e-3", "--reward_funcs", "accuracy,format", "--reward_pattern", "e",
            "--run_name", name, *SAME, *(("--overwrite", "1") if fresh else ()), *more]  # fmt: skip


def rows(run: Path) -> tuple[list[dict], list[dict]]:
    """(the training rows, the validation rows) of a run's metrics.jsonl."""
    every = read_jsonl(run / "metrics.jsonl")
    return [r for r in every if "loss" in r], [r for r in every if "val_loss" in r]


TRAINED = ("loss", "reward", "reward_std", "completions/mean_length", "entropy", "grad_norm")


def test_validation_logs_val_reward_and_leaves_the_training_draws_as_they_were(root, base_model, capsys):
    val = ("--val_path", str(root / "val.jsonl"), "--eval_every", "1")
    assert run_cli(*argv(root, base_model, "plain")) == 0
    assert run_cli(*argv(root, base_model, "val", *val)) == 0
    out = capsys.readouterr().out
    assert "validation = 4 prompts" in out and "eval step 1: val_loss" in out and "val_reward " in out
    assert run_cli(*argv(root, base_model, "split", *val, "--max_steps", "2")) == 0
    assert run_cli(*argv(root, base_model, "split", *val, "--resume", "1", fresh=False)) == 0
    plain, _ = rows(root / "runs" / "plain")
    trained, checked = rows(root / "runs" / "val")
    resumed, again = rows(root / "runs" / "split")
    assert [r["step"] for r in trained] == [r["step"] for r in resumed] == [1, 2, 3]
    for a, b, c in zip(plain, trained, resumed, strict=True):  # the same completions drawn, the same steps
        for name in TRAINED:
            assert a[name] == b[name], (a["step"], name)
            assert a[name] == pytest.approx(c[name], rel=1e-5, abs=1e-6), (a["step"], name)
    assert [r["step"] for r in checked] == [r["step"] for r in again] == [1, 2, 3]
    for a, b in zip(checked, again, strict=True):  # every pass draws alike: the resumed run's are the same
        for name in ("val_loss", "val_reward", "val_rewards/accuracy/mean", "val_rewards/format/mean"):
            assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-6), (a["step"], name)
    assert all(r["val_ppl"] is None and r["samples"] == 2 * r["step"] for r in checked)
    assert len({r["val_reward"] for r in checked}) > 1  # the weights moved, and the passes see it
    summary = json.loads((root / "runs" / "val" / "summary.json").read_text())
    assert summary["final_val_reward"] == pytest.approx(checked[-1]["val_reward"])
    last = checked[-1]
    assert summary["final_val_rewards/format/mean"] == pytest.approx(last["val_rewards/format/mean"])
    assert summary["final_val_ppl"] is None and summary["val_prompts"] == 4 and summary["eval_passes"] == 3
    assert "final_val_reward" not in json.loads((root / "runs" / "plain" / "summary.json").read_text())


def test_val_fraction_holds_out_the_last_prompts_and_tensorboard_gets_val_reward(root, base_model, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    frac = ("--val_fraction", "0.25", "--max_steps", "1", "--report_to", "tensorboard")
    assert run_cli(*argv(root, base_model, "frac", *frac)) == 0
    out = capsys.readouterr().out
    assert "validation = 3 prompts" in out and "eval step 1: val_loss" in out
    run = root / "runs" / "frac"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["prompts"] == 12 and summary["val_prompts"] == 3 and summary["val_sequences"] == 2
    _, checked = rows(run)
    assert [r["step"] for r in checked] == [1] and "val_rewards/format/mean" in checked[0]
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"val/reward", "val/rewards/format/mean", "summary/final_val_reward"} <= scalars, scalars


@pytest.mark.parametrize("flags, message", [
    (("--val_path", "{root}/empty.jsonl"), "VAL_PATH: {root}/empty.jsonl: no records"),
    (("--val_path", "{root}/bare.jsonl"), "REWARD_FUNCS=accuracy: VAL_PATH has no 'answer' or 'solution'"),
    (("--val_fraction", "0.3", "--batch_size", "10", "--max_steps", "1"),
     "DATA_PATH: 8 prompts (VAL_FRACTION held out 4 more) are fewer than one optimizer step needs"),
    (("--keep_best", "1", "--val_fraction", "0.1"),
     "KEEP_BEST (--keep_best) does not apply to reward training"),
])  # fmt: skip
def test_a_bad_held_out_set_is_one_line_exit_2_and_no_run_folder(root, base_model, capsys, flags, message):
    (root / "empty.jsonl").write_text("")
    (root / "bare.jsonl").write_text(json.dumps({"prompt": "Hi."}) + "\n")
    flags = [f.format(root=root) for f in flags]
    assert run_cli(*argv(root, base_model, "refused", *flags)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.format(root=root) in err, err
    assert not (root / "runs" / "refused").exists()


def test_one_prompt_leaves_none_to_hold_out(root, base_model, tmp_path, capsys):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": "Say 1.", "answer": "1"}) + "\n")
    code = run_cli(*argv(root, base_model, "refused", "--data_path", str(one), "--val_fraction", "0.2"))
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "VAL_FRACTION=0.2: 1 prompt(s) leave none to hold out" in err, err
