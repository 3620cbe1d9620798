"""train.epochs -> train.max_steps, counted once by the launcher before any rank starts (and by the planner's command),
so every rank, the learning-rate schedule, the checkpoint cadence and the reports read one number: the resolved
config's train.max_steps.

    steps = ceil(epochs x training examples / global_batch_size),  global_batch_size = micro_batch x grad_accum x dp

The training examples are those the ranks train on: after the method's encoding (long prompts dropped, text rows
split) and after packing (packed rows). Counted from the run's token cache entry when there is one (its meta.json,
what the ranks will read: a resume reads the same count), else by tokenizing data.train here with finetune.data.lengths'
LightTokenizer (no torch, no transformers; the quickstart's 4,000 rows in about a second). Rank 0 checks the count
against the examples it loads (`check_count`). Imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Callable

from finetune import methods
from finetune.config import Config, ConfigError
from finetune.data.batches import epoch_steps
from finetune.data.lengths import LightTokenizer, light_tokenizer, row_lengths, tokenizer_files


def resolve(cfg: Config, say: Callable[[str], None]) -> None:
    """With train.epochs: count the training examples, set cfg.train.max_steps to the steps they make, say how
    (one line), and check the warmup against them. Without: nothing."""
    t = cfg.train
    if t.epochs is None:
        return
    examples, where = count_examples(cfg)
    t.max_steps = epoch_steps(t.epochs, examples, t.global_batch_size)
    what = "packed rows" if packed(cfg) else "examples"
    say(f"train.epochs={t.epochs:g}: train.max_steps={t.max_steps} = ceil({t.epochs:g} x {examples:,} {what} of data.train / "
        f"{t.global_batch_size} per step (micro_batch {t.micro_batch_size} x grad_accum {cfg.grad_accum_steps} x dp "
        f"{cfg.data_parallel_size})); counted {where}")
    check_warmup(cfg)


def packed(cfg: Config) -> bool:
    return cfg.data.packing and methods.get(cfg.method.name).unpacked is None


def count_examples(cfg: Config) -> tuple[int, str]:
    """The training examples after packing, and where they were counted (the token cache, or tokenized here)."""
    files = tokenizer_files(cfg.model)
    if files is None:
        raise ConfigError(f"train.epochs={cfg.train.epochs:g} counts data.train's examples with the tokenizer, and "
                          f"{cfg.model.tokenizer or cfg.model.path} has no tokenizer.json here (its directory or the Hugging "
                          "Face cache): download it once, or set train.max_steps instead")
    try:
        tokenizer = light_tokenizer(cfg.model, files)
    except Exception as e:  # noqa: BLE001 - a tokenizer this light reader cannot read
        raise ConfigError(f"train.epochs={cfg.train.epochs:g}: the tokenizer could not be read without transformers to count "
                          f"data.train's examples ({type(e).__name__}): set train.max_steps instead") from None
    if cfg.data.cache:
        from finetune.data import cache

        entry = cache.find(cfg.data, tokenizer, cfg.method.name, cfg.train.seed)
        if entry is not None:
            return json.loads((entry / cache.META).read_text())["rows"]["train"], f"from the token cache {entry}"
    return _tokenized(cfg, tokenizer), "by tokenizing data.train here"


def _tokenized(cfg: Config, tokenizer: LightTokenizer) -> int:
    from finetune.data.examples import tokenize
    from finetune.data.pack import first_fit
    from finetune.data.sources import split_rows

    data = replace(cfg.data, eval=None, eval_size=0) if cfg.data.eval is not None else cfg.data  # the train rows only
    rows = split_rows(data, cfg.train.seed)[0]
    try:
        examples, _ = tokenize(rows, tokenizer, cfg.data, "data.train", cfg.method.name)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a template this light reader cannot render
        raise ConfigError(f"train.epochs={cfg.train.epochs:g}: data.train could not be tokenized without transformers to count "
                          f"its examples ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): run python -m "
                          "finetune.prepare with this config first (the launcher then reads the token cache's count), or set "
                          "train.max_steps") from None
    if packed(cfg):
        return len(first_fit(row_lengths(examples), cfg.data.max_length, cfg.train.seed))
    return len(examples)


def check_count(cfg: Config, examples: int) -> None:
    """On the ranks: the examples loaded make the steps the launcher counted (else its tokenizer read the data
    otherwise than the run's: one line, before a step runs)."""
    t = cfg.train
    if t.epochs is None or t.max_steps is None:
        return
    if epoch_steps(t.epochs, examples, t.global_batch_size) != t.max_steps:
        raise ConfigError(f"train.epochs={t.epochs:g}: the run loaded {examples:,} training examples, which make "
                          f"{epoch_steps(t.epochs, examples, t.global_batch_size)} steps, but the launcher counted "
                          f"{t.max_steps}: run python -m finetune.prepare with this config first (the launcher then reads the "
                          "token cache's count), or set train.max_steps")


def check_warmup(cfg: Config) -> None:
    """optim.warmup_steps below the steps (known at compose with train.max_steps; with train.epochs once the launcher has
    counted them: `resolve` calls it again)."""
    steps, how = cfg.train.max_steps, f"train.max_steps={cfg.train.max_steps}"
    if steps is not None and cfg.train.epochs is not None:
        how = f"the {steps} steps of train.epochs={cfg.train.epochs:g}"
    if steps is not None and cfg.optim.warmup_steps >= steps and cfg.optim.warmup_steps > 0:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps} must be below {how}")
