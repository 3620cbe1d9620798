"""Rows -> the run's examples, through its method (finetune.methods): the launcher's check of every local row
(`check`), and `tokenize_row`, the one place a row becomes examples: in memory (`tokenize`, `load_split`), in the
token cache's workers (finetune.data.cache) and in a stream's worker (finetune.rank.stream).

Above the methods, which are built on forms.py and tokenize.py: this module asks a method's record what a row
becomes, so those two never import the methods back.
"""

from __future__ import annotations

from typing import Any

from finetune import methods
from finetune.config import ConfigError, DataConfig
from finetune.data.images import has_images
from finetune.data.sources import Rows, all_sources, local_rows, split_rows
from finetune.data.tokenize import Encoded, Stats, uses_chat_template
from finetune.data.tools import uses_tools


def check(cfg: DataConfig, method: str) -> str | None:
    """Read every local data file and convert every row; raises ConfigError at the first bad one. Returns where the
    first row with tools or tool turns is (its template is then probed: finetune.data.templates.check_tools), or None.

    A local directory is only checked to hold a dataset; its rows, and hub datasets, are checked by
    the ranks (that needs `datasets`). A streamed data.train is only checked to exist: reading it
    whole is what streaming avoids (the ranks name a bad row when the stream reaches it). Each row is
    converted as `method` reads it (its finetune.methods record's `check_row`)."""
    check_row = methods.get(method).check_row
    first_tools = None
    for s in all_sources(cfg):
        rows = local_rows(s, streamed=cfg.streaming and s.key.startswith("data.train"))
        for i, row in enumerate(rows.rows if rows is not None else []):
            _reads_images(row, rows.where(i), method)
            check_row(row, cfg, rows.where(i))
            if first_tools is None and uses_tools(row):
                first_tools = rows.where(i)
    return first_tools


def tokenize_row(row: dict[str, Any], where: str, tokenizer: Any, cfg: DataConfig, method: str, chat: bool) -> Encoded:
    """One row -> its examples no longer than cfg.max_length (see `tokenize`): the method's `encode`."""
    _reads_images(row, where, method)
    return methods.get(method).encode(row, where, tokenizer, cfg, chat)


def _reads_images(row: dict[str, Any], where: str, method: str) -> None:
    """A row with images for a method that does not read them yet (its record's `images`): one line naming the row."""
    why = methods.get(method).images
    if why is not None and has_images(row):
        raise ConfigError(f"{where}: this row has images, and method={method} does not read rows with images yet: {why}")


def tokenize(rows: Rows, tokenizer: Any, cfg: DataConfig, key: str, method: str = "sft") -> tuple[list[Any], Stats]:
    """Rows -> examples (or preference pairs) no longer than cfg.max_length, with truncation counted.

    A pair keeps its prompt whole and cuts each response at the end, so the prompt/response
    boundary (and the prompt both responses share) is never lost."""
    chat = uses_chat_template(tokenizer, cfg.template)
    stats = Stats(rows=len(rows.rows), sources=rows.note)
    out: list[Any] = []
    for i, row in enumerate(rows.rows):
        encoded = tokenize_row(row, rows.where(i), tokenizer, cfg, method, chat)
        stats.count(encoded)
        out += encoded.items
    stats.check(key, rows.source, cfg.max_length, bool(out))
    return out, stats


def load_split(cfg: DataConfig, tokenizer: Any, seed: int, method: str = "sft") -> tuple[list[Any], list[Any], dict[str, Stats]]:
    """The train and eval examples (pairs for DPO), per the data config, with their counts, in memory."""
    train_rows, eval_rows = split_rows(cfg, seed)
    train, train_stats = tokenize(train_rows, tokenizer, cfg, "data.train", method)
    stats = {"train": train_stats}
    evals: list[Any] = []
    if eval_rows is not None:
        evals, stats["eval"] = tokenize(eval_rows, tokenizer, cfg, "data.eval", method)
    return train, evals, stats
