"""Examples -> batches: step -> this rank's micro-batches for training, and evaluation's shards and batches.

The batch order is a pure function of (seed, step): step k uses the same global batch of samples on any
number of ranks, so runs with different layouts (and a resumed run) see the same data. (A stream keeps
this with its own order: finetune.rank.stream.)
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from finetune.data.images import APART, IN_BATCH, SHOWN, Shown
from finetune.data.tokenize import IGNORE, Example

if TYPE_CHECKING:
    import torch


SAMPLES = "sample_index"
"""A padding-free batch of items' rows: [1, T], the index of the sample each token belongs to (0 .. rows - 1)."""


def collate(examples: list[Any], pad_id: int, width: int | None = None, flat: bool = False,
            pictures: Any = None, blank: bool = True) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding carries no loss. `flat`: the examples end to end in one row
    instead (padding-free, `flat_row`).

    Items (finetune.methods.base.Item: preference pairs) become row k of every example,
    k = 0, 1, ... (2B rows: the B chosen, then the B rejected), and the values they carry (precomputed
    reference log-probs as `reference_logps`) float64 tensors in the same order.

    Plain rows get an attention mask. Packed rows get position ids instead, restarting at 0 for
    every sample (and for the padding tail): transformers then attends only within each sample
    (a block-diagonal causal mask with sdpa/eager, varlen kernels with flash-attn).
    `real_tokens` counts the non-pad tokens of each row. `width` pads to a fixed length
    (pipeline parallel: every micro-batch has one shape). Rows with images (a vision-language model's) get the model's
    image inputs from its processor (`pictures`: finetune.data.images.Pictures.batch).
    """
    import torch  # here, not at the top: the planner reads lengths through this module without torch

    if not isinstance(examples[0], Example):  # an Item (finetune.methods.base): its rows and the values they carry
        rows, n = range(len(examples[0].rows)), len(examples)
        ordered = [e.rows[k] for k in rows for e in examples]
        if flat:
            return valued(flat_samples(ordered), examples, rows)
        batch = collate(ordered, pad_id, width, pictures=pictures, blank=False)
        shown = [[list(e.rows[k].images) for e in examples] for k in rows]  # each row group's images
        empty = [k for k in rows if not any(shown[k])]
        if pictures is not None and pictures.everywhere and empty:  # every group's forward runs the vision tower: the
            batch = pictures.with_blanks(batch, [(k + 1) * n - 1 for k in empty], pad_id, IGNORE)  # empty ones' on a blank
            for k in empty:
                shown[k][-1] = [pictures.blank]
            batch |= {IN_BATCH + name: v for name, v in pictures.batch([im for group in shown for im in group], batch["input_ids"]).items()}
        if len(rows) > 1 and any(k.startswith(IN_BATCH) for k in batch):  # each row group's own image inputs, for a method
            for k in rows:                                                    # that forwards them apart (images.apart)
                ids = batch["input_ids"][k * n : (k + 1) * n]
                batch |= {f"{APART}{k}.{name}": v for name, v in pictures.batch(shown[k], ids).items()}
        return valued(batch, examples, rows)
    if flat:
        return with_images(flat_row(examples), [[im for e in examples for im in e.images]], pictures, pad_id, blank)
    width = width or max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    real = torch.tensor([len(e.input_ids) for e in examples])
    for row, e in enumerate(examples):
        ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[row, : len(e.input_ids)] = torch.tensor(e.labels)
    batch = {"input_ids": ids, "labels": labels, "real_tokens": real}
    if examples[0].position_ids is None:
        batch["attention_mask"] = (torch.arange(width)[None, :] < real[:, None]).long()
    else:
        pos = torch.zeros((len(examples), width), dtype=torch.long)
        for row, e in enumerate(examples):
            n = len(e.input_ids)
            pos[row, :n] = torch.tensor(e.position_ids)
            pos[row, n:] = torch.arange(width - n)  # the padding tail is a separate "sample"
        batch["position_ids"] = pos
        labels[starts(pos)] = IGNORE  # a sample's first token is predicted by the sample before's last: no loss
    return with_images(batch, [list(e.images) for e in examples], pictures, pad_id, blank)


def valued(batch: dict[str, Any], items: list[Any], rows: range) -> dict[str, Any]:
    """`batch` with the values items carry (a precomputed reference's log-probs), float64, in the rows' order."""
    import torch

    values = [e.values() for e in items]
    for name in values[0]:
        batch[name] = torch.tensor([v[name][k] for k in rows for v in values], dtype=torch.float64)
    return batch


def flat_samples(rows: list[Example]) -> dict[str, torch.Tensor]:
    """Padding-free rows of items (a preference pair's chosen and rejected): `rows` end to end in one row, as
    `flat_row` lays SFT's, and SAMPLES saying which of them each token is, so a method sums per sample what it
    sums per row in a padded batch (finetune.methods.losses.row_sums)."""
    if any(e.images for e in rows):
        raise ValueError("padding-free rows of pairs with images are not built: set data.padding_free=false")
    batch = flat_row(rows)
    batch[SAMPLES] = starts(batch["position_ids"]).long().cumsum(-1) - 1
    return batch


def on_grid(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token values of a batch's rows, each predicting the next token ([rows, tokens - 1]), laid out as the padded
    batch's: a padding-free batch's (`flat_samples`) [1, T - 1] becomes [samples, longest - 1], sample i's values in
    row i from its own first token on, 0 past its end (what padding holds); a padded batch's stay as they are. An
    online method's rollout reads its per-token log-probs so (finetune.methods.online). Differentiable."""
    if SAMPLES not in batch:
        return values
    samples, positions = batch[SAMPLES][0, 1:].to(values.device), batch["position_ids"][0, 1:].to(values.device)
    inside = positions > 0  # a sample's first token is predicted by nothing of its own
    grid = values.new_zeros(int(batch[SAMPLES][0, -1]) + 1, int(batch["position_ids"].max()))
    return grid.index_put((samples[inside], positions[inside] - 1), values[0, inside])


def with_images(batch: dict[str, Any], images: list[list[Any]], pictures: Any, pad_id: int, blank: bool) -> dict[str, Any]:
    """A micro-batch of rows with the model's image inputs for each row's `images` (in the order its tokens show them),
    and the images themselves (`SHOWN`); a batch without any, under a layout whose ranks run the vision tower together
    (`blank`), runs it on a blank image."""
    if any(images):
        if pictures is None:
            raise ValueError("a batch with images needs the model's processor (finetune.data.images.Pictures)")
        batch |= {IN_BATCH + k: v for k, v in pictures.batch(images, batch["input_ids"]).items()}
        batch[SHOWN] = Shown(images)
    elif pictures is not None and pictures.everywhere and blank:
        batch = pictures.with_blank(batch, pad_id, IGNORE)
    return batch


def flat_row(examples: list[Example]) -> dict[str, torch.Tensor]:
    """Padding-free: the examples end to end in one row, no padding, each attending only to itself (its positions
    restart at 0, as in a packed row) and its first token predicted by nothing (as in a row of its own): the same
    loss as the padded micro-batch, without computing on padding."""
    import torch

    ids = torch.tensor([t for e in examples for t in e.input_ids])[None]
    labels = torch.tensor([t for e in examples for t in e.labels])[None]
    pos = torch.tensor([p for e in examples for p in (e.position_ids or range(len(e.input_ids)))])[None]
    labels[starts(pos)] = IGNORE
    return {"input_ids": ids, "labels": labels, "real_tokens": torch.tensor([ids.shape[1]]), "position_ids": pos}


def starts(positions: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: where a sample begins (a position that does not follow the one before: transformers' reading
    of packed rows, and finetune.rank.varlen's)."""
    import torch

    first = torch.ones_like(positions, dtype=torch.bool)
    first[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return first


def samples(batch: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """(row, start, end) of each sample in a collated batch, in row order: a padded row's tokens (its attention mask), or
    the samples laid in a row end to end (packed, padding-free: position ids and no mask; a packed row's padding tail
    is one too, without labels)."""
    if "attention_mask" in batch or "position_ids" not in batch:
        mask = batch.get("attention_mask")
        return [(r, 0, int(mask[r].sum()) if mask is not None else batch["input_ids"].shape[1]) for r in range(batch["input_ids"].shape[0])]
    out = []
    for r, first in enumerate(starts(batch["position_ids"]).tolist()):
        bounds = [i for i, s in enumerate(first) if s]
        out += [(r, a, b) for a, b in zip(bounds, [*bounds[1:], len(first)])]
    return out


class TrainBatches:
    """Step -> this rank's micro-batches. Pure in (seed, step): any layout sees the same samples.

    The global batch of step k is positions [k*G, (k+1)*G) of an endless stream made of one
    seeded permutation of the dataset per epoch. It is split into contiguous blocks, one per
    data-parallel rank, and each block into micro-batches. So epoch e is positions [e*N, (e+1)*N):
    every example exactly once; a step that straddles the boundary ends one epoch and starts the next.
    """

    pure = True  # a step's micro-batches depend on the step alone: the loop makes the next step's ahead (loop.Ahead)

    def __init__(
        self, examples: list[Example], *, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int, pad_id: int,
        pad_to: int | None = None, flat: bool = False, pictures: Any = None,
    ) -> None:
        self.examples, self.global_batch, self.micro_batch = examples, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed, self.pad_id, self.pad_to = dp_rank, dp_size, seed, pad_id, pad_to
        self.flat = flat  # padding-free: each micro-batch one row of its samples end to end (flat_row)
        self.pictures = pictures  # a vision-language model's processor: its rows' images become pixel inputs in collate
        self._perm: dict[int, np.ndarray] = {}

    def indices(self, step: int) -> list[int]:
        """Dataset indices of this rank's share of the global batch of `step` (0-based)."""
        n, per_rank = len(self.examples), self.global_batch // self.dp_size
        start = step * self.global_batch + self.dp_rank * per_rank
        return [int(self._permutation(p // n)[p % n]) for p in range(start, start + per_rank)]

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm:
            self._perm = {e: p for e, p in self._perm.items() if e == epoch - 1}  # a step spans <= 2 epochs
            self._perm[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
        return self._perm[epoch]

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        return self._collated(self.indices(step))

    def refill(self, step: int, round: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of a global batch of prompts drawn anew for `step` (0-based), its refill `round`
        (1, 2, ...: an online method's dynamic sampling): drawn at random from the whole dataset (without replacement
        where it is large enough), a function of (seed, step, round) and so the same after a restart."""
        n, per_rank = len(self.examples), self.global_batch // self.dp_size
        drawn = np.random.default_rng([self.seed, step, round, 1]).choice(n, size=self.global_batch, replace=self.global_batch > n)
        return self._collated([int(i) for i in drawn[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]])

    def _collated(self, idx: list[int]) -> list[dict[str, torch.Tensor]]:
        chunks = [idx[i : i + self.micro_batch] for i in range(0, len(idx), self.micro_batch)]
        return [collate([self.examples[i] for i in chunk], self.pad_id, self.pad_to, self.flat, self.pictures) for chunk in chunks]

    def epoch(self, step: int) -> float:
        return step * self.global_batch / len(self.examples)


def epoch_steps(epochs: float, examples: int, global_batch: int) -> int:
    """The optimizer steps of `epochs` passes over `examples` (train.epochs): ceil(epochs x examples / global_batch),
    with epochs read as the decimal it was written as (1.1 x 100 / 10 is 11 steps, not 12)."""
    return math.ceil(Fraction(str(epochs)) * examples / global_batch)


def shard(items: list[Any], rank: int, world: int) -> list[Any]:
    """This rank's contiguous share of an evaluation list (sizes differ by at most one)."""
    per, extra = divmod(len(items), world)
    start = rank * per + min(rank, extra)
    return items[start : start + per + (rank < extra)]


def for_generation(examples: list[Any]) -> list[Example]:
    """What exact match generates from: the example, or an item's target (a pair's chosen response; KTO's desirable
    rows only); text rows have no prompt."""
    targets = (e if isinstance(e, Example) else e.target for e in examples)
    return [e for e in targets if e is not None and e.prompt_len > 0]  # not text rows


def left_padded(prompts: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompts padded on the left, with their attention mask: every row ends where generation starts."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def eval_batches(examples: list[Any], batch_size: int, pad_id: int, pictures: Any = None) -> Iterator[dict[str, torch.Tensor]]:
    for i in range(0, len(examples), batch_size):
        yield collate(examples[i : i + batch_size], pad_id, pictures=pictures)
