"""Direct preference optimisation (method=dpo) and its family (method.loss: sigmoid, ipo, hinge, simpo).

Data: preference rows, (prompt, chosen, rejected) (finetune.data.forms.to_pair), each a `Pair` of two rows
that share the prompt; only the final response carries labels. A batch of B pairs is B chosen rows, then B
rejected rows, so one forward scores both: padded, or padding-free (data.padding_free's default) laid end to end in
one row, each attending only to itself, the log-probs summed per sample (finetune.methods.losses.row_sums); never
packed (a pair's rows would be split over packed rows). The loss compares
each response's summed log-probability with a reference model's (finetune.rank.reference computes them:
precomputed, live or adapter_disabled); simpo needs none.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import TYPE_CHECKING, Any

from finetune.config import (METHOD_NAME, POSITIVE, Config, ConfigError, DataConfig, DataFormat, MethodConfig, PeftMethod, Reference,
                             Spelled, at_least, checked, in_range, unused)
from finetune.data.forms import images_of, to_pair
from finetune.data.images import check_image
from finetune.data.tools import tools_of
from finetune.data.tokenize import IGNORE, Encoded, Example, Pair, encode_pair, fit
from finetune.methods.base import CAUSAL_LM, Output

if TYPE_CHECKING:
    import torch


class DpoLoss(str, Enum, metaclass=Spelled):
    sigmoid = "sigmoid"
    ipo = "ipo"
    hinge = "hinge"
    simpo = "simpo"


@dataclass
class DpoConfig(MethodConfig):
    """method=dpo: preference optimisation on (prompt, chosen, rejected) pairs with the DPO-family loss `loss`."""

    name: str = checked(METHOD_NAME, "dpo")
    loss: DpoLoss = DpoLoss.sigmoid
    """sigmoid (DPO), ipo (squared loss on length-averaged log-ratios), hinge (SLiC), simpo (reference-free,
    length-averaged log-probs, target margin `gamma`)."""
    beta: float | None = checked(POSITIVE, None)
    """Inverse temperature of the implicit reward; null: 0.1, 2.0 for simpo (the papers' values)."""
    gamma: float = checked(at_least(0), 1.0)
    """simpo: the target reward margin between chosen and rejected."""
    label_smoothing: float = checked(in_range(0, 0.5, hi_open=True), 0.0)
    """sigmoid/simpo: probability that a preference label is flipped (conservative DPO), in [0, 0.5)."""
    sft_weight: float = checked(at_least(0), 0.0)
    """Weight of an added SFT loss on the chosen response (per-token mean; RPO-style)."""
    reference: Reference = Reference.precomputed
    """Where the reference log-probs come from. precomputed: one no-grad pass of the initial policy over the data
    before training (no reference model in memory while training); live: a frozen copy of the initial model (sharded
    like the policy under ZeRO-3); adapter_disabled: with peft, the policy itself with its adapter switched off (no
    copy)."""

    @property
    def beta_value(self) -> float:
        if self.beta is not None:
            return self.beta
        return 2.0 if self.loss == DpoLoss.simpo else 0.1


class Dpo:
    """The DPO record (finetune.methods.base.Method)."""

    name = "dpo"
    config = DpoConfig
    forms = (DataFormat.preference,)
    unit = "pair"
    columns = ("chosen_", "rejected_")
    rows_per_example = 2
    no_grad_rows = 0
    unpacked = "method=dpo scores chosen and rejected as rows of their own"
    padded = None  # padding-free: a micro-batch's chosen and rejected rows end to end in one (finetune.data.batches.flat_samples)
    split_tokens = ("the DPO loss needs each response's whole log-probability before it is computed, and each rank holds a "
                    "slice of the tokens; use parallelism.cp=1 (with checkpointing=full and logits=chunked for long pairs)")
    scalars = ()
    images = None  # a pair's prompt shows them to both rows
    attached = True  # a precomputed reference's log-probs are attached to each pair on the ranks
    model_class = CAUSAL_LM

    def check_row(self, row: dict[str, Any], data: DataConfig, where: str) -> None:
        for image in pair_images(row, to_pair(row, data.system_prompt, where, self.name), where):
            check_image(image, where)

    def encode(self, row: dict[str, Any], where: str, tokenizer: Any, data: DataConfig, chat: bool) -> Encoded:
        prompt, chosen, rejected = to_pair(row, data.system_prompt, where, self.name)
        pair = encode_pair(prompt, chosen, rejected, tokenizer, chat, tools=tools_of(row, where), data=data, where=where,
                           images=pair_images(row, (prompt, chosen, rejected), where))
        return fit(pair, data, where)


    def join(self, rows: list[Example], scalars: dict[str, float]) -> Pair:
        return Pair(*rows)

    def sampling(self, cfg: MethodConfig) -> None:
        return None

    def teacher(self, cfg: MethodConfig) -> None:
        return None

    def make_first(self, cfg: MethodConfig, make: Any) -> None:
        return None

    def reference(self, cfg: DpoConfig) -> Reference | None:
        return None if cfg.loss == DpoLoss.simpo else cfg.reference

    def validate(self, cfg: Config) -> None:
        m = cfg.method
        if m.loss == DpoLoss.simpo:
            unused(m, "method", ("name", "loss", "beta", "gamma", "label_smoothing", "sft_weight"), "with method.loss=simpo (reference-free)")
        else:
            unused(m, "method", tuple(f.name for f in fields(m) if f.name != "gamma"), f"with method.loss={m.loss.value} (only with simpo)")
        if m.loss in (DpoLoss.ipo, DpoLoss.hinge) and m.label_smoothing:
            raise ConfigError(f"method.label_smoothing={m.label_smoothing} applies to method.loss=sigmoid or simpo, not {m.loss.value}")
        check_reference(cfg)
        if cfg.data.packing:
            raise ConfigError("data.packing=true is not supported with method=dpo (chosen and rejected are scored as separate rows): "
                              "set data.packing=false")
        if cfg.data.format not in (DataFormat.auto, DataFormat.preference):
            raise ConfigError(f"method=dpo trains on preference pairs: data.format={cfg.data.format.value} must be preference or auto")

    def settle(self, examples: list[Any], data: DataConfig, key: str) -> list[Any]:
        return examples

    def objective(self, cfg: DpoConfig, reference: Any, router: Any, head: Any) -> DPO:
        return DPO(cfg, reference, router, head)


def check_reference(cfg: Config) -> None:
    """A reference the config cannot give, refused (the methods that compare with one call it)."""
    if cfg.method.reference == Reference.adapter_disabled and cfg.peft.name == PeftMethod.none:
        raise ConfigError("method.reference=adapter_disabled uses the base model under a PEFT adapter: add peft=lora (or qlora/dora), "
                          "or use method.reference=precomputed")


METHOD = Dpo()


def pair_images(row: dict[str, Any], pair: tuple[list[Any], str, str], where: str) -> list[Any]:
    """The images of a pair's prompt (a vision-language model's), which both rows show; refused in one line as for SFT
    rows (finetune.data.forms.images_of), and in a response."""
    prompt, chosen, rejected = pair
    return images_of(row, [*prompt, *({"role": "assistant", "content": text} for text in (chosen, rejected))], where)


class PairLoss:
    """A loss on preference pairs (DPO's family, ORPO); a batch holds B chosen rows, then B rejected rows.

    Policy log-probs of both responses come from one concatenated forward. Reference log-probs, when the method
    needs them (`referenced`), come from the batch (`reference_logps`, precomputed before training), or from
    `reference` (a live frozen model, or the policy with its adapter disabled). A subclass says what the pair's
    loss is (`pairs`) and names its metrics. torch and finetune.methods.losses are imported where they are used: the
    launcher reads the methods' records.
    """

    metric_names: tuple[str, ...] = ()

    def __init__(self, cfg: MethodConfig, reference: Any = None, router: Any = None, head: Any = None, referenced: bool = True) -> None:
        self.cfg, self.reference, self.router, self.head, self.referenced = cfg, reference, router, head, referenced
        self.metrics = self.metric_names + ((router.metric,) if router else ())

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        from finetune.data.batches import SAMPLES

        samples = batch.get(SAMPLES)  # padding-free: the rows end to end in one
        return (batch["input_ids"].shape[0] if samples is None else int(samples[0, -1]) + 1) // 2

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        import torch

        from finetune.data.batches import SAMPLES
        from finetune.methods.losses import forward_aux, tie

        reference = None  # precomputed ones travel in the batch: `loss` reads them there
        if self.referenced and "reference_logps" not in batch:
            if self.reference is None:
                raise RuntimeError(f"method={self.cfg.name} needs reference log-probs: precompute them or give a reference model")
            with torch.no_grad():  # before the policy's forward: nothing of it is kept for backward
                reference = self.reference(model, batch).float()
        if self.head is not None:  # logits=chunked: the output layer leaves the label log-probs
            with self.head.labelled(batch["labels"], samples=batch.get(SAMPLES)):
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
        from finetune.data.batches import SAMPLES
        from finetune.methods.losses import logits_logps

        return self.pairs(*logits_logps(logits, batch["labels"], batch.get(SAMPLES)), batch, reference)

    def rows_loss(self, logps: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        """The loss from each row's summed label log-probs (a pipeline's last stage under logits=chunked; the
        reference log-probs precomputed, in the batch)."""
        return self.pairs(logps, (batch["labels"][:, 1:] != IGNORE).sum(-1), batch, None)

    def pairs(self, logps: torch.Tensor, lengths: torch.Tensor, batch: dict[str, torch.Tensor], reference: torch.Tensor | None) -> Output:
        """(summed loss, summed metrics) from each row's summed response log-probs and lengths (chosen rows, then
        rejected) and, when `referenced`, the reference's (None: in the batch)."""
        raise NotImplementedError


class DPO(PairLoss):
    """A DPO-family loss (method.loss) on preference pairs."""

    metric_names = ("logps/chosen", "logps/rejected", "rewards/accuracy", "rewards/chosen", "rewards/margin", "rewards/rejected")

    def __init__(self, cfg: DpoConfig, reference: Any = None, router: Any = None, head: Any = None) -> None:
        super().__init__(cfg, reference, router, head, referenced=cfg.loss != DpoLoss.simpo)

    def pairs(self, logps: torch.Tensor, lengths: torch.Tensor, batch: dict[str, torch.Tensor], reference: torch.Tensor | None) -> Output:
        if reference is None and self.referenced:
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


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, n_chosen: torch.Tensor, n_rejected: torch.Tensor,
             cfg: DpoConfig) -> tuple[torch.Tensor, ...]:
    """Per-pair losses and implicit rewards (chosen, rejected) from summed response log-probs.

    Args:
        chosen, rejected: policy log-probs of each response, summed over its tokens, shape [B].
        ref_chosen, ref_rejected: the reference model's (None for simpo).
        n_chosen, n_rejected: response lengths in tokens (ipo and simpo average over them).
    """
    import torch
    import torch.nn.functional as F

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
