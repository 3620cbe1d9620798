"""The training methods, one module each behind one interface (finetune/methods/base.py), and their registry.

The data (forms, tokenizing, the token cache, batches), the planner, the rules, the reference and the loss
read a method through `get(cfg.method.name)`; nothing outside this package branches on a method's name.
Adding a method: a module here with a `METHOD` record (base.Method) and its config class, its entry below, a
recipes/method/NAME.yaml, and its tests (docs/architecture.md: "Adding a training method").
No torch here: the launcher imports this package.
"""

from __future__ import annotations

from typing import Any

from finetune.config import METHOD_CONFIGS, method_schema
from finetune.methods import distill, dpo, grpo, kto, orpo, reward, rloo, sft
from finetune.methods.base import Item, Method, Objective

METHODS: dict[str, Method] = {m.name: m for m in (sft.METHOD, dpo.METHOD, kto.METHOD, orpo.METHOD, reward.METHOD, grpo.METHOD,
                                                                 rloo.METHOD, distill.METHOD)}
"""Every method, by its method.name."""

METHOD_CONFIGS.update({name: m.config for name, m in METHODS.items()})  # the schema types the method group with these


def get(name: Any) -> Method:
    """The method named `name`; ConfigError naming the methods where none has that name."""
    found = METHODS.get(str(getattr(name, "value", name)))
    if found is None:
        method_schema(name)  # raises, naming the methods
    return found


__all__ = ["METHODS", "Item", "Method", "Objective", "get"]
