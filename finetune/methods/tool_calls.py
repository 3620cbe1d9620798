"""Rollouts with tools (method.tools): while an online method samples, a completion that calls a function gets the
function's result back as a tool turn and sampling goes on, up to method.max_turns calls.

What a template writes is read from the template itself, by rendering a probe conversation
(finetune.data.templates.PROBE), so any family's template is read the same way and none is named here:
- where an assistant turn ends: the text the template writes after an answer's content. Where that is the EOS token,
  generation stops there as it always does; otherwise (Qwen's `<|im_end|>`) at that text (generate's stop strings), and
  what the template writes after it (a newline) is added as a token of the context, not of the policy;
- how a call is written: every template shipped or met so far writes a call as JSON naming the function and its
  arguments (Qwen's `<tool_call>{"name", "arguments"}</tool_call>`, Llama 3.1's `{"name", "parameters"}`, Mistral's
  `[TOOL_CALLS] [{"name", "arguments"}]`); `parse` reads every such JSON value in a completion. A template whose
  probe call does not read back this way is refused, naming what it wrote;
- the tool turn: the template's rendering of the results after the call, and its generation prompt for the next
  assistant turn (the difference of two renderings of the probe with the actual calls and results).

A call runs the user's function (`package.module:function`, found by the name the model called) on its arguments in a
thread, with method.tool_timeout seconds; whatever it raises, a timeout, an unknown function or arguments that do not
fit come back as the tool's answer (`error: ...`), as a model meets them in use. Only the tokens the policy sampled
carry the loss; the tool turns are context. The rewards see the final answer as `completions` and the whole
exchange as `trajectories` (each a list of messages: assistant calls, tool results, the answer).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor, TimeoutError as Timeout
from dataclasses import dataclass
from typing import Any, Callable

from finetune.config import ConfigError

_FORMATS: dict[str, TurnFormat] = {}


@dataclass(frozen=True)
class TurnFormat:
    """Where an assistant turn ends, as the template writes it."""

    stop: str | None
    """The text that ends it (None: the EOS token does)."""
    after: str
    """What the template writes after that (context, not the policy's)."""
    opener: str = ""
    """What it writes before a call's JSON (Qwen's `<tool_call>`): not part of the message's own content."""


def turn_format(tokenizer: Any) -> TurnFormat:
    """The tokenizer's template's end of an assistant turn, probed once per template; a template that does not write tool
    calls as JSON with a name and arguments is refused."""
    from finetune.data.templates import PROBE, PROBE_TOOLS

    template = str(tokenizer.chat_template)
    if template not in _FORMATS:
        answered = tokenizer.apply_chat_template(PROBE[:1] + [{"role": "assistant", "content": "probe_answer"}], tokenize=False)
        closing = answered[answered.index("probe_answer") + len("probe_answer"):]
        eos = tokenizer.eos_token
        if eos and eos in closing:
            fmt = TurnFormat(None, closing[closing.index(eos) + len(eos):])
        else:
            stop = closing.rstrip()
            fmt = TurnFormat(stop or None, closing[len(stop):])
        from finetune.data.templates import _after

        called = tokenizer.apply_chat_template(PROBE[:2], tools=PROBE_TOOLS, tokenize=False)
        prompt = tokenizer.apply_chat_template(PROBE[:1], tools=PROBE_TOOLS, tokenize=False, add_generation_prompt=True)
        content, calls = parse(called[_after(prompt, called):])
        fmt = TurnFormat(fmt.stop, fmt.after, content)
        if [(c["name"], c["arguments"]) for c in calls] != [("probe_lookup", {"probe_key": "probe_value"})]:
            raise ConfigError(f"method.tools: the chat template writes a tool call as {called[called.index('probe_question') + 14:]!r}, "
                              "which is not JSON naming the function and its arguments, the form tool calls are read in: use a "
                              "template that writes calls so (data.chat_template=qwen2_5, llama3_1 or mistral)")
        _FORMATS[template] = fmt
    return _FORMATS[template]


def parse(text: str, opener: str = "") -> tuple[str, list[dict[str, Any]]]:
    """(the text before the first call, without the template's `opener`; every call in `text` as {name, arguments}): each
    JSON value in it that names a function and its arguments ({"name", "arguments" or "parameters"}, OpenAI's
    {"function": {...}}, or a list of them)."""
    decoder, calls, first, i = json.JSONDecoder(), [], None, 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
            except ValueError:
                i += 1
                continue
            found = _calls(value)
            if found:
                calls += found
                first = i if first is None else first
                i = end
                continue
        i += 1
    if first is None:
        return text, calls
    content, mark = text[:first].rstrip(), opener.strip()
    return (content[: -len(mark)] if mark and content.endswith(mark) else text[:first]), calls


def _calls(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, list):
        each = [_calls(v) for v in value]
        return [c for found in each for c in found] if value and all(each) else []
    if not isinstance(value, dict):
        return []
    if isinstance(value.get("function"), dict):
        return _calls(value["function"])
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return []
    if isinstance(value.get("name"), str) and isinstance(arguments, dict):
        return [{"name": value["name"], "arguments": arguments}]
    return []


def run(call: dict[str, Any], functions: dict[str, Callable[..., Any]], timeout: float) -> str:
    """The function's answer to `call` as text (JSON for what is not a string); `error: ...` for whatever went wrong."""
    fn = functions.get(call["name"])
    if fn is None:
        return f"error: no function named {call['name']!r} (there are: {', '.join(sorted(functions))})"
    pool = ThreadPoolExecutor(1, thread_name_prefix="tool")
    try:
        result = pool.submit(fn, **call["arguments"]).result(timeout=timeout)
    except Timeout:
        return f"error: {call['name']} did not answer within {timeout:g} s"
    except Exception as e:  # noqa: BLE001 - the user's function: what it raises is its answer
        return f"error: {type(e).__name__}: {e}"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a function past its time limit is left to finish on its own
    return result if isinstance(result, str) else json.dumps(result, default=str)


def tool_turn(tokenizer: Any, calls: list[dict[str, Any]], results: list[str], turn: int) -> str:
    """The template's text after an assistant turn that made `calls`: the tool turn of their `results`, then the prompt
    of the next assistant turn."""
    ids = [f"call{turn:02d}{i:03d}" for i in range(len(calls))]  # 9 characters: Mistral's template needs them so
    tools = [{"type": "function", "function": {"name": c["name"], "description": "", "parameters": {"type": "object", "properties": {}}}}
             for c in calls]
    asked = [{"role": "user", "content": "probe_question"},
             {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": i, "function": c} for i, c in zip(ids, calls)]}]
    answered = asked + [{"role": "tool", "content": r, "tool_call_id": i, "name": c["name"]} for i, c, r in zip(ids, calls, results)]
    before = tokenizer.apply_chat_template(asked, tools=tools, tokenize=False)
    after = tokenizer.apply_chat_template(answered, tools=tools, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ConfigError("method.tools: the chat template renders a call differently once its result follows, so the tool turn "
                          "cannot be appended to what was sampled: use another template (data.chat_template)")
    return after[len(before):]


def resolve(names: list[str]) -> dict[str, Callable[..., Any]]:
    """method.tools as functions by the names the model calls them (each function's own name)."""
    from finetune.methods.rewards import imported

    functions: dict[str, Callable[..., Any]] = {}
    for name in names:
        fn = imported(name, f"method.tools: {name}")
        if fn.__name__ in functions:
            raise ConfigError(f"method.tools: two functions are named {fn.__name__!r}: the model calls a tool by its name; rename one")
        functions[fn.__name__] = fn
    return functions
