"""The layouts on one DeviceMesh (FSDP2, tensor, pipeline and context parallel): whether a model's shape and family
allow the layout asked for, checked by the launcher's rules and again on the ranks once the model's config is loaded.
No torch.
"""

from __future__ import annotations

from typing import Any

from finetune.config import ConfigError, ParallelismConfig
from finetune.families import FAMILIES


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
