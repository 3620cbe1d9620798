"""Training objectives: the one seam where SFT and DPO differ.

An objective turns a batch into a *sum* of per-unit losses and the number of units (response
tokens for SFT, preference pairs for DPO); the loop divides by the global count over all
micro-batches and ranks, so the step's loss is the mean over every unit of the step, however the
global batch is split. It also returns sums of its own metrics (DPO rewards and log-probs),
which the loop averages the same way.

A mixture-of-experts model with a load-balancing loss (its config has router_aux_loss_coef) reports
it as `router_aux_loss`, and adds router_aux_loss_coef x it to the loss when its config sets
output_router_logits, as transformers does when it computes the loss itself (`RouterLoss`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from finetune.config import DpoLoss, Method, MethodConfig
from finetune.data.tokenize import IGNORE
from finetune.head import ChunkedHead

Output = tuple[torch.Tensor, dict[str, torch.Tensor]]  # (summed loss, summed metrics)
Reference = Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]  # (policy, batch) -> reference log-probs [2B]


@dataclass(frozen=True)
class RouterLoss:
    """A MoE's load-balancing loss (transformers' `aux_loss`, one scalar per forward): reported per
    step as `router_aux_loss`, and `coef` x it added to the loss when `added`."""

    coef: float
    added: bool
    metric = "router_aux_loss"

    def apply(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor], aux: Any, units: int) -> Output:
        """Weighted by the batch's loss units, like the loss sum: the step's value is their mean."""
        aux = torch.as_tensor(aux, dtype=torch.float32, device=loss.device)
        metrics = {**metrics, self.metric: aux.detach() * units}
        return (loss + self.coef * aux * units if self.added else loss), metrics

    def describe(self) -> str:
        return (f"router aux loss: reported as {self.metric}; " + (
            f"added to the loss x{self.coef:g} (router_aux_loss_coef; the model's config sets output_router_logits)"
            if self.added else "not added to the loss (the model's config leaves output_router_logits false, transformers' "
                               "default; set it true in config.json to train with it)"))


def router_loss(config: Any) -> RouterLoss | None:
    """The load-balancing loss of a MoE model's transformers config: None when it has none."""
    coef = getattr(config, "router_aux_loss_coef", None)
    if not isinstance(coef, (int, float)) or isinstance(coef, bool):
        return None
    return RouterLoss(float(coef), bool(getattr(config, "output_router_logits", False)))


