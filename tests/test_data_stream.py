"""Streaming (data.streaming=true, finetune/rank/stream.py): the order of the streamed steps, the same labels as
the in-memory path, a resume that continues exactly, the same samples on any layout, and every refusal."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from conftest import read_metrics, run_cli, train_here, write_jsonl

from finetune.config import ASSETS, ConfigError, DataConfig
from finetune.rank import stream
from finetune.data.batches import collate
from finetune.data.sources import load_rows
from finetune.rank.stream import Position, StreamBatches
from finetune.data.examples import tokenize
from finetune.data.tokenize import Stats


ROWS = [  # forms, a multi-turn chat, a response cut at max_length, a prompt too long (dropped), a text row split in pieces
    {"instruction": "reverse", "input": "abc", "output": "cba"},
    {"messages": [{"role": "user", "content": "upper\nab"}, {"role": "assistant", "content": "AB"},
                  {"role": "user", "content": "lower\nCD"}, {"role": "assistant", "content": "cd"}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    {"prompt": "copy xyz", "completion": "xyz"},
    {"instruction": "r", "output": "abcdefghijklmnopqrstuvwxyz" * 2},
    {"instruction": "r" * 80, "output": "x"},
    {"text": "plain text for continued pre-training " * 3},
]


def numbered(n):
    return [{"instruction": f"row {i}", "output": f"{i}"} for i in range(n)]


def streamed(cfg, tok, seed=0, method="sft"):
    return stream.Streamed(cfg, tok, method, seed)


def taken(examples, n):
    return [next(examples) for _ in range(n)]


def batches(train, *, global_batch=4, micro_batch=2, dp_rank=0, dp_size=1, resume_from=None):
    return StreamBatches(train, global_batch=global_batch, micro_batch=micro_batch, dp_rank=dp_rank, dp_size=dp_size, pad_id=0,
                         resume_from=resume_from)


def served(b, steps):
    """The micro-batches of `steps`, as lists (comparable with ==)."""
    out = [[{k: v.tolist() for k, v in mb.items()} for mb in b.micro_batches(step)] for step in steps]
    b.close()
    return out


def collated(examples, micro_batch=2):
    return [{k: v.tolist() for k, v in collate(examples[i : i + micro_batch], 0).items()} for i in range(0, len(examples), micro_batch)]


@pytest.mark.parametrize("shipped,method,rows", [(None, "sft", ROWS * 3), ("quickstart_dpo", "dpo", None)])
def test_a_buffer_of_one_streams_the_in_memory_examples_in_file_order_pass_after_pass(tok, tmp_path, shipped, method, rows):
    """data.shuffle_buffer=1: the source's own order, every pass alike; each example (ids, labels, prompt length,
    reference; a text row's pieces; no dropped row) is exactly what tokenize makes of the same rows."""
    path = str(ASSETS / "data" / shipped / "train.jsonl") if shipped else write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = DataConfig(train=path, max_length=48, streaming=True, shuffle_buffer=1)
    memory, stats = tokenize(load_rows(path, "train", "data.train"), tok, cfg, "data.train", method)
    counts = Stats()
    out = taken(streamed(cfg, tok, method=method).examples(Position(), counts), len(memory) + 3)
    assert [example for *_, example in out] == memory + memory[:3]
    assert [epoch for _, epoch, *_ in out] == [0] * len(memory) + [1] * 3
    assert (counts.rows, counts.truncated, counts.dropped, counts.split) == (
        stats.rows + 3, stats.truncated, stats.dropped, stats.split)  # a pass, and the next pass's first 3 rows (none cut or dropped)
    if method == "sft":
        assert (stats.truncated, stats.dropped, stats.split) == (3, 3, 3)


def test_the_steps_are_consecutive_global_batches_of_the_stream(tok, tmp_path):
    """Step k is examples [kG, (k+1)G) of the stream, in micro-batches; the DataLoader worker serves them in order."""
    path = write_jsonl(tmp_path / "t.jsonl", ROWS * 3)
    cfg = DataConfig(train=path, max_length=48, streaming=True, shuffle_buffer=1)
    memory, _ = tokenize(load_rows(path, "train", "data.train"), tok, cfg, "data.train")
    order = memory * 3
    b = batches(streamed(cfg, tok))
    assert served(b, range(12)) == [collated(order[4 * k : 4 * k + 4]) for k in range(12)]  # crosses two pass boundaries
    with pytest.raises(RuntimeError, match="^a stream is read in step order: step 0 was asked for, step 12 is next$"):
        b.micro_batches(0)


