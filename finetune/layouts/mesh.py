"""The layouts on one DeviceMesh (FSDP2, tensor, pipeline and context parallel): their rules (finetune.layouts.LAYOUTS
names them), and whether a model's shape and family allow the layout asked for, checked by the launcher's rules and
again on the ranks once the model's config is loaded. No torch.
"""

from __future__ import annotations

from typing import Any

from finetune import methods
from finetune.config import Checkpointing, Config, ConfigError, ParallelismConfig, PeftMethod, Precision, Reference, Strategy
from finetune.disk import local_vision, model_config
from finetune.families import FAMILIES, router_loss_split


def _no_vision(cfg: Config, layout: str) -> None:
    """tp, pp and cp follow the language model's plans; a vision-language model's tower and projector have none here."""
    vision = local_vision(cfg.model)
    if vision is not None:
        raise ConfigError(f"{layout} is not supported for a vision-language model (model_type={vision.model_type}): its "
                          "tensor-parallel, pipeline and context-parallel plans cover the language model, not the vision "
                          "tower and the projector; use parallelism=fsdp or ddp, or zero")


def _precision(cfg: Config) -> None:
    """What every mesh layout refuses: fp16 (no sharded loss scaler)."""
    p = cfg.parallelism
    if cfg.precision.name == Precision.fp16:
        raise ConfigError(f"precision=fp16 is not supported with parallelism.strategy={p.strategy.value} tp={p.tp} pp={p.pp} "
                          "(no sharded loss scaler here): use precision=bf16")


def validate_fsdp(cfg: Config) -> None:
    """FSDP2 (parallelism=fsdp)."""
    _precision(cfg)


def fsdp_gathers_bf16(cfg: Config) -> bool:
    """Whether FSDP2 trains in mixed precision as torchtitan does (precision=bf16, precision=fp8's bf16 rest): each unit
    gathered and computed in bf16 over fp32 shards, the gradients reduce-scattered in fp32, no autocast
    (finetune.rank.parallel.fully_shard's MixedPrecisionPolicy); what the planner counts it as. bf16_pure's weights
    are bf16 already; fp32 gathers fp32."""
    return cfg.parallelism.strategy == Strategy.fsdp and cfg.precision.name == Precision.bf16


def validate_tp(cfg: Config) -> None:
    """Tensor parallel: no 4-bit base (QLoRA) and no DoRA, whose pieces have no rows or columns to split; a language model."""
    _precision(cfg)
    p = cfg.parallelism
    _no_vision(cfg, f"parallelism.tp={p.tp}")
    if cfg.peft.name == PeftMethod.qlora:
        raise ConfigError(f"peft=qlora is not supported with tensor parallel (parallelism.tp={p.tp}): bitsandbytes keeps a 4-bit "
                          "weight as one flat buffer of packed pairs with per-block constants, which has no rows or columns to "
                          "split (no maintained library splits it): use peft=qlora with parallelism=fsdp or pp, or peft=lora with tp")
    if cfg.peft.name == PeftMethod.dora:
        raise ConfigError("peft=dora is not supported with tensor parallel (its weight norm spans the sharded dimension): "
                          "use peft=lora with tp, or dora with fsdp/ddp")


def validate_pp(cfg: Config) -> None:
    """Pipeline parallel: a reference the stages can run (precomputed), no activation offload; a language model."""
    _precision(cfg)
    _no_vision(cfg, f"parallelism.pp={cfg.parallelism.pp}")
    if (ref := methods.get(cfg.method.name).reference(cfg.method)) not in (None, Reference.precomputed):
        raise ConfigError(f"method.reference={ref.value} is not supported with pipeline parallel: "
                          "use method.reference=precomputed")
    if cfg.checkpointing.name == Checkpointing.offload:
        raise ConfigError("checkpointing=offload is not supported with pipeline parallel: use checkpointing=full or selective")


def validate_cp(cfg: Config) -> None:
    """Context parallel (finetune/rank/context.py): a method that splits no row's tokens apart, no router loss; a
    language model."""
    _precision(cfg)
    p, method = cfg.parallelism, methods.get(cfg.method.name)
    _no_vision(cfg, f"parallelism.cp={p.cp}")
    if method.split_tokens:
        raise ConfigError(f"method={method.name} with parallelism.cp={p.cp} is not supported: {method.split_tokens}")
    arch = model_config(cfg.model)
    if arch is not None and arch.get("output_router_logits") is True:
        raise ConfigError(router_loss_split(f"parallelism.cp={p.cp}"))


def check_layout_fits_model(p: ParallelismConfig, shape: dict[str, Any]) -> None:
    """The family has the tensor-parallel / pipeline plan the layout needs (families.FAMILIES; a
    model_type not listed is left to the ranks), tp divides the heads and the MLP width, there are
    at least as many blocks as pipeline stages, and pipeline stages have untied embeddings. A size
    the shape lacks (None) is not checked."""
    model_type = shape.get("model_type")
    fam = FAMILIES.get(str(model_type))
    if p.tp > 1 and fam is not None and not fam.tp_plan:
        conv = " and its fused Conv1D layers (c_attn, c_proj, c_fc) are not the Llama layout our own plan splits" if fam.gpt2 else ""
        raise ConfigError(f"parallelism.tp={p.tp}: transformers publishes no tensor-parallel plan for model_type={model_type}{conv}: "
                          "use parallelism=fsdp or ddp")
    if p.pp > 1 and fam is not None and not fam.pp_plan:
        raise ConfigError(f"parallelism.pp={p.pp}: transformers publishes no pipeline plan for model_type={model_type} (which "
                          "modules run before and after its blocks), so it cannot be cut into stages: use parallelism=fsdp or ddp")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if p.tp > 1 and shape.get(key) and shape[key] % p.tp:
            raise ConfigError(f"parallelism.tp={p.tp} must divide the model's {key}={shape[key]}: "
                              f"use a tp that divides {shape[key]}")
    for key in ("num_attention_heads", "num_key_value_heads"):  # the all-to-all hands each cp rank whole heads
        heads = shape.get(key) or (shape.get("num_attention_heads") if key == "num_key_value_heads" else None)
        if p.cp > 1 and heads and heads % p.tp == 0 and (heads // p.tp) % p.cp:
            per = f"{heads // p.tp} per tensor-parallel rank ({key}={heads} / parallelism.tp={p.tp})" if p.tp > 1 else f"the model's {key}={heads}"
            raise ConfigError(f"parallelism.cp={p.cp} must divide {per}: each context-parallel rank attends over whole heads; "
                              f"use a cp that divides {heads // p.tp}")
    stages, blocks = p.pp * p.pp_stages_per_rank, shape.get("num_hidden_layers")
    if p.pp > 1 and blocks and stages > blocks:
        raise ConfigError(f"parallelism.pp={p.pp} x pp_stages_per_rank={p.pp_stages_per_rank} = {stages} pipeline stages, but the "
                          f"model has {blocks} blocks: use at most {blocks} stages")
    if p.pp > 1 and shape.get("tie_word_embeddings") is True:
        raise ConfigError("pipeline parallel needs untied input/output embeddings (the first and last stages hold them): "
                          "this model ties them; use tp or fsdp")
