"""Tool calls in rows: the function schemas a row offers (`tools`), assistant messages that call them (`tool_calls`)
and the results that come back (`role: tool`), read in the two shapes datasets come in and written in the one shape
chat templates read (transformers' apply_chat_template(messages, tools=...)). No heavy imports: the launcher reads
every local row with it (finetune.data.forms).

OpenAI's shape (chat rows, `messages`): an assistant message with `tool_calls=[{type: function, id, function: {name,
arguments}}]` (arguments a JSON object or its text) and `content` empty or null; a `{role: tool, content, tool_call_id,
name}` message per result; `tools=[{type: function, function: {name, description, parameters}}]`.

LLaMA-Factory's ShareGPT shape (sharegpt rows, `conversations`): a `{from: function_call, value: '{"name": ..,
"arguments": {..}}'}` turn (or a JSON list of such calls), then `{from: observation, value: RESULT}`; `tools` the text
of a JSON list of function schemas. Each call gets an id, call00001 on (templates such as Mistral's need one: 9
characters), and each observation answers the oldest call not yet answered.

Written shape: tools as `[{type: function, function: {name, ...}}]`; a call as `{type: function, id?, function: {name,
arguments: dict}}`; a tool message as `{role: tool, content: text, tool_call_id?, name?}`.
"""

from __future__ import annotations

import json
from typing import Any

from finetune.config import ConfigError

Message = dict[str, Any]
TOOL_TURNS = ("function_call", "observation")  # ShareGPT's `from` values of a call and of its result


def tools_of(row: dict[str, Any], where: str) -> list[dict[str, Any]] | None:
    """The row's function schemas in the written shape, or None when it offers none."""
    tools = row.get("tools")
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        tools = _json(tools, where, "'tools'")
    if not isinstance(tools, list):
        raise ConfigError(f"{where}: 'tools' must be a list of function schemas (or its JSON text), got {type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        schema = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str) or not schema["name"]:
            raise ConfigError(f"{where}: tools[{i}] must be a function schema {{name, description, parameters}} (or "
                              f"{{type: function, function: {{...}}}}), got {t!r}")
        out.append({"type": "function", "function": schema})
    return out


def uses_tools(row: dict[str, Any]) -> bool:
    """Whether the row offers tools or holds a tool call or result (in any of its message lists)."""
    if row.get("tools"):
        return True
    lists = [v for v in row.values() if isinstance(v, list)] + [[v] for v in row.values() if isinstance(v, dict)]
    return any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool" or m.get("from") in TOOL_TURNS)
               for messages in lists for m in messages)


def tool_message(m: dict[str, Any], where: str, at: str) -> Message:
    """A `role: tool` message (a function's result) in the written shape."""
    content = m.get("content")
    if isinstance(content, (dict, list)):
        content = json.dumps(content)
    if not isinstance(content, str):
        raise ConfigError(f"{where}: {at} is a tool result: its 'content' must be text (or JSON), got {m!r}")
    out: Message = {"role": "tool", "content": content}
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def calls(value: Any, where: str, at: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` in the written shape (OpenAI's nested form, or flat {name, arguments})."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: {at}.tool_calls must be a non-empty list of {{type: function, function: {{name, arguments}}}}")
    out = []
    for i, call in enumerate(value):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ConfigError(f"{where}: {at}.tool_calls[{i}] must be {{type: function, function: {{name, arguments}}}}, got {call!r}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = _json(args, where, f"{at}.tool_calls[{i}]'s arguments")
        if not isinstance(args, dict):
            raise ConfigError(f"{where}: {at}.tool_calls[{i}]'s arguments must be a JSON object, got {args!r}")
        written: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            written["id"] = call["id"]
        out.append(written)
    return out


def sharegpt_call(value: str, where: str, at: str, pending: list[tuple[str, str]]) -> Message:
    """A ShareGPT `function_call` turn as an assistant message calling the function(s); their (id, name) are queued
    on `pending` for the observations that answer them."""
    parsed = _json(value, where, f"{at} (a function_call)")
    out = calls(parsed if isinstance(parsed, list) else [parsed], where, at)
    for call in out:
        call["id"] = f"call{len(pending) + 1:05d}"
        pending.append((call["id"], call["function"]["name"]))
    return {"role": "assistant", "content": "", "tool_calls": out}


def sharegpt_observation(value: str, where: str, at: str, pending: list[tuple[str, str]], answered: list[int]) -> Message:
    """A ShareGPT `observation` turn: the result of the oldest call not yet answered."""
    if answered[0] >= len(pending):
        raise ConfigError(f"{where}: {at} is an observation with no function_call before it to answer: {FIX}")
    call_id, name = pending[answered[0]]
    answered[0] += 1
    return {"role": "tool", "content": value, "tool_call_id": call_id, "name": name}


def check_calls(messages: list[Message], tools: list[dict[str, Any]] | None, where: str) -> None:
    """Every call names a function the row offers (when it offers any), and every tool result follows a call."""
    names = {t["function"]["name"] for t in tools or []}
    called = False
    for i, m in enumerate(messages):
        for call in m.get("tool_calls", []):
            called = True
            if tools and call["function"]["name"] not in names:
                raise ConfigError(f"{where}: messages[{i}] calls {call['function']['name']!r}, which is not among the row's tools "
                                  f"({', '.join(sorted(names))}): {FIX}")
        if m["role"] == "tool" and not called:
            raise ConfigError(f"{where}: messages[{i}] is a tool result with no tool call before it: {FIX}")


FIX = "fix the row or remove it"


def _json(text: str, where: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: {what} is not valid JSON ({e.msg} at character {e.pos}): {FIX}") from None
