"""Rows -> conversations, with no heavy imports: the launcher checks local data files with it
before any rank starts, so a missing file or a malformed row is one line naming file and line.

SFT rows come in the forms people's datasets have, told apart by their keys (data.format=auto) or named:
alpaca (`instruction`, optional `input`, `output`); chat (`messages`: a list of `{role, content}`
ending with the assistant's response, OpenAI-style, other keys such as `name` ignored); sharegpt
(`conversations`: `{from, value}` with from human/gpt/system); completion (`prompt` + `completion`,
or `question` + `answer`); text (`text`: continued pre-training, no template, every token trained on).

Preference rows (method=dpo) hold a prompt and two responses, in either form:
- `{prompt, chosen, rejected}` with text values (the prompt becomes a user message), or `prompt`
  a message list and `chosen`/`rejected` one assistant message each (as lists or dicts);
- `{chosen, rejected}` as whole conversations that share every message but the last (the
  assistant's response): the shared messages are the prompt.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from finetune.config import ConfigError, DataConfig, DataFormat, Method

ROLES = ("system", "user", "assistant")


@dataclass
class Rows:
    """Raw rows plus where each came from, for error messages that name a file and line."""

    rows: list[dict[str, Any]]
    source: str
    lines: list[int] | None = None  # 1-based line of each row in a JSONL file
    first: int = 0  # the index of rows[0] in its source, for a slice of it
    wheres: list[str] | None = None  # each row's origin, for rows mixed from several sources
    note: str = ""  # how a mixture was drawn, for the log

    def where(self, i: int) -> str:
        if self.wheres:
            return self.wheres[i]
        return f"{self.source}:{self.lines[i]}" if self.lines else f"{self.source} row {self.first + i}"

    def subset(self, idx: list[int]) -> Rows:
        pick = lambda values: [values[i] for i in idx] if values else None  # noqa: E731
        return Rows([self.rows[i] for i in idx], self.source, pick(self.lines), 0, pick(self.wheres) or
                    (None if self.lines else [self.where(i) for i in idx]), self.note)


# ---------------------------------------------------------------------------------------------
# Sources: one path or hub id, or a mixture


@dataclass(frozen=True)
class Source:
    path: str
    split: str
    key: str  # the config key that names it, e.g. data.train[1]
    weight: float | None = None
    rows: int | None = None


SOURCE_KEYS = ("path", "split", "weight", "rows")
SOURCE_FORM = ("a path or hub id, or a list of sources, each a path or {path, split, weight, rows}, "
               "e.g. data.train=[a.jsonl,{path:b.jsonl,weight:0.3}]")


def sources(value: Any, split: str, key: str) -> list[Source]:
    """data.train / data.eval as a list of sources; one line naming the entry for a malformed one."""
    if isinstance(value, str):
        return [Source(value, split, key)]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{key} must be {SOURCE_FORM}")
    out = []
    for i, entry in enumerate(value):
        at = f"{key}[{i}]"
        entry = {"path": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict):
            raise ConfigError(f"{at}={entry!r}: a source is a path or {{path, split, weight, rows}}")
        unknown = sorted(set(entry) - set(SOURCE_KEYS))
        if unknown:
            raise ConfigError(f"{at}: unknown key {unknown[0]!r}: a source has path, and optionally split, weight or rows")
        path, weight, rows = entry.get("path"), entry.get("weight"), entry.get("rows")
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(f"{at}.path must be a path or hub id (got {path!r})")
        if weight is not None and rows is not None:
            raise ConfigError(f"{at}: set weight (its share of the mixture) or rows (an exact count), not both")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0):
            raise ConfigError(f"{at}.weight={weight} must be a number above 0")
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ConfigError(f"{at}.rows={rows} must be an integer of at least 1")
        out.append(Source(path, str(entry.get("split", split)), at, None if weight is None else float(weight), rows))
    return out


def samples_rows(cfg: DataConfig) -> bool:
    """Whether drawing the rows depends on the seed (a source with a weight or a row count)."""
    return any(s.weight is not None or s.rows is not None
               for value, split, key in _keys(cfg) for s in sources(value, split, key))


def _keys(cfg: DataConfig) -> list[tuple[Any, str, str]]:
    return [(v, split, k) for v, split, k in ((cfg.train, cfg.train_split, "data.train"), (cfg.eval, cfg.eval_split, "data.eval"))
            if v is not None]


def mixture_counts(srcs: list[Source], sizes: list[int]) -> list[int]:
    """Rows drawn from each source: `rows` exactly (repeating rows past the source's size); all of a source
    with neither; and the sources with a `weight` in those shares of their part, as many rows as that
    allows without repeating one (the source that runs out first is used whole)."""
    weighted = [(s.weight, n) for s, n in zip(srcs, sizes) if s.weight is not None]
    total = sum(w for w, _ in weighted)
    scale = min((n / (w / total) for w, n in weighted), default=0.0)
    return [s.rows if s.rows is not None else n if s.weight is None else min(n, int(scale * s.weight / total + 1e-9))
            for s, n in zip(srcs, sizes)]


def draw(size: int, count: int, seed: int, index: int) -> list[int]:
    """`count` row indices of a source of `size`, in file order: a seeded sample, or every row
    count // size times plus a sample of the rest."""
    import numpy as np

    whole, rest = divmod(count, size)
    picked = np.random.default_rng([seed, 7919, index]).permutation(size)[:rest]
    return sorted([*range(size)] * whole + picked.tolist())


def load_sources(value: Any, split: str, key: str, seed: int) -> Rows:
    """The rows of data.train or data.eval: one source's, or a mixture's (drawn per `mixture_counts`, seeded)."""
    srcs = sources(value, split, key)
    if len(srcs) == 1 and srcs[0].weight is None and srcs[0].rows is None:
        return load_rows(srcs[0].path, srcs[0].split, srcs[0].key)
    loaded = [load_rows(s.path, s.split, s.key) for s in srcs]
    counts = mixture_counts(srcs, [len(r.rows) for r in loaded])
    rows: list[dict[str, Any]] = []
    wheres: list[str] = []
    parts = []
    for i, (s, r, n) in enumerate(zip(srcs, loaded, counts)):
        idx = draw(len(r.rows), n, seed, i)
        rows += [r.rows[j] for j in idx]
        wheres += [r.where(j) for j in idx]
        how = f", weight {s.weight:g}" if s.weight is not None else f", rows={s.rows}" if s.rows is not None else ""
        parts.append(f"{s.path} {n:,} of {len(r.rows):,}{how}")
    return Rows(rows, key, wheres=wheres, note=f"{key}: {len(rows):,} rows from {len(srcs)} sources ({'; '.join(parts)})")


def load_rows(source: str, split: str, key: str) -> Rows:
    """Read a local .jsonl/.json file, a local dataset directory, or a hub dataset id.

    Args:
        source: the path or hub id.
        split: split name for directories and hub datasets.
        key: the config key that named `source` (for messages), e.g. "data.train".

    Raises:
        ConfigError: one line naming the file and line of a bad row, or, for a source that cannot
            be loaded, every way it was tried and why each failed.
    """
    path = Path(source).expanduser()
    if path.is_file():
        rows = _read_jsonl(path) if _data_file(path, source, key) == ".jsonl" else _read_json(path)
        if not rows.rows:
            raise ConfigError(f"{key}: {source} has no rows ({'the file is empty' if not path.stat().st_size else 'only blank lines'})")
        return rows
    return Rows(rows=list(_open_dataset(source, split, key, streaming=False)), source=source)


def _data_file(path: Path, source: str, key: str) -> str:
    """A data file's suffix, .jsonl or .json (anything else refused in one line)."""
    if path.suffix not in (".jsonl", ".json"):
        raise ConfigError(f"{key}: {source} is a {path.suffix or 'suffix-less'} file: data files are .jsonl (one JSON object "
                          "per line) or .json (a list of objects); for other formats use a dataset directory")
    return path.suffix


def _open_dataset(source: str, split: str, key: str, *, streaming: bool) -> Any:
    """A local dataset directory (data files or save_to_disk output) or a hub id, through `datasets`: a Dataset, or
    with `streaming` an IterableDataset read as it is iterated (save_to_disk output is memory-mapped either way)."""
    path = Path(source).expanduser()
    if looks_local(source) and not path.exists():
        raise ConfigError(f"{key}: no such file or directory: {source}")
    if path.is_dir():
        _check_directory(path, key)
    import datasets

    try:
        if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(path))
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(str(path) if path.is_dir() else source, split=split, streaming=streaming)
    except Exception as e:  # noqa: BLE001 - whatever `datasets` raises, the user needs one line
        if path.is_dir():
            raise ConfigError(f"{key}: could not load the local dataset directory {source} (split {split!r}): "
                              f"{str(e).splitlines()[0]}") from None
        raise ConfigError(f"{key}: could not load {source!r}: as a local path: no such file or directory; as a hub dataset "
                          f"(split {split!r}): {_hub_failure(e)}") from None


