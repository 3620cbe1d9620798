"""Model-parallel layouts on one DeviceMesh of shape (pp, dp, tp), with PyTorch's own machinery:

- tensor parallel: DTensor plans per block (q/k/v, gate/up column-wise; o, down row-wise: one
  all-reduce after attention and one after the MLP), for the Llama/Qwen2/Mistral family;
- FSDP2: `fully_shard` per block, then the root, over the data-parallel dimension;
- pipeline parallel: each rank keeps only its stages' blocks (the embedding on the first stage,
  the final norm and LM head on the last), wrapped as `torch.distributed.pipelining` stages.

Ranks are laid out tp fastest, then dp, then pp: a TP group is adjacent ranks (one node),
pipeline stages are furthest apart (across nodes), as in the 70B tp8 x pp16 layout.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from finetune.config import ConfigError, ParallelismConfig
from finetune.rules import check_layout_fits_model

TP_PLAN = {  # module path inside a decoder block -> style
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


def build_mesh(device: torch.device, world_size: int, pp: int, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (pp, world_size // (pp * tp), tp), mesh_dim_names=("pp", "dp", "tp"))


def decoder(model: nn.Module) -> nn.Module:
    """The transformer body (`model.model` of a *ForCausalLM), under a PEFT wrapper too."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(inner, "model", None)
    if body is None or not hasattr(body, "layers"):
        raise ConfigError(f"{type(inner).__name__}: tensor/pipeline parallel here support decoder-only models with "
                          "model.model.layers (Llama, Qwen2, Mistral families)")
    return body


def check_model(model: nn.Module, p: ParallelismConfig) -> None:
    """The layout-vs-model checks for models whose config was not readable before launch (hub ids)."""
    c = model.config  # transformers' attribute_map reads each family's own names
    check_layout_fits_model(p, {"num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
                                "num_key_value_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                                "intermediate_size": getattr(c, "intermediate_size", None),
                                "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False))})


def tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    """Shard every (remaining) decoder block's linear layers over the TP mesh; the rest stays replicated.

    A LoRA layer follows its base: under a column-wise base, lora_B is column-wise too (each rank
    adds its slice of B A x); under a row-wise base, lora_A is row-wise (its output all-reduced,
    like the base's) and lora_B stays replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in decoder(model).layers:
        plan = {}
        for path, style in TP_PLAN.items():
            if not _has(block, path):
                continue
            layer = block.get_submodule(path)
            if not hasattr(layer, "base_layer"):
                plan[path] = styles[style]()
                continue
            plan[f"{path}.base_layer"] = styles[style]()
            for name in layer.lora_A:  # one entry per adapter
                lora = f"{path}.lora_B.{name}" if style == "colwise" else f"{path}.lora_A.{name}"
                plan[lora] = styles[style]()
        if plan:
            parallelize_module(block, tp_mesh, plan)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def fully_shard(model: nn.Module, dp_mesh: Any, *, reshard_after_forward: bool, offload: bool) -> None:
    """FSDP2: each decoder block is one unit (gathered for its forward/backward), then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    from torch.distributed.fsdp import fully_shard as shard
    from transformers.modeling_layers import GradientCheckpointingLayer

    kwargs = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward,
              "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()}
    for block in [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]:
        shard(block, **kwargs)
    shard(model, **kwargs)


class Stage(nn.Module):
    """One pipeline stage: a pruned copy of the causal LM that keeps only blocks `first..last-1`
    (plus the embedding on stage 0, the norm and LM head on the last stage). Parameter names
    stay those of the whole model, so the stages' state dicts merge into one HF checkpoint."""

    def __init__(self, lm: nn.Module, blocks: range, *, is_first: bool, is_last: bool, causal_mask: bool) -> None:
        super().__init__()
        body = decoder(lm)
        for i in range(len(body.layers)):
            if i not in blocks:
                body.layers[i] = nn.Identity()  # no parameters: the kept blocks keep their indices
        if not is_first:
            body.embed_tokens = None
        if not is_last:
            body.norm = None
            lm.lm_head = None
        self.lm, self.blocks, self.is_first, self.is_last, self.causal_mask = lm, blocks, is_first, is_last, causal_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body = decoder(self.lm)
        h = body.embed_tokens(x) if self.is_first else x
        positions = torch.arange(h.shape[1], device=h.device)[None]
        rope = body.rotary_emb(h, positions)
        # Rows are right-padded: a causal mask alone keeps every real token from seeing padding.
        mask = None
        if self.causal_mask:  # eager attention has no implicit causal mask
            mask = torch.full((h.shape[1], h.shape[1]), torch.finfo(h.dtype).min, device=h.device).triu(1)[None, None]
        for i in self.blocks:
            h = body.layers[i](h, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        return self.lm.lm_head(body.norm(h)) if self.is_last else h


def split_blocks(num_blocks: int, num_stages: int) -> list[range]:
    """Contiguous, as even as possible (the first stages take one more when it does not divide)."""
    per, extra = divmod(num_blocks, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = per + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


def pipeline_stages(model: nn.Module, *, pp_rank: int, pp: int, per_rank: int, causal_mask: bool) -> list[tuple[int, Stage]]:
    """This rank's (stage index, stage module) pairs: stages pp_rank, pp_rank + pp, ... (looped)."""
    num_stages = pp * per_rank
    ranges = split_blocks(len(decoder(model).layers), num_stages)
    indices = [pp_rank + k * pp for k in range(per_rank)]
    out = []
    for k, s in enumerate(indices):
        lm = model if k == len(indices) - 1 else copy.deepcopy(model)  # the last one prunes the original
        out.append((s, Stage(lm, ranges[s], is_first=s == 0, is_last=s == num_stages - 1, causal_mask=causal_mask)))
    return out


def bubble_fraction(num_stages: int, microbatches: int, per_rank: int) -> float:
    """Idle fraction of a (looped) 1F1B / GPipe schedule: (p - 1) / (v m + p - 1), p ranks, v stages each."""
    p = num_stages // per_rank
    return (p - 1) / (per_rank * microbatches + p - 1)
