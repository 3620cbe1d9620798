"""A streamed training set (data.streaming=true): data.train read as it is needed, tokenized on the fly by a
DataLoader worker on every rank, and cut into steps as `TrainBatches` cuts a set held whole. No token cache.

The order. One pass over the data is `finetune.data.sources.one_pass`: each source in its own order through a shuffle
buffer of data.shuffle_buffer rows drawn by the seed (a mixture: each next row from a source by weight, seeded);
pass e has its own order, a function of (seed, e), and the passes follow each other without end (epochs). Each row
is tokenized by `tokenize_row`, the in-memory path's own (so its labels are those), into its examples: one, none when
its prompt is dropped, or a text row's pieces. With data.packing, the examples of each run of PACK_WINDOW rows of a
pass are packed together by `pack` (first fit, seeded by the seed and the run's first row). Step k's global batch is
examples [kG, (k+1)G) of that sequence, split over the data-parallel ranks in contiguous blocks as TrainBatches
splits it. Every rank reads and tokenizes the whole stream and keeps its block, so step k sees the same samples on
any layout; the price is that every rank tokenizes every row (in its worker, while the model trains).

Resume. A checkpoint records where the next step starts (`Position`: the first row of the run of rows being
consumed, and how many of its examples were). The resumed stream reads the rows before it without tokenizing them
(the shuffle buffer needs them), tokenizes that one run again, skips the consumed examples and goes on exactly as
the uninterrupted run does.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from finetune.config import ConfigError, DataConfig
from finetune.data.batches import collate
from finetune.data.pack import pack
from finetune.data.sources import first_rows, load_sources, one_pass, parse_row, sources
from finetune.data.examples import tokenize, tokenize_row
from finetune.data.tokenize import Stats, uses_chat_template

BUFFER = 10_000  # data.shuffle_buffer's default
PACK_WINDOW = 1_000  # rows whose examples are packed together (first fit over a thousand samples already fills rows well)
PREFETCH = 2  # steps the worker prepares ahead of the one training
STATE = "data_stream.json"  # in a checkpoint: where the stream's next step starts


@dataclass(frozen=True)
class Position:
    """Where a step starts: the first row of the run being consumed (a row; PACK_WINDOW rows when packing), counted
    from the start of the stream over all passes, and how many of that run's examples were consumed."""

    row: int = 0
    skip: int = 0


@dataclass
class Step:
    """One step, as the worker hands it over: this rank's micro-batches, where the next step starts, the pass the
    step's last example came from, and the counts of the rows before that position's run."""

    step: int
    micro_batches: list[dict[str, torch.Tensor]]
    after: Position
    epoch: int
    stats: Stats


@dataclass
class Failed:
    """A data mistake the worker met (a bad row), for the main process to raise as its one line."""

    message: str


class Streamed:
    """data.train as a stream of examples, from any Position: a pure function of the data, the tokenizer and the seed."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, method: str, seed: int) -> None:
        self.cfg, self.tokenizer, self.method, self.seed = cfg, tokenizer, method, seed
        self.buffer = cfg.shuffle_buffer or BUFFER
        self.window = PACK_WINDOW if cfg.packing else 1

    def examples(self, start: Position, stats: Stats) -> Iterator[tuple[Position, int, Stats, Any]]:
        """(position, pass, the counts before its run, example) of each example from `start` on, without end.
        `stats` counts every row tokenized. Raises ConfigError for a bad row, or a pass that kept no example."""
        chat = uses_chat_template(self.tokenizer, self.cfg.template)
        kept, counts, whole = 0, Stats(), False
        for first, epoch, begins, rows in self._runs(start.row):
            if begins:
                counts.check("data.train", self.cfg.train, self.cfg.max_length, kept > 0 or not whole)  # the pass before
                kept, counts, whole = 0, Stats(), True
            before = replace(stats)
            items: list[Any] = []
            for record in rows:
                encoded = tokenize_row(parse_row(record["row"], record["where"]), record["where"], self.tokenizer, self.cfg,
                                       self.method, chat)
                for tally in (stats, counts):
                    tally.rows += 1
                    tally.count(encoded)
                items += encoded.items
            if self.cfg.packing and items:
                items = pack(items, self.cfg.max_length, [self.seed, first])
            kept += len(items)
            for i, item in enumerate(items):
                if first > start.row or i >= start.skip:
                    yield Position(first, i), epoch, before, item

    def _runs(self, start: int) -> Iterator[tuple[int, int, bool, list[dict[str, str]]]]:
        """(first row, pass, whether it begins its pass, rows) of each run of `window` rows of a pass, from the run
        beginning at row `start` on. The rows before it are read (the shuffle buffer needs them), not tokenized."""
        ds = one_pass(self.cfg, self.seed, self.buffer)
        row = 0
        for epoch in itertools.count():
            ds.set_epoch(epoch)
            rows = iter(ds)
            begins = True
            while run := list(itertools.islice(rows, self.window)):
                if row >= start:
                    yield row, epoch, begins, run
                row, begins = row + len(run), False

    def first(self) -> Any:
        """The stream's first example."""
        return next(self.examples(Position(), Stats()))[3]

    def line(self) -> str:
        """What the run prints for its train set."""
        paths = ", ".join(s.path for s in sources(self.cfg.train, self.cfg.train_split, "data.train"))
        packed = f"; packed per {PACK_WINDOW:,} rows" if self.cfg.packing else ""
        return (f"data train: streamed from {paths} (a shuffle buffer of {self.buffer:,} rows, seed {self.seed}; tokenized on "
                f"the fly by a DataLoader worker on every rank, no token cache{packed})")


