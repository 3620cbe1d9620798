"""Where rows come from, with no heavy imports (the launcher reads local files through it before any rank
starts, so a missing file or a bad line is one line naming the file and line).

- A source is a local .jsonl/.json file, a local dataset directory (data files, or save_to_disk output)
  or a hub dataset id (`datasets.load_dataset`); data.train / data.eval are one source or a mixture (a
  list of sources with weights or row counts, drawn by the seed).
- `split_rows`: the train rows and the eval rows (data.eval, or rows of data.train held out by the seed).
- Streams (data.streaming=true): a source read as it is needed, one pass of data.train as a
  `datasets.IterableDataset` through a seeded shuffle buffer (finetune.rank.stream tokenizes it).
- `fingerprint`: what the data of a run is (the files' content hashes), for a resume to compare.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from finetune.config import ConfigError, DataConfig
from finetune.data.images import anchor, has_images, inline, kept_row


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
    name: str | None = None  # the dataset's subset (its config name: `datasets.load_dataset(path, name=...)`)
    revision: str | None = None  # a hub dataset's branch, tag or commit
    columns: tuple[tuple[str, str], ...] = ()  # (our key, the dataset's column): renamed before a row is read

    def load(self) -> Rows:
        return load_rows(self.path, self.split, self.key, name=self.name, revision=self.revision, columns=self.columns)


SOURCE_KEYS = ("path", "name", "split", "revision", "columns", "weight", "rows")
SOURCE_FORM = ("a path or hub id, a source {path, name, split, revision, columns}, or a list of sources (each also with a weight "
               "or rows), e.g. data.train={path:ORG/NAME,name:SUBSET,split:train_sft,columns:{messages:conversation}}")


def sources(value: Any, split: str, key: str) -> list[Source]:
    """data.train / data.eval as a list of sources; one line naming the entry for a malformed one."""
    if isinstance(value, str):
        return [Source(value, split, key)]
    if isinstance(value, dict):  # one source with its subset, split, revision or column map
        return [_source(value, split, key)]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"{key} must be {SOURCE_FORM}")
    return [_source({"path": entry} if isinstance(entry, str) else entry, split, f"{key}[{i}]") for i, entry in enumerate(value)]


def _source(entry: Any, split: str, at: str) -> Source:
    if not isinstance(entry, dict):
        raise ConfigError(f"{at}={entry!r}: a source is a path or {{path, name, split, revision, columns, weight, rows}}")
    unknown = sorted(set(entry) - set(SOURCE_KEYS))
    if unknown:
        raise ConfigError(f"{at}: unknown key {unknown[0]!r}: a source has path, and optionally {', '.join(SOURCE_KEYS[1:])}")
    path, weight, rows = entry.get("path"), entry.get("weight"), entry.get("rows")
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{at}.path must be a path or hub id (got {path!r})")
    if weight is not None and rows is not None:
        raise ConfigError(f"{at}: set weight (its share of the mixture) or rows (an exact count), not both")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0):
        raise ConfigError(f"{at}.weight={weight} must be a number above 0")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ConfigError(f"{at}.rows={rows} must be an integer of at least 1")
    for name in ("name", "split", "revision"):
        if entry.get(name) is not None and (not isinstance(entry[name], (str, int)) or not str(entry[name]).strip()):
            raise ConfigError(f"{at}.{name}={entry[name]!r} must be non-empty text")
    if entry.get("revision") is not None and Path(path).expanduser().is_dir():
        raise ConfigError(f"{at}.revision: {path} is a local directory, which has no revisions (a hub dataset's branch, tag or "
                          "commit): remove revision")
    if Path(path).suffix in (".jsonl", ".json") and (entry.get("name") is not None or entry.get("revision") is not None):
        which = "name" if entry.get("name") is not None else "revision"
        raise ConfigError(f"{at}.{which}: {path} is a data file, which has no subsets or revisions: remove {which}, or point "
                          "path at a dataset directory or hub id")
    return Source(path, str(entry.get("split") or split), at, None if weight is None else float(weight), rows,
                  _text(entry.get("name")), _text(entry.get("revision")), column_map(entry.get("columns"), at))


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def column_map(value: Any, at: str) -> tuple[tuple[str, str], ...]:
    """A source's `columns` ({our key: the dataset's column}) as pairs; refused when it is not such a map (one naming a
    key no row form reads is refused by finetune.launcher.rules.data, which knows the forms)."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not value or not all(isinstance(v, str) and v for v in value.values()):
        raise ConfigError(f"{at}.columns must map the keys rows are read by to the dataset's columns, "
                          f"e.g. {{messages: conversation}} (got {value!r})")
    if len(set(value.values())) < len(value):
        raise ConfigError(f"{at}.columns maps one column onto two keys ({value}): map each column once")
    return tuple((str(k), v) for k, v in value.items())


