"""Row forms -> conversations (SFT), preference pairs (DPO) or text, with no heavy imports: the launcher
converts every row of the local data files with it before any rank starts (finetune.data.examples.check),
so a malformed row is one line naming file and line.

SFT rows come in the forms people's datasets have, told apart by their keys (data.format=auto) or named:
alpaca (`instruction`, optional `input`, `output`); chat (`messages`: a list of `{role, content}`
ending with the assistant's response, OpenAI-style, other keys such as `name` ignored); sharegpt
(`conversations`: `{from, value}` with from human/gpt/system); chat and sharegpt rows may offer `tools` and hold
tool calls and their results (OpenAI's and LLaMA-Factory's shapes: finetune.data.tools); completion (`prompt` + `completion`,
or `question` + `answer`); text (`text`: continued pre-training, no template, every token trained on).

Preference rows (method=dpo) hold a prompt and two responses, in either form:
- `{prompt, chosen, rejected}` with text values (the prompt becomes a user message), or `prompt`
  a message list and `chosen`/`rejected` one assistant message each (as lists or dicts);
- `{chosen, rejected}` as whole conversations that share every message but the last (the
  assistant's response): the shared messages are the prompt.
"""

from __future__ import annotations

from typing import Any

from finetune.config import ConfigError, DataConfig, DataFormat
from finetune.data import images as pictures
from finetune.data import tools as tool_turns
from finetune.data.tools import FIX, TOOL_TURNS, Message, check_calls, tools_of

ROLES = ("system", "user", "assistant", "tool")


def is_preference(row: dict[str, Any]) -> bool:
    return "chosen" in row and "rejected" in row


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "model": "assistant", "system": "system"}
ROW_KEYS = ("messages", "conversations", "instruction", "input", "output", "prompt", "completion", "question", "answer", "text",
            "chosen", "rejected", "label")  # every key a row form reads: what a source's column map may rename a column to
KNOWN_FORMS = ("alpaca (instruction, output), chat (messages), sharegpt (conversations), completion (prompt and completion, "
               "or question and answer), text (text)")


def form_of(row: dict[str, Any], fmt: DataFormat, where: str) -> DataFormat:
    """The row's form: `fmt` when named, else told by its keys (one line naming the keys when none fits)."""
    if fmt != DataFormat.auto:
        return fmt
    if is_preference(row):
        return DataFormat.preference
    for form, keys in ((DataFormat.chat, ("messages",)), (DataFormat.sharegpt, ("conversations",)),
                       (DataFormat.alpaca, ("instruction",)), (DataFormat.alpaca, ("output",)),
                       (DataFormat.completion, ("prompt", "completion")), (DataFormat.completion, ("question", "answer")),
                       (DataFormat.text, ("text",))):
        if all(k in row for k in keys):
            return form
    raise ConfigError(f"{where}: a row of no known form (keys present: {', '.join(sorted(row)) or 'none'}); the forms are "
                      f"{KNOWN_FORMS}: rename its keys, or fix the row")


def text_of(row: dict[str, Any], where: str) -> str:
    """A text row's text (data.format=text, or auto with a `text` key)."""
    text = row.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where}: text rows need a non-empty string 'text' (keys present: {', '.join(sorted(row)) or 'none'})")
    return text


def to_messages(row: dict[str, Any], fmt: DataFormat, system_prompt: str | None, where: str) -> list[Message]:
    """One SFT row -> a conversation ending with the assistant's response.

    Refused (one line naming `where`): a row of no known form, a response with no text, a
    conversation with no user message before its response or not ending with the assistant."""
    fmt = form_of(row, fmt, where)
    if fmt == DataFormat.preference:
        raise ConfigError(f"{where}: this row is a preference pair (chosen/rejected), which trains with method=dpo: "
                          "add method=dpo, or use alpaca/chat rows for method=sft")
    if fmt == DataFormat.text:
        raise ConfigError(f"{where}: a text row has no prompt or response (it is tokenized whole): data.tokenize reads it")
    if isinstance(row.get("label"), bool):
        raise ConfigError(f"{where}: this row's response is labelled (label: {str(row['label']).lower()}), which trains with "
                          "method=kto (a false one would be learned as a right answer): add method=kto, or remove the labels")
    if fmt == DataFormat.sharegpt:
        return to_messages({"messages": sharegpt_messages(row, where)}, DataFormat.chat, system_prompt, where)
    if fmt == DataFormat.completion:
        prompt, response = ("prompt", "completion") if "prompt" in row or "question" not in row else ("question", "answer")
        missing = [k for k in (prompt, response) if not isinstance(row.get(k), str)]
        if missing:
            raise ConfigError(f"{where}: completion rows need string '{prompt}' and '{response}' (missing or not text: "
                              f"{', '.join(missing)}; keys present: {', '.join(sorted(row)) or 'none'})")
        if not row[prompt].strip():
            raise ConfigError(f"{where}: the prompt '{prompt}' is empty: {FIX}")
        messages = [{"role": "user", "content": row[prompt]}, {"role": "assistant", "content": _text(row[response], where, f"'{response}'")}]
        return _with_system(messages, system_prompt)
    if fmt == DataFormat.alpaca:
        missing = [k for k in ("instruction", "output") if not isinstance(row.get(k), str)]
        if missing:
            raise ConfigError(
                f"{where}: alpaca rows need string 'instruction' and 'output' (missing or not text: "
                f"{', '.join(missing)}; keys present: {', '.join(sorted(row)) or 'none'})"
            )
        user = row["instruction"] + (f"\n{row['input']}" if row.get("input") else "")
        if not user.strip():
            raise ConfigError(f"{where}: the prompt is empty ('instruction' and 'input' hold no text): {FIX}")
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": _text(row["output"], where, "'output'")}]
    else:
        messages = _messages(row.get("messages"), where, "messages")
        if not messages:
            raise ConfigError(f"{where}: chat rows need a non-empty 'messages' list (keys present: {', '.join(sorted(row))})")
        _ends_with_response(messages, where, "messages")
        for i, m in enumerate(messages):  # every assistant turn is trained on: its text, or its tool calls
            if m["role"] == "assistant" and not m.get("tool_calls"):
                _text(m["content"], where, f"the assistant's messages[{i}]")
        _has_prompt(messages[:-1], where)
        check_calls(messages, tools_of(row, where), where)
    return _with_system(messages, system_prompt)


