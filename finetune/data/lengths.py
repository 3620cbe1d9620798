"""How long a run's batches are, read from its data before anything starts, so that the planner
plans the peak for the longest batch the run will see rather than for data.max_length.

How batches are formed (finetune.data.batches.TrainBatches): step k takes positions [kG, (k+1)G) of an
endless stream made of one seeded permutation of the training rows per epoch, cut into
micro-batches, each padded to its longest row (collate). Nothing sorts or buckets rows by length,
so the longest micro-batch is as long as the longest row the run's steps reach (rows are already
cut at data.max_length; a packed row is as long as the samples packed into it), and the planner
counts micro_batch_size examples of that length (x the method's rows per example: DPO's chosen and rejected).

The rows are tokenized by finetune.data's own code (templates, response labels, truncation, long
prompts dropped, the eval rows held out), with `LightTokenizer`: the tokenizer's tokenizer.json
read by the `tokenizers` library (the Rust tokenizer transformers wraps) and its chat template
rendered with jinja2 as transformers renders it. No torch, no transformers: the quickstart's 4,000
rows take about a second (time.perf_counter in tests/test_lengths.py). Only local data files
(.jsonl, .json) are read; a hub dataset, a dataset directory, a stream (data.streaming=true: it is read
once, by the run), or a tokenizer that is neither a local directory nor in the Hugging Face cache leaves
the plan at data.max_length (an upper bound).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from finetune import methods
from finetune.config import Config, ConfigError, ModelConfig
from finetune.data.batches import epoch_steps
from finetune.data.pack import first_fit
from finetune.data.sources import sources, split_rows
from finetune.data.examples import tokenize
from finetune.data.images import pictures_of
from finetune.data.templates import check_tools, override
from finetune.data.tokenize import IGNORE, rows_of, uses_chat_template

@dataclass(frozen=True)
class Longest:
    """The longest micro-batch a run sees, read from its data (finetune.data.lengths.longest_batch)."""

    width: int | None
    """Its tokens per row: a padded batch is as long as its longest row, a packed one as its fullest row
    (None: the data could not be read)."""
    why: str
    """What was read, or why nothing was, for the plan's line (e.g. "the longest of all 4,000 rows of data.train")."""
    labelled: int | None = None
    """The most labelled tokens one micro-batch holds (what logits=chunked puts through the output layer; None: at most
    every token)."""
    image_tokens: int | None = None
    """The most image tokens one micro-batch holds (a vision-language model's rows; None: not read)."""
    pixels_per_token: float = 0.0
    """The pixel values the processor makes per image token (finetune.data.images.Pictures.pixels_per_token): with the
    tower's patch size, how many patches the vision tower runs on."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


class LightTokenizer:
    """What finetune.data asks of a tokenizer (`__call__`, `apply_chat_template`, `chat_template`,
    `bos_token`, `eos_token` and their ids), from the files transformers saves, without torch or transformers."""

    def __init__(self, files: dict[str, Path]) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(files["tokenizer.json"]))
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins, as in transformers
            if name in files:
                config |= json.loads(files[name].read_text())
        self.special = {k: _content(config.get(k)) for k in
                        ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")}
        self.bos_token, self.eos_token = self.special["bos_token"], self.special["eos_token"]
        ids = [None if t is None else self._tokenizer.token_to_id(t) for t in (self.bos_token, self.eos_token)]
        self.bos_token_id, self.eos_token_id = ids  # text rows: BOS + text + EOS
        template = files["chat_template.jinja"].read_text() if "chat_template.jinja" in files else config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._compiled: Any = None

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        if isinstance(text, list):  # a batch: each text on its own, as transformers does
            return {"input_ids": [e.ids for e in self._tokenizer.encode_batch(text, add_special_tokens=add_special_tokens)]}
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        """The conversation rendered as transformers' apply_chat_template(tokenize=False) renders it."""
        assert not tokenize, "finetune.data renders, then tokenizes segment by segment"
        if self._compiled is None or self._compiled[0] != self.chat_template:  # data.chat_template may replace it
            self._compiled = (self.chat_template, _compile(self.chat_template or ""))
        return self._compiled[1].render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     documents=None, **{k: v for k, v in self.special.items() if v is not None})


