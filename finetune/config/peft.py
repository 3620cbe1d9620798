"""The `peft` group's schema: the adapter method, its rank, scaling, targets, initialisation and QLoRA's 4-bit base.
Re-exported by finetune.config.schema (every group's dataclass is read from there)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from finetune.config.fields import NAMES, PROBABILITY, SOME_NAMES, Spelled, at_least, checked


class PeftMethod(str, Enum, metaclass=Spelled):
    none = "none"
    lora = "lora"
    qlora = "qlora"
    dora = "dora"


class LoraInit(str, Enum, metaclass=Spelled):
    default = "default"
    gaussian = "gaussian"
    pissa = "pissa"
    olora = "olora"
    loftq = "loftq"


class QuantType(str, Enum, metaclass=Spelled):
    nf4 = "nf4"
    fp4 = "fp4"


@dataclass
class PeftConfig:
    name: PeftMethod = PeftMethod.none
    """none (full fine-tuning), lora, dora (weight-decomposed LoRA), or qlora (LoRA on a 4-bit base)."""
    r: int = checked(at_least(1), 16)
    """Adapter rank."""
    alpha: int = checked(at_least(1), 32)
    """Scaling: the adapter's update is multiplied by alpha / r."""
    dropout: float = checked(PROBABILITY, 0.05)
    """Dropout on the adapter's input (lora_dropout)."""
    target_modules: list[str] = checked(SOME_NAMES, factory=lambda: ["all-linear"])
    """Module names to adapt (e.g. [q_proj,v_proj]); [all-linear]: every linear layer but the output head."""
    modules_to_save: list[str] = checked(NAMES, factory=list)
    """Modules trained fully and saved with the adapter (e.g. [lm_head,embed_tokens])."""
    use_rslora: bool = False
    """Rank-stabilized LoRA: scale the update by alpha / sqrt(r) instead of alpha / r (PEFT's use_rslora)."""
    init: LoraInit = LoraInit.default
    """The adapters' initial weights (PEFT's init_lora_weights): default (A Kaiming-uniform, B zero), gaussian (A
    normal(0, 1/r), B zero), pissa (A and B the weight's top-r singular vectors, taken out of the base weight: the
    model is unchanged at step 0), olora (the same with a QR decomposition), loftq (refused: PEFT runs it on CUDA only
    and replaces the base with its 4-bit approximation, which no saved adapter can convert back). With pissa/olora
    final/ holds the adapter converted back to the original base (rank 2r, PEFT's
    path_initial_model_for_weight_conversion), so it applies to model.path like any LoRA adapter."""
    quant_type: QuantType = QuantType.nf4
    """qlora: 4-bit data type of the frozen base."""
    double_quant: bool = True
    """qlora: quantize the quantization constants too (~0.4 bits/param less)."""
