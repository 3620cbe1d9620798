"""Conversations, pairs and text -> token ids with response-only labels (finetune.data.forms gives the rows' shapes).

SFT rows become a list of messages, rendered by the tokenizer's chat template or our built-in one, and
tokenized segment by segment so that we know exactly which tokens are the response: only those carry
labels. Text rows (continued pre-training) are tokenized whole, every token a label, split into
max_length pieces.

Preference rows (DPO) become a `Pair` of two examples, prompt + chosen and prompt + rejected, rendered
through the same templates; only the final response carries labels. A pair's batch is its chosen rows
followed by its rejected rows, so one forward scores both.

Which of these a row becomes is the method's `encode` (finetune.methods), built from the helpers here
(`encode`, `encode_pair`, `encode_text`, `fit`); finetune.data.examples calls it (`tokenize_row`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.config import ConfigError, DataConfig, LongPrompt, Template

IGNORE = -100  # label of tokens that carry no loss (prompt, padding)


def uses_chat_template(tokenizer: Any, template: Template) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if template == Template.tokenizer and not has:
        raise ConfigError("data.template=tokenizer, but the tokenizer has no chat template: use data.template=builtin or auto")
    return template == Template.tokenizer or (template == Template.auto and has)


def segments(messages: list[dict[str, str]], tokenizer: Any, chat_template: bool) -> list[tuple[str, bool]]:
    """Split a rendered conversation into (text, is_response) pieces, in order."""
    if not chat_template:
        return _builtin_segments(messages, tokenizer)
    out: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise ConfigError(
                "the tokenizer's chat template does not render a conversation as a prefix of its continuation, "
                "so prompt and response tokens cannot be separated: use data.template=builtin"
            )
        out += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
        done = full
    return [(text, resp) for text, resp in out if text]


def _builtin_segments(messages: list[dict[str, str]], tokenizer: Any) -> list[tuple[str, bool]]:
    """Our template for tokenizers without one: '### Role:' headers, EOS after each response."""
    out: list[tuple[str, bool]] = [(tokenizer.bos_token, False)] if tokenizer.bos_token else []
    for m in messages:
        header = f"### {m['role'].capitalize()}:\n"
        if m["role"] == "assistant":
            out += [(header, False), (m["content"] + (tokenizer.eos_token or ""), True), ("\n\n", False)]
        else:
            out.append((f"{header}{m['content']}\n\n", False))
    return out[:-1]  # drop the separator after the last response: the sample ends with EOS


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    prompt_len: int  # tokens before the last response: what generation continues from
    reference: str  # the last response's text, for exact match
    position_ids: list[int] | None = None  # packed rows: positions restart at 0 for every sample


@dataclass
class Pair:
    """A preference pair: the same prompt with the chosen and with the rejected response."""

    chosen: Example
    rejected: Example
    reference: tuple[float, float] | None = None
    """Reference-model log-probs of the chosen and rejected responses (summed over their tokens),
    when precomputed before training."""

    @property
    def rows(self) -> tuple[Example, Example]:
        """Its rows in batch order (finetune.methods.base.Item): a batch of pairs is B chosen rows, then B rejected."""
        return self.chosen, self.rejected

    @property
    def target(self) -> Example:
        return self.chosen

    def values(self) -> dict[str, tuple[float, ...]]:
        return {"reference_logps": self.reference} if self.reference is not None else {}


def rows_of(item: Any) -> tuple[Example, ...]:
    """An example's rows: itself, or an item's (finetune.methods.base.Item: a pair's chosen and rejected)."""
    return (item,) if isinstance(item, Example) else item.rows


def encode(messages: list[dict[str, str]], tokenizer: Any, chat_template: bool, last_only: bool = False) -> Example:
    """Token ids and labels; every assistant response is labelled (only the last with `last_only`)."""
    ids: list[int] = []
    labels: list[int] = []
    prompt_len = 0
    pieces = segments(messages, tokenizer, chat_template)
    last = max(i for i, (_, is_response) in enumerate(pieces) if is_response)
    tokens = tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]  # each piece alone, in one call
    for i, ((_, is_response), piece) in enumerate(zip(pieces, tokens)):
        if is_response:
            prompt_len = len(ids)
        ids += piece
        labels += piece if is_response and (i == last or not last_only) else [IGNORE] * len(piece)
    return Example(ids, labels, prompt_len, messages[-1]["content"])


