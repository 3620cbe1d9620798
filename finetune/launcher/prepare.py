"""Tokenize a recipe's data into the token cache, and nothing else: on a login node or a CPU-only machine,
before the GPUs are needed.

    python -m finetune.prepare +recipe=quickstart_sft [group=option ...] [data.num_proc=N]

Composes exactly as `finetune.launch` does (the same overrides, the same checks), loads the tokenizer,
and builds the cache entry the run will read (finetune/data/cache.py): a launch of the same recipe
then prints `data: cached tokens PATH` and starts training without tokenizing. Uses every core of
this machine unless data.num_proc says otherwise. Exit code 0: prepared (or already there); 2: a
config or data mistake (one line).
"""

from __future__ import annotations

import sys

from finetune.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    from finetune.launcher.compose import preflight

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        cfg = preflight(args)
        if cfg.data.streaming:
            raise ConfigError("data.streaming=true: the stream is tokenized on the fly while the run trains, so there is nothing "
                              "to prepare (drop data.streaming=true to cache the tokens)")
        if not cfg.data.cache:
            raise ConfigError("data.cache=false: the run tokenizes in memory at every launch, so there is nothing to prepare "
                              "(drop data.cache=false to cache the tokens)")
        from finetune.data import cache
        from finetune.data.templates import load_tokenizer

        tokenizer = load_tokenizer(cfg.model, cfg.data)
        train, evals, stats, samples, target = cache.load(cfg.data, tokenizer, cfg.train.seed, cfg.method.name, builder=True,
                                                          progress=True, say=print)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, s in stats.items():
        print(s.line(name, cfg.data.max_length))
    if cfg.data.packing:
        print(f"packing: {samples} samples -> {len(train)} rows of up to {cfg.data.max_length} tokens")
    print(f"prepared: {target} ({cache.describe(train, evals)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
