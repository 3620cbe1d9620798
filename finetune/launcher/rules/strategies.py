"""The memory strategies' rules: keys a strategy leaves unused (checkpointing, peft, precision, logits), Liger's
kernels, PEFT's targets against the family, DoRA and tensor parallel on a MoE's experts, flash-attn's precision,
QLoRA under ZeRO-3, checkpointing=full_offload under train.compile.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from finetune.config import (AttnImpl, Checkpointing, Config, ConfigError, Device, Kernels, Logits, LogitsKernel, PeftMethod, Precision,
                             unused as _unused)
from finetune import methods
from finetune.families import liger
from finetune.methods.base import CAUSAL_LM
from finetune.disk import model_config
from finetune.families import adapted_outside_linears, arch_from_config, arch_targets, dora_experts, router_loss_under_pp, unmatched_targets


def validate_strategies(cfg: Config) -> None:
    ck, peft = cfg.checkpointing, cfg.peft
    if ck.name != Checkpointing.selective:
        _unused(ck, "checkpointing", ("name",), f"with checkpointing={ck.name.value} (only with selective)")
    if ck.name == Checkpointing.full_offload and cfg.train.compile:
        raise ConfigError("checkpointing=full_offload with train.compile=true: the host-memory hooks around each block "
                          "(torch.autograd.graph.saved_tensors_hooks) are a graph break dynamo does not trace, so every "
                          "layer would run eagerly: use checkpointing=full or ops with train.compile=true, or "
                          "train.compile=false")
    if peft.name == PeftMethod.none:
        _unused(peft, "peft", ("name",), "with peft=none")
    elif peft.name != PeftMethod.qlora:
        _unused(peft, "peft", ("name", "r", "alpha", "dropout", "target_modules", "modules_to_save", "use_rslora", "init"), f"with peft={peft.name.value} (only with qlora)")
    own = {Precision.fp16: ("initial_scale_power", "loss_scale_window"), Precision.bf16_pure: ("kahan_sum",), Precision.bf16: ("fp8", "fp8_on_cpu")}
    for owner, keys in own.items():  # each precision's own keys, refused under the others
        if owner != cfg.precision.name:
            _unused(cfg.precision, "precision", tuple(f.name for f in fields(cfg.precision) if f.name not in keys),
                    f"with precision={cfg.precision.name.value} (only with {owner.value})")
    if cfg.logits.name == Logits.full:
        _unused(cfg.logits, "logits", ("name",), "with logits=full (only with logits=chunked)")
    if cfg.logits.kernel == LogitsKernel.cce and cfg.train.device == Device.cpu:
        raise ConfigError("logits.kernel=cce with train.device=cpu: cut-cross-entropy's kernels are Triton, CUDA only: use "
                          "logits.kernel=torch (or auto) on CPU")
    validate_fp8(cfg)
    validate_qat(cfg)
    arch = model_config(cfg.model)
    validate_liger(cfg, arch)
    if cfg.parallelism.pp > 1 and arch is not None and arch.get("output_router_logits") is True:
        raise ConfigError(router_loss_under_pp(cfg.parallelism.pp))
    if peft.name != PeftMethod.none and arch is not None:
        validate_targets(arch, peft.target_modules)
    if peft.name == PeftMethod.dora and arch is not None and adapted_outside_linears(arch, peft.target_modules):
        raise ConfigError(dora_experts(str(arch.get("model_type") or "")))
    tp = cfg.parallelism.tp
    if peft.name != PeftMethod.none and tp > 1 and arch is not None and adapted_outside_linears(arch, peft.target_modules):
        raise ConfigError(f"peft={peft.name.value} with peft.target_modules={list(peft.target_modules)} adapts this "
                          f"{arch.get('model_type') or 'MoE'} model's experts (fused 3-D weights), which parallelism.tp={tp} shards "
                          "with transformers' expert style that PEFT's adapter cannot follow: name the linear layers "
                          "(e.g. peft.target_modules=[q_proj,k_proj,v_proj,o_proj]), or use parallelism=fsdp")
    if cfg.model.attn_implementation == AttnImpl.flash_attention_2 and cfg.precision.name == Precision.fp32:
        raise ConfigError("model.attn_implementation=flash_attention_2 runs in fp16/bf16 only: add precision=bf16 (or use sdpa)")
    if peft.name == PeftMethod.qlora and cfg.zero.stage == 3 and cfg.precision.name == Precision.fp32:
        raise ConfigError(
            "peft=qlora under zero=stage3 stores the 4-bit weights in the compute dtype so DeepSpeed can shard them: "
            "use precision=bf16 or fp16"
        )


def validate_fp8(cfg: Config) -> None:
    """precision=fp8 (finetune.rank.fp8): an NVIDIA GPU (the ranks check its compute capability; precision.fp8_on_cpu lets
    a CPU rank run it), on the torch layouts (single, DDP, FSDP2, TP, PP and their meshes), with full fine-tuning, LoRA or
    DoRA; not under DeepSpeed nor over QLoRA's 4-bit base."""
    fp8 = cfg.precision.fp8
    if fp8 is None:
        if cfg.precision.fp8_on_cpu:
            raise ConfigError("precision.fp8_on_cpu=true has no effect without precision=fp8: remove it, or add precision=fp8")
        return
    said = f"precision=fp8 (precision.fp8={fp8.value})"
    if cfg.train.device == Device.cpu and not cfg.precision.fp8_on_cpu:
        raise ConfigError(f"{said} with train.device=cpu: FP8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (L4, "
                          "RTX 4090, H100, H200, B200): use precision=bf16 on CPU (or precision.fp8_on_cpu=true to check the "
                          "recipe's numerics through torch's CPU FP8 matmuls, slower than bf16)")
    blocked = (f"zero.stage={cfg.zero.stage}: DeepSpeed's engine casts the model and runs its own precision" if cfg.zero.enabled else
               "peft=qlora: its base layers are bitsandbytes' 4-bit ones, not linear layers torchao's FP8 can take"
               if cfg.peft.name == PeftMethod.qlora else None)
    if blocked:
        raise ConfigError(f"{said} with {blocked}; use precision=fp8 on the torch layouts (single, ddp, fsdp, tp, pp) with full "
                          "fine-tuning, LoRA or DoRA, or precision=bf16")


