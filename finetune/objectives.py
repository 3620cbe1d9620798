"""Training objectives: the one seam where SFT and DPO differ.

An objective turns a batch into a *sum* of per-unit losses and the number of units (response
tokens for SFT, preference pairs for DPO); the loop divides by the global count over all
micro-batches and ranks, so the step's loss is the mean over every unit of the step, however the
global batch is split. It also returns sums of its own metrics (DPO rewards and log-probs),
which the loop averages the same way.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from finetune.config import DpoLoss, Method, MethodConfig
from finetune.data import IGNORE

Output = tuple[torch.Tensor, dict[str, torch.Tensor]]  # (summed loss, summed metrics)
Reference = Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]  # (policy, batch) -> reference log-probs [2B]


class SFT:
    """Cross-entropy of next-token prediction on response tokens (prompt and padding masked)."""

    metrics: tuple[str, ...] = ()  # names of the metric sums it returns (the same on every rank)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Units the loss is averaged over: labelled tokens that some position predicts."""
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        """Summed token loss of the batch (not averaged: the loop normalises)."""
        return self.loss(forward(model, batch), batch)

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The loss from logits (what a pipeline's last stage computes)."""
        return token_loss_sum(logits, batch["labels"]), {}


class DPO:
    """A DPO-family loss on preference pairs; a batch holds B chosen rows, then B rejected rows.

    Policy log-probs of both responses come from one concatenated forward. Reference log-probs
    come from the batch (`reference_logps`, precomputed before training), or from `reference`
    (a live frozen model, or the policy with its adapter disabled), or are not needed (simpo).
    """

    metrics = ("logps/chosen", "logps/rejected", "rewards/accuracy", "rewards/chosen", "rewards/margin", "rewards/rejected")

    def __init__(self, cfg: MethodConfig, reference: Reference | None = None) -> None:
        self.cfg, self.reference = cfg, reference

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        reference = None  # precomputed ones travel in the batch: `loss` reads them there
        if self.cfg.loss != DpoLoss.simpo and "reference_logps" not in batch:
            if self.reference is None:
                raise RuntimeError("DPO needs reference log-probs: precompute them or give a reference model")
            with torch.no_grad():  # before the policy's forward: nothing of it is kept for backward
                reference = self.reference(model, batch).float()
        return self.loss(forward(model, batch), batch, reference)

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], reference: torch.Tensor | None = None) -> Output:
        """The loss from logits (what a pipeline's last stage computes; reference log-probs from
        `reference` or the batch)."""
        if reference is None and self.cfg.loss != DpoLoss.simpo:
            reference = batch["reference_logps"].float()
        logps, lengths = logits_logps(logits, batch["labels"])
        chosen, rejected = logps.chunk(2)
        n_chosen, n_rejected = lengths.chunk(2)
        ref = reference.chunk(2) if reference is not None else (None, None)
        losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, *ref, n_chosen, n_rejected, self.cfg)
        if self.cfg.sft_weight:  # RPO-style: keep the chosen response likely in absolute terms too
            losses = losses + self.cfg.sft_weight * (-chosen / n_chosen)
        metrics = {
            "rewards/chosen": chosen_rewards.sum(),
            "rewards/rejected": rejected_rewards.sum(),
            "rewards/accuracy": (chosen_rewards > rejected_rewards).float().sum(),
            "rewards/margin": (chosen_rewards - rejected_rewards).sum(),
            "logps/chosen": chosen.sum(),
            "logps/rejected": rejected.sum(),
        }
        return losses.sum(), {k: v.detach() for k, v in metrics.items()}


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None,
             n_chosen: torch.Tensor, n_rejected: torch.Tensor, cfg: MethodConfig) -> tuple[torch.Tensor, ...]:
    """Per-pair losses and implicit rewards (chosen, rejected) from summed response log-probs.

    Args:
        chosen, rejected: policy log-probs of each response, summed over its tokens, shape [B].
        ref_chosen, ref_rejected: the reference model's (None for simpo).
        n_chosen, n_rejected: response lengths in tokens (ipo and simpo average over them).
    """
    beta, ls = cfg.beta_value, cfg.label_smoothing
    if cfg.loss in (DpoLoss.ipo, DpoLoss.simpo):  # length-normalised log-probs
        chosen, rejected = chosen / n_chosen, rejected / n_rejected
        if ref_chosen is not None:
            ref_chosen, ref_rejected = ref_chosen / n_chosen, ref_rejected / n_rejected
    if cfg.loss == DpoLoss.simpo:
        chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
        z = chosen_rewards - rejected_rewards - cfg.gamma
        return -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z), chosen_rewards.detach(), rejected_rewards.detach()
    assert ref_chosen is not None and ref_rejected is not None
    chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    h = (chosen - ref_chosen) - (rejected - ref_rejected)  # the log-ratio margin
    if cfg.loss == DpoLoss.sigmoid:
        losses = -(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)
    elif cfg.loss == DpoLoss.ipo:
        losses = (h - 1 / (2 * beta)) ** 2
    else:  # hinge
        losses = torch.relu(1 - beta * h)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def sequence_logps(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-probability of the labelled tokens (summed, fp32) and how many there are."""
    return logits_logps(forward(model, batch), batch["labels"])


def logits_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits[:, :-1].float()
    targets = labels[:, 1:]
    token_logps = -F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                                   reduction="none").view_as(targets)  # 0 where ignored
    return token_logps.sum(-1), (targets != IGNORE).sum(-1)


def forward(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a plain (attention mask) or packed (position ids, no mask) batch."""
    return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                 position_ids=batch.get("position_ids"), use_cache=False).logits


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of -log p(label) over labelled positions; position t predicts label t+1."""
    logits = logits[:, :-1].float()  # fp32 for a stable log-softmax
    targets = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")


def build(method: MethodConfig, reference: Reference | None = None) -> SFT | DPO:
    return DPO(method, reference) if method.name == Method.dpo else SFT()
