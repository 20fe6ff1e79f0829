"""A model family is one entry, a plan source is pure calls: two rules of the kit's shape, each a
function of the kit's folder, with a planted violation for each (as tests/test_architecture.py does).

1. No family branch outside train/models/: no code there asks what a model is (is_seq2seq,
   model_kind, config.is_encoder_decoder, an Auto class picked by hand) or compares a family name
   ("gpt2", "t5", "llama", "seq2seq" ...) with a model_type, MODEL_FAMILY or a family. The one
   switch read elsewhere is Family.source_target, the data shape that truly differs (source -> target
   pairs), and train/data/ may branch on the batch shape's name (kind == "seq2seq"), which the
   family hands it (Family.kind).
2. The plan sources (train/run/plan/*Source) keep nothing: no method assigns to self, so each
   call's result is what it returns (ModelChoice, tokenizer, Data, model)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KIT = Path(__file__).resolve().parent.parent
ASKS = {"is_seq2seq", "model_kind", "is_encoder_decoder", "auto_class_for", "AutoModelForSeq2SeqLM"}
NAMES = {"gpt2", "t5", "llama", "seq2seq", "causal", "mt5", "bart", "qwen2"}
ABOUT = ("model_type", "model_family", "family", "kind")
DATA_SHAPE = "train/data/"  # where the batch shape's name may be compared (Family.kind hands it over)


def _mentions(node: ast.AST) -> str:
    return ast.unparse(node)


def _literal_names(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)} & NAMES


def family_branches(kit: Path) -> list[str]:
    """file:line what, for every question about a model's family outside train/models/."""
    found = []
    for path in sorted((kit / "train").rglob("*.py")):
        rel = path.relative_to(kit).as_posix()
        if rel.startswith("train/models/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.name if isinstance(node, ast.alias) else None)
            if name is not None and name.split(".")[-1] in ASKS:
                found.append(f"{rel}:{node.lineno} asks {name}")
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for op in node.ops):
                sides = [node.left, *node.comparators]
                text = " ".join(_mentions(s) for s in sides)
                names = set().union(*(_literal_names(s) for s in sides))
                if names and any(a in text for a in ABOUT):
                    if rel.startswith(DATA_SHAPE) and "kind" in text and names <= {"seq2seq", "causal"}:
                        continue  # the batch shape's name, handed over by the family
                    found.append(f"{rel}:{node.lineno} compares {_mentions(node)}")
    return found


def impure_sources(kit: Path) -> list[str]:
    """file:line Class.method for every assignment to self in a plan source's methods."""
    found = []
    for path in sorted((kit / "train" / "run" / "plan").glob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(cls, ast.ClassDef) and cls.name.endswith("Source")):
                continue
            for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                for node in ast.walk(method):
                    targets = (node.targets if isinstance(node, ast.Assign)
                               else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
                    for target in targets:
                        for sub in ast.walk(target):
                            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                                found.append(f"{path.name}:{node.lineno} {cls.name}.{method.name} sets self.{sub.attr}")
    return found


def test_no_family_branch_outside_models():
    assert family_branches(KIT) == []


def test_plan_sources_are_pure():
    assert impure_sources(KIT) == []


def test_every_family_is_one_entry_with_every_size():
    """MODEL_FAMILY's choices are the registry's names, and every family has every MODEL_SIZE."""
    import config
    from train.models import FAMILIES, SIZES

    assert config.MODEL_FAMILIES == tuple(FAMILIES) and {"gpt2", "t5", "llama"} <= set(FAMILIES)
    for family in FAMILIES.values():
        assert set(family.sizes) == set(SIZES), family.name
        for size in SIZES:
            cfg = family.config_for(size, 8192, 0)
            assert cfg.model_type == family.name and cfg.vocab_size == 8192


@pytest.fixture
def kit(tmp_path) -> Path:
    for name, text in {
        "train/models/family.py": "def is_seq2seq(m):\n    return m.config.model_type == 't5'\n",
        "train/data/sft/cut.py": "def f(kind):\n    return kind == 'seq2seq'\n",
        "train/run/plan/build.py": "class PretrainingSource:\n    def choose(self, cfg):\n        return 1\n",
        "train/run/loop/parts.py": "def f(b):\n    return b.family.source_target\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_planted_kit_keeps_both_rules(kit):
    assert family_branches(kit) == [] and impure_sources(kit) == []


@pytest.mark.parametrize("text, expected", [
    ("from train.models.family import is_seq2seq\n", "asks is_seq2seq"),
    ("def f(m):\n    return m.config.is_encoder_decoder\n", "asks is_encoder_decoder"),
    ("def f(cfg):\n    return cfg.model.model_family != 'gpt2'\n", "compares cfg.model.model_family != 'gpt2'"),
    ("def f(c):\n    return c.model_type in ('t5', 'mt5')\n", "compares c.model_type in ('t5', 'mt5')"),
    ("def f(kind):\n    return kind == 'seq2seq'\n", "compares kind == 'seq2seq'"),  # outside data/
])
def test_a_family_branch_outside_models_fails(kit, text, expected):
    (kit / "train/run/loop/parts.py").write_text(text)
    assert any(expected in p for p in family_branches(kit)), family_branches(kit)


def test_a_source_that_keeps_state_fails(kit):
    (kit / "train/run/plan/build.py").write_text(
        "class PretrainingSource:\n    def choose(self, cfg):\n        self.hf_cfg = cfg\n        return 1\n")
    assert impure_sources(kit) == ["build.py:3 PretrainingSource.choose sets self.hf_cfg"]
