"""The turns of any SFT source -> one conversation shape, tool calls, reasoning and weights included.

A conversation is a list of turns:
  {"role": "system" | "user" | "assistant" | "tool", "content": str}
content is always a string here, whatever shape the source gave it (see "Content" below).
An assistant turn may also carry
  "tool_calls": [{"type": "function", "function": {"name": str, "arguments": object}}]
  "reasoning_content": str, its thinking trace (the key Qwen3's and DeepSeek's templates read),
any turn may carry "loss_weight": 0.0 or 1.0 (0 = not trained) when the source gives one (the
renderer applies it), a tool turn is a call's result (its "tool_call_id" and "name" kept when the
source has them), and a conversation whose record lists tools starts with {"role": "tools",
"tools": [...]}, each tool {"type": "function", "function": <its JSON schema>}. That is the shape
transformers' chat templates take (apply_chat_template(messages, tools=...), arguments as an
object), so the tokenizer's own template gets it as it is; train/data/chat/encode.py renders it
either way. A plain-text record (only TEXT_FIELD, no turns) is [{"role": "text", "content": str}],
trained whole.

Content: a string, or a list of typed parts, in either spelling:
- OpenAI: {"type": "text", "text": ...} (also input_text / output_text / refusal);
- LLaMA-Factory v1: {"type": "text" | "reasoning" | "tool_call", "value": ...} (its
  v1_sft_demo.jsonl and reason_tool_use_demo_50.jsonl), with "loss_weight" on the message.
Text parts are joined; reasoning parts (and an OpenAI-style "reasoning_content" / "reasoning" /
"thinking" key on the message) become reasoning_content; tool_call parts (a JSON call, or a list)
become tool_calls; a "tools" part joins the record's tools. Image, audio, video and file parts are
refused: this kit trains text models.

Sources spell tool calls two ways, both accepted:
- ShareGPT / glaive (LLaMA-Factory's glaive_toolcall): turns from "function_call" (the value a
  JSON call {"name", "arguments"}, or a list of them) and "observation" (the result), and a
  record-level "tools": a JSON string or a list, of bare schemas or wrapped ones.
- OpenAI messages: an assistant turn's "tool_calls" ([{"type": "function", "function": {"name",
  "arguments"}}], arguments a JSON string or an object), turns of role "tool", a "tools" list.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from train.core.errors import UsageError
from train.data import json_lines

TOOLS_ROLE = "tools"
TEXT_ROLE = "text"  # a plain-text record's one turn, trained whole
# Source role -> conversation role; "function_call" is an assistant turn holding calls.
ROLE_NAMES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function": "tool",
}


# Content part types a text model reads. OpenAI names the value's key after the type ("text",
# "refusal"); LLaMA-Factory v1 calls it "value"; the Responses API's input_text/output_text are text.
TEXT_PARTS = ("text", "input_text", "output_text", "refusal")
REASONING_PARTS = ("reasoning", "thinking")
CALL_PARTS = ("tool_call", "tool_calls")
PART_TYPES = (*TEXT_PARTS, *REASONING_PARTS, *CALL_PARTS, "tools")
MEDIA_PARTS = {
    "image_url": "an image",
    "image": "an image",
    "input_image": "an image",
    "input_audio": "an audio",
    "audio": "an audio",
    "audio_url": "an audio",
    "video": "a video",
    "video_url": "a video",
    "file": "a file",
    "input_file": "a file",
}
# A message's own thinking trace: DeepSeek and Qwen3 data say reasoning_content, others reasoning or
# thinking (gpt-oss's template reads message.thinking).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


class BadRecord(ValueError):
    """One record that cannot be used; the loader adds the file and place to the message."""


def refuse_bad(first: str) -> UsageError:
    """A bad record stops the run (without SKIP_BAD_RECORDS): one line with its place."""
    return UsageError(f"DATA_PATH: {first} (SKIP_BAD_RECORDS=1 skips such records)")


def all_bad(data_path, skipped: int, first: str) -> UsageError:
    return UsageError(f"DATA_PATH: {data_path}: all {skipped} records are bad; the first: {first}")


@dataclass
class Parts:
    """What a list of content parts holds, each kind joined."""

    text: str
    reasoning: str
    calls: list[dict]
    tools: list[dict]
    kinds: list[str]  # each part's type, in order: for messages that say what was found


def _part_value(part: dict, kind: str, where: str) -> object:
    # None is a key the part does not have: a parquet or Arrow column of parts is one struct type,
    # so every part there carries every key of every other ({"type": "text", "text": ..., "value": None}).
    for key in ("value", kind, "text"):
        if part.get(key) is not None:
            return part[key]
    raise BadRecord(f"{where} ({kind}) has no {kind!r} or 'value'")


def parts(value: list, what: str) -> Parts:
    """A list of typed content parts -> Parts; a part a text model cannot train on is a BadRecord."""
    texts, reasoning, calls, tools, kinds = [], [], [], [], []
    for k, part in enumerate(value, 1):
        where = f"{what} part {k}"
        part = {"type": "text", "text": part} if isinstance(part, str) else part
        if not isinstance(part, dict):
            raise BadRecord(f"{where} is {type(part).__name__}, expected an object {{\"type\": ..., ...}}")
        kind = part.get("type") or "text"  # no type (or a null one, in parquet): a text part
        if isinstance(kind, str) and kind in MEDIA_PARTS:
            raise BadRecord(f"{where} is {MEDIA_PARTS[kind]} part: this kit trains text models")
        if kind not in PART_TYPES:
            raise BadRecord(f"{where} has type {kind!r}; read: {', '.join(PART_TYPES)}")
        kinds.append(kind)
        raw = _part_value(part, kind, where)
        if kind in CALL_PARTS:
            calls += _calls(raw, f"{where} ({kind})")
        elif kind == "tools":
            tools += parse_tools(raw)
        elif not isinstance(raw, str):
            raise BadRecord(f"{where} ({kind}) is {type(raw).__name__}, expected a string")
        else:
            (reasoning if kind in REASONING_PARTS else texts).append(raw)
    return Parts("".join(texts), "\n".join(reasoning), calls, tools, kinds)


def text(value: object, what: str) -> str:
    """A field that must be text: a string, or a list of text parts (joined)."""
    if isinstance(value, list):
        found = parts(value, what)
        other = sorted({k for k in found.kinds if k not in TEXT_PARTS})
        if other:
            raise BadRecord(f"{what} has {', '.join(other)} parts; only text is read here")
        return found.text
    if not isinstance(value, str):
        raise BadRecord(f"{what} is {type(value).__name__}, expected a string")
    return value


def _json(value: object, what: str) -> object:
    if not isinstance(value, str):
        return value
    try:  # json_lines' bounds: a string nested 100,000 deep is one bad record, as a line would be
        return json_lines.loads(value)
    except ValueError as err:
        reason = str(err)
        raise BadRecord(f"{what} is not JSON: {value[:60]!r}" if reason.startswith("not valid JSON")
                        else f"{what} {reason.replace('to be a record', 'to read')}") from None


def parse_tools(value: object) -> list[dict]:
    """A record's "tools" (a JSON string or a list; empty or missing: none) -> wrapped schemas."""
    if value is None or value == "":
        return []
    tools = _json(value, "'tools'")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRecord(f"'tools' is {type(tools).__name__}, expected a list of function schemas")
    out = []
    for i, tool in enumerate(tools, 1):
        schema = tool.get("function", tool) if tool.get("type", "function") == "function" else tool
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise BadRecord(f"tool {i} has no name")
        out.append({"type": "function", "function": schema})
    return out


