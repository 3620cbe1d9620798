"""Tokenized data as an on-disk Arrow artifact: made once, then memory-mapped by every rank.

The key is a hash of everything that changes the tokens (`key_inputs`): the source files' content (a
hub dataset: its `datasets` fingerprint) and each source's subset, split, revision and column map, the tokenizer (its whole tokenizer.json and chat template),
the data settings (form, template, system prompt, max_length, long prompts, packing, the held-out eval
rows), the method, and the seed where it matters (held-out rows, packing). The image files a vision-language model's
rows name are not read for the key (a million of them would be read at every start): the entry records each one's size
and modification time, and a load that finds one changed uses an entry of its own, keyed by the changed files
(`entry`): an image replaced in place is tokenized again (its token count follows its size). Under `data.cache_dir`
(default ~/.cache/finetune/tokens) the directory KEY/ holds `train.arrow` and `eval.arrow` (Arrow IPC
files) and `meta.json` (the counts the run prints). It is written under a temporary
name and renamed into place when complete, so a reader never sees half of one, and two processes
building the same key (sweep trials, nodes on a shared disk) cannot corrupt it.

Who builds it: local rank 0 of each node, inside the run (so any launch, torchrun or deepspeed, one
node or several with their own disks, gets the same path), with `datasets.map(num_proc=...)` over the
node's cores while the node's other ranks wait for `meta.json` to appear (a file wait, not a
collective: a million rows outlast a collective's timeout); or `python -m finetune.prepare`
beforehand, on a login node, with the same config. The rows are tokenized by finetune.data.tokenize's own
`tokenize_row` (so labels are those of the in-memory path, exactly), and packing (first fit, seeded)
runs on the token columns with numpy, so its result is cached too.

A rank memory-maps the files with pyarrow (no `datasets` import on a cache hit) and reads rows as
batches need them (`Examples`): its RAM does not grow with the dataset. A method whose examples carry values
computed on the ranks (DPO: the precomputed reference log-probs attached to each pair) has them materialized.
An example of several rows (a pair) is one table row, each of its rows under its own column prefix
(the method's `columns`: chosen_input_ids, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from finetune import methods
from finetune.config import ConfigError, DataConfig
from finetune.data.pack import first_fit
from finetune.data.sources import Rows, fingerprint, samples_rows, split_rows
from finetune.data.examples import tokenize_row
from finetune.data.images import has_images, kept, kept_row, pictures_of
from finetune.data.tokenize import IGNORE, Example, Stats, rows_of, uses_chat_template

if TYPE_CHECKING:
    import datasets
    import pyarrow as pa

VERSION = 3  # bump when the layout or the tokenization changes: old entries are then never read
META = "meta.json"
ROWS_PER_PROCESS = 1000  # fewer rows than this per process: starting the process costs more than it saves
SFT_COLUMNS = ("input_ids", "labels")


def root(cfg: DataConfig) -> Path:
    """data.cache_dir, else $FINETUNE_CACHE_DIR, else $XDG_CACHE_HOME/finetune/tokens (~/.cache/finetune/tokens)."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    if os.environ.get("FINETUNE_CACHE_DIR"):
        return Path(os.environ["FINETUNE_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "finetune" / "tokens"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides the tokens: the whole tokenizer (a fast tokenizer's tokenizer.json, else its
    vocabulary), its special tokens and its chat template."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    digest.update((backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))).encode())
    digest.update(json.dumps([getattr(tokenizer, "chat_template", None), tokenizer.bos_token, tokenizer.eos_token,
                              tokenizer.bos_token_id, tokenizer.eos_token_id], default=str).encode())
    pictures = pictures_of(tokenizer)
    if pictures is not None:  # a vision-language model's processor decides each image's tokens
        digest.update(pictures.fingerprint().encode())
    return digest.hexdigest()


def key_inputs(cfg: DataConfig, tokenizer: Any, method: str, seed: int) -> dict[str, Any]:
    """Everything that changes the tokens of a run's data (what the key hashes; meta.json keeps it)."""
    sources = fingerprint(cfg)
    for entry in sources.values():
        if "hub" in entry:  # the dataset's own fingerprint (revision and content), from its local cache
            entry["fingerprint"] = _hub_fingerprint(entry["hub"], entry["split"], entry.get("name"), entry.get("revision"))
    held_out = cfg.eval is None and cfg.eval_size > 0
    seeded = held_out or cfg.packing or samples_rows(cfg)
    return {
        "version": VERSION, "sources": sources, "tokenizer": tokenizer_fingerprint(tokenizer), "method": methods.get(method).name,
        "format": cfg.format.value, "template": cfg.template.value, "system_prompt": cfg.system_prompt,
        "max_length": cfg.max_length, "long_prompt": cfg.long_prompt.value, "packing": cfg.packing,
        "eval_size": cfg.eval_size if held_out else 0, "seed": seed if seeded else None,
        "reasoning": [cfg.reasoning.value, *cfg.reasoning_tags],  # data.chat_template: in the tokenizer's fingerprint
    }


def _hub_fingerprint(source: str, split: str, name: str | None, revision: str | None) -> str | None:
    try:
        import datasets

        return datasets.load_dataset(source, name=name, split=split, revision=revision)._fingerprint
    except Exception:  # noqa: BLE001 - loading it for real names the problem (finetune.data.sources.load_rows)
        return None


def key_of(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------------------------
# Reading


class Examples(Sequence):
    """A split's examples (or pairs), read row by row from a memory-mapped Arrow table."""

    def __init__(self, table: pa.Table, method: str = "sft") -> None:
        self.table, self.method = table, methods.get(method)
        self.columns = self.method.columns  # each of an example's rows: its columns' prefix

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        row = self.table.slice(int(i) % len(self), 1).to_pylist()[0]
        return self.method.join([Example(row[f"{c}input_ids"], row[f"{c}labels"], row[f"{c}prompt_len"], row[f"{c}reference"],
                                         row.get(f"{c}position_ids"), images=tuple(row.get(f"{c}images") or ()))
                                 for c in self.columns],
                                {name: row[name] for name in self.method.scalars})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Examples) and self.table.equals(other.table)

    def lengths(self) -> np.ndarray:
        """Each example's tokens (a pair: its longer side), without reading the rows."""
        import pyarrow.compute as pc

        columns = [f"{c}input_ids" for c in self.columns]
        table = self.table
        return np.max([_numpy(pc.list_value_length(table.column(c)).combine_chunks()) for c in columns], axis=0)

    def labelled(self) -> np.ndarray:
        """Each row's labelled positions after its first token, both sides of a pair summed
        (finetune.data.lengths.row_labelled), from the columns."""
        table = self.table
        return sum(_labelled(table.column(c).combine_chunks())
                   for c in (f"{prefix}labels" for prefix in self.columns))

    def image_tokens(self, token_id: int | None) -> np.ndarray:
        """Each row's tokens that are `token_id` (a vision-language model's image token), both sides of a pair summed
        (finetune.data.lengths.row_image_tokens), from the columns."""
        total = np.zeros(len(self), dtype=np.int64)
        for column in (f"{prefix}input_ids" for prefix in self.columns):
            ids = self.table.column(column).combine_chunks()
            hits = np.concatenate([[0], np.cumsum(_numpy(ids.flatten()) == token_id)])
            offsets = _numpy(ids.offsets)
            offsets = offsets - offsets[0]  # flatten() starts at the first row's values
            total += hits[offsets[1:]] - hits[offsets[:-1]]
        return total

    def tokens(self) -> int:
        import pyarrow.compute as pc

        return sum(int(pc.sum(pc.list_value_length(self.table.column(c))).as_py() or 0)
                   for c in (f"{prefix}input_ids" for prefix in self.columns))


def _numpy(array: Any) -> np.ndarray:
    """An Arrow array of integers as NumPy (a view of its buffer where it has no nulls). pyarrow's own to_numpy imports
    pandas on its first call, a second of a rank's start on a busy 2-core machine, for nothing the rank uses."""
    import pyarrow as pa

    if array.null_count or not pa.types.is_integer(array.type):
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(array.type.to_pandas_dtype())  # a NumPy dtype: no pandas involved
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _labelled(labels: Any) -> np.ndarray:
    offsets, values = _numpy(labels.offsets), _numpy(labels.values)
    marked = np.concatenate([[0], np.cumsum(values != IGNORE)])
    first = np.zeros(len(offsets) - 1, dtype=np.int64)  # a row's first token predicts nothing
    nonempty = offsets[1:] > offsets[:-1]
    first[nonempty] = values[offsets[:-1][nonempty]] != IGNORE
    return marked[offsets[1:]] - marked[offsets[:-1]] - first


def find(cfg: DataConfig, tokenizer: Any, method: str, seed: int) -> Path | None:
    """The cache entry of these inputs, if one is complete."""
    _, target, _ = entry(cfg, tokenizer, method, seed)
    return target if (target / META).is_file() else None


def entry(cfg: DataConfig, tokenizer: Any, method: str, seed: int) -> tuple[dict[str, Any], Path, list[str]]:
    """(the key's inputs, the entry's directory, the images changed since): where the entry of these inputs made from
    rows whose image files changed in place since (`changed_images`) is one of its own, its key the changed files'."""
    inputs = key_inputs(cfg, tokenizer, method, seed)
    target = root(cfg) / key_of(inputs)
    changed = changed_images(target) if (target / META).is_file() else []
    if changed:  # the same rows, other pictures: other tokens where the resolution is dynamic
        inputs |= {"images": hashlib.sha256(json.dumps(_stamps(changed)).encode()).hexdigest()}
        target = root(cfg) / key_of(inputs)
    return inputs, target, changed


def open_split(path: Path, method: str = "sft") -> Examples:
    """A split's Arrow file of `method`'s examples, memory-mapped (pages are read as rows are; nothing is copied)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return Examples(pa.ipc.open_file(source).read_all(), method)


def write_split(table: pa.Table, path: Path) -> None:
    import pyarrow as pa

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=8192)


# ---------------------------------------------------------------------------------------------
# Building


def _features(method: str) -> datasets.Features:
    """The token columns of each of an example's rows (prefixed by the method's `columns`), its `scalars`, and the counts'."""
    from datasets import Features, Sequence, Value

    ids = Sequence(Value("int32"))
    common = {"kind": Value("int8"), "prompt": Value("int32"), "flags": Value("int8"), "thought": Value("int32"),
              "n_images": Value("int32"), "n_image_tokens": Value("int32")}
    m = methods.get(method)
    return Features({f"{c}{name}": ids for c in m.columns for name in ("input_ids", "labels")}
                    | {f"{c}prompt_len": Value("int32") for c in m.columns} | {f"{c}reference": Value("string") for c in m.columns}
                    | {f"{c}images": Sequence(Value("string")) for c in m.columns}
                    | {name: Value("float64") for name in m.scalars} | common)


