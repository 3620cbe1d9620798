"""The token cache (finetune/data/cache.py): the same examples as tokenizing in memory, a key that changes
with every input that changes the tokens, refusals that name the row, and `python -m finetune.prepare`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import run_cli, write_jsonl
from transformers import AutoTokenizer

from finetune.config import ASSETS, ConfigError, DataConfig, LongPrompt, Reasoning, Template
from finetune.data import cache
from finetune.data.pack import pack
from finetune.data.examples import load_split


MIXED = [  # every SFT form, a multi-turn chat, a response cut at max_length, a prompt too long, a text row split
    {"instruction": "reverse", "input": "abc", "output": "cba"},
    {"messages": [{"role": "user", "content": "upper\nab"}, {"role": "assistant", "content": "AB"},
                  {"role": "user", "content": "lower\nCD"}, {"role": "assistant", "content": "cd"}]},
    {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    {"prompt": "copy xyz", "completion": "xyz"},
    {"question": "2+2", "answer": "4"},
    {"instruction": "r", "output": "abcdefghijklmnopqrstuvwxyz" * 2},
    {"instruction": "r" * 80, "output": "x"},
    {"text": "plain text for continued pre-training " * 6},
]


def in_memory_and_cached(cfg: DataConfig, tok, method="sft", seed=0):
    memory = load_split(cfg, tok, seed, method)
    cached = cache.load(cfg, tok, seed, method, builder=True, progress=False, say=lambda line: None)
    return memory, cached


def same(a, b):
    assert len(a) == len(b)
    for i in range(len(a)):
        assert a[i] == b[i], i


@pytest.mark.parametrize("template", [Template.auto, Template.builtin])
@pytest.mark.parametrize("packing", [False, True])
def test_cached_examples_equal_in_memory_ones_for_every_form(tok, tmp_path, template, packing):
    """Labels, positions, prompt lengths, references and the counts: exactly those of finetune.data.examples.tokenize
    (the cache runs its `tokenize_row` in `datasets.map` workers), packed rows those of finetune.data.pack.pack."""
    rows = MIXED * 300  # 2,400 rows: two tokenizing processes
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", rows), eval_size=40, template=template, max_length=48,
                     packing=packing, cache_dir=str(tmp_path / "cache"), num_proc=2)
    (train, evals, stats), (ctrain, cevals, cstats, samples, target) = in_memory_and_cached(cfg, tok, seed=5)
    assert samples == len(train)
    if packing:
        train = pack(train, cfg.max_length, 5)
    same(train, ctrain)
    same(evals, cevals)
    assert {k: vars(s) for k, s in stats.items()} == {k: vars(s) for k, s in cstats.items()}
    assert stats["train"].dropped > 0 and stats["train"].truncated > 0 and stats["train"].split > 0
    meta = json.loads((target / "meta.json").read_text())
    assert meta["rows"] == {"train": len(ctrain), "eval": len(cevals)}
    from finetune.data.lengths import row_labelled, row_lengths

    assert row_lengths(ctrain) == row_lengths(train) and row_labelled(ctrain) == row_labelled(train)  # from the columns


@pytest.mark.parametrize("shipped,method", [("quickstart", "sft"), ("quickstart_dpo", "dpo")])
def test_shipped_datasets_cache_to_the_same_examples(tok, tmp_path, shipped, method):
    folder = ASSETS / "data" / shipped
    cfg = DataConfig(train=str(folder / "train.jsonl"), eval=str(folder / "eval.jsonl"), max_length=64, cache_dir=str(tmp_path))
    (train, evals, stats), (ctrain, cevals, cstats, _, _) = in_memory_and_cached(cfg, tok, method)
    same(train, ctrain)
    same(evals, cevals)
    assert isinstance(ctrain, list) == (method == "dpo")  # DPO pairs are materialized (they carry reference log-probs)


def test_tool_rows_cache_to_the_same_examples_and_counts(tmp_path):
    """Tool calls through Qwen2.5's template with reasoning masked: the cache's labels and reasoning counts are the
    in-memory path's."""
    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "qwen2_5")
    folder = ASSETS / "data" / "quickstart_tools"
    cfg = DataConfig(train=str(folder / "eval.jsonl"), max_length=1536, reasoning=Reasoning.mask, cache_dir=str(tmp_path))
    (train, _, stats), (ctrain, _, cstats, _, _) = in_memory_and_cached(cfg, tok)
    same(train, ctrain)
    assert vars(stats["train"]) == vars(cstats["train"]) and stats["train"].reasoning == 16


