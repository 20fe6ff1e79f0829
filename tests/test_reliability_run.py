"""Run, checkpoint and config failures made for real, each one line with its exit code and no
traceback: a file-size limit (RLIMIT_FSIZE, as a full disk fails a write) hit inside a
checkpoint's safetensors or torch.save write; T5 configs that cannot train (d_kv, d_ff or
relative_attention_num_buckets 0) and NaN values in a model config; an unknown model_type;
RESUME=1 with another DATA_PATH; RUN_NAME=latest; TOKENIZE_WORKERS above the bound."""

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess

import pytest
from test_write_safety import copy_run, finished  # noqa: F401, F811 (finished: a fixture)

from conftest import ROOT, launcher_env, make_text, run_cli, train_python


def snapshot(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def train(*argv: str, fsize: int | None = None) -> subprocess.CompletedProcess:
    """`python -m train ...` in a child process; fsize: its RLIMIT_FSIZE in bytes, SIGXFSZ
    ignored, so a write past it fails with EFBIG as a write to a full disk fails with ENOSPC."""

    def limit():
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    # the limit and SIGXFSZ pass to a fork
    env = launcher_env({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    return subprocess.run([train_python(), "-m", "train", *argv], cwd=ROOT, env=env, preexec_fn=limit,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def one_line(proc, code: int = 2) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == code and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[
        -3000:
    ]
    return errors[0]


@pytest.fixture(scope="module")
def done(finished):  # noqa: F811
    """A 2-step run with its checkpoint at step 2 (the token cache built), and its flags."""
    return finished


@pytest.mark.parametrize("file", ["model.safetensors", "state.pt"])
def test_file_size_limit_inside_a_checkpoint_write_is_one_line(file, done):
    """RESUME=1 to step 6 under a file-size limit that the step-4 checkpoint's `file` passes:
    safetensors (Rust, "os error 27") or torch.save (C++, "unexpected pos" through a path)."""
    run, flags = copy_run(done, f"fsize-{file}")
    saved = run / "checkpoints" / "step-00000002"
    weights, state = ((saved / n).stat().st_size for n in ("model.safetensors", "state.pt"))
    assert state > weights + 4096  # AdamW's two moments: the limit can fall between the two
    limit = weights // 2 if file == "model.safetensors" else (weights + state) // 2
    before = snapshot(saved)
    outside = snapshot(run.parent / "done")
    proc = train("pretrain", *flags, "--max_steps", "6", "--resume", "1", fsize=limit)
    line = one_line(proc)
    assert line == (
        f"error: disk full: writing checkpoint step-00000004 failed at {file} in {run / 'checkpoints'} (File "
        f"too large); the previous checkpoint step-00000002 is intact; free space or lower KEEP_CHECKPOINTS, "
        f"then RESUME=1 RUN_NAME={run.name} continues the run"
    )
    assert not list((run / "checkpoints").glob(".*")) and not list(run.glob(".*tmp*"))
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")] == [
        "step-00000002"
    ]
    assert snapshot(saved) == before and snapshot(run.parent / "done") == outside
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_reason"] == "write_failed" and summary["write_error"] == line.removeprefix("error: ")
    assert summary["steps"] == 4
    if file == "state.pt":
        return  # the resume below is the same for both
    # and the line's command continues the run once the limit is gone
    assert train("pretrain", *flags, "--max_steps", "6", "--resume", "1").returncode == 0
    assert json.loads((run / "summary.json").read_text())["exit_reason"] == "completed"


T5_TINY = {
    "model_type": "t5",
    "num_layers": 2,
    "num_decoder_layers": 2,
    "d_model": 32,
    "d_ff": 64,
    "num_heads": 2,
    "d_kv": 16,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 32,
}
GPT2_TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}
BAD_CONFIGS = [
    ("T3 d_kv 0", {**T5_TINY, "d_kv": 0}, "d_kv must be a whole number >= 1, got 0"),
    ("T4 d_ff 0", {**T5_TINY, "d_ff": 0}, "d_ff must be a whole number >= 1, got 0"),
    ("T5 buckets 0", {**T5_TINY, "relative_attention_num_buckets": 0},
     "relative_attention_num_buckets must be a whole number >= 4, got 0"),
    ("buckets beyond distance", {**T5_TINY, "relative_attention_max_distance": 4},
     "relative_attention_max_distance (4) must be larger than half of relative_attention_num_buckets (8)"),
    ("E17 NaN epsilon", {**GPT2_TINY, "layer_norm_epsilon": float("nan")},
     "layer_norm_epsilon is nan; a model config's numbers must be finite"),
    ("inf T5 epsilon", {**T5_TINY, "layer_norm_epsilon": float("inf")},
     "layer_norm_epsilon is inf; a model config's numbers must be finite"),
    ("T11 unknown type", {**GPT2_TINY, "model_type": "gpt3-turbo"},
     "unknown model_type 'gpt3-turbo'; this kit trains causal LMs (gpt2, llama, qwen2 ...) and "
     "encoder-decoders "
     "(t5, bart ...)"),
]  # fmt: skip


@pytest.mark.parametrize("label, config, expect", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_a_model_config_that_cannot_train_is_one_line_before_any_run_folder(label, config, expect, done,
                                                                           tmp_path, capsys):  # fmt: skip
    """Each was a ZeroDivisionError (weight init or the first forward, a half-made run folder),
    a NaN run that ended advising a lower LEARNING_RATE, or transformers' 11,745-character list."""
    runs, flags = done
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))  # json writes NaN and Infinity, and reads them back
    out = tmp_path / "runs"
    assert (
        run_cli("pretrain", *flags, "--model_config", str(path), "--output_dir", str(out), "--max_steps", "2")
        == 2
    )
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert errors[0] == f"error: MODEL_CONFIG={path}: {expect}" and len(errors[0]) < 400
    assert not out.exists() or not any(out.iterdir())  # no run folder, half-made or not


def test_the_nan_epsilon_through_the_command_line_exits_2(done, tmp_path):
    """The same refusal in a real `python -m train` process: exit code 2, one line."""
    runs, flags = done
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GPT2_TINY, "layer_norm_epsilon": float("nan")}))
    proc = train("pretrain", *flags, "--model_config", str(path), "--output_dir", str(tmp_path / "runs"))
    assert one_line(proc).endswith("layer_norm_epsilon is nan; a model config's numbers must be finite")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("workers", ["1000", "cores+1"])