def _call(value: object, what: str) -> dict:
    call = _json(value, what)
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        call = call["function"]  # OpenAI's {"type": "function", "function": {...}}
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise BadRecord(f"{what} is not a call ({{\"name\": ..., \"arguments\": ...}})")
    arguments = _json(call.get("arguments", {}), f"{what} arguments")
    if not isinstance(arguments, dict):  # a template writes them as keyword arguments: an object
        raise BadRecord(f"{what} arguments are a {type(arguments).__name__}, expected an object")
    return {"type": "function", "function": {"name": call["name"], "arguments": arguments}}


def _calls(value: object, what: str) -> list[dict]:
    value = _json(value, what)
    values = value if isinstance(value, list) else [value]
    if not values:
        raise BadRecord(f"{what} holds no call")
    return [_call(v, f"{what}" if len(values) == 1 else f"{what} call {k}") for k, v in enumerate(values, 1)]


def _loss_weight(turn: dict, what: str) -> float | None:
    weight = turn.get("loss_weight")
    if weight is None:
        return None
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight not in (0, 1):
        # a turn is trained or not: a 0.5 would be trained as 1 without a word, so it is said instead
        raise BadRecord(f"{what} loss_weight is {weight!r}, expected 0 (not trained) or 1 (trained); the kit "
                        "does not scale a turn's loss")
    return float(weight)


def _reasoning_key(turn: dict, what: str) -> str:
    for key in REASONING_KEYS:
        value = turn.get(key)
        if value is not None and value != "":
            if not isinstance(value, str):
                raise BadRecord(f"{what} {key!r} is {type(value).__name__}, expected a string")
            return value
    return ""


