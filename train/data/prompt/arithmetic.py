"""The built-in reward task (DATA_PATH left empty): one-digit arithmetic with a checkable answer.

Every sum a + b and every difference a - b (a >= b, so no answer is negative) of the digits 0 to 9,
155 problems, each a prompt "What is 3 + 4? Answer with a number." with its `answer` column ("7"),
in an order shuffled by SEED: deterministic and offline, as the other built-in sets are.

Its rewards (TASK_REWARDS, TASK_PATTERN; REWARD_FUNCS and REWARD_PATTERN left empty): accuracy (the
completion's last number is the answer) and format (the completion opens with a number and writes
no other digit after it, so that its first number is the one accuracy reads). The format reward
pays first: the README's nano model after its 50 SFT steps writes code, and a number alone followed
by the end of the turn came 0 times in 256 samples of 8 tokens (it stopped in 1), while a number
first with no digit after it came in 3 % of the first step's samples and 6 % of the first ten steps',
enough for the completions of some groups to differ.

Measured on that model (2026-11-28, 2 shared cores) with a bare GRPO update outside the kit (8
prompts x 8 completions of at most 8 tokens, group-normalized advantages, no KL, AdamW lr 5e-4, 60
steps, 14 min): format 6 % of the completions over steps 0-9, 70 % over 20-29, 91 % over 50-59; accuracy
0.6 % -> 7 %, which is the share of problems whose answer is 0, the number the model settled on. So
the answer's shape is learned in minutes on a CPU and the sums are not: the group's completions
become alike and the signal thins (groups whose rewards differ at all: 91 % of them over steps 10-29,
54 % over 50-59). At lr 1e-4 the same 60 steps (20 min): format 4 % -> 53 %, accuracy 1 % -> 6 %.
"Repeat the number 7." prompts instead (answers 0 to 18, 50 steps at lr 5e-4) went the same way:
format 16 % -> 89 %, accuracy 1 % -> 6 %, the model again settled on 0. A run that should learn the
sums needs more than this: more steps, a KL or entropy term, or a model that starts closer.
"""

from __future__ import annotations

import random

from train.data.prompt.prompt_formats import ANSWER, Prompt

TASK_REWARDS = "accuracy,format"  # REWARD_FUNCS left empty on this task: the right number, and its shape
# REWARD_PATTERN left empty on this task: a number first and no other digit after it (module doc: a
# pattern that waits for the end of the turn pays nothing to learn from at first).
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