def validate_qat(cfg: Config) -> None:
    """train.qat (finetune.rank.qat): a causal language model's linear layers, full fine-tuning or LoRA/DoRA over them."""
    qat, group, after = cfg.train.qat, cfg.train.qat_group_size, cfg.train.qat_after_steps
    if qat is None:
        for key, value, default in (("qat_group_size", group, 32), ("qat_after_steps", after, 0)):
            if value != default:
                raise ConfigError(f"train.{key}={value} has no effect without train.qat: remove it or set "
                                  "train.qat=int4_weight (or int8_dynamic_int4_weight)")
        return
    if cfg.train.max_steps is not None and after >= cfg.train.max_steps:
        raise ConfigError(f"train.qat_after_steps={after} with train.max_steps={cfg.train.max_steps}: no step would train "
                          f"for the quantized grid: set train.qat_after_steps below {cfg.train.max_steps} (0: from the first)")
    said = f"train.qat={qat.value}"
    blocked = (f"method={cfg.method.name}: the 4-bit export is a causal language model's, and this method trains "
               f"{cfg.method.name}'s model" if methods.get(cfg.method.name).model_class != CAUSAL_LM else
               "peft=qlora: its base is already quantized (bitsandbytes' 4-bit NF4), and QAT rounds full-precision weights"
               if cfg.peft.name == PeftMethod.qlora else
               "precision=fp8: the linear layers are torchao's float8 ones, which QAT's fake quantization does not wrap"
               if cfg.precision.fp8 is not None else
               f"parallelism.tp={cfg.parallelism.tp}: transformers' tensor-parallel plan shards the linear layers, and the fake "
               "quantizer torchao puts inside each is not a module the plan knows" if cfg.parallelism.tp > 1 else None)
    if blocked:
        raise ConfigError(f"{said} with {blocked}: train without train.qat")


def validate_liger(cfg: Config, arch: dict[str, Any] | None) -> None:
    """model.kernels=liger and logits.kernel=liger (finetune/families/liger.py): CUDA, the package, a family Liger patches, no
    tensor parallel. The ranks check the device and the family again (train.device=auto, a hub id's config)."""
    wanted = [(key, instead) for key, instead, on in (
        ("model.kernels=liger", "model.kernels=none", cfg.model.kernels == Kernels.liger),
        ("logits.kernel=liger", "logits.kernel=torch (or auto)", cfg.logits.kernel == LogitsKernel.liger)) if on]
    for key, instead in wanted:
        if cfg.train.device == Device.cpu:
            raise ConfigError(f"{key} with train.device=cpu: {liger.CUDA_ONLY}: use {instead} on CPU")
        if not liger.installed():
            raise ConfigError(liger.not_installed(key, instead))
    if cfg.model.kernels != Kernels.liger:
        return
    supported, model_type = liger.families(), (arch or {}).get("model_type")
    if supported is not None and model_type and model_type not in supported:
        raise ConfigError(liger.unsupported(str(model_type), supported))
    if cfg.parallelism.tp > 1:
        raise ConfigError(f"model.kernels=liger with parallelism.tp={cfg.parallelism.tp}: Liger's Triton kernels take plain "
                          "tensors, and under tensor parallel some layers see DTensor shards (transformers' styles for experts "
                          "and gathered outputs); the pairing was never run: use model.kernels=liger with parallelism=fsdp, ddp "
                          "or pp, or model.kernels=none with tp")


def validate_targets(arch: dict[str, Any], targets: list[str]) -> None:
    """peft.target_modules names (without dots: a dotted path is the ranks' to check) against the
    modules of a family finetune.families knows, read from its config.json (the ranks check again)."""
    try:
        structure = arch_from_config({"vocab_size": 1, **arch}, "config.json")
    except ConfigError:  # a key the structure needs is missing: the ranks check
        return
    if structure.known:
        refusal = unmatched_targets(structure.model_type, [t for t in targets if "." not in t], *arch_targets(structure))
        if refusal:
            raise ConfigError(refusal)