DATA_FILES = (".jsonl", ".json", ".csv", ".parquet", ".arrow", ".txt")  # what `datasets` reads from a directory


def _check_directory(path: Path, key: str) -> None:
    """A directory must be save_to_disk output or hold data files (no `datasets` import needed to tell)."""
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        return
    if any(p.suffix in DATA_FILES for p in path.rglob("*") if p.is_file()):
        return
    raise ConfigError(f"{key}: could not load the local dataset directory {path}: as a saved dataset: no dataset_info.json; "
                      f"as a directory of data files: no {'/'.join(DATA_FILES)} files in it")


def _hub_failure(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "OfflineModeIsEnabled" in text or "offline" in text.lower():
        return ("offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set) and not in the local cache: "
                "download it once online, or point the key at a local file or directory")
    if type(e).__name__ in ("DatasetNotFoundError", "RepositoryNotFoundError", "FileNotFoundError"):
        return f"not found ({text}); check the id, or log in (huggingface-cli login) for a private or gated dataset"
    return text


def _read_jsonl(path: Path) -> Rows:
    rows, lines = [], []
    for n, line in _jsonl_lines(path):
        rows.append(parse_row(line, f"{path}:{n}"))
        lines.append(n)
    return Rows(rows=rows, source=str(path), lines=lines)


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line, read one at a time; a line that is not UTF-8 is refused."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            line = _decode(raw[3:] if n == 1 and raw.startswith(b"\xef\xbb\xbf") else raw, path, n)  # a UTF-8 BOM is fine
            if line.strip():
                yield n, line


def parse_row(line: str, where: str) -> dict[str, Any]:
    """One JSONL line as a row (a JSON object), or one line naming `where`."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
    return row


def _read_json(path: Path) -> Rows:
    raw = path.read_bytes()
    text = _decode(raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw, path, None)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"{path}: a .json data file must hold a list of objects (use .jsonl for one object per line)")
    return Rows(rows=rows, source=str(path))


def _decode(raw: bytes, path: Path, line: int | None) -> str:
    """UTF-8 text, or one line naming the file, the line and the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if raw.startswith((b"\xff\xfe", b"\xfe\xff")) and line in (1, None):
            line, why, was = 1, "it starts with a UTF-16 byte-order mark", "utf-16"
        else:
            before = raw[: e.start]
            line, column = line or before.count(b"\n") + 1, e.start - before.rfind(b"\n")
            why, was = f"byte 0x{raw[e.start]:02x} at column {column}", "latin1"
        raise ConfigError(f"{path}:{line}: not UTF-8 text ({why}): save the file as UTF-8, "
                          f"e.g. iconv -f {was} -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}") from None


# ---------------------------------------------------------------------------------------------
# Streams: data.train read as it is needed (data.streaming=true)


def records(source: str, split: str, key: str, start: int = 0) -> Iterator[dict[str, str]]:
    """One source's rows in its own order from its row `start` on, read as they are needed, each as
    {"row": its JSON text, "where": FILE:LINE or SOURCE row I} (rows travel as text: `datasets` would give rows of
    different forms each other's keys, as nulls). A .jsonl file is read line by line, a dataset directory or a hub
    id through `datasets` streaming (save_to_disk output memory-mapped), a .json file (one list) whole.

    Raises:
        ConfigError: a source that cannot be read, or one with no rows from `start` on (data.eval_size held them out).
    """
    path = Path(source).expanduser()
    if path.is_file() and _data_file(path, source, key) == ".jsonl":
        found = ({"row": line, "where": f"{path}:{n}"} for n, line in _jsonl_lines(path))
    elif path.is_file():
        found = ({"row": json.dumps(row), "where": f"{path} row {i}"} for i, row in enumerate(_read_json(path).rows))
    else:
        found = ({"row": json.dumps(row, default=str), "where": f"{source} row {i}"}
                 for i, row in enumerate(_open_dataset(source, split, key, streaming=True)))
    empty = True
    for record in itertools.islice(found, start, None):
        empty = False
        yield record
    if empty:
        raise ConfigError(f"data.eval_size={start} leaves no training rows in {source}" if start else f"{key}: {source} has no rows")


def stream(cfg: DataConfig, seed: int, buffer: int) -> Any:
    """One pass over data.train as a `datasets.IterableDataset` of `records`: each source read in its own order
    (after the data.eval_size rows held out), through a shuffle buffer of `buffer` rows drawn by the seed; a mixture
    draws each next row from a source with its weight's probability (seeded) and ends when a source runs out, so no
    row repeats within a pass. `set_epoch(e)` gives pass e its own order, a function of (seed, e)."""
    import datasets
    import numpy as np

    srcs = sources(cfg.train, cfg.train_split, "data.train")
    start = cfg.eval_size if cfg.eval is None else 0
    parts = [datasets.IterableDataset.from_generator(records, gen_kwargs={"source": s.path, "split": s.split, "key": s.key, "start": start})
             .shuffle(generator=np.random.default_rng([seed, 7919, i]), buffer_size=buffer) for i, s in enumerate(srcs)]
    if len(parts) == 1:
        return parts[0]
    total = sum(s.weight for s in srcs)  # every source of a streamed mixture has one (finetune.rules)
    return datasets.interleave_datasets(parts, probabilities=[s.weight / total for s in srcs], seed=seed,
                                        stopping_strategy="first_exhausted")


def first_rows(cfg: DataConfig) -> Rows:
    """The eval rows of a streamed data.train: its first data.eval_size rows, in the source's order."""
    (s,) = sources(cfg.train, cfg.train_split, "data.train")  # one source (finetune.rules)
    held = list(itertools.islice(records(s.path, s.split, s.key), cfg.eval_size))
    if len(held) < cfg.eval_size:
        raise ConfigError(f"data.eval_size={cfg.eval_size} leaves no training rows in {s.path}")
    return Rows([parse_row(r["row"], r["where"]) for r in held], s.path, wheres=[r["where"] for r in held])


# ---------------------------------------------------------------------------------------------
# Rows -> messages


def is_preference(row: dict[str, Any]) -> bool:
    return "chosen" in row and "rejected" in row


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "model": "assistant", "system": "system"}
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


