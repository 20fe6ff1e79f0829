"""Reward training's rewards: each built-in (exact, accuracy, format, length) on the completions TRL hands a
reward, a user's own reward file loaded by REWARD_FUNCS=file.py:name and called with TRL's arguments
and the data's columns, REWARD_WEIGHTS' weighted sum with None left out, and every way a reward can fail
(raise, hang past REWARD_TIMEOUT, return NaN, the wrong number of values, what is not a number) stopping
with one line that names the reward."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from train.core.errors import UsageError
from train.core.reward.builtin import BUILTINS, Options, accuracy, exact, last_number
from train.core.reward.guard import RewardFailed, RewardSet, State
from train.data.prompt.arithmetic import TASK_PATTERN, TASK_REWARDS
from train.run.plan.reward_funcs import build_rewards, user_files, weights_of

NUMBER_ALONE = r"\A\s*-?\d+\s*\Z"


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and isinstance(err.value, UsageError), text
    return text


def write_rewards(tmp_path, body: str, name: str = "my_rewards.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


# ---- the built-ins --------------------------------------------------------------------------------


def test_exact_collapses_spacing_and_case_and_skips_a_missing_answer():
    completions = ["  Paris ", "paris\n", "Lyon", "Rome"]
    assert exact(completions, answer=["paris", "Paris", "Paris", None]) == [1.0, 1.0, 0.0, None]
    # TRL's column name, where the data has no `answer`
    assert exact(["x"], solution=["X"]) == [1.0]


@pytest.mark.parametrize(
    "text, number",
    [
        ("The answer is 7.", 7.0),
        ("3-4", 4.0),
        ("x = -4", -4.0),
        ("$1,000", 1000.0),
        ("it costs 1,234.5 euros", 1234.5),
        ("2, 3, 4", 4.0),
        ("42%", 42.0),
        ("5 km", 5.0),
        ("... #### 72", 72.0),
        ("\u22125", -5.0),
        ("no digits", None),
    ],
)
def test_the_last_number_is_read_through_commas_signs_and_units(text, number):
    assert last_number(text) == number


def test_accuracy_compares_the_last_number_with_the_answer():
    completions = ["7", "3 + 4 = 7", "The answer: 7 apples", "7 or 8", "seven", "7.0000001", "1,000"]
    answers = ["7", "7", 7, "7", "7", "7", "$1000"]
    assert accuracy(completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    # a gold answer with no number is no judgement (None), as TRL's accuracy_reward skips an unparseable one
    assert accuracy(["7", "7"], answer=["n/a", None]) == [None, None]
    # conversational completions: a list of messages, the last one's content read
    assert accuracy([[{"role": "assistant", "content": "It is 12"}]], solution=["12"]) == [1.0]


def test_accuracy_without_an_answer_column_is_one_line_before_any_work():
    rewards = build_rewards("accuracy,format", pattern=NUMBER_ALONE)
    with pytest.raises(UsageError) as err:
        rewards.check_columns(["id", "topic"])
    assert "REWARD_FUNCS=accuracy: DATA_PATH has no 'answer' or 'solution' column" in one_line(err)
    assert "id, topic" in str(err.value)
    rewards.check_columns(["solution"])  # TRL's name will do
    with pytest.raises(UsageError) as err:  # called anyway: the same kind of line, from the call
        rewards.score(["q"], ["7"], [[1]], {})
    assert "REWARD_FUNCS=accuracy: the data has no 'answer' or 'solution' column" in one_line(err)


def test_format_searches_reward_pattern_the_built_in_tasks_by_default():
    alone = BUILTINS["format"].make(Options(pattern=NUMBER_ALONE))
    assert alone(["7", " 12\n", "-3", "7 apples", "x 7", "", "1.5"]) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    think = BUILTINS["format"].make(Options(pattern=r"\A<think>.*</think>"))
    assert think(["<think>\na\nb\n</think> 4", "4 <think></think>"]) == [1.0, 0.0]  # "." crosses lines
    with pytest.raises(UsageError) as err:
        BUILTINS["format"].make(Options(pattern="(unclosed"))
    assert one_line(err).startswith("REWARD_PATTERN='(unclosed': not a regular expression")
    # no pattern: the built-in task's (a number first, no other digit after it); on other data, refused
    task = build_rewards("format", builtin_data=True)
    completions = ["7", " 12\n", "7 apples", "7\n  x = 8", "x 7", "", "-3 and so on"]
    assert task.score([""] * 7, completions)[:, 0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert TASK_PATTERN == r"\A\s*-?\d+\D*\Z"
    with pytest.raises(UsageError) as err:
        build_rewards("format")
    assert one_line(err).startswith("REWARD_FUNCS=format needs REWARD_PATTERN")


def test_length_scores_the_token_count_against_reward_length():
    length = BUILTINS["length"].make(Options(length=4))
    assert length(["a"] * 5, completion_ids=[[1] * 4, [1] * 2, [1] * 6, [1] * 8, []]) == [
        1.0,
        0.5,
        0.5,
        0.0,
        0.0,
    ]
    with pytest.raises(UsageError) as err:
        build_rewards("length")
    assert "REWARD_FUNCS=length needs REWARD_LENGTH" in one_line(err)


def test_empty_reward_funcs_is_the_tasks_set_on_built_in_data_and_refused_on_the_users():
    assert build_rewards("", builtin_data=True).names == TASK_REWARDS.split(",") == ["accuracy", "format"]
    with pytest.raises(UsageError) as err:
        build_rewards(None)
    assert one_line(err).startswith("REWARD_FUNCS: name the rewards for DATA_PATH")


@pytest.mark.parametrize(
    "funcs, expected",
    [
        ("accuracy,speling", "unknown reward 'speling'; built-ins: exact ("),
        ("accuracy,,format", "an empty name between commas"),
        ("format,format", "format is named twice"),
        ("missing.py:score", "REWARD_FUNCS=missing.py:score: no such file"),
    ],
)
def test_bad_reward_funcs_are_one_line(funcs, expected):
    with pytest.raises(UsageError) as err:
        build_rewards(funcs)
    assert expected in one_line(err)


# ---- weights and the weighted sum -------------------------------------------------------------------


def test_weights_default_to_one_each_and_weigh_the_sum_with_none_left_out():
    assert weights_of("", ["a", "b"]) == [1.0, 1.0] and weights_of(None, ["a"]) == [1.0]
    rewards = build_rewards("accuracy,format", "2,0.5", pattern=NUMBER_ALONE)
    assert rewards.weights.tolist() == [2.0, 0.5]
    scores = rewards.score(["q"] * 4, ["7", "7 apples", "8", "x"], None, {"answer": ["7", "7", "7", None]})
    assert torch.equal(
        torch.isnan(scores), torch.tensor([[False, False], [False, False], [False, False], [True, False]])
    )
    assert rewards.combine(scores).tolist() == [2.5, 2.0, 0.5, 0.0]  # the None of row 4 counts as nothing
    # a completion no reward judged has no reward: NaN, for the group statistics to leave out
    only = build_rewards("accuracy")
    assert math.isnan(only.combine(only.score(["q"], ["7"], None, {"answer": ["none"]}))[0].item())


@pytest.mark.parametrize(
    "weights, expected",
    [
        ("1", "1 weights for 2 rewards (REWARD_FUNCS=accuracy,format)"),
        ("1,abc", "expected numbers separated by commas"),
        ("0,0", "not all of them 0"),
        ("1,inf", "each weight a finite number"),
    ],
)
def test_bad_reward_weights_are_one_line(weights, expected):
    with pytest.raises(UsageError) as err:
        build_rewards("accuracy,format", weights, pattern=NUMBER_ALONE)
    assert one_line(err).startswith("REWARD_WEIGHTS=") and expected in str(err.value)


def test_reward_timeout_must_be_positive():
    with pytest.raises(UsageError) as err:
        build_rewards("format", timeout=0)
    assert one_line(err).startswith("REWARD_TIMEOUT=0")


# ---- a user's own rewards -------------------------------------------------------------------------


USER = """
    seen = {}

    def score(completions, prompts, answer, topic, completion_ids, trainer_state, log_metric, **kwargs):
        seen.update(prompts=prompts, answer=answer, topic=topic, ids=completion_ids,
                    step=trainer_state.global_step, extra=sorted(kwargs))
        log_metric("score/seen", len(completions))
        return [1.0 if c.strip() == a else None if a is None else -1.0 for c, a in zip(completions, answer)]

    def shout(completions, **kwargs):
        completions.append("side effect")  # the next reward must not see it
        return [float(c.isupper()) for c in completions[:-1]]

    async def later(completions, **kwargs):
        return [0.25 for _ in completions]

    class Scale:
        def __call__(self, completions, **kwargs):
            return [len(c) / 10 for c in completions]

    scale = Scale()