def test_the_shuffle_buffer_order_is_a_function_of_the_seed(tok, tmp_path):
    """Each pass holds every row once, none more than buffer-1 places early; each pass has its own order; the same
    seed gives the same order, another seed another."""
    n, buffer = 60, 8
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", numbered(n)), max_length=48, streaming=True, shuffle_buffer=buffer)

    def order(seed):
        return [int(example.reference) for *_, example in taken(streamed(cfg, tok, seed).examples(Position(), Stats()), 2 * n)]

    first, again, other = order(3), order(3), order(4)
    passes = first[:n], first[n:]
    assert all(sorted(p) == list(range(n)) for p in passes)
    assert all(row <= place + buffer - 1 for p in passes for place, row in enumerate(p))
    assert passes[0] != passes[1] and passes[0] != list(range(n))
    assert again == first and other != first


@pytest.mark.parametrize("packing", [False, True])
def test_a_resumed_stream_yields_exactly_what_the_uninterrupted_one_does(tok, tmp_path, packing):
    """Saved after step j (where the next step starts: StreamBatches.save), a new stream from that checkpoint serves
    steps j.. exactly as the uninterrupted one; here j falls inside a text row's pieces and, packed, inside a run."""
    rows = [{"text": f"{i} " + "long text row " * (i % 5)} for i in range(40)]
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", rows), max_length=16, streaming=True, shuffle_buffer=5, packing=packing)
    whole = served(batches(streamed(cfg, tok, seed=2)), range(14))
    for j in (1, 5, 9):
        first = batches(streamed(cfg, tok, seed=2))
        assert served(first, range(j)) == whole[:j]
        step_dir = tmp_path / f"step_{j}"
        step_dir.mkdir()
        first.save(step_dir)
        state = json.loads((step_dir / stream.STATE).read_text())
        assert state["step"] == j and state["stats"]["rows"] == state["row"]  # the rows before the run being consumed
        resumed = batches(streamed(cfg, tok, seed=2), resume_from=step_dir)
        assert served(resumed, range(j, 14)) == whole[j:], j


def test_every_layout_serves_the_same_global_batch(tok, tmp_path):
    """Two data-parallel ranks each serve their contiguous half of the one-rank global batch."""
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", ROWS * 4), max_length=48, streaming=True, shuffle_buffer=6)
    one = served(batches(streamed(cfg, tok), global_batch=8), range(5))
    two = [served(batches(streamed(cfg, tok), global_batch=8, dp_rank=r, dp_size=2), range(5)) for r in range(2)]
    assert one == [two[0][k] + two[1][k] for k in range(5)]


def test_a_local_dataset_directory_streams_through_datasets(tok, tmp_path):
    """The hub-id path (`datasets.load_dataset(..., streaming=True)`) on local directories: data files, and
    save_to_disk output; the examples are those of the in-memory path, each row named as it names it."""
    import datasets

    files, saved = tmp_path / "files", tmp_path / "saved"
    files.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(6)]
    write_jsonl(files / "train.jsonl", rows)
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    for folder in (files, saved):
        cfg = DataConfig(train=str(folder), streaming=True, shuffle_buffer=1)
        memory, _ = tokenize(load_rows(str(folder), "train", "data.train"), tok, cfg, "data.train")
        assert [e for *_, e in taken(streamed(cfg, tok).examples(Position(), Stats()), 6)] == memory
    bad = tmp_path / "bad"
    bad.mkdir()
    write_jsonl(bad / "train.jsonl", [*rows[:2], {"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(ConfigError) as e:
        taken(streamed(DataConfig(train=str(bad), streaming=True), tok).examples(Position(), Stats()), 3)
    assert str(e.value) == f"{bad} row 2: the last message must be the assistant's response, got role 'user'"


def test_a_streamed_mixture_draws_by_weight_and_repeats_no_row_within_a_pass(tok, tmp_path):
    """Each next row comes from a source with its weight's probability (seeded); a pass ends when a source runs out."""
    a = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "a", "output": f"a{i}"} for i in range(100)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"instruction": "b", "output": f"b{i}"} for i in range(300)])
    cfg = DataConfig(train=[{"path": a, "weight": 1}, {"path": b, "weight": 3}], max_length=48, streaming=True, shuffle_buffer=50)

    def first_pass(seed):
        out = []
        for _, epoch, _, example in streamed(cfg, tok, seed).examples(Position(), Stats()):
            if epoch:
                return out
            out.append(example.reference)

    drawn = first_pass(1)
    assert len(set(drawn)) == len(drawn)  # no row twice in a pass
    from_a, from_b = (sum(x.startswith(name) for x in drawn) for name in "ab")
    assert from_a == 100 or from_b == 300  # the pass ended when a source ran out
    assert 2.4 < from_b / from_a < 3.6
    assert first_pass(1) == drawn and first_pass(2) != drawn


