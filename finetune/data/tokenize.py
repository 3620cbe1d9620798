"""Conversations, pairs and text -> token ids with response-only labels (finetune.data.forms gives the rows' shapes).

SFT rows become a list of messages (and the tools they offer), rendered by the tokenizer's chat template (or
data.chat_template's) or our built-in one, and tokenized segment by segment so that we know exactly which tokens are the
response: only those carry labels (the assistant's text and tool calls; never tool results). finetune.data.templates
finds each response in the rendered conversation, probes a template for tools and splits reasoning blocks out
(data.reasoning=mask: in the input, out of the loss; drop: removed). Text rows (continued pre-training) are tokenized whole, every token a label, split into
max_length pieces.

Preference rows (DPO) become a `Pair` of two examples, prompt + chosen and prompt + rejected, rendered
through the same templates; only the final response carries labels. A pair's batch is its chosen rows
followed by its rejected rows, so one forward scores both.

Which of these a row becomes is the method's `encode` (finetune.methods), built from the helpers here
(`encode`, `encode_pair`, `encode_text`, `fit`); finetune.data.examples calls it (`tokenize_row`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from finetune.config import ConfigError, DataConfig, LongPrompt, Reasoning, Template
from finetune.data import templates
from finetune.data.images import PLACEHOLDER, as_parts, pictures_of
from finetune.data.tools import Message

IGNORE = -100  # label of tokens that carry no loss (prompt, padding)


def uses_chat_template(tokenizer: Any, template: Template) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if template == Template.tokenizer and not has:
        raise ConfigError("data.template=tokenizer, but the tokenizer has no chat template: use data.template=builtin or auto")
    return template == Template.tokenizer or (template == Template.auto and has)


def segments(messages: list[Message], tokenizer: Any, chat_template: bool, tools: templates.Tools = None,
             where: str = "a row") -> list[tuple[str, bool]]:
    """Split a rendered conversation into (text, is_response) pieces, in order (finetune.data.templates.spans)."""
    if not chat_template:
        return _builtin_segments(messages, tokenizer)
    full, found = templates.spans(messages, tokenizer, tools, where)
    out: list[tuple[str, bool]] = []
    done = 0
    for start, end in found:
        out += [(full[done:start], False), (full[start:end], True)]
        done = end
    out.append((full[done:], False))
    return [(text, resp) for text, resp in out if text]


def _builtin_segments(messages: list[Message], tokenizer: Any) -> list[tuple[str, bool]]:
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
    thought: int = field(default=0, compare=False)
    """Tokens of reasoning blocks in its labelled responses (dropped: in any assistant message), per data.reasoning: a
    count for the data line, which the token cache keeps per row of its own (not with the example)."""
    images: tuple[Any, ...] = ()
    """Its images in order (a vision-language model's: paths, or bytes in memory), each already expanded to its tokens
    in `input_ids` (finetune.data.images.Pictures); the batch turns them into the model's pixel inputs."""
    image_tokens: int = field(default=0, compare=False)
    """How many of its tokens are its images' (the data line counts them)."""
    image_end: int = field(default=0, compare=False)
    """Where its last image's tokens end: `fit` never cuts an image (a prompt longer than this is a long prompt)."""


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


def encode(messages: list[Message], tokenizer: Any, chat_template: bool, last_only: bool = False, *, tools: templates.Tools = None,
           data: DataConfig | None = None, where: str = "a row", images: list[Any] | tuple[Any, ...] = ()) -> Example:
    """Token ids and labels; every assistant response is labelled (only the last with `last_only`). `tools`: the
    functions the row offers; `data`: its data.reasoning and data.reasoning_tags (None: reasoning kept, uncounted);
    `images`: the row's images, one for each finetune.data.images.PLACEHOLDER in the messages (finetune.data.forms.images_of),
    each expanded into the tokens the model's processor says (a prompt's tokens: never labelled)."""
    pictures = pictures_of(tokenizer) if images else None
    if images and pictures is None:
        raise ConfigError(f"{where}: this row has {len(images)} image(s), but the model is a text model (its config.json has no "
                          "vision_config): train a vision-language model on it, or remove the images")
    if pictures is not None:  # each image as the template renders it: a content part, or the processor's own token
        messages = [m if m["role"] == "assistant" else
                    {**m, "content": as_parts(m["content"]) if chat_template else m["content"].replace(PLACEHOLDER, pictures.token)}
                    for m in messages]
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        templates.check_tools(tokenizer, chat_template, where)
    mode, tags = (data.reasoning, data.reasoning_tags) if data is not None else (Reasoning.keep, None)
    if tags is not None:
        templates.check_blocks(messages, tags, where)
    dropped: list[str] = []
    if mode == Reasoning.drop:
        messages, dropped = templates.drop_reasoning(messages, tags)
        if not messages[-1]["content"].strip() and not messages[-1].get("tool_calls"):
            raise ConfigError(f"{where}: the response is nothing but reasoning, which data.reasoning=drop removes: fix the row, or "
                              "set data.reasoning=keep or mask")
    pieces = segments(messages, tokenizer, chat_template, tools, where)
    last = max(i for i, (_, is_response) in enumerate(pieces) if is_response)
    flat = [(text, is_response and (i == last or not last_only), i == last, False) for i, (text, is_response) in enumerate(pieces)]
    counted = dropped  # reasoning text to count apart from the pieces: dropped, or kept (tokenized as it is rendered)
    if mode == Reasoning.mask:  # (text, labelled, last response, reasoning): each labelled block a piece of its own
        flat = [(t, on, end, thought) for text, on, end, _ in flat
                for t, thought in (templates.split_reasoning(text, tags) if on else [(text, False)])]
    elif mode == Reasoning.keep and tags is not None:
        counted = [t for text, on, *_ in flat if on for t, thought in templates.split_reasoning(text, tags) if thought]
    if pictures is not None:  # the pieces with each image's tokens in place
        tokens = pictures.tokenize([text for text, *_ in flat], list(images), where)
        tokens += tokenizer(counted, add_special_tokens=False)["input_ids"] if counted else []
    else:
        tokens = tokenizer([text for text, *_ in flat] + counted, add_special_tokens=False)["input_ids"]  # each piece alone, in one call
    ids: list[int] = []
    labels: list[int] = []
    prompt_len = None
    thought = sum(len(t) for t in tokens[len(flat):])
    for (_, on, end, is_thought), piece in zip(flat, tokens):
        if end and prompt_len is None:
            prompt_len = len(ids)
        thought += len(piece) if is_thought else 0
        ids += piece
        labels += piece if on and not is_thought else [IGNORE] * len(piece)
    if pictures is None:
        shows = pictures_of(tokenizer)  # a vision-language model's text row: its text must not spell an image's token
        if shows is not None and shows.image_token_id in ids:
            token = tokenizer.convert_ids_to_tokens(shows.image_token_id)
            raise ConfigError(f"{where}: the row's text holds the model's image token ({token}, id {shows.image_token_id}) but the "
                              f"row has no images: give the image (an 'images' list with {PLACEHOLDER} where it goes, or an "
                              "image part), or remove the token from the text")
        return Example(ids, labels, prompt_len or 0, messages[-1]["content"], thought=thought)
    marks = [i for i, t in enumerate(ids) if t == pictures.image_token_id]
    labels = [IGNORE if t == pictures.image_token_id else label for t, label in zip(ids, labels)]
    return Example(ids, labels, prompt_len or 0, messages[-1]["content"], thought=thought, images=tuple(images),
                   image_tokens=len(marks), image_end=marks[-1] + 1 if marks else 0)


def encode_pair(prompt: list[Message], chosen: str, rejected: str, tokenizer: Any, chat_template: bool, *,
                tools: templates.Tools = None, data: DataConfig | None = None, where: str = "a row",
                images: list[Any] | tuple[Any, ...] = ()) -> Pair:
    """The prompt with each response, as two rows (`images`: the prompt's, in both)."""
    return Pair(*(encode([*prompt, {"role": "assistant", "content": text}], tokenizer, chat_template, last_only=True, tools=tools,
                         data=data, where=where, images=images) for text in (chosen, rejected)))


@dataclass
class Stats:
    rows: int = 0
    truncated: int = 0  # responses cut at max_length
    dropped: int = 0  # prompts that leave no room for a response token
    shortest_dropped_prompt: int = 0
    split: int = 0  # text rows longer than max_length, split into pieces (none of their tokens lost)
    sources: str = ""  # a mixture: the rows drawn from each source
    reasoning: int = 0  # rows with reasoning blocks
    thought: int = 0  # their tokens, `reasoning_mode`
    reasoning_mode: str = "keep"  # data.reasoning, once a row had reasoning
    images: int = 0  # images in the kept examples (a vision-language model's rows)
    image_tokens: int = 0  # the tokens they became

    def count(self, encoded: Encoded) -> None:
        for item in encoded.items:  # an example's rows show the same images: its first row's
            self.images += len(rows_of(item)[0].images)
            self.image_tokens += rows_of(item)[0].image_tokens
        self.truncated += encoded.truncated
        self.split += encoded.split
        self.reasoning += encoded.thought > 0
        self.thought += encoded.thought
        self.reasoning_mode = encoded.reasoning_mode if encoded.thought else self.reasoning_mode
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
            + (f", {self.reasoning} rows with reasoning ({self.thought} tokens {THOUGHT[self.reasoning_mode]})" if self.reasoning else "")
            + (f", {self.images} images ({self.image_tokens} image tokens, "
               f"{self.image_tokens / self.images:.0f} per image)" if self.images else "")
            + (f"\n{self.sources}" if self.sources else "")
        )


