"""Hub datasets as people name them (finetune/data/sources.py): data.train={path, name, split, revision, columns},
through `datasets.load_dataset(path, name=, split=, revision=)`, tried on local directories laid out as the hub lays
them out (data/SPLIT-*.parquet files; subsets declared by a README.md's `configs:` front matter). The plain string
form keeps working; the refusals name the subsets, splits or columns there are; the token cache, the launcher's
check of local rows and a stream all read the new fields."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import write_jsonl

from finetune.config import ConfigError, DataConfig, load, to_yaml
from finetune.data import cache
from finetune.rank import stream
from finetune.data.examples import check, load_split
from finetune.data.sources import sources
from finetune.rank.stream import Position
from finetune.data.tokenize import Stats


def chat(i):
    return [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]


README = """---
configs:
- config_name: chat
  data_files:
  - split: train_sft
    path: chat/train_sft-*.jsonl
  - split: test_sft
    path: chat/test_sft-*.jsonl
- config_name: alpaca
  data_files:
  - split: train
    path: alpaca/train-*.jsonl
---
# a dataset laid out as on the hub, with two subsets
"""


@pytest.fixture
def hub(tmp_path):
    """A dataset directory with two subsets (README.md `configs:`): chat (its conversations under `conversation`,
    splits train_sft and test_sft) and alpaca (split train)."""
    root = tmp_path / "org_name"
    (root / "chat").mkdir(parents=True)
    (root / "alpaca").mkdir()
    write_jsonl(root / "chat" / "train_sft-00000-of-00001.jsonl", [{"conversation": chat(i), "id": i} for i in range(6)])
    write_jsonl(root / "chat" / "test_sft-00000-of-00001.jsonl", [{"conversation": chat(i), "id": i} for i in range(6, 8)])
    write_jsonl(root / "alpaca" / "train-00000-of-00001.jsonl", [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(4)])
    (root / "README.md").write_text(README)
    return str(root)


def plain(tmp_path, name, rows):
    return DataConfig(train=write_jsonl(tmp_path / name, rows))


def test_a_subset_split_and_column_map_read_like_a_plain_file(tok, tmp_path, hub):
    """{path, name, split, columns} (and the same for eval): the examples of a .jsonl file holding the renamed rows."""
    cfg = DataConfig(train={"path": hub, "name": "chat", "split": "train_sft", "columns": {"messages": "conversation"}},
                     eval={"path": hub, "name": "chat", "split": "test_sft", "columns": {"messages": "conversation"}})
    train, evals, _ = load_split(cfg, tok, 0)
    expected = plain(tmp_path, "t.jsonl", [{"messages": chat(i), "id": i} for i in range(6)])
    expected = replace(expected, eval=write_jsonl(tmp_path / "e.jsonl", [{"messages": chat(i)} for i in range(6, 8)]))
    assert (train, evals) == load_split(expected, tok, 0)[:2]
    alpaca, _, _ = load_split(DataConfig(train={"path": hub, "name": "alpaca"}), tok, 0)  # split: data.train_split
    assert alpaca == load_split(plain(tmp_path, "a.jsonl", [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(4)]), tok, 0)[0]


def test_a_mixture_of_subsets(hub):
    from finetune.data.sources import load_sources

    mixed = load_sources([{"path": hub, "name": "chat", "split": "train_sft", "columns": {"messages": "conversation"}, "rows": 3},
                          {"path": hub, "name": "alpaca"}], "train", "data.train", seed=1)
    assert [sorted(r) for r in mixed.rows] == [["id", "messages"]] * 3 + [["instruction", "output"]] * 4
    assert mixed.note == f"data.train: 7 rows from 2 sources ({hub} subset chat 3 of 6, rows=3; {hub} subset alpaca 4 of 4)"


def test_the_plain_string_form_and_a_parquet_hub_layout(tok, tmp_path):
    """A directory of data/SPLIT-*.parquet files (no subsets): the string form reads its `train` split; a dict picks another."""
    import datasets

    root = tmp_path / "parquet_set"
    (root / "data").mkdir(parents=True)
    datasets.Dataset.from_list([{"messages": chat(i)} for i in range(5)]).to_parquet(str(root / "data" / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list([{"messages": chat(i)} for i in range(5, 7)]).to_parquet(str(root / "data" / "test-00000-of-00001.parquet"))
    reference = load_split(plain(tmp_path, "t.jsonl", [{"messages": chat(i)} for i in range(5)]), tok, 0)[0]
    assert load_split(DataConfig(train=str(root)), tok, 0)[0] == reference
    assert load_split(DataConfig(train={"path": str(root)}), tok, 0)[0] == reference
    test = load_split(DataConfig(train={"path": str(root), "split": "test"}), tok, 0)[0]
    assert test == load_split(plain(tmp_path, "e.jsonl", [{"messages": chat(i)} for i in range(5, 7)]), tok, 0)[0]


@pytest.mark.parametrize("spec,message", [
    ({"name": "nope"}, "data.train: the local dataset directory {hub} has no subset name=nope: its subsets are chat, alpaca; "
                       "set name to one of them"),
    ({}, "data.train: the local dataset directory {hub} has several subsets and no default: name one, e.g. "
         "data.train={{path: {hub}, name: SUBSET}} (its subsets: chat, alpaca)"),
    ({"name": "chat", "revision": "v1"}, "data.train.revision: {hub} is a local directory, which has no revisions (a hub "
                                         "dataset's branch, tag or commit): remove revision"),
    ({"name": "chat", "split": "validation"}, "data.train: the local dataset directory {hub} (subset chat) has no split "
                                              "'validation': its splits are train_sft, test_sft"),
    ({"name": "chat", "split": "train_sft", "columns": {"messages": "conversations"}},
     "data.train.columns.messages=conversations: {hub} row 0 has no column 'conversations' (its columns: conversation, id)"),
])
def test_an_unknown_subset_split_or_column_is_one_line_listing_what_there_is(hub, spec, message):
    with pytest.raises(ConfigError) as e:
        sources({"path": hub, **spec}, "train", "data.train")[0].load()
    assert str(e.value) == message.format(hub=hub)


@pytest.mark.parametrize("value,message", [
    ("{path:org/name,columns:{msgs:conversation}}", "data.train.columns.msgs: no row form reads a key 'msgs': map the dataset's "
     "columns onto messages, conversations, instruction, input, output, prompt, completion, question, answer, text, chosen, "
     "rejected, label"),
    ("{path:org/name,columns:{messages:a,text:a}}", "data.train.columns maps one column onto two keys ({'messages': 'a', 'text': "
     "'a'}): map each column once"),
    ("{path:a.jsonl,name:chat}", "data.train.name: a.jsonl is a data file, which has no subsets or revisions: remove name, or "
     "point path at a dataset directory or hub id"),
    ("{path:org/name,subset:chat}", "data.train: unknown key 'subset': a source has path, and optionally name, split, revision, "
     "columns, weight, rows"),
    ("[{path:org/a,weight:1},{path:org/b,columns:[messages]}]", "data.train[1].columns must map the keys rows are read by to the "
     "dataset's columns, e.g. {messages: conversation} (got ['messages'])"),
])
def test_malformed_hub_sources_are_one_line_at_compose(compose, value, message):
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", f"data.train={value}"])
    assert str(e.value) == message


def test_the_hub_form_composes_from_the_command_line(compose, tmp_path):
    cfg = compose(["+recipe=quickstart_sft", "data.train={path:ORG/NAME,name:SUBSET,split:train_sft,revision:v1,"
                   "columns:{messages:conversation}}"])
    (s,) = sources(cfg.data.train, cfg.data.train_split, "data.train")
    assert (s.path, s.name, s.split, s.revision, s.columns) == ("ORG/NAME", "SUBSET", "train_sft", "v1", (("messages", "conversation"),))
    written = tmp_path / "config.yaml"  # as the launcher writes it and the ranks read it back
    written.write_text(to_yaml(cfg))
    assert sources(load(written).data.train, "train", "data.train") == [s]


def test_the_token_cache_keys_on_subset_split_revision_and_column_map(tok, tmp_path, hub, monkeypatch):
    base = DataConfig(train={"path": hub, "name": "chat", "split": "train_sft", "columns": {"messages": "conversation"}},
                      cache_dir=str(tmp_path / "cache"))
    key = lambda train: cache.key_of(cache.key_inputs(replace(base, train=train), tok, "sft", 0))  # noqa: E731
    keys = {key(base.train), key({**base.train, "split": "test_sft"}), key({"path": hub, "name": "alpaca"}),
            key({**base.train, "columns": {"messages": "conversation", "text": "id"}})}
    assert len(keys) == 4
    assert key(dict(base.train)) == key(base.train)
    train, _, _, _, entry = cache.load(base, tok, 0, "sft", builder=True, progress=False, say=lambda line: None)
    assert list(train) == load_split(base, tok, 0)[0]
    assert json.loads((entry / "meta.json").read_text())["inputs"]["sources"]["data.train"]["columns"] == {"messages": "conversation"}
    asked = []  # a hub dataset (not downloaded here): its `datasets` fingerprint is read at the subset, split and revision
    monkeypatch.setattr(cache, "_hub_fingerprint", lambda *args: asked.append(args) or "same content")
    hub_keys = {key({"path": "org/name", "name": "chat", "revision": revision}) for revision in ("v1", "v2", None)}
    assert len(hub_keys) == 3 and asked == [("org/name", "train", "chat", r) for r in ("v1", "v2", None)]


def test_a_hub_id_is_loaded_with_its_subset_split_and_revision(monkeypatch):
    """The hub path itself (no network here): `datasets.load_dataset(path, name=, split=, revision=)`, then the column map."""
    import datasets

    calls = []

    def load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_list([{"conversation": chat(0), "id": 0}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    (s,) = sources({"path": "ORG/NAME", "name": "SUBSET", "split": "train_sft", "revision": "abc123",
                    "columns": {"messages": "conversation"}}, "train", "data.train")
    assert s.load().rows == [{"id": 0, "messages": chat(0)}]
    assert calls == [("ORG/NAME", {"name": "SUBSET", "split": "train_sft", "revision": "abc123", "streaming": False})]


def test_the_launchers_check_of_local_rows_reads_the_column_map(tmp_path):
    """A local .jsonl file's rows are checked renamed (the column map applies to files too), before any rank starts."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"conversation": chat(i)} for i in range(2)])
    check(DataConfig(train={"path": path, "columns": {"messages": "conversation"}}), "sft")
    with pytest.raises(ConfigError) as e:
        check(DataConfig(train=path), "sft")
    assert str(e.value).startswith(f"{path}:1: a row of no known form (keys present: conversation)")


def test_a_stream_reads_the_subset_split_and_column_map(tok, hub):
    """data.streaming=true: the same examples, in the source's order with a buffer of one, as in memory."""
    cfg = DataConfig(train={"path": hub, "name": "chat", "split": "train_sft", "columns": {"messages": "conversation"}},
                     streaming=True, shuffle_buffer=1)
    memory = load_split(replace(cfg, streaming=False, shuffle_buffer=None), tok, 0)[0]
    examples = stream.Streamed(cfg, tok, "sft", 0).examples(Position(), Stats())
    assert [next(examples)[-1] for _ in range(6)] == memory