def light_tokenizer(model: ModelConfig, files: dict[str, Path]) -> LightTokenizer:
    """The launcher's tokenizer for `model`; a local vision-language model's carries its processor (finetune.data.images:
    each image's tokens are the processor's to count, and the token cache keys them), which imports transformers."""
    from finetune.disk import local_vision

    tokenizer = LightTokenizer(files)
    if local_vision(model) is not None:
        from finetune.data.images import attach
        from finetune.data.templates import pictures_for

        attach(tokenizer, pictures_for(model))
    return tokenizer


def _compile(template: str) -> Any:
    """transformers' template environment: sandboxed, trim_blocks/lstrip_blocks, loop controls, its
    tojson, raise_exception and strftime_now, and `{% generation %}` blocks rendered as their body."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def tokenizer_files(m: ModelConfig) -> dict[str, Path] | None:
    """The tokenizer's files from its local directory, or from the Hugging Face cache for a hub id
    (never the network); None without a tokenizer.json."""
    source = m.tokenizer or m.path
    if not source:
        return None
    directory = Path(source).expanduser()
    if directory.is_dir():
        found = {name: directory / name for name in TOKENIZER_FILES if (directory / name).is_file()}
    else:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        found = {}
        for name in TOKENIZER_FILES:
            try:
                path = try_to_load_from_cache(source, name, revision=m.revision)
            except Exception:  # not a valid repo id: nothing cached under it
                return None
            if isinstance(path, str):
                found[name] = Path(path)
    return found if "tokenizer.json" in found else None


def seen_rows(n: int, cfg: Config) -> np.ndarray:
    """Indices of the training rows that the run's steps reach (TrainBatches' stream: one seeded
    permutation per epoch); all of them once the steps cover an epoch."""
    total = steps_of(cfg, n) * cfg.train.global_batch_size
    if total >= n:
        return np.arange(n)
    return np.random.default_rng([cfg.train.seed, 0]).permutation(n)[:total]


def steps_of(cfg: Config, n: int) -> int:
    """train.max_steps, or the steps train.epochs makes of `n` training examples when the launcher has not counted them."""
    return cfg.train.max_steps or epoch_steps(cfg.train.epochs, n, cfg.train.global_batch_size)


def row_lengths(examples: list[Any]) -> list[int]:
    """Tokens of each training example as collate pads it (several rows: the longest, a pair's longer response)."""
    if hasattr(examples, "lengths"):  # the token cache's rows: read from its columns, not row by row
        return examples.lengths().tolist()
    return [max(len(row.input_ids) for row in rows_of(e)) for e in examples]


def row_labelled(examples: list[Any]) -> list[int]:
    """Labelled positions of each training example (of all its rows: a pair's two), what logits=chunked
    puts through the output layer."""
    if hasattr(examples, "labelled"):
        return examples.labelled().tolist()

    def count(e: Any) -> int:
        return len(e.labels) - 1 - e.labels[1:].count(IGNORE) if e.labels else 0
    return [sum(count(row) for row in rows_of(e)) for e in examples]


def longest_of(lengths: list[int], cfg: Config, labelled: list[int] | None = None, pictures: Any = None,
               images: Any = None) -> Longest:
    """The longest batch among the rows the run's steps reach (and at most how many labelled tokens, and image tokens,
    a micro-batch of them holds: its rows' most, micro_batch_size times). `pictures`, `images`: a vision-language
    model's processor and each row's image tokens (`row_image_tokens`)."""
    seen = seen_rows(len(lengths), cfg)
    width = max(lengths[i] for i in seen)
    most = cfg.train.micro_batch_size * max(labelled[i] for i in seen) if labelled else None
    what = "packed rows" if cfg.data.packing else "rows"
    scope = f"all {len(lengths):,} {what} of data.train" if len(seen) == len(lengths) else \
        f"the {len(seen):,} {what} of data.train its {steps_of(cfg, len(lengths))} steps reach, of {len(lengths):,}"
    if pictures is None or images is None or not pictures.loads():
        return Longest(width, f"the longest of {scope}", most)
    return Longest(width, f"the longest of {scope}", most, cfg.train.micro_batch_size * int(max(images[i] for i in seen)),
                   pictures.pixels_per_token())


def row_image_tokens(examples: Any, token_id: int | None) -> Any:
    """Image tokens of each training example (of all its rows: a pair's two show the prompt's images twice)."""
    if hasattr(examples, "image_tokens"):  # the token cache's columns
        return examples.image_tokens(token_id)
    return [sum(row.image_tokens for row in rows_of(e)) for e in examples]


def _from_cache(cfg: Config, files: dict[str, Path]) -> Longest | None:
    """The lengths from the run's token cache entry when there is one (finetune/data/cache.py): a million
    rows are read from their Arrow columns in a second instead of being tokenized again."""
    if not cfg.data.cache:
        return None
    from finetune.data import cache

    try:
        tokenizer = override(light_tokenizer(cfg.model, files), cfg.data)
        entry = cache.find(cfg.data, tokenizer, cfg.method.name, cfg.train.seed)
    except Exception:  # noqa: BLE001 - the tokenizer this light reader cannot read: tokenize below, which says why
        return None
    if entry is None:
        return None
    train = cache.open_split(entry / "train.arrow", cfg.method.name)  # packed already when data.packing
    pictures = pictures_of(tokenizer)
    return longest_of(train.lengths().tolist(), cfg, train.labelled().tolist(), pictures,
                      row_image_tokens(train, pictures.image_token_id) if pictures is not None else None)


STREAMED = "data.streaming=true: a stream's lengths are known only as the run reads it"


def longest_batch(cfg: Config) -> Longest | str:
    """The longest batch the run will see, read from its data; or why the data was not read (the plan is then
    at data.max_length, an upper bound)."""
    if cfg.data.streaming:
        return STREAMED
    not_files = [s for s in sources(cfg.data.train, cfg.data.train_split, "data.train") if not Path(s.path).expanduser().is_file()]
    if not_files:
        return f"{not_files[0].key}={not_files[0].path} is not a local .jsonl/.json file"
    files = tokenizer_files(cfg.model)
    if files is None:
        return f"no tokenizer.json for {cfg.model.tokenizer or cfg.model.path} here (in its directory or the Hugging Face cache)"
    cached = _from_cache(cfg, files)
    if cached is not None:
        return cached
    try:
        rows = split_rows(replace(cfg.data, eval=None) if cfg.data.eval is not None else cfg.data, cfg.train.seed)[0]
        tokenizer = override(light_tokenizer(cfg.model, files), cfg.data)
        examples, _ = tokenize(rows, tokenizer, cfg.data, "data.train", cfg.method.name)
    except ConfigError as e:  # the launcher names data mistakes itself
        return f"data.train could not be read ({e})"
    except Exception as e:  # a tokenizer or template this light reader cannot handle
        return f"the tokenizer could not be read without transformers ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    lengths, labelled = row_lengths(examples), row_labelled(examples)
    if cfg.data.packing and methods.get(cfg.method.name).unpacked is None:
        packed = first_fit(lengths, cfg.data.max_length, cfg.train.seed)
        lengths, labelled = [sum(lengths[i] for i in row) for row in packed], [sum(labelled[i] for i in row) for row in packed]
    pictures = pictures_of(tokenizer)  # packing is refused for a vision-language model: its rows are the examples
    return longest_of(lengths, cfg, labelled, pictures,
                      row_image_tokens(examples, pictures.image_token_id) if pictures is not None else None)


def check_tools_template(cfg: Config, where: str | None) -> None:
    """Before launch: refuse data whose first row with tools (at `where`; None: no such row) the run's chat template cannot
    render (finetune.data.templates.check_tools), read with `LightTokenizer`; a tokenizer not here is probed by the ranks."""
    files = tokenizer_files(cfg.model) if where is not None else None
    if files is None:
        return
    tokenizer = override(LightTokenizer(files), cfg.data)
    check_tools(tokenizer, uses_chat_template(tokenizer, cfg.data.template), where)