def test_a_second_load_reads_the_cache(tok, tmp_path):
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", MIXED[:5]), cache_dir=str(tmp_path / "c"))
    said: list[str] = []
    first = cache.load(cfg, tok, 0, "sft", builder=True, progress=False, say=said.append)
    again = cache.load(cfg, tok, 0, "sft", builder=True, progress=False, say=said.append)
    assert said[0].startswith("data: tokenized 5 train rows in ") and said[0].endswith(f"cached at {first[4]}")
    assert said[1] == f"data: cached tokens {first[4]} (train 5 rows, {first[0].tokens()} tokens)"
    same(first[0], again[0])
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [first[4].name]  # no temporary directory left


def test_a_builder_that_loses_the_race_keeps_the_winners_entry(tok, tmp_path):
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", MIXED[:5]), cache_dir=str(tmp_path / "c"))
    *_, target = cache.load(cfg, tok, 0, "sft", builder=True, progress=False, say=lambda line: None)
    inputs = cache.key_inputs(cfg, tok, "sft", 0)
    said: list[str] = []
    cache.build(cfg, tok, "sft", 0, target, inputs, num_proc=1, progress=False, say=said.append)  # same key again
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [target.name] and len(said) == 1


def test_the_key_changes_with_every_input_that_changes_the_tokens(tok, tmp_path):
    base = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", MIXED[:4]))
    key = lambda cfg=base, tokenizer=tok, method="sft", seed=0: cache.key_of(cache.key_inputs(cfg, tokenizer, method, seed))  # noqa: E731
    other_template = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    other_template.chat_template = other_template.chat_template.replace("<|assistant|>", "<|bot|>")
    changed = {
        "file content": key(replace(base, train=write_jsonl(tmp_path / "u.jsonl", MIXED[:3]))),
        "tokenizer's chat template": key(tokenizer=other_template),
        "template": key(replace(base, template=Template.builtin)),
        "system prompt": key(replace(base, system_prompt="be brief")),
        "max_length": key(replace(base, max_length=256)),
        "long_prompt": key(replace(base, long_prompt=LongPrompt.error)),
        "packing": key(replace(base, packing=True)),
        "held-out eval rows": key(replace(base, eval_size=1)),
        "method": key(method="dpo"),
        "seed, when rows are held out": key(replace(base, eval_size=1), seed=1),
    }
    assert len(set(changed.values()) | {key()}) == len(changed) + 1, changed
    assert key(seed=1) == key()  # the seed changes nothing without held-out rows or packing
    assert key(replace(base, cache_dir="/elsewhere", num_proc=7)) == key()  # where and how fast: not what
    before = key()
    write_jsonl(tmp_path / "t.jsonl", MIXED[:4][::-1])  # the same path, the rows in another order
    assert key() != before


def test_a_bad_row_in_a_worker_is_one_line_naming_its_line(tok, tmp_path):
    rows = [{"instruction": "r", "output": "ab"}] * 2500 + [{"instruction": "r" * 80, "output": "x"}]
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", rows), max_length=16, long_prompt=LongPrompt.error,
                     cache_dir=str(tmp_path / "c"), num_proc=2)
    with pytest.raises(ConfigError) as e:
        cache.load(cfg, tok, 0, "sft", builder=True, progress=False, say=lambda line: None)
    assert str(e.value) == (f"{cfg.train}:2501: the prompt is 83 tokens, data.max_length=16 leaves no room for the response: "
                            "raise data.max_length or set data.long_prompt=drop")
    assert not any((tmp_path / "c").glob("*/meta.json"))


