"""The README and docs/*.md as a newcomer meets them. Every fenced bash block carries a marker on
the line before it: `<!-- cpu-test: VAR=value ... -->` runs it here, in a fresh copy of the kit,
each VAR=value replacing the block's own setting of VAR (MAX_STEPS=100 becomes MAX_STEPS=2) and
exported, over a tiny base (MAX_LENGTH 64, a small corpus, a 512-token BPE; the test's files are
$DATA_PATH, $SFT_DATA, $PREF_DATA and $TINY_MODEL, a 2-layer width-64 GPT-2 config), and it must exit 0 (or
`exit=N`); `<!-- no-test: reason -->` says why a block is not run. An unmarked
block fails. The blocks run in document order, README first, so the first-hour path (pretrain ->
SFT on runs/latest/final -> DPO -> chat -> compare) shares one pretraining run. The run folder it leaves
is checked against "What a run writes", and the model-size table against the models' shapes."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import CLEAN_ENV, ROOT, TINY_CONFIG, fork_server, forking, make_text

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- (cpu-test|no-test):(.*)-->$")
SHELL_FENCES = ("```bash", "```sh", "```shell")
# The tiny base every tested block runs on; a block's marker (and its own settings) come on top.
# No MODEL_SIZE: SFT would read it as "build a new model" beside MODEL_PATH (refused).
BASE = {
    "MAX_LENGTH": "64", "VOCAB_SIZE": "512", "NUM_WORKERS": "0",
    "TOKENIZE_WORKERS": "1", "EVAL_BATCHES": "2", "LOG_EVERY": "1",
}  # fmt: skip
SFT_PAIRS = [
    ("Add two numbers.", "def add(a, b):\n    return a + b"),
    ("Say hi.", "Hi!"),
    ("Name a colour.", "Blue."),
]


@dataclass
class Block:
    doc: str
    line: int  # 1-based line of the opening fence
    text: str
    kind: str | None  # cpu-test, no-test, or None (unmarked)
    detail: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks_of(path: Path, root: Path | None = None) -> list[Block]:
    lines, found = path.read_text().splitlines(), []
    i = 0
    while i < len(lines):
        if lines[i].strip().startswith("```") and lines[i].strip() != "```":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            if lines[i].strip() in SHELL_FENCES:
                before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                mark = MARKER.match(before)
                found.append(
                    Block(
                        path.relative_to(root or path.parent).as_posix(),
                        i + 1,
                        "\n".join(lines[i + 1 : end]),
                        mark.group(1) if mark else None,
                        mark.group(2).strip() if mark else "",
                    )
                )
            i = end
        i += 1
    return found


ALL = [b for doc in DOCS for b in blocks_of(doc, ROOT)]


def test_every_shell_block_is_tested_or_says_why_not():
    assert len(ALL) >= 5
    unmarked = [str(b) for b in ALL if b.kind is None]
    assert not unmarked, (f"shell blocks without <!-- cpu-test: ... --> or <!-- no-test: reason -->: "
                          f"{unmarked}")
    assert not [str(b) for b in ALL if b.kind == "no-test" and len(b.detail) < 10], ("a no-test marker needs "
                                                                                     "a reason")
    for doc in DOCS:  # a marker that precedes no shell block marks nothing
        lines = doc.read_text().splitlines()
        for n, line in enumerate(lines):
            if MARKER.match(line.strip()):
                nxt = next(text.strip() for text in lines[n + 1 :] if text.strip())
                assert nxt in SHELL_FENCES, f"{doc.name}:{n + 1}: marker not followed by a shell block"


def test_commands_use_the_kits_environment_and_the_docs_stand_alone():
    bare = [str(b) for b in ALL if re.search(r"(?<!\.venv/bin/)\bpython3? -m train", b.text)]
    assert not bare, f"blocks calling python -m train without .venv/bin/python: {bare}"
    for doc in DOCS:
        text = doc.read_text()
        assert "../shared" not in text and "/work/notes" not in text, doc.name


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_resolve_and_the_readme_reaches_every_doc():
    readme = (ROOT / "README.md").read_text()
    for doc in DOCS[1:]:
        assert f"(docs/{doc.name})" in readme, f"README does not link docs/{doc.name}"
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            assert path.exists(), f"{doc.name}: link to {target}: no such file"
            if anchor and path.suffix == ".md":
                heads = {slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}
                assert anchor in heads, f"{doc.name}: link to {target}: no such heading"


def test_the_first_hour_comes_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    at = {
        name: next(i for i, line in enumerate(lines) if needle in line)
        for name, needle in [
            ("make train", "make train   #"),
            ("pretrain", "./run_single_gpu.sh   #"),
            ("sft", "MODEL_PATH=runs/latest/final"),
            ("chat", "make chat MODEL="),
            ("compare", "make compare"),
            ("outputs", "## What a run writes"),
        ]
    }
    assert list(at) == sorted(at, key=at.get), at  # in that order
    assert at["compare"] < 92, "the first-hour path should fit the README's first screens"


def test_the_model_size_table_is_what_the_models_count():
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from train.core.model import padded_vocab
    from train.models.build import build_config

    rows = [line.split("|")[1:-1] for line in (ROOT / "README.md").read_text().splitlines()
            if re.match(r"\| (nano|tiny|small|medium) \|", line)]  # fmt: skip
    assert [r[0].strip() for r in rows] == ["nano", "tiny", "small", "medium"] * 2  # GPT-2 and T5, then Llama
    llama = {r[0].strip(): r for r in rows[4:]}
    for size, _, gpt2_8k, gpt2_50k, _, t5_8k, t5_32k in rows[:4]:
        _, _, llama_8k, llama_50k = llama[size.strip()]
        for family, vocab, said in [("gpt2", 8192, gpt2_8k), ("gpt2", 50257, gpt2_50k),
                                    ("t5", padded_vocab(8192 + 100), t5_8k), ("t5", 32128, t5_32k),
                                    ("llama", 8192, llama_8k), ("llama", 50257, llama_50k)]:  # fmt: skip
            cfg = build_config(size.strip(), None, vocab, 0, family)
            auto = AutoModelForSeq2SeqLM if family == "t5" else AutoModelForCausalLM
            with torch.device("meta"):
                n = sum(p.numel() for p in auto.from_config(cfg).parameters())
            assert said.strip() == f"{n / 1e6:.1f}M", (family, size, vocab, n)


def test_the_parser_finds_an_unmarked_block_and_the_marker_cuts_the_run(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# T\n\n```bash\nmake train\n```\n\n<!-- cpu-test: MAX_STEPS=2 exit=2 -->\n```bash\n"
                    "MAX_STEPS=100 ./run_single_gpu.sh  # NO_MAX_STEPS=100 stays\n```\n\n```\ntree, not "
                    "run\n```\n")  # fmt: skip
    found = blocks_of(page)
    assert [(b.line, b.kind) for b in found] == [(3, None), (8, "cpu-test")]
    assert script(found[1]).splitlines()[1:] == ["export MAX_STEPS=2", "MAX_STEPS=2 ./run_single_gpu.sh  # "
                                                                       "NO_MAX_STEPS=100 stays"]
    assert slug("T5 fine-tuning (SFT)") == "t5-fine-tuning-sft"


# ---- the blocks, run ---------------------------------------------------------------------------


def kit_copy(dest: Path) -> Path:
    """The kit as a fresh clone has it, with a .venv that is this interpreter (make's stamp newer
    than requirements.txt, so no make target installs anything): its `python -m train` runs are
    forks of a warm server of the copy's own (fork_server; anything else is the interpreter itself)."""
    skip = shutil.ignore_patterns(
        ".git", ".venv", "runs", ".cache", "__pycache__", ".pytest_cache", ".ruff_cache", "compare"
    )
    shutil.copytree(ROOT, dest, ignore=skip)
    (dest / ".venv" / "bin").mkdir(parents=True)
    python = dest / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{fork_server(dest)["python"] if forking() else sys.executable}" '
                      f'"$@"\n')
    python.chmod(0o755)
    (dest / ".venv" / ".installed").touch()
    return dest


