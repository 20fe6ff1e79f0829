"""A mode is an objective: the shared parts never ask which mode they serve. A function of the kit's
folder, with a planted violation for each kind (as tests/test_architecture_families.py does).

Outside the plan's sources (train/run/plan/) and the knob layer (train/config/), no code compares a
mode's name (`mode == "dpo"`, `cfg.run.mode in ("sft", "dpo")`, `"sft" != mode`), and outside the
objectives (train/core/objective.py's implementations: train/core/step.py, train/core/preference/) and
the data doors that make the batches (train/data/), none sniffs a mode's batch or metric keys to tell
the mode (`"n_pairs" in batch`, `batch.get("n_pairs")`, `"rewards/accuracies" in row`,
`name.startswith("rewards/")`): each asks the objective (train/core/objective.py) or the mode's row
(MODES, in the same module)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parent.parent
MODE_NAMES = {"pretrain", "sft", "dpo", "grpo"}
MODE_LAYERS = ("train/run/plan/", "train/config/")  # where a mode's name may be compared
KEYS = {"n_pairs", "n_conversations", "mean_token_accuracy", "rewards/accuracies", "rewards/margins",
        "rewards/", "logps/", "reward", "reward_std", "kl"}  # a mode's batch and metric keys
KEY_OWNERS = (
    *MODE_LAYERS,
    "train/core/step.py",
    "train/core/preference/",
    "train/core/reward/",
    "train/data/",
)


def _literals(node: ast.AST) -> set[str]:
    """The string constants of a literal or of a tuple / list / set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_literals(e) for e in node.elts)) if node.elts else set()
    return set()


def mode_branches(kit: Path) -> list[str]:
    """file:line what, for every mode-name comparison and every sniffed mode key outside their layers."""
    found = []
    for path in sorted((kit / "train").rglob("*.py")):
        rel = path.relative_to(kit).as_posix()
        names_here, keys_here = not rel.startswith(MODE_LAYERS), not rel.startswith(KEY_OWNERS)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                literals = set().union(*(_literals(s) for s in sides))
                if names_here and literals & MODE_NAMES:
                    found.append(f"{rel}:{node.lineno} compares {ast.unparse(node)}")
                membership = any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
                if keys_here and membership and _literals(node.left) & KEYS:
                    found.append(f"{rel}:{node.lineno} sniffs {ast.unparse(node)}")
            elif keys_here and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                asked = node.func.attr in ("get", "startswith", "pop") and node.args
                if asked and _literals(node.args[0]) & KEYS:
                    found.append(f"{rel}:{node.lineno} sniffs {ast.unparse(node)}")
    return found


def test_no_mode_branch_outside_the_plan_and_knob_layers():
    assert mode_branches(KIT) == []


@pytest.fixture
def kit(tmp_path) -> Path:
    for name, text in {
        # the plan's layer and the knob layer may compare modes; an objective reads its own keys
        "train/run/plan/fill.py": "def f(cfg):\n    return cfg.run.mode == 'dpo'\n",
        "train/config/knob_docs.py": "def f(mode):\n    return mode in ('sft', 'dpo')\n",
        "train/core/step.py": "def f(batch):\n    return batch.get('n_conversations', 1)\n",
        "train/run/loop/meter.py": "def f(objective, batch):\n    return objective.samples(batch)\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_planted_kit_passes(kit):
    assert mode_branches(kit) == []


@pytest.mark.parametrize("text, expected", [
    ("def f(cfg):\n    return cfg.run.mode == 'dpo'\n", "compares cfg.run.mode == 'dpo'"),
    ("def f(mode):\n    return mode in ('sft', 'dpo')\n", "compares mode in ('sft', 'dpo')"),
    ("def f(e):\n    return 'sft' != e['mode']\n", "compares 'sft' != e['mode']"),
    ("def f(batch):\n    return 'n_pairs' in batch\n", "sniffs 'n_pairs' in batch"),
    ("def f(row):\n    return 'rewards/accuracies' not in row\n", "sniffs 'rewards/accuracies' not in row"),
    ("def f(batch):\n    return batch.get('n_pairs', 0)\n", "sniffs batch.get('n_pairs', 0)"),
    ("def f(name):\n    return name.startswith('rewards/')\n", "sniffs name.startswith('rewards/')"),
])
def test_a_mode_branch_in_a_shared_part_fails(kit, text, expected):
    (kit / "train/run/loop/meter.py").write_text(text)
    assert [f"train/run/loop/meter.py:2 {expected}"] == mode_branches(kit)