def encode_pair(prompt: list[dict[str, str]], chosen: str, rejected: str, tokenizer: Any, chat_template: bool) -> Pair:
    return Pair(*(encode([*prompt, {"role": "assistant", "content": text}], tokenizer, chat_template, last_only=True)
                  for text in (chosen, rejected)))


@dataclass
class Stats:
    rows: int = 0
    truncated: int = 0  # responses cut at max_length
    dropped: int = 0  # prompts that leave no room for a response token
    shortest_dropped_prompt: int = 0
    split: int = 0  # text rows longer than max_length, split into pieces (none of their tokens lost)
    sources: str = ""  # a mixture: the rows drawn from each source

    def count(self, encoded: Encoded) -> None:
        self.truncated += encoded.truncated
        self.split += encoded.split
        if encoded.dropped is not None:
            self.dropped += 1
            self.shortest_dropped_prompt = min(self.shortest_dropped_prompt or encoded.dropped, encoded.dropped)

    def check(self, key: str, source: str, max_length: int, kept: bool) -> None:
        """Refuse a split that filtering left empty, saying why."""
        if kept:
            return
        why = (
            f"all {self.dropped} prompts are longer than data.max_length={max_length} "
            f"(the shortest is {self.shortest_dropped_prompt} tokens): raise data.max_length"
            if self.dropped
            else "it has no rows"
        )
        raise ConfigError(f"{key}={source}: the dataset is empty after filtering: {why}")

    def line(self, name: str, max_length: int) -> str:
        return (
            f"data {name}: {self.rows} rows, {self.truncated} responses truncated at max_length={max_length}, "
            f"{self.dropped} dropped (prompt too long)" + (f", {self.split} text rows split into max_length pieces" if self.split else "")
            + (f"\n{self.sources}" if self.sources else "")
        )


def encode_text(text: str, tokenizer: Any, max_length: int) -> list[Example]:
    """A text row (continued pre-training): BOS + its tokens + EOS, every token a label, in consecutive
    pieces of at most `max_length` tokens (a last piece of one token, which predicts nothing, is dropped)."""
    ids = ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + \
        tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    pieces = [ids[i : i + max_length] for i in range(0, len(ids), max_length)]
    return [Example(p, list(p), 0, "") for p in pieces if len(p) > 1]


@dataclass
class Encoded:
    """One row, tokenized: its examples (a text row's pieces, or one example or pair), and what happened to it."""

    items: list[Any]
    truncated: bool = False  # its response was cut at max_length
    dropped: int | None = None  # the prompt's length, when it leaves no room for a response token (no items)
    split: bool = False  # a text row longer than max_length, in several pieces


def fit(item: Any, cfg: DataConfig, where: str) -> Encoded:
    """An example of prompt + response rows (all sharing one prompt), cut to cfg.max_length: each row's response
    cut at the end (the prompt, and the boundary, never lost), or the example dropped (or refused, per
    data.long_prompt) when its prompt leaves no room for a single response token."""
    parts = rows_of(item)
    first_label = next((j for j, label in enumerate(parts[0].labels) if label != IGNORE), len(parts[0].labels))
    if first_label >= cfg.max_length:  # not a single response token would fit
        if cfg.long_prompt == LongPrompt.error:
            raise ConfigError(
                f"{where}: the prompt is {first_label} tokens, data.max_length={cfg.max_length} leaves no "
                "room for the response: raise data.max_length or set data.long_prompt=drop"
            )
        return Encoded([], dropped=first_label)
    truncated = any(len(ex.input_ids) > cfg.max_length for ex in parts)
    if truncated:
        for ex in parts:
            ex.input_ids, ex.labels = ex.input_ids[: cfg.max_length], ex.labels[: cfg.max_length]
    return Encoded([item], truncated=truncated)
