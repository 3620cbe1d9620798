"""GRPO's reward functions (`method.rewards`, weighted by `method.reward_weights`): built-in verifiable ones, a
user's Python function named by dotted path, or a reward model this project trained (method=reward).

Every reward is called once per rollout micro-batch with keyword arguments, each a list with one entry per
completion (a prompt's G completions are adjacent):

    prompts: the prompt as the model saw it, decoded (special tokens removed)
    completions: the sampled completion, decoded (special tokens removed)
    answers: the row's own response (what exact match compares with)
    completion_tokens: each completion's length in tokens (its EOS included)

and returns one number per completion (TRL's convention: a function takes **kwargs for the arguments it does not
use). Built-in: `exact_match` (1.0 when the completion equals the answer, both stripped), `similarity` (partial
credit: difflib's matched-character ratio of the two, 1.0 when equal), `format` (1.0 when the
completion, stripped, matches `method.format_pattern` whole), `length` (-completion_tokens / method.completion_tokens,
a penalty for long answers), `overlong` (DAPO's soft overlong punishment: 0, then down to -1 over the last
`method.overlong_buffer` tokens before method.completion_tokens). `package.module:function` imports a function;
`reward:PATH` scores prompt + completion with the sequence classifier at PATH (a method=reward run directory or its
final/).

No torch at import: the launcher resolves every reward before launch, so a misspelt function is one line.
"""

from __future__ import annotations

import difflib
import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from finetune.config import ConfigError, MethodConfig
from finetune.methods.base import SCORED, saved_class

RewardFn = Callable[..., list[float]]


@dataclass(frozen=True)
class Reward:
    name: str
    """As written in method.rewards (the metric is rewards/NAME)."""
    weight: float
    fn: RewardFn


def exact_match(*, completions: list[str], answers: list[str], **_: Any) -> list[float]:
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]


def similarity(*, completions: list[str], answers: list[str], **_: Any) -> list[float]:
    """Partial credit: difflib's ratio of the stripped strings, 2 * matched characters / both lengths (1.0 when equal)."""
    return [difflib.SequenceMatcher(None, c.strip(), a.strip(), autojunk=False).ratio() for c, a in zip(completions, answers)]


def format_reward(pattern: str) -> RewardFn:
    compiled = re.compile(pattern, re.DOTALL)

    def format(*, completions: list[str], **_: Any) -> list[float]:  # noqa: A001 (the reward's name)
        return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]

    return format


def length_penalty(limit: int) -> RewardFn:
    def length(*, completion_tokens: list[int], **_: Any) -> list[float]:
        return [-n / limit for n in completion_tokens]

    return length


def overlong_penalty(limit: int, buffer: int) -> RewardFn:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), L_max = `limit`, L_cache = `buffer`:
    0 up to L_max - L_cache tokens, then ((L_max - L_cache) - |o|) / L_cache, down to -1 at L_max."""
    def overlong(*, completion_tokens: list[int], **_: Any) -> list[float]:
        return [min(0.0, ((limit - buffer) - n) / buffer) if n <= limit else -1.0 for n in completion_tokens]

    return overlong


def resolve(method: MethodConfig, *, load_models: bool = False) -> list[Reward]:
    """method.rewards as functions with their weights; one line naming the key for anything that is not one.
    `load_models`: a reward model is loaded now (a rank); otherwise its directory is only checked (the launcher)."""
    weights = method.reward_weights if method.reward_weights is not None else [1.0] * len(method.rewards)
    if len(weights) != len(method.rewards):
        raise ConfigError(f"method.reward_weights has {len(weights)} weights for {len(method.rewards)} rewards "
                          f"({', '.join(method.rewards)}): give one weight per reward, or none (1 each)")
    return [Reward(name, float(w), function(name, method, load_models)) for name, w in zip(method.rewards, weights)]


def function(name: str, method: MethodConfig, load_models: bool) -> RewardFn:
    key = f"method.rewards: {name}"
    if name == "exact_match":
        return exact_match
    if name == "similarity":
        return similarity
    if name == "format":
        if not method.format_pattern:
            raise ConfigError(f"{key} needs method.format_pattern (the regular expression a well-formed completion matches), "
                              "e.g. method.format_pattern='<answer>.*</answer>'")
        try:
            return format_reward(method.format_pattern)
        except re.error as e:
            raise ConfigError(f"method.format_pattern={method.format_pattern!r} is not a regular expression: {e}") from None
    if name == "length":
        return length_penalty(method.completion_tokens)
    if name == "overlong":  # method.overlong_buffer: checked with the method's rules
        return overlong_penalty(method.completion_tokens, method.overlong_buffer)
    if name.startswith("reward:"):
        return reward_model(name.removeprefix("reward:"), key, load_models)
    if ":" not in name:
        raise ConfigError(f"{key} is not a reward: use exact_match, similarity, format, length, overlong, a function as package.module:function, "
                          "or reward:PATH (a reward model trained with method=reward)")
    return imported(name, key)


def imported(name: str, key: str) -> Callable[..., Any]:
    """The function `package.module:function` names; one line naming `key` where it cannot be imported or called."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import {module_name} ({e}): is it installed or on PYTHONPATH?") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: {module_name} has no function {attr!r}" if fn is None else f"{key}: {module_name}.{attr} is not callable")
    return fn


