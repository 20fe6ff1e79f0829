"""The lines a user reads about checkpoints: a refused state.pt in one clean line (no advice to
load it unsafely), a resume with another MODEL_SIZE named as that, and a full disk before the
first checkpoint not pointing at RESUME=1."""

import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY_CONFIG, run_cli
from train.distributed import safe_load
from train.run.checkpoint import on_disk


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def refused(data: bytes, tmp_path: Path) -> str:
    path = tmp_path / "state.pt"
    path.write_bytes(data)
    with pytest.raises(safe_load.Refused) as caught:
        safe_load.load_file(path, "state.pt")
    return str(caught.value)


def test_safe_loader_refusal_is_one_clean_line(tmp_path):
    marker = tmp_path / "code-ran"
    blob = io.BytesIO()
    torch.save({"optimizer": Payload(marker)}, blob)
    line = refused(blob.getvalue(), tmp_path)
    assert line == ("state.pt refused by the safe loader: it holds a Python object (io.open) that could run "
                    "code")
    assert not marker.exists()
    # a truncated file: torch's first sentence, without its advice
    line = refused(blob.getvalue()[:60], tmp_path)
    assert line == (
        "state.pt refused by the safe loader: PytorchStreamReader failed reading zip archive: "
        "failed finding central directory"
    )
    for err in [
        pickle_error(),
        RuntimeError("word " * 60 + "\n\tsecond line"),
        EOFError(),
    ]:
        reason = safe_load.refusal(err)
        assert (
            "\n" not in reason and "weights_only" not in reason and len(reason) <= safe_load.REASON_CHARS + 4
        )
    assert safe_load.refusal(EOFError()) == "EOFError"
    assert safe_load.refusal(RuntimeError("words " * 60)).endswith("words words ...")  # cut between words


def pickle_error() -> Exception:
    """What torch.load(weights_only=True) raises for a global it does not allow, advice and all."""
    blob = io.BytesIO()
    torch.save(Payload("/nonexistent/never"), blob)
    blob.seek(0)
    try:
        torch.load(blob, weights_only=True)
    except Exception as err:
        assert "weights_only" in str(err)  # torch's advice, which the line must not repeat
        return err
    raise AssertionError("torch.load accepted a pickled callable")


@pytest.fixture
def flags(corpus, cache_dir, tmp_path):
    return ["--data_path", str(corpus), "--vocab_size", "512", "--cache_dir", str(cache_dir),
            "--output_dir", str(tmp_path / "runs"), "--max_length", "64", "--batch_size", "2"]  # fmt: skip


def tree(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_resume_with_another_model_size_names_model_size(flags, tiny_config, tmp_path, capsys):
    argv = [*flags, "--max_steps", "2", "--save_every", "1", "--run_name", "nano"]
    assert run_cli("pretrain", *argv, "--model_size", "nano") == 0
    run = tmp_path / "runs" / "nano"
    meta = json.loads((run / "checkpoints" / "step-00000002" / "meta.json").read_text())
    assert meta["settings"]["model_size"] == "nano"
    shutil.rmtree(run / "final")  # as a run stopped before its end
    (run / "summary.json").unlink()
    before = tree(run)
    capsys.readouterr()

    resume = [*flags, "--max_steps", "4", "--run_name", "nano", "--resume", "1"]
    for other, has in [
        (["--model_size", "tiny"], "MODEL_SIZE=tiny"),
        (["--model_config", str(tiny_config)], f"MODEL_CONFIG={tiny_config}"),
    ]:
        assert run_cli("pretrain", *resume, *other) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert errors == [
            f"error: RESUME=1: checkpoint step-00000002 was saved by a MODEL_SIZE=nano run, this run has "
            f"{has}; resume with MODEL_SIZE=nano"
        ], err[-2000:]
        assert "optimizer" not in err and "Traceback" not in err
        assert tree(run) == before


def test_resume_with_another_model_config_names_the_saved_one(flags, tiny_config, tmp_path, capsys):
    """Both runs custom (MODEL_CONFIG), another shape: named as another model, not as an
    optimizer state that does not fit, with the MODEL_CONFIG the checkpoint was saved with."""
    argv = [
        *flags,
        "--model_config",
        str(tiny_config),
        "--max_steps",
        "2",
        "--save_every",
        "1",
        "--run_name",
        "c",
    ]
    assert run_cli("pretrain", *argv) == 0
    run = tmp_path / "runs" / "c"
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**TINY_CONFIG, "n_layer": 3}))
    before = tree(run)
    capsys.readouterr()

    argv[argv.index("--model_config") + 1] = str(other)
    assert run_cli("pretrain", *argv, "--resume", "1", "--max_steps", "4") == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert errors[0].startswith("error: RESUME=1: checkpoint step-00000002 holds another model than this run "
                                "builds (")
    assert errors[0].endswith(f"resume with MODEL_CONFIG={tiny_config}") and "optimizer" not in errors[0]
    assert tree(run) == before


def test_disk_full_before_the_first_checkpoint_suggests_running_again(
    flags, tiny_config, monkeypatch, capsys
):
    monkeypatch.setattr(on_disk.CheckpointFolder, "free_bytes", lambda self: 4096)
    argv = [
        *flags,
        "--model_config",
        str(tiny_config),
        "--max_steps",
        "4",
        "--save_every",
        "2",
        "--run_name",
        "full",
    ]
    assert run_cli("pretrain", *argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert "disk full: checkpoint step-00000002 needs about" in errors[0]
    assert "(no checkpoint yet); free space, then run again" in errors[0]
    assert "RESUME=1" not in errors[0]
