"""The training methods, one module each behind one interface (finetune/methods/base.py), and their registry.

The data (forms, tokenizing, the token cache, batches), the planner, the rules, the reference and the loss
read a method through `get(cfg.method.name)`; nothing outside this package branches on a method's name.
Adding a method: a module here with a `METHOD` record (base.Method), its entry below and in
finetune.config.Method, a recipes/method/NAME.yaml, and its tests (docs/architecture.md: "Adding a training method").
No torch here: the launcher imports this package.
"""

from __future__ import annotations

from typing import Any

from finetune.methods import dpo, grpo, kto, orpo, reward, sft
from finetune.methods.base import Item, Method, Objective

METHODS: dict[str, Method] = {m.name: m for m in (sft.METHOD, dpo.METHOD, kto.METHOD, orpo.METHOD, reward.METHOD, grpo.METHOD)}
"""Every method, by its method.name (tests/test_methods.py checks each finetune.config.Method has one)."""


def get(name: Any) -> Method:
    """The method named `name` (a finetune.config.Method or its value)."""
    return METHODS[getattr(name, "value", name)]


__all__ = ["METHODS", "Item", "Method", "Objective", "get"]
