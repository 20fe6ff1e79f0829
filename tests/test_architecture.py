"""The shape of the kit: train/'s packages in layers, imports pointing down only (relative imports and
importlib's included), run/'s rooms importing only the rooms below them, the root config.py read only
where it belongs, no import cycles, no function or file too long to read (config.py included), no
folder of more than 15 modules, and the Layout map (docs/layout.md) naming exactly the modules there are.
Each rule is a function of the kit's folder, so the self-tests at the end plant each violation in a
small tree of their own and watch it fail."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parent.parent
# Lower layers never import higher ones; packages of one layer do not import each other.
LAYERS = {
    "core": 0,
    "models": 1,
    "config": 2,
    "data": 2,
    "distributed": 2,
    "observe": 2,
    "run": 3,
    "tools": 4,
    "": 5,
}
# run/'s rooms (sub-packages; train.run.loop.meter is in "loop", in folder "run/loop"; "" is run/ itself):
# each imports its own modules and the rooms below it.
RUN_ROOMS = {"compile": 0, "checkpoint": 1, "rundir": 2, "plan": 3, "guard": 4, "loop": 5, "": 6}
# The user's config.py (the root module "config") is read by these packages of train/ only; the
# others are handed values. config.py itself imports only from core, so that imports run one way:
# core <- config.py <- train/config.
CONFIG_READERS = ("config", "run")
CONFIG_IMPORTS = ("core", "models")
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 400
# The root config.py is the table of every knob (a field, its default, its doc: what knobs.md and the
# launchers' blocks are generated from), not code to read through: it grows by a few lines per knob, and
# a fourth mode's knobs took it past 400. Its functions keep MAX_FUNCTION_LINES.
MAX_CONFIG_LINES = 600
MAX_FOLDER_MODULES = 15


def module_name(path: Path, kit: Path) -> str:
    parts = path.relative_to(kit).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(kit: Path) -> dict[str, Path]:
    """train's modules, and the root config.py as "config"."""
    found = {module_name(p, kit): p for p in sorted((kit / "train").rglob("*.py"))}
    if (kit / "config.py").exists():
        found["config"] = kit / "config.py"
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """`from .x import y` in `module` -> the absolute name of .x."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dynamic(tree: ast.AST) -> bool:
    """Does the file load modules by name (importlib.import_module, __import__)?"""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("import_module", "__import__"):
                return True
    return False


def imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The kit's modules `path` imports anywhere in it: plain, relative (`from . import x`),
    `from a import b` (b when it is a module), and by name through importlib / __import__ (every
    string in such a file that names a module of the kit counts)."""
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path.name == "__init__.py")
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    if _dynamic(tree):
        names += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def folder(module: str) -> str:
    return "/".join(module.split(".")[1:-1])


def room(module: str) -> str:
    return folder(module).partition("/")[2]


def graph(kit: Path) -> dict[str, set[str]]:
    mods = modules(kit)
    known = set(mods)
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}  # empty: nothing to import
    return {m: imports(p, m, known) - packages - {m} for m, p in mods.items()}


def unlayered(kit: Path) -> list[str]:
    return [
        f"{m}: package {package(m)!r} has no layer"
        for m in modules(kit)
        if m != "config" and package(m) not in LAYERS
    ]


def upward_imports(kit: Path) -> list[str]:
    wrong = []
    for module, deps in graph(kit).items():
        if module == "config":
            continue
        here = package(module)
        for dep in deps - {"config"}:
            there = package(dep)
            if dep == f"train.{here}" or there == here:
                continue
            if LAYERS.get(there, 99) >= LAYERS.get(here, -1):
                wrong.append(f"{module} imports {dep} (layer {there or 'top'} is not below {here or 'top'})")
    return sorted(wrong)


def run_room_imports(kit: Path) -> list[str]:
    mods = [m for m in graph(kit).items() if package(m[0]) == "run"]
    wrong = [f"{m}: run/{room(m)}/ is not in RUN_ROOMS" for m, _ in mods if room(m) not in RUN_ROOMS]
    for module, deps in mods:
        for dep in (d for d in deps if package(d) == "run" and room(d) != room(module)):
            if RUN_ROOMS.get(room(module), -1) <= RUN_ROOMS.get(room(dep), 99):
                wrong.append(f"{module} imports {dep} (run/{room(dep)}/ is not below run/{room(module)})")
    return sorted(wrong)


def crowded_folders(kit: Path) -> list[str]:
    counts = Counter(
        folder(m) for m, path in modules(kit).items() if m != "config" and path.name != "__init__.py"
    )
    return sorted(f"train/{name}: {n} modules (at most {MAX_FOLDER_MODULES}; split it into rooms by job)"
                  for name, n in counts.items() if n > MAX_FOLDER_MODULES)