class SFT:
    """Cross-entropy of next-token prediction on response tokens (prompt and padding masked)."""

    def __init__(self, router: RouterLoss | None = None, head: ChunkedHead | None = None) -> None:
        self.router, self.head = router, head
        self.metrics: tuple[str, ...] = (router.metric,) if router else ()  # names of its metric sums (the same on every rank)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Units the loss is averaged over: labelled tokens that some position predicts."""
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        """Summed token loss of the batch (not averaged: the loop normalises)."""
        if self.head is not None:  # logits=chunked: the output layer leaves the label log-probs
            with self.head.labelled(batch["labels"]):
                logits, aux = forward_aux(model, batch, self.router is not None)
            loss, metrics = -self.head.take()[0].sum() + tie(logits), {}
        else:
            logits, aux = forward_aux(model, batch, self.router is not None)
            loss, metrics = self.loss(logits, batch)
        return self.router.apply(loss, metrics, aux, self.count(batch)) if self.router else (loss, metrics)

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The loss from logits (what a pipeline's last stage computes)."""
        return token_loss_sum(logits, batch["labels"]), {}

    def rows_loss(self, logps: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The loss from each row's summed label log-probs (a pipeline's last stage under logits=chunked)."""
        return -logps.sum(), {}


class DPO:
    """A DPO-family loss on preference pairs; a batch holds B chosen rows, then B rejected rows.

    Policy log-probs of both responses come from one concatenated forward. Reference log-probs
    come from the batch (`reference_logps`, precomputed before training), or from `reference`
    (a live frozen model, or the policy with its adapter disabled), or are not needed (simpo).
    """

    def __init__(self, cfg: MethodConfig, reference: Reference | None = None, router: RouterLoss | None = None,
                 head: ChunkedHead | None = None) -> None:
        self.cfg, self.reference, self.router, self.head = cfg, reference, router, head
        self.metrics = ("logps/chosen", "logps/rejected", "rewards/accuracy", "rewards/chosen", "rewards/margin",
                        "rewards/rejected") + ((router.metric,) if router else ())

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        reference = None  # precomputed ones travel in the batch: `loss` reads them there
        if self.cfg.loss != DpoLoss.simpo and "reference_logps" not in batch:
            if self.reference is None:
                raise RuntimeError("DPO needs reference log-probs: precompute them or give a reference model")
            with torch.no_grad():  # before the policy's forward: nothing of it is kept for backward
                reference = self.reference(model, batch).float()
        if self.head is not None:  # logits=chunked: the output layer leaves the label log-probs
            with self.head.labelled(batch["labels"]):
                logits, aux = forward_aux(model, batch, self.router is not None)
            loss, metrics = self.pairs(*self.head.take(), batch, reference)
            loss = loss + tie(logits)
        else:
            logits, aux = forward_aux(model, batch, self.router is not None)
            loss, metrics = self.loss(logits, batch, reference)
        return self.router.apply(loss, metrics, aux, self.count(batch)) if self.router else (loss, metrics)

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], reference: torch.Tensor | None = None) -> Output:
        """The loss from logits (what a pipeline's last stage computes; reference log-probs from
        `reference` or the batch)."""
        return self.pairs(*logits_logps(logits, batch["labels"]), batch, reference)

    def rows_loss(self, logps: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The loss from each row's summed label log-probs (a pipeline's last stage under logits=chunked; the
        reference log-probs precomputed, in the batch)."""
        return self.pairs(logps, (batch["labels"][:, 1:] != IGNORE).sum(-1), batch, None)

    def pairs(self, logps: torch.Tensor, lengths: torch.Tensor, batch: dict[str, torch.Tensor],
              reference: torch.Tensor | None) -> Output:
        """The loss from each row's summed response log-probs and lengths (chosen rows, then rejected)."""
        if reference is None and self.cfg.loss != DpoLoss.simpo:
            reference = batch["reference_logps"].float()
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
    logits = predicting(logits, labels).float()
    targets = labels[:, 1:]
    token_logps = -F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                                   reduction="none").view_as(targets)  # 0 where ignored
    return token_logps.sum(-1), (targets != IGNORE).sum(-1)


def forward(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a plain (attention mask) or packed (position ids, no mask) batch."""
    return forward_aux(model, batch, False)[0]


def forward_aux(model: Any, batch: dict[str, torch.Tensor], router: bool) -> tuple[torch.Tensor, Any]:
    """Logits, and with `router` the MoE's load-balancing loss (output_router_logits; None without)."""
    extra = {"output_router_logits": True} if router else {}
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                position_ids=batch.get("position_ids"), use_cache=False, **extra)
    return out.logits, (out.aux_loss if router else None)


def tie(logits: torch.Tensor) -> torch.Tensor:
    """0, from the model's (empty, logits=chunked) output: the loss's graph then starts at the model's
    output as usual, so the hooks that engines and trackers put there (FSDP's root pre-backward,
    MemTracker's) run."""
    return logits.sum().float() * 0


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of -log p(label) over labelled positions; position t predicts label t+1."""
    logits = predicting(logits, labels).float()  # fp32 for a stable log-softmax
    targets = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")


def predicting(positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The positions that predict `labels[:, 1:]`: all but the last of a row, or all of them when the labels
    are one longer (a context-parallel slice, whose last position predicts the next slice's first label)."""
    return positions[:, : labels.shape[1] - 1]


def build(method: MethodConfig, reference: Reference | None = None, router: RouterLoss | None = None,
          head: ChunkedHead | None = None) -> SFT | DPO:
    return DPO(method, reference, router, head) if method.name == Method.dpo else SFT(router, head)
