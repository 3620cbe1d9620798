"""The reference log-probs a method's loss compares with (DPO's), three ways (`method.reference`); whether a
method needs them, and which way, is its record's `reference` (finetune.methods):

- precomputed (default): before the first step the initial policy scores every row of every train and
  eval example (a pair's two) once (no gradients, sharded over ranks, in the compute precision, through
  the engine, so it works wherever training works). The values travel with the samples: no reference model is
  in memory while training. They are saved to RUN_DIR/reference_logps.pt, which a run resumed
  from one of RUN_DIR's checkpoints reads back (its initial policy is gone by then).
- live: a frozen copy of the initial model, placed by the engine like the policy (under ZeRO-3
  sharded like it); one extra no-grad forward per micro-batch.
- adapter_disabled: the policy itself with its PEFT adapter switched off, which is exactly the
  base model: no copy at all.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Callable

import torch

from finetune import methods
from finetune.config import Config, ConfigError, Reference
from finetune.data.batches import SAMPLES, collate, shard
from finetune.data.rows import padding_free
from finetune.data.tokenize import rows_of
from finetune.rank.engine.base import Engine
from finetune.rank.dist import Dist
from finetune.rank.heldout import lockstep_extra
from finetune.rank.neftune import silenced
from finetune.methods.losses import logits_logps, sequence_logps, token_logps

FILE = "reference_logps.pt"


def setup(cfg: Config, *, engine: Engine, dist: Dist, splits: dict[str, list[Any]], run_dir: Path, resume_from: Path | None,
          load_model: Callable[[], torch.nn.Module], pad_id: int, pictures: Any = None) -> Callable[[Any, dict[str, torch.Tensor]], torch.Tensor] | None:
    """Prepare the reference for `cfg.method`; returns what its objective calls for reference
    log-probs during training (None: they are in the batches, or the loss needs none)."""
    method = methods.get(cfg.method.name)
    how = method.reference(cfg.method)
    if how is None:
        return None
    if how == Reference.precomputed:
        saved = resume_from.parent.parent / FILE if resume_from is not None else None  # RUN_DIR/checkpoints/step_N
        precompute(engine, splits, dist=dist, path=run_dir / FILE, saved=saved, batch_size=cfg.train.eval_batch_size, pad_id=pad_id,
                   method=method, pictures=pictures, flat=padding_free(cfg)[0])
        return None
    if how == Reference.live:
        with torch.random.fork_rng(devices=[]):  # loading re-seeds; training's random stream (dropout) stays as it was
            reference = engine.frozen(load_model())
        return lambda policy, batch, per_token=False: scores(reference, batch, per_token)
    return adapter_disabled


def scores(model: Any, batch: dict[str, torch.Tensor], per_token: bool) -> torch.Tensor:
    """Each row's summed label log-prob, or with `per_token` each labelled token's (GRPO's per-token KL)."""
    return token_logps(model, batch) if per_token else sequence_logps(model, batch)[0]


def adapter_disabled(policy: Any, batch: dict[str, torch.Tensor], per_token: bool = False) -> torch.Tensor:
    """Log-probs of the policy's base model: its PEFT adapter switched off for this forward."""
    model = policy
    while not hasattr(model, "disable_adapter"):  # DDP / DeepSpeed wrap the PEFT model in `.module`
        model = model.module
    with model.disable_adapter(), silenced(model):  # the base as it was: no NEFTune noise either
        return scores(model, batch, per_token)


def precompute(engine: Engine, splits: dict[str, list[Any]], *, dist: Dist, path: Path, saved: Path | None, batch_size: int,
               pad_id: int, method: methods.Method, pictures: Any = None, flat: bool = False) -> None:
    """Attach reference log-probs to every example (one per row: a pair's chosen and rejected) and write them
    to `path`: computed now from the initial policy, or, when resuming, read from `saved` (refused if the data
    changed). `flat`: the train split's batches with their rows end to end, as the padding-free training batches lay
    them; the eval split's stay padded, as evaluation's batches are (the same batches: a policy still equal to its
    reference scores each pair's margin exactly 0 there, not float noise)."""
    prints = {name: fingerprint(pairs) for name, pairs in splits.items()}
    unit, rows = method.unit, method.rows_per_example
    tic = time.perf_counter()
    if saved is not None:
        if not saved.is_file():
            raise ConfigError(f"train.resume: {saved} is missing: the precomputed reference log-probs came from the initial model, "
                              f"which a resumed run no longer has; resume from a checkpoint of a {method.name.upper()} run, or start afresh")
        state = torch.load(saved, weights_only=True)
        changed = [name for name in splits if state["fingerprint"].get(name) != prints[name]]
        if changed:
            raise ConfigError(f"train.resume: the {' and '.join(changed)} {unit}s differ from those whose reference log-probs are in "
                              f"{saved} (data or tokenizer changed since that run started); resume with the same data")
        values = state["values"]
    else:
        values = {name: score(engine, pairs, dist=dist, batch_size=batch_size, pad_id=pad_id, rows=rows, pictures=pictures,
                              flat=flat and name == "train") for name, pairs in splits.items()}
    if dist.is_main and path != saved:
        torch.save({"fingerprint": prints, "values": values}, path)
    for name, pairs in splits.items():
        for pair, logps in zip(pairs, values[name].tolist()):
            pair.reference = tuple(logps)
    if dist.is_main:
        what = " + ".join(f"{len(p)} {name}" for name, p in splits.items() if p)
        how = f"read from {saved}" if saved is not None else f"computed in {time.perf_counter() - tic:.1f}s, saved to {path}"
        print(f"reference: log-probs of {what} {unit}s {how}")


@torch.no_grad()
def score(engine: Engine, pairs: list[Any], *, dist: Dist, batch_size: int, pad_id: int, rows: int = 2,
          pictures: Any = None, flat: bool = False) -> torch.Tensor:
    """[N, rows] log-probs of each example's rows (a pair: chosen, rejected) by the model as it is now; each rank
    scores its share (`flat`: each batch's rows end to end, padding-free)."""
    out = torch.zeros(len(pairs), rows, dtype=torch.float64)
    if not pairs:
        return out
    mine = shard(list(range(len(pairs))), engine.dp_rank, engine.dp_size)
    for i in range(0, len(mine), batch_size):
        idx = mine[i : i + batch_size]
        logps = engine.inference(LOGPS, collate([pairs[j] for j in idx], pad_id, flat=flat, pictures=pictures))
        if engine.owner:  # tp/pp: one rank per model replica contributes
            out[idx] = logps.double().cpu().view(rows, -1).T  # collate: row k of every example, k = 0, 1, ...
    for _ in range(lockstep_extra(engine, len(pairs), batch_size)):  # ZeRO-3/FSDP: as many forwards as the other ranks
        engine.inference(LOGPS, collate(pairs[:1], pad_id, flat=flat, pictures=pictures))
    return dist.sum_tensor(out)


class _Logps:
    """Summed response log-probs per row: called with a model, or (pipeline) with its logits."""

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return sequence_logps(model, batch)[0]

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return logits_logps(logits, batch["labels"], batch.get(SAMPLES))[0]

    def rows_loss(self, logps: torch.Tensor, _batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return logps  # logits=chunked: what the last stage returns already


LOGPS = _Logps()


def fingerprint(pairs: list[Any]) -> str:
    h = hashlib.sha256()
    for p in pairs:
        h.update(repr(tuple(tokens for row in rows_of(p) for tokens in (row.input_ids, row.labels))).encode())
        h.update(repr([row.images for row in rows_of(p) if row.images]).encode())  # a vision-language model's images
    return h.hexdigest()