def test_an_unwritable_cache_dir_is_one_line(tok, tmp_path):
    (tmp_path / "file").write_text("")
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", MIXED[:2]), cache_dir=str(tmp_path / "file" / "cache"))
    with pytest.raises(ConfigError) as e:
        cache.load(cfg, tok, 0, "sft", builder=True, progress=False, say=lambda line: None)
    assert str(e.value) == (f"data.cache_dir: cannot write the token cache in {tmp_path / 'file' / 'cache'} (Not a directory): "
                            "point data.cache_dir at a writable directory, or set data.cache=false to tokenize in memory")


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("FINETUNE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.root(DataConfig(train="x")) == tmp_path / "finetune" / "tokens"
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.root(DataConfig(train="x")) == tmp_path / "mine"
    assert cache.root(DataConfig(train="x", cache_dir="~/c")) == cache.Path("~/c").expanduser()


def test_prepare_then_launch_starts_from_the_cache(tmp_path):
    """`python -m finetune.prepare` tokenizes; the launch of the same recipe reads the cache, and trains."""
    env_dir = tmp_path / "tokens"
    overrides = ["+recipe=quickstart_sft", "train.max_steps=1", "optim.warmup_steps=0", "launcher.nproc_per_node=1",
                 "parallelism=single", "train.progress_bar=false", "train.exact_match_samples=0", f"data.cache_dir={env_dir}"]
    prep = run_cli(*overrides, cwd=tmp_path, module="finetune.prepare")
    assert prep.returncode == 0, prep.stderr
    entry = next(env_dir.iterdir())
    assert prep.stdout.splitlines()[-1] == f"prepared: {entry} (train 4,000 rows, 87,395 tokens, eval 256 rows, 5,557 tokens)"
    run = run_cli(*overrides, f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"data: cached tokens {entry} (train 4,000 rows, 87,395 tokens, eval 256 rows, 5,557 tokens)" in run.stdout
    assert "data: tokenized" not in run.stdout
    no_cache = run_cli(*overrides, "data.cache=false", cwd=tmp_path, module="finetune.prepare")
    assert no_cache.returncode == 2 and no_cache.stderr.strip() == (
        "error: data.cache=false: the run tokenizes in memory at every launch, so there is nothing to prepare "
        "(drop data.cache=false to cache the tokens)")


# ---------------------------------------------------------------------------------------------
# Mixtures: data.train as a list of sources


def numbered(tmp_path, name, n):
    return write_jsonl(tmp_path / f"{name}.jsonl", [{"instruction": f"{name} {i}", "output": f"{name}{i}"} for i in range(n)])


def test_mixture_proportions_and_exact_counts(tmp_path):
    from finetune.data.sources import load_sources, mixture_counts, sources

    a, b, c = numbered(tmp_path, "a", 100), numbered(tmp_path, "b", 1000), numbered(tmp_path, "c", 4000)
    spec = [{"path": a, "rows": 250}, {"path": b, "weight": 0.25}, {"path": c, "weight": 0.75}, c]
    assert mixture_counts(sources(spec, "train", "data.train"), [100, 1000, 4000, 4000]) == [250, 1000, 3000, 4000]
    rows = load_sources(spec, "train", "data.train", seed=3)
    drawn = [r["instruction"].split()[0] for r in rows.rows]
    assert [drawn.count(x) for x in "abc"] == [250, 1000, 7000]
    from_a = [int(r["instruction"].split()[1]) for r in rows.rows if r["instruction"].startswith("a ")]
    assert all(from_a.count(i) in (2, 3) for i in range(100))  # 250 of 100 rows: every row twice, 50 of them thrice
    from_c = {r["instruction"] for r in rows.rows[1250:4250]}
    assert len(from_c) == 3000  # the weighted draw repeats no row
    again, other = load_sources(spec, "train", "data.train", seed=3), load_sources(spec, "train", "data.train", seed=4)
    assert again.rows == rows.rows and other.rows != rows.rows  # a function of the seed
    assert rows.where(0) == f"{a}:1" and rows.where(1250) == f"{c}:{int(rows.rows[1250]['instruction'].split()[1]) + 1}"
    assert rows.note == (f"data.train: 8,250 rows from 4 sources ({a} 250 of 100, rows=250; {b} 1,000 of 1,000, weight 0.25; "
                         f"{c} 3,000 of 4,000, weight 0.75; {c} 4,000 of 4,000)")


def test_a_bad_row_in_a_mixture_names_its_own_file_and_line(tok, tmp_path):
    a = numbered(tmp_path, "a", 5)
    b = write_jsonl(tmp_path / "b.jsonl", [{"instruction": "x", "output": "y"}, {"instruction": "r" * 80, "output": "x"}])
    cfg = DataConfig(train=[a, {"path": b, "rows": 2}], max_length=16, long_prompt=LongPrompt.error, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=f"^{b}:2: the prompt is 83 tokens"):
        cache.load(cfg, tok, 0, "sft", builder=True, progress=False, say=lambda line: None)
    with pytest.raises(ConfigError, match=f"^{b}:2: the prompt is 83 tokens"):
        load_split(cfg, tok, 0)


def test_a_mixture_caches_like_it_tokenizes_and_its_key_follows_the_draw(tok, tmp_path):
    a, b = numbered(tmp_path, "a", 30), numbered(tmp_path, "b", 60)
    cfg = DataConfig(train=[{"path": a, "weight": 1}, {"path": b, "weight": 1}], eval_size=5, cache_dir=str(tmp_path / "c"))
    (train, evals, stats), (ctrain, cevals, cstats, _, _) = in_memory_and_cached(cfg, tok, seed=2)
    same(train, ctrain)
    same(evals, cevals)
    assert cstats["train"].line("train", 512).endswith(f"\ndata.train: 60 rows from 2 sources ({a} 30 of 30, weight 1; {b} 30 of 60, weight 1)")
    key = lambda c, seed=2: cache.key_of(cache.key_inputs(c, tok, "sft", seed))  # noqa: E731
    assert key(cfg, seed=3) != key(cfg)  # the draw depends on the seed
    assert key(replace(cfg, train=[{"path": a, "weight": 1}, {"path": b, "weight": 2}])) != key(cfg)
    assert key(replace(cfg, eval_size=0, train=[a, b]), seed=3) == key(replace(cfg, eval_size=0, train=[a, b]))  # all rows: no draw


@pytest.mark.parametrize("value,message", [
    ("[a.jsonl,{path:b.jsonl,wieght:0.5}]", "data.train[1]: unknown key 'wieght': a source has path, and optionally name, split, revision, "
                                                   "columns, weight, rows"),
    ("[{path:a.jsonl,weight:0.5,rows:3}]", "data.train[0]: set weight (its share of the mixture) or rows (an exact count), not both"),
    ("[{path:a.jsonl,weight:0}]", "data.train[0].weight=0 must be a number above 0"),
    ("[{path:a.jsonl,rows:1.5}]", "data.train[0].rows=1.5 must be an integer of at least 1"),
    ("[{weight:1}]", "data.train[0].path must be a path or hub id (got None)"),
    ("[]", "data.train=[] must be a path or hub id, a source {path, name, split, revision, columns}, or a list of sources"),
])
def test_malformed_mixtures_are_one_line_at_compose(compose, value, message):
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", f"data.train={value}"])
    assert str(e.value) == message
