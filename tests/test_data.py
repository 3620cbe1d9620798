"""Data: templates, response-only labels, truncation accounting, sources, and batch order."""

from __future__ import annotations

import re

import pytest
from conftest import write_jsonl
from transformers import AutoTokenizer

from finetune.config import ASSETS, ConfigError, DataConfig, DataFormat, LongPrompt, Template
from finetune.data.batches import TrainBatches, collate, for_generation, shard
from finetune.data.forms import to_messages
from finetune.data.pack import first_fit
from finetune.data.sources import load_rows
from finetune.data.examples import load_split, tokenize
from finetune.data.tokenize import IGNORE, Example, encode, segments, uses_chat_template


def labelled(tok, ex) -> str:
    return tok.decode([t for t, label in zip(ex.input_ids, ex.labels) if label != IGNORE])


def test_alpaca_row_becomes_user_and_assistant():
    row = {"instruction": "reverse", "input": "abc", "output": "cba"}
    assert to_messages(row, DataFormat.auto, None, "f:1") == [
        {"role": "user", "content": "reverse\nabc"},
        {"role": "assistant", "content": "cba"},
    ]
    assert to_messages({"instruction": "hi", "output": "yo"}, DataFormat.alpaca, "be brief", "f:1")[0] == {"role": "system", "content": "be brief"}


PAIR = [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"}]


@pytest.mark.parametrize("row", [
    {"conversations": [{"from": "human", "value": "reverse abc"}, {"from": "gpt", "value": "cba"}]},
    {"prompt": "reverse abc", "completion": "cba"},
    {"question": "reverse abc", "answer": "cba"},
    {"messages": [{"role": "user", "content": "reverse abc", "name": "u1"}, {"role": "assistant", "content": "cba", "weight": 1}]},
    {"instruction": "reverse abc", "output": "cba"},
])
def test_every_common_row_form_is_the_same_conversation(row):
    """ShareGPT, prompt/completion, question/answer, OpenAI messages with extra keys and alpaca: one conversation."""
    assert to_messages(row, DataFormat.auto, None, "f:1") == PAIR


def test_sharegpt_system_turn_and_named_format():
    row = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "reverse abc"},
                             {"from": "gpt", "value": "cba"}]}
    assert to_messages(row, DataFormat.sharegpt, None, "f:1") == [{"role": "system", "content": "be brief"}, *PAIR]


