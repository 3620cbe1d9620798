"""Padded runs are planned from the data (finetune/data/lengths.py): the light tokenizer gives the rank's
token ids, the longest batch is the one the run's steps reach, the plan says which width it used,
and the dry run reads no data when data.max_length already fits."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_cli


def real_examples(cfg):
    from finetune.rank import model
    from finetune.data.examples import load_split

    tokenizer = model.load_tokenizer(cfg.model)
    train, _, _ = load_split(cfg.data, tokenizer, cfg.train.seed, cfg.method.name)
    return train, tokenizer


@pytest.mark.parametrize("overrides", [[], ["data=quickstart_dpo", "method=dpo"]], ids=["sft", "dpo"])
def test_light_tokenizer_gives_the_ranks_token_ids(compose, overrides):
    """Chat template, response labels and truncation through finetune.data's code: identical ids."""
    from finetune.data import lengths
    from finetune.data.sources import load_rows
    from finetune.data.examples import tokenize
    from finetune.data.tokenize import Pair

    cfg = compose(["+recipe=quickstart_sft", *overrides])
    train, _ = real_examples(cfg)
    rows = load_rows(cfg.data.train, cfg.data.train_split, "data.train")
    if cfg.data.eval is None and cfg.data.eval_size:
        pytest.skip("held-out rows: compared in test_the_longest_batch_is_the_one_the_steps_reach")
    light, _ = tokenize(rows, lengths.LightTokenizer(lengths.tokenizer_files(cfg.model)), cfg.data, "data.train", cfg.method.name)
    flat = lambda items: [(e.chosen.input_ids, e.rejected.input_ids) if isinstance(e, Pair) else e.input_ids for e in items]  # noqa: E731
    assert flat(light) == flat(train)


