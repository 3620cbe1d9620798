"""Vision-language models read from their own config.json, as finetune.families reads a text model's (no torch).

A vision-language checkpoint (LLaVA, Qwen2.5-VL and Qwen3-VL, Gemma 3, Llama 3.2 Vision, Mistral 3, and the other
image-text-to-text classes transformers registers) says so in its config: a `vision_config` (the vision tower) beside a
`text_config` (the language model), and the id of the token an image takes in the text (`image_token_id`, or
`image_token_index` in the older classes). Where the vision tower, the projector and the language model live in the
built model is found by `parts` (the planner's meta-device build, the ranks' model: finetune/rank/vision.py freezes them);
how many tokens an image becomes is the processor's to say,
but where the config fixes it (Gemma 3's `mm_tokens_per_image`) it is read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROJECTORS = ("multi_modal_projector", "connector", "merger", "mlp1")
"""The names image-text classes give the module between the vision tower and the language model."""
TOWERS = ("vision_tower", "visual", "vision_model", "vision_encoder", "image_tower")
"""The names transformers' get_encoder(modality="image") looks for."""

IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")
"""Where a config names the token an image takes in the text (the newer classes' name first)."""
FIXED_TOKENS_KEYS = ("mm_tokens_per_image",)
"""Where a config fixes how many tokens one image becomes (the model pools every image to it). Not `image_seq_length`:
LLaVA's config carries 576 whatever its vision tower's size, a value for its processor."""


@dataclass(frozen=True)
class Vision:
    """A vision-language model as its config.json describes it."""

    model_type: str
    text: dict[str, Any]
    """The language model's config (text_config), read by finetune.families like a text model's."""
    vision: dict[str, Any]
    """The vision tower's config (vision_config)."""
    image_token_id: int | None
    """The token each image takes (or fills, once the processor expands it) in the text."""
    cross_attention: bool
    """Images reach the text through cross-attention layers (Llama 3.2 Vision's mllama), not as tokens in the sequence."""
    tokens_per_image: int | None
    """How many tokens one image becomes, where the config fixes it; None: the processor computes it per image
    (dynamic resolution: Qwen2-VL's image_grid_thw, Pixtral's patches; tiles)."""

    @property
    def text_model_type(self) -> str:
        return str(self.text.get("model_type") or "")

    def describe(self) -> str:
        """What it is, in a few words, for the lines that name it."""
        language = f"a {self.text_model_type} language model" if self.text_model_type else "a language model"
        return f"a vision tower, a projector and {language}" + (" with cross-attention to the image" if self.cross_attention else "")


def vision_of(config: dict[str, Any]) -> Vision | None:
    """The vision-language model `config` (a config.json's keys) describes, or None for a text model."""
    vision, text = config.get("vision_config"), config.get("text_config")
    if not isinstance(vision, dict):
        return None
    text = text if isinstance(text, dict) else {}
    token = next((config[k] for k in IMAGE_TOKEN_KEYS if isinstance(config.get(k), int)), None)
    fixed = next((config[k] for k in FIXED_TOKENS_KEYS if isinstance(config.get(k), int)), None)
    return Vision(model_type=str(config.get("model_type") or ""), text=text, vision=vision, image_token_id=token,
                  cross_attention=bool(text.get("cross_attention_layers")), tokens_per_image=fixed)


def frozen_parts(freeze: list[str] | None, adapters: bool) -> list[str]:
    """The parts model.freeze keeps frozen. null: the vision tower (full fine-tuning trains the projector and the language
    model, as the peers do), and the projector too under adapters (LoRA adapts the language model only)."""
    if freeze is not None:
        return list(freeze)
    return ["vision", "projector"] if adapters else ["vision"]


@dataclass
class Parts:
    """A built vision-language model's vision tower, projector and language model (torch modules; None where absent)."""

    vision: Any
    projector: Any
    language: Any
    loose: tuple[Any, ...] = ()
    """Parameters the model holds outside the three parts and its output head (LLaVA-NeXT's image_newline, the embedding
    it lays after each row of an image's tiles): the projector's, the bridge from the images to the text they belong to."""

    def named(self, part: str) -> list[Any]:
        """The parameters of one part (vision, projector, language): the vision tower's without the projector inside it,
        the projector's with the loose ones."""
        module = getattr(self, part)
        loose = list(self.loose) if part == "projector" else []
        if module is None:
            return loose
        inside = {id(p) for p in self.projector.parameters()} if part == "vision" and self.projector is not None else set()
        return [p for p in module.parameters() if id(p) not in inside] + loose

    def count(self, part: str) -> int:
        """Its parameters (a ZeRO-3 partitioned one counted whole: ds_numel)."""
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.named(part))


def _within(inner: Any, outer: Any) -> bool:
    return any(m is inner for m in outer.modules())


def parts(model: Any) -> Parts:
    """The vision tower, projector and language model of a built `model` (None where it has none), by one code path for
    every image-text class: transformers' own `get_encoder(modality="image")` and `get_decoder()` (over the names the
    classes use: TOWERS; language_model, text_model), and the first module named as a projector (PROJECTORS) outside
    the language model. A text model answers with itself: no vision tower."""
    vision = language = None
    try:
        vision = model.get_encoder(modality="image")
    except (AttributeError, TypeError, ValueError):
        pass
    try:
        language = model.get_decoder()
    except (AttributeError, TypeError, ValueError):
        pass
    if vision is not None and (language is None or _within(language, vision)):
        vision = None
    projector = None
    loose: tuple[Any, ...] = ()
    if vision is not None:
        projector = next((m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTORS
                          and not (language is not None and _within(m, language))), None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        found = {id(p) for m in (vision, projector, language, head) if m is not None for p in m.parameters()}
        loose = tuple(p for p in model.parameters() if id(p) not in found)
    return Parts(vision, projector, language, loose)