def to_messages(row: dict[str, Any], fmt: DataFormat, system_prompt: str | None, where: str) -> list[dict[str, str]]:
    """One SFT row -> a conversation ending with the assistant's response.

    Refused (one line naming `where`): a row of no known form, a response with no text, a
    conversation with no user message before its response or not ending with the assistant."""
    fmt = form_of(row, fmt, where)
    if fmt == DataFormat.preference:
        raise ConfigError(f"{where}: this row is a preference pair (chosen/rejected), which trains with method=dpo: "
                          "add method=dpo, or use alpaca/chat rows for method=sft")
    if fmt == DataFormat.text:
        raise ConfigError(f"{where}: a text row has no prompt or response (it is tokenized whole): data.tokenize reads it")
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
        for i, m in enumerate(messages):  # every assistant turn is trained on
            if m["role"] == "assistant":
                _text(m["content"], where, f"the assistant's messages[{i}]")
        _has_prompt(messages[:-1], where)
    return _with_system(messages, system_prompt)


def to_pair(row: dict[str, Any], system_prompt: str | None, where: str) -> tuple[list[dict[str, str]], str, str]:
    """One preference row -> (prompt messages, chosen response text, rejected response text).

    Refused as for SFT rows, and a pair whose two responses are the same text (it prefers nothing)."""
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
    else:
        whole = [_messages(row[k], where, k) for k in ("chosen", "rejected")]
        for key, conv in zip(("chosen", "rejected"), whole):
            if len(conv) < 2:
                raise ConfigError(f"{where}: without a 'prompt', '{key}' must be a whole conversation (prompt messages, then the response)")
            _ends_with_response(conv, where, key)
        if whole[0][:-1] != whole[1][:-1]:
            raise ConfigError(f"{where}: 'chosen' and 'rejected' must share every message but the last (the prompt); they differ before it")
        prompt, chosen, rejected = whole[0][:-1], whole[0][-1]["content"], whole[1][-1]["content"]
    _has_prompt(prompt, where)
    chosen, rejected = _text(chosen, where, "'chosen'"), _text(rejected, where, "'rejected'")
    if chosen.strip() == rejected.strip():
        raise ConfigError(f"{where}: 'chosen' and 'rejected' are the same response, so the pair prefers nothing: {FIX}")
    return _with_system(prompt, system_prompt), chosen, rejected