@pytest.mark.parametrize("row,fmt,message", [
    ({"q": "a", "a": "b"}, DataFormat.auto, "f:1: a row of no known form (keys present: a, q); the forms are alpaca (instruction, "
                                            "output), chat (messages), sharegpt (conversations), completion (prompt and completion, "
                                            "or question and answer), text (text): rename its keys, or fix the row"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, DataFormat.auto, "f:1: conversations[0] must be {from: human|user|gpt|"),
    ({"prompt": "a"}, DataFormat.completion, "f:1: completion rows need string 'prompt' and 'completion' (missing or not text: completion"),
    ({"question": "", "answer": "b"}, DataFormat.auto, "f:1: the prompt 'question' is empty"),
])
def test_row_form_mistakes_are_one_line(row, fmt, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        to_messages(row, fmt, None, "f:1")


def test_text_rows_train_on_every_token_in_max_length_pieces(tok):
    """Continued pre-training: BOS + text + EOS, every token a label, cut into consecutive max_length pieces (none
    lost; a last piece of one token predicts nothing and is dropped); no prompt, so exact match skips them."""
    from finetune.data.sources import Rows

    rows = Rows([{"text": "abcdefghij"}, {"text": "xyz"}], "f")
    out, stats = tokenize(rows, tok, DataConfig(train="f", max_length=5), "data.train")
    ids = tok("abcdefghij", add_special_tokens=False)["input_ids"]
    whole = [tok.bos_token_id, *ids, tok.eos_token_id]  # 12 tokens -> 5 + 5 + 2
    assert [e.input_ids for e in out[:3]] == [whole[:5], whole[5:10], whole[10:]]
    assert all(e.labels == e.input_ids and e.prompt_len == 0 for e in out[:4])
    assert out[3].input_ids == [tok.bos_token_id, *tok("xyz", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert stats.split == 1 and "1 text rows split into max_length pieces" in stats.line("train", 5)
    chat = encode(PAIR, tok, chat_template=True)
    assert len(out) == 4 and for_generation([*out, chat]) == [chat]  # only a conversation has a prompt to continue
    with pytest.raises(ConfigError, match="^f row 0: text rows need a non-empty string 'text'"):
        tokenize(Rows([{"text": " "}], "f"), tok, DataConfig(train="f", format=DataFormat.text), "data.train")


def test_builtin_template_segments_and_labels(tok):
    messages = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "xy"}]
    assert segments(messages, tok, chat_template=False) == [
        ("<s>", False), ("### User:\nabc\n\n", False), ("### Assistant:\n", False), ("xy</s>", True),
    ]
    ex = encode(messages, tok, chat_template=False)
    assert len(ex.input_ids) == 1 + len("### User:\nabc\n\n") + len("### Assistant:\n") + 3  # one token per character
    assert ex.labels[: ex.prompt_len] == [IGNORE] * ex.prompt_len
    assert ex.labels[ex.prompt_len :] == ex.input_ids[ex.prompt_len :] == tok.convert_tokens_to_ids(["x", "y", "</s>"])
    assert ex.reference == "xy"


def test_chat_template_labels_only_the_responses(tok):
    messages = [
        {"role": "user", "content": "reverse\nabc"}, {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "uppercase\nab"}, {"role": "assistant", "content": "AB"},
    ]
    ex = encode(messages, tok, chat_template=True)
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(messages, tokenize=False)
    assert labelled(tok, ex) == "cba</s>AB</s>"
    assert tok.decode(ex.input_ids[: ex.prompt_len]).endswith("<|user|>uppercase\nab\n<|assistant|>")
    assert ex.reference == "AB"


def test_unalignable_chat_template_is_refused(tok):
    """A template whose rendering of the response cannot be found in the whole conversation (here: in reverse order) is
    refused; templates that are only not prefix-stable are aligned (tests/test_templates.py)."""
    weird = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    weird.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError, match="renders assistant message 1 differently inside the whole conversation than at its end"):
        encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], weird, chat_template=True)


def test_template_choice(tok):
    assert uses_chat_template(tok, Template.auto) and not uses_chat_template(tok, Template.builtin)
    bare = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    bare.chat_template = None
    assert not uses_chat_template(bare, Template.auto)
    with pytest.raises(ConfigError, match="the tokenizer has no chat template: use data.template=builtin or auto"):
        uses_chat_template(bare, Template.tokenizer)


def test_truncation_and_drops_are_counted(tok, tmp_path):
    rows = [
        {"instruction": "r", "output": "abcdefghij"},  # prompt 4 tokens (<|user|> r \n <|assistant|>) + 11: cut at 10
        {"instruction": "r" * 30, "output": "x"},  # prompt 33 tokens: no room, dropped
        {"instruction": "r", "output": "ab"},  # 4 + 3 tokens: fits
    ]
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", rows), max_length=10)
    examples, stats = tokenize(load_rows(cfg.train, "train", "data.train"), tok, cfg, "data.train")
    assert (stats.rows, stats.truncated, stats.dropped) == (3, 1, 1)
    assert [len(e.input_ids) for e in examples] == [10, 7]
    assert labelled(tok, examples[0]) == "abcdef" and labelled(tok, examples[1]) == "ab</s>"
    cfg.long_prompt = LongPrompt.error
    with pytest.raises(ConfigError) as e:
        tokenize(load_rows(cfg.train, "train", "data.train"), tok, cfg, "data.train")
    assert str(e.value) == f"{cfg.train}:2: the prompt is 33 tokens, data.max_length=10 leaves no room for the response: raise data.max_length or set data.long_prompt=drop"


