"""No code runs from a run folder on RESUME=1 of a sharded checkpoint (SHARDING=zero2 on one
process, a real FSDP2 run): a crafted shards/.metadata or a crafted non-tensor entry of a shard
file is refused in one line, the previous checkpoint is tried, and with none left the run stops
with exit code 2, untouched. Every crafted file is re-hashed in meta.json, so the checksums pass
and only the loaders stand in the way; each payload is shown to be live (stock pickle or
torch.distributed.checkpoint runs it)."""

import hashlib
import io
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY_CONFIG, read_jsonl, run_cli
from train.distributed import safe_load
from train.run.checkpoint import on_disk

STEPS = [
    "--batch_size",
    "2",
    "--max_steps",
    "6",
    "--save_every",
    "2",
    "--sharding",
    "zero2",
    "--log_every",
    "1",
    "--keep_checkpoints",
    "5",
]
ENTRY = "optimizer.param_groups.0.lr"  # a non-tensor entry: DCP itself would torch.load it unrestricted


class Payload:
    """Unpickling this creates a file: code from the run folder running on load."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def ref(corpus, tiny_config, cache_dir, tmp_path_factory):
    """A finished zero2 run with checkpoints at steps 2, 4 and 6, and the flags that made it."""
    runs = tmp_path_factory.mktemp("security") / "runs"
    flags = [
        "--model_config",
        str(tiny_config),
        "--data_path",
        str(corpus),
        "--vocab_size",
        "512",
        "--cache_dir",
        str(cache_dir),
        "--output_dir",
        str(runs),
        "--max_length",
        "64",
        *STEPS,
    ]
    assert run_cli("pretrain", *flags, "--run_name", "ref") == 0
    return runs, flags


def copy_run(runs: Path, name: str) -> Path:
    """The reference stopped after step 4: checkpoints 2 and 4, nothing of its end."""
    run = runs / name
    shutil.copytree(runs / "ref", run, symlinks=True)
    shutil.rmtree(run / "checkpoints" / "step-00000006")
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("step", 0) <= 4]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def rehash(folder: Path) -> None:
    """meta.json's sizes and sha256 made to match the files as they are now."""
    meta = json.loads((folder / "meta.json").read_text())
    for name in meta["files"]:
        data = (folder / name).read_bytes()
        meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))


def craft_metadata(folder: Path, marker: Path) -> None:
    """The real .metadata with a payload inside, pickled as torch.distributed.checkpoint does."""
    path = folder / "shards" / ".metadata"
    metadata = safe_load.read_metadata(path)
    metadata.planner_data = {"note": Payload(marker)}
    path.write_bytes(pickle.dumps(metadata))
    rehash(folder)


def craft_entry(folder: Path, marker: Path) -> bytes:
    """ENTRY pointed at a payload appended to the shard file (a legitimate .metadata)."""
    shards = folder / "shards"
    metadata = safe_load.read_metadata(shards / ".metadata")
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    for index, info in metadata.storage_data.items():
        if index.fqn == ENTRY:
            shard = shards / info.relative_path
            info.offset, info.length = shard.stat().st_size, len(blob.getvalue())
            with open(shard, "ab") as handle:
                handle.write(blob.getvalue())
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))
    rehash(folder)
    return blob.getvalue()


def tree(root: Path) -> dict:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def test_crafted_metadata_is_refused_and_the_previous_checkpoint_resumes(ref, tmp_path, capsys):
    runs, flags = ref
    run = copy_run(runs, "metadata")
    marker = tmp_path / "code-ran"
    craft_metadata(run / "checkpoints" / "step-00000004", marker)
    capsys.readouterr()

    assert run_cli("pretrain", *flags, "--run_name", "metadata", "--resume", "1") == 0
    assert not marker.exists()
    out = capsys.readouterr().out
    assert (
        "checkpoint step-00000004 cannot be used: shards/.metadata refused by the safe loader: it holds a "
        "Python object (io.open) that could run code; trying the previous one"
    ) in out
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 2
    # the legitimate sharded checkpoint, read back through the safe reader, continues exactly
    np.testing.assert_allclose(losses(run), losses(runs / "ref"), rtol=0, atol=1e-5)
    set_aside = run / "checkpoints" / "step-00000004.invalid" / "shards" / ".metadata"
    with open(set_aside, "rb") as handle:  # the payload was live: plain pickle runs it
        pickle.load(handle)
    assert marker.exists()


def test_crafted_shard_entry_is_refused_before_anything_is_read(ref, tmp_path, capsys):
    runs, flags = ref
    run = copy_run(runs, "entry")
    marker = tmp_path / "code-ran"
    blob = craft_entry(run / "checkpoints" / "step-00000004", marker)
    capsys.readouterr()

    assert run_cli("pretrain", *flags, "--run_name", "entry", "--resume", "1") == 0
    assert not marker.exists()
    out = capsys.readouterr().out
    assert (
        f"checkpoint step-00000004 cannot be used: __0_0.distcp ({ENTRY}) refused by the safe loader: it "
        "holds a Python object (io.open) that could run code; trying the previous one"
    ) in out
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 2
    torch.load(io.BytesIO(blob), weights_only=False)  # what DCP's default planner does with it
    assert marker.exists()