def test_eval_size_holds_out_the_first_rows_and_the_stream_starts_after_them(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", numbered(10))
    cfg = DataConfig(train=path, eval_size=3, max_length=48, streaming=True, shuffle_buffer=1)
    train, evals, stats = stream.load(cfg, tok, 0, "sft")
    assert [e.reference for e in evals] == ["0", "1", "2"] and stats["eval"].rows == 3
    assert [e.reference for *_, e in taken(train.examples(Position(), Stats()), 8)] == [*"3456789", "3"]
    with pytest.raises(ConfigError, match=f"^data.eval_size=10 leaves no training rows in {path}$"):
        taken(streamed(replace(cfg, eval_size=10), tok).examples(Position(), Stats()), 1)


def test_a_bad_row_met_by_the_worker_is_one_line_naming_its_line(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [*numbered(5), {"instruction": "x", "output": " "}])
    b = batches(streamed(DataConfig(train=path, streaming=True, shuffle_buffer=1), tok))
    assert len(b.micro_batches(0)) == 2
    with pytest.raises(ConfigError) as e:
        b.micro_batches(1)
    assert str(e.value) == f"{path}:6: the response 'output' is empty (only whitespace): fix the row or remove it"


def test_the_launcher_checks_only_that_a_streamed_file_exists(tmp_path):
    """Reading a stream whole before launch is what streaming avoids: its rows are checked as the stream reaches them."""
    from finetune.data.examples import check

    bad = write_jsonl(tmp_path / "t.jsonl", [{"instruction": "x", "output": " "}])
    check(DataConfig(train=bad, streaming=True), "sft")
    with pytest.raises(ConfigError, match=f"^{bad}:1: the response 'output' is empty"):
        check(DataConfig(train=bad), "sft")
    for name, message in (("missing.jsonl", "data.train: no such file or directory: {}"),
                          ("rows.csv", "data.train: {} is a .csv file: data files are .jsonl")):
        (tmp_path / "rows.csv").write_text("a,b\n")
        with pytest.raises(ConfigError, match="^" + re.escape(message.format(tmp_path / name))):
            check(DataConfig(train=str(tmp_path / name), streaming=True), "sft")


def test_a_pass_that_keeps_nothing_is_refused(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"instruction": "r" * 80, "output": "x"}] * 2)
    with pytest.raises(ConfigError) as e:
        taken(streamed(DataConfig(train=path, max_length=16, streaming=True), tok).examples(Position(), Stats()), 1)
    assert str(e.value) == (f"data.train={path}: the dataset is empty after filtering: all 2 prompts are longer than "
                            "data.max_length=16 (the shortest is 83 tokens): raise data.max_length")


def test_resuming_without_the_streams_position_is_one_line(tok, tmp_path):
    cfg = DataConfig(train=write_jsonl(tmp_path / "t.jsonl", numbered(4)), streaming=True)
    with pytest.raises(ConfigError) as e:
        batches(streamed(cfg, tok), resume_from=tmp_path)
    assert str(e.value) == (f"train.resume: {tmp_path} has no data_stream.json (where the stream stood): resume a checkpoint saved "
                            "with data.streaming=true, or start a fresh run")


@pytest.mark.parametrize("overrides,message", [
    (["data.cache_dir=/tmp/x"], "data.cache_dir=/tmp/x has no effect with data.streaming=true (a stream is tokenized on the fly, with no "
                                "token cache): remove it, or set data.streaming=false"),
    (["data.num_proc=4"], "data.num_proc=4 has no effect with data.streaming=true (a stream is tokenized on the fly, with no token "
                          "cache): remove it, or set data.streaming=false"),
    (["data.train=[{path:a.jsonl,weight:1},{path:b.jsonl,rows:20}]"], "data.train[1].rows=20 is an exact count of the source's rows, whose number "
                                                      "data.streaming=true does not read ahead: give the source a weight instead"),
    (["data.train=[a.jsonl,{path:b.jsonl,weight:2}]"], "data.train[0]: a streamed mixture draws each next row from a source by its "
                                                       "weight (data.streaming=true): give every source a weight"),
    (["data.train=[{path:a.jsonl,weight:1},{path:b.jsonl,weight:2}]", "data.eval=null", "data.eval_size=10"],
     "data.eval_size=10 with a streamed mixture: data.streaming=true holds out the first rows of one source, and a mixture has "
     "several: set data.eval"),
    (["method=dpo", "data=quickstart_dpo"], "method.reference=precomputed scores every train pair before training, which a stream cannot "
                                 "(data.streaming=true): use method.reference=live (or adapter_disabled with peft), or data.streaming=false"),
])
def test_what_a_stream_cannot_do_is_refused_at_compose(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "data.streaming=true", *overrides])
    assert str(e.value) == message


