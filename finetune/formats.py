"""Rows -> conversations, with no heavy imports: the launcher checks local data files with it
before any rank starts, so a missing file or a malformed row is one line naming file and line.

SFT rows come in two forms: alpaca (`instruction`, optional `input`, `output`) and chat
(`messages`: a list of `{role, content}` ending with the assistant's response).

Preference rows (method=dpo) hold a prompt and two responses, in either form:
- `{prompt, chosen, rejected}` with text values (the prompt becomes a user message), or `prompt`
  a message list and `chosen`/`rejected` one assistant message each (as lists or dicts);
- `{chosen, rejected}` as whole conversations that share every message but the last (the
  assistant's response): the shared messages are the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config import ConfigError, DataConfig, DataFormat, Method

ROLES = ("system", "user", "assistant")


@dataclass
class Rows:
    """Raw rows plus where each came from, for error messages that name a file and line."""

    rows: list[dict[str, Any]]
    source: str
    lines: list[int] | None = None  # 1-based line of each row in a JSONL file

    def where(self, i: int) -> str:
        return f"{self.source}:{self.lines[i]}" if self.lines else f"{self.source} row {i}"

    def subset(self, idx: list[int]) -> Rows:
        return Rows([self.rows[i] for i in idx], self.source, [self.lines[i] for i in idx] if self.lines else None)


def load_rows(source: str, split: str, key: str) -> Rows:
    """Read a local .jsonl/.json file, a local dataset directory, or a hub dataset id.

    Args:
        source: the path or hub id.
        split: split name for directories and hub datasets.
        key: the config key that named `source` (for messages), e.g. "data.train".
    """
    path = Path(source).expanduser()
    if path.suffix in (".jsonl", ".json") and path.is_file():
        return _read_jsonl(path) if path.suffix == ".jsonl" else _read_json(path)
    if looks_local(source) and not path.exists():
        raise ConfigError(f"{key}: no such file or directory: {source}")
    import datasets

    try:  # a local dataset directory (data files or save_to_disk output) or a hub id
        if path.is_dir() and (path / "dataset_info.json").is_file():
            ds = datasets.load_from_disk(str(path))
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(str(path) if path.is_dir() else source, split=split)
    except Exception as e:  # noqa: BLE001 - whatever `datasets` raises, the user needs one line
        what = "the local dataset directory" if path.is_dir() else "the hub dataset"
        raise ConfigError(f"{key}: could not load {what} {source!r} (split {split!r}): {str(e).splitlines()[0]}") from None
    return Rows(rows=list(ds), source=source)


def _read_jsonl(path: Path) -> Rows:
    rows, lines = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{n}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
            lines.append(n)
    return Rows(rows=rows, source=str(path), lines=lines)


def _read_json(path: Path) -> Rows:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"{path}: a .json data file must hold a list of objects (use .jsonl for one object per line)")
    return Rows(rows=rows, source=str(path))


# ---------------------------------------------------------------------------------------------
# Rows -> messages


def is_preference(row: dict[str, Any]) -> bool:
    return "chosen" in row and "rejected" in row


def to_messages(row: dict[str, Any], fmt: DataFormat, system_prompt: str | None, where: str) -> list[dict[str, str]]:
    """One SFT row -> a conversation ending with the assistant's response."""
    if fmt == DataFormat.preference or (fmt == DataFormat.auto and is_preference(row)):
        raise ConfigError(f"{where}: this row is a preference pair (chosen/rejected), which trains with method=dpo: "
                          "add method=dpo, or use alpaca/chat rows for method=sft")
    if fmt == DataFormat.auto:
        fmt = DataFormat.chat if "messages" in row else DataFormat.alpaca
    if fmt == DataFormat.alpaca:
        missing = [k for k in ("instruction", "output") if not isinstance(row.get(k), str)]
        if missing:
            raise ConfigError(
                f"{where}: alpaca rows need string 'instruction' and 'output' (missing or not text: "
                f"{', '.join(missing)}; keys present: {', '.join(sorted(row)) or 'none'})"
            )
        user = row["instruction"] + (f"\n{row['input']}" if row.get("input") else "")
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
    else:
        messages = _messages(row.get("messages"), where, "messages")
        if not messages:
            raise ConfigError(f"{where}: chat rows need a non-empty 'messages' list (keys present: {', '.join(sorted(row))})")
        _ends_with_response(messages, where, "messages")
    return _with_system(messages, system_prompt)


def to_pair(row: dict[str, Any], system_prompt: str | None, where: str) -> tuple[list[dict[str, str]], str, str]:
    """One preference row -> (prompt messages, chosen response text, rejected response text)."""
    if not is_preference(row):
        raise ConfigError(f"{where}: method=dpo needs preference rows with 'chosen' and 'rejected' (and 'prompt' unless they are "
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
        return _with_system(prompt, system_prompt), chosen, rejected
    chosen, rejected = (_messages(row[k], where, k) for k in ("chosen", "rejected"))
    for key, conv in (("chosen", chosen), ("rejected", rejected)):
        if len(conv) < 2:
            raise ConfigError(f"{where}: without a 'prompt', '{key}' must be a whole conversation (prompt messages, then the response)")
        _ends_with_response(conv, where, key)
    if chosen[:-1] != rejected[:-1]:
        raise ConfigError(f"{where}: 'chosen' and 'rejected' must share every message but the last (the prompt); they differ before it")
    return _with_system(chosen[:-1], system_prompt), chosen[-1]["content"], rejected[-1]["content"]


def _response(value: Any, where: str, key: str) -> str:
    """A response given as text, one assistant message, or a one-message list."""
    if isinstance(value, str):
        return value
    messages = _messages([value] if isinstance(value, dict) else value, where, key)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise ConfigError(f"{where}: '{key}' must be the response: text or one assistant message, got {len(messages)} message(s)")
    return messages[0]["content"]


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: '{key}' must be a list of {{role, content}} messages, got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: {key}[{i}] must be {{role: system|user|assistant, content: text}}, got {m!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _ends_with_response(messages: list[dict[str, str]], where: str, key: str) -> None:
    if messages[-1]["role"] != "assistant":
        of = "" if key == "messages" else f" of '{key}'"
        raise ConfigError(f"{where}: the last message{of} must be the assistant's response, got role {messages[-1]['role']!r}")


def _with_system(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    if system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def looks_local(source: str) -> bool:
    """A path rather than a hub id: a data-file suffix or an explicit directory prefix."""
    return Path(source).suffix in (".jsonl", ".json") or source.startswith((".", "/", "~"))


def check(cfg: DataConfig, method: Method) -> None:
    """Read every local data file and convert every row; raises ConfigError at the first bad one.

    Directories and hub datasets are checked by the ranks (that needs `datasets`)."""
    for key, source in (("data.train", cfg.train), ("data.eval", cfg.eval)):
        if source is None or not looks_local(source) or Path(source).expanduser().is_dir():
            continue
        rows = load_rows(source, "train", key)
        for i, row in enumerate(rows.rows):
            if method == Method.dpo:
                to_pair(row, cfg.system_prompt, rows.where(i))
            else:
                to_messages(row, cfg.format, cfg.system_prompt, rows.where(i))
