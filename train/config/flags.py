"""Flags -> a validated TrainConfig: every config field is a --<field> flag, typed from its
annotation and documented by the docstring under it in config.py."""

from __future__ import annotations

import argparse
import ast
import inspect
from dataclasses import fields

import config
from train.config.knobs import applies, marked, refusal
from train.core.errors import UsageError


def field_docs() -> dict[str, str]:
    """The docstring under each field, read from this file's source (shown by --help)."""
    docs = {}
    for klass in config.SECTIONS.values():
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_type(name: str) -> type:
    """The scalar type of a field (int, float, bool or str), Optional unwrapped."""
    klass = config.SECTIONS[config.FIELD_SECTION[name]]
    annotation = {f.name: f.type for f in fields(klass)}[name]
    for scalar in ("bool", "int", "float", "str"):
        if annotation.split("|")[0].strip() == scalar:
            return {"bool": bool, "int": int, "float": float, "str": str}[scalar]
    raise TypeError(f"unsupported annotation {annotation} for {name}")


# Fields whose empty value the run decides ("auto" and "none" say the same): marked "auto" in
# config.py (tests/test_knob_lists.py keeps them fields that default to None).
AUTO_FIELDS = marked("auto")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_value(name: str, text: str):
    """Convert one flag's text to the field's type; an empty string means 'not set'."""
    kind = field_type(name)
    text = text.strip()
    if text == "" or text.lower() in ("none", "auto") and name in AUTO_FIELDS:
        return None
    if kind is bool:
        if text.lower() in TRUE_WORDS:
            return True
        if text.lower() in FALSE_WORDS:
            return False
        raise config.bad_value(name, "1 or 0", text)
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise config.bad_value(name, "a whole number", text) from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise config.bad_value(name, "a number", text) from None
    return text



class ArgParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one UsageError line instead of usage + exit."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see --help)")


FLAGS_NOTE = (" Each flag is a config.py field; [VARIABLE] is its launcher variable. Precedence: config.py's "
              "default < --preset < the flag.")
DESCRIPTIONS = {
    "pretrain": "Pretrain a model from scratch on text: a GPT-2-style causal LM, or a T5 encoder-decoder on "
                "span "
                "corruption (--model_family t5, or a T5 --model_config). The launchers run_single_gpu.sh and "
                "run_single_gpu_optimized.sh start it with the guides' baseline and optimized presets.",
    "sft": "Fine-tune a trained model (--model_path: a causal LM or an encoder-decoder folder; in full or "
           "with LoRA, "
           "--lora_r) on chat, instruction or plain-text data, or train a new one from scratch on it "
           "(--model_size / "
           "--model_config). The loss is on the assistant's replies (--loss_on all: every token). "
           "train_sft_custom.sh and quick_start_sft_fast.sh start it.",
    "dpo": "Preference training (the third stage: pretrain -> SFT -> DPO) of a chat model (--model_path; "
           "default the "
           "newest completed SFT run's final/) on pairs of chosen and rejected replies (--data_path): "
           "--dpo_loss "
           "sigmoid | ipo | hinge | simpo | orpo, --beta, a reference model (--reference copy | precomputed "
           "| adapters). train_dpo.sh starts it; docs/dpo.md.",
    "grpo": "Reward training (GRPO, the fourth stage) of a chat model (--model_path; default the newest "
            "completed SFT "
            "or DPO run's final/) on prompts (--data_path; default a built-in arithmetic task): "
            "--num_generations "
            "completions per prompt, scored by --reward_funcs. train_grpo.sh starts it; docs/grpo.md.",
}


def training_parser(command: str) -> argparse.ArgumentParser:
    """The flags of a training command. A mode's --help hides the flags of the knobs it does not read
    (knob(modes=...)), and pretraining's tools (find-batch, doctor, autotune, bench) pretraining's; such
    a flag given is still read, so parse_training_args refuses it in one line naming it."""
    docs = field_docs()
    mode = command if command in config.MODES else "pretrain"
    sft, dpo = command in ("sft", "dpo", "grpo"), command == "dpo"  # the presets a command offers
    description = DESCRIPTIONS.get(command, "It takes pretraining's flags, below.") + FLAGS_NOTE
    parser = ArgParser(prog=f"python -m train {command}", description=description)
    presets = sorted(p for p in config.PRESETS
                     if (p != "sft" or sft) and (p != "dpo" or dpo) and (p != "grpo" or command == "grpo"))
    parser.add_argument("--preset", choices=presets, help="named preset applied under the flags")
    parser.add_argument("--fp16", action="store_true", help="shorthand for --precision fp16 (ENABLE_FP16)")
    parser.add_argument("--bf16", action="store_true", help="shorthand for --precision bf16 (ENABLE_BF16)")
    parser.add_argument("--is_keep_training", nargs="?", const="1", help="the guides' name for --resume "
                                                                         "(RESUME)")
    for name in config.FIELD_SECTION:
        if name == "mode":  # the command itself
            continue
        kind = field_type(name)
        help_text = f"[{config.env_name(name)}] {docs.get(name, '')}".replace("%", "%%")
        if not applies(name, mode):
            help_text = argparse.SUPPRESS
        if kind is bool:
            # `--pin_memory` alone means on; `--pin_memory 0` turns a preset's setting off.
            parser.add_argument(f"--{name}", nargs="?", const="1", default=None, help=help_text)
        else:
            parser.add_argument(f"--{name}", default=None, help=help_text)
    return parser


def parse_training_args(command: str, argv: list[str]) -> config.TrainConfig:
    """Flags -> validated TrainConfig (precedence: default < the mode's own < preset < flag). A flag of a
    knob the command's mode does not read (knob(modes=...)) is refused, as it would be ignored."""
    args = training_parser(command).parse_args(argv)
    for name in config.FIELD_SECTION:  # given at all: a launcher passes only what is set, never empty
        given = (getattr(args, name, None) or "").strip()
        if given and command in config.MODES and not applies(name, command):
            raise UsageError(refusal(name, command))
    overrides = {"mode": command}
    for name in config.FIELD_SECTION:
        text = getattr(args, name, None)
        if text is not None:
            value = parse_value(name, text)
            if value is not None or name in AUTO_FIELDS:
                overrides[name] = value
    if args.is_keep_training is not None:  # the guides' --is_keep_training=True: --resume under another name
        keep = parse_value("resume", args.is_keep_training)
        if args.resume is not None and parse_value("resume", args.resume) != keep:
            raise UsageError("--is_keep_training and RESUME (--resume) disagree: set one")
        overrides["resume"] = keep
    if args.fp16 and args.bf16:
        raise UsageError("ENABLE_FP16 and ENABLE_BF16 are both set: choose one precision")
    if (args.fp16 or args.bf16) and args.precision not in (None, ""):
        raise UsageError("PRECISION is set together with ENABLE_FP16/ENABLE_BF16: choose one")
    if args.fp16:
        overrides["precision"] = "fp16"
    if args.bf16:
        overrides["precision"] = "bf16"
    return config.resolve(args.preset, overrides)


