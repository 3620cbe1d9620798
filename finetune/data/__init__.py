"""Datasets -> conversations -> token ids with response-only labels -> per-rank micro-batches.

SFT rows (alpaca, chat, sharegpt, completion: finetune/formats.py) become a list of messages, rendered
by the tokenizer's chat template or our built-in one, and tokenized segment by segment so that we
know exactly which tokens are the response: only those carry labels. Text rows (continued
pre-training) are tokenized whole, every token a label, split into max_length pieces.

Preference rows (DPO) become a `Pair` of two examples, prompt + chosen and prompt + rejected,
rendered through the same templates; only the final response carries labels. A pair's batch is
its chosen rows followed by its rejected rows, so one forward scores both.

The batch order is a pure function of (seed, step): step k uses the same global batch of samples
on any number of ranks, so runs with different layouts (and a resumed run) see the same data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from finetune.config import ConfigError, DataConfig, DataFormat, LongPrompt, Method, Template
from finetune.formats import Rows, form_of, load_rows, load_sources, text_of, to_messages, to_pair  # noqa: F401 (load_rows: re-exported)

if TYPE_CHECKING:
    import torch

IGNORE = -100  # label of tokens that carry no loss (prompt, padding)


# ---------------------------------------------------------------------------------------------
# Messages -> tokens


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


def tokenize_row(row: dict[str, Any], where: str, tokenizer: Any, cfg: DataConfig, method: Method, chat: bool) -> Encoded:
    """One row -> its examples no longer than cfg.max_length (see `tokenize`)."""
    if method == Method.dpo:
        item = encode_pair(*to_pair(row, cfg.system_prompt, where), tokenizer, chat)
        parts = [item.chosen, item.rejected]
    elif form_of(row, cfg.format, where) == DataFormat.text:
        pieces = encode_text(text_of(row, where), tokenizer, cfg.max_length)
        return Encoded(pieces, split=len(pieces) > 1)
    else:
        item = encode(to_messages(row, cfg.format, cfg.system_prompt, where), tokenizer, chat)
        parts = [item]
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


def tokenize(rows: Rows, tokenizer: Any, cfg: DataConfig, key: str, method: Method = Method.sft) -> tuple[list[Any], Stats]:
    """Rows -> examples (or preference pairs) no longer than cfg.max_length, with truncation counted.

    A pair keeps its prompt whole and cuts each response at the end, so the prompt/response
    boundary (and the prompt both responses share) is never lost."""
    chat = uses_chat_template(tokenizer, cfg.template)
    stats = Stats(rows=len(rows.rows), sources=rows.note)
    out: list[Any] = []
    for i, row in enumerate(rows.rows):
        encoded = tokenize_row(row, rows.where(i), tokenizer, cfg, method, chat)
        stats.count(encoded)
        out += encoded.items
    stats.check(key, rows.source, cfg.max_length, bool(out))
    return out, stats


def split_rows(cfg: DataConfig, seed: int) -> tuple[Rows, Rows | None]:
    """The train rows and the eval rows (data.eval, or data.eval_size rows of data.train held out by `seed`)."""
    train_rows = load_sources(cfg.train, cfg.train_split, "data.train", seed)
    if cfg.eval is not None:
        return train_rows, load_sources(cfg.eval, cfg.eval_split, "data.eval", seed)
    if not cfg.eval_size:
        return train_rows, None
    if cfg.eval_size >= len(train_rows.rows):
        raise ConfigError(f"data.eval_size={cfg.eval_size} leaves no training rows out of {len(train_rows.rows)}")
    order = np.random.default_rng(seed).permutation(len(train_rows.rows))
    held, kept = sorted(order[: cfg.eval_size]), sorted(order[cfg.eval_size :])
    return train_rows.subset(kept), train_rows.subset(held)


def load_split(cfg: DataConfig, tokenizer: Any, seed: int, method: Method = Method.sft) -> tuple[list[Any], list[Any], dict[str, Stats]]:
    """The train and eval examples (pairs for DPO), per the data config, with their counts, in memory."""
    train_rows, eval_rows = split_rows(cfg, seed)
    train, train_stats = tokenize(train_rows, tokenizer, cfg, "data.train", method)
    stats = {"train": train_stats}
    evals: list[Any] = []
    if eval_rows is not None:
        evals, stats["eval"] = tokenize(eval_rows, tokenizer, cfg, "data.eval", method)
    return train, evals, stats


# ---------------------------------------------------------------------------------------------
# Batches


def collate(examples: list[Any], pad_id: int, width: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding carries no loss.

    Preference pairs become 2B rows: the B chosen, then the B rejected, and their precomputed
    reference log-probs (if any) as `reference_logps` in the same order.

    Plain rows get an attention mask. Packed rows get position ids instead, restarting at 0 for
    every sample (and for the padding tail): transformers then attends only within each sample
    (a block-diagonal causal mask with sdpa/eager, varlen kernels with flash-attn).
    `real_tokens` counts the non-pad tokens of each row. `width` pads to a fixed length
    (pipeline parallel: every micro-batch has one shape).
    """
    import torch  # here, not at the top: the planner reads lengths through this module without torch

    if isinstance(examples[0], Pair):
        batch = collate([p.chosen for p in examples] + [p.rejected for p in examples], pad_id, width)
        if examples[0].reference is not None:
            batch["reference_logps"] = torch.tensor([p.reference[0] for p in examples] + [p.reference[1] for p in examples],
                                                    dtype=torch.float64)
        return batch
    width = width or max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    real = torch.tensor([len(e.input_ids) for e in examples])
    for row, e in enumerate(examples):
        ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[row, : len(e.input_ids)] = torch.tensor(e.labels)
    batch = {"input_ids": ids, "labels": labels, "real_tokens": real}
    if examples[0].position_ids is None:
        batch["attention_mask"] = (torch.arange(width)[None, :] < real[:, None]).long()
    else:
        pos = torch.zeros((len(examples), width), dtype=torch.long)
        for row, e in enumerate(examples):
            n = len(e.input_ids)
            pos[row, :n] = torch.tensor(e.position_ids)
            pos[row, n:] = torch.arange(width - n)  # the padding tail is a separate "sample"
        batch["position_ids"] = pos
    return batch


