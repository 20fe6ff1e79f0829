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
import sys

import pytest

from conftest import ROOT, run_cli

FAST = ["--batch_size", "4", "--seed", "3", "--log_every", "1", "--save_every", "2"]


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

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "train", *argv], cwd=ROOT, env=env, preexec_fn=limit,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def one_line(proc, code: int = 2) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == code and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def done(corpus, tiny_config, cache_dir, tmp_path_factory):
    """A 2-step run with its checkpoint at step 2 (the token cache built), and its flags."""
    runs = tmp_path_factory.mktemp("reliability") / "runs"
    flags = ["--model_config", str(tiny_config), "--data_path", str(corpus), "--vocab_size", "512",
             "--cache_dir", str(cache_dir), "--output_dir", str(runs), "--max_length", "64", *FAST]  # fmt: skip
    assert run_cli("pretrain", *flags, "--max_steps", "2", "--run_name", "done") == 0
    return runs, flags


def copy_run(done, name):
    runs, flags = done
    shutil.copytree(runs / "done", runs / name, symlinks=True)
    return runs / name, [*flags, "--run_name", name]


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
        f"error: disk full: writing checkpoint step-00000004 failed at {file} in {run / 'checkpoints'} (File too "
        f"large); the previous checkpoint step-00000002 is intact; free space or lower KEEP_CHECKPOINTS, then "
        f"RESUME=1 RUN_NAME={run.name} continues the run"
    )
    assert not list((run / "checkpoints").glob(".*")) and not list(run.glob(".*tmp*"))
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")] == ["step-00000002"]
    assert snapshot(saved) == before and snapshot(run.parent / "done") == outside
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_reason"] == "write_failed" and summary["write_error"] == line.removeprefix("error: ")
    assert summary["steps"] == 4
    # and the line's command continues the run once the limit is gone
    assert train("pretrain", *flags, "--max_steps", "6", "--resume", "1").returncode == 0
    assert json.loads((run / "summary.json").read_text())["exit_reason"] == "completed"
