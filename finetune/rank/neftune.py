"""NEFTune (train.neftune_alpha): uniform noise on the input embeddings in training forwards only.

The noise of the NEFTune paper (Jain et al., 2023) and of transformers' `neftune_noise_alpha`: uniform(-1, 1) x
alpha / sqrt(L x d), d the hidden size. transformers takes L as the padded width of the batch; here L is each
sequence's real length: the attention mask's count of a padded row, or the length of its sample in a packed or
padding-free row (position_ids restart at 0 at each sample). A forward hook on the input embedding adds it while the
model is in train mode; evaluation, exact match and generation run in eval mode and see none, and neither does a
reference computed inside a training step (DPO/KTO's adapter_disabled: `silenced`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from finetune.data.batches import starts


def lengths(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """[B, S, 1] float: the real length of the sequence each token belongs to (padded width when neither is given)."""
    if attention_mask is not None:
        return attention_mask.sum(1).clamp(min=1).float()[:, None, None].expand(shape[0], shape[1], 1)
    if position_ids is not None:
        segment = starts(position_ids).long().cumsum(1)  # which sample of the row each token is in
        counts = torch.zeros(segment.shape[0], shape[1] + 1, dtype=torch.long, device=segment.device)
        counts.scatter_add_(1, segment, torch.ones_like(segment))
        return counts.gather(1, segment).float()[..., None]
    return torch.full((shape[0], shape[1], 1), float(shape[1]))


def add_noise(model: torch.nn.Module, alpha: float) -> None:
    """Hook NEFTune onto `model`'s input embedding (a transformers model, or a PEFT model around one)."""
    seen: dict[str, Any] = {}
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model

    def remember(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["attention_mask"], seen["position_ids"] = kwargs.get("attention_mask"), kwargs.get("position_ids")

    def noisy(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        mask, pos = seen.get("attention_mask"), seen.get("position_ids")
        if mask is not None and mask.dim() != 2:  # a 4-D mask someone built: fall back to the width
            mask = None
        length = lengths(mask, pos, output.shape).to(output.device)
        scale = alpha / torch.sqrt(length * output.shape[-1])
        return output + torch.empty_like(output).uniform_(-1, 1) * scale.to(output.dtype)

    inner.register_forward_pre_hook(remember, with_kwargs=True)
    inner.get_input_embeddings().register_forward_hook(noisy)


@contextlib.contextmanager
def silenced(model: torch.nn.Module) -> Iterator[None]:
    """No NEFTune noise inside (the embedding in eval mode, which only the hook reads): a reference's forward."""
    embedding = model.get_input_embeddings()
    was = embedding.training
    embedding.eval()
    try:
        yield
    finally:
        embedding.train(was)
