"""Context parallel (`parallelism.cp=N`): each sequence's tokens split over N ranks, DeepSpeed-Ulysses style.

Every rank of a context-parallel group gets the same micro-batch and keeps 1/N of its tokens: a
contiguous slice of every row (`ContextParallel.split`). Embeddings, norms, the MLPs and the loss run
on the slice alone, so their activations are 1/N of the sequence's. Only attention needs every token:
there, an all-to-all turns the slice's queries, keys and values for all heads into the whole
sequence's for 1/N of the heads, the family's own attention kernel runs on those (sdpa,
FlashAttention, or its eager function with soft-capping), and a second all-to-all turns the output
back into the slice's tokens for all heads. Communication is 4 all-to-alls per block each way, the
size of q, k, v and the output; no rank ever holds the whole sequence's activations.

Why Ulysses and not ring attention (`torch.distributed.tensor.experimental.context_parallel`): torch's
ring attention replaces only the CUDA sdpa kernels (flash, efficient, cuDNN), so nothing of it runs on
a CPU, and it cannot take a per-sample mask (packed rows). Ulysses is two collectives around any
attention kernel, on any device and backend (gloo's all-to-all included); its limit is that N must
divide the query and key/value heads of a rank.

Masks: the model builds its mask for the slice, which is wrong for the whole sequence, so under
context parallel the model's attention implementation is ours (registered with transformers'
AttentionInterface; it gets no mask) and the mask is made here for the whole sequence from its
position ids: causal, per packed sample (a new sample where the position does not follow the one
before, as transformers reads packed rows), and the layer's sliding window. sdpa gets none when plain
causal will do (unpacked rows, no window: O(1) memory); FlashAttention gets the whole sequence's
position ids (its varlen path for packed rows, its own window). Rows are right-padded, so causal
attention alone keeps every real token from seeing padding.

Labels: position t predicts label t+1, and the last position of a slice predicts the first label of
the next one, so a slice's labels are one longer than its tokens (the objectives read
`labels[:, 1:]` against the positions they have). Each rank's loss is a sum over its slice; the
engine adds the slices' gradients like data parallel's.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from finetune.config import ConfigError
from finetune.data.batches import starts
from finetune.data.tokenize import IGNORE

NAME = "finetune_context_parallel"
"""The attention implementation a model runs under while its batch is split (AttentionInterface key)."""


class ContextParallel:
    """One model's context-parallel attention over a process group of `size` ranks (this one is `rank`)."""

    def __init__(self, model: nn.Module, group: Any, rank: int, size: int) -> None:
        from transformers import AttentionInterface

        self.config = _causal_lm(model).config
        self.group, self.rank, self.size = group, rank, size
        self.inner = self.config._attn_implementation  # what the model runs when its batch is not split
        self.eager = None
        if self.inner == "eager":  # the family's own eager function (Gemma-2's soft-capping), from its modeling module
            self.eager = family_eager(model)
            if self.eager is None:
                raise ConfigError(f"parallelism.cp: {self.config.model_type}'s eager attention is not a function transformers "
                                  "names (eager_attention_forward), so it cannot run on the whole sequence's heads: use "
                                  "model.attn_implementation=sdpa")
        AttentionInterface.register(NAME, self.attention)
        self.positions: torch.Tensor | None = None
        self.masks: dict[int | None, torch.Tensor | None] = {}

    # -- the batch ----------------------------------------------------------------------------

    def split(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of a micro-batch (split_batch); the whole rows' position ids are kept for the masks."""
        part, self.positions = split_batch(batch, self.rank, self.size)
        self.masks = {}
        return part

    @contextlib.contextmanager
    def split_attention(self) -> Iterator[None]:
        """Within (forward and backward, recomputation included): the model attends over the whole sequence."""
        self.config._attn_implementation = NAME
        try:
            yield
        finally:
            self.config._attn_implementation = self.inner

    # -- attention --------------------------------------------------------------------------

    def attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """transformers' attention interface: q [B, H, S/N, D], k/v [B, K, S/N, D] -> output [B, S/N, H, D]."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        q, k, v = (self._heads(t) for t in (query, key, value))  # [B, H/N, S, D]: the whole sequence, a share of the heads
        window = kwargs.get("sliding_window")
        if self.inner.startswith("flash"):
            kwargs["position_ids"], mask = self.positions, None
        else:
            kwargs.pop("position_ids", None)
            mask = self.mask(window, q.dtype)
        kernel = self.eager if self.eager is not None else ALL_ATTENTION_FUNCTIONS[self.inner]
        out, _ = kernel(module, q, k, v, mask, **kwargs)  # [B, S, H/N, D]
        return self._tokens(out), None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, S/N, D] (this rank's tokens, every head) -> [B, H/N, S, D] (every token, this rank's heads)."""
        b, h, s, d = x.shape
        sent = x.view(b, self.size, h // self.size, s, d).transpose(0, 1).contiguous()  # head group j -> rank j
        got = _all_to_all(sent, self.group)  # [N, B, H/N, S/N, D]: chunk i holds rank i's tokens
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // self.size, self.size * s, d)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, H/N, D] -> [B, S/N, H, D]: the inverse of _heads, on the attention output's layout."""
        b, s, h, d = x.shape
        sent = x.view(b, self.size, s // self.size, h, d).transpose(0, 1).contiguous()  # token slice i -> rank i
        got = _all_to_all(sent, self.group)  # [N, B, S/N, H/N, D]: chunk j holds rank j's heads
        return got.permute(1, 2, 0, 3, 4).reshape(b, s // self.size, self.size * h, d)

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The whole sequence's mask for a layer with this sliding window (whole_mask), made once per micro-batch."""
        if window not in self.masks:
            assert self.positions is not None, "ContextParallel.split sets the positions before the forward"
            self.masks[window] = whole_mask(self.positions, window, dtype if self.eager is not None else None)
        return self.masks[window]


def split_batch(batch: dict[str, torch.Tensor], rank: int, size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rank `rank` of `size`'s slice of a micro-batch, and the whole rows' position ids. The rows are padded to a
    multiple of `size` (padding after every real token carries no label, and causal attention never lets a real
    token see it); the slice holds input ids and position ids [B, S/size], and labels [B, S/size + 1]: its last
    position predicts the first label of the next slice (objectives.predicting)."""
    ids = batch["input_ids"]
    rows, width = ids.shape
    per = -(-width // size)
    pad = per * size - width
    positions = batch.get("position_ids")
    if positions is None:  # plain right-padded rows
        positions = torch.arange(width, device=ids.device).expand(rows, width)
    if pad:
        ids = F.pad(ids, (0, pad))
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=ids.device)], dim=1)
    labels = F.pad(batch["labels"], (0, pad + 1), value=IGNORE)  # the last position predicts nothing
    start = rank * per
    part = {"input_ids": ids[:, start:start + per], "position_ids": positions[:, start:start + per],
            "labels": labels[:, start:start + per + 1]}
    return part, positions


def whole_mask(positions: torch.Tensor, window: int | None, additive: torch.dtype | None,
               packed: bool | None = None) -> torch.Tensor | None:
    """The attention mask of whole rows [B or 1, 1, S, S] from their position ids: causal, within each packed sample
    (one begins where a position does not follow the one before: transformers' reading of packed rows), and within
    the layer's sliding window (a query sees keys fewer than `window` tokens back). Boolean (True: attend) for
    sdpa, which gets None where its own causal mask is all of it; with `additive` a dtype, the eager
    function's additive mask (0 or the dtype's minimum), which it always needs (it applies no causality itself).
    `packed`: whether the rows hold several samples, where the caller knows (None: read from the positions)."""
    width = positions.shape[1]
    first = starts(positions)
    packed = bool(first[:, 1:].any()) if packed is None else packed  # known to the caller: nothing read back
    windowed = window is not None and window < width
    if additive is None and not packed and not windowed:
        return None
    index = torch.arange(width, device=positions.device)
    allowed = (index[:, None] >= index[None, :])[None]  # [1, S, S]
    if packed:
        sample = first.cumsum(-1)
        allowed = allowed & (sample[:, :, None] == sample[:, None, :])
    if windowed:
        allowed = allowed & (index[:, None] - index[None, :] < window)[None]
    allowed = allowed[:, None]
    if additive is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=additive, device=positions.device).masked_fill(~allowed, torch.finfo(additive).min)


def family_eager(model: nn.Module) -> Any:
    """The family's own eager attention function (Gemma-2's soft-capping), from its modeling module; None if
    it names none (eager_attention_forward)."""
    return next((f for m in model.modules() for cls in type(m).__mro__
                 if (f := getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None))), None)


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk j of dim 0 goes to rank j; what rank i sent lands in chunk i. Differentiable (the backward is
    the reverse all-to-all)."""
    from torch.distributed.nn.functional import all_to_all_single

    return all_to_all_single(torch.empty_like(x), x, group=group)


def _causal_lm(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model