def renamed(row: dict[str, Any], columns: tuple[tuple[str, str], ...], where: str, key: str) -> dict[str, Any]:
    """A row with its columns renamed to our keys (a source's `columns`); one line naming the row for a column it
    lacks, with the columns it has."""
    if not columns:
        return row
    theirs = {c for _, c in columns}
    for ours, column in columns:
        if column not in row:
            raise ConfigError(f"{key}.columns.{ours}={column}: {where} has no column {column!r} (its columns: "
                              f"{', '.join(sorted(row)) or 'none'})")
    out = {k: v for k, v in row.items() if k not in theirs}
    return out | {ours: row[column] for ours, column in columns}


def samples_rows(cfg: DataConfig) -> bool:
    """Whether drawing the rows depends on the seed (a source with a weight or a row count)."""
    return any(s.weight is not None or s.rows is not None for s in all_sources(cfg))


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
        return srcs[0].load()
    loaded = [s.load() for s in srcs]
    counts = mixture_counts(srcs, [len(r.rows) for r in loaded])
    rows: list[dict[str, Any]] = []
    wheres: list[str] = []
    parts = []
    for i, (s, r, n) in enumerate(zip(srcs, loaded, counts)):
        idx = draw(len(r.rows), n, seed, i)
        rows += [r.rows[j] for j in idx]
        wheres += [r.where(j) for j in idx]
        how = f", weight {s.weight:g}" if s.weight is not None else f", rows={s.rows}" if s.rows is not None else ""
        parts.append(f"{s.path}{'' if s.name is None else f' subset {s.name}'} {n:,} of {len(r.rows):,}{how}")
    return Rows(rows, key, wheres=wheres, note=f"{key}: {len(rows):,} rows from {len(srcs)} sources ({'; '.join(parts)})")


def load_rows(source: str, split: str, key: str, *, name: str | None = None, revision: str | None = None,
              columns: tuple[tuple[str, str], ...] = ()) -> Rows:
    """Read a local .jsonl/.json file, a local dataset directory, or a hub dataset id.

    Args:
        source: the path or hub id.
        split: split name for directories and hub datasets.
        key: the config key that named `source` (for messages), e.g. "data.train".
        name, revision: the dataset's subset and (hub) revision, for directories and hub datasets.
        columns: (our key, the dataset's column) pairs: each row's columns renamed (`renamed`).

    Raises:
        ConfigError: one line naming the file and line of a bad row, or, for a source that cannot
            be loaded, every way it was tried and why each failed.
    """
    path = Path(source).expanduser()
    if path.is_file():
        rows = _read_jsonl(path) if _data_file(path, source, key) == ".jsonl" else _read_json(path)
        if not rows.rows:
            raise ConfigError(f"{key}: {source} has no rows ({'the file is empty' if not path.stat().st_size else 'only blank lines'})")
    else:
        rows = Rows(rows=list(_open_dataset(source, split, key, streaming=False, name=name, revision=revision)), source=source)
    if columns:
        rows.rows = [renamed(row, columns, rows.where(i), key) for i, row in enumerate(rows.rows)]
    if path.exists():  # a local file's or directory's images are read relative to it
        rows.rows = _anchored(rows.rows, path)
    return rows


