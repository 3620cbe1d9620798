"""Reward modelling (method=reward): a scalar score per sequence, trained on preference pairs.

Data: the same preference rows as DPO, (prompt, chosen, rejected) (finetune.data.forms.to_pair), each a `Pair` of two
rows that share the prompt; a batch of B pairs is B chosen rows, then B rejected rows, so one forward scores both.
The model is transformers' own ForSequenceClassification of the family (num_labels=1: a score head of hidden x 1
on the last hidden state; finetune.rank.model.load_model builds it from this record's `model_class`), and its forward
pools the score of each row's last token that is not padding (config.pad_token_id): the exported final/ loads
with AutoModelForSequenceClassification and scores a row exactly as training did.

The loss is the Bradley-Terry model of a preference, as the InstructGPT reward model is trained (Ouyang et al.
2022, "Training language models to follow instructions with human feedback", eq. 1):
    loss = -log sigmoid(r(x, chosen) - r(x, rejected))
and, with method.center_rewards_coefficient = c > 0, c * (r(x, chosen) + r(x, rejected))^2, which keeps the scores
centred on 0 (Eisenstein et al. 2023, "Helping or Herding? Reward Model Ensembles Mitigate but do not Eliminate
Reward Hacking"; TRL's RewardTrainer adds the same term). Its metrics: the pairwise accuracy (the chosen row scored
higher), the mean scores and their margin. No reference model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetune.config import METHOD_NAME, Config, ConfigError, Logits, MethodConfig, Reference, at_least, checked
from finetune.disk import model_config
from finetune.families import FAMILIES
from finetune.methods.base import SCORED, Output
from finetune.methods.dpo import Dpo

if TYPE_CHECKING:
    import torch


@dataclass
class RewardConfig(MethodConfig):
    """method=reward: a reward model (one scalar score per row, AutoModelForSequenceClassification) trained on
    preference pairs with the Bradley-Terry loss."""

    name: str = checked(METHOD_NAME, "reward")
    center_rewards_coefficient: float = checked(at_least(0), 0.0)
    """Weight of the added mean squared sum of the pair's scores, (r_chosen + r_rejected)^2, which keeps the scores
    centred on 0 (Eisenstein et al. 2023; TRL's RewardConfig.center_rewards_coefficient, 0.01 there); 0: the plain
    Bradley-Terry loss."""


class Reward:
    """The reward-model record (finetune.methods.base.Method)."""

    name = "reward"
    config = RewardConfig
    forms, unit, columns, rows_per_example, scalars = Dpo.forms, Dpo.unit, Dpo.columns, Dpo.rows_per_example, Dpo.scalars
    no_grad_rows = Dpo.no_grad_rows
    check_row, encode, join = Dpo.check_row, Dpo.encode, Dpo.join  # DPO's preference rows, read the same way (as method=reward)
    unpacked = "method=reward scores chosen and rejected each at its own last token, as rows of their own"
    padded = unpacked
    split_tokens = ("a reward model scores each row at its last token, which only one rank's slice of the tokens holds; use "
                    "parallelism.cp=1 (with checkpointing=full for long pairs)")
    attached = False
    images = Dpo.images
    model_class = SCORED

    settle = Dpo.settle  # nothing added to a split

    def sampling(self, cfg: MethodConfig) -> None:
        return None

    def teacher(self, cfg: MethodConfig) -> None:
        return None

    def make_first(self, cfg: MethodConfig, make: Any) -> None:
        return None

    def reference(self, cfg: MethodConfig) -> Reference | None:
        return None

    def validate(self, cfg: Config) -> None:
        refusal = unsupported(cfg)
        if refusal:
            raise ConfigError(refusal)

    def objective(self, cfg: MethodConfig, reference: Any, router: Any, head: Any) -> BradleyTerry:
        return BradleyTerry(cfg, router)


METHOD = Reward()


ROUTER_LOSS = ("method=reward with a model whose config sets output_router_logits: transformers' ForSequenceClassification returns "
               "no load-balancing loss to add to the loss: set output_router_logits false in its config.json")


def unsupported(cfg: Config) -> str | None:
    """Why this config cannot train a reward model (the first reason, one line naming the key and what to do), or None.
    Packing, padding-free micro-batches and context parallel are refused by the shared rules from the record's
    `unpacked` and `split_tokens`."""
    p, arch = cfg.parallelism, model_config(cfg.model) or {}
    model_type = str(arch.get("model_type") or "")
    if model_type in FAMILIES and not FAMILIES[model_type].scored:
        return (f"method=reward needs a ForSequenceClassification model and transformers has none for model_type={model_type}: "
                "use a family that has one (llama, qwen2, qwen3, mistral, gemma2, phi3, ...)")
    if arch.get("output_router_logits") is True:
        return ROUTER_LOSS
    if p.pp > 1:
        return (f"method=reward with parallelism.pp={p.pp} is not supported: pipeline stages run the causal LM's forward, not "
                "the score head and its last-token pooling: use parallelism=fsdp, tp2 or a zero option")
    if cfg.logits.name == Logits.chunked:
        return ("logits=chunked with method=reward: a reward model's head is one score per row (hidden x 1), with no vocabulary "
                "logits to chunk: use logits=full")
    if cfg.train.exact_match_samples:
        return (f"train.exact_match_samples={cfg.train.exact_match_samples} with method=reward: a reward model scores rows and "
                "does not generate: set train.exact_match_samples=0 (evaluation reports eval_rewards/accuracy)")
    return None


class BradleyTerry:
    """-log sigmoid(r_chosen - r_rejected) per pair (+ the centring term); a batch holds B chosen rows, then B rejected rows.

    The scores come from the model's own ForSequenceClassification forward (its `logits`, [2B, 1]), which returns no MoE
    load-balancing loss: a MoE's router loss is neither reported nor added (refused where its config would add it).
    torch is imported where it is used: the launcher reads this module's record."""

    metrics = ("rewards/accuracy", "rewards/chosen", "rewards/margin", "rewards/rejected")

    def __init__(self, cfg: MethodConfig, router: Any = None) -> None:
        if router is not None and router.added:  # a hub config the launcher could not read
            raise ConfigError(ROUTER_LOSS)
        self.center = cfg.center_rewards_coefficient

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        from finetune.data.images import seen

        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), position_ids=batch.get("position_ids"),
                    use_cache=False, **seen(batch))
        return self.loss(out.logits, batch)

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The loss from the model's pooled logits, one score per row ([2B, 1])."""
        return self.rows_loss(logits.squeeze(-1), batch)

    def rows_loss(self, scores: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The loss from each row's score ([2B]: chosen rows, then rejected), summed over pairs."""
        chosen, rejected = scores.float().chunk(2)
        losses = bradley_terry(chosen, rejected, self.center)
        metrics = {
            "rewards/accuracy": (chosen > rejected).float().sum(),
            "rewards/chosen": chosen.sum(),
            "rewards/rejected": rejected.sum(),
            "rewards/margin": (chosen - rejected).sum(),
        }
        return losses.sum(), {k: v.detach() for k, v in metrics.items()}


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, center: float = 0.0) -> torch.Tensor:
    """Per-pair losses: -log sigmoid(chosen - rejected) (Ouyang et al. 2022), + center * (chosen + rejected)^2
    (Eisenstein et al. 2023) when `center` > 0.

    Args:
        chosen, rejected: the model's score of each pair's chosen and rejected row, shape [B].
        center: method.center_rewards_coefficient.
    """
    import torch.nn.functional as F

    losses = -F.logsigmoid(chosen - rejected)
    return losses + center * (chosen + rejected) ** 2 if center else losses