KEPT, DROPPED = 0, 1  # `kind`: a row to train on, or a prompt too long (its length in `prompt`), kept for the counts
TRUNCATED, SPLIT = 1, 2  # `flags` bits, on a source row's first output


def _encode_batch(batch: dict[str, list[Any]], indices: list[int], *, origin: Rows, tokenizer: Any, cfg: DataConfig,
                  method: str, chat: bool) -> dict[str, list[Any]]:
    """datasets.map: JSON rows -> token columns, one output per example (and one per dropped row)."""
    out: dict[str, list[Any]] = {name: [] for name in _features(method)}
    for raw, i in zip(batch["row"], indices):
        encoded = tokenize_row(json.loads(raw), origin.where(i), tokenizer, cfg, method, chat)
        items: list[Any] = encoded.items or [None]
        for n, item in enumerate(items):
            flags = (TRUNCATED * encoded.truncated + SPLIT * encoded.split) if n == 0 else 0
            _append(out, item, method, kind=DROPPED if item is None else KEPT, prompt=encoded.dropped or 0, flags=flags,
                    thought=encoded.thought if n == 0 else 0)
    return out


def _append(out: dict[str, list[Any]], item: Any, method: str, *, kind: int, prompt: int, flags: int, thought: int) -> None:
    out["thought"].append(thought)
    first = rows_of(item)[0] if item is not None else None  # an example's rows show the same images
    out["n_images"].append(len(first.images) if first is not None else 0)
    out["n_image_tokens"].append(first.image_tokens if first is not None else 0)
    out["kind"].append(kind)
    out["prompt"].append(prompt)
    out["flags"].append(flags)
    m = methods.get(method)
    for name in m.scalars:
        out[name].append(float(getattr(item, name)) if item is not None else 0.0)
    for c, ex in zip(m.columns, rows_of(item) if item is not None else [Example([], [], 0, "")] * len(m.columns)):
        out[f"{c}input_ids"].append(ex.input_ids)
        out[f"{c}labels"].append(ex.labels)
        out[f"{c}prompt_len"].append(ex.prompt_len)
        out[f"{c}reference"].append(ex.reference)
        out[f"{c}images"].append(list(ex.images))  # paths: the rows' bytes were kept as files first (`_kept_images`)


