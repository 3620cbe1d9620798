"""The root of the config: the run's own group (`TrainConfig`), `Config` (one field per group), the groups as
Hydra's ConfigStore holds them (`register`), and the typed config's life: composed DictConfig -> `Config`
(`to_config`), written to RUN_DIR/config.yaml (`to_yaml`), read back by the ranks (`load`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from finetune.config.fields import NAMES, POSITIVE, TEXT, at_least, checked, spelling
from finetune.errors import ConfigError
from finetune.config.schema import (
    LOGGERS, MEMORY_REPORT_BOOLS, MEMORY_REPORTS, CheckpointingConfig, DataConfig, Device, HardwareConfig, LauncherConfig,
    LogitsConfig, MemoryReport, METHOD_CONFIGS, MethodConfig, ModelConfig, NonFinite, OptimConfig, ParallelismConfig, PeftConfig,
    PlanConfig, PrecisionConfig, Qat, ZeroConfig, method_schema,
)


@dataclass
class TrainConfig:
    max_steps: int | None = checked(at_least(1), 100)
    """Optimizer steps; null with `epochs`, which the launcher turns into max_steps before any rank starts."""
    epochs: float | None = checked(POSITIVE, None)
    """Passes over the training examples instead of max_steps (set max_steps=null; fractions such as 1.5 are fine):
    max_steps = ceil(epochs x examples / global_batch_size), the examples counted after packing (the token cache's
    count when it holds the run's data, else tokenized by the launcher without torch). Every example is seen once per
    whole epoch; the last step may take a few of the next epoch's. Not with data.streaming (no length ahead)."""
    micro_batch_size: int = checked(at_least(1), 8)
    """Samples per rank per forward/backward."""
    global_batch_size: int = checked(at_least(1), 32)
    """Samples per optimizer step over all ranks; accumulation = global / (micro x data-parallel)."""
    seed: int = checked(at_least(0), 42)
    """Data order; the same seed gives the same samples per step on any number of ranks."""
    eval_every: int = checked(at_least(0), 0)
    """Evaluate every N steps (0: only before and after training)."""
    eval_batch_size: int = checked(at_least(1), 32)
    """Samples per rank per forward in evaluation, exact match and the DPO reference pass."""
    exact_match_samples: int = checked(at_least(0), 0)
    """Eval rows scored by greedy generation (response == reference) before and after training."""
    max_new_tokens: int = checked(at_least(1), 64)
    """Generation length limit for exact match and the samples."""
    sample_prompts: int = checked(at_least(0), 0)
    """Generate for the first N eval prompts at each evaluation and log prompt, reference and output (metrics.jsonl rows
    of kind `sample`, a table in each tracker, text in TensorBoard); 0: off."""
    eval_tasks: list[str] = checked(NAMES, factory=list)
    """lm-evaluation-harness tasks run on final/ after training (rank 0; as `python -m finetune.evaluate RUN_DIR tasks=...`
    does): RUN_DIR/eval/results.json, summary.json's `benchmarks`, a `benchmark` row to the loggers. Shipped, offline:
    quickstart_exact, quickstart_choice; any lm-eval task name (`pip install -e ".[eval]"`). []: none."""
    log_every: int = checked(at_least(1), 10)
    """Print a metrics line every N steps when there is no progress bar."""
    progress_bar: bool = True
    """A tqdm progress bar on the main rank (else a metrics line every log_every steps)."""
    loggers: list[str] = checked(LOGGERS, factory=lambda: ["jsonl", "tensorboard"],
                                 hint="e.g. train.loggers=[jsonl,tensorboard,mlflow]")
    """Where the metrics go (finetune/logs/__init__.py SINKS): jsonl (RUN_DIR/metrics.jsonl, always, named or not: the summary, the
    loss plot and the sweep summary read it; train.loggers=[mlflow] resolves to [jsonl,mlflow]), tensorboard
    (RUN_DIR/tensorboard), and the trackers wandb, mlflow, trackio
    (finetune/logs/trackers.py; `pip install -e ".[track]"`, each configured by its own environment variables)."""
    group: str | None = checked(TEXT, None)
    """The trackers' group for this run (W&B group, MLflow parent run, trackio group); null: none, except that a
    sweep's trials get their sweep directory (the launcher sets it)."""
    tensorboard: bool | None = None
    """The older switch, still read: true adds tensorboard to train.loggers, false takes it out; null: as
    train.loggers says."""
    compile: bool = False
    """Compile each decoder layer in place (torch.compile, regional: one graph reused by every layer) for the
    training steps; evaluation and generation run eager. The first step (and each new shape) pays the
    compile time, reported apart as compile_s. CPU: inductor builds C++ with the system compiler."""
    memory_report: str = checked(MEMORY_REPORTS, "peak")
    """Measure memory over the first 2 steps: peak (the allocator's or the process's high-water mark, no cost), categories
    (parameters, gradients, optimizer, activations, with PyTorch's MemTracker: those steps run 2-3x slower) or off; printed
    beside the memory plan."""
    count_host_reads: bool = False
    """Count, in every training step, the ops that read a device value back on the host (each a sync that stalls a
    GPU's queue: `.item()`, `nonzero`, a boolean mask's indexing), logged as `host_reads`: the step reads none per
    micro-batch, and one (its numbers, with the loop's all-reduce) per step (finetune/rank/syncs.py). A diagnostic: the
    counting slows the step. On a GPU, torch.cuda.set_sync_debug_mode("warn") also names each sync."""
    memory_snapshot: bool = False
    """CUDA only: write RUN_DIR/memory_snapshot.pickle of the first steps (open it at pytorch.org/memory_viz)."""
    save_every: int = checked(at_least(0), 0)
    """Save a resumable checkpoint every N steps into RUN_DIR/checkpoints (0: never; SIGTERM/SIGINT
    save one at the next step boundary in any case)."""
    keep_checkpoints: int = checked(at_least(0), 0)
    """Keep only the newest K complete checkpoints (0: keep all)."""
    save_hf: bool = False
    """Write each checkpoint also as a transformers-loadable step-N/hf/ (the whole model, or the adapter with peft), as
    final/ is written; without it, `python -m finetune.export RUN_DIR --step N` converts a checkpoint afterwards."""
    neftune_alpha: float | None = checked(POSITIVE, None)
    """NEFTune: add uniform(-1, 1) x alpha / sqrt(L x d) noise to the input embeddings in training steps only (L: each
    sequence's real length, padding excluded; d: the hidden size); the paper uses 5 to 15. null: no noise."""
    on_nonfinite: NonFinite = NonFinite.stop
    """A step whose loss or gradient norm is inf/nan: stop (naming the step, weights untouched by
    it) or skip it (no update; counted as `nonfinite_skipped`). fp16's loss scaler skips overflowing
    gradients on its own either way."""
    resume: str | None = checked(TEXT, None)
    """null: start fresh; auto: the newest checkpoint in RUN_DIR/checkpoints (same hydra.run.dir),
    or start fresh if there is none; a path: that checkpoint directory."""
    overwrite: bool = False
    """Start over in a run directory that holds another run's checkpoints or final/: they (and its
    metrics and summary) are removed first. Without it (or train.resume) such a launch is refused."""
    device: Device = Device.auto
    """auto: cuda when available, else cpu."""
    qat: Qat | None = None
    """Quantization-aware training (torchao, finetune.rank.qat): the linear layers' forward sees their weights rounded to
    4 bits (int4_weight; int3_weight, int2_weight), and their inputs to int8 per token too (int8_dynamic_int4_weight),
    so the model trained survives that quantization; final/ keeps the weights in full precision and `python -m
    finetune.export RUN_DIR` writes them quantized (transformers' TorchAoConfig; int4 also as --gguf q4_0). null: off."""
    qat_group_size: int = checked(at_least(1), 32)
    """train.qat: weights sharing one scale along a row (32: GGUF Q4_0's block); layers whose input size it does not
    divide stay in full precision (the model line names them)."""
    qat_after_steps: int = checked(at_least(0), 0)
    """train.qat: the fake quantization starts after this many optimizer steps (torchtune's fake_quant_after_n_steps):
    the steps before train in full precision, the rest for the quantized grid, and every evaluation from then on is the
    quantized model's. 0: from the first step."""

    def __post_init__(self) -> None:
        # A str field, not an enum: OmegaConf refuses a bool for an enum, and true/false are still accepted (MEMORY_REPORT_BOOLS).
        word = spelling(str(self.memory_report))
        with contextlib.suppress(KeyError):
            self.memory_report = MEMORY_REPORT_BOOLS.get(word) or MemoryReport[word]
        if self.tensorboard is not None:  # train.tensorboard=true/false, as before train.loggers
            others = [name for name in self.loggers if name != "tensorboard"]
            self.loggers = [*others, "tensorboard"] if self.tensorboard else others
        if "jsonl" not in self.loggers:  # metrics.jsonl is always written (the summary, the plot, the sweep read it)
            self.loggers = ["jsonl", *self.loggers]


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    method: MethodConfig = MISSING
    precision: PrecisionConfig = MISSING
    checkpointing: CheckpointingConfig = MISSING
    logits: LogitsConfig = MISSING
    zero: ZeroConfig = MISSING
    parallelism: ParallelismConfig = MISSING
    peft: PeftConfig = MISSING
    optim: OptimConfig = MISSING
    launcher: LauncherConfig = MISSING
    train: TrainConfig = MISSING
    hardware: HardwareConfig = MISSING
    """The machine the memory plan is checked against; the ranks themselves ignore it."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """The memory planner's switches (plan.suggest, plan.force)."""
    run_dir: str | None = checked(TEXT, None)
    """Where the run writes; null: Hydra's run directory (`hydra.run.dir`)."""

    @property
    def world_size(self) -> int:
        return self.launcher.nproc_per_node * self.launcher.nnodes

    @property
    def data_parallel_size(self) -> int:
        p = self.parallelism
        return max(1, self.world_size // (p.tp * p.pp * p.cp))

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size)


GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "method": MethodConfig,
    "precision": PrecisionConfig,
    "checkpointing": CheckpointingConfig,
    "logits": LogitsConfig,
    "zero": ZeroConfig,
    "parallelism": ParallelismConfig,
    "peft": PeftConfig,
    "optim": OptimConfig,
    "launcher": LauncherConfig,
    "train": TrainConfig,
    "hardware": HardwareConfig,
}


