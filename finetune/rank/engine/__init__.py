"""How a step runs (rank side: torch). The loop calls one interface, `Engine` (base.py: train_step, inference,
frozen, generation_model, memory_targets, save, load, export, and the data layout dp_rank, dp_size, owner,
lockstep); engines differ behind it:

- `TorchEngine` (torch_engine.py): a plain module, DDP for data parallel, torch autocast + GradScaler.
- `DeepSpeedEngine` (deepspeed_engine.py): ZeRO stages 0-3 with CPU/NVMe offload, DeepSpeed's precision and scaler.
- `MeshEngine` (mesh_engine.py): FSDP2, tensor parallel and pipeline parallel on one DeviceMesh (pp, dp, tp).

common.py holds what they share (optimizer and schedule building, autocast, StepResult). `build` builds the one
the config's engine record (finetune.layouts.ENGINES) names.
"""

from __future__ import annotations

import importlib
from typing import Any

from finetune.config import Config
from finetune.layouts import engine_of
from finetune.rank.dist import Dist
from finetune.rank.engine.base import Engine
from finetune.rank.engine.common import StepResult, build_scheduler

__all__ = ["Engine", "StepResult", "build", "build_scheduler"]


def build(cfg: Config, model: Any, dist: Dist) -> Engine:
    """The engine `cfg` runs on (finetune.layouts.engine_of: its record names the class), built from the config."""
    module, _, name = engine_of(cfg).builds.partition(":")
    return getattr(importlib.import_module(module), name).from_config(model, cfg, dist)