ROWS_PER_WRITE = 10_000
IMAGES = "images"
"""The cache root's directory of images a row held as bytes (a `datasets` Image column, or bytes in memory), each kept
once as a file named by its content's hash: the token table keeps image paths."""


def _kept_images(row: dict[str, Any], store: Path) -> dict[str, Any]:
    """The row with each image it holds as bytes or a decoded image replaced by its file in `store`."""
    if not has_images(row):
        return row
    return kept_row(row, lambda image: kept(image, store))


def row_file(rows: Rows, path: Path, store: Path) -> datasets.Dataset:
    """The rows as one JSON string each, written to an Arrow file that `datasets` memory-maps: the forked
    tokenizing workers share its pages instead of each copying the parent's row objects (a million rows'
    dicts are gigabytes, and a child's garbage collector touches every one). `rows.rows` is emptied as
    it is written: the caller's rows are consumed. Images a row holds as bytes are kept as files in `store` first."""
    import pyarrow as pa

    import datasets

    schema = pa.schema([("row", pa.string())])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for start in range(0, len(rows.rows), ROWS_PER_WRITE):
            end = min(start + ROWS_PER_WRITE, len(rows.rows))
            writer.write_batch(pa.record_batch([pa.array([json.dumps(_kept_images(r, store)) for r in rows.rows[start:end]],
                                                         pa.string())], schema=schema))
            rows.rows[start:end] = [None] * (end - start)
    rows.rows.clear()
    return datasets.Dataset.from_file(str(path))


