"""The precomputed reference's cache (CACHE_DIR/pref_reference/<key>/) is sealed as the other caches
are: log-probs edited in place, another model's cache copied under this one's key, non-finite numbers
(sealed or not), a flipped byte of meta.json or a cut file are each said in one line naming the cache,
removed and computed again, so the first step of DPO against the policy itself is ln 2 every time; a
reference that gives non-finite log-probs itself is refused in one line, exit 2, nothing cached."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import read_jsonl, run_cli

PAIRS = [
    {"prompt": f"Say {i}.", "chosen": f"{i} {i}.", "rejected": f"no {i % 5} way" * (1 + i % 3)}
    for i in range(24)
]


@pytest.fixture(scope="module")
def root(base_model, tmp_path_factory) -> Path:
    """A folder with a tiny SFT run (DPO's model) beside the pretrained model it came from (another
    model of the same shape, for the copied cache), and preference pairs."""
    root = tmp_path_factory.mktemp("refcache")
    data = root / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Say {i}.", "response": f"{i} {i}."}) + "\n" for i in range(16))
    )
    argv = ["--model_path", str(base_model), "--data_path", str(data), "--output_dir", str(root / "runs"),
            "--cache_dir", str(root / "cache"), "--max_length", "64", "--batch_size", "4", "--max_steps", "2",
            "--learning_rate", "1e-2", "--run_name", "sft", "--num_workers", "0"]  # fmt: skip
    assert run_cli("sft", *argv) == 0
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    (root / "base").symlink_to(base_model)
    return root


def dpo(root: Path, name: str, model: str = "runs/sft/final", *more: str) -> int:
    return run_cli(
        "dpo",
        "--model_path",
        str(root / model),
        "--data_path",
        str(root / "pairs.jsonl"),
        "--output_dir",
        str(root / "runs"),
        "--cache_dir",
        str(root / "cache"),
        "--max_length",
        "64",
        "--batch_size",
        "4",
        "--max_steps",
        "2",
        "--log_every",
        "1",
        "--num_workers",
        "0",
        "--reference",
        "precomputed",
        "--val_fraction",
        "0",
        "--learning_rate",
        "1e-3",
        "--run_name",
        name,
        "--overwrite",
        "1",
        *more,
    )


def first_loss(root: Path, name: str) -> float:
    return next(r["loss"] for r in read_jsonl(root / "runs" / name / "metrics.jsonl") if "loss" in r)


def cache_folders(root: Path) -> set[Path]:
    where = root / "cache" / "pref_reference"
    return {p for p in where.iterdir() if not p.name.startswith(".")} if where.exists() else set()


def made(root: Path, name: str, capsys, model: str = "runs/sft/final") -> Path:
    """A run that builds (or reads) the cache; the cache folder it used."""
    before = cache_folders(root)
    assert dpo(root, name, model) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if "reference log-probs:" in s)
    folder = Path(line.split(" in ")[-1].split(" (")[0]) if "cached in" in line else Path(line.split()[-1])
    assert folder in cache_folders(root) and before <= cache_folders(root)
    return folder


def reseal(folder: Path, name: str) -> None:
    """meta.json's sha256 of `name` made true again (a cache whose numbers are wrong yet sealed)."""
    meta = json.loads((folder / "meta.json").read_text())
    meta["sha256"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))


def plus_50(folder: Path) -> None:
    values = np.fromfile(folder / "chosen.bin", dtype=np.float32) + 50
    values.tofile(folder / "chosen.bin")


def nan_sealed(folder: Path) -> None:
    values = np.fromfile(folder / "rejected.bin", dtype=np.float32)
    values[3] = np.nan
    values.tofile(folder / "rejected.bin")
    reseal(folder, "rejected.bin")


def meta_byte(folder: Path) -> None:
    raw = bytearray((folder / "meta.json").read_bytes())
    raw[0] ^= 0x01  # "{" becomes "z"
    (folder / "meta.json").write_bytes(bytes(raw))


def cut(folder: Path) -> None:
    raw = (folder / "chosen.bin").read_bytes()
    (folder / "chosen.bin").write_bytes(raw[: len(raw) // 2])


@pytest.mark.parametrize("tamper, said", [
    (plus_50, "chosen.bin does not hold the bytes meta.json's checksum describes"),
    (nan_sealed, "rejected.bin holds 1 non-finite log-prob(s)"),
    (meta_byte, "meta.json cannot be read"),
    (cut, "chosen.bin holds 48 bytes, 24 pairs need 96"),
])  # fmt: skip
def test_a_tampered_cache_is_said_removed_and_made_again(root, capsys, tamper, said):
    folder = made(root, "first", capsys)
    assert first_loss(root, "first") == pytest.approx(math.log(2), abs=1e-5)
    tamper(folder)
    assert dpo(root, "again") == 0
    lines = [s for s in capsys.readouterr().out.splitlines() if "reference log-probs" in s]
    assert lines[0].startswith(f"reference log-probs cache {folder} was damaged ({said}")
    assert lines[0].endswith("); removed, computing it again")
    assert first_loss(root, "again") == pytest.approx(math.log(2), abs=1e-5)  # not 5.0 (+50) nor NaN
    assert dpo(root, "third") == 0  # and sound again: read, not computed
    assert f"reference log-probs: reused {folder}" in capsys.readouterr().out


def test_another_models_cache_copied_under_the_key_is_not_taken(root, capsys):
    mine = made(root, "mine", capsys)
    other = made(root, "other", capsys, model="base")
    assert mine != other  # the key holds the reference model's weights digest
    mine_loss = first_loss(root, "mine")
    shutil.rmtree(mine)
    shutil.copytree(other, mine)
    assert dpo(root, "copied") == 0
    out = capsys.readouterr().out
    assert (f"reference log-probs cache {mine} was damaged (it was made for another reference model than "
            f"this run's") in out
    assert (
        first_loss(root, "copied")
        == pytest.approx(math.log(2), abs=1e-5)
        == pytest.approx(mine_loss, abs=1e-6)
    )
    meta = json.loads((mine / "meta.json").read_text())
    assert meta["identity"] != json.loads((other / "meta.json").read_text())["identity"]


def test_a_reference_with_non_finite_log_probs_is_refused_and_nothing_is_cached(root, capsys, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(root / "runs" / "sft" / "final", broken)
    from safetensors.torch import load_file, save_file

    weights = load_file(broken / "model.safetensors")
    name = next(k for k in weights if k.endswith("ln_f.weight"))
    weights[name][:] = 3e38  # finite weights whose logits overflow: NaN log-probs
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    before = cache_folders(root)
    assert dpo(root, "nan", str(broken)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "non-finite log-probs for 24 of 24 pairs" in err[0]
        and "LEARNING_RATE" not in err[0]
    )
    assert cache_folders(root) == before and not (root / "runs" / "nan").exists()
