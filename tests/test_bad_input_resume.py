"""Bad input through the launchers, checkpoint and resume inputs first: each case gives exit
code 2, one line naming the problem, no traceback, and leaves every run folder as it was.

Every case goes through run_single_gpu.sh, which turns the variables into the command
(SHOW_COMMAND=1 prints it, quoted), and that command runs through `python -m train`'s entry
point in this process (importing torch once, not thirty times). Cases marked `real` also run
the launcher for real, start to finish, in a fresh process: they fail before torch loads.
"""

import hashlib
import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from conftest import KIT_PY, ROOT, TINY_CONFIG, launch, run_cli
from train.run.checkpoint import on_disk


class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))  # runs on unpickling: what weights_only refuses


@pytest.fixture(scope="module")
def world(corpus, tiny_config, cache_dir, tmp_path_factory):
    """A finished run with checkpoints, damaged copies of it, and bad data and config files."""
    top = tmp_path_factory.mktemp("bad_input")
    runs = top / "runs"
    env = {
        "MODEL_CONFIG": str(tiny_config),
        "DATA_PATH": str(corpus),
        "VOCAB_SIZE": "512",
        "CACHE_DIR": str(cache_dir),
        "OUTPUT_DIR": str(runs),
        "MAX_LENGTH": "64",
        "BATCH_SIZE": "4",
        "MAX_STEPS": "6",
        "LOG_EVERY": "1",
    }
    flags = [f"--{name.lower()}" for name in env]
    argv = [x for pair in zip(flags, env.values(), strict=True) for x in pair]
    assert run_cli("pretrain", *argv, "--save_every", "3", "--run_name", "good") == 0
    good = runs / "good"

    def copy(name):
        shutil.copytree(good, runs / name, symlinks=True)
        return on_disk.list_checkpoints(runs / name / "checkpoints")

    for folder in copy("truncated"):
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    for folder in copy("badmeta"):
        (folder / "meta.json").write_text("{not json")
    marker = top / "code-ran"
    for folder in copy("pickled"):
        torch.save({"optimizer": Payload(marker), "scaler": {}, "rng": {}}, folder / "state.pt")
        meta = json.loads((folder / "meta.json").read_text())
        meta["files"]["state.pt"] = {
            "bytes": (folder / "state.pt").stat().st_size,
            "sha256": hashlib.sha256((folder / "state.pt").read_bytes()).hexdigest(),
        }
        (folder / "meta.json").write_text(json.dumps(meta))
    copy("nockpt")
    shutil.rmtree(runs / "nockpt" / "checkpoints")

    files = top / "files"
    files.mkdir()
    (files / "binary.txt").write_bytes(b"\xff\xfe\x00\x81 not text " * 50)
    (files / "bad.jsonl").write_text('{"text": "fine"}\n{not json}\n')
    (files / "empty").mkdir()
    (files / "other.json").write_text(json.dumps({**TINY_CONFIG, "n_embd": 32}))
    (files / "garbage.json").write_text("this is not json")
    return {"top": top, "runs": runs, "env": env, "files": files, "marker": marker}


def tree(root: Path) -> dict:
    """Every path under root with its kind, size, mtime and content hash."""
    state = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            state[key] = ("link", str(path.readlink()))
        elif path.is_dir():
            state[key] = ("dir",)
        else:
            data = path.read_bytes()
            state[key] = ("file", len(data), path.stat().st_mtime_ns, hashlib.sha256(data).hexdigest())
    return state


