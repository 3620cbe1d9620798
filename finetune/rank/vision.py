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


def rope_per_sample(model: torch.nn.Module) -> bool:
    """Rows of several samples (packed, padding-free) on a class whose positions over image tokens are 3-D (M-RoPE: the
    Qwen-VL family's and GLM-4V's `get_rope_index`, which reads a row as one sample): before each forward, the positions
    of each sample computed alone, by the model's own `get_rope_index` over the samples laid out as a padded batch, and
    handed to the model as transformers takes packed ones ([4, rows, tokens]: the text positions, which the attention
    reads samples from, then the three rotary ones). Whether the model has it."""
    import inspect

    from torch.nn.utils.rnn import pad_sequence

    from finetune.rank.varlen import sample_lengths

    inner = next((m for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)
    if inner is None:
        return False
    takes = set(inspect.signature(inner.get_rope_index).parameters) - {"input_ids", "attention_mask", "kwargs"}

    def positions(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        text, ids = kwargs.get("position_ids"), kwargs.get("input_ids")
        if text is None or ids is None or text.dim() != 2:
            return None
        lengths = sample_lengths(text)
        if all(len(row) == 1 for row in lengths):
            return None

        def samples(t: torch.Tensor) -> torch.Tensor:
            return pad_sequence([s for b, row in enumerate(lengths) for s in t[b].split(row)], batch_first=True)

        padded = samples(ids)
        mask = samples(torch.ones_like(ids))
        extra = {k: samples(v) if k.endswith("token_type_ids") else v for k, v in kwargs.items() if k in takes}
        rope, _ = inner.get_rope_index(padded, attention_mask=mask, **extra)
        rope = rope[:, mask.bool()].reshape(rope.shape[0], *ids.shape).to(text.device)
        return args, {**kwargs, "position_ids": torch.cat([text[None], rope], dim=0)}

    model.register_forward_pre_hook(positions, with_kwargs=True)
    return True
