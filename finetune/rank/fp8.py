"""precision=fp8: torchao's float8 training (torchao.float8.convert_to_float8_training) on the linear layers the rule
below picks, before adapters, checkpointing, compilation and sharding. FSDP2 shards the converted layers as any other
and, with tensorwise scaling, all-gathers their weights already cast to FP8 (torchao's enable_fsdp_float8_all_gather:
half of bf16's bytes); tensor parallel's plan shards them into DTensors (torch's Colwise/RowwiseParallel), which torchao's
casts and matmuls take as they are (its float8 sequence-parallel styles are not used: the activations' collectives stay
bf16); a pipeline's stages hold them as they were converted; LoRA and DoRA wrap a converted layer as their frozen base.

Each converted layer casts its input, weight and output gradient to FP8 (e4m3 forward, e5m2 gradients) with tensorwise
or rowwise scales and multiplies them with torch._scaled_mm; its weight stays in the weights' dtype (fp32 master under
precision=bf16), so the optimizer, checkpoints and exports are bf16's. The rule: every nn.Linear but the output layer
(its logits feed the loss; the peers keep it in bf16 too) and those whose sizes are not multiples of 16 (what
_scaled_mm takes). The ranks refuse a device without FP8 matmuls (compute capability below 8.9, or not CUDA) in one
line, naming it; with precision.fp8_on_cpu=true a CPU rank runs the same layers through torch's CPU _scaled_mm (the same
casts and scales, accumulated by the CPU, slower than bf16): how the suite checks FP8's numerics and layouts without a
GPU.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch

from finetune.config import ConfigError

MULTIPLE = 16
"""torch._scaled_mm needs both sizes of the weight divisible by this."""

CAPABILITY = (8, 9)
"""The first compute capability with FP8 tensor cores (Ada: L4, RTX 4090; Hopper, Blackwell after it)."""


def chosen(model: torch.nn.Module, tp: int = 1) -> tuple[list[str], dict[str, str]]:
    """(the linear layers converted, {a layer kept in bf16: why}) by the rule in the module docstring; under tensor
    parallel of degree `tp` a shard's sizes must be multiples of 16 too (a layer is split along either size)."""
    head, multiple = model.get_output_embeddings(), MULTIPLE * tp
    converted, kept = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if module is head:
            kept[name] = "the output layer"
        elif module.in_features % multiple or module.out_features % multiple:
            kept[name] = f"{module.in_features} x {module.out_features}, not multiples of {multiple}" + (
                f" ({MULTIPLE} per parallelism.tp={tp} shard)" if tp > 1 else "")
        else:
            converted.append(name)
    return converted, kept


def blocker(device: torch.device, on_cpu: bool = False) -> str | None:
    """Why this rank cannot train in FP8 (None: it can). `on_cpu` (precision.fp8_on_cpu): a CPU rank runs torch's CPU FP8
    matmuls, where this torch has them."""
    if device.type == "cpu" and on_cpu:
        return cpu_blocker()
    if device.type != "cuda":
        return (f"this rank runs on {device.type}, and FP8 matmuls need an NVIDIA GPU of compute capability "
                f"{CAPABILITY[0]}.{CAPABILITY[1]} or newer (L4, RTX 4090, H100, H200, B200)")
    capability = torch.cuda.get_device_capability(device)
    if capability < CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}, and FP8 matmuls "
                f"need {CAPABILITY[0]}.{CAPABILITY[1]} or newer (L4, RTX 4090, H100, H200, B200)")
    try:
        importlib.import_module("torchao.float8")
    except ImportError as e:
        return f"torchao is not installed ({e}): pip install -e '.[gpu]'"
    return None


def cpu_blocker() -> str | None:
    """Why this torch cannot run FP8 matmuls on CPU (None: it can): one 16 x 16 torch._scaled_mm, as Float8Linear calls it."""
    try:
        importlib.import_module("torchao.float8")
    except ImportError as e:
        return f"torchao is not installed ({e}): pip install -e '.[qat]'"
    one, eye = torch.tensor(1.0), torch.eye(MULTIPLE).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(eye, eye.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        return f"torch {torch.__version__} has no FP8 matmul on CPU ({str(e).splitlines()[0]})"
    return None


def convert(model: torch.nn.Module, scaling: str, device: torch.device, on_cpu: bool = False, fsdp: bool = False,
            tp: int = 1) -> str:
    """The chosen layers swapped for torchao's Float8Linear in place; the model line's words for it."""
    if (why := blocker(device, on_cpu)) is not None:
        raise ConfigError(f"precision.fp8={scaling}: {why}: use precision=bf16")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted, kept = chosen(model, tp)
    wanted = set(converted)
    config = Float8LinearConfig.from_recipe_name(scaling)
    if fsdp and scaling == "tensorwise":  # FSDP2 all-gathers the weights already cast to FP8: half of bf16's bytes
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, fqn: fqn in wanted)
    done = sum(1 for m in model.modules() if type(m).__name__ == "Float8Linear")
    if done != len(converted):
        raise ConfigError(f"precision.fp8={scaling}: torchao converted {done} of the {len(converted)} linear layers chosen: use "
                          "precision=bf16 (and report the model's family)")
    where = ("; FSDP2 all-gathers their weights in FP8" if config.enable_fsdp_float8_all_gather else "") + (
        "; on CPU: torch's CPU FP8 matmuls, slower than bf16" if device.type == "cpu" else "")
    return describe(converted, kept, scaling, where)


def describe(converted: list[str], kept: dict[str, str], scaling: str, where: str = "") -> str:
    reasons: dict[str, list[str]] = {}
    for name, why in kept.items():
        reasons.setdefault(why, []).append(name)
    said = "; ".join(f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} ({why})" for why, names in reasons.items())
    return f"fp8: {len(converted)} linear layers in FP8 ({scaling} scaling{where}), {len(kept)} in bf16" + (f": {said}" if said else "")