THOUGHT = {"keep": "trained on", "mask": "masked out of the loss", "drop": "dropped"}  # data.reasoning, as the data line says it


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
    thought: int = 0  # reasoning tokens of its rows (finetune.data.tokenize.Example.thought), per data.reasoning
    reasoning_mode: str = "keep"


def fit(item: Any, cfg: DataConfig, where: str) -> Encoded:
    """An example of prompt + response rows (all sharing one prompt), cut to cfg.max_length: each row's response
    cut at the end (the prompt, and the boundary, never lost), or the example dropped (or refused, per
    data.long_prompt) when its prompt leaves no room for a single response token."""
    parts = rows_of(item)
    first_label = next((j for j, label in enumerate(parts[0].labels) if label != IGNORE), len(parts[0].labels))
    image_end = max(ex.image_end for ex in parts)  # an image's tokens are never cut: the model reads them all or none
    if first_label >= cfg.max_length or image_end > cfg.max_length:  # not a single response token would fit
        prompt = "the prompt" if first_label >= image_end else "the prompt with its images"
        if cfg.long_prompt == LongPrompt.error:
            raise ConfigError(
                f"{where}: {prompt} is {max(first_label, image_end)} tokens, data.max_length={cfg.max_length} leaves no "
                "room for the response: raise data.max_length or set data.long_prompt=drop"
            )
        return Encoded([], dropped=max(first_label, image_end))
    truncated = any(len(ex.input_ids) > cfg.max_length for ex in parts)
    if truncated:
        for ex in parts:
            ex.input_ids, ex.labels = ex.input_ids[: cfg.max_length], ex.labels[: cfg.max_length]
    return Encoded([item], truncated=truncated, thought=sum(ex.thought for ex in parts), reasoning_mode=cfg.reasoning.value)