def to_pair(row: dict[str, Any], system_prompt: str | None, where: str, method: str = "dpo") -> tuple[list[Message], str, str]:
    """One preference row -> (prompt messages, chosen response text, rejected response text).

    Refused as for SFT rows, and a pair whose two responses are the same text (it prefers nothing); `method`:
    the method that reads pairs, as the refusal names it."""
    if not is_preference(row):
        raise ConfigError(f"{where}: method={method} needs preference rows with 'chosen' and 'rejected' (and 'prompt' unless they are "
                          f"whole conversations); keys present: {', '.join(sorted(row)) or 'none'}")
    if "prompt" in row:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        else:
            prompt = _messages(prompt, where, "prompt")
            if not prompt or prompt[-1]["role"] == "assistant":
                raise ConfigError(f"{where}: 'prompt' must be text or a non-empty message list that ends before the response")
        chosen, rejected = (_response(row[k], where, k) for k in ("chosen", "rejected"))
    else:
        whole = [_messages(row[k], where, k) for k in ("chosen", "rejected")]
        for key, conv in zip(("chosen", "rejected"), whole):
            if len(conv) < 2:
                raise ConfigError(f"{where}: without a 'prompt', '{key}' must be a whole conversation (prompt messages, then the response)")
            _ends_with_response(conv, where, key)
        if whole[0][:-1] != whole[1][:-1]:
            raise ConfigError(f"{where}: 'chosen' and 'rejected' must share every message but the last (the prompt); they differ before it")
        for key, conv in zip(("chosen", "rejected"), whole):
            _no_call(conv[-1], where, key)
        prompt, chosen, rejected = whole[0][:-1], whole[0][-1]["content"], whole[1][-1]["content"]
    _has_prompt(prompt, where)
    check_calls(prompt, tools_of(row, where), where)
    chosen, rejected = _text(chosen, where, "'chosen'"), _text(rejected, where, "'rejected'")
    if chosen.strip() == rejected.strip():
        raise ConfigError(f"{where}: 'chosen' and 'rejected' are the same response, so the pair prefers nothing: {FIX}")
    return _with_system(prompt, system_prompt), chosen, rejected


def to_labelled(row: dict[str, Any], data: DataConfig, where: str, method: str) -> list[tuple[list[Message], bool]]:
    """An unpaired row -> [(conversation ending with the response, whether the response is desirable)]: any SFT form
    with a boolean `label` (TRL's unpaired preference rows: `prompt` and `completion` as text or as messages); a
    preference pair counts as one desirable and one undesirable row (chosen, rejected). `method`: the method that
    reads them, as the refusal names it."""
    if form_of(row, data.format, where) == DataFormat.preference:
        prompt, chosen, rejected = to_pair(row, data.system_prompt, where, method)
        return [([*prompt, {"role": "assistant", "content": text}], good) for text, good in ((chosen, True), (rejected, False))]
    label = row.get("label")
    if not isinstance(label, bool):
        raise ConfigError(f"{where}: method={method} needs each row labelled: 'label' true (a desirable response) or false (an "
                          f"undesirable one), got {label!r}; or give preference pairs (chosen, rejected)")
    if isinstance(row.get("prompt"), list):  # conversational: the prompt as messages, the completion text or one message
        prompt = _messages(row["prompt"], where, "prompt")
        _has_prompt(prompt, where)
        response = _text(_response(row.get("completion"), where, "completion"), where, "'completion'")
        return [(_with_system([*prompt, {"role": "assistant", "content": response}], data.system_prompt), label)]
    return [(to_messages({k: v for k, v in row.items() if k != "label"}, data.format, data.system_prompt, where), label)]


def _text(text: str, where: str, what: str) -> str:
    """A response to train on: refused when it holds nothing but whitespace."""
    if not text.strip():
        raise ConfigError(f"{where}: the response {what} is empty{' (only whitespace)' if text else ''}: {FIX}")
    return text


