"""The distributed rules: the launcher and its rendezvous, the hardware, ZeRO, the parallel layout (and whether the
model's shape and family allow it), context parallel, the batch sizes against the data-parallel size.
"""

from __future__ import annotations

from dataclasses import fields

from finetune.config import (Checkpointing, Config, ConfigError, LauncherConfig, LauncherName, Offload, ParallelismConfig, PeftMethod,
                             PipeSchedule, Precision, Reference, Strategy, unused as _unused)
from finetune.layouts import launcher_for
from finetune import methods
from finetune.disk import model_config
from finetune.families import router_loss_split
from finetune.layouts.mesh import check_layout_fits_model
from finetune.launcher.rules.model import model_shape


def layout_words(p: ParallelismConfig) -> str:
    """The layout as the user spelled it: parallelism=fsdp, parallelism.tp=2, ..."""
    return ", ".join([*(["parallelism=fsdp"] if p.strategy == Strategy.fsdp else []),
                      *([f"parallelism.tp={p.tp}"] if p.tp > 1 else []), *([f"parallelism.pp={p.pp}"] if p.pp > 1 else []),
                      *([f"parallelism.cp={p.cp}"] if p.cp > 1 else [])])


def validate_batches(cfg: Config) -> None:
    """The launch size against parallelism=single, the batch sizes against the data-parallel size, the
    micro-batches per step against a pipeline schedule."""
    world, t, launch = cfg.world_size, cfg.train, cfg.launcher
    if cfg.parallelism.strategy == Strategy.single and world != 1:
        raise ConfigError(
            f"parallelism=single runs one process, but the launcher starts {world} "
            f"(launcher.nproc_per_node={launch.nproc_per_node} x launcher.nnodes={launch.nnodes}): "
            "use parallelism=ddp or launcher.nproc_per_node=1"
        )
    per_step = t.micro_batch_size * cfg.data_parallel_size
    if t.global_batch_size < cfg.data_parallel_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is smaller than the data-parallel size "
            f"{cfg.data_parallel_size}: every rank needs at least one sample per step"
        )
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
            f"{t.micro_batch_size} x data-parallel size {cfg.data_parallel_size} = {per_step}: "
            f"use e.g. train.global_batch_size={max(per_step, t.global_batch_size // per_step * per_step)}"
        )
    p = cfg.parallelism
    stages = p.pp * p.pp_stages_per_rank
    if p.pp > 1 and p.pp_schedule != PipeSchedule.gpipe and cfg.grad_accum_steps < stages:
        raise ConfigError(
            f"parallelism.pp_schedule={p.pp_schedule.value} needs at least as many micro-batches per step as pipeline stages "
            f"({stages}), got {cfg.grad_accum_steps} (train.global_batch_size={t.global_batch_size} / (train.micro_batch_size="
            f"{t.micro_batch_size} x data-parallel {cfg.data_parallel_size})): lower train.micro_batch_size"
        )
    if p.pp_schedule == PipeSchedule.interleaved_1f1b and p.pp > 1 and cfg.grad_accum_steps % p.pp:
        raise ConfigError(f"parallelism.pp_schedule=interleaved_1f1b needs a micro-batch count per step ({cfg.grad_accum_steps}) "
                          f"that is a multiple of parallelism.pp={p.pp}: change train.micro_batch_size or train.global_batch_size")