def reward_model(where: str, key: str, load: bool) -> RewardFn:
    """A sequence classifier's score of prompt + completion (the text re-tokenized by its own tokenizer)."""
    path = Path(where).expanduser()
    final = path / "final" if (path / "config.yaml").is_file() else path
    config = final / "config.json"
    if not config.is_file():
        raise ConfigError(f"{key}: {final} holds no config.json: give a method=reward run directory or its final/")
    import json

    if saved_class(json.loads(config.read_text())) != SCORED:
        raise ConfigError(f"{key}: {final} is not a sequence classifier: train one with method=reward (a merged adapter works too)")
    if not load:
        return lambda **_: []
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final)
    scorer = AutoModelForSequenceClassification.from_pretrained(final).eval()

    @torch.no_grad()
    def score(*, prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        device = next(scorer.parameters()).device
        batch = tokenizer([p + c for p, c in zip(prompts, completions)], return_tensors="pt", padding=True).to(device)
        return scorer(**batch).logits[:, 0].float().tolist()

    return score


def score(rewards: list[Reward], **columns: Any) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted sum per completion, and each reward's own values (for its metric)."""
    each: dict[str, list[float]] = {}
    n = len(columns["completions"])
    for r in rewards:
        each[r.name] = called(r, n, columns)
    total = [sum(r.weight * each[r.name][i] for r in rewards) for i in range(n)]
    return total, each


def called(r: Reward, n: int, columns: dict[str, Any]) -> list[float]:
    """One reward's values for `n` completions; a fault in it (an exception, a count or a value that is not one finite
    number per completion) is one line naming the reward and, for the user's own function, the file and line it came
    from: never a NaN loss or a traceback downstream."""
    import inspect
    import math
    import traceback

    try:
        values = list(r.fn(**columns))
    except Exception as e:  # noqa: BLE001 - the user's code: whatever it raises is named as its fault
        frames = traceback.extract_tb(e.__traceback__)[1:]  # from the function's own frame in
        try:
            own = inspect.getsourcefile(r.fn)
        except TypeError:
            own = None
        mine = [f for f in frames if f.filename == own] or frames
        at = f" at {mine[-1].filename}:{mine[-1].lineno}" if mine else ""
        raise ConfigError(f"method.rewards: {r.name} raised {type(e).__name__}: {e}{at}: fix the reward function") from None
    if len(values) != n:
        raise ConfigError(f"method.rewards: {r.name} returned {len(values)} values for {n} completions: return one number each")
    for i, v in enumerate(values):
        try:
            number = float(v)
        except (TypeError, ValueError):
            number = None
        if number is None or not math.isfinite(number):
            what = "a number" if number is None else "finite"
            raise ConfigError(f"method.rewards: {r.name} returned {v!r} for completion {i} ({columns['completions'][i][:40]!r}), "
                              f"which is not {what}: return one finite number per completion")
        values[i] = number
    return values
