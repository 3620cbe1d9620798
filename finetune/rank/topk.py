"""method.teacher_topk: the teacher's top-k log-probs of every response token, computed once before training and kept.

Before the first step the teacher (loaded and placed as finetune.rank.teacher does) scores every train and eval sample
once, each rank its share, through its hidden states and output layer a chunk of positions at a time: for each response
token the K most probable next tokens at `method.temperature`, their log-probs and the log-prob of all the others
together (the tail bucket: finetune.methods.distill.buckets). Then it is freed: training holds no teacher.

The table is written beside the token cache (data.cache_dir: `teacher_topk/KEY.pt`), KEY a hash of the teacher's files
(their names, sizes and modification times; a hub id's name), K, the temperature, the vocabulary and the samples' tokens:
a later run on the same data with the same teacher (a sweep of the student's settings, another epoch count) reads it
and loads no teacher at all.

A batch finds its rows by content: each sample's tokens (a padded row, or one of the samples laid end to end in a row)
key its entry, so padding-free micro-batches and packed rows read the same table. A sample the table lacks is an error
naming what changed, never a silent zero.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from finetune.config import Config
from finetune.data import cache
from finetune.data.batches import collate, samples, shard
from finetune.data.tokenize import IGNORE
from finetune import methods
from finetune.methods.base import TeacherModel
from finetune.methods.distill import table_settings, top_k
from finetune.rank.dist import Dist
from finetune.rank.engine.base import Engine
from finetune.rank.heldout import lockstep_extra

FOLDER = "teacher_topk"


class TopK:
    """The table: for each sample (keyed by its tokens) its response tokens' top-k ids [n, K] and log-probs [n, K + 1]."""

    def __init__(self, index: dict[int, tuple[int, int]], ids: torch.Tensor, logps: torch.Tensor, vocab: int) -> None:
        self.index, self.ids, self.logps, self.vocab = index, ids, logps, vocab

    def lookup(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's response tokens' (ids [N, K] int64, log-probs [N, K + 1]) in row order, as the loss selects them."""
        tokens, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
        parts = []
        for r, a, b in samples(batch):
            n = sum(1 for t in labels[r][a + 1 : b] if t != IGNORE)  # a sample's first token predicts nothing of its own
            if n == 0:
                continue
            where = self.index.get(key(tokens[r][a:b]))
            if where is None or where[1] != n:
                raise RuntimeError(f"method.teacher_topk: a sample of {b - a} tokens is not in the teacher's table (the data, its "
                                   "tokenization or data.max_length changed since it was computed?)")
            parts.append(where)
        ids = torch.cat([self.ids[o : o + n] for o, n in parts]).long() if parts else self.ids[:0].long()
        return ids, torch.cat([self.logps[o : o + n] for o, n in parts]) if parts else self.logps[:0]


def key(tokens: list[int]) -> int:
    return hash(tuple(tokens))


def identity(found: Any) -> list[Any]:
    """What names a teacher's weights: for a local model (and an adapter's base) each file's name, size and modification
    time; a hub id's name."""
    out: list[Any] = []
    for where in (found.model, found.base):
        path = Path(where) if where else None
        if path is None or not path.is_dir():
            out.append(where)
            continue
        out += [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.iterdir()) if f.is_file()]
    return out


def table_path(cfg: Config, found: Any, splits: dict[str, list[Any]], vocab: int) -> Path:
    from finetune.rank.reference import fingerprint

    inputs = {"teacher": identity(found), **table_settings(cfg.method), "vocab": vocab,
              "data": {name: fingerprint(rows) for name, rows in splits.items()}}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache.root(cfg.data) / FOLDER / f"{digest}.pt"


def prepare(cfg: Config, *, engine: Engine, dist: Dist, splits: dict[str, list[Any]], tokenizer: Any, attention: str) -> TopK:
    """The table for this run's data: read where a run with the same teacher and data wrote it, else computed here by
    the teacher (loaded, placed, then freed) and written."""
    from finetune.rank import teacher as teachers
    from finetune.rank.finished import locate

    spec = methods.get(cfg.method.name).teacher(cfg.method)
    assert isinstance(spec, TeacherModel) and spec.topk, "method.teacher_topk"
    found = locate(spec.where)
    path = table_path(cfg, found, splits, len(tokenizer))
    tic = time.perf_counter()
    if path.is_file():
        state = torch.load(path, weights_only=True, mmap=True)
        said = f"read from {path}"
    else:
        teacher = teachers.load(cfg, engine=engine, tokenizer=tokenizer, attention=attention)
        state = compute(teacher, [row for rows in splits.values() for row in rows], cfg, engine=engine, dist=dist, pad_id=tokenizer.pad_token_id)
        del teacher
        if dist.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
        said = f"computed in {time.perf_counter() - tic:.1f} s, saved to {path}"
    index = {k: (o, n) for k, o, n in state["index"].tolist()}
    if dist.is_main:
        print(f"teacher top-{spec.topk}: {state['ids'].shape[0]:,} response tokens of {len(index):,} samples {said}")
    return TopK(index, state["ids"], state["logps"], len(tokenizer))


@torch.no_grad()
def compute(teacher: Any, rows: list[Any], cfg: Config, *, engine: Engine, dist: Dist, pad_id: int) -> dict[str, torch.Tensor]:
    """Every sample's top-k rows, each rank scoring its share of `rows` (batches of train.eval_batch_size, chunks of
    logits.chunk_tokens positions), gathered on every rank."""
    size, chunk = cfg.train.eval_batch_size, cfg.logits.chunk_tokens
    mine = shard(list(range(len(rows))), engine.dp_rank, engine.dp_size)
    keys, counts, ids, logps = [], [], [], []
    for i in range(0, len(mine), size):
        batch = collate([rows[j] for j in mine[i : i + size]], pad_id)
        hidden = engine.inference(lambda _, b: teacher.hidden(b), batch)
        for s in range(0, len(hidden), chunk):
            top, kept = top_k(teacher.head_logits(hidden[s : s + chunk])[..., : teacher.vocab], cfg.method)
            ids.append(top.cpu())
            logps.append(kept.cpu())
        tokens, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
        for r, a, b in samples(batch):
            n = sum(1 for t in labels[r][a + 1 : b] if t != IGNORE)
            if n:
                keys.append(key(tokens[r][a:b]))
                counts.append(n)
    for _ in range(lockstep_extra(engine, len(rows), size)):  # ZeRO-3/FSDP: as many forwards as the other ranks
        engine.inference(lambda _, b: teacher.hidden(b), collate([rows[0]], pad_id))
    empty = top_k(torch.zeros(0, teacher.vocab), cfg.method)
    parts = dist.gather((keys, counts, torch.cat(ids) if ids else empty[0], torch.cat(logps) if logps else empty[1]))
    index, offset = [], 0
    for part_keys, part_counts, _, _ in parts:
        for kk, n in zip(part_keys, part_counts):
            index.append((kk, offset, n))
            offset += n
    return {"index": torch.tensor(index, dtype=torch.int64).view(-1, 3), "ids": torch.cat([p[2] for p in parts]),
            "logps": torch.cat([p[3] for p in parts])}
