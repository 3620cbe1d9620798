"""The DeepSpeed engine: ZeRO stages 0-3, CPU/NVMe offload, DeepSpeed's fp16 scaler / bf16.

The JSON comes from `layouts.zero.deepspeed_config` (the same pure function the launcher wrote
RUN_DIR/deepspeed.json with); the learning-rate schedule is the torch engine's, handed to
DeepSpeed as a client scheduler so both engines follow the same curve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from finetune.data.images import save_tokenizer
from finetune.config import Config, ConfigError, Precision
from finetune.rank.dist import Dist, import_deepspeed
from finetune.data.host import to_device
from finetune.rank.engine.common import (StepResult, add_metrics, autocast_dtype, build_scheduler, lora_b, loraplus_lr, param_groups, place,
                                         read_for, training_dtype)
from finetune.layouts.zero import deepspeed_config

Objective = Callable[[Any, dict[str, torch.Tensor]], Any]


class DeepSpeedEngine:
    """finetune.rank.engine.base.Engine on DeepSpeed ZeRO stages 0-3."""

    owner = True  # every rank's data and loss count in global sums
    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: Config, dist: Dist) -> DeepSpeedEngine:
        """The engine a run's config asks for (finetune.layouts.ENGINES: what finetune.rank.engine.build calls)."""
        return cls(model, cfg=cfg, dist=dist)

    def __init__(self, model: torch.nn.Module, *, cfg: Config, dist: Dist) -> None:
        deepspeed = import_deepspeed()
        from deepspeed.accelerator import get_accelerator

        if cfg.precision.name == Precision.fp16 and not get_accelerator().is_fp16_supported():
            raise ConfigError(f"precision=fp16 is not supported by DeepSpeed's {get_accelerator().device_name()} accelerator: use precision=bf16 or fp32")
        if cfg.precision.name == Precision.bf16 and not get_accelerator().is_bf16_supported():
            raise ConfigError(f"precision=bf16 is not supported by DeepSpeed's {get_accelerator().device_name()} accelerator: use precision=fp16 or fp32")
        self.dist = dist
        self.dp_rank, self.dp_size = dist.rank, dist.world_size
        self.stage = cfg.zero.stage
        self.lockstep = self.stage == 3 and dist.world_size > 1  # parameters are gathered collectively
        self.fp16 = cfg.precision.name == Precision.fp16
        self.dtype = autocast_dtype(cfg.precision.name)
        self.weights_dtype = training_dtype(cfg.precision.name)
        if self.stage < 3:  # a checkpoint read in bf16, cast on the device (ZeRO-3's zero.Init read it into partitions)
            place(model.parameters(), dist.device, self.weights_dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(params, cfg.optim.weight_decay, fast=lora_b(model), fast_lr=loraplus_lr(cfg.optim)),
            config=deepspeed_config(cfg),
            lr_scheduler=lambda opt: build_scheduler(opt, cfg.optim, cfg.train.max_steps),
        )
        self.module = self.engine.module
        self.config = deepspeed_config(cfg)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], objective: Objective, count: float) -> StepResult:
        """One optimizer step: DeepSpeed steps at the accumulation boundary (the last micro-batch)."""
        self.engine.train()
        lr = self.scheduler.get_last_lr()[0]
        loss_sum, norm, metrics = 0.0, None, {}
        for i, batch in enumerate(micro_batches):
            batch = to_device(batch, self.engine.device)
            loss, sums = objective(self.engine, batch)
            # DeepSpeed averages gradients over ranks (hence * world_size); we normalise by the
            # global token count ourselves, so no extra 1/accumulation scaling.
            self.engine.backward(loss * (self.dist.world_size / count), scale_wrt_gas=False)
            if self.stage == 0 and i == len(micro_batches) - 1:  # ZeRO off: DeepSpeed reports no norm
                norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in self.module.parameters() if p.grad is not None]))
            self.engine.step()
            loss_sum = loss_sum + loss.detach().float()  # on the device: read once, by the loop
            add_metrics(metrics, sums)
        norm = self.engine.get_global_grad_norm() if norm is None else norm  # DeepSpeed's step reads its own numbers
        return StepResult(loss_sum=loss_sum, grad_norm=norm if norm is not None else float("nan"), lr=lr,
                          loss_scale=self.engine.optimizer.loss_scale if self.fp16 else None,
                          skipped=self.engine.skipped_steps, metrics=metrics)

    @torch.no_grad()
    def inference(self, fn: Objective, batch: dict[str, torch.Tensor]) -> Any:
        """fn(model, batch) in eval mode, without gradients (DeepSpeed's precision; ZeRO-3 gathers)."""
        self.engine.eval()
        return fn(self.engine, {k: v.to(self.engine.device) for k, v in batch.items()})

    def frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model beside the policy (DPO's live reference), in an optimizer-less DeepSpeed
        engine: the same precision, and under ZeRO-3 sharded like the policy (built in zero.Init)."""
        import copy

        deepspeed = import_deepspeed()
        config = copy.deepcopy(self.config)
        for key in ("optimizer", "scheduler", "gradient_clipping"):
            config.pop(key, None)
        zero = config["zero_optimization"]
        if zero["stage"] != 3:  # nothing to shard without gradients or optimizer states
            config["zero_optimization"] = {"stage": 0}
        else:
            zero.pop("offload_optimizer", None)
        model.requires_grad_(False)
        if self.stage < 3:
            place(model.parameters(), self.dist.device, read_for(model))
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine

    @property
    def generation_model(self) -> torch.nn.Module:
        """The module; under ZeRO-3 its forward gathers parameters (generate with synced_gpus)."""
        return self.module

    def memory_targets(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The module and the torch optimizer inside DeepSpeed's ZeRO wrapper (it holds the states)."""
        return self.module, getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)

    def save(self, directory: Path, step: int) -> None:
        """DeepSpeed's sharded checkpoint into `directory` (every rank writes its shard).

        A write that fails (a full disk) must not leave the other ranks waiting in save_checkpoint's
        collectives (ZeRO-3 gathers parameters again after writing, then every rank meets in a
        barrier): each of its writes goes through `Writes`, which keeps the first failure and skips the
        writes after it, so every rank runs the whole sequence; the failure is raised after it."""
        writes = Writes(self.engine.checkpoint_engine)
        self.engine.checkpoint_engine = writes
        self.engine._copy_recovery_script = lambda path, copy=self.engine._copy_recovery_script: writes.guard(copy, path)
        try:
            self.engine.save_checkpoint(str(directory.parent), tag=directory.name, client_state={"step": step}, save_latest=False)
        finally:
            self.engine.checkpoint_engine = writes.inner
            del self.engine._copy_recovery_script  # the engine's own method again
        if writes.failure is not None:
            raise writes.failure

    def load(self, step_dir: Path) -> int:
        path, client = self.engine.load_checkpoint(str(step_dir.parent), tag=step_dir.name)
        if path is None:
            raise ConfigError(f"train.resume: {step_dir} holds no DeepSpeed checkpoint; was it saved with a zero option?")
        return int(client["step"])

    def export(self, path: Path, tokenizer: Any) -> None:
        """Consolidated Hugging Face weights: under ZeRO-3 gathered from every rank's shard."""
        state = self.engine._zero3_consolidated_16bit_state_dict() if self.stage == 3 else None  # collective
        if self.dist.is_main:
            self.module.save_pretrained(path, state_dict=state)
            save_tokenizer(tokenizer, path)
        self.dist.barrier()


class Writes:
    """A DeepSpeed checkpoint engine's writes, guarded: the first failure is kept (and raised by
    `DeepSpeedEngine.save` once the save's collectives are over), the writes after it skipped."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.failure = inner, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        self.guard(self.inner.save, state_dict, path)

    def guard(self, write: Callable[..., Any], *args: Any) -> None:
        if self.failure is None:
            try:
                write(*args)
            except Exception as e:  # noqa: BLE001 - raised after the collectives
                self.failure = e
