"""Kahneman-Tversky optimisation (method=kto): Ethayarajh, Xu, Muennighoff, Jurafsky and Kiela, "KTO: Model
Alignment as Prospect Theoretic Optimization", ICML 2024 (arXiv:2402.01306).

Data: unpaired rows, each one response judged on its own, the feedback most teams collect: any SFT row form with a
boolean `label` (`{prompt, completion, label}`, TRL's unpaired preference rows, also with the prompt as messages);
a preference pair counts as one desirable and one undesirable row. Only the final response carries labels.

With r = log pi(y|x) - log pi_ref(y|x) (the response's summed log-probs) and z0 the reference point, a row's loss is

    desirable:    lambda_D * (1 - sigmoid(beta * (r - z0)))
    undesirable:  lambda_U * (1 - sigmoid(beta * (z0 - r)))                       (eq. 8, as lambda_y - v(x, y))

z0 estimates KL(pi || pi_ref) from *mismatched* rows (a prompt with another example's response): the mean of their
r, clamped at 0 and not differentiated (section 4.1). Each example's mismatched row pairs its prompt with the next
example's response in the split (`Kto.settle`), fixed before training, so a precomputed reference scores it once
with the rest (TRL also builds these rows before training). The estimate is the micro-batch's (TRL's: the device
batch's, averaged over processes); the mismatched rows are forwarded without gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from finetune.config import METHOD_NAME, POSITIVE, Config, ConfigError, DataConfig, DataFormat, MethodConfig, Reference, checked
from finetune.data.forms import images_of, to_labelled
from finetune.data.images import apart, check_image
from finetune.data.tools import tools_of
from finetune.data.tokenize import IGNORE, Encoded, Example, encode, fit
from finetune.methods.base import CAUSAL_LM, Output
from finetune.methods.dpo import check_reference

if TYPE_CHECKING:
    import torch


@dataclass
class KtoConfig(MethodConfig):
    """method=kto: unpaired rows labelled desirable or undesirable (`label: true/false`; pairs count as one of each),
    against a reference."""

    name: str = checked(METHOD_NAME, "kto")
    beta: float = checked(POSITIVE, 0.1)
    """Inverse temperature of the implicit reward (the paper's 0.1)."""
    desirable_weight: float = checked(POSITIVE, 1.0)
    """The weight of a desirable row's loss (lambda_D; the paper keeps lambda_D x desirable rows / lambda_U x
    undesirable rows in [1, 4/3])."""
    undesirable_weight: float = checked(POSITIVE, 1.0)
    """The weight of an undesirable row's loss (lambda_U)."""
    reference: Reference = Reference.precomputed
    """Where the reference log-probs come from: precomputed, live or adapter_disabled (as method=dpo's)."""


@dataclass
class Labelled:
    """A KTO example (finetune.methods.base.Item): a prompt and response judged desirable or not, and, once its split is
    read, its mismatched row (its prompt with another example's response)."""

    row: Example
    desirable: bool
    mismatched: Example | None = None
    reference: tuple[float, float] | None = None
    """Reference-model log-probs of the row and its mismatched row, when precomputed before training."""

    @property
    def rows(self) -> tuple[Example, ...]:
        return (self.row,) if self.mismatched is None else (self.row, self.mismatched)

    @property
    def target(self) -> Example | None:
        """What exact match generates from and compares with: a desirable response only."""
        return self.row if self.desirable else None

    def values(self) -> dict[str, tuple[float, ...]]:
        out = {"desirable": (float(self.desirable),) * len(self.rows)}
        return out | ({"reference_logps": self.reference} if self.reference is not None else {})


def mismatched(row: Example, other: Example, max_length: int) -> Example:
    """`row`'s prompt with `other`'s response (labelled as the response was), cut to max_length."""
    p, q = row.prompt_len, other.prompt_len
    return Example((row.input_ids[:p] + other.input_ids[q:])[:max_length], ([IGNORE] * p + other.labels[q:])[:max_length], p, other.reference,
                   images=row.images, image_tokens=row.image_tokens, image_end=row.image_end)  # its prompt's images


class Kto:
    """The KTO record (finetune.methods.base.Method)."""

    name = "kto"
    config = KtoConfig
    forms = (DataFormat.alpaca, DataFormat.chat, DataFormat.sharegpt, DataFormat.completion, DataFormat.preference)
    unit = "example"
    columns = ("",)  # the token cache keeps the row; its mismatched row is made on the rank (settle)
    rows_per_example = 2  # the row, then its mismatched row
    no_grad_rows = 1  # the mismatched row: forwarded without gradients (a pipeline keeps it)
    unpacked = "method=kto scores each response's whole log-probability in a row of its own"
    padded = unpacked
    split_tokens = ("the KTO loss needs each response's whole log-probability before it is computed, and each rank holds a "
                    "slice of the tokens; use parallelism.cp=1 (with checkpointing=full and logits=chunked for long rows)")
    scalars = ("desirable",)
    images = None  # a row's mismatched row shows its prompt's images
    attached = True  # mismatched rows and a precomputed reference's log-probs are attached on the ranks
    model_class = CAUSAL_LM

    def check_row(self, row: dict[str, Any], data: DataConfig, where: str) -> None:
        for messages, _ in to_labelled(row, data, where, self.name):
            for image in images_of(row, messages, where):
                check_image(image, where)

    def encode(self, row: dict[str, Any], where: str, tokenizer: Any, data: DataConfig, chat: bool) -> Encoded:
        tools = tools_of(row, where)
        parts = [fit(Labelled(encode(messages, tokenizer, chat, last_only=True, tools=tools, data=data, where=where,
                                     images=images_of(row, messages, where)), good), data, where)
                 for messages, good in to_labelled(row, data, where, self.name)]
        return Encoded([i for p in parts for i in p.items], truncated=any(p.truncated for p in parts),
                       dropped=parts[0].dropped if not any(p.items for p in parts) else None, thought=sum(p.thought for p in parts),
                       reasoning_mode=data.reasoning.value)

    def join(self, rows: list[Example], scalars: dict[str, float]) -> Labelled:
        return Labelled(rows[0], bool(scalars["desirable"]))

    def settle(self, examples: list[Any], data: DataConfig, key: str) -> list[Any]:
        """Give each example its mismatched row: its prompt with the next example's response (the last: the first's)."""
        if len(examples) == 1:
            raise ConfigError(f"{key}: method=kto pairs each prompt with another example's response to estimate its reference point, "
                              "and this split has 1 example: add rows")
        for i, e in enumerate(examples):
            e.mismatched = mismatched(e.row, examples[(i + 1) % len(examples)].row, data.max_length)
        return examples

    def sampling(self, cfg: MethodConfig) -> None:
        return None

    def teacher(self, cfg: MethodConfig) -> None:
        return None

    def make_first(self, cfg: MethodConfig, make: Any) -> None:
        return None

    def reference(self, cfg: KtoConfig) -> Reference | None:
        return cfg.reference

    def validate(self, cfg: Config) -> None:
        check_reference(cfg)
        if cfg.data.packing:
            raise ConfigError("data.packing=true is not supported with method=kto (each response is scored in a row of its own): "
                              "set data.packing=false")
        if cfg.data.streaming:
            raise ConfigError("data.streaming=true is not supported with method=kto: each example's mismatched row (for the KL "
                              "reference point) takes another example's response, which needs the whole split: set data.streaming=false")
        if cfg.data.format == DataFormat.text:
            raise ConfigError("method=kto trains on labelled responses: data.format=text has none; use alpaca, chat, sharegpt, "
                              "completion (with a 'label') or preference rows")

    def objective(self, cfg: KtoConfig, reference: Any, router: Any, head: Any) -> KTO:
        return KTO(cfg, reference, router, head)


METHOD = Kto()


class KTO:
    """The KTO loss; a batch holds B rows, then their B mismatched rows, and `desirable` per row.

    The rows' log-probs come from one forward with gradients, the mismatched rows' from one without (the reference
    point is not differentiated); the reference's from the batch (precomputed) or from `reference` (live, or the
    policy with its adapter disabled), for all 2B rows. A pipeline's last stage (`loss`, `rows_loss`) has the 2B rows
    of one forward and detaches the mismatched half.
    """

    def __init__(self, cfg: KtoConfig, reference: Any = None, router: Any = None, head: Any = None) -> None:
        self.cfg, self.reference, self.router, self.head = cfg, reference, router, head
        self.metrics = ("kl", "logps", "rewards/accuracy", "rewards/signed") + ((router.metric,) if router else ())

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        import torch

        n = self.count(batch)
        reference = None  # precomputed ones travel in the batch
        if "reference_logps" not in batch:
            if self.reference is None:
                raise RuntimeError("KTO needs reference log-probs: precompute them or give a reference model")
            with torch.no_grad():
                reference = self.reference(model, batch).float()
        rows, others = apart(batch, 0, n), apart(batch, 1, n)  # forwarded apart: each with its rows' image inputs
        with torch.no_grad():
            other_logps = self.logps(model, others, router=False)[0]
        logps, aux, tied = self.logps(model, rows, router=self.router is not None)
        loss, metrics = self.rows(torch.cat([logps, other_logps]), batch, reference)
        loss = loss + tied
        return self.router.apply(loss, metrics, aux, n) if self.router else (loss, metrics)

    def logps(self, model: Any, batch: dict[str, torch.Tensor], router: bool) -> tuple[torch.Tensor, Any, Any]:
        """Each row's summed label log-probs, the MoE's load-balancing loss (with `router`), and the 0 that ties a
        logits=chunked loss to the model's output (finetune.methods.losses.tie)."""
        from finetune.methods.losses import forward_aux, logits_logps, tie

        if self.head is not None:  # logits=chunked: the output layer leaves the label log-probs
            with self.head.labelled(batch["labels"]):
                logits, aux = forward_aux(model, batch, router)
            return self.head.take()[0], aux, tie(logits)
        logits, aux = forward_aux(model, batch, router)
        return logits_logps(logits, batch["labels"])[0], aux, 0

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The loss from the 2B rows' logits (a pipeline's last stage; the reference precomputed, in the batch)."""
        from finetune.methods.losses import logits_logps

        return self.rows(logits_logps(logits, batch["labels"])[0], batch, None)

    def rows_loss(self, logps: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        return self.rows(logps, batch, None)

    def rows(self, logps: torch.Tensor, batch: dict[str, torch.Tensor], reference: torch.Tensor | None) -> Output:
        """(summed loss, summed metrics) from the 2B rows' summed log-probs (rows, then mismatched rows)."""
        n = self.count(batch)
        reference = batch["reference_logps"].float() if reference is None else reference
        good = batch["desirable"][:n].bool()
        rewards = logps[:n] - reference[:n]
        kl = (logps[n:].detach() - reference[n:]).mean().clamp(min=0)
        losses = kto_loss(rewards, kl, good, self.cfg)
        beta = self.cfg.beta
        sign = good.float() * 2 - 1
        metrics = {"kl": kl * n, "logps": logps[:n].sum(), "rewards/accuracy": ((rewards > kl) == good).float().sum(),
                   "rewards/signed": beta * (sign * rewards).sum()}
        return losses.sum(), {k: v.detach().float() for k, v in metrics.items()}


def kto_loss(rewards: torch.Tensor, kl: torch.Tensor, desirable: torch.Tensor, cfg: KtoConfig) -> torch.Tensor:
    """Per-row KTO losses from each row's r = policy - reference log-prob ([B]), the reference point z0 and the labels."""
    import torch

    beta = cfg.beta
    value = torch.where(desirable, torch.sigmoid(beta * (rewards - kl)), torch.sigmoid(beta * (kl - rewards)))
    weight = torch.where(desirable, cfg.desirable_weight, cfg.undesirable_weight)
    return weight * (1 - value)
