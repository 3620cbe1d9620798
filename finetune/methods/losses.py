"""What the training methods' losses share: forwards, label log-probs, the token loss, a MoE's router loss.
Each method's loss is in its module (finetune/methods/, the `Objective` interface in methods/base.py), built on
this one; the rank picks it from the method's record (finetune.rank.train.build_objective). Nothing here imports a method.

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
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from finetune.data.batches import SAMPLES
from finetune.data.images import seen
from finetune.data.tokenize import IGNORE

if TYPE_CHECKING:
    from finetune.methods.base import Output

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


def sequence_logps(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-probability of the labelled tokens (summed, fp32) and how many there are."""
    return logits_logps(forward(model, batch), batch["labels"], batch.get(SAMPLES))


def logits_logps(logits: torch.Tensor, labels: torch.Tensor, samples: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed label log-probs and labelled tokens; with `samples` (a padding-free batch's SAMPLES), each
    sample's instead."""
    return (row_sums(logits_token_logps(logits, labels), samples),
            row_sums((labels[:, 1:] != IGNORE).long(), samples))


def row_sums(values: torch.Tensor, samples: torch.Tensor | None) -> torch.Tensor:
    """Per-position values [B, T - 1] (position t predicts label t + 1) summed per row, or with `samples` per sample of a
    padding-free batch (finetune.data.batches.SAMPLES: which sample each token is), in the samples' order."""
    if samples is None:
        return values.sum(-1)
    owner = samples[:, 1:].reshape(-1)  # the sample of label t + 1 (a sample's first token has none: IGNORE)
    return values.new_zeros(sample_count(samples)).index_add(0, owner, values.reshape(-1))


def sample_count(samples: torch.Tensor) -> int:
    """How many samples a padding-free batch's SAMPLES holds: read from the micro-batch's host copy (finetune.rank.syncs)."""
    from finetune.data.host import host_copy, on_host

    host = host_copy(samples, "the samples of a padding-free batch")
    with on_host():
        return int(host[0, -1]) + 1


def logits_token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label t+1) at every position t (fp32; 0 where the label is ignored): B x (T - 1)."""
    logits = predicting(logits, labels).float()
    targets = labels[:, 1:]
    return -F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                            reduction="none").view_as(targets)


def token_logps(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token log-probs of the labelled tokens (logits_token_logps of the model's forward)."""
    return logits_token_logps(forward(model, batch), batch["labels"])


def labelled_logps(model: Any, batch: dict[str, torch.Tensor], router: bool = False) -> tuple[torch.Tensor, Any]:
    """`token_logps` and the router's loss (forward_aux's); of a padding-free batch, with the logits computed at the
    positions whose next token is labelled only (transformers' `logits_to_keep`: the output layer and its log-softmax
    skip every prompt token, as TRL's GRPOTrainer does), where the model takes it. The same values either way."""
    labels = batch["labels"]
    if SAMPLES not in batch or not keeps_logits(model):
        logits, aux = forward_aux(model, batch, router)
        return logits_token_logps(logits, labels), aux
    keep = (labels[0, 1:] != IGNORE).nonzero().flatten()  # positions t predicting a label t + 1
    logits, aux = forward_aux(model, batch, router, logits_to_keep=keep)
    values = -F.cross_entropy(logits[0].float(), labels[0, keep + 1], reduction="none")
    return values.new_zeros(labels.shape[1] - 1).index_put((keep,), values)[None], aux


def keeps_logits(model: Any) -> bool:
    """The causal LM under DDP, DeepSpeed's engine, torch.compile or PEFT takes `logits_to_keep` (transformers' own
    families do; a remote-code model may not)."""
    import inspect

    from transformers import PreTrainedModel

    inner = getattr(model, "_orig_mod", model)
    while (not isinstance(inner, PreTrainedModel) and not hasattr(inner, "get_base_model")
           and isinstance(getattr(inner, "module", None), torch.nn.Module)):  # DistributedDataParallel, a DeepSpeed engine
        inner = getattr(inner.module, "_orig_mod", inner.module)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def forward(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a plain (attention mask) or packed (position ids, no mask) batch."""
    return forward_aux(model, batch, False)[0]


def forward_aux(model: Any, batch: dict[str, torch.Tensor], router: bool, **keep: Any) -> tuple[torch.Tensor, Any]:
    """Logits, and with `router` the MoE's load-balancing loss (output_router_logits; None without). `keep`:
    logits_to_keep, the positions whose logits are made (`labelled_logps`)."""
    extra = {"output_router_logits": True} if router else {}
    extra |= keep
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                position_ids=batch.get("position_ids"), use_cache=False, **extra, **seen(batch))  # a VLM's rows' images
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