"""


def test_a_users_file_is_loaded_by_name_and_called_with_trls_arguments_and_the_columns(tmp_path):
    path = write_rewards(tmp_path, USER)
    funcs = f"{path}:score,{path}:shout,exact,{path}:later,{path}:scale"
    assert user_files(funcs) == [f"{path}:score", f"{path}:shout", f"{path}:later", f"{path}:scale"]
    assert user_files(" rewards.py:f , accuracy") == ["rewards.py:f"] and user_files(None) == []
    rewards = build_rewards(funcs, "1,1,1,1,2")
    columns = {"answer": ["7", "hi", None], "topic": ["math", "greeting", "x"]}
    scores = rewards.score(
        ["q1", "q2", "q3"],
        ["7", "HI", "no"],
        [[5], [6, 7], []],
        columns,
        state=State(global_step=3, max_steps=10),
    )
    seen = rewards.rewards[0].fn.__globals__["seen"]  # the user's module, imported once for all four
    assert seen == {
        "prompts": ["q1", "q2", "q3"],
        "answer": ["7", "hi", None],
        "topic": ["math", "greeting", "x"],
        "ids": [[5], [6, 7], []],
        "step": 3,
        "extra": ["log_extra"],
    }
    assert rewards.rewards[1].fn.__globals__ is rewards.rewards[0].fn.__globals__
    # score is case-sensitive, exact folds case; None (no answer) is NaN, left out of the sum
    expected = [[1.0, 0.0, 1.0, 0.25, 0.1], [-1.0, 1.0, 1.0, 0.25, 0.2], [math.nan, 0.0, math.nan, 0.25, 0.2]]
    assert torch.allclose(scores, torch.tensor(expected), equal_nan=True)
    assert rewards.combine(scores).tolist() == pytest.approx([2.45, 1.65, 0.65])
    assert rewards.logged.drain() == ({"score/seen": 3.0}, {})
    assert rewards.logged.drain() == ({}, {})


@pytest.mark.parametrize(
    "body, timeout, expected",
    [
        (
            "def bad(completions, **kw):\n    return [1 / 0 for c in completions]\n",
            5,
            "reward '{path}:bad' raised ZeroDivisionError: division by zero (at my_rewards.py:2)",
        ),
        (
            "import time\ndef bad(completions, **kw):\n    time.sleep(20)\n",
            0.2,
            "reward '{path}:bad' did not return within REWARD_TIMEOUT=0.2 s",
        ),
        (
            "def bad(completions, **kw):\n    return [float('nan')] * len(completions)\n",
            5,
            "reward '{path}:bad' returned nan at completion 0: not a finite number (None skips a completion",
        ),
        (
            "def bad(completions, **kw):\n    return [1.0, float('inf')]\n",
            5,
            "reward '{path}:bad' returned inf at completion 1: not a finite number",
        ),
        (
            "def bad(completions, **kw):\n    return [1.0]\n",
            5,
            "reward '{path}:bad' returned 1 values for 2 completions",
        ),
        (
            "def bad(completions, **kw):\n    return [1.0, 'good']\n",
            5,
            "reward '{path}:bad' returned str 'good' at completion 1, not a number",
        ),
        (
            "def bad(completions, **kw):\n    return {'a': 1.0}\n",
            5,
            "reward '{path}:bad' returned dict {{'a': 1.0}}; a reward returns a list of 2 numbers",
        ),
        (
            "def bad(completions, **kw):\n    return [[1.0], [2.0]]\n",
            5,
            "reward '{path}:bad' returned list [1.0] at completion 0, not a number",
        ),
    ],
)
def test_a_reward_that_fails_stops_with_one_line_naming_it(tmp_path, body, timeout, expected):
    path = write_rewards(tmp_path, body)
    rewards = build_rewards(f"{path}:bad", timeout=timeout)
    with pytest.raises(RewardFailed) as err:
        rewards.score(["q", "q"], ["a", "b"], None, {})
    assert one_line(err).startswith("REWARD_FUNCS: ") and expected.format(path=path) in str(err.value)


def test_numpy_and_tensor_answers_and_bools_are_numbers(tmp_path):
    path = write_rewards(
        tmp_path,
        """
        import torch
        def as_tensor(completions, **kw):
            return torch.tensor([1.0, 0.5])
        def as_bools(completions, **kw):
            return [True, False]
    """,
    )
    rewards = build_rewards(f"{path}:as_tensor,{path}:as_bools")
    assert rewards.score(["q", "q"], ["a", "b"]).tolist() == [[1.0, 1.0], [0.5, 0.0]]


@pytest.mark.parametrize(
    "body, item, expected",
    [
        (
            "def score(completions, **kw):\n    return []\n",
            "scor",
            "my_rewards.py has no 'scor' (it defines: score)",
        ),
        ("class Score:\n    pass\n", "Score", "Score is a class (name a function, or an instance)"),
        ("limit = 3\n", "limit", "limit is int, not a reward function"),
        ("raise RuntimeError('needs a GPU')\n", "score", "importing {path} raised RuntimeError: needs a GPU"),
        ("def score(:\n", "score", "importing {path} raised SyntaxError"),
        ("def score(completions, **kw):\n    return []\n", "9x", "'9x' is not a Python name"),
    ],
)
def test_a_bad_user_reward_is_refused_at_load_in_one_line(tmp_path, body, item, expected):
    path = write_rewards(tmp_path, body)
    with pytest.raises(UsageError) as err:
        build_rewards(f"{path}:{item}")
    assert one_line(err).startswith(f"REWARD_FUNCS={path}:{item}: ") and expected.format(path=path) in str(
        err.value
    )


def test_a_user_file_that_hangs_on_import_is_bounded_too(tmp_path):
    path = write_rewards(
        tmp_path, "import time\ntime.sleep(20)\ndef score(completions, **kw):\n    return []\n"
    )
    with pytest.raises(RewardFailed) as err:
        build_rewards(f"{path}:score", timeout=0.2)
    assert f"importing {path} did not return within REWARD_TIMEOUT=0.2 s" in one_line(err)


def test_every_reward_gets_its_own_lists(tmp_path):
    # USER's shout appends to its completions; exact, called next, still sees three
    path = write_rewards(tmp_path, USER)
    rewards = build_rewards(f"{path}:shout,exact")
    scores = rewards.score(["q"] * 3, ["A", "b", "C"], None, {"answer": ["a", "b", "x"]})
    assert scores.tolist() == [[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]]


def test_the_set_is_a_reward_set_of_named_rewards():
    rewards = build_rewards("exact,accuracy,format,length", length=8, pattern=r"\d")
    assert isinstance(rewards, RewardSet) and rewards.names == ["exact", "accuracy", "format", "length"]
    scores = rewards.score(["q"], ["12"], [[1] * 8], {"answer": ["12"]})
    assert scores.tolist() == [[1.0, 1.0, 1.0, 1.0]]


def test_a_hung_reward_does_not_hold_the_process_open(tmp_path):
    # The thread of a call past REWARD_TIMEOUT cannot be stopped; it is a daemon, so the process that
    # stops with the one line exits at once instead of waiting out the reward's 600 s.
    path = write_rewards(tmp_path, "import time\ndef bad(completions, **kw):\n    time.sleep(600)\n")
    script = textwrap.dedent(f"""
        import sys
        from train.core.errors import UsageError
        from train.run.plan.reward_funcs import build_rewards
        try:
            build_rewards({str(path) + ":bad"!r}, timeout=0.2).score(["q"], ["a"])
        except UsageError as err:
            print(f"error: {{err}}", file=sys.stderr)
            sys.exit(2)
    """)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: REWARD_FUNCS: reward '{path}:bad' did not return within "
        "REWARD_TIMEOUT=0.2 s (a loop without end, or a call that waits?); "
        "raise REWARD_TIMEOUT if it is only slow"
    ]
