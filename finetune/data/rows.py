"""What lays several samples in one training row, read by both sides: the launcher's rules and planner, the ranks'
batches. Derived from the config alone; no torch (but for a vision-language model, whose class transformers names).
"""

from __future__ import annotations

from finetune import methods
from finetune.config import Config, ConfigError


def vision_model(cfg: Config) -> bool:
    """Whether the run trains a vision-language model, as its local config.json names its class."""
    from finetune.disk import local_vision

    return local_vision(cfg.model) is not None


def vision_unpacked(cfg: Config) -> str | None:
    """Why the run's vision-language model cannot hold several samples in a row (`unpacked`), as its local config.json
    names its class; None for a text model, or one whose samples each attend alone."""
    from finetune.disk import local_vision

    vision = local_vision(cfg.model)
    if vision is None:
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # torch: a VLM only

    import transformers

    cls = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(vision.model_type, ""), None)
    why = unpacked(cls) if cls is not None else None
    return f"model.path={cfg.model.path} ({vision.model_type}): {why}" if why else None


def unpacked(cls: type) -> str | None:
    """Why an image-text class cannot take rows of several samples (packed, padding-free), read from what its forward
    takes; None where each sample's attention and positions can be computed alone: causal attention over 1-D positions
    (finetune.rank.varlen: LLaVA, Mistral 3, Idefics3), or M-RoPE's 3-D positions per sample by the class's own
    get_rope_index (finetune.rank.vision.rope_per_sample: the Qwen-VL family, GLM-4V)."""
    import inspect
    import sys

    takes = set(inspect.signature(cls.forward).parameters)
    if "cross_attention_mask" in takes:
        return ("its text reads the images through cross-attention, masked over the whole row (cross_attention_mask), "
                "which does not keep an image with its own sample")
    rope = any(callable(getattr(c, "get_rope_index", None)) for c in vars(sys.modules[cls.__module__]).values()
               if isinstance(c, type))
    types = sorted(takes & {"token_type_ids", "mm_token_type_ids"})
    if types and not rope:
        return (f"its image tokens' attention is shaped over the whole row by {types[-1]} (Gemma 3's and 4's images attend "
                "to each other both ways), which attention one sample at a time, causal, does not keep")
    return None


def padding_free(cfg: Config) -> tuple[bool, str]:
    """(whether the training micro-batches are padding-free, why): data.padding_free, null resolved."""
    asked = cfg.data.padding_free
    p = cfg.parallelism
    record = methods.get(cfg.method.name)
    why_not = record.padded or (
        f"method={record.name}'s rows with images are padded (each row group's image inputs apart)"
        if record.rows_per_example > 1 and vision_model(cfg) else None) or (
        f"method={record.name}'s rollouts with images are padded (each completion shown its prompt's images)"
        if record.sampling(cfg.method) is not None and vision_model(cfg) else None) or (
        f"parallelism.pp={p.pp} sends every micro-batch through the stages at one shape (data.max_length)" if p.pp > 1 else
        f"parallelism.cp={p.cp} splits each row's tokens over ranks and masks the whole row" if p.cp > 1 else
        vision_unpacked(cfg))
    if asked is False:
        return False, "data.padding_free=false"
    if why_not is not None:
        if asked:
            raise ConfigError(f"data.padding_free=true cannot run here: {why_not}: set data.padding_free=false (or null)")
        return False, f"padded: {why_not}"
    if asked is None and cfg.train.micro_batch_size == 1 and record.sampling(cfg.method) is None:  # (a prompt's G rows do)
        return False, "padded: one row per micro-batch has no padding"
    return True, "data.padding_free=true" if asked else "auto"


def several_per_row(cfg: Config) -> str:
    """What lays several samples in a training row, each attended alone (finetune.rank.varlen; "" when nothing does):
    packing, padding-free micro-batches. Under pipeline or context parallel the rows keep transformers' mask."""
    if cfg.parallelism.pp > 1 or cfg.parallelism.cp > 1:
        return ""
    return " and ".join(w for w, on in (("packed rows", cfg.data.packing), ("padding-free micro-batches", padding_free(cfg)[0])) if on)