def load(cfg: DataConfig, tokenizer: Any, seed: int, method: str) -> tuple[Streamed, list[Any], dict[str, Stats]]:
    """The streamed train set and the eval examples (data.eval, or the first data.eval_size rows of data.train,
    tokenized in memory: an eval set is finite), with the eval counts."""
    rows = load_sources(cfg.eval, cfg.eval_split, "data.eval", seed) if cfg.eval is not None else first_rows(cfg) if cfg.eval_size else None
    if rows is None:
        return Streamed(cfg, tokenizer, method, seed), [], {}
    evals, stats = tokenize(rows, tokenizer, cfg, "data.eval", method)
    return Streamed(cfg, tokenizer, method, seed), evals, {"eval": stats}


class Stream(IterableDataset):
    """The DataLoader worker's dataset: this rank's micro-batches of each step, from `first_step` at `start` on."""

    def __init__(self, streamed: Streamed, *, first_step: int, start: Position, stats: Stats, global_batch: int,
                 micro_batch: int, dp_rank: int, dp_size: int, pad_id: int, pad_to: int | None, flat: bool,
                 pictures: Any = None) -> None:
        self.streamed, self.first_step, self.start, self.stats = streamed, first_step, start, stats
        self.global_batch, self.micro_batch, self.dp_rank, self.dp_size = global_batch, micro_batch, dp_rank, dp_size
        self.pad_id, self.pad_to, self.flat, self.pictures = pad_id, pad_to, flat, pictures

    def __iter__(self) -> Iterator[Step | Failed]:
        per_rank = self.global_batch // self.dp_size
        examples = self.streamed.examples(self.start, replace(self.stats))
        try:
            for step in itertools.count(self.first_step):
                batch = list(itertools.islice(examples, self.global_batch))  # the stream has no end: always whole
                mine = [example for *_, example in batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]]
                last, epoch, before, _ = batch[-1]
                micro = [collate(mine[i : i + self.micro_batch], self.pad_id, self.pad_to, self.flat, self.pictures)
                         for i in range(0, per_rank, self.micro_batch)]
                yield Step(step, micro, Position(last.row, last.skip + 1), epoch, before)
        except ConfigError as e:  # raised in the main process with its own message (a worker's exception would carry a traceback)
            yield Failed(str(e))


def _as_is(item: Any) -> Any:
    return item


class StreamBatches:
    """Step -> this rank's micro-batches of a streamed set, served in step order by one DataLoader worker that reads
    and tokenizes PREFETCH steps ahead while the model trains. One worker: more would each read a share of the
    sources and interleave them, in an order that would depend on their number."""

    def __init__(self, streamed: Streamed, *, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, pad_id: int,
                 pad_to: int | None = None, flat: bool = False, resume_from: Path | None = None, pictures: Any = None) -> None:
        state = read_state(resume_from) if resume_from is not None else {"step": 0, "row": 0, "skip": 0, "epoch": 0, "stats": {}}
        self.step, self.epoch_now = state["step"], state["epoch"]
        self.position, self.stats = Position(state["row"], state["skip"]), Stats(**state["stats"])
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the worker is forked after the tokenizer ran here: no threads in it
        dataset = Stream(streamed, first_step=self.step, start=self.position, stats=self.stats, global_batch=global_batch,
                         micro_batch=micro_batch, dp_rank=dp_rank, dp_size=dp_size, pad_id=pad_id, pad_to=pad_to, flat=flat,
                         pictures=pictures)
        loader = DataLoader(dataset, batch_size=None, num_workers=1, prefetch_factor=PREFETCH, collate_fn=_as_is,
                            generator=torch.Generator())  # the workers' seed is drawn from it, not from training's random stream
        self._steps = iter(loader)

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        if step != self.step:
            raise RuntimeError(f"a stream is read in step order: step {step} was asked for, step {self.step} is next")
        item = next(self._steps)
        if isinstance(item, Failed):
            raise ConfigError(item.message)
        self.step, self.position, self.epoch_now, self.stats = step + 1, item.after, item.epoch, item.stats
        return item.micro_batches

    def epoch(self, step: int) -> float:
        """The pass (0, 1, ...) the last example of the step served last came from: a stream's length is not known ahead."""
        return float(self.epoch_now)

    def save(self, directory: Path) -> None:
        """Record in a checkpoint where the next step starts."""
        state = {"step": self.step, "row": self.position.row, "skip": self.position.skip, "epoch": self.epoch_now,
                 "stats": asdict(self.stats)}
        (directory / STATE).write_text(json.dumps(state, indent=1) + "\n")

    def close(self) -> None:
        """Stop the worker (the DataLoader's iterator stops it when it is let go)."""
        self._steps = iter(())


def read_state(step_dir: Path) -> dict[str, Any]:
    path = step_dir / STATE
    if not path.is_file():
        raise ConfigError(f"train.resume: {step_dir} has no {STATE} (where the stream stood): resume a checkpoint saved with "
                          "data.streaming=true, or start a fresh run")
    return json.loads(path.read_text())