def test_tokenize_workers_above_the_cores_is_one_line(workers, done, tmp_path, capsys):
    runs, flags = done
    cores = len(os.sched_getaffinity(0))
    value = str(cores + 1) if workers == "cores+1" else workers
    argv = [*flags, "--output_dir", str(tmp_path / "runs"), "--max_steps", "2", "--tokenize_workers", value]
    assert run_cli("pretrain", *argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"error: TOKENIZE_WORKERS (--tokenize_workers): expected a whole number from 1 to {cores} "
        f"(this machine's CPU cores), got {value}"
    )
    assert not (tmp_path / "runs").exists()


def test_run_name_latest_is_refused_and_a_failed_latest_swap_leaves_no_link(done, tmp_path, capsys):
    """RUN_NAME=latest made a run folder where the runs/latest link goes, and every later run
    left a .latest.<pid> link beside it. Refused now; and where runs/latest is such a folder
    (made by an older kit), a run leaves no temporary link behind."""
    runs, flags = done
    out = tmp_path / "runs"
    assert (
        run_cli("pretrain", *flags, "--output_dir", str(out), "--max_steps", "2", "--run_name", "latest") == 2
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "error: RUN_NAME=latest: that name is the link to the newest run (OUTPUT_DIR/latest); pick another"
    )
    assert not out.exists()
    (out / "latest").mkdir(parents=True)
    (out / "latest" / "keep.txt").write_text("an older kit's run\n")
    assert (
        run_cli("pretrain", *flags, "--output_dir", str(out), "--max_steps", "1", "--run_name", "next") == 0
    )
    assert sorted(p.name for p in out.iterdir()) == ["latest", "next"]
    assert not list((out / "next" / "checkpoints").glob(".latest.*"))
    assert (out / "latest" / "keep.txt").read_text() == "an older kit's run\n"