def test_stream_settings_without_a_stream_are_refused_and_dpo_streams_with_a_live_reference(compose):
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "data.shuffle_buffer=100"])
    assert str(e.value) == ("data.shuffle_buffer=100 applies to data.streaming=true only (otherwise the whole set is shuffled by "
                            "train.seed): remove it, or set data.streaming=true")
    assert compose(["+recipe=quickstart_dpo", "data.streaming=true", "method.reference=live"]).data.streaming
    assert compose(["+recipe=quickstart_dpo", "data.streaming=true", "method.loss=simpo"]).data.streaming


def test_the_planner_plans_a_stream_at_max_length(compose):
    from finetune.launcher.plan import read_longest
    from finetune.planner.peak import batch_width
    from finetune.data.lengths import longest_batch

    cfg = compose(["+recipe=quickstart_sft", "data.streaming=true"])
    assert longest_batch(cfg) == "data.streaming=true: a stream's lengths are known only as the run reads it"
    assert batch_width(cfg, read_longest(cfg)) == (64, (
        "activations at max_length 64 tokens: an upper bound (the data was not read: data.streaming=true: a stream's lengths are "
        "known only as the run reads it; padded batches are as long as their longest row, at most data.max_length)"))


def test_checkpoints_of_runs_before_streaming_keep_resuming(compose):
    """A setting added later is left out of a checkpoint's trajectory at its default (what older runs ran)."""
    from finetune.rank.checkpoint import trajectory

    assert not {"data.streaming", "data.shuffle_buffer"} & set(trajectory(compose(["+recipe=quickstart_sft"])))
    streaming = trajectory(compose(["+recipe=quickstart_sft", "data.streaming=true", "data.shuffle_buffer=7"]))
    assert (streaming["data.streaming"], streaming["data.shuffle_buffer"]) == (True, 7)


def test_prepare_refuses_a_stream(tmp_path):
    out = run_cli("+recipe=quickstart_sft", "data.streaming=true", cwd=tmp_path, module="finetune.prepare")
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: data.streaming=true: the stream is tokenized on the fly while the run trains, so there is nothing to prepare "
        "(drop data.streaming=true to cache the tokens)")


def test_a_streamed_run_resumes_where_it_stopped(tmp_path):
    """Through the rank code: 3 steps, saving at 2; a run resumed from that checkpoint trains step 3 on the same
    batch (the same loss) as the uninterrupted run."""
    overrides = ["+recipe=quickstart_sft", "data.streaming=true", "data.shuffle_buffer=64", "train.max_steps=3", "train.save_every=2",
                 "optim.warmup_steps=0", "train.exact_match_samples=0", "train.eval_every=0"]
    train_here(overrides, tmp_path / "whole")
    step_2 = tmp_path / "whole" / "checkpoints" / "step_2"
    assert json.loads((step_2 / stream.STATE).read_text())["step"] == 2
    train_here([*overrides, f"train.resume={step_2}"], tmp_path / "resumed")
    loss = {name: [r["loss"] for r in read_metrics(tmp_path / name) if r.get("kind") == "train"] for name in ("whole", "resumed")}
    assert len(loss["whole"]) == 3 and loss["resumed"] == pytest.approx(loss["whole"][2:], rel=1e-6)


def test_a_streamed_run_through_the_cli(tmp_path):
    out = run_cli("+recipe=quickstart_sft", "data.streaming=true", "train.max_steps=2", "optim.warmup_steps=0", "launcher.nproc_per_node=1",
                  "parallelism=single", "train.progress_bar=false", "train.exact_match_samples=0", f"run_dir={tmp_path / 'run'}",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (f"data train: streamed from {ASSETS / 'data/quickstart/train.jsonl'} (a shuffle buffer of 10,000 rows, seed 42; tokenized "
            "on the fly by a DataLoader worker on every rank, no token cache)") in out.stdout.splitlines()
    assert "data: tokenized" not in out.stdout and "data: cached tokens" not in out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["train"]["rows"] == 63  # the rows before the run (one row) the next step starts in: 2 steps x 32 - 1
    lines = out.stdout.strip().splitlines()  # the report, the time after training, the launcher's shutdown line
    assert lines[-3].startswith("metrics ") and lines[-2].startswith("after training: ") and lines[-1].startswith("[finetune] shutdown: ")
