"""The engines and the layouts as records, read by both sides (no torch).

A layout (LAYOUTS) is one way of splitting a run over ranks: data parallel, FSDP2 and its offload, tensor, pipeline and
context parallel, a ZeRO stage, ZeRO's offloads. Its record says how the user spells it, which engines run it, what
applies it on a rank, its rules, its memory terms for the planner, what its checkpoint fixes and what it composes with.
An engine (ENGINES) is the class a rank builds to run a step; the engine of a config is the first one that runs all its
layouts. Who reads the records:
- engine_of / engine_kind / launcher_for (below), and through them finetune.rank.engine.build and the launch command;
- the launcher's rules (finetune/launcher/rules/layout.py): each layout's `rules`, then `check_composes`;
- the planner (finetune/planner/peak.py): each layout's `states` and `work` terms, in the records' order;
- the checkpoints (finetune/rank/checkpoint.py): `shape` is the layout a checkpoint records, `fixed` what a resume keeps.

Adding a layout is a record here (with its rules beside it: zero.py, mesh.py) plus its engine code on the rank and its
planner terms; tests/test_layouts.py fails for a record whose code, rules or terms are missing or do nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from finetune.config import Config, ConfigError, LauncherName, Offload, Strategy
from finetune.layouts import mesh, zero

Shape = Mapping[str, Any]
"""A run's layout as plain values (shape(cfg)): what a checkpoint records in its meta.json, and what a record's `uses`
reads, so a saved checkpoint's layouts are found the way a config's are."""


def shape(cfg: Config) -> dict[str, Any]:
    """The layout keys of `cfg` (finetune/rank/checkpoint.py saves them with the engine's name)."""
    p, z = cfg.parallelism, cfg.zero
    return {"world_size": cfg.world_size, "zero_stage": z.stage, "offload_optimizer": z.offload_optimizer.value,
            "offload_param": z.offload_param.value, "strategy": p.strategy.value, "fsdp_offload": p.fsdp_offload, "tp": p.tp,
            "pp": p.pp, "pp_stages_per_rank": p.pp_stages_per_rank, "cp": p.cp}


@dataclass(frozen=True)
class EngineRecord:
    """One engine: the class a rank builds, what starts it, what its checkpoints are."""

    name: str
    """engine_kind's word; a checkpoint's meta.json records it, and a resume runs on the same engine."""
    builds: str
    """"module:Class" a rank builds (finetune.rank.engine.build): Class.from_config(model, cfg, dist)."""
    launcher: LauncherName
    """What launcher=auto starts for it (one process on one node is the rank itself, launcher.command)."""
    checkpoint: str
    """What its checkpoints hold, in words."""
    resumes: str
    """Under what a checkpoint of it can be resumed: the end of a refused resume's line."""


ENGINES: tuple[EngineRecord, ...] = (
    EngineRecord("torch", "finetune.rank.engine.torch_engine:TorchEngine", LauncherName.torchrun,
                 "torch.save of the model's and the optimizer's state by rank 0",
                 "resume with a layout of the torch engine (parallelism=single or ddp, no zero, tp=pp=1), on any number of ranks"),
    EngineRecord("deepspeed", "finetune.rank.engine.deepspeed_engine:DeepSpeedEngine", LauncherName.deepspeed,
                 "DeepSpeed's checkpoint: each rank's ZeRO partitions of the weights and optimizer states",
                 "resume under DeepSpeed with the same zero stage and number of ranks"),
    EngineRecord("mesh", "finetune.rank.engine.mesh_engine:MeshEngine", LauncherName.torchrun,
                 "torch.distributed.checkpoint: every rank writes its own shards (DTensor-aware)",
                 "resume under fsdp or tp with the same pp, on any number of ranks (DCP reshards): on one process, "
                 "parallelism=fsdp launcher.nproc_per_node=1"),
)
"""Every engine, in the order a config is matched against them: the first that runs all of its layouts is its engine
(the torch engine runs one process and DDP; a config with no layout, parallelism=single, runs on it)."""


@dataclass(frozen=True)
class LayoutRecord:
    """One layout: each field is one thing the code needs of it (tests/test_layouts.py checks every one says something)."""

    name: str
    """Its word: in a refusal, in composes, in the tests."""
    spelled: Callable[[Config], str]
    """How the user asked for it (parallelism.tp=2, zero=stage3, ...), for the lines that name it."""
    uses: Callable[[Shape], bool]
    """Whether a run of this layout shape (shape(cfg), or a checkpoint's) uses it."""
    engines: tuple[str, ...]
    """The engines that run it (ENGINES' names)."""
    rank: str
    """"module:name" of what applies it on a rank (the test imports it)."""
    rules: Callable[[Config], None] | None
    """Its own rules, run by the launcher (finetune/launcher/rules/layout.py) on a config that uses it (ConfigError, one
    line); None: it has none beyond what it composes with."""
    states: str | None
    """"module:function" of its planner term on the model states (weights, gradients, optimizer states, where offload
    puts them): function(arch, cfg, states, counts, on_gpu, notes), in the records' order; None: it changes none."""
    work: str | None
    """"module:function" of its planner term on what one rank computes of a micro-batch (its tokens, blocks, micro-batches
    in flight): function(arch, cfg, work, notes); None: it changes none."""
    fixed: tuple[str, ...]
    """The shape keys a resume from its checkpoint cannot change (finetune.rank.checkpoint.check_compatible)."""
    composes: tuple[str, ...]
    """The layouts it runs together with (both ways); any other pair is refused by check_composes."""
    apart: str
    """Why it does not compose with the layouts it does not, and what to use instead: the end of that refusal's line."""


MESH_ONLY = "a layout of the mesh engine (FSDP2 / DTensor / pipelining), not of DeepSpeed's"
ZERO_APART = "ZeRO shards over data-parallel ranks on the DeepSpeed engine; FSDP2, tensor, pipeline and context parallel " \
             "run on the mesh engine: use parallelism=ddp with zero, or zero=none"
PLAN = "finetune.planner.terms:"


def _zero_stage(stage: int) -> LayoutRecord:
    return LayoutRecord(
        f"zero{stage}", lambda cfg: f"zero=stage{cfg.zero.stage}", lambda s: s["zero_stage"] == stage, ("deepspeed",),
        "finetune.rank.engine.deepspeed_engine:DeepSpeedEngine", zero.validate_stage, PLAN + "zero_partitions", None,
        ("world_size", "zero_stage"), ("ddp", *(("zero_offload_optimizer",) if stage >= 2 else ()),
                                       *(("zero_offload_param",) if stage == 3 else ())), ZERO_APART)


LAYOUTS: tuple[LayoutRecord, ...] = (
    *(_zero_stage(stage) for stage in range(4)),
    LayoutRecord("zero_offload_optimizer", lambda cfg: f"zero.offload_optimizer={cfg.zero.offload_optimizer.value}",
                 lambda s: s["offload_optimizer"] != Offload.none.value, ("deepspeed",), "finetune.layouts.zero:deepspeed_config",
                 zero.validate_offload_optimizer, PLAN + "zero_offload_optimizer", None, (),
                 ("zero2", "zero3", "zero_offload_param", "ddp"), ZERO_APART),
    LayoutRecord("zero_offload_param", lambda cfg: f"zero.offload_param={cfg.zero.offload_param.value}",
                 lambda s: s["offload_param"] != Offload.none.value, ("deepspeed",), "finetune.layouts.zero:deepspeed_config",
                 zero.validate_offload_param, PLAN + "zero_offload_param", None, (),
                 ("zero3", "zero_offload_optimizer", "ddp"), ZERO_APART),
    LayoutRecord("cp", lambda cfg: f"parallelism.cp={cfg.parallelism.cp}", lambda s: s["cp"] > 1, ("mesh",),
                 "finetune.rank.context:ContextParallel", mesh.validate_cp, None, PLAN + "context_work", (),
                 ("tp", "ddp", "fsdp", "fsdp_offload"),
                 "a pipeline stage hands whole sequences to the next: use cp with fsdp or ddp, and tp"),
    LayoutRecord("tp", lambda cfg: f"parallelism.tp={cfg.parallelism.tp}", lambda s: s["tp"] > 1, ("mesh",),
                 "finetune.rank.parallel:tensor_parallel", mesh.validate_tp, PLAN + "tensor_split", None, (),
                 ("cp", "pp", "ddp", "fsdp", "fsdp_offload"), MESH_ONLY + ": use parallelism=ddp with zero, or zero=none"),
    LayoutRecord("pp", lambda cfg: f"parallelism.pp={cfg.parallelism.pp}", lambda s: s["pp"] > 1, ("mesh",),
                 "finetune.rank.parallel:pipeline_stages", mesh.validate_pp, PLAN + "pipeline_split", PLAN + "pipeline_work",
                 ("pp", "pp_stages_per_rank"), ("tp", "ddp", "fsdp", "fsdp_offload"),
                 MESH_ONLY + ": use parallelism=ddp with zero, or zero=none"),
    LayoutRecord("ddp", lambda cfg: "parallelism=ddp", lambda s: s["strategy"] == Strategy.ddp.value, ("torch", "deepspeed", "mesh"),
                 "torch.nn.parallel:DistributedDataParallel", None, PLAN + "ddp_buckets", None, (),
                 ("zero0", "zero1", "zero2", "zero3", "zero_offload_optimizer", "zero_offload_param", "cp", "tp", "pp"),
                 "data parallel replicates the model; FSDP2 shards it: choose one, parallelism=ddp or parallelism=fsdp"),
    LayoutRecord("fsdp", lambda cfg: "parallelism=fsdp", lambda s: s["strategy"] == Strategy.fsdp.value, ("mesh",),
                 "finetune.rank.parallel:fully_shard", mesh.validate_fsdp, PLAN + "fsdp_shards", None, (),
                 ("fsdp_offload", "cp", "tp", "pp"), MESH_ONLY + ": use parallelism=ddp with zero, or zero=none"),
    LayoutRecord("fsdp_offload", lambda cfg: "parallelism.fsdp_offload=true", lambda s: bool(s["fsdp_offload"]), ("mesh",),
                 "finetune.rank.parallel:fully_shard", None, PLAN + "fsdp_offload", None, (),
                 ("fsdp", "cp", "tp", "pp"), "it offloads FSDP2's shards: use it with parallelism=fsdp"),
)
"""Every layout, in the order the planner applies their terms (a ZeRO stage before its offloads; tensor and pipeline
splits before FSDP shards what is left) and the rules run; a pair that does not compose is named by the earlier one."""


def layouts_of(cfg_or_shape: Config | Shape) -> list[LayoutRecord]:
    """The layouts a config (or a checkpoint's saved shape) uses, in LAYOUTS' order."""
    s = shape(cfg_or_shape) if isinstance(cfg_or_shape, Config) else cfg_or_shape
    return [rec for rec in LAYOUTS if rec.uses(s)]


def engine_of(cfg: Config) -> EngineRecord:
    """The engine `cfg` runs on: the first of ENGINES that runs all its layouts. Layouts no engine runs together
    (refused by check_composes) run on the first layout's engine, so that a rule may ask before they are refused."""
    used = layouts_of(cfg)
    for engine in ENGINES:
        if all(engine.name in rec.engines for rec in used):
            return engine
    return next(e for e in ENGINES if e.name == used[0].engines[0])


def engine_kind(cfg: Config) -> str:
    """deepspeed (a ZeRO stage), mesh (FSDP2 / tensor / pipeline / context parallel) or torch (single, DDP)."""
    return engine_of(cfg).name


def launcher_for(cfg: Config) -> LauncherName:
    """Which launcher `launcher=auto` means: the engine's (deepspeed for DeepSpeed's, else torchrun)."""
    return cfg.launcher.name if cfg.launcher.name != LauncherName.auto else engine_of(cfg).launcher


def check_composes(cfg: Config) -> None:
    """Refuse two layouts that do not run together (one line naming both, and the earlier one's reason)."""
    used = layouts_of(cfg)
    for i, a in enumerate(used):
        for b in used[i + 1:]:
            if b.name not in a.composes:
                raise ConfigError(f"{a.spelled(cfg)} does not compose with {b.spelled(cfg)}: {a.apart}")


def resolve(dotted: str) -> Any:
    """The object a record names as "module:name"."""
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)
