"""The typed config: one dataclass per group, registered in Hydra's ConfigStore (the cross-group rules that no
single group can check are finetune/launcher/rules/).

Every group YAML starts with `defaults: [base_<group>]`, so a typo (`optim.lrr=...`) or a wrong
type (`optim.lr=fast`) fails when Hydra composes, naming the key. `validate` then checks what
spans groups (batch sizes vs. launch size, options that need each other) and raises
`ConfigError` with one line that names the keys and says what to do.

This module imports no torch: the launcher and a dry run stay instant.

The package: fields.py (what a field accepts, how an enum is spelled), schema.py (the enums and the groups'
dataclasses; data.py: the data group's), root.py (train, the root `Config`, register / to_config / to_yaml / load). Every name is
re-exported here: `from finetune.config import X` is how the rest of finetune reads the schema.
"""

from __future__ import annotations

from typing import Any

from finetune import optimizers
from finetune.config.fields import (
    ASSETS, Accepts, at_least, in_range, unused, one_of, POSITIVE, PROBABILITY, PORT, TEXT, SOURCES, ANY_TEXT,
    NAMES, SOME_NAMES, ENV, BETAS, EXISTING_FILE, EXISTING_DIR, ARCHITECTURE, HOST_PORT, checked, check_fields,
    machine_ram_gib, ENUM_ALIASES, spelling, Spelled
)
from finetune.config.root import (
    TrainConfig, Config, GROUPS, uses_deepspeed, register, to_config, to_yaml, load
)
from finetune.config.schema import (
    AttnImpl, DataFormat, Template, LongPrompt, Reasoning, Reference, Precision, Fp8Scaling, Qat, Offload, Checkpointing,
    Logits, LogitsKernel, Kernels, LoraInit, PeftMethod, QuantType, Strategy, PipeSchedule, StateDtype, OptimKernel,
    OPTIMIZER, LOGGERS, Scheduler, LauncherName, NonFinite, Device, MemoryReport, MEMORY_REPORT_BOOLS,
    MEMORY_REPORTS, ModelInit, ModelConfig, DataConfig, MethodConfig, METHOD_CONFIGS, METHOD_NAME, method_schema, PrecisionConfig, CheckpointingConfig,
    LogitsConfig, ZeroConfig, ParallelismConfig, PeftConfig, OptimConfig, LauncherConfig, PlanConfig, HardwareConfig
)
from finetune.errors import ConfigError, did_you_mean

__all__ = [
    "ANY_TEXT", "ARCHITECTURE", "ASSETS", "BETAS", "ENUM_ALIASES", "ENV", "EXISTING_DIR", "EXISTING_FILE", "GROUPS",
    "HOST_PORT", "LOGGERS", "MEMORY_REPORTS", "MEMORY_REPORT_BOOLS", "NAMES", "OPTIMIZER", "PORT", "POSITIVE",
    "PROBABILITY", "Qat", "SOME_NAMES", "SOURCES", "TEXT", "Accepts", "AttnImpl", "Checkpointing", "CheckpointingConfig",
    "Config", "ConfigError", "DataConfig", "DataFormat", "Device", "Fp8Scaling", "HardwareConfig", "Kernels",
    "LauncherConfig", "LauncherName", "Logits", "LogitsConfig", "LogitsKernel", "LongPrompt", "MemoryReport",
    "METHOD_CONFIGS", "METHOD_NAME", "MethodConfig", "ModelConfig", "ModelInit", "NonFinite", "Offload", "OptimConfig", "OptimKernel",
    "LoraInit", "ParallelismConfig", "PeftConfig", "PeftMethod", "PipeSchedule", "PlanConfig", "Precision", "PrecisionConfig",
    "QuantType", "Reasoning", "Reference", "Scheduler", "Spelled", "StateDtype", "Strategy", "Template", "TrainConfig",
    "ZeroConfig", "at_least", "check_fields", "checked", "did_you_mean", "in_range", 
    "load", "machine_ram_gib", "method_schema", "one_of", "register", "spelling", "to_config", "to_yaml", "unused", "uses_deepspeed"
]


def __getattr__(name: str) -> Any:
    if name == "Optimizer":  # the built-in optimizer names as an enum, where they were defined before finetune/optimizers/
        return optimizers.Optimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
