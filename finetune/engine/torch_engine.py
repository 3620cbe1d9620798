"""The torch engine: one module (DDP-wrapped for data parallel), AdamW, warmup + decay, clipping."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from finetune.config import OptimConfig, Scheduler, Strategy
from finetune.dist import Dist

Objective = Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class StepResult:
    loss_sum: float
    """This rank's summed loss over its micro-batches (the loop reduces and divides)."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate this step used."""


class TorchEngine:
    def __init__(self, model: torch.nn.Module, *, optim: OptimConfig, max_steps: int, strategy: Strategy, dist: Dist) -> None:
        self.dist = dist
        self.module = model
        ddp = strategy == Strategy.ddp and dist.world_size > 1
        self.model: torch.nn.Module = DistributedDataParallel(model) if ddp else model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.max_grad_norm = optim.max_grad_norm
        self.optimizer = build_optimizer(self.params, optim)
        self.scheduler = build_scheduler(self.optimizer, optim, max_steps)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], objective: Objective, count: float) -> StepResult:
        """One optimizer step over this rank's micro-batches.

        Args:
            micro_batches: this rank's share of the global batch.
            objective: returns the *summed* loss of a batch.
            count: loss units (response tokens) in the whole global batch, over all ranks.
        """
        self.model.train()
        lr = self.scheduler.get_last_lr()[0]
        loss_sum = 0.0
        for i, batch in enumerate(micro_batches):
            batch = {k: v.to(self.dist.device) for k, v in batch.items()}
            sync = i == len(micro_batches) - 1  # DDP all-reduces gradients on the last micro-batch only
            with contextlib.nullcontext() if sync or self.model is self.module else self.model.no_sync():
                loss = objective(self.model, batch)
                # Gradients accumulate as sums; DDP then averages over ranks, hence * world_size:
                # the step's gradient is d(sum of every rank's token losses)/dW / count.
                (loss * (self.dist.world_size / count)).backward()
            loss_sum += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm or math.inf)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum=loss_sum, grad_norm=float(norm), lr=lr)

    @torch.no_grad()
    def eval_loss(self, batch: dict[str, torch.Tensor], objective: Objective) -> float:
        """Summed loss of one batch, no gradients."""
        self.module.eval()
        return float(objective(self.module, {k: v.to(self.dist.device) for k, v in batch.items()}))

    @property
    def generation_model(self) -> torch.nn.Module:
        """The unwrapped model, for `generate` (each rank holds it whole under DDP)."""
        return self.module

    def export(self, path: Path, tokenizer: Any) -> None:
        """Hugging Face format (safetensors + config + tokenizer), written by rank 0."""
        if self.dist.is_main:
            self.module.save_pretrained(path)
            tokenizer.save_pretrained(path)
        self.dist.barrier()


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    # No weight decay on biases and norm scales (1-D tensors), as is standard for transformers.
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> Any:
    from transformers import get_scheduler

    name, extra = {
        Scheduler.cosine: ("cosine_with_min_lr", {"min_lr_rate": cfg.min_lr_ratio}),
        Scheduler.linear: ("linear", {}),
        Scheduler.constant: ("constant_with_warmup", {}),
    }[cfg.scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=max_steps, scheduler_specific_kwargs=extra)