def script(block: Block) -> str:
    """The block as written, each marker setting replacing the block's own and exported first."""
    text, exports = block.text, []
    for setting in block.detail.split():
        name = setting.partition("=")[0]
        if name == "exit":
            continue
        text = re.sub(rf"(?<![\w$]){name}=\S+", setting.replace("\\", "\\\\"), text)
        exports.append(f"export {setting}")
    return "set -eo pipefail\n" + "\n".join(exports) + "\n" + text + "\n"


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict:
    """Every cpu-test block run in order in one fresh kit copy: {block: (expected, rc, output, s)}."""
    top = tmp_path_factory.mktemp("readme")
    kit = kit_copy(top / "kit")
    (top / "corpus.txt").write_text(make_text(7, 1500))
    with open(top / "sft.jsonl", "w") as f:
        for i in range(48):
            prompt, answer = SFT_PAIRS[i % len(SFT_PAIRS)]
            f.write(json.dumps({"instruction": prompt, "input": "", "output": answer}) + "\n")
    with open(top / "pairs.jsonl", "w") as f:  # preference pairs for the first hour's DPO step
        for i in range(24):
            prompt, answer = SFT_PAIRS[i % len(SFT_PAIRS)]
            f.write(
                json.dumps({"instruction": prompt, "input": "", "chosen": answer, "rejected": "No."}) + "\n"
            )
    # PATH, HOME, LANG, TMPDIR and where the copy's fork server is (the launchers take .venv/bin/python)
    env = {k: v for k, v in os.environ.items() if k in CLEAN_ENV}
    if forking():
        env.update(fork_server(kit)["env"])
    # the run sets the vocabulary
    (top / "tiny.json").write_text(json.dumps({**TINY_CONFIG, "vocab_size": 64}))
    env.update(
        BASE,
        DATA_PATH=str(top / "corpus.txt"),
        SFT_DATA=str(top / "sft.jsonl"),
        PREF_DATA=str(top / "pairs.jsonl"),
        TINY_MODEL=str(top / "tiny.json"),
    )
    results = {}
    for block in (b for b in ALL if b.kind == "cpu-test"):
        expected = int(dict(s.partition("=")[::2] for s in block.detail.split()).get("exit", 0))
        start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run(["bash", "-c", script(block)], cwd=kit, env=env, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        results[str(block)] = (expected, out.returncode, out.stdout + out.stderr, time.perf_counter() - start)
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
        print(f"{block}: {time.perf_counter() - start:.1f} s wall, {cpu_s:.1f} s CPU")
    return {"kit": kit, "results": results}


def test_each_cpu_block_exits_as_documented(ran):
    wrong = [f"{name}: exit {rc}, documented {expected}\n{output[-1500:]}"
             for name, (expected, rc, output, _) in ran["results"].items() if rc != expected]  # fmt: skip
    assert not wrong, "\n\n".join(wrong)
    assert len(ran["results"]) >= 4  # the first-hour path at least


def test_the_run_folders_hold_what_the_readme_says(ran):
    runs = ran["kit"] / "runs"
    readme = (ROOT / "README.md").read_text()
    written = readme[readme.index("## What a run writes") : readme.index("## Model sizes")]
    pretrain = next(p for p in runs.iterdir() if p.name.startswith("run_single_gpu-"))
    made = (
        "config.json",
        "metrics.jsonl",
        "train.log",
        "summary.json",
        "curves.png",
        "tensorboard",
        "checkpoints",
        "final",
    )
    for name in made:  # the tested pretraining block runs with REPORT_TO=tensorboard
        assert (pretrain / name).exists(), name
        assert name in written, name
    closing = (pretrain / "train.log").read_text().splitlines()[-1]
    assert closing.startswith("outputs: ") and "tensorboard/" in closing, closing
    config = json.loads((pretrain / "config.json").read_text())
    assert list(config) == ["config", "asked", "asked_sha256", "resolved", "decisions", "versions"]
    rows = [json.loads(line) for line in (pretrain / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in rows) and any("loss" in r for r in rows)
    fields = {k for r in rows for k in r}
    summary = json.loads((pretrain / "summary.json").read_text())
    missing = sorted(k for k in fields | set(summary) if not re.search(rf"\b{k}\b", written))
    assert not missing, f"metrics/summary fields the README does not name: {missing}"
    assert summary["exit_reason"] == "completed"
    compare = runs / "compare" / "compare-baseline_vs_compare-optimized"
    assert sorted(p.name for p in compare.iterdir()) == ["compare.json", "compare.md", "compare.png"]