def validate_layout(cfg: Config) -> None:
    p, launch, world = cfg.parallelism, cfg.launcher, cfg.world_size
    model_parallel = p.tp * p.pp * p.cp
    if model_parallel > 1 and world % model_parallel:
        cp = f" x parallelism.cp={p.cp}" if p.cp > 1 else ""
        raise ConfigError(
            f"parallelism.tp={p.tp} x parallelism.pp={p.pp}{cp} = {model_parallel} ranks per model replica does not divide the "
            f"launch size {world} (launcher.nproc_per_node={launch.nproc_per_node} x launcher.nnodes={launch.nnodes}): "
            f"launch a multiple of {model_parallel} ranks"
        )
    if model_parallel > 1 and p.strategy == Strategy.single:
        cp = f"/cp={p.cp}" if p.cp > 1 else ""
        raise ConfigError(f"parallelism.tp={p.tp}/pp={p.pp}{cp} need parallelism.strategy=ddp or fsdp (data parallel over "
                          f"world / (tp x pp{' x cp' if cp else ''}) replicas), not single")
    if p.pp == 1:
        _unused(p, "parallelism", ("strategy", "tp", "pp", "cp", "fsdp_reshard_after_forward", "fsdp_offload"), "without pipeline parallel (pp=1)")
    if p.strategy != Strategy.fsdp:
        _unused(p, "parallelism", ("strategy", "tp", "pp", "cp", "pp_schedule", "pp_stages_per_rank"), f"with strategy={p.strategy.value} (only with fsdp)")
    interleaved = p.pp_schedule == PipeSchedule.interleaved_1f1b
    if p.pp > 1 and interleaved != (p.pp_stages_per_rank > 1):
        raise ConfigError(f"parallelism.pp_schedule={p.pp_schedule.value} with pp_stages_per_rank={p.pp_stages_per_rank}: "
                          "interleaved_1f1b needs 2 or more stages per rank, gpipe and 1f1b exactly 1")
    shape = model_shape(cfg.model)
    if shape is not None:
        check_layout_fits_model(p, shape)
    if not (model_parallel > 1 or p.strategy == Strategy.fsdp):
        return
    layout = f"parallelism.strategy={p.strategy.value} tp={p.tp} pp={p.pp}"
    if cfg.precision.name == Precision.fp16:
        raise ConfigError(f"precision=fp16 is not supported with {layout} (no sharded loss scaler here): use precision=bf16")
    if cfg.peft.name == PeftMethod.qlora and p.tp > 1:
        raise ConfigError(f"peft=qlora is not supported with tensor parallel (parallelism.tp={p.tp}): bitsandbytes keeps a 4-bit "
                          "weight as one flat buffer of packed pairs with per-block constants, which has no rows or columns to "
                          "split (no maintained library splits it): use peft=qlora with parallelism=fsdp or pp, or peft=lora with tp")
    if p.cp > 1:
        validate_context_parallel(cfg)
    if cfg.peft.name == PeftMethod.dora and p.tp > 1:
        raise ConfigError("peft=dora is not supported with tensor parallel (its weight norm spans the sharded dimension): "
                          "use peft=lora with tp, or dora with fsdp/ddp")
    if p.pp > 1:
        if (ref := methods.get(cfg.method.name).reference(cfg.method)) not in (None, Reference.precomputed):
            raise ConfigError(f"method.reference={ref.value} is not supported with pipeline parallel: "
                              "use method.reference=precomputed")
        if cfg.checkpointing.name == Checkpointing.offload:
            raise ConfigError("checkpointing=offload is not supported with pipeline parallel: use checkpointing=full or selective")


def validate_context_parallel(cfg: Config) -> None:
    """What context parallel (finetune/rank/context.py) does not combine with, and why."""
    p = cfg.parallelism
    if p.pp > 1:
        raise ConfigError(f"parallelism.cp={p.cp} with pipeline parallel (parallelism.pp={p.pp}) is not supported (a stage hands "
                          "whole sequences to the next): use cp with fsdp or ddp, and tp")
    method = methods.get(cfg.method.name)
    if method.split_tokens:
        raise ConfigError(f"method={method.name} with parallelism.cp={p.cp} is not supported: {method.split_tokens}")
    arch = model_config(cfg.model)
    if arch is not None and arch.get("output_router_logits") is True:
        raise ConfigError(router_loss_split(f"parallelism.cp={p.cp}"))


def validate_hardware(cfg: Config) -> None:
    """A GPU launch cannot start more ranks on a node than the declared hardware has GPUs."""
    hw, launch = cfg.hardware, cfg.launcher
    if hw.gpu_memory_gib and launch.nproc_per_node > hw.gpus_per_node:
        raise ConfigError(f"launcher.nproc_per_node={launch.nproc_per_node} exceeds hardware.gpus_per_node={hw.gpus_per_node} of "
                          f"hardware={hw.name}: lower launcher.nproc_per_node, or declare the machine with hardware.gpus_per_node=N")


