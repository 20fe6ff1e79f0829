"""The built-in reward task (DATA_PATH left empty): one-digit arithmetic with a checkable answer.

Every sum a + b and every difference a - b (a >= b, so no answer is negative) of the digits 0 to 9,
155 problems, each a prompt "What is 3 + 4? Answer with a number." with its `answer` column ("7"),
in an order shuffled by SEED: deterministic and offline, as the other built-in sets are. The answers
run from 0 to 18, so a model that writes any small number is right about one time in ten: a group
of completions of one prompt then differs in reward from the first steps, which is what GRPO's
group-relative advantage needs, and a nano model can move on it in a few minutes of CPU.

Its rewards (TASK_REWARDS in train/run/plan/reward_funcs.py): accuracy (the completion's last
number is the answer) and format (the completion is a number alone, DEFAULT_PATTERN). The format
reward pays before accuracy does: a model that learns to answer with a number and stop has learned
the answer's shape, and then only the right number separates the completions of a group.
"""

from __future__ import annotations

import random

from train.data.prompt.prompt_formats import ANSWER, Prompt

TASK_REWARDS = (
    "accuracy,format"  # REWARD_FUNCS left empty on this task: the right number, and the answer's shape
)
# REWARD_PATTERN left empty on this task: the completion opens with a number and writes no other digit
# (its first number is then its last, the one accuracy reads). A number alone, then the end of the
# turn, is the shape to reach; but a nano model fresh from SFT almost never stops within a few
# tokens (module doc), so a pattern that waits for the stop pays nothing to learn from.
TASK_PATTERN = r"\A\s*-?\d+\D*\Z"
TASK_NAME = "built-in arithmetic (a + b and a - b of the digits 0-9, 155 problems; the answer a number)"
QUESTION = "What is {a} {op} {b}? Answer with a number."


def problems() -> list[tuple[int, str, int, int]]:
    """(a, op, b, answer) of every problem, in a fixed order."""
    sums = [(a, "+", b, a + b) for a in range(10) for b in range(10)]
    differences = [(a, "-", b, a - b) for a in range(10) for b in range(a + 1)]
    return sums + differences


def arithmetic_prompts(seed: int = 0, limit: int | None = None) -> list[Prompt]:
    """The task's prompts, shuffled by seed (the same seed, the same order), the first `limit` of them.
    Each prompt is a string (TRL's standard form: rewards get string completions) rendered as one user
    turn by the chat template."""
    order = problems()
    random.Random(seed).shuffle(order)
    prompts = []
    for k, (a, op, b, answer) in enumerate(order[:limit], 1):
        question = QUESTION.format(a=a, op=op, b=b)
        prompts.append(
            Prompt(
                question,
                [{"role": "user", "content": question}],
                {ANSWER: str(answer)},
                f"built-in problem {k}",
            )
        )
    return prompts
