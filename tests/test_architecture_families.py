"""A model family is one entry, a plan source is pure calls: two rules of the kit's shape, each a
function of the kit's folder, with a planted violation for each (as tests/test_architecture.py does).

1. No family branch outside train/models/: no code there asks what a model is (is_seq2seq,
   model_kind, config.is_encoder_decoder, an Auto class picked by hand) or compares a family name
   ("gpt2", "t5", "llama", "seq2seq" ...) with a model_type, MODEL_FAMILY or a family, or a layout's
   name. The one thing read elsewhere is Family.layout, the strategy object that carries the
   encoder-decoder difference (targets, losses, log-probs, generation inputs, pick); the lines
   outside train/models/ that still branch on it (layout.encoder_decoder, or a capability such as
   layout.packs) are counted and may not grow (LAYOUT_BRANCHES).
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
LAYOUT_FIELDS = {"encoder_decoder", "packs", "shifted"}  # what a branch on the Layout reads
LAYOUT_BRANCHES = 3  # step.py forward, sft_model base-run ranking, generate span decoding; only fewer


def _mentions(node: ast.AST) -> str:
    return ast.unparse(node)


def _literal_names(node: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    } & NAMES


def nodes_outside_models(kit: Path):
    """(file, node) for every AST node of train/ outside train/models/."""
    for path in sorted((kit / "train").rglob("*.py")):
        rel = path.relative_to(kit).as_posix()
        if not rel.startswith("train/models/"):
            yield from ((rel, node) for node in ast.walk(ast.parse(path.read_text())))


def family_branches(kit: Path) -> list[str]:
    """file:line what, for every question about a model's family outside train/models/."""
    found = []
    for rel, node in nodes_outside_models(kit):
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
                found.append(f"{rel}:{node.lineno} compares {_mentions(node)}")
    return found


def layout_branches(kit: Path) -> list[str]:
    """file:line test, for every if / conditional expression / returned condition outside train/models/
    that reads the Layout's own switch (LAYOUT_FIELDS) instead of asking it to do the thing."""
    found = []
    for rel, node in nodes_outside_models(kit):
        test = (
            node.test
            if isinstance(node, (ast.If, ast.IfExp, ast.While))
            else node.value
            if isinstance(node, ast.Return) and isinstance(node.value, ast.BoolOp)
            else None
        )
        if (
            test is not None
            and {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)} & LAYOUT_FIELDS
        ):
            found.append(f"{rel}:{node.lineno} {ast.unparse(test)}")
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
                            if (
                                isinstance(sub, ast.Attribute)
                                and isinstance(sub.value, ast.Name)
                                and sub.value.id == "self"
                            ):
                                found.append(f"{path.name}:{node.lineno} {cls.name}.{method.name} sets "
                                             f"self.{sub.attr}")
    return found


def test_no_family_branch_outside_models():
    assert family_branches(KIT) == []


def test_branches_on_the_layout_outside_models_do_not_grow():
    assert len(layout_branches(KIT)) <= LAYOUT_BRANCHES, "\n".join(layout_branches(KIT))


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
        "train/data/chat/cut.py": "def f(layout):\n    return layout.pick(1, 2)\n",
        "train/run/plan/build.py": "class PretrainingSource:\n    def choose(self, cfg):\n        return 1\n",
        "train/run/loop/parts.py": "def f(plan):\n    return plan.family.name\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_planted_kit_keeps_both_rules(kit):
    assert family_branches(kit) == [] and impure_sources(kit) == [] and layout_branches(kit) == []


def test_a_branch_on_the_layout_is_counted(kit):
    (kit / "train/data/chat/cut.py").write_text("def f(layout):\n    return 1 if layout.encoder_decoder else "
                                                "2\n")
    assert layout_branches(kit) == ["train/data/chat/cut.py:2 layout.encoder_decoder"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("from train.models.family import is_seq2seq\n", "asks is_seq2seq"),
        ("def f(m):\n    return m.config.is_encoder_decoder\n", "asks is_encoder_decoder"),
        (
            "def f(cfg):\n    return cfg.model.model_family != 'gpt2'\n",
            "compares cfg.model.model_family != 'gpt2'",
        ),
        ("def f(c):\n    return c.model_type in ('t5', 'mt5')\n", "compares c.model_type in ('t5', 'mt5')"),
        ("def f(kind):\n    return kind == 'seq2seq'\n", "compares kind == 'seq2seq'"),
        ("def f(d):\n    return d.kind != 'causal'\n", "compares d.kind != 'causal'"),
    ],
)
def test_a_family_branch_outside_models_fails(kit, text, expected):
    (kit / "train/run/loop/parts.py").write_text(text)
    assert any(expected in p for p in family_branches(kit)), family_branches(kit)


def test_a_source_that_keeps_state_fails(kit):
    (kit / "train/run/plan/build.py").write_text(
        "class PretrainingSource:\n    def choose(self, cfg):\n        self.hf_cfg = cfg\n        return 1\n")
    assert impure_sources(kit) == ["build.py:3 PretrainingSource.choose sets self.hf_cfg"]