def first_fit(lengths: list[int], max_length: int, seed: int) -> list[list[int]]:
    """Which samples (by index) share each packed row of at most `max_length` tokens: first fit, in a
    seeded order (what `pack` packs; the planner reads packed lengths from it without tokens).

    Each sample goes to the first row with room for it, found in O(log n) by descending a max-tree of
    the rows' free room (rows not opened yet are empty, so "no open row fits" lands on the next new one):
    n log n in all, a million samples in seconds, the same rows the plain scan gives."""
    order = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    if lengths and max(lengths) > max_length:
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a packed row of {max_length}")
    cap = 1
    while cap < len(lengths):
        cap *= 2
    room = [max_length] * (2 * cap)  # room[cap + r]: row r's free tokens; room[k]: the most under node k
    rows: list[list[int]] = []
    for i in order:
        n = lengths[i]
        node = 1
        while node < cap:  # the leftmost row with room >= n
            node = 2 * node if room[2 * node] >= n else 2 * node + 1
        r = node - cap
        if r == len(rows):
            rows.append([])
        rows[r].append(i)
        room[node] -= n
        node //= 2
        while node:  # refresh the maxima above it, up to the first one that does not change
            most = max(room[2 * node], room[2 * node + 1])
            if room[node] == most:
                break
            room[node] = most
            node //= 2
    return rows


def pack(examples: list[Example], max_length: int, seed: int) -> list[Example]:
    """Several samples per row of at most `max_length` tokens (first fit, in a seeded order).

    Each sample keeps its own labels and positions; nothing crosses sample boundaries.
    """
    rows = [[examples[i] for i in row] for row in first_fit([len(e.input_ids) for e in examples], max_length, seed)]
    return [
        Example(
            input_ids=[t for e in row for t in e.input_ids],
            labels=[t for e in row for t in e.labels],
            prompt_len=0,
            reference="",
            position_ids=[p for e in row for p in range(len(e.input_ids))],
        )
        for row in rows
    ]


class TrainBatches:
    """Step -> this rank's micro-batches. Pure in (seed, step): any layout sees the same samples.

    The global batch of step k is positions [k*G, (k+1)*G) of an endless stream made of one
    seeded permutation of the dataset per epoch. It is split into contiguous blocks, one per
    data-parallel rank, and each block into micro-batches.
    """

    def __init__(
        self, examples: list[Example], *, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int, pad_id: int,
        pad_to: int | None = None,
    ) -> None:
        self.examples, self.global_batch, self.micro_batch = examples, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed, self.pad_id, self.pad_to = dp_rank, dp_size, seed, pad_id, pad_to
        self._perm: dict[int, np.ndarray] = {}

    def indices(self, step: int) -> list[int]:
        """Dataset indices of this rank's share of the global batch of `step` (0-based)."""
        n, per_rank = len(self.examples), self.global_batch // self.dp_size
        start = step * self.global_batch + self.dp_rank * per_rank
        return [int(self._permutation(p // n)[p % n]) for p in range(start, start + per_rank)]

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm:
            self._perm = {e: p for e, p in self._perm.items() if e == epoch - 1}  # a step spans <= 2 epochs
            self._perm[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
        return self._perm[epoch]

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        idx = self.indices(step)
        chunks = [idx[i : i + self.micro_batch] for i in range(0, len(idx), self.micro_batch)]
        return [collate([self.examples[i] for i in chunk], self.pad_id, self.pad_to) for chunk in chunks]

    def epoch(self, step: int) -> float:
        return step * self.global_batch / len(self.examples)


def shard(items: list[Any], rank: int, world: int) -> list[Any]:
    """This rank's contiguous share of an evaluation list (sizes differ by at most one)."""
    per, extra = divmod(len(items), world)
    start = rank * per + min(rank, extra)
    return items[start : start + per + (rank < extra)]


def for_generation(examples: list[Any]) -> list[Example]:
    """What exact match generates from: the example, or a pair's chosen response; text rows have no prompt."""
    return [e for e in (e.chosen if isinstance(e, Pair) else e for e in examples) if e.prompt_len > 0]  # not text rows


def eval_batches(examples: list[Any], batch_size: int, pad_id: int) -> Iterator[dict[str, torch.Tensor]]:
    for i in range(0, len(examples), batch_size):
        yield collate(examples[i : i + batch_size], pad_id)
