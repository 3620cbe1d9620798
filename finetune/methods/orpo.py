"""Odds-ratio preference optimisation (method=orpo): Hong, Lee and Thorne, "ORPO: Monolithic Preference
Optimization without Reference Model", EMNLP 2024 (arXiv:2403.07691).

One stage instead of SFT then DPO, and no reference model: on a preference pair (x, y_w, y_l) the loss is the
SFT loss of the chosen response plus lambda (`method.beta`, the paper's and TRL's 0.1) times an odds-ratio term
that pushes the chosen response's odds above the rejected one's:

    L = -(1/m) log P(y_w|x) - lambda * log sigmoid(log odds(y_w|x) - log odds(y_l|x)),
    odds(y|x) = P(y|x) / (1 - P(y|x)),  log P(y|x) = the response's mean token log-probability (eq. 3-7).

Both terms are per pair (the SFT term the chosen response's per-token mean, as in the paper; TRL averages it over
the batch's tokens instead); the loop averages over the step's pairs. The data, and what the rows cannot do
(packing, context parallel), are DPO's (finetune.methods.dpo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetune.config import METHOD_NAME, POSITIVE, Config, ConfigError, DataFormat, MethodConfig, Reference, checked
from finetune.methods.base import Output
from finetune.methods.dpo import Dpo, PairLoss

if TYPE_CHECKING:
    import torch


@dataclass
class OrpoConfig(MethodConfig):
    """method=orpo: pairs, the SFT loss on the chosen response plus an odds-ratio term; no reference model."""

    name: str = checked(METHOD_NAME, "orpo")
    beta: float = checked(POSITIVE, 0.1)
    """The weight (lambda) of the odds-ratio term (the paper's 0.1)."""


class Orpo(Dpo):
    """The ORPO record (finetune.methods.base.Method): DPO's pairs, no reference."""

    name = "orpo"
    config = OrpoConfig
    unpacked = "method=orpo scores chosen and rejected as rows of their own"
    split_tokens = ("the ORPO loss needs each response's whole log-probability before it is computed, and each rank holds a "
                    "slice of the tokens; use parallelism.cp=1 (with checkpointing=full and logits=chunked for long pairs)")
    attached = False  # nothing is computed on the ranks before training

    def reference(self, cfg: MethodConfig) -> Reference | None:
        return None

    def validate(self, cfg: Config) -> None:
        if cfg.data.packing:
            raise ConfigError("data.packing=true is not supported with method=orpo (chosen and rejected are scored as separate rows): "
                              "set data.packing=false")
        if cfg.data.format not in (DataFormat.auto, DataFormat.preference):
            raise ConfigError(f"method=orpo trains on preference pairs: data.format={cfg.data.format.value} must be preference or auto")

    def objective(self, cfg: MethodConfig, reference: Any, router: Any, head: Any) -> ORPO:
        return ORPO(cfg, None, router, head, referenced=False)


METHOD = Orpo()


class ORPO(PairLoss):
    """The ORPO loss on preference pairs (chosen rows, then rejected)."""

    metric_names = ("log_odds_ratio", "nll", "rewards/accuracy", "rewards/chosen", "rewards/margin", "rewards/rejected")

    def pairs(self, logps: torch.Tensor, lengths: torch.Tensor, batch: dict[str, torch.Tensor], reference: torch.Tensor | None) -> Output:
        chosen, rejected = (logps / lengths).chunk(2)  # each response's mean token log-probability
        losses, log_odds = orpo_loss(chosen, rejected, self.cfg.beta)
        beta = self.cfg.beta
        metrics = {
            "log_odds_ratio": log_odds.sum(), "nll": -chosen.sum(),
            "rewards/chosen": beta * chosen.sum(), "rewards/rejected": beta * rejected.sum(),  # TRL's: beta x mean log-prob
            "rewards/accuracy": (chosen > rejected).float().sum(), "rewards/margin": beta * (chosen - rejected).sum(),
        }
        return losses.sum(), {k: v.detach() for k, v in metrics.items()}


def orpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair ORPO losses and log odds ratios from each response's mean token log-probability ([B] each, < 0)."""
    import torch
    import torch.nn.functional as F

    def log_odds(logp: torch.Tensor) -> torch.Tensor:  # log(p / (1 - p)) = log p - log(1 - e^log p), stable near p = 1
        return logp - torch.log(-torch.expm1(logp.clamp(max=-1e-12)))  # clamp: p = 1 in fp32 would give log 0

    ratio = log_odds(chosen) - log_odds(rejected)
    return -chosen - weight * F.logsigmoid(ratio), ratio.detach()