def _anchored(rows: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """Rows with their relative image paths read from the data file's directory (a dataset directory: itself)."""
    base = (path if path.is_dir() else path.parent).resolve()
    return [anchor(row, base) if has_images(row) else row for row in rows]


def _data_file(path: Path, source: str, key: str) -> str:
    """A data file's suffix, .jsonl or .json (anything else refused in one line)."""
    if path.suffix not in (".jsonl", ".json"):
        raise ConfigError(f"{key}: {source} is a {path.suffix or 'suffix-less'} file: data files are .jsonl (one JSON object "
                          "per line) or .json (a list of objects); for other formats use a dataset directory")
    return path.suffix


def _open_dataset(source: str, split: str, key: str, *, streaming: bool, name: str | None = None, revision: str | None = None) -> Any:
    """A local dataset directory (data files or save_to_disk output) or a hub id, through `datasets`: a Dataset, or
    with `streaming` an IterableDataset read as it is iterated (save_to_disk output is memory-mapped either way).
    `name`: its subset (config); `revision`: a hub dataset's branch, tag or commit."""
    path = Path(source).expanduser()
    if looks_local(source) and not path.exists():
        raise ConfigError(f"{key}: no such file or directory: {source}")
    if path.is_dir():
        _check_directory(path, key)
    import datasets

    saved = path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())
    if saved and name is not None:
        raise ConfigError(f"{key}.name={name}: {source} is save_to_disk output, which has no subsets: remove name")
    try:
        if saved:
            ds = datasets.load_from_disk(str(path))
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(str(path) if path.is_dir() else source, name=name, split=split, revision=revision,
                                     streaming=streaming)
    except Exception as e:  # noqa: BLE001 - whatever `datasets` raises, the user needs one line
        what = f"the local dataset directory {source}" if path.is_dir() else repr(source)
        if _subset_or_split(e):
            raise ConfigError(_choices(e, str(path) if path.is_dir() else source, name, split, revision, key, what)) from None
        if path.is_dir():
            raise ConfigError(f"{key}: could not load {what} (split {split!r}): {str(e).splitlines()[0]}") from None
        raise ConfigError(f"{key}: could not load {source!r}: as a local path: no such file or directory; as a hub dataset "
                          f"(split {split!r}): {_hub_failure(e)}") from None


def _subset_or_split(e: Exception) -> bool:
    text = str(e)
    return isinstance(e, ValueError) and ("BuilderConfig" in text or "Unknown split" in text or "Config name is missing" in text)


def _choices(e: Exception, path: str, name: str | None, split: str, revision: str | None, key: str, what: str) -> str:
    """An unknown subset or split of a dataset, in one line with the ones it has."""
    import datasets

    if "Unknown split" not in str(e):
        names = ", ".join(datasets.get_dataset_config_names(path, revision=revision))
        if name is None:
            return f"{key}: {what} has several subsets and no default: name one, e.g. {key}={{path: {path}, name: SUBSET}} (its subsets: {names})"
        return f"{key}: {what} has no subset name={name}: its subsets are {names}; set name to one of them"
    splits = datasets.get_dataset_split_names(path, name, revision=revision)
    return f"{key}: {what}{'' if name is None else f' (subset {name})'} has no split {split!r}: its splits are {', '.join(splits)}"


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


def records(source: str, split: str, key: str, start: int = 0, *, name: str | None = None, revision: str | None = None,
            columns: tuple[tuple[str, str], ...] = ()) -> Iterator[dict[str, str]]:
    """One source's rows in its own order from its row `start` on, read as they are needed, each as
    {"row": its JSON text, "where": FILE:LINE or SOURCE row I} (rows travel as text: `datasets` would give rows of
    different forms each other's keys, as nulls). A .jsonl file is read line by line, a dataset directory or a hub
    id (its subset `name`, at `revision`) through `datasets` streaming (save_to_disk output memory-mapped), a .json
    file (one list) whole; `columns` renames each row's columns (`renamed`).

    Raises:
        ConfigError: a source that cannot be read, or one with no rows from `start` on (data.eval_size held them out).
    """
    path = Path(source).expanduser()
    if path.is_file() and _data_file(path, source, key) == ".jsonl":
        found = ({"row": line, "where": f"{path}:{n}"} for n, line in _jsonl_lines(path))
    elif path.is_file():
        found = ({"row": json.dumps(row), "where": f"{path} row {i}"} for i, row in enumerate(_read_json(path).rows))
    else:
        found = ({"row": json.dumps(kept_row(row, inline) if has_images(row) else row, default=str), "where": f"{source} row {i}"}
                 for i, row in enumerate(_open_dataset(source, split, key, streaming=True, name=name, revision=revision)))
    if columns:
        found = ({"row": json.dumps(renamed(parse_row(r["row"], r["where"]), columns, r["where"], key), default=str),
                  "where": r["where"]} for r in found)
    if path.exists():  # relative image paths read from the data file's directory
        found = ({"row": json.dumps(anchor(row, (path if path.is_dir() else path.parent).resolve())), "where": r["where"]}
                 if has_images(row := parse_row(r["row"], r["where"])) else r for r in found)
    empty = True
    for record in itertools.islice(found, start, None):
        empty = False
        yield record
    if empty:
        raise ConfigError(f"data.eval_size={start} leaves no training rows in {source}" if start else f"{key}: {source} has no rows")


def _reads(s: Source) -> dict[str, Any]:
    """`records`' arguments for a source."""
    return {"source": s.path, "split": s.split, "key": s.key, "name": s.name, "revision": s.revision, "columns": s.columns}