F = "{files}"  # replaced by the files folder
M = "{marker}"  # replaced by the marker a shell injection would create
CASES = [
    # id, variables, extra launcher arguments, what the one error line must say, also run for real
    (
        "save_every_word",
        {"SAVE_EVERY": "abc"},
        (),
        "SAVE_EVERY (--save_every): expected a whole number",
        True,
    ),
    (
        "save_every_negative",
        {"SAVE_EVERY": "-1"},
        (),
        "SAVE_EVERY (--save_every): expected a whole number >= 0",
        True,
    ),
    ("keep_zero", {"KEEP_CHECKPOINTS": "0"}, (), "KEEP_CHECKPOINTS (--keep_checkpoints)", True),
    ("keep_fraction", {"KEEP_CHECKPOINTS": "1.5"}, (), "KEEP_CHECKPOINTS (--keep_checkpoints)", True),
    ("nan_patience_negative", {"NAN_PATIENCE": "-2"}, (), "NAN_PATIENCE (--nan_patience)", True),
    ("resume_word", {"RESUME": "perhaps"}, (), "RESUME (--resume): expected 1 or 0", True),
    (
        "resume_and_overwrite",
        {"RESUME": "1", "OVERWRITE": "1", "RUN_NAME": "good"},
        (),
        "RESUME=1 and OVERWRITE=1",
        True,
    ),
    ("keep_training_word", {}, ("--is_keep_training", "maybe"), "RESUME (--resume): expected 1 or 0", True),
    (
        "keep_training_disagrees",
        {"RESUME": "0"},
        ("--is_keep_training=True",),
        "--is_keep_training and RESUME",
        True,
    ),
    (
        "resume_missing_run",
        {"RESUME": "1", "RUN_NAME": "nosuch"},
        (),
        "does not exist (RUN_NAME=nosuch)",
        False,
    ),
    ("resume_no_run_of_launcher", {"RESUME": "1"}, (), "RESUME=1: no run of run_single_gpu", False),
    ("resume_no_checkpoints", {"RESUME": "1", "RUN_NAME": "nockpt"}, (), "has no checkpoint", False),
    (
        "resume_truncated",
        {"RESUME": "1", "RUN_NAME": "truncated"},
        (),
        "step-00000006: model.safetensors is truncated",
        False,
    ),
    (
        "resume_meta_not_json",
        {"RESUME": "1", "RUN_NAME": "badmeta"},
        (),
        "meta.json is not valid JSON",
        False,
    ),
    (
        "resume_pickle",
        {"RESUME": "1", "RUN_NAME": "pickled"},
        (),
        "state.pt refused by the safe loader",
        False,
    ),
    (
        "resume_other_model",
        {"RESUME": "1", "RUN_NAME": "good", "MODEL_CONFIG": F + "/other.json"},
        (),
        "another model",
        False,
    ),
    ("resume_parent_dir", {"RESUME": "1", "RUN_NAME": "../good"}, (), "RUN_NAME (--run_name)", True),
    ("run_name_exists", {"RUN_NAME": "good"}, (), "RUN_NAME=good: ", False),
    ("run_name_semicolon", {"RUN_NAME": f"x; touch {M}"}, (), "RUN_NAME (--run_name)", True),
    ("run_name_substitution", {"RUN_NAME": f"$(touch {M})"}, (), "RUN_NAME (--run_name)", True),
    (
        "data_path_substitution",
        {"DATA_PATH": f"$(touch {M}).txt"},
        (),
        "DATA_PATH (--data_path): no such file",
        True,
    ),
    (
        "data_path_backticks",
        {"DATA_PATH": f"`touch {M}`; x.txt"},
        (),
        "DATA_PATH (--data_path): no such file",
        True,
    ),
    ("data_not_utf8", {"DATA_PATH": F + "/binary.txt"}, (), "is not UTF-8 text", False),
    ("data_bad_jsonl", {"DATA_PATH": F + "/bad.jsonl"}, (), "line 2: not valid JSON", False),
    ("data_empty_folder", {"DATA_PATH": F + "/empty"}, (), "holds no .txt", False),
    (
        "model_config_garbage",
        {"MODEL_CONFIG": F + "/garbage.json"},
        (),
        "is not a transformers config.json",
        False,
    ),
    ("batch_size_zero", {"BATCH_SIZE": "0"}, (), "BATCH_SIZE (--batch_size)", True),
    ("fp16_switch_word", {"ENABLE_FP16": "maybe"}, (), "ENABLE_FP16 must be", True),
]


def test_the_table_has_at_least_twenty_cases():
    assert len(CASES) >= 20 and len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("name, variables, args, message, real", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exit_2_one_line_nothing_damaged(world, capsys, name, variables, args, message, real):
    env = dict(world["env"])
    for key, value in variables.items():
        env[key] = value.replace(F, str(world["files"])).replace(M, str(world["marker"]))
    before = tree(world["top"])

    shown = launch("run_single_gpu.sh", {**env, "SHOW_COMMAND": "1"}, *args)
    if shown.returncode != 0:  # the launcher itself refused the value
        code, err = shown.returncode, shown.stderr
    else:
        argv = shlex.split(shown.stdout)
        assert argv[:3] == [KIT_PY, "-m", "train"]
        capsys.readouterr()
        code = run_cli(*argv[3:])  # an exception other than UsageError would fail here, traceback and all
        err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert message in errors[0], errors[0]
    if real:
        result = launch("run_single_gpu.sh", env, *args)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == errors, result.stderr[-2000:]
    assert not world["marker"].exists()  # no shell or pickle payload ran
    assert tree(world["top"]) == before  # no run folder (or anything else) touched


def test_shell_characters_in_a_real_path_reach_python_as_text(world, tmp_path):
    strange = tmp_path / "my data; $(touch PWNED) `touch PWNED`.txt"
    strange.write_text("hello\n")
    shown = launch("run_single_gpu.sh", {**world["env"], "DATA_PATH": str(strange), "SHOW_COMMAND": "1"})
    argv = shlex.split(shown.stdout)
    assert argv[argv.index("--data_path") + 1] == str(strange)
    from train.config.flags import parse_training_args

    assert parse_training_args("pretrain", argv[4:]).data.data_path == str(strange)
    planted = [p for p in (ROOT / "PWNED", tmp_path / "PWNED") if p.exists()]
    for path in planted:
        path.unlink()
    assert planted == []  # launch() runs in the kit's folder: that is where a command would have run


@pytest.mark.parametrize(
    "form", [["--is_keep_training=True"], ["--is_keep_training", "True"], ["--resume", "1"]]
)
def test_the_guides_keep_training_flag_is_resume(form):
    from train.config.flags import parse_training_args

    assert parse_training_args("pretrain", form).run.resume is True
    assert parse_training_args("pretrain", []).run.resume is False
