"""What the engines share: the step result, the optimizer and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from finetune.config import Optimizer, OptimConfig, Scheduler


@dataclass
class StepResult:
    loss_sum: float
    """This rank's summed loss over its micro-batches (the loop reduces and divides)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate this step used."""
    loss_scale: float | None = None
    """fp16: the dynamic loss scale after this step."""
    skipped: int = 0
    """fp16: optimizer steps skipped so far because gradients overflowed."""
    metrics: dict[str, float] = field(default_factory=dict)
    """This rank's sums of the objective's own metrics (DPO rewards...), reduced like `loss_sum`."""
    applied: bool = True
    """Whether the optimizer step was applied (False: skipped because the gradient norm was not finite)."""


def add_metrics(total: dict[str, float], sums: dict[str, Any]) -> None:
    """Accumulate an objective's metric sums (tensors) into `total` (floats)."""
    for k, v in sums.items():
        total[k] = total.get(k, 0.0) + float(v)


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The torch optimizer `optim.name` names, over `param_groups` (no decay on 1-D tensors).

    adamw: decoupled weight decay. adam: torch's Adam adds weight_decay * w to the gradient (L2
    regularisation, scaled by Adam's normalisation), a different regulariser at the same number.
    sgd: optim.momentum 0 keeps no state, > 0 one momentum buffer per parameter; betas/eps unused.
    adamw_8bit: bitsandbytes' AdamW8bit (runs on CPU too). adafactor: torch's, decoupled weight decay.
    (The DeepSpeed engine builds the same optimizers from `launcher.deepspeed_config`.)
    """
    groups = param_groups(params, cfg.weight_decay)
    if cfg.name == Optimizer.sgd:
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.name == Optimizer.adamw_8bit:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == Optimizer.adafactor:
        return torch.optim.Adafactor(groups, lr=cfg.lr)
    adam = {Optimizer.adamw: torch.optim.AdamW, Optimizer.adam: torch.optim.Adam}[cfg.name]
    return adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> Any:
    """Linear warmup, then cosine (to lr * min_lr_ratio) or linear decay, or constant."""
    from transformers import get_scheduler

    name, extra = {
        Scheduler.cosine: ("cosine_with_min_lr", {"min_lr_rate": cfg.min_lr_ratio}),
        Scheduler.linear: ("linear", {}),
        Scheduler.constant: ("constant_with_warmup", {}),
    }[cfg.scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=max_steps, scheduler_specific_kwargs=extra)


def autocast_dtype(name: Any) -> torch.dtype | None:
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name.value]


def param_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases and norm scales (1-D tensors), as is standard for transformers."""
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
