"""The torch engine: one module (DDP-wrapped for data parallel), AdamW/Adam/SGD, warmup + decay,
clipping, and autocast with a GradScaler for fp16; bf16_pure keeps the module itself in bf16 and
steps optimi's Kahan-compensated optimizers; optim.in_backward steps each parameter in its gradient hook."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from finetune.data.images import save_tokenizer
from finetune.config import Config, ConfigError, OptimConfig, Precision, PrecisionConfig, Strategy
from finetune.families.vision import parts
from finetune.rank.dist import Dist
from finetune.data.host import to_device
from finetune.rank.engine.common import (InBackward, StepResult, add_metrics, clip, skip_unless_finite, autocast_dtype, build_optimizer, build_scheduler, end_weights, lora_b, no_deepspeed_probe,
                                    place, read_for, training_dtype)

Objective = Callable[[Any, dict[str, torch.Tensor]], Any]
STATE_FILE = "state.pt"


class TorchEngine:
    """finetune.rank.engine.base.Engine on one module (DDP for data parallel)."""

    lockstep = False  # each rank holds the whole model: ranks may run different numbers of forwards
    owner = True  # every rank's data and loss count in global sums (no model-parallel copies)

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: Config, dist: Dist) -> TorchEngine:
        """The engine a run's config asks for (finetune.layouts.ENGINES: what finetune.rank.engine.build calls)."""
        return cls(model, optim=cfg.optim, precision=cfg.precision, max_steps=cfg.train.max_steps, strategy=cfg.parallelism.strategy,
                   dist=dist)

    def __init__(self, model: torch.nn.Module, *, optim: OptimConfig, precision: PrecisionConfig, max_steps: int,
                 strategy: Strategy, dist: Dist) -> None:
        self.dist = dist
        self.dp_rank, self.dp_size = dist.rank, dist.world_size
        check_precision(precision.name, dist.device)
        pure = precision.name == Precision.bf16_pure
        # fp32 master weights whatever the compute precision, or under bf16_pure the bf16 ones the optimizer updates;
        # a checkpoint read in bf16 is cast on the device
        self.weights_dtype = training_dtype(precision.name)
        place(model.parameters(), dist.device, self.weights_dtype)
        self.module = model.to(dist.device)  # and the buffers
        ddp = strategy == Strategy.ddp and dist.world_size > 1
        # a vision-language model: a row without images leaves its vision tower and projector out of the forward
        unused = parts(self.module).vision is not None
        self.model: torch.nn.Module = DistributedDataParallel(self.module, find_unused_parameters=unused) if ddp else self.module
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.max_grad_norm = optim.max_grad_norm
        kahan = precision.kahan_sum if pure else None
        fast = lora_b(self.module)  # LoRA+'s B matrices (their own rate with optim.loraplus_lr_ratio)
        ends = end_weights(self.module)  # the embeddings and output layer (optim=muon leaves them to AdamW)
        self.in_backward = InBackward(self.params, optim, kahan, fast, ends) if optim.in_backward else None
        self.optimizer = self.in_backward.lead if self.in_backward else build_optimizer(self.params, optim, kahan, fast=fast, ends=ends)
        self.scheduler = build_scheduler(self.optimizer, optim, max_steps)
        self.dtype = autocast_dtype(precision.name)
        self.scaler = None
        if precision.name == Precision.fp16:  # fp16 gradients underflow without loss scaling
            self.scaler = torch.amp.GradScaler(dist.device.type, init_scale=2.0**precision.initial_scale_power,
                                               growth_interval=precision.loss_scale_window)
        self.skipped = 0

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.dtype)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], objective: Objective, count: float) -> StepResult:
        """One optimizer step over this rank's micro-batches.

        Args:
            micro_batches: this rank's share of the global batch.
            objective: returns the *summed* loss of a batch and sums of its metrics.
            count: loss units (response tokens, pairs) in the whole global batch, over all ranks.
        """
        self.model.train()
        lr = self.scheduler.get_last_lr()[0]
        loss_sum, metrics = 0.0, {}
        if self.in_backward:
            return self._step_in_backward(micro_batches, objective, count, lr)
        for i, batch in enumerate(micro_batches):
            batch = to_device(batch, self.dist.device)
            sync = i == len(micro_batches) - 1  # DDP all-reduces gradients on the last micro-batch only
            with contextlib.nullcontext() if sync or self.model is self.module else self.model.no_sync():
                with self.autocast():
                    loss, sums = objective(self.model, batch)
                # Gradients accumulate as sums; DDP then averages over ranks, hence * world_size:
                # the step's gradient is d(sum of every rank's token losses)/dW / count.
                scaled = loss * (self.dist.world_size / count)
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            loss_sum = loss_sum + loss.detach().float()  # on the device: read once, by the loop
            add_metrics(metrics, sums)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        norm = clip(self.params, self.max_grad_norm)
        if self.scaler:
            scale = self.scaler._get_scale_async()
            before = scale.clone()
            self.scaler.step(self.optimizer)  # skipped when gradients hold inf/nan
            self.scaler.update()
            applied = scale >= before  # the scale backs off only on overflow
            self.skipped = self.skipped + (~applied).long()
        else:
            applied = skip_unless_finite(self.optimizer, norm)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum=loss_sum, grad_norm=norm, lr=lr,
                          loss_scale=self.scaler._get_scale_async() if self.scaler else None, skipped=self.skipped,
                          metrics=metrics, applied=applied)

    def _step_in_backward(self, micro_batches: list[dict[str, torch.Tensor]], objective: Objective, count: float,
                          lr: float) -> StepResult:
        """optim.in_backward: one micro-batch (the rules refuse accumulation), whose backward steps every parameter."""
        (batch,) = micro_batches
        batch = to_device(batch, self.dist.device)
        assert self.in_backward is not None
        self.in_backward.begin()
        with self.autocast():
            loss, sums = objective(self.model, batch)
        (loss * (self.dist.world_size / count)).backward()  # each parameter steps, and drops its gradient, in here
        self.in_backward.end()
        self.scheduler.step()
        metrics: dict[str, float] = {}
        add_metrics(metrics, sums)
        return StepResult(loss_sum=loss.detach().float(), grad_norm=self.in_backward.norm(), lr=lr, metrics=metrics)

    @torch.no_grad()
    def inference(self, fn: Objective, batch: dict[str, torch.Tensor]) -> Any:
        """fn(model, batch) in eval mode, without gradients, in the compute precision."""
        self.module.eval()
        with self.autocast():
            return fn(self.module, {k: v.to(self.dist.device) for k, v in batch.items()})

    def frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model beside the policy (DPO's live reference): on the device, eval mode, no grads."""
        place(model.parameters(), self.dist.device, read_for(model))
        return model.to(self.dist.device).eval().requires_grad_(False)

    @property
    def generation_model(self) -> torch.nn.Module:
        """The unwrapped model, for `generate` (each rank holds it whole under DDP)."""
        return self.module

    def memory_targets(self) -> tuple[torch.nn.Module, torch.optim.Optimizer | list[torch.optim.Optimizer]]:
        return self.module, self.in_backward.optimizers if self.in_backward else self.optimizer

    def save(self, directory: Path, step: int) -> None:
        """Model, optimizer, scheduler and scaler into `directory` (ranks hold the same state: rank 0 writes)."""
        if self.dist.is_main:
            state = {"step": step, "model": self.module.state_dict(), "optimizer": (self.in_backward or self.optimizer).state_dict(),
                     "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else None,
                     "skipped": self.skipped}
            torch.save(state, directory / STATE_FILE)

    def load(self, step_dir: Path) -> int:
        if not (step_dir / STATE_FILE).is_file():
            raise ConfigError(f"train.resume: {step_dir} holds no torch-engine checkpoint ({STATE_FILE}); was it saved with zero=none?")
        state = torch.load(step_dir / STATE_FILE, map_location=self.dist.device, weights_only=False)
        self.module.load_state_dict(state["model"])
        (self.in_backward or self.optimizer).load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped = state["skipped"]
        return state["step"]

    def export(self, path: Path, tokenizer: Any) -> None:
        """Hugging Face format (safetensors + config + tokenizer), written by rank 0; a pissa/olora adapter converted to
        one of the original base (model.adapter_save_kwargs)."""
        from finetune.rank.model import adapter_save_kwargs

        if self.dist.is_main:
            with no_deepspeed_probe(), adapter_save_kwargs(self.module) as kwargs:
                self.module.save_pretrained(path, **kwargs)
            save_tokenizer(tokenizer, path)
        self.dist.barrier()


def check_precision(name: Precision, device: torch.device) -> None:
    """Refuse a precision this device cannot compute in, naming what it can."""
    if device.type == "cuda" and name in (Precision.bf16, Precision.bf16_pure) and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"precision={name.value} needs an Ampere or newer GPU ({torch.cuda.get_device_name(device)} has no bf16): use precision=fp16")
