"""Where a vision-language model's parts live in the model a rank built, and model.freeze applied to them.

One code path for every image-text class (finetune.families.vision reads the config; this finds the modules): the
vision tower is what transformers' `get_encoder(modality="image")` returns, the language model what `get_decoder()`
returns (both PreTrainedModel's own lookups, over the names the classes use: vision_tower, visual, vision_model;
language_model, text_model), and the projector the first module named as the classes name it (multi_modal_projector,
connector, Qwen's merger inside its vision tower). A part the built model does not have (a causal LM class that drops
the vision tower, as MllamaForCausalLM does) is None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROJECTORS = ("multi_modal_projector", "connector", "merger", "mlp1")
"""The names image-text classes give the module between the vision tower and the language model."""
TOWERS = ("vision_tower", "visual", "vision_model", "vision_encoder", "image_tower")
"""The names transformers' get_encoder(modality="image") looks for."""
NOT_QUANTIZED = [rf"(.*\.)?{name}" for name in (*TOWERS, *PROJECTORS, "lm_head")]
"""What QLoRA leaves unquantized in a vision-language model (bitsandbytes' llm_int8_skip_modules: transformers matches
each as a regex from the start of a module's path, to a module boundary, before the model is built): the vision tower,
the projector and the output head, wherever the class puts them."""


@dataclass
class Parts:
    vision: torch.nn.Module | None
    projector: torch.nn.Module | None
    language: torch.nn.Module | None

    def named(self, part: str) -> list[torch.nn.Parameter]:
        """The parameters of one part (vision, projector, language): the vision tower's without the projector inside it."""
        module = getattr(self, part)
        if module is None:
            return []
        inside = {id(p) for p in self.projector.parameters()} if part == "vision" and self.projector is not None else set()
        return [p for p in module.parameters() if id(p) not in inside]


def _within(inner: torch.nn.Module, outer: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def parts(model: torch.nn.Module) -> Parts:
    """The vision tower, projector and language model of `model` (None where it has none)."""
    vision = language = None
    try:
        vision = model.get_encoder(modality="image")
    except (AttributeError, TypeError, ValueError):
        pass
    try:
        language = model.get_decoder()
    except (AttributeError, TypeError, ValueError):
        pass
    if vision is not None and (language is None or _within(language, vision)):  # a text model answers with itself
        vision = None
    projector = None
    if vision is not None:
        projector = next((m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTORS
                          and not (language is not None and _within(m, language))), None)
    return Parts(vision, projector, language)


def default_frozen(adapters: bool) -> list[str]:
    """model.freeze=null: the vision tower (full fine-tuning trains the projector and the language model, as the peers
    do), and the projector too under adapters (LoRA adapts the language model only, unless model.freeze says otherwise)."""
    return ["vision", "projector"] if adapters else ["vision"]


def freeze(model: torch.nn.Module, frozen: list[str] | None, adapters: bool) -> tuple[dict[str, int], set[str]]:
    """Keep model.freeze's parts out of training: (the parameters frozen per part, the linear layers wholly frozen, which
    LoRA then leaves alone). Nothing for a text model."""
    found = parts(model)
    if found.vision is None:
        return {}, set()
    out: dict[str, int] = {}
    kept: set[int] = set()
    for part in default_frozen(adapters) if frozen is None else frozen:
        params = found.named(part)
        for p in params:
            p.requires_grad_(False)
        kept |= {id(p) for p in params}
        if params:
            out[part] = sum(p.numel() for p in params)
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and all(id(p) in kept for p in m.parameters())}
    return out, linears
