"""How a step runs (rank side: torch). The loop calls one interface, `Engine` (base.py: train_step, inference,
frozen, generation_model, memory_targets, save, load, export, and the data layout dp_rank, dp_size, owner,
lockstep); engines differ behind it:

- `TorchEngine` (torch_engine.py): a plain module, DDP for data parallel, torch autocast + GradScaler.
- `DeepSpeedEngine` (deepspeed_engine.py): ZeRO stages 0-3 with CPU/NVMe offload, DeepSpeed's precision and scaler.
- `MeshEngine` (mesh_engine.py): FSDP2, tensor parallel and pipeline parallel on one DeviceMesh (pp, dp, tp).

common.py holds what they share (optimizer and schedule building, autocast, StepResult). `build` picks one.
"""

from __future__ import annotations

from typing import Any

from finetune.config import Config, engine_kind
from finetune.rank.dist import Dist
from finetune.rank.engine.base import Engine
from finetune.rank.engine.common import StepResult, build_scheduler

__all__ = ["Engine", "StepResult", "build", "build_scheduler"]


def build(cfg: Config, model: Any, dist: Dist) -> Engine:
    """The engine `cfg` runs on (config.engine_kind): mesh, deepspeed or torch."""
    kind = engine_kind(cfg)
    if kind == "mesh":
        from finetune.rank.engine.mesh_engine import MeshEngine

        return MeshEngine(model, cfg=cfg, dist=dist)
    if kind == "deepspeed":
        from finetune.rank.engine.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(model, cfg=cfg, dist=dist)
    from finetune.rank.engine.torch_engine import TorchEngine

    return TorchEngine(model, optim=cfg.optim, precision=cfg.precision, max_steps=cfg.train.max_steps,
                       strategy=cfg.parallelism.strategy, dist=dist)
