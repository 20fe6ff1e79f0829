"""Reward training's front door for prompts: DATA_PATH (or the built-in arithmetic task) -> Prompts ->
the prompt text as the chat template frames it -> token ids, and each batch's prompts and columns as
the rewards get them; VAL_PATH's prompts come through the same door, VAL_FRACTION's are a PromptSet's
last part.

A prompt is rendered as SFT frames the prompt of a conversation and as `python -m train generate`
prompts a model: train/data/sft/sft_data.py's prompt_for_generation, the text up to where the
assistant's reply starts (the built-in template's "<|assistant|>\\n", the tokenizer's own template
with add_generation_prompt=True, TEMPLATE=none's source + eos). A string prompt is one user turn here,
as SFT reads TRL's prompt-completion strings (TRL itself feeds a string prompt to the model as it
is; this kit's models were fine-tuned with a template, so they are asked through it). A model with
no chat template at all (a pretraining run's final/) continues the turns' text, joined by newlines,
as generate does. The ids carry no special tokens beyond what the text holds (the template writes
its own), as generate tokenizes. A prompt the template cannot render within its bound, that makes
no tokens, or that is longer than max_tokens (the room MAX_LENGTH leaves the completion) is a bad
record: one line, or skipped and counted with SKIP_BAD_RECORDS=1.
Imports train/core and train/data only, never the root config.py or a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from train.data.chat import formats
from train.data.chat.encode import prompt_for_generation
from train.data.chat.render_bounds import RenderFailed
from train.data.chat.template_table import plain_prompt
from train.data.prompt.arithmetic import TASK_NAME, arithmetic_prompts
from train.data.prompt.prompt_formats import Prompt, converted, open_prompts


def render_prompt(tokenizer, conversation: Sequence[dict]) -> str:
    """The prompt's text, up to where the reply starts (module doc); RenderFailed from a template
    that fails, loops or grows past its bound. The tokenizer is ready for SFT's templates (its
    final/ folder's, or ensure_special_tokens'd)."""
    if tokenizer.chat_template is None:
        return plain_prompt(conversation)
    return prompt_for_generation(tokenizer, conversation)


def encode_prompts(
    prompts: Sequence[Prompt], tokenizer, max_tokens: int | None = None
) -> tuple[list[list[int] | None], list[str]]:
    """Each prompt's ids (None for a bad one) and "place: reason" of each bad one, in order."""
    ids: list[list[int] | None] = []
    bad: list[str] = []
    for prompt in prompts:
        reason = None
        try:
            row = tokenizer(render_prompt(tokenizer, prompt.turns), add_special_tokens=False)["input_ids"]
        except RenderFailed as err:
            row, reason = None, f"cannot be rendered by the chat template: {err.reason}"
        if row is not None and not row:
            reason = "makes no tokens with the chat template"
        elif row is not None and max_tokens is not None and len(row) > max_tokens:
            reason = (
                f"is {len(row)} tokens with the chat template; at most {max_tokens} fit with the "
                "completion's room (raise MAX_LENGTH, or shorten the prompt)"
            )
        ids.append(None if reason else row)
        if reason:
            bad.append(f"{prompt.place or 'a prompt'}: {reason}")
    return ids, bad


@dataclass(frozen=True)
class PromptSet:
    """The run's prompts, their ids, the format read, and the records skipped (SKIP_BAD_RECORDS=1)."""

    unit: ClassVar[str] = "prompts"  # what train/data/holdout.py's held-out split counts
    prompts: list[Prompt]
    ids: list[list[int]]
    format: str
    n_skipped: int = 0
    first_error: str | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def column_names(self) -> list[str]:
        """Every extra column any prompt has, in order of first appearance (RewardSet.check_columns)."""
        return list(dict.fromkeys(k for p in self.prompts for k in p.columns))

    def part(self, lo: int, hi: int) -> PromptSet:
        """Prompts lo .. hi - 1 (VAL_FRACTION's split: holdout.held_out), indexed from 0."""
        return replace(self, prompts=self.prompts[lo:hi], ids=self.ids[lo:hi])

    def for_rewards(self, index: Sequence[int], repeat: int = 1) -> tuple[list, dict[str, list]]:
        """(prompts, columns) of the prompts at `index` as rewards get them, each repeated `repeat`
        times in a row (a prompt's completions are consecutive, as TRL's sampler lays out a group);
        a column a prompt lacks is None there."""
        rows = [self.prompts[i] for i in index for _ in range(repeat)]
        return [r.prompt for r in rows], {k: [r.columns.get(k) for r in rows] for k in self.column_names}


def prompt_set(
    data_path: str | Path | None,
    tokenizer,
    *,
    skip_bad_records: bool = False,
    max_tokens: int | None = None,
    seed: int = 0,
    say: Callable[[str], None] = print,
) -> PromptSet:
    """DATA_PATH's prompts (None: the built-in arithmetic task, shuffled by SEED), rendered and
    encoded; says the format and the counts. A bad record stops with one line naming DATA_PATH and its
    place unless skip_bad_records; a set with no good prompt stops in any case."""
    unusable: list[str] = []
    if data_path is None:
        prompts, fmt = arithmetic_prompts(seed), TASK_NAME
    else:
        name, items = open_prompts(data_path, skip_bad_records)
        (prompts, unusable), fmt = converted(items, name), f"format {name}"
    ids, bad = encode_prompts(prompts, tokenizer, max_tokens)
    bad = unusable + bad
    if bad and not skip_bad_records:
        raise formats.refuse_bad(bad[0])
    kept = [(p, row) for p, row in zip(prompts, ids, strict=True) if row is not None]
    if not kept:
        raise formats.all_bad(data_path or "built-in", len(bad), bad[0])
    say(f"prompt data: {data_path or 'built-in'}, {fmt}, {len(kept)} prompts")
    if bad:
        say(f"skipped {len(bad)} bad record(s) (SKIP_BAD_RECORDS=1); the rest train; the first: {bad[0]}")
    first = bad[0] if bad else None
    return PromptSet([p for p, _ in kept], [row for _, row in kept], fmt, len(bad), first)