def validate_launcher(cfg: Config) -> None:
    """launcher.node_rank within launcher.nnodes; the c10d rendezvous (launcher.rdzv_endpoint) against the static one
    and the deepspeed launcher; a trial's own devices (launcher.devices_per_trial) against its ranks."""
    if cfg.launcher.node_rank >= cfg.launcher.nnodes:
        raise ConfigError(f"launcher.node_rank={cfg.launcher.node_rank} must be in [0, launcher.nnodes={cfg.launcher.nnodes})")
    per, ranks = cfg.launcher.devices_per_trial, cfg.launcher.nproc_per_node
    if per is not None and per < ranks:
        raise ConfigError(f"launcher.devices_per_trial={per} is fewer devices than the launch's launcher.nproc_per_node={ranks} "
                          f"ranks: set launcher.devices_per_trial={ranks} (or more), or fewer ranks")
    if per is not None and cfg.launcher.nnodes > 1:
        raise ConfigError(f"launcher.devices_per_trial={per} shares one node's devices among the launches on it, but this job "
                          f"spans launcher.nnodes={cfg.launcher.nnodes} nodes: leave launcher.devices_per_trial unset (null)")
    launch, default = cfg.launcher, LauncherConfig()
    endpoint = launch.rdzv_endpoint
    if endpoint is None:
        if launch.rdzv_id != default.rdzv_id:
            raise ConfigError(f"launcher.rdzv_id={launch.rdzv_id} has no effect without launcher.rdzv_endpoint (c10d rendezvous): "
                              "set launcher.rdzv_endpoint=HOST:PORT or remove launcher.rdzv_id")
        return
    if launcher_for(cfg) == LauncherName.deepspeed:
        raise ConfigError(f"launcher.rdzv_endpoint={endpoint} is a torchrun (c10d rendezvous) setting, but this run uses the deepspeed "
                          "launcher: unset launcher.rdzv_endpoint and use launcher.hostfile or launcher.no_ssh=true launcher.node_rank=R, "
                          "or add launcher=torchrun")
    static = [f"launcher.{key}={getattr(launch, key)}" for key in ("node_rank", "master_addr", "master_port")
              if getattr(launch, key) != getattr(default, key)]
    if static:
        raise ConfigError(f"{' and '.join(static)} {'conflicts' if len(static) == 1 else 'conflict'} with launcher.rdzv_endpoint="
                          f"{endpoint} (the c10d rendezvous assigns node ranks): remove {'it' if len(static) == 1 else 'them'}, "
                          "or unset launcher.rdzv_endpoint to use the static rendezvous")


def validate_zero(cfg: Config) -> None:
    z, launch = cfg.zero, cfg.launcher
    if launch.name == LauncherName.deepspeed and not z.enabled:
        raise ConfigError("launcher=deepspeed starts the DeepSpeed engine, which needs a zero option: use zero=stage0..stage3 or launcher=torchrun")
    if (launch.hostfile or launch.no_ssh) and launch.name == LauncherName.torchrun:
        raise ConfigError("launcher.hostfile and launcher.no_ssh are deepspeed launcher settings: use launcher=deepspeed (or unset them)")
    if not z.enabled:
        if z.offload_optimizer != Offload.none or z.offload_param != Offload.none:
            raise ConfigError("zero.offload_* needs DeepSpeed: choose a zero option (e.g. zero=stage2_offload), not zero=none")
        _unused(z, "zero", ("stage",), "with zero=none (no DeepSpeed)")
        return
    if z.stage == 3:
        _unused(z, "zero", tuple(f.name for f in fields(z) if f.name != "allgather_bucket_size"), "with ZeRO stage 3 (stages 1-2 only)")
    else:  # offload_param below stage 3 gets its own message further down
        stage3_knobs = [f.name for f in fields(z) if f.name.startswith("stage3_") or f.name == "sub_group_size"]
        _unused(z, "zero", tuple(f.name for f in fields(z) if f.name not in stage3_knobs), f"with ZeRO stage {z.stage} (stage 3 only)")
    if cfg.parallelism.strategy not in (Strategy.single, Strategy.ddp) or cfg.parallelism.tp * cfg.parallelism.pp * cfg.parallelism.cp > 1:
        p = cfg.parallelism
        raise ConfigError(
            f"zero=stage{z.stage} shards over data-parallel ranks; parallelism strategy={p.strategy.value} tp={p.tp} pp={p.pp} is "
            "a torch-engine layout (FSDP2 / DTensor / pipelining): use parallelism=ddp with zero, or zero=none"
        )
    if z.offload_optimizer != Offload.none and z.stage < 2:
        raise ConfigError(
            f"zero.offload_optimizer={z.offload_optimizer.value} needs ZeRO stage 2 or 3 (got stage {z.stage}): "
            "use zero=stage2_offload or zero=stage3_offload"
        )
    if z.offload_param != Offload.none and z.stage != 3:
        raise ConfigError(f"zero.offload_param={z.offload_param.value} needs ZeRO stage 3 (got stage {z.stage}): use zero=stage3_offload")
    if Offload.nvme in (z.offload_optimizer, z.offload_param) and not z.nvme_path:
        raise ConfigError("NVMe offload needs a directory on a fast local disk: set zero.nvme_path=/local/nvme")
    if launch.nnodes > 1 and launcher_for(cfg) == LauncherName.deepspeed and not launch.hostfile:
        raise ConfigError(
            f"launcher.nnodes={launch.nnodes} with the deepspeed launcher needs launcher.hostfile "
            "(one 'host slots=N' line per node; see launch/hostfile.example)"
        )