def _has_prompt(messages: list[Message], where: str) -> None:
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise ConfigError(f"{where}: no user message with text before the response (a response to nothing): {FIX}")


def _response(value: Any, where: str, key: str) -> str:
    """A response given as text, one assistant message, or a one-message list."""
    if isinstance(value, str):
        return value
    messages = _messages([value] if isinstance(value, dict) else value, where, key)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise ConfigError(f"{where}: '{key}' must be the response: text or one assistant message, got {len(messages)} message(s)")
    _no_call(messages[0], where, key)
    return messages[0]["content"]


def _no_call(message: Message, where: str, key: str) -> None:
    if message.get("tool_calls"):
        raise ConfigError(f"{where}: '{key}' is a tool call: a preference response must be text (tool calls and results may be in "
                          "the prompt): make the responses the answers, or train the calls with method=sft")


def _messages(value: Any, where: str, key: str) -> list[Message]:
    """Messages as templates read them: {role, content}, an assistant's `tool_calls`, a tool result's id and name."""
    if not isinstance(value, list):
        raise ConfigError(f"{where}: '{key}' must be a list of {{role, content}} messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        role = m.get("role") if isinstance(m, dict) else None
        if isinstance(m, dict) and isinstance(m.get("content"), list):  # content parts: images as <image> in the text
            m = {**m, "content": pictures.part_text(m["content"], where, f"{key}[{i}]", [])}
        if role == "tool":
            out.append(tool_turns.tool_message(m, where, f"{key}[{i}]"))
        elif role == "assistant" and m.get("tool_calls") and (m.get("content") is None or isinstance(m["content"], str)):
            out.append({"role": role, "content": m.get("content") or "", "tool_calls": tool_turns.calls(m["tool_calls"], where, f"{key}[{i}]")})
        elif role not in ROLES or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: {key}[{i}] must be {{role: system|user|assistant|tool, content: text}} (an assistant's "
                              f"content may be null beside tool_calls), got {m!r}")
        else:
            out.append({"role": role, "content": m["content"]})
    return out


def sharegpt_messages(row: dict[str, Any], where: str) -> list[Message]:
    """ShareGPT's `conversations` ({from, value}) as {role, content} messages; function_call and observation turns as
    tool calls and their results (finetune.data.tools)."""
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{where}: sharegpt rows need a non-empty 'conversations' list of {{from, value}} turns")
    out: list[Message] = []
    pending: list[tuple[str, str]] = []
    answered = [0]
    for i, t in enumerate(turns):
        source = t.get("from") if isinstance(t, dict) else None
        role = SHAREGPT_ROLES.get(source) if source not in TOOL_TURNS else source
        if role is None or not isinstance(t.get("value"), str):
            raise ConfigError(f"{where}: conversations[{i}] must be {{from: {'|'.join([*SHAREGPT_ROLES, *TOOL_TURNS])}, value: text}}, "
                              f"got {t!r}")
        if role == "function_call":
            out.append(tool_turns.sharegpt_call(t["value"], where, f"conversations[{i}]", pending))
        elif role == "observation":
            out.append(tool_turns.sharegpt_observation(t["value"], where, f"conversations[{i}]", pending, answered))
        else:
            out.append({"role": role, "content": t["value"]})
    return out


def images_of(row: dict[str, Any], messages: list[Message], where: str) -> list[Any]:
    """The row's images in the order their places (finetune.data.images.PLACEHOLDER) come in `messages` (the row read by
    `to_messages`): its top-level `images` list, or its messages' image parts. Refused in one line naming the row: both
    forms at once, a count of images that differs from their places, an image in an assistant's message (images are
    what the model reads, not what it writes)."""
    listed = pictures.row_images(row)
    parts: list[Any] = []
    # where the prompt's messages are: a conversation, a pair's prompt, or (a pair of whole conversations) the chosen one,
    # whose prompt the rejected one repeats
    key = next((k for k in ("messages", "prompt", "chosen") if isinstance(row.get(k), list)), None)
    for i, m in enumerate(row[key] if key else []):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            pictures.part_text(m["content"], where, f"{key}[{i}]", parts)
    if listed and parts:
        raise ConfigError(f"{where}: the row gives images both as an 'images' list and as image parts in its messages: use one")
    found = listed or parts
    if not found and "images" not in row:
        return []
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and pictures.PLACEHOLDER in m["content"]:
            raise ConfigError(f"{where}: the assistant's message {i} holds an image ({pictures.PLACEHOLDER}): images go in "
                              "the user's messages (the model reads them; it writes text)")
    pictures.check_count([m["content"] for m in messages], found, where)
    return found


def _ends_with_response(messages: list[Message], where: str, key: str) -> None:
    if messages[-1]["role"] != "assistant":
        of = "" if key == "messages" else f" of '{key}'"
        raise ConfigError(f"{where}: the last message{of} must be the assistant's response, got role {messages[-1]['role']!r}")


def _with_system(messages: list[Message], system_prompt: str | None) -> list[Message]:
    if system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages
