"""The shipped lm-eval tasks' data: the quickstart's held-out rows (finetune/assets/data), read where they are
installed, so the tasks run offline. lm-eval calls these through `custom_dataset: !function quickstart.NAME`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "data"


def _split(folder: str) -> Any:
    import datasets

    return datasets.DatasetDict({"test": datasets.load_dataset("json", data_files=str(DATA / folder / "eval.jsonl"), split="train")})


def instructions(**_: Any) -> Any:
    """quickstart/eval.jsonl: {instruction, input, output} rows (reverse, uppercase, double, shift a word)."""
    return _split("quickstart")


def pairs(**_: Any) -> Any:
    """quickstart_dpo/eval.jsonl: the same prompts as {prompt, chosen, rejected}: the right answer and a near miss."""
    return _split("quickstart_dpo")
