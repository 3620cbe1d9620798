"""Training objectives. An objective turns a batch into a *sum* of per-unit losses and the
number of units (response tokens for SFT); the loop divides by the global count over all
micro-batches and ranks, so the step's loss is the mean over every response token of the step,
however the global batch is split."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from finetune.data import IGNORE


class SFT:
    """Cross-entropy of next-token prediction on response tokens (prompt and padding masked)."""

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Units the loss is averaged over: labelled tokens that some position predicts."""
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed token loss of the batch (not averaged: the loop normalises)."""
        return token_loss_sum(forward(model, batch), batch["labels"])


def forward(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a plain (attention mask) or packed (position ids, no mask) batch."""
    return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                 position_ids=batch.get("position_ids"), use_cache=False).logits


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of -log p(label) over labelled positions; position t predicts label t+1."""
    logits = logits[:, :-1].float()  # fp32 for a stable log-softmax
    targets = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")


def build(method: Any) -> SFT:
    return SFT()