def test_eval_held_out_from_train(tok, tmp_path):
    rows = [{"instruction": "r", "output": f"{i}"} for i in range(20)]
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", rows), eval_size=5)
    train, evals, stats = load_split(cfg, tok, seed=3)
    assert (len(train), len(evals)) == (15, 5)
    assert {e.reference for e in train}.isdisjoint({e.reference for e in evals})
    again = load_split(cfg, tok, seed=3)[1]
    assert [e.reference for e in again] == [e.reference for e in evals]


def test_local_dataset_directory_goes_through_datasets(tok, tmp_path):
    """The hub-id code path (`datasets.load_dataset`) on a local directory of data files, chat format."""
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(6)]
    write_jsonl(folder / "train.jsonl", rows)
    loaded = load_rows(str(folder), "train", "data.train")
    assert len(loaded.rows) == 6 and loaded.where(2) == f"{folder} row 2"
    cfg = DataConfig(train=str(folder), format=DataFormat.chat)
    train, evals, _ = load_split(cfg, tok, seed=0)
    assert [labelled(tok, e) for e in train] == [f"a{i}</s>" for i in range(6)] and evals == []


def test_collate_masks_padding(tok):
    a = Example([5, 6, 7], [IGNORE, 6, 7], 1, "")
    b = Example([5, 6], [IGNORE, 6], 1, "")
    batch = collate([a, b], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 6, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [IGNORE, 6, IGNORE]]


def test_batch_order_is_the_same_on_any_number_of_ranks():
    examples = [Example([i], [i], 0, "") for i in range(10)]
    one = TrainBatches(examples, global_batch=4, micro_batch=2, dp_rank=0, dp_size=1, seed=7, pad_id=0)
    two = [TrainBatches(examples, global_batch=4, micro_batch=2, dp_rank=r, dp_size=2, seed=7, pad_id=0) for r in range(2)]
    for step in range(6):  # crosses two epoch boundaries
        assert one.indices(step) == two[0].indices(step) + two[1].indices(step)
    stream = [i for step in range(5) for i in one.indices(step)]  # 20 samples = 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]  # each epoch reshuffles
    assert len(one.micro_batches(0)) == 2 and one.micro_batches(0)[0]["input_ids"].shape == (2, 1)


def test_shard_covers_everything_once():
    items = list(range(7))
    parts = [shard(items, r, 3) for r in range(3)]
    assert parts == [[0, 1, 2], [3, 4], [5, 6]]


def plain_first_fit(lengths, max_length, seed):
    """The definition: each sample, in the seeded order, into the first row with room (a scan of every row)."""
    import numpy as np

    rows, room = [], []
    for i in np.random.default_rng(seed).permutation(len(lengths)):
        slot = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            rows.append([])
            room.append(max_length)
            slot = len(rows) - 1
        rows[slot].append(int(i))
        room[slot] -= lengths[i]
    return rows


@pytest.mark.parametrize("count,low,high,max_length", [(0, 1, 2, 8), (1, 8, 9, 8), (3000, 5, 300, 512), (3000, 1, 2048, 2048),
                                                       (2000, 400, 513, 512)])
def test_packing_is_first_fit_in_n_log_n(count, low, high, max_length):
    """The max-tree packs exactly the rows the plain scan does (the scan is quadratic: 20,000 samples took 3 s,
    a million over an hour; the tree packs a million in ~5 s), each row within max_length."""
    import numpy as np

    lengths = np.random.default_rng(count).integers(low, high, count).tolist()
    rows = first_fit(lengths, max_length, seed=7)
    assert rows == plain_first_fit(lengths, max_length, seed=7)
    assert sorted(i for row in rows for i in row) == list(range(count))
    assert all(sum(lengths[i] for i in row) <= max_length for row in rows)


def test_packing_refuses_a_sample_longer_than_a_row():
    with pytest.raises(ValueError, match="a sample of 9 tokens does not fit a packed row of 8"):
        first_fit([3, 9], 8, seed=0)