def config_misreads(kit: Path) -> list[str]:
    """Who imports the root config.py, and what config.py imports."""
    edges = graph(kit)
    wrong = [
        f"{m} imports the root config.py (only {CONFIG_READERS} may; pass values down)"
        for m, deps in edges.items()
        if "config" in deps and m != "config" and package(m) not in CONFIG_READERS
    ]
    wrong += [f"config.py imports {dep} (only train.{CONFIG_IMPORTS} may be)"
              for dep in edges.get("config", ()) if package(dep) not in CONFIG_IMPORTS]
    return sorted(wrong)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def too_long(kit: Path) -> list[str]:
    long = []
    for name, path in modules(kit).items():
        text = path.read_text()
        lines, cap = text.count("\n"), MAX_CONFIG_LINES if name == "config" else MAX_FILE_LINES
        if lines > cap:
            long.append(f"{path.relative_to(kit)}: {lines} lines (at most {cap})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(kit)}:{node.lineno} {node.name}: {size} lines")
    return long


def layout_block(kit: Path) -> str:
    """The map in docs/layout.md (the README links it)."""
    readme = (kit / "docs" / "layout.md").read_text()
    block = readme[readme.index("# Layout"):]
    return block[: block.index("```", block.index("```") + 3)]


def _without_parentheses(text: str) -> str:
    out, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def layout_listed(kit: Path) -> dict[str, set[str]]:
    """{folder: the module names the Layout map lists under it} ("" for train/, "run/loop" for a room
    "    loop/" under "  run/"). Under a folder the names are the comma-separated words of its column
    (continued on the lines indented to it), descriptions in parentheses or after "name:" left out."""
    texts: dict[str, str] = {}
    current, column, parent = None, None, None
    for line in layout_block(kit).splitlines():
        indent = len(line) - len(line.lstrip())
        head = line.strip().split("  ")[0]
        if indent in (2, 4) and head.endswith("/"):  # "  run/     names..." or "    loop/   names..."
            parent = head[:-1] if indent == 2 else parent
            current = head[:-1] if indent == 2 else f"{parent}/{head[:-1]}"
            rest = line.strip()[len(head):].strip()
            column = line.index(rest) if rest else len(line)
            texts[current] = rest
        elif indent == 2:  # "  cli.py, __main__.py    what they do"
            current = None
            texts[""] = (
                texts.get("", "")
                + ", "
                + ", ".join(n.strip()[:-3] for n in head.split(",") if n.strip().endswith(".py"))
            )
        elif current is not None and indent >= column:
            texts[current] += " " + line.strip()
        else:
            current = None
    listed = {}
    for pkg, text in texts.items():
        names = set()
        for word in _without_parentheses(text).split(","):
            before, colon, after = word.partition(":")
            word = before if colon and before.strip().isidentifier() else (after if colon else before)
            if word.strip().isidentifier():
                names.add(word.strip())
        listed[pkg] = names
    return listed


def map_mismatches(kit: Path) -> list[str]:
    """Both ways: every package and module is named, and every name listed is a module."""
    listed = layout_listed(kit)
    wrong = []
    for module, path in modules(kit).items():
        if module == "config" or path.name == "__init__.py":
            continue
        pkg = folder(module)
        if path.stem not in listed.get(pkg, set()):
            wrong.append(f"{module} is not in the Layout map (docs/layout.md)")
    for pkg, names in listed.items():
        for name in names:
            if not (kit / "train" / pkg / f"{name}.py").exists():
                wrong.append(f"the Layout map (docs/layout.md) lists {pkg + '/' if pkg else ''}{name}, which "
                             f"does not exist")
    return sorted(wrong)


# ---- the rules, on this kit ------------------------------------------------------------------


def test_every_package_has_a_layer():
    assert not unlayered(KIT)


def test_imports_point_down():
    assert not upward_imports(KIT), "\n".join(upward_imports(KIT))


def test_run_rooms_import_only_the_rooms_below_and_no_folder_holds_more_than_15_modules():
    assert not run_room_imports(KIT) + crowded_folders(KIT), "\n".join(
        run_room_imports(KIT) + crowded_folders(KIT)
    )


def test_the_root_config_is_read_by_config_and_run_only():
    assert not config_misreads(KIT), "\n".join(config_misreads(KIT))


def test_no_import_cycle():
    cycle = find_cycle(graph(KIT))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_functions_and_files_are_short_config_py_included():
    assert not too_long(KIT), "\n".join(too_long(KIT))


def test_the_readme_map_and_the_modules_match_both_ways():
    assert not map_mismatches(KIT), "\n".join(map_mismatches(KIT))


# ---- the rules fail on what they are for ------------------------------------------------------

LAYOUT = """# Layout

```
config.py                 configs
train/                    python -m train
  cli.py                    the command line
  run/                      loop, plan (the plan,
                            frozen), sft
    guard/                    resume (the guard)
    checkpoint/               files
  core/                     step, device
```
"""


