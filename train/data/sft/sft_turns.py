"""The turns of any SFT source -> one conversation shape, tool calls included.

A conversation is a list of turns:
  {"role": "system" | "user" | "assistant" | "tool", "content": str}
where an assistant turn may also carry the calls it makes,
  "tool_calls": [{"type": "function", "function": {"name": str, "arguments": object}}],
a tool turn is a call's result (its "tool_call_id" and "name" kept when the source has them),
and a conversation whose record lists tools starts with {"role": "tools", "tools": [...]}, each
tool {"type": "function", "function": <its JSON schema>}. That is the shape transformers' chat
templates take (apply_chat_template(messages, tools=...), arguments as an object), so the
tokenizer's own template gets it as it is; train/data/sft/sft_data.py renders it either way.

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

TOOLS_ROLE = "tools"
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


class BadRecord(ValueError):
    """One record that cannot be used; the loader adds the file and place to the message."""


def text(value: object, what: str) -> str:
    # OpenAI-style content can be a list of parts; the text parts are what a text model can use.
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        value = "".join(str(p.get("text", "")) for p in value)
    if not isinstance(value, str):
        raise BadRecord(f"{what} is {type(value).__name__}, expected a string")
    return value


def _json(value: object, what: str) -> object:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise BadRecord(f"{what} is not JSON: {value[:60]!r}") from None


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


def _turn(turn: dict, i: int, role_key: str, content_key: str) -> dict:
    # Accept role/content inside "conversations" and from/value inside "messages": both occur.
    source_role = turn.get(role_key, turn.get("role", turn.get("from")))
    content = turn.get(content_key, turn.get("content", turn.get("value")))
    if not isinstance(source_role, str) or source_role not in ROLE_NAMES:
        raise BadRecord(f"turn {i} has role {source_role!r}; accepted: {', '.join(ROLE_NAMES)}")
    role = ROLE_NAMES[source_role]
    if source_role == "function_call":
        return {"role": role, "content": "", "tool_calls": _calls(content, f"turn {i} (function_call)")}
    if role == "assistant" and turn.get("tool_calls"):
        out = {"role": role, "content": "" if content is None else text(content, f"turn {i} content")}
        out["tool_calls"] = _calls(turn["tool_calls"], f"turn {i} tool_calls")
        return out
    out = {"role": role, "content": text(content, f"turn {i} content")}
    if role == "tool":
        out.update({k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)})
    return out


def turns(raw: list, role_key: str, content_key: str, tools: object = None) -> list[dict]:
    """A record's turn list (and its "tools" field) -> a conversation, before the checks every
    format shares (sft_formats.to_conversation)."""
    conversation, called = [], False
    for i, turn in enumerate(raw, 1):
        if not isinstance(turn, dict):
            raise BadRecord(f"turn {i} is {type(turn).__name__}, expected an object")
        conversation.append(_turn(turn, i, role_key, content_key))
        called = called or bool(conversation[-1].get("tool_calls"))
        # A result with no call before it would teach the model that results come unasked.
        if conversation[-1]["role"] == "tool" and not called:
            raise BadRecord(f"turn {i} is a tool result (observation) before any call")
    listed = parse_tools(tools)
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