def _empty(i: int, found: Parts | None) -> str:
    # Say what was there: "empty" alone reads as a reader bug when the source had parts.
    if found is None:
        return f"no response (assistant turn {i} is empty)"
    if not found.kinds:
        return f"no response (assistant turn {i} is empty: its content is an empty list of parts)"
    kinds = ", ".join(dict.fromkeys(found.kinds))
    return (f"no response (assistant turn {i} is empty: its {len(found.kinds)} content part(s), of type "
            f"{kinds}, hold no text)")


def _content(turn: dict, role: str, content: object, i: int, tools: list) -> dict:
    """A turn's content (a string or typed parts), reasoning and calls -> the conversation's turn."""
    what, given_calls = f"turn {i}", role == "assistant" and turn.get("tool_calls")
    found, reasoning, calls = None, "", []
    if isinstance(content, list):
        found = parts(content, f"{what} content")
        tools += found.tools
        extra = sorted({k for k in found.kinds if k in REASONING_PARTS + CALL_PARTS})
        if role != "assistant" and extra:
            raise BadRecord(f"{what} ({role}) has {', '.join(extra)} parts; only an assistant turn carries "
                            f"them")
        content, reasoning, calls = found.text, found.reasoning, found.calls
    elif content is None and given_calls:
        content = ""
    elif not isinstance(content, str):
        raise BadRecord(f"{what} content is {type(content).__name__}, expected a string or a list of parts")
    out = {"role": role, "content": content}
    if role != "assistant":
        return out
    reasoning = "\n".join(r for r in (_reasoning_key(turn, what), reasoning) if r)
    calls = calls + (_calls(turn["tool_calls"], f"{what} tool_calls") if given_calls else [])
    if calls:
        out["tool_calls"] = calls
    if reasoning.strip():
        out["reasoning_content"] = reasoning
    # A reasoning trace or a call is a reply; an empty one would teach the model to end at once.
    if not (content.strip() or calls or reasoning.strip()):
        raise BadRecord(_empty(i, found))
    return out


def _turn(turn: dict, i: int, role_key: str, content_key: str, tools: list) -> dict:
    # Accept role/content inside "conversations" and from/value inside "messages": both occur.
    source_role = turn.get(role_key, turn.get("role", turn.get("from")))
    content = turn.get(content_key, turn.get("content", turn.get("value")))
    if not isinstance(source_role, str) or source_role not in ROLE_NAMES:
        raise BadRecord(f"turn {i} has role {source_role!r}; accepted: {', '.join(ROLE_NAMES)}")
    role = ROLE_NAMES[source_role]
    if source_role == "function_call":
        out = {"role": role, "content": "", "tool_calls": _calls(content, f"turn {i} (function_call)")}
    else:
        out = _content(turn, role, content, i, tools)
    if role == "tool":
        out.update({k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)})
    weight = _loss_weight(turn, f"turn {i}")
    if weight is not None:
        out["loss_weight"] = weight
    return out


def turns(raw: list, role_key: str, content_key: str, tools: object = None) -> list[dict]:
    """A record's turn list (and its "tools" field) -> a conversation, before the checks every
    format shares (formats.to_conversation)."""
    conversation, called, in_parts = [], False, []
    for i, turn in enumerate(raw, 1):
        if not isinstance(turn, dict):
            raise BadRecord(f"turn {i} is {type(turn).__name__}, expected an object")
        conversation.append(_turn(turn, i, role_key, content_key, in_parts))
        called = called or bool(conversation[-1].get("tool_calls"))
        # A result with no call before it would teach the model that results come unasked.
        if conversation[-1]["role"] == "tool" and not called:
            raise BadRecord(f"turn {i} is a tool result (observation) before any call")
    listed = parse_tools(tools)
    listed += [t for t in in_parts if t not in listed]  # a "tools" part (LLaMA-Factory v1's system message)
    return [{"role": TOOLS_ROLE, "tools": listed}, *conversation] if listed else conversation


def split_tools(conversation: Sequence[dict]) -> tuple[list[dict] | None, Sequence[dict]]:
    """(the tools list or None, the turns without it)."""
    if conversation and conversation[0]["role"] == TOOLS_ROLE:
        return conversation[0]["tools"], conversation[1:]
    return None, conversation


def call_text(call: dict) -> str:
    """A call as the built-in template writes it: {"name": ..., "arguments": ...} in JSON, as
    the Jinja filter tojson writes it (non-ASCII kept)."""
    function = call.get("function", call)
    return json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