def one_pass(cfg: DataConfig, seed: int, buffer: int) -> Any:
    """One pass over data.train as a `datasets.IterableDataset` of `records`: each source read in its own order
    (after the data.eval_size rows held out), through a shuffle buffer of `buffer` rows drawn by the seed; a mixture
    draws each next row from a source with its weight's probability (seeded) and ends when a source runs out, so no
    row repeats within a pass. `set_epoch(e)` gives pass e its own order, a function of (seed, e)."""
    import datasets
    import numpy as np

    srcs = sources(cfg.train, cfg.train_split, "data.train")
    start = cfg.eval_size if cfg.eval is None else 0
    parts = [datasets.IterableDataset.from_generator(records, gen_kwargs=_reads(s) | {"start": start})
             .shuffle(generator=np.random.default_rng([seed, 7919, i]), buffer_size=buffer) for i, s in enumerate(srcs)]
    if len(parts) == 1:
        return parts[0]
    total = sum(s.weight for s in srcs)  # every source of a streamed mixture has one (finetune.launcher.rules)
    return datasets.interleave_datasets(parts, probabilities=[s.weight / total for s in srcs], seed=seed,
                                        stopping_strategy="first_exhausted")


def first_rows(cfg: DataConfig) -> Rows:
    """The eval rows of a streamed data.train: its first data.eval_size rows, in the source's order."""
    (s,) = sources(cfg.train, cfg.train_split, "data.train")  # one source (finetune.launcher.rules)
    held = list(itertools.islice(records(**_reads(s)), cfg.eval_size))
    if len(held) < cfg.eval_size:
        raise ConfigError(f"data.eval_size={cfg.eval_size} leaves no training rows in {s.path}")
    return Rows([parse_row(r["row"], r["where"]) for r in held], s.path, wheres=[r["where"] for r in held])


# ---------------------------------------------------------------------------------------------
# Train and eval rows, the data's fingerprint, the launcher's read


def split_rows(cfg: DataConfig, seed: int) -> tuple[Rows, Rows | None]:
    """The train rows and the eval rows (data.eval, or data.eval_size rows of data.train held out by `seed`)."""
    train_rows = load_sources(cfg.train, cfg.train_split, "data.train", seed)
    if cfg.eval is not None:
        return train_rows, load_sources(cfg.eval, cfg.eval_split, "data.eval", seed)
    if not cfg.eval_size:
        return train_rows, None
    if cfg.eval_size >= len(train_rows.rows):
        raise ConfigError(f"data.eval_size={cfg.eval_size} leaves no training rows out of {len(train_rows.rows)}")
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(train_rows.rows))
    held, kept = sorted(order[: cfg.eval_size]), sorted(order[cfg.eval_size :])
    return train_rows.subset(kept), train_rows.subset(held)


def fingerprint(cfg: DataConfig) -> dict[str, dict[str, Any]]:
    """What the data of a run is, for a resume to compare: per source (data.train, data.eval, or
    data.train[i] of a mixture, with its weight or row count), the sha256 of each local file (a
    directory: each file in it), or a hub dataset's id and split; and its subset, revision and column map where set."""
    out: dict[str, dict[str, Any]] = {}
    for s in all_sources(cfg):
        path = Path(s.path).expanduser()
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else None
        if files is None:
            out[s.key] = {"hub": s.path, "split": s.split}
        else:
            out[s.key] = {"files": {str(p): _sha256(p.resolve(), *_stamp(p)) for p in files}}
            if path.is_dir():  # which of its splits (a data file has none)
                out[s.key]["split"] = s.split
        out[s.key] |= {k: v for k, v in (("weight", s.weight), ("rows", s.rows), ("name", s.name), ("revision", s.revision),
                                         ("columns", dict(s.columns) or None)) if v is not None}
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


def all_sources(cfg: DataConfig) -> list[Source]:
    """Every source of data.train and data.eval."""
    return [s for value, split, key in _keys(cfg) for s in sources(value, split, key)]


def local_rows(s: Source, *, streamed: bool) -> Rows | None:
    """What the launcher reads of a source before any rank starts: the rows of a local .jsonl/.json file; None for
    what it leaves to the ranks (a hub id; a directory, once it is seen to hold a dataset; a streamed file, once it is
    seen to exist: reading it whole is what streaming avoids)."""
    path = Path(s.path).expanduser()
    if not (looks_local(s.path) or path.exists()):
        return None
    if looks_local(s.path) and not path.exists():
        raise ConfigError(f"{s.key}: no such file or directory: {s.path}")
    if path.is_dir():
        _check_directory(path, s.key)
        return None
    if streamed:
        _data_file(path, s.path, s.key)
        return None
    return s.load()
