"""Chat templates rendered within a bound of time and size: every render of the kit goes here.

A chat template is code from the user's folder (a TEMPLATE file, a tokenizer's
tokenizer_config.json): Jinja in transformers' sandbox, which stops it reaching Python but not
from looping ({% for %} over range(100000) nested twice), recursing, or writing gigabytes ('x' *
10**10, tojson(indent=10**9), a string doubled in a loop). Such a template, or a conversation
that makes a fair one cost without end (ten thousand turns: the prefix renders that find the
replies grow with the square of the turns), is one RenderFailed (a UsageError) with the reason:
the SFT encoder makes it a bad record (SKIP_BAD_RECORDS), generate and TEMPLATE's check stop
the command in one line.

How: the template is compiled once into an environment built like transformers' own (its
globals, filters and {% generation %} tag, so the text is the same as apply_chat_template's)
that checks a Budget at every call, filter, multiplication and piece of output: the time left,
and the characters left. A Budget spans every render of one conversation. A multiplication,
power or call whose numbers ask for more characters than are left is refused before it runs;
what any call returns is measured after. In a process's main thread (generate, the SFT
encoder's worker processes, TOKENIZE_WORKERS=1) a timer signal also stops a single step that
never returns to the checks.
"""

from __future__ import annotations

import contextvars
import functools
import signal
import threading
import time
from collections.abc import Sequence

from train.core.errors import UsageError

RENDER_SECONDS = 3.0  # one conversation's renders: real ones take milliseconds (2,000 turns: 0.2 s)
RENDER_CHARS = 32 << 20  # characters one conversation's renders may write (far past any MAX_LENGTH)
PER_INPUT_CHAR = 4  # ... or this many per character of the conversation, where that is more
MAX_POWER_BITS = 1 << 16  # an integer power bigger than this many bits is not chat markup


class RenderFailed(UsageError):
    """A chat template that fails, loops or grows past its bound on one conversation."""

    def __init__(self, reason: str, spent: bool = False):
        self.reason, self.spent = reason, spent  # spent: the budget ran out (not the template's own refusal)
        super().__init__(f"the chat template cannot render a conversation: {reason}")


class _OutOfTime(BaseException):
    """Raised inside the template (from the timer or a check): a BaseException, so that no
    `except Exception` on the way swallows it."""


class Budget:
    """Time and characters left to one conversation's renders."""

    def __init__(self, chars: int = RENDER_CHARS, seconds: float = RENDER_SECONDS):
        self.chars, self.limit, self.seconds = chars, chars, seconds
        self.deadline = time.monotonic() + seconds

    @classmethod
    def of(cls, conversation: Sequence[dict], tools=None) -> Budget:
        size = sum(
            len(str(t.get("content") or "")) + len(str(t.get("reasoning_content") or ""))
            for t in conversation
        )
        return cls(max(RENDER_CHARS, PER_INPUT_CHAR * (size + len(str(tools or "")))))

    def check(self, spent: int = 0) -> None:
        self.chars -= spent
        if self.chars < 0:
            raise RenderFailed(f"it writes more than {self.limit} characters", spent=True)
        if time.monotonic() > self.deadline:
            raise _OutOfTime

    def asks(self, n: int) -> None:
        """Refuse an operation that would make n characters (or items) before it runs."""
        if n > self.chars:
            raise RenderFailed(f"it writes more than {self.limit} characters", spent=True)
        self.check()


_budget: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("render_budget", default=None)


def _current() -> Budget:
    return _budget.get() or Budget()  # outside render_chat: a fresh bound