@pytest.fixture
def kit(tmp_path) -> Path:
    """A small kit that keeps every rule."""
    files = {
        "config.py": "from train.core import device\n",
        "train/__init__.py": "",
        "train/cli.py": "from train.run import loop\n",
        "train/run/__init__.py": "",
        "train/run/loop.py": "from . import plan\nfrom .sft import x\nimport config\n",
        "train/run/plan.py": "from ..core import step\n",
        "train/run/sft.py": "x = 1\n",
        "train/run/guard/resume.py": "from ..checkpoint import files\nfrom train.run.checkpoint.files import "
                                     "y\n",
        "train/run/checkpoint/files.py": "y = 1\n",
        "train/core/__init__.py": "",
        "train/core/step.py": "import math\n",
        "train/core/device.py": "",
        "docs/layout.md": LAYOUT,
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def all_problems(kit: Path) -> list[str]:
    cycle = find_cycle(graph(kit))
    return [*unlayered(kit), *upward_imports(kit), *run_room_imports(kit), *crowded_folders(kit),
            *config_misreads(kit), *too_long(kit), *map_mismatches(kit),
            *(["cycle " + " -> ".join(cycle)] if cycle else [])]


def test_the_planted_kit_keeps_every_rule(kit):
    assert graph(kit)["train.run.loop"] == {"train.run.plan", "train.run.sft", "config"}
    assert graph(kit)["train.run.plan"] == {"train.core.step"}
    assert graph(kit)["train.run.guard.resume"] == {"train.run.checkpoint.files"}
    assert all_problems(kit) == []


@pytest.mark.parametrize(
    "path, text, rule, expected",
    [
        (
            "train/core/step.py",
            "from train.run import loop\n",
            upward_imports,
            "train.core.step imports train.run.loop",
        ),
        (
            "train/core/step.py",
            "from ..run import loop\n",
            upward_imports,
            "train.core.step imports train.run.loop",
        ),
        (
            "train/core/step.py",
            "from ..run.loop import x\n",
            upward_imports,
            "train.core.step imports train.run.loop",
        ),
        (
            "train/core/step.py",
            "import importlib\nm = importlib.import_module('train.run.plan')\n",
            upward_imports,
            "train.core.step imports train.run.plan",
        ),
        (
            "train/core/step.py",
            "M = {'a': 'train.run.sft'}\nm = __import__(M['a'])\n",
            upward_imports,
            "train.core.step imports train.run.sft",
        ),
        (
            "train/core/step.py",
            "from config import TrainConfig\n",
            config_misreads,
            "train.core.step imports the root config",
        ),
        ("train/cli.py", "import config\n", config_misreads, "train.cli imports the root config"),
        ("config.py", "from train.run import plan\n", config_misreads, "config.py imports train.run.plan"),
        ("train/core/step.py", "def f():\n" + "    x = 1\n" * 90, too_long, "f: 91 lines"),
        ("config.py", "x = 1\n" * 601, too_long, "config.py: 601 lines"),
        (
            "train/run/extra.py",
            "",
            map_mismatches,
            "train.run.extra is not in the Layout map (docs/layout.md)",
        ),
        (
            "train/run/guard/extra.py",
            "",
            map_mismatches,
            "train.run.guard.extra is not in the Layout map (docs/layout.md)",
        ),
        (
            "train/run/checkpoint/files.py",
            "from train.run.guard import resume\n",
            run_room_imports,
            "train.run.checkpoint.files imports train.run.guard.resume",
        ),
        (
            "train/run/guard/resume.py",
            "from train.run import loop\n",
            run_room_imports,
            "train.run.guard.resume imports train.run.loop",
        ),
        ("train/run/attic/old.py", "", run_room_imports, "run/attic/ is not in RUN_ROOMS"),
        ("train/weird/x.py", "", unlayered, "package 'weird' has no layer"),
    ],
)
def test_each_rule_fails_on_its_planted_violation(kit, path, text, rule, expected):
    (kit / path).parent.mkdir(parents=True, exist_ok=True)
    (kit / path).write_text(text)
    problems = rule(kit)
    assert any(expected in p for p in problems), problems


def test_a_listed_module_that_does_not_exist_fails(kit):
    (kit / "train/run/sft.py").unlink()
    assert "the Layout map (docs/layout.md) lists run/sft, which does not exist" in map_mismatches(kit)
    (kit / "train/run/sft.py").write_text("")
    layout = (kit / "docs/layout.md").read_text().replace("loop, plan", "loop, gone, plan")
    (kit / "docs/layout.md").write_text(layout)
    assert map_mismatches(kit) == ["the Layout map (docs/layout.md) lists run/gone, which does not exist"]


def test_a_cycle_is_found(kit):
    (kit / "train/run/sft.py").write_text("from train.run import loop\n")
    assert find_cycle(graph(kit)) == ["train.run.loop", "train.run.sft", "train.run.loop"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_folder_of_16_modules_is_crowded(kit):
    for i in range(14):  # with step and device, 16 modules (KIT's core/ holds 15 and passes)
        (kit / f"train/core/m{i}.py").write_text("")
    assert crowded_folders(kit) == ["train/core: 16 modules (at most 15; split it into rooms by job)"]