def tokenize_split(rows: Rows, tokenizer: Any, cfg: DataConfig, key: str, method: str, *, num_proc: int,
                   progress: bool, scratch: Path, store: Path) -> tuple[pa.Table, Stats]:
    """Rows -> a token table (memory-mapped from `datasets`' files in `scratch`) with `tokenize`'s counts and
    refusals. The rows are consumed (`row_file`)."""
    import gc

    import pyarrow as pa

    import datasets

    chat = uses_chat_template(tokenizer, cfg.template)
    count = len(rows.rows)
    scratch = scratch / key  # a split's own directory: `datasets` names its output files by the fingerprint
    scratch.mkdir(parents=True)
    table = row_file(rows, scratch / "rows.arrow", store)
    procs = max(1, min(num_proc, count // ROWS_PER_PROCESS))
    if procs > 1:  # the workers are forked: the tokenizer's own threads would deadlock or warn in them
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    origin = Rows([], rows.source, rows.lines, rows.first, rows.wheres)  # where each row is from, for refusals
    fn = _bound(_encode_batch, origin=origin, tokenizer=tokenizer, cfg=cfg, method=method, chat=chat)
    (datasets.enable_progress_bars if progress else datasets.disable_progress_bars)()
    gc.collect()
    gc.freeze()  # the objects alive now are never collected in the forked workers, so their pages stay shared
    try:
        ds = table.map(fn, batched=True, batch_size=256, with_indices=True, remove_columns=["row"], features=_features(method),
                       num_proc=procs if procs > 1 else None, desc=f"tokenizing {key}", new_fingerprint=f"tokens-{os.getpid()}", load_from_cache_file=False)
    except ConfigError:
        raise
    except Exception as e:  # a worker's ConfigError comes back wrapped by the pool in some versions
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise
    finally:
        gc.unfreeze()
    columns = ds.data.table
    kind, flags, prompt, thought, images, image_tokens = (columns.column(c).to_numpy() for c in (
        "kind", "flags", "prompt", "thought", "n_images", "n_image_tokens"))
    dropped = kind == DROPPED
    stats = Stats(rows=count, sources=rows.note, truncated=int(((flags & TRUNCATED) > 0).sum()), split=int(((flags & SPLIT) > 0).sum()),
                  dropped=int(dropped.sum()), shortest_dropped_prompt=int(prompt[dropped].min()) if dropped.any() else 0,
                  reasoning=int((thought > 0).sum()), thought=int(thought.sum()),
                  reasoning_mode=cfg.reasoning.value if thought.any() else Stats.reasoning_mode,
                  images=int(images.sum()), image_tokens=int(image_tokens.sum()))
    stats.check(key, rows.source, cfg.max_length, not dropped.all() and len(ds) > 0)
    if dropped.any():
        columns = columns.filter(pa.array(~dropped))
    return columns.drop_columns(["kind", "prompt", "flags", "thought", "n_images", "n_image_tokens"]), stats


class _bound:
    """functools.partial that `datasets` can hash cheaply (we give map its fingerprint ourselves) and pickle."""

    def __init__(self, fn: Callable[..., Any], **kwargs: Any) -> None:
        self.fn, self.kwargs = fn, kwargs

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        return self.fn(batch, indices, **self.kwargs)


def pack_split(table: pa.Table, max_length: int, seed: int) -> pa.Table:
    """Packed rows of at most `max_length` tokens (`first_fit`'s rows, in its seeded order), built from the
    token columns with numpy: the same rows as finetune.data.pack.pack, for a million samples in seconds."""
    import pyarrow as pa

    ids, labels = (table.column(c).combine_chunks() for c in SFT_COLUMNS)
    offsets = ids.offsets.to_numpy()
    lengths = np.diff(offsets)
    rows = first_fit(lengths.tolist(), max_length, seed)
    order = np.fromiter((i for row in rows for i in row), dtype=np.int64, count=len(lengths))
    sizes = lengths[order]
    seg_start = np.cumsum(sizes) - sizes  # where each sample starts in the packed token stream
    total = int(sizes.sum())
    gather = np.repeat(offsets[:-1][order] - seg_start, sizes) + np.arange(total)
    position = np.arange(total) - np.repeat(seg_start, sizes)
    counts = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
    row_offsets = np.concatenate([[0], np.cumsum(np.add.reduceat(sizes, np.cumsum(counts) - counts))]).astype(np.int32)

    def column(values: np.ndarray) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(row_offsets), pa.array(values.astype(np.int32)))

    n = len(rows)
    packed = pa.table({"input_ids": column(ids.values.to_numpy()[gather]), "labels": column(labels.values.to_numpy()[gather]),
                       "prompt_len": pa.array(np.zeros(n, np.int32)), "reference": pa.array([""] * n, pa.string()),
                       "position_ids": column(position)})
    if "images" in table.column_names:  # a vision-language model's rows: each packed row shows its samples' images in order
        images = table.column("images").to_pylist()
        packed = packed.append_column("images", pa.array([[im for i in row for im in images[i]] for row in rows],
                                                         pa.list_(pa.string())))
    return packed


def build(cfg: DataConfig, tokenizer: Any, method: str, seed: int, target: Path, inputs: dict[str, Any], *,
          num_proc: int, progress: bool, say: Callable[[str], None]) -> None:
    """Tokenize (and pack) the run's data into `target`, atomically."""
    started = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f"{target.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    scratch = temporary / "scratch"  # the rows and `datasets.map`'s output, removed before the entry is complete
    try:
        rows = dict(zip(("train", "eval"), split_rows(cfg, seed)))
        splits: dict[str, Any] = {}
        stats: dict[str, Stats] = {}
        for name in ("train", "eval"):
            if rows[name] is not None:
                splits[name], stats[name] = tokenize_split(rows.pop(name), tokenizer, cfg, f"data.{name}", method,
                                                           num_proc=num_proc, progress=progress, scratch=scratch,
                                                           store=target.parent / IMAGES)
        samples = splits["train"].num_rows
        images = _image_stamps(splits.values())
        if cfg.packing and methods.get(method).unpacked is None:
            splits["train"] = pack_split(splits["train"], cfg.max_length, seed)
        for name, table in splits.items():
            write_split(table, temporary / f"{name}.arrow")
        counts = {k: v.num_rows for k, v in splits.items()}
        del splits, table
        shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    meta = {"inputs": inputs, "stats": {k: vars(s) for k, s in stats.items()}, "samples": samples,
            "rows": counts, "seconds": round(time.perf_counter() - started, 3), "images": images}
    (temporary / META).write_text(json.dumps(meta, indent=1) + "\n")
    try:
        os.rename(temporary, target)
    except OSError:  # another process finished the same key first: theirs is as good
        shutil.rmtree(temporary, ignore_errors=True)
        if not (target / META).is_file():
            raise
    rate = sum(s.rows for s in stats.values()) / max(meta["seconds"], 1e-9)
    say(f"data: tokenized {' + '.join(f'{s.rows} {k}' for k, s in stats.items())} rows in {meta['seconds']:.1f} s "
        f"({rate:,.0f} rows/s, {num_proc} processes at most), cached at {target}")


def num_processes(cfg: DataConfig) -> int:
    """data.num_proc, or the cores this process may run on."""
    if cfg.num_proc:
        return cfg.num_proc
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load(cfg: DataConfig, tokenizer: Any, seed: int, method: str, *, builder: bool, progress: bool,
         say: Callable[[str], None], wait_s: float = 0.5) -> tuple[Any, Any, dict[str, Stats], int, Path]:
    """The run's train and eval examples from the cache, built first if missing by the `builder` (local rank 0;
    the others wait for it). Returns (train, eval, counts, samples before packing, the cache entry)."""
    inputs, target, changed = entry(cfg, tokenizer, method, seed)
    base = root(cfg)
    if changed:
        say(f"data: {len(changed)} image(s) changed since their rows' tokens were cached ({changed[0]}"
            f"{', ...' if len(changed) > 1 else ''}): the rows' tokens again, cached at {target}")
    if not (target / META).is_file():
        if builder:
            try:
                base.mkdir(parents=True, exist_ok=True)
                probe = base / f".write-test-{os.getpid()}"
                probe.touch()
                probe.unlink()
            except OSError as e:
                raise ConfigError(f"data.cache_dir: cannot write the token cache in {base} ({e.strerror}): point data.cache_dir "
                                  "at a writable directory, or set data.cache=false to tokenize in memory") from None
            build(cfg, tokenizer, method, seed, target, inputs, num_proc=num_processes(cfg), progress=progress, say=say)
        else:
            while not (target / META).is_file():  # local rank 0 is building it (if it fails, the launcher stops us)
                time.sleep(wait_s)
        hit = False
    else:
        hit = True
    meta = json.loads((target / META).read_text())
    train = open_split(target / "train.arrow", method)
    evals = open_split(target / "eval.arrow", method) if (target / "eval.arrow").is_file() else []
    if hit:
        say(f"data: cached tokens {target} ({describe(train, evals)})")
    if methods.get(method).attached:  # each example carries values computed on the rank (reference log-probs): materialize
        train, evals = list(train), list(evals)
    stats = {k: Stats(**v) for k, v in meta["stats"].items()}
    return train, evals, stats, meta["samples"], target


def _image_stamps(tables: Any) -> dict[str, list[int]]:
    """Each image file the tokenized rows name, with its size and modification time (what a later run compares: an
    image changed in place changes its tokens where the model's resolution is dynamic, Qwen-VL's)."""
    paths = {image for table in tables for column in table.column_names if column.endswith("images")
             for row in table.column(column).to_pylist() for image in row or ()}
    return _stamps(sorted(paths))


def _stamps(paths: list[str]) -> dict[str, list[int]]:
    out = {}
    for path in paths:
        try:
            st = os.stat(path)
            out[path] = [st.st_size, st.st_mtime_ns]
        except OSError:
            out[path] = [-1, -1]
    return out


def changed_images(entry: Path) -> list[str]:
    """The images a cache entry's rows name whose file changed (or went) since it was made: one stat per image."""
    made = json.loads((entry / META).read_text()).get("images") or {}
    now = _stamps(list(made))
    return [path for path, stamp in made.items() if now[path] != stamp]


def describe(train: Any, evals: Any) -> str:
    """`N rows, T tokens` of the cached splits."""
    def tokens(split: Any) -> int:
        return split.tokens() if isinstance(split, Examples) else sum(len(row.input_ids) for p in split for row in rows_of(p))

    return ", ".join(f"{name} {len(split):,} rows, {tokens(split):,} tokens" for name, split in (("train", train), ("eval", evals)) if len(split))

