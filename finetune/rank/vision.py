"""model.freeze applied to a vision-language model on the rank: its parts (finetune.families.vision.parts, one code
path for every image-text class) frozen before adapters are added, and what QLoRA leaves unquantized. A part the built
model does not have (a causal LM class that drops the vision tower, as MllamaForCausalLM does) freezes nothing.
"""

from __future__ import annotations

import torch

from finetune.families.vision import PROJECTORS, TOWERS, frozen_parts, parts

NOT_QUANTIZED = [rf"(.*\.)?{name}" for name in (*TOWERS, *PROJECTORS, "lm_head")]
"""What QLoRA leaves unquantized in a vision-language model (bitsandbytes' llm_int8_skip_modules: transformers matches
each as a regex from the start of a module's path, to a module boundary, before the model is built): the vision tower,
the projector and the output head, wherever the class puts them."""


def freeze(model: torch.nn.Module, frozen: list[str] | None, adapters: bool) -> tuple[dict[str, int], set[str]]:
    """Keep model.freeze's parts out of training: (the parameters frozen per part, the linear layers wholly frozen, which
    LoRA then leaves alone). Nothing for a text model."""
    found = parts(model)
    if found.vision is None:
        return {}, set()
    out: dict[str, int] = {}
    kept: set[int] = set()
    for part in frozen_parts(frozen, adapters):
        params = found.named(part)
        for p in params:
            p.requires_grad_(False)
        kept |= {id(p) for p in params}
        if params:
            out[part] = found.count(part)
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and all(id(p) in kept for p in m.parameters())}
    return out, linears