FIX = "fix the row or remove it"


def _text(text: str, where: str, what: str) -> str:
    """A response to train on: refused when it holds nothing but whitespace."""
    if not text.strip():
        raise ConfigError(f"{where}: the response {what} is empty{' (only whitespace)' if text else ''}: {FIX}")
    return text


def _has_prompt(messages: list[dict[str, str]], where: str) -> None:
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise ConfigError(f"{where}: no user message with text before the response (a response to nothing): {FIX}")


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


def sharegpt_messages(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """ShareGPT's `conversations` ({from, value}) as {role, content} messages."""
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{where}: sharegpt rows need a non-empty 'conversations' list of {{from, value}} turns")
    out = []
    for i, t in enumerate(turns):
        role = SHAREGPT_ROLES.get(t.get("from")) if isinstance(t, dict) else None
        if role is None or not isinstance(t.get("value"), str):
            raise ConfigError(f"{where}: conversations[{i}] must be {{from: {'|'.join(SHAREGPT_ROLES)}, value: text}}, got {t!r}")
        out.append({"role": role, "content": t["value"]})
    return out


def _ends_with_response(messages: list[dict[str, str]], where: str, key: str) -> None:
    if messages[-1]["role"] != "assistant":
        of = "" if key == "messages" else f" of '{key}'"
        raise ConfigError(f"{where}: the last message{of} must be the assistant's response, got role {messages[-1]['role']!r}")


def _with_system(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    if system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def fingerprint(cfg: DataConfig) -> dict[str, dict[str, Any]]:
    """What the data of a run is, for a resume to compare: per source (data.train, data.eval, or
    data.train[i] of a mixture, with its weight or row count), the sha256 of each local file (a
    directory: each file in it), or a hub dataset's id and split."""
    out: dict[str, dict[str, Any]] = {}
    for value, split, key in _keys(cfg):
        for s in sources(value, split, key):
            path = Path(s.path).expanduser()
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else None
            if files is None:
                out[s.key] = {"hub": s.path, "split": s.split}
            else:
                out[s.key] = {"files": {str(p): _sha256(p.resolve(), *_stamp(p)) for p in files}}
            out[s.key] |= {k: v for k, v in (("weight", s.weight), ("rows", s.rows)) if v is not None}
    return out


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=256)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    """A file's content hash; cached per (path, size, mtime): checkpoints of one run hash the data once."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def looks_local(source: str) -> bool:
    """A path rather than a hub id: a data-file suffix or an explicit directory prefix."""
    return Path(source).suffix in (".jsonl", ".json") or source.startswith((".", "/", "~"))


def check(cfg: DataConfig, method: Method) -> None:
    """Read every local data file and convert every row; raises ConfigError at the first bad one.

    A local directory is only checked to hold a dataset; its rows, and hub datasets, are checked by
    the ranks (that needs `datasets`). A streamed data.train is only checked to exist: reading it
    whole is what streaming avoids (the ranks name a bad row when the stream reaches it)."""
    for s in (s for value, split, key in _keys(cfg) for s in sources(value, split, key)):
        key, source, path = s.key, s.path, Path(s.path).expanduser()
        if not (looks_local(source) or path.exists()):
            continue
        if looks_local(source) and not path.exists():
            raise ConfigError(f"{key}: no such file or directory: {source}")
        if path.is_dir():
            _check_directory(path, key)
            continue
        if cfg.streaming and key.startswith("data.train"):
            _data_file(path, source, key)
            continue
        rows = load_rows(source, "train", key)
        for i, row in enumerate(rows.rows):
            if method == Method.dpo:
                to_pair(row, cfg.system_prompt, rows.where(i))
            elif form_of(row, cfg.format, rows.where(i)) == DataFormat.text:
                text_of(row, rows.where(i))
            else:
                to_messages(row, cfg.format, cfg.system_prompt, rows.where(i))
