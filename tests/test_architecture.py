"""The shape of train/: packages in layers, imports pointing down only, no import cycles, and no
function or file too long to read. Imports inside functions count: they hide cycles otherwise."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "train"
# Lower layers never import higher ones; packages of one layer do not import each other.
LAYERS = {"core": 0, "config": 1, "data": 1, "dist": 1, "observe": 1, "run": 2, "tools": 3, "": 4}
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """The train.* modules `path` imports anywhere in it (`from train.x import y` counts y when
    y is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("train."):
                found.add(name)
    return found


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}  # empty: nothing to import
    return {m: imports(p, known) - packages - {m} for m, p in mods.items()}


def test_every_package_has_a_layer():
    for module in modules():
        assert package(module) in LAYERS, f"{module}: package {package(module)!r} has no layer in LAYERS"


def test_imports_point_down():
    wrong = []
    for module, deps in graph().items():
        here = package(module)
        for dep in deps:
            there = package(dep)
            if dep in (f"train.{here}",) or there == here:
                continue
            if LAYERS[there] >= LAYERS[here]:
                wrong.append(f"{module} imports {dep} (layer {there or 'top'} is not below {here or 'top'})")
    assert not wrong, "\n".join(sorted(wrong))


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


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_can_fail():
    """The cycle finder and the layer rule catch what they are for."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert LAYERS[package("train.core.device")] < LAYERS[package("train.run.loop")]


def test_functions_and_files_are_short():
    long = []
    for path in modules().values():
        lines = path.read_text().count("\n")
        if lines > MAX_FILE_LINES:
            long.append(f"{path.relative_to(ROOT.parent)}: {lines} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {size} lines")
    assert not long, "\n".join(long)


def test_the_readme_map_names_every_package_and_module():
    readme = (ROOT.parent / "README.md").read_text()
    block = readme[readme.index("## Layout"):]
    block = block[: block.index("```", block.index("```") + 3)]
    missing = []
    for module, path in modules().items():
        if path.name == "__init__.py":
            continue
        if path.parent != ROOT and f"  {path.parent.name}/" not in block:
            missing.append(f"package {path.parent.name}/")
        if path.stem not in block:
            missing.append(module)
    assert not missing, "README's Layout does not name: " + ", ".join(sorted(set(missing)))