def uses_deepspeed(cfg: Config) -> bool:
    """The DeepSpeed engine runs when a ZeRO stage is set."""
    return cfg.zero.enabled


def register() -> None:
    """Store the schemas: `base_config` for the root, `base_<group>` in each group. Called by finetune.launcher.compose, which
    composes: a rank only reads its config.yaml and needs no Hydra (its import is ~0.2 s of the rank's start)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schema in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
    for name, schema in METHOD_CONFIGS.items():  # recipes/method/NAME.yaml: defaults: [base_NAME]
        cs.store(group="method", name=f"base_{name}", node=schema)


# ---------------------------------------------------------------------------------------------
# Typed config <-> YAML


def to_config(dcfg: DictConfig) -> Config:
    """Resolve a composed DictConfig into the typed `Config`.

    Goes through a plain container so that keys added with `+key=...` are checked against the
    schema too (merging two DictConfigs would let them through).
    """
    plain = OmegaConf.to_container(dcfg, resolve=True)
    plain.pop("hydra", None)
    method = plain.get("method")
    if not isinstance(method, dict) or "name" not in method:  # the name picks the class: no default to fall back on
        raise ConfigError(f"method.name is missing: choose the method with method=NAME (one of {', '.join(METHOD_CONFIGS)})")
    name = method["name"]
    schema = method_schema(name)
    composed = OmegaConf.get_type(dcfg, "method") if "method" in dcfg else None  # the class Hydra composed the group with
    if isinstance(composed, type) and issubclass(composed, MethodConfig) and composed not in (schema, MethodConfig):
        raise ConfigError(f"method.name={name} with method={composed.name}: choose the method with method={name} (the group "
                          "option brings its keys); method.name only names it")
    merged = OmegaConf.merge(OmegaConf.structured(Config), {"method": OmegaConf.structured(schema)}, plain)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def to_yaml(cfg: Config) -> str:
    """The config as YAML, as OmegaConf writes it (through plain values: twice as fast as a structured config)."""
    return OmegaConf.to_yaml(_plain(cfg))


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def load(path: str | Path) -> Config:
    """Read a resolved config.yaml (what the launcher wrote into the run directory)."""
    return to_config(OmegaConf.load(path))