def test_reading_lengths_imports_no_torch():
    code = ("import sys, time; from finetune.launcher.compose import preflight; cfg = preflight(['+recipe=quickstart_sft']); "
            "t = time.perf_counter(); from finetune.data.lengths import longest_batch; found = longest_batch(cfg); "
            "print(found.width, round(time.perf_counter() - t, 2), 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    width, seconds, torch, transformers = out.stdout.split()
    print(f"quickstart: longest row {width} tokens, read and tokenized in {seconds} s (4,000 rows)")
    assert (torch, transformers) == ("False", "False")


@pytest.mark.parametrize("overrides", [
    ["train.max_steps=500"],  # 500 x 32 rows: every row
    ["train.max_steps=3", "train.global_batch_size=8", "train.micro_batch_size=4", "launcher.nproc_per_node=1"],  # 24 rows
    ["data.packing=true", "train.max_steps=500"],
    ["data.eval=null", "data.eval_size=100", "train.max_steps=2", "train.global_batch_size=16", "train.micro_batch_size=8",
     "launcher.nproc_per_node=1"],
])
def test_the_longest_batch_is_the_one_the_steps_reach(compose, overrides):
    """Against the rank's own batches: TrainBatches over every step, each micro-batch as collate pads it."""
    from finetune.data.batches import TrainBatches
    from finetune.data.pack import pack
    from finetune.data.lengths import longest_batch

    cfg = compose(["+recipe=quickstart_sft", "optim.warmup_steps=0", *overrides])
    train, tokenizer = real_examples(cfg)
    if cfg.data.packing:
        train = pack(train, cfg.data.max_length, cfg.train.seed)
    widest = 0
    for rank in range(cfg.data_parallel_size):
        batches = TrainBatches(train, global_batch=cfg.train.global_batch_size, micro_batch=cfg.train.micro_batch_size,
                               dp_rank=rank, dp_size=cfg.data_parallel_size, seed=cfg.train.seed, pad_id=tokenizer.pad_token_id)
        for step in range(cfg.train.max_steps):
            idx = batches.indices(step)
            widest = max(widest, max(len(train[i].input_ids) for i in idx))
    found = longest_batch(cfg)
    assert found.width == widest, found.why


def test_plan_says_at_which_width(tmp_path):
    """The plan line: the longest batch read from local data; an upper bound when the data is a hub dataset."""
    local = run_cli("+recipe=quickstart_sft", cwd=REPO, module="finetune.plan", timeout=120)
    assert local.returncode == 0, local.stderr
    line = next(x for x in local.stdout.splitlines() if "activations at" in x)
    assert line == "note: activations at the longest batch: 29 tokens (max_length 64; the longest of all 4,000 rows of data.train)"
    hub = run_cli("+recipe=quickstart_sft", "data=jsonl", "data.train=someone/some-dataset", "data.max_length=2048", "train.exact_match_samples=0",
                  "model.init.max_position_embeddings=2048", cwd=REPO, module="finetune.plan", timeout=120)
    assert hub.returncode == 0, hub.stderr
    line = next(x for x in hub.stdout.splitlines() if "activations at" in x)
    assert line == ("note: activations at max_length 2048 tokens: an upper bound (the data was not read: data.train=someone/some-dataset "
                    "is not a local .jsonl/.json file; padded batches are as long as their longest row, at most data.max_length)")


def test_dry_run_reads_no_data_when_max_length_fits(compose, monkeypatch, capsys):
    """check_memory plans data.max_length first; only a config that does not fit there reads the data."""
    from finetune.data import lengths
    from finetune.launcher import launch

    calls = []
    monkeypatch.setattr(lengths, "longest_batch", lambda cfg: calls.append(cfg) or lengths.Longest(16, "stub"))
    cfg = compose(["+recipe=quickstart_sft", "launcher.dry_run=true"])
    start = time.perf_counter()
    launch.check_memory(cfg, [])
    took = time.perf_counter() - start
    print(f"check_memory (fits at max_length): {took * 1e3:.1f} ms")
    assert calls == [] and took < 0.5
    assert "FITS (python -m finetune.plan" in capsys.readouterr().out
    # 2 GiB of RAM per rank, a 0.1B model at 1024 tokens: does not fit at max_length, fits at the 16-token stub
    big = compose(["+recipe=quickstart_sft", "launcher.dry_run=true", "model.init.hidden_size=1024", "model.init.intermediate_size=2816",
                   "model.init.num_hidden_layers=8", "model.init.num_attention_heads=8", "model.init.num_key_value_heads=8",
                   "model.init.max_position_embeddings=1024", "data.max_length=1024", "hardware.cpu_memory_gib=4.5",
                   "peft=lora", "train.micro_batch_size=16"])
    launch.check_memory(big, [])
    assert len(calls) == 1
    assert "FITS at the longest batch, 16 tokens (not at data.max_length=1024)" in capsys.readouterr().out


def test_quickstart_memory_report_within_15_percent(tmp_path):
    """The quickstart's own 2-rank run (two steps): the report's every category within 15% of MemTracker."""
    run = tmp_path / "qs"
    out = run_cli("+recipe=quickstart_sft", "train.max_steps=2", "optim.warmup_steps=0", "train.eval_every=0",
                  "train.exact_match_samples=0", "train.progress_bar=false", "train.tensorboard=false", f"run_dir={run}", "train.memory_report=categories",
                  cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = subprocess.run([sys.executable, str(REPO / "scripts" / "memory_report.py"), str(run)], capture_output=True,
                            text=True, cwd=REPO)
    assert report.returncode == 0, report.stderr
    print(report.stdout)
    rows = [line.split() for line in report.stdout.splitlines()[3:8]]
    assert [r[0] for r in rows] == ["weights", "gradients", "optimizer", "activations", "peak"]
    for name, predicted, measured, _ in rows:
        assert float(predicted) == pytest.approx(float(measured), rel=0.15), name
    record = next(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"plan"' in x)
    assert record["plan_run_width"] == 29 and record["plan_width"] <= 29
