"""PEFT variants' rules: peft.init (pissa, olora, loftq) against the base, the engine and the DPO/KTO reference;
optim.loraplus_lr_ratio without adapters; train.neftune_alpha under layouts that split the embedding's output.
"""

from __future__ import annotations

from finetune import methods
from finetune.config import Config, ConfigError, LoraInit, PeftMethod, Reference
from finetune.layouts import engine_kind

MUTATING = (LoraInit.pissa, LoraInit.olora)
"""Inits that move the base weights' principal part into the adapter (finetune.rank.model.MUTATING, which imports torch)."""


def validate_peft_variants(cfg: Config) -> None:
    peft, init = cfg.peft, cfg.peft.init
    if cfg.optim.loraplus_lr_ratio is not None and peft.name == PeftMethod.none:
        raise ConfigError(f"optim.loraplus_lr_ratio={cfg.optim.loraplus_lr_ratio:g} speeds up LoRA's B matrices, and peft=none "
                          "trains none: add peft=lora (or dora/qlora), or remove optim.loraplus_lr_ratio")
    if init == LoraInit.loftq:
        raise ConfigError("peft.init=loftq: PEFT computes LoftQ on CUDA only and replaces the base weights with their 4-bit "
                          "approximation, which no saved adapter converts back to model.path, so final/ could not hold the "
                          "trained model: use peft=qlora with peft.init=default (or pissa/olora with peft=lora)")
    if init not in MUTATING:
        return
    if peft.name == PeftMethod.qlora:
        raise ConfigError(f"peft.init={init.value} with peft=qlora: PiSSA/OLoRA decompose the full-precision base weight and "
                          "PEFT cannot take the residual back into a 4-bit base exactly: use peft=lora with "
                          f"peft.init={init.value}, or peft=qlora with peft.init=default")
    if peft.name == PeftMethod.dora:
        raise ConfigError(f"peft.init={init.value} with peft=dora: PEFT converts only plain LoRA adapters back to the original "
                          f"base at save: use peft=lora with peft.init={init.value}, or peft=dora with peft.init=default")
    if engine_kind(cfg) != "torch":
        raise ConfigError(f"peft.init={init.value} under {f'zero.stage={cfg.zero.stage}' if cfg.zero.enabled else 'parallelism=' + layout(cfg)}: "
                          "PEFT converts the trained adapter to the original base at save by loading the step-0 adapter into "
                          "the live model, which a sharded or partitioned model cannot take: use parallelism=single or ddp "
                          "with zero=none, or peft.init=default")
    if methods.get(cfg.method.name).reference(cfg.method) == Reference.adapter_disabled:
        raise ConfigError(f"method.reference=adapter_disabled with peft.init={init.value}: the base under the adapter holds "
                          "the residual (the weight less its principal part), not the model you started from: use "
                          "method.reference=precomputed or live, or peft.init=default")


def layout(cfg: Config) -> str:
    p = cfg.parallelism
    return ",".join([p.strategy.value] + [f"{k}{v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp)) if v > 1])


def validate_neftune(cfg: Config) -> None:
    p = cfg.parallelism
    split = [f"parallelism.{k}={v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp)) if v > 1]
    if cfg.train.neftune_alpha is not None and split:
        raise ConfigError(f"train.neftune_alpha with {', '.join(split)}: the embedding's output is split or staged across "
                          "ranks there, so each rank would draw its own noise and scale it by its own part of the sequence: "
                          "use NEFTune with parallelism=single, ddp or fsdp (or zero), or remove train.neftune_alpha")
