"""The distributed rules: the launcher and its rendezvous, the hardware, the launcher against ZeRO, the parallel layout
(its sizes against the launch and the model's shape; then each layout's own rules and the pairs that do not compose, from
the records of finetune.layouts), the batch sizes against the data-parallel size.
"""

from __future__ import annotations

from finetune.config import (Config, ConfigError, LauncherConfig, LauncherName, ParallelismConfig, PipeSchedule, Strategy,
                             unused as _unused)
from finetune.layouts import check_composes, launcher_for, layouts_of
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
        _unused(p, "parallelism", ("strategy", "tp", "pp", "cp", "fsdp_reshard_after_forward", "fsdp_offload", "sequence_parallel"),
                "without pipeline parallel (pp=1)")
    if p.strategy != Strategy.fsdp:
        _unused(p, "parallelism", ("strategy", "tp", "pp", "cp", "pp_schedule", "pp_stages_per_rank", "sequence_parallel"),
                f"with strategy={p.strategy.value} (only with fsdp)")
    if p.tp == 1 and not p.sequence_parallel:
        raise ConfigError("parallelism.sequence_parallel=false has no effect without tensor parallel (tp=1): remove it or "
                          "change the option")
    interleaved = p.pp_schedule == PipeSchedule.interleaved_1f1b
    if p.pp > 1 and interleaved != (p.pp_stages_per_rank > 1):
        raise ConfigError(f"parallelism.pp_schedule={p.pp_schedule.value} with pp_stages_per_rank={p.pp_stages_per_rank}: "
                          "interleaved_1f1b needs 2 or more stages per rank, gpipe and 1f1b exactly 1")
    shape = model_shape(cfg.model)
    if shape is not None:
        check_layout_fits_model(p, shape)
    for rec in layouts_of(cfg):  # each layout's own rules (finetune.layouts.LAYOUTS), then the pairs that do not compose
        if rec.rules is not None:
            rec.rules(cfg)
    check_composes(cfg)


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
    """The launcher against ZeRO (the ZeRO layouts' own rules are finetune/layouts/zero.py's, run by validate_layout)."""
    z, launch = cfg.zero, cfg.launcher
    if launch.name == LauncherName.deepspeed and not z.enabled:
        raise ConfigError("launcher=deepspeed starts the DeepSpeed engine, which needs a zero option: use zero=stage0..stage3 or launcher=torchrun")
    if (launch.hostfile or launch.no_ssh) and launch.name == LauncherName.torchrun:
        raise ConfigError("launcher.hostfile and launcher.no_ssh are deepspeed launcher settings: use launcher=deepspeed (or unset them)")
    if not z.enabled:
        _unused(z, "zero", ("stage", "offload_optimizer", "offload_param"), "with zero=none (no DeepSpeed)")
        return
    if launch.nnodes > 1 and launcher_for(cfg) == LauncherName.deepspeed and not launch.hostfile:
        raise ConfigError(
            f"launcher.nnodes={launch.nnodes} with the deepspeed launcher needs launcher.hostfile "
            "(one 'host slots=N' line per node; see launch/hostfile.example)"
        )