@pytest.mark.parametrize("size", ["same", "other"])
def test_resume_with_a_data_path_that_trains_another_tokenizer_is_refused(size, done, tmp_path, capsys):
    """E15: the new corpus trains a BPE whose ids mean other text, of the same size (trained
    silently before) or another (named as another model before); the run stays as it was."""
    run, flags = copy_run(done, f"newdata-{size}")
    other = tmp_path / "other.txt"
    if size == "same":  # other sentences of the same words: as many tokens, their ids in another order
        other.write_text(make_text(9, 6000))
    else:  # the words spelled backwards: more merges
        other.write_text(
            "".join(
                " ".join(w[::-1] for w in line.split()) + "\n" for line in make_text(5, 4000).splitlines()
            )
        )
    before = snapshot(run)
    argv = [*flags, "--data_path", str(other), "--max_steps", "4", "--resume", "1"]
    assert run_cli("pretrain", *argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"error: RESUME=1: checkpoint step-00000002 was trained with another tokenizer than this run's "
        f"(DATA_PATH={flags[flags.index('--data_path') + 1]}); a new DATA_PATH or TOKENIZER_PATH gives the "
        f"same "
        "text other token ids: resume with the run's DATA_PATH and TOKENIZER_PATH, or start a new run on the "
        "new data"
    )
    assert snapshot(run) == before
    if size == "other":
        return
    # the run's own DATA_PATH resumes it
    assert run_cli("pretrain", *flags, "--max_steps", "4", "--resume", "1") == 0


@pytest.fixture
def tiny_disk(tmp_path):
    """A real file system that fills: a tmpfs of a given size (root only; skipped elsewhere)."""
    mounted = []

    def make(size: int):
        folder = tmp_path / "disk"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"no tmpfs can be mounted here ({done.stderr.strip() or 'not root'})")
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_real_full_disk_part_way_through_a_checkpoint_is_one_line(done, tiny_disk, monkeypatch, capsys):
    """ENOSPC from the kernel, not a limit: the run folder on a tmpfs that holds one checkpoint
    and not two. The free-space check before the save is set to pass, so the disk fills inside
    the write itself, as when another process fills it during the save."""
    from train.run.checkpoint import on_disk

    runs, flags = done
    size = sum(p.stat().st_size for p in (runs / "done" / "checkpoints" / "step-00000002").iterdir())
    disk = tiny_disk((int(size * 1.5) + (256 << 10)) // 4096 * 4096)
    monkeypatch.setattr(on_disk.CheckpointFolder, "free_bytes", lambda self: 1 << 40)
    argv = [*flags, "--output_dir", str(disk), "--run_name", "full", "--max_steps", "6"]
    assert run_cli("pretrain", *argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    folder = disk / "full" / "checkpoints"
    assert errors[0].startswith("error: disk full: writing checkpoint step-00000004 failed at ")
    assert errors[0].endswith(
        f"in {folder} (No space left on device); the previous checkpoint step-00000002 is intact; free space "
        f"or lower KEEP_CHECKPOINTS, then RESUME=1 RUN_NAME=full continues the run"
    )
    assert [p.name for p in on_disk.list_checkpoints(folder)] == ["step-00000002"]
    meta = json.loads((folder / "step-00000002" / "meta.json").read_text())
    for name, record in meta["files"].items():  # the earlier checkpoint as it was saved
        assert hashlib.sha256((folder / "step-00000002" / name).read_bytes()).hexdigest() == record["sha256"]
    assert not list(folder.glob(".tmp-*")) and not list(folder.glob(".latest.*"))
    summary = json.loads((disk / "full" / "summary.json").read_text())
    assert summary["exit_reason"] == "write_failed" and summary["steps"] == 4


def test_sft_from_a_model_of_an_unknown_type_is_one_short_line(base_model, tmp_path, capsys):
    """T11 through MODEL_PATH: transformers' own error is one line listing every model type."""
    folder = tmp_path / "model"
    shutil.copytree(base_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt3-turbo"}))
    out = tmp_path / "runs"
    assert run_cli("sft", "--model_path", str(folder), "--output_dir", str(out), "--max_steps", "1") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"error: MODEL_PATH={folder}: unknown model_type 'gpt3-turbo'; this kit trains causal LMs (gpt2, "
        f"llama, "
        "qwen2 ...) and encoder-decoders (t5, bart ...); if it ships its own model code and you trust it: "
        "TRUST_REMOTE_CODE=1"
    )
    assert not out.exists()
