"""ZeRO (DeepSpeed): the DeepSpeed JSON, a pure function of the typed config, and the rules of the ZeRO layouts
(finetune.layouts.LAYOUTS: the stages and the offloads).

The launcher writes it beside config.yaml (finetune.launcher.command) and the DeepSpeed engine builds from the same function
(finetune.rank.engine.deepspeed_engine), so what a dry run shows is what the ranks run. No torch import.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from finetune import optimizers
from finetune.config import Config, ConfigError, Offload, OptimConfig, Precision, unused


def deepspeed_config(cfg: Config) -> dict[str, Any]:
    """The DeepSpeed JSON, every number taken from the typed config.

    The learning-rate schedule is not in it: both engines step the same scheduler object
    (`engine.build_scheduler`), because DeepSpeed's Warmup* schedulers run their first step at
    lr 0 even without warmup, which would make the DeepSpeed run diverge from the torch run.
    """
    t, o, z, p = cfg.train, cfg.optim, cfg.zero, cfg.precision
    ds: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": o.max_grad_norm or 0.0,  # 0: no clipping
        "optimizer": deepspeed_optimizer(o),
        "steps_per_print": t.max_steps + 1,  # we log; keep DeepSpeed's own step lines quiet
        "wall_clock_breakdown": False,
    }
    if p.name == Precision.fp16:
        ds["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0 = dynamic
            "initial_scale_power": p.initial_scale_power,
            "loss_scale_window": p.loss_scale_window,
            "hysteresis": 1,  # back off on the first overflow, as torch's GradScaler does
            "min_loss_scale": 1,
        }
    elif p.name == Precision.bf16:
        ds["bf16"] = {"enabled": True}
    zero: dict[str, Any] = {
        "stage": z.stage,
        "overlap_comm": z.overlap_comm,
        "contiguous_gradients": z.contiguous_gradients,
        "reduce_bucket_size": z.reduce_bucket_size,
    }
    if z.stage in (1, 2):
        zero["allgather_bucket_size"] = z.allgather_bucket_size
    if z.stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": z.stage3_prefetch_bucket_size,
            "stage3_param_persistence_threshold": z.stage3_param_persistence_threshold,
            "stage3_max_live_parameters": z.stage3_max_live_parameters,
            "stage3_max_reuse_distance": z.stage3_max_reuse_distance,
            "sub_group_size": z.sub_group_size,
            "stage3_gather_16bit_weights_on_model_save": True,  # the final export needs whole weights
        }
    for key, where in (("offload_optimizer", z.offload_optimizer), ("offload_param", z.offload_param)):
        if where != Offload.none:
            zero[key] = {"device": where.value, "pin_memory": z.pin_memory}
            if where == Offload.nvme:
                zero[key]["nvme_path"] = z.nvme_path
    ds["zero_optimization"] = zero
    if not optimizers.record(o.name).deepspeed_tested:
        ds["zero_allow_untested_optimizer"] = True  # ZeRO's list of tested optimizers has Adam(W), not SGD
    return ds


def deepspeed_optimizer(o: OptimConfig) -> dict[str, Any]:
    """The JSON "optimizer" section, from the optimizer's record (finetune/optimizers/): what DeepSpeed builds is
    what the torch engine builds.

    "AdamW" and "Adam" become DeepSpeed's FusedAdam (DeepSpeedCPUAdam with zero.offload_optimizer);
    DeepSpeed's "Adam" is AdamW too unless "adam_w_mode" is false. Any other type is looked up in
    torch.optim: "SGD" is torch.optim.SGD.
    """
    rec = optimizers.record(o.name)
    values = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay, "momentum": o.momentum}
    return {"type": rec.deepspeed, "params": {**{k: values[k] for k in rec.deepspeed_keys}, **rec.deepspeed_extra}}


def validate_stage(cfg: Config) -> None:
    """A ZeRO stage's rules: the knobs of the other stages are refused as having no effect."""
    z = cfg.zero
    if z.stage == 3:
        unused(z, "zero", tuple(f.name for f in fields(z) if f.name != "allgather_bucket_size"), "with ZeRO stage 3 (stages 1-2 only)")
    else:
        stage3_knobs = [f.name for f in fields(z) if f.name.startswith("stage3_") or f.name == "sub_group_size"]
        unused(z, "zero", tuple(f.name for f in fields(z) if f.name not in stage3_knobs), f"with ZeRO stage {z.stage} (stage 3 only)")


def _offload(cfg: Config, where: Offload) -> None:
    """What both offloads need: DeepSpeed, and a directory for NVMe."""
    if not cfg.zero.enabled:
        raise ConfigError("zero.offload_* needs DeepSpeed: choose a zero option (e.g. zero=stage2_offload), not zero=none")
    if where == Offload.nvme and not cfg.zero.nvme_path:
        raise ConfigError("NVMe offload needs a directory on a fast local disk: set zero.nvme_path=/local/nvme")


def validate_offload_optimizer(cfg: Config) -> None:
    """zero.offload_optimizer: ZeRO stage 2 or 3 (the optimizer states and the fp32 gradients go to CPU RAM or NVMe)."""
    z = cfg.zero
    _offload(cfg, z.offload_optimizer)
    if z.stage < 2:
        raise ConfigError(f"zero.offload_optimizer={z.offload_optimizer.value} needs ZeRO stage 2 or 3 (got stage {z.stage}): "
                          "use zero=stage2_offload or zero=stage3_offload")


def validate_offload_param(cfg: Config) -> None:
    """zero.offload_param: ZeRO stage 3 (the parameters go to CPU RAM or NVMe between uses)."""
    z = cfg.zero
    _offload(cfg, z.offload_param)
    if z.stage != 3:
        raise ConfigError(f"zero.offload_param={z.offload_param.value} needs ZeRO stage 3 (got stage {z.stage}): use zero=stage3_offload")