def test_no_usable_checkpoint_left_exit_2_one_line_nothing_touched(ref, tmp_path, capsys):
    runs, flags = ref
    run = copy_run(runs, "allbad")
    marker = tmp_path / "code-ran"
    craft_metadata(run / "checkpoints" / "step-00000004", marker)
    older = run / "checkpoints" / "step-00000002"
    state = torch.load(older / "state.pt", weights_only=True)
    torch.save({**state, "scaler": Payload(marker)}, older / "state.pt")  # state.pt of a sharded run
    rehash(older)
    before = tree(runs)
    capsys.readouterr()

    assert run_cli("pretrain", *flags, "--run_name", "allbad", "--resume", "1") == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert errors[0].startswith("error: RESUME=1: no usable checkpoint in")
    assert "step-00000004: shards/.metadata refused by the safe loader" in errors[0]
    assert (
        "step-00000002: state.pt refused by the safe loader: it holds a Python object (io.open)" in errors[0]
    )
    assert "weights_only" not in errors[0]
    assert not marker.exists()
    assert tree(runs) == before


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("craft", ["metadata", "entry"])
def test_stock_dcp_load_runs_the_payload_the_safe_reader_refuses(craft, ref, tmp_path):
    """The same files through torch.distributed.checkpoint.load itself (no process group: one
    process reads the checkpoint), through safe_load.dcp_load as load_sharded calls it, and
    through DCP with SafeReader and SafePlanner alone (what stands if the pre-check is skipped)."""
    import torch.distributed.checkpoint as dcp

    runs, _ = ref
    folder = tmp_path / "step"
    shutil.copytree(runs / "ref" / "checkpoints" / "step-00000004", folder)
    marker = tmp_path / "code-ran"
    craft_metadata(folder, marker) if craft == "metadata" else craft_entry(folder, marker)

    def wanted():
        return {"optimizer": {"param_groups": [{"lr": 0.0}]}}  # reads ENTRY alone

    with pytest.raises(safe_load.Refused, match=r"refused by the safe loader: it holds a Python object "
                                                r"\(io.open\)"):
        safe_load.dcp_load(wanted(), folder / "shards")
    reader, planner = safe_load.SafeReader(str(folder / "shards")), safe_load.SafePlanner()
    with pytest.raises(dcp.api.CheckpointException, match="refused by the safe loader"):
        dcp.load(wanted(), storage_reader=reader, planner=planner)
    assert not marker.exists()
    try:
        dcp.load(wanted(), checkpoint_id=str(folder / "shards"))
    except BaseException:  # whatever DCP makes of the payload's result: it has run by then
        pass
    assert marker.exists()


def test_shard_reads_stay_inside_the_shard_files(ref, tmp_path):
    runs, _ = ref
    shards = tmp_path / "shards"
    shutil.copytree(runs / "ref" / "checkpoints" / "step-00000002" / "shards", shards)
    (tmp_path / "secret.distcp").write_bytes(b"\0" * 10_000)
    original = (shards / ".metadata").read_bytes()
    for change, message in [
        ({"relative_path": "../secret.distcp"}, "points outside the shard files"),
        ({"relative_path": ".metadata"}, "points outside the shard files"),
        ({"offset": 10**9}, "points past the end of __0_0.distcp"),
        ({"length": -1}, "holds an invalid offset"),
        ({"transform_descriptors": ["zstd"]}, "stream transforms"),
    ]:
        metadata = pickle.loads(original)
        info = next(iter(metadata.storage_data.values()))
        for key, value in change.items():
            setattr(info, key, value)
        (shards / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(safe_load.Refused, match=message):
            safe_load.check_shards(shards, None)
    (shards / ".metadata").write_bytes(original)
    safe_load.check_shards(shards, None)  # the untouched folder passes


def test_sharded_checkpoint_of_another_model_is_named_as_one(ref, tmp_path, capsys):
    runs, flags = ref
    run = copy_run(runs, "othermodel")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**TINY_CONFIG, "n_embd": 32}))
    before = tree(run)
    argv = [*flags, "--run_name", "othermodel", "--resume", "1"]
    argv[argv.index("--model_config") + 1] = str(other)
    capsys.readouterr()

    assert run_cli("pretrain", *argv) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert "RESUME=1: checkpoint step-00000004 holds another model than this run builds (" in err
    assert f"resume with MODEL_CONFIG={flags[1]}" in err
    assert tree(run) == before
    assert on_disk.list_checkpoints(run / "checkpoints")[0].name == "step-00000004"


def test_checkpoint_files_are_read_inside_the_checkpoint_only(ref, tmp_path):
    """A meta.json entry that leaves the folder, or a shard file linked to a copy elsewhere, makes
    the checkpoint unusable before that file is read or hashed (sizes and sha256 all match)."""
    from train.run.checkpoint.verify import BadCheckpoint, check_files

    runs, _ = ref
    folder = tmp_path / "step"
    shutil.copytree(runs / "ref" / "checkpoints" / "step-00000002", folder)
    meta = json.loads((folder / "meta.json").read_text())
    check_files(folder, meta)  # the checkpoint as saved passes
    outside = tmp_path / "hostname"
    outside.write_text("a file outside the run folder\n")
    escaping = {**meta["files"], "shards/../../hostname": {"bytes": outside.stat().st_size,
                "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()}}  # fmt: skip
    with pytest.raises(BadCheckpoint, match=r"lists 'shards/\.\./\.\./hostname', which is not a file of the "
                                            r"checkpoint"):
        check_files(folder, {**meta, "files": escaping})
    shard = sorted((folder / "shards").glob("*.distcp"))[0]
    copy = tmp_path / "copy.distcp"
    shutil.copyfile(shard, copy)
    shard.unlink()
    shard.symlink_to(copy)  # the same bytes: only the link gives it away
    with pytest.raises(BadCheckpoint, match=f"lists 'shards/{shard.name}', which is not a file of the "
                                            f"checkpoint"):
        check_files(folder, meta)
    with pytest.raises(safe_load.Refused, match="points outside the shard files"):
        safe_load.check_shards(folder / "shards", None)
