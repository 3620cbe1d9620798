"""What lays several samples in one training row, read by both sides: the launcher's rules and planner, the ranks'
batches. Derived from the config alone; no torch.
"""

from __future__ import annotations

from finetune import methods
from finetune.config import Config, ConfigError


UNPACKED_VISION = ("a vision-language model computes its image tokens' positions and masks per row (Qwen-VL's M-RoPE, Gemma 3's "
                   "bidirectional image attention, Mllama's cross-attention mask)")


def vision_model(cfg: Config) -> bool:
    """Whether the run's model is a vision-language one, as its local config.json says (finetune.families.vision)."""
    from finetune.disk import local_vision

    return local_vision(cfg.model) is not None


def padding_free(cfg: Config) -> tuple[bool, str]:
    """(whether the training micro-batches are padding-free, why): data.padding_free, null resolved."""
    asked = cfg.data.padding_free
    p = cfg.parallelism
    why_not = methods.get(cfg.method.name).unpacked or (
        f"parallelism.pp={p.pp} sends every micro-batch through the stages at one shape (data.max_length)" if p.pp > 1 else
        f"parallelism.cp={p.cp} splits each row's tokens over ranks and masks the whole row" if p.cp > 1 else
        UNPACKED_VISION if vision_model(cfg) else None)
    if asked is False:
        return False, "data.padding_free=false"
    if why_not is not None:
        if asked:
            raise ConfigError(f"data.padding_free=true cannot run here: {why_not}: set data.padding_free=false (or null)")
        return False, f"padded: {why_not}"
    if asked is None and cfg.train.micro_batch_size == 1:
        return False, "padded: one row per micro-batch has no padding"
    return True, "data.padding_free=true" if asked else "auto"


def several_per_row(cfg: Config) -> str:
    """What lays several samples in a training row, each attended alone (finetune.rank.varlen; "" when nothing does):
    packing, padding-free micro-batches. Under pipeline or context parallel the rows keep transformers' mask."""
    if cfg.parallelism.pp > 1 or cfg.parallelism.cp > 1:
        return ""
    return " and ".join(w for w, on in (("packed rows", cfg.data.packing), ("padding-free micro-batches", padding_free(cfg)[0])) if on)
