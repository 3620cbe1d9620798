"""The functions the shipped tool recipes name (method.tools, method.rewards): the tool the model learns to call, `code`,
and the reward that tells whether it called it rightly, `correct_call` (quickstart_tools logs it with weight 0).

No torch, no transformers: the launcher imports both to check them before launch."""

from __future__ import annotations

import zlib
from typing import Any


def code(word: str) -> str:
    """A word's code: four digits no model can work out from the word (its CRC-32, modulo 10,000), only look up."""
    return f"{zlib.crc32(word.encode()) % 10000:04d}"


def correct_call(*, trajectories: list[list[dict[str, Any]]], answers: list[str], **_: Any) -> list[float]:
    """1.0 where a tool's result in the exchange is the row's answer (the right tool, called with the right arguments),
    else 0.0: the rate of correct calls, logged as rewards/finetune.methods.toolbox:correct_call."""
    return [float(any(m["role"] == "tool" and str(m["content"]).strip() == a.strip() for m in t))
            for t, a in zip(trajectories, answers)]
