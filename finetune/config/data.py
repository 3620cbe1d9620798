"""The data group's config: its enumerations and `DataConfig` (finetune/config/schema.py re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from finetune.config.fields import ANY_TEXT, ASSETS, SOURCES, TEXT, Accepts, Spelled, at_least, checked

TEMPLATES = ASSETS / "templates"
"""The shipped chat templates, NAME.jinja each: what data.chat_template=NAME reads."""


def template_path(value: str) -> Path:
    """data.chat_template's file: a shipped template by name, else the path given."""
    shipped = TEMPLATES / f"{value}.jinja"
    return shipped if "/" not in value and shipped.is_file() else Path(value).expanduser()


CHAT_TEMPLATE = Accepts(f"a .jinja file or a shipped template ({', '.join(sorted(p.stem for p in TEMPLATES.glob('*.jinja')))})",
                        lambda v: template_path(str(v)).is_file() and (str(v).endswith(".jinja") or "/" not in str(v)),
                        ("nonexistent.jinja",))
TAG_PAIR = Accepts("two different non-empty tags: [opening, closing]",
                   lambda v: len(v) == 2 and all(str(t).strip() for t in v) and v[0] != v[1], ("['<think>']",))


class DataFormat(str, Enum, metaclass=Spelled):
    auto = "auto"
    alpaca = "alpaca"
    chat = "chat"
    sharegpt = "sharegpt"
    completion = "completion"
    text = "text"
    preference = "preference"


class Template(str, Enum, metaclass=Spelled):
    auto = "auto"
    tokenizer = "tokenizer"
    builtin = "builtin"


class LongPrompt(str, Enum, metaclass=Spelled):
    drop = "drop"
    error = "error"


class Reasoning(str, Enum, metaclass=Spelled):
    keep = "keep"
    mask = "mask"
    drop = "drop"


@dataclass
class DataConfig:
    train: Any = checked(SOURCES, MISSING)
    """A local .jsonl/.json file, a local dataset directory, or a hub dataset id; or one source as people name a hub
    dataset, {path: ORG/NAME, name: SUBSET, split: SPLIT, revision: REV, columns: {messages: conversation}}
    (`datasets.load_dataset(path, name=, split=, revision=)`; `columns` renames the dataset's columns to the keys the
    row forms read); or a mixture: a list of those, each optionally with a weight or rows. `rows`: exactly that
    many rows of it (seeded sample; repeated past its size); `weight`: the weighted sources share their part of the
    mixture in these proportions, as many rows as that allows without repeating one."""
    eval: Any = checked(SOURCES, None)
    """The same forms as `train`; null: hold out `eval_size` rows of `train` instead."""
    eval_size: int = checked(at_least(0), 0)
    """Rows of `train` held out for evaluation when `eval` is null (0: no evaluation)."""
    train_split: str = checked(TEXT, "train")
    """Split to read from a dataset directory or hub id (ignored for .jsonl files)."""
    eval_split: str = checked(TEXT, "train")
    """Split to read from `eval` when it is a dataset directory or hub id."""
    format: DataFormat = DataFormat.auto
    """alpaca (instruction/input/output), chat (OpenAI-style messages: role/content, other keys ignored),
    sharegpt (conversations: from/value), completion (prompt/completion or question/answer), text (plain
    text for continued pre-training: every token is trained on, long rows split into max_length pieces),
    preference (prompt/chosen/rejected, for method=dpo), or auto: decided per row by its keys."""
    template: Template = Template.auto
    """tokenizer: its chat template; builtin: ours; auto: the tokenizer's if it has one."""
    chat_template: str | None = checked(CHAT_TEMPLATE, None)
    """Render rows with this chat template instead of the tokenizer's: a .jinja file, or a shipped one by name (qwen2_5,
    llama3_1, gemma, mistral; compact: the shipped tokenizer's own with tools, one line each: finetune/assets/templates/);
    the run's saved tokenizer carries it. null: the tokenizer's."""
    reasoning: Reasoning = Reasoning.keep
    """Reasoning blocks (`reasoning_tags`, <think>...</think>) in assistant messages: keep (trained on like the rest
    of the response), mask (in the input, out of the loss) or drop (removed before rendering). Counted in the data line."""
    reasoning_tags: list[str] = checked(TAG_PAIR, factory=lambda: ["<think>", "</think>"])
    """The opening and closing tags of a reasoning block."""
    system_prompt: str | None = checked(ANY_TEXT, None)
    """Prepended as a system message to rows that have none."""
    max_length: int = checked(at_least(1), 512)
    """Tokens per sample (per prompt+response for preference pairs); longer responses are cut at
    the end (and counted), the prompt is kept whole."""
    long_prompt: LongPrompt = LongPrompt.drop
    """Rows whose prompt leaves no room for a response token: drop (counted) or error."""
    packing: bool = False
    """Train on rows of several samples (up to max_length), each attending only to itself."""
    padding_free: bool | None = None
    """Lay each training micro-batch's rows end to end in one row instead of padding them to the longest: no
    compute on padding, each sample attending only to itself (the same loss). null: on for method=sft wherever
    it runs (not under pipeline or context parallel, not with one row per micro-batch); true: on, refused where
    it cannot run; false: padded rows. Evaluation batches are padded either way."""
    cache: bool = True
    """Tokenize once into Arrow files under `cache_dir`, keyed by everything that changes the tokens,
    and memory-map them on every rank (later launches with the same key skip tokenizing); false:
    tokenize in memory on every rank at every launch."""
    cache_dir: str | None = checked(TEXT, None)
    """Where tokenized data is cached; null: $FINETUNE_CACHE_DIR if set, else $XDG_CACHE_HOME/finetune/tokens
    (~/.cache/finetune/tokens)."""
    num_proc: int | None = checked(at_least(1), None)
    """Processes that tokenize a dataset into the cache (one per 1,000 rows at most); null: the node's cores."""
    streaming: bool = False
    """Read `train` as a stream, for a set larger than the disk cache: rows in a seeded shuffle-buffer order,
    tokenized on the fly by a DataLoader worker on every rank, no token cache (`cache` does not apply; the eval
    set, `eval` or the first `eval_size` rows of `train`, is tokenized in memory). Step k is still examples
    [kG, (k+1)G) of one order, a function of the seed, on any layout; a resume continues it. A mixture needs
    a weight on every source; packing packs each 1,000 rows."""
    shuffle_buffer: int | None = checked(at_least(1), None)
    """streaming: rows held in the shuffle buffer, each next row drawn from it by the seed; null: 10,000;
    1: the source's own order."""
