"""The engines as records, read by both sides (no torch): which engine a config runs on, what the launcher starts for
it, what a rank builds, what its checkpoints are. What both sides know of a layout lives beside them: zero.py (the
DeepSpeed JSON), mesh.py (whether a model's shape allows tp, pp, cp).

Adding an engine is a record in ENGINES plus its class under finetune/rank/engine/ (the Engine protocol,
finetune/rank/engine/base.py); engine_kind, launcher_for, the rank's engine.build and the checkpoints read the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from finetune.config import Config, LauncherName, Strategy


@dataclass(frozen=True)
class EngineRecord:
    """One engine: which configs run on it and what each side does for it."""

    name: str
    """engine_kind's word; a checkpoint's meta.json records it, and a resume runs on the same engine."""
    runs: Callable[[Config], bool]
    """Whether a config runs on it: ENGINES is asked in order, the first that runs a config is its engine."""
    builds: str
    """"module:Class" a rank builds (finetune.rank.engine.build): Class.from_config(model, cfg, dist)."""
    launcher: LauncherName
    """What launcher=auto starts for it (one process on one node is the rank itself, launcher.command)."""
    layouts: str
    """The layouts it runs, in words."""
    checkpoint: str
    """What its checkpoints hold, in words."""


def _mesh(cfg: Config) -> bool:
    p = cfg.parallelism
    return p.strategy == Strategy.fsdp or p.tp * p.pp * p.cp > 1


ENGINES: tuple[EngineRecord, ...] = (
    EngineRecord("deepspeed", lambda cfg: cfg.zero.enabled, "finetune.rank.engine.deepspeed_engine:DeepSpeedEngine",
                 LauncherName.deepspeed, "ZeRO stages 0-3 with CPU or NVMe offload of the optimizer and the parameters",
                 "DeepSpeed's checkpoint: each rank's ZeRO partitions of the weights and optimizer states"),
    EngineRecord("mesh", _mesh, "finetune.rank.engine.mesh_engine:MeshEngine", LauncherName.torchrun,
                 "FSDP2, tensor, pipeline and context parallel on one DeviceMesh",
                 "torch.distributed.checkpoint: every rank writes its own shards (DTensor-aware)"),
    EngineRecord("torch", lambda cfg: True, "finetune.rank.engine.torch_engine:TorchEngine", LauncherName.torchrun,
                 "one process, or DDP", "torch.save of the model's and the optimizer's state by rank 0"),
)
"""Every engine, in the order a config is matched against them (the torch engine takes what no other runs)."""


def engine_of(cfg: Config) -> EngineRecord:
    """The engine `cfg` runs on."""
    return next(e for e in ENGINES if e.runs(cfg))


def engine_kind(cfg: Config) -> str:
    """deepspeed (a ZeRO stage), mesh (FSDP2 / tensor / pipeline / context parallel) or torch (single, DDP)."""
    return engine_of(cfg).name


def launcher_for(cfg: Config) -> LauncherName:
    """Which launcher `launcher=auto` means: the engine's (deepspeed for DeepSpeed's, else torchrun)."""
    return cfg.launcher.name if cfg.launcher.name != LauncherName.auto else engine_of(cfg).launcher