def _sized(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _checked_call(fn, skip: int = 0):
    """fn with the budget checked before (a number argument asking for more than is left: a
    width, a count, an indent) and after (what it returned). skip: leading arguments that are
    not such numbers (a filter's context and value)."""

    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
    def call(*args, **kwargs):
        budget = _current()
        for arg in (*args[skip:], *kwargs.values()):
            if isinstance(arg, int) and not isinstance(arg, bool):
                budget.asks(abs(arg))
            budget.asks(_sized(arg))  # a string doubled through a macro's recursion
        result = fn(*args, **kwargs)
        budget.check()
        budget.asks(_sized(result))
        return result

    return call


@functools.lru_cache(maxsize=1)
def _environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            return _checked_call(lambda *a, **k: super(Bounded, __self).call(__context, __obj, *a, **k))(
                *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            budget = _current()
            if operator == "*":
                sized, times = (left, right) if _sized(left) else (right, left)
                if _sized(sized) and isinstance(times, int):
                    budget.asks(_sized(sized) * times)
            elif isinstance(left, int) and isinstance(right, int) and right > 0:
                if max(left.bit_length(), 1) * right > MAX_POWER_BITS:
                    raise RenderFailed(f"it computes {left} ** {right}, a number too large")
            result = super().call_binop(context, operator, left, right)
            budget.check()
            return result

    return Bounded


def _bounded_namespace(namespace):
    """The one place a Jinja template keeps a value from one loop turn to the next (its lists and
    dicts are immutable in the sandbox): a string doubled each turn is caught as it is stored."""

    class Bounded(namespace):
        def __setitem__(self, name, value):
            _current().asks(_sized(value))
            super().__setitem__(name, value)

    return Bounded


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """The template in an environment like transformers' (apply_chat_template's globals, filters,
    extensions and whitespace rules), every filter checked."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    base = _compile_jinja_template("").environment
    env = _environment_class()(trim_blocks=base.trim_blocks, lstrip_blocks=base.lstrip_blocks,
                               extensions=[type(e) for e in base.extensions.values()])  # fmt: skip
    env.globals.update(base.globals, namespace=_bounded_namespace(base.globals["namespace"]))
    env.filters.update(
        {name: _checked_call(fn, 1 + hasattr(fn, "jinja_pass_arg")) for name, fn in base.filters.items()}
    )
    return env.from_string(template)


def _on_timer(signum, frame):
    raise _OutOfTime


class _Timer:
    """SIGALRM after the seconds left, in the main thread only (where Python delivers signals)."""

    def __init__(self, seconds: float):
        self.seconds = max(seconds, 0.001)
        self.armed = threading.current_thread() is threading.main_thread()

    def __enter__(self):
        if self.armed:
            self.old = signal.signal(signal.SIGALRM, _on_timer)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)


def _prepared(tokenizer, messages, tools, template):
    """What apply_chat_template hands its template: the chosen template, the messages without
    their None values, plain data only, the reasoning under every name, the special tokens."""
    from transformers.utils.chat_template_utils import _alias_reasoning_fields, _plain_template_data

    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation")  # as transformers does
    chosen = tokenizer.get_chat_template(template, tools)
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    chat = _alias_reasoning_fields(_plain_template_data(chat))
    extra = _plain_template_data(dict(tokenizer.special_tokens_map))
    return chosen, chat, _plain_template_data(list(tools) if tools else None), extra


def render_chat(
    tokenizer,
    messages: Sequence[dict],
    tools: list | None = None,
    add_generation_prompt: bool = False,
    template: str | None = None,
    budget: Budget | None = None,
) -> str:
    """apply_chat_template(messages, tools=tools, tokenize=False, ...)'s text, within `budget`
    (a fresh one when None); RenderFailed with the reason otherwise."""
    budget = budget or Budget.of(messages, tools)
    token = _budget.set(budget)
    out: list[str] = []
    try:
        with _Timer(budget.deadline - time.monotonic()):
            chosen, chat, tools, extra = _prepared(tokenizer, messages, tools, template)
            compiled = _compile(chosen)
            for piece in compiled.generate(messages=chat, tools=tools, documents=None,
                                           add_generation_prompt=add_generation_prompt, **extra):  # fmt: skip
                out.append(piece)
                budget.check(len(piece))
    except _OutOfTime:
        raise RenderFailed(f"it runs past {budget.seconds:g} s (a loop without end?)", spent=True) from None
    except RenderFailed:
        raise
    except RecursionError:
        raise RenderFailed("it recurses or nests too deep") from None
    except MemoryError:
        raise RenderFailed("it needs more memory than the machine has") from None
    except Exception as err:  # jinja's TemplateError, a raise_exception() of the template, a bad value
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise RenderFailed(first[:200]) from None
    finally:
        _budget.reset(token)
    return "".join(out)
