"""train.qat: quantization-aware training with torchao's QAT (torchao.quantization.qat.QATConfig), so the model trained
here survives the 4-bit quantization it is deployed in.

`prepare` swaps the linear layers the rule picks for torchao's FakeQuantizedLinear before adapters, checkpointing,
compilation and sharding: their forward rounds the weight to the scheme's grid (4, 3 or 2 bits, symmetric, one scale
per `train.qat_group_size` weights along a row) and, for int8_dynamic_int4_weight, the input to int8 per token; the
backward passes the gradient straight through the rounding (the straight-through estimator; each group's largest
weight also carries its scale's gradient), so the weights, gradients, optimizer and checkpoints stay in the run's
precision and final/ holds them as they are. The quantization itself happens after training, with the same torchao
config (`ptq_config`): `finetune.export` writes the quantized model that transformers loads (its TorchAoConfig), or
for int4 a GGUF Q4_0 file, and the same export of a run trained without QAT is post-training quantization, the
baseline QAT is measured against.

The rule: every nn.Linear but the output layer (transformers' TorchAoConfig keeps it in full precision too) and those
whose input size is not a multiple of the group size; the model line names what it kept.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from finetune.config import ConfigError

SCHEMES = ("int4_weight", "int8_dynamic_int4_weight", "int3_weight", "int2_weight")
"""train.qat's values: 4-bit weights (IntxWeightOnlyConfig), 4-bit weights with int8 per-token dynamic activations
(Int8DynamicActivationIntxWeightConfig), 3- or 2-bit weights (IntxWeightOnlyConfig)."""


def ptq_config(scheme: str, group_size: int) -> Any:
    """The torchao post-training config of `scheme`: what QAT prepares for, what the export applies."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    if scheme not in SCHEMES:
        raise ValueError(f"unknown QAT scheme {scheme!r} (one of {', '.join(SCHEMES)})")
    bits = getattr(torch, scheme.removeprefix("int8_dynamic_").removesuffix("_weight"))
    if scheme.startswith("int8_dynamic_"):
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=bits, weight_granularity=PerGroup(group_size))
    return IntxWeightOnlyConfig(weight_dtype=bits, granularity=PerGroup(group_size))


def chosen(model: torch.nn.Module, group_size: int) -> tuple[list[str], dict[str, str]]:
    """(the linear layers quantized, {a layer kept in full precision: why}) by the rule in the module docstring."""
    head = model.get_output_embeddings()
    quantized, kept = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if module is head:
            kept[name] = "the output layer"
        elif module.in_features % group_size:
            kept[name] = f"input size {module.in_features}, not a multiple of train.qat_group_size={group_size}"
        else:
            quantized.append(name)
    return quantized, kept


def prepare(model: torch.nn.Module, scheme: str, group_size: int, after_steps: int = 0) -> str:
    """The chosen layers swapped for torchao's fake-quantized ones in place; the model line's words for it."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    quantized, kept = chosen(model, group_size)
    if not quantized:
        raise ConfigError(f"train.qat={scheme}: no linear layer of this model can be quantized in groups of "
                          f"{group_size} ({'; '.join(f'{n}: {why}' for n, why in list(kept.items())[:3])}): set "
                          "train.qat_group_size to a divisor of the hidden size")
    wanted = set(quantized)
    quantize_(model, QATConfig(ptq_config(scheme, group_size), step="prepare"), filter_fn=lambda m, fqn: fqn in wanted)
    done = sum(1 for m in model.modules() if isinstance(m, FakeQuantizedLinear))
    if done != len(quantized):
        raise ConfigError(f"train.qat={scheme}: torchao prepared {done} of the {len(quantized)} linear layers chosen: "
                          "train without train.qat (and report the model's family)")
    return describe(quantized, kept, scheme, group_size) + (
        f"; fake-quantized from step {after_steps + 1} (train.qat_after_steps={after_steps}), full precision before" if after_steps else "")


def describe(quantized: list[str], kept: dict[str, str], scheme: str, group_size: int) -> str:
    reasons: dict[str, list[str]] = {}
    for name, why in kept.items():
        reasons.setdefault(why, []).append(name)
    said = "; ".join(f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} ({why})" for why, names in reasons.items())
    return (f"qat: {len(quantized)} linear layers fake-quantized ({scheme}, groups of {group_size}), {len(kept)} in full "
            "precision" + (f": {said}" if said else ""))


def quantize(model: torch.nn.Module, scheme: str, group_size: int) -> list[str]:
    """`model` (plain nn.Linear layers) quantized in place as the export writes it; the layers quantized."""
    from torchao.quantization import quantize_

    quantized, _ = chosen(model, group_size)
    wanted = set(quantized)
    quantize_(model, ptq_config(scheme, group_size), filter_fn=lambda m, fqn: fqn in wanted)
    return quantized


def dequantize(layers: list[str], model: torch.nn.Module) -> None:
    """The quantized `layers` of `model` given back plain float weights holding their 4-bit values (scale x q)."""
    for name in layers:
        module = model.get_submodule(name)
        module.weight = torch.nn.Parameter(module.weight.dequantize().float(), requires_grad=False)


def fake_quantizing(model: torch.nn.Module, on: bool) -> None:
    """Turn every fake quantizer of the prepared layers on or off (train.qat_after_steps): off, a layer's forward is its
    full-precision one."""
    from torchao.quantization.qat import FakeQuantizedLinear

    for module in model.modules():
        if isinstance(module, FakeQuantizedLinear):
            for quantizer in (module.weight_fake_quantizer, module.activation_fake_quantizer):
                if quantizer is not None:
                    quantizer.enabled = on


def switch(cfg: Any, model: torch.nn.Module) -> Callable[[int], None] | None:
    """The training loop's `before_step` for train.qat_after_steps (None without a delay): fake quantization off until
    that many steps are done, on from then (a resumed run sets it from its own step)."""
    if cfg.qat is None or not cfg.qat_after_steps:
        return None
    return lambda done: fake_quantizing(model, done >= cfg.qat_after_steps)
