"""The cross-group rules: what no single field's constraint can check (batch sizes against the
launch size, options that need or exclude each other, the model's shape against the layout).

Each rule raises `ConfigError` with one line naming the keys that conflict and what to do
instead. Per-field constraints are declared beside the fields in `finetune.config` and checked
when the config is composed, before these rules run. Imports no torch (a torch.optim class named by optim.name
imports it when its record is made: finetune/optimizers/).

By topic (as axolotl groups its validation), each module one group of rules; `validate` runs them in order:
- model.py: the model's own (path or init, structure, context length, attention kernel).
- data.py: sources, streaming, the chat template, the method's rules and forms, packing and padding-free rows.
- optim.py: the optimizer's record against the config (keys, schedule, engines, precisions, kernel).
- layout.py: launcher, hardware, ZeRO, the parallel layout against the model, batch sizes.
- strategies.py: checkpointing, PEFT, precision, logits and kernel options that need or exclude each other.
- peft.py: PEFT's variants (peft.init, LoRA+) and NEFTune against the base, the engine and the layout.
"""

from __future__ import annotations

from finetune.config import Config
from finetune.data.rows import padding_free
from finetune.launcher.rules import data, layout, model, optim, peft, strategies
from finetune.launcher.rules.layout import layout_words
from finetune.launcher.rules.model import SHAPE, family_defaults, model_shape

__all__ = ["SHAPE", "family_defaults", "layout_words", "model_shape", "validate"]


def validate(cfg: Config) -> None:
    """Check the rules that span groups, by topic, in this order (the first broken one is the line said). Raises
    ConfigError naming the keys to change."""
    model.validate_model(cfg.model)
    model.validate_vision(cfg)
    model.validate_structure(cfg.model)
    model.validate_context(cfg)
    data.validate_sources(cfg)
    data.validate_streaming(cfg)
    data.validate_template(cfg)
    model.validate_attention(cfg)
    layout.validate_launcher(cfg)
    layout.validate_hardware(cfg)
    optim.validate_optimizer_keys(cfg)
    optim.validate_length(cfg)
    optim.validate_schedule(cfg)
    layout.validate_zero(cfg)
    layout.validate_layout(cfg)
    layout.validate_batches(cfg)
    optim.validate_optimizer_engine(cfg)
    optim.validate_pure(cfg)
    optim.validate_state_dtype(cfg)
    optim.validate_kernel(cfg)
    optim.validate_compile(cfg)
    optim.validate_in_backward(cfg)
    strategies.validate_strategies(cfg)
    peft.validate_peft_variants(cfg)
    peft.validate_neftune(cfg)
    data.validate_method(cfg)
    padding_free(cfg)
    data.validate_eval(cfg)
