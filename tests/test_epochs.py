"""train.epochs (finetune/data/steps.py): the steps the launcher counts equal ceil(epochs x examples after packing /
(micro_batch x grad_accum x dp)) on any layout, from the data tokenized here or from the token cache alike (a resume
counts the same); every example is seen once per epoch (finetune.data.batches.TrainBatches); the refusals; the
dry run and a real run."""

from __future__ import annotations

import math
import re

import pytest
from conftest import read_metrics, run_cli, write_jsonl

from finetune.data import steps
from finetune.config import ConfigError
from finetune.data import cache
from finetune.data.batches import TrainBatches, epoch_steps
from finetune.data.examples import load_split
from finetune.data.pack import pack


def rows(n):
    return [{"instruction": f"reverse {'ab' * (i % 7)}{i}", "output": f"{i}"} for i in range(n)]


def small(tmp_path, n=50, *more, eval_size=0):
    return [f"data.train={write_jsonl(tmp_path / 'train.jsonl', rows(n))}", "data.eval=null", f"data.eval_size={eval_size}",
            "train.exact_match_samples=0", "optim.warmup_steps=0", "train.max_steps=null", f"data.cache_dir={tmp_path / 'tokens'}",
            *more]


def test_epoch_steps_read_epochs_as_written():
    assert [epoch_steps(e, 100, 10) for e in (1, 1.1, 1.5, 0.01, 3)] == [10, 11, 15, 1, 30]
    assert epoch_steps(1, 101, 10) == 11  # the last step is a partial epoch's: ceil


@pytest.mark.parametrize("layout,micro,dp", [(["launcher.nproc_per_node=1", "parallelism=single"], 4, 1), (["launcher.nproc_per_node=2", "parallelism=ddp"], 8, 2),
                                             (["launcher.nproc_per_node=4", "parallelism=ddp"], 2, 4)])
@pytest.mark.parametrize("packing", [False, True])
def test_the_steps_are_the_hand_computation_on_any_layout_with_and_without_packing(compose, tok, tmp_path, layout, micro, dp, packing):
    """ceil(epochs x examples / (micro_batch x grad_accum x dp)), the examples those the ranks train on: the rows, or the
    packed rows the ranks' own packing makes of them (with the run's tokenizer)."""
    cfg = compose(["+recipe=quickstart_sft", *small(tmp_path), "train.epochs=1.5", "train.global_batch_size=16",
                   f"train.micro_batch_size={micro}", f"data.packing={str(packing).lower()}", *layout])
    train = load_split(cfg.data, tok, cfg.train.seed)[0]
    examples = len(pack(train, cfg.data.max_length, cfg.train.seed)) if packing else len(train)
    assert examples < 50 if packing else examples == 50  # packing: fewer, fuller rows
    said = []
    steps.resolve(cfg, said.append)
    accum = 16 // (micro * dp)
    assert cfg.grad_accum_steps == accum and cfg.data_parallel_size == dp
    assert cfg.train.max_steps == math.ceil(1.5 * examples / (micro * accum * dp))
    what = "packed rows" if packing else "examples"
    assert said == [f"train.epochs=1.5: train.max_steps={cfg.train.max_steps} = ceil(1.5 x {examples} {what} of data.train / 16 "
                    f"per step (micro_batch {micro} x grad_accum {accum} x dp {dp})); counted by tokenizing data.train here"]


def test_the_token_cache_gives_the_count_the_launcher_tokenized(compose, tok, tmp_path):
    """A resume (or any later launch) reads the count from the cache entry the ranks built: the same steps (the rows
    held out for evaluation not among them)."""
    cfg = compose(["+recipe=quickstart_sft", *small(tmp_path, 37, eval_size=5), "train.epochs=2", "data.packing=true"])
    first, where = steps.count_examples(cfg)
    assert where == "by tokenizing data.train here"
    train, _, _, _, entry = cache.load(cfg.data, tok, cfg.train.seed, "sft", builder=True, progress=False, say=lambda line: None)
    assert len(train) == first < 32
    assert steps.count_examples(cfg) == (first, f"from the token cache {entry}")


def test_the_planner_counts_the_steps_as_the_launcher_does(capsys):
    from finetune.launcher.plan import main

    assert main(["+recipe=quickstart_sft", "train.max_steps=null", "train.epochs=2"]) == 0
    assert capsys.readouterr().out.startswith("# train.epochs=2: train.max_steps=250 = ceil(2 x 4,000 examples of data.train")


@pytest.mark.parametrize("epochs,dp", [(1, 1), (2, 1), (2, 2), (1.5, 4)])
def test_an_epoch_sees_every_example_once(epochs, dp):
    """TrainBatches' stream is one seeded permutation per epoch: epoch e is positions [e*N, (e+1)*N) of the steps'
    global batches, on any number of ranks; ceil's last step takes the rest from the next epoch's permutation."""
    n, global_batch = 10, 4
    per_rank = [TrainBatches(list(range(n)), global_batch=global_batch, micro_batch=1, dp_rank=r, dp_size=dp, seed=3, pad_id=0)
                for r in range(dp)]
    total = epoch_steps(epochs, n, global_batch)
    seen = [i for step in range(total) for b in per_rank for i in b.indices(step)]
    assert len(seen) == total * global_batch >= epochs * n
    for e in range(math.floor(epochs)):
        assert sorted(seen[e * n : (e + 1) * n]) == list(range(n))
    rest = seen[math.floor(epochs) * n :]
    assert len(set(rest)) == len(rest)  # the partial epoch repeats nothing


@pytest.mark.parametrize("overrides,message", [
    (["train.epochs=2"], "train.epochs=2 and train.max_steps=500 both set how long training runs: add train.max_steps=null to "
                         "train for epochs, or remove train.epochs"),
    (["train.max_steps=null"], "train.max_steps=null and no train.epochs: set train.max_steps=N (optimizer steps) or "
                               "train.epochs=N (passes over data.train)"),
    (["train.epochs=1", "train.max_steps=null", "data.streaming=true"],
     "train.epochs=1 needs the number of training examples, which a stream (data.streaming=true) does not know before the run "
     "reads it: set train.max_steps instead"),
    (["train.epochs=0", "train.max_steps=null"], "train.epochs=0.0 must be positive"),
])
def test_how_long_is_one_of_max_steps_or_epochs(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", *overrides])
    assert str(e.value) == message


def test_warmup_is_checked_against_the_counted_steps_and_the_ranks_check_the_count(compose, tmp_path):
    cfg = compose(["+recipe=quickstart_sft", *small(tmp_path, 40), "train.epochs=1", "train.global_batch_size=8",
                   "train.micro_batch_size=4", "optim.warmup_steps=5"])
    with pytest.raises(ConfigError) as e:
        steps.resolve(cfg, lambda line: None)
    assert str(e.value) == "optim.warmup_steps=5 must be below the 5 steps of train.epochs=1"
    steps.check_count(cfg, 40)
    with pytest.raises(ConfigError) as e:
        steps.check_count(cfg, 48)
    assert str(e.value) == ("train.epochs=1: the run loaded 48 training examples, which make 6 steps, but the launcher counted 5: "
                            "run python -m finetune.prepare with this config first (the launcher then reads the token cache's "
                            "count), or set train.max_steps")


def test_the_dry_run_prints_the_steps_and_a_sweep_counts_each_trial(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path / "tokens"))  # an empty token cache: the launcher counts by tokenizing
    out = run_cli("-m", "+recipe=quickstart_sft", "train.max_steps=null", "train.epochs=1,0.5", "launcher.dry_run=true",
                  f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("# train.epochs=")]
    assert lines == [f"# train.epochs={e}: train.max_steps={s} = ceil({e} x 4,000 examples of data.train / 32 per step (micro_batch "
                     f"16 x grad_accum 1 x dp 2)); counted by tokenizing data.train here" for e, s in (("1", 125), ("0.5", 63))]
    assert re.findall(r"^  max_steps: (\d+)$", out.stdout, re.M) == ["125", "63"]


@pytest.mark.slow
def test_a_run_of_one_epoch_takes_the_counted_steps_and_a_resume_counts_from_the_cache(tmp_path):
    data = small(tmp_path, 8, "train.global_batch_size=4", "train.micro_batch_size=2")
    overrides = ["+recipe=quickstart_sft", *data, "launcher.nproc_per_node=1", "parallelism=single", "train.progress_bar=false",
                 "train.log_every=1", "train.save_every=2", f"run_dir={tmp_path / 'run'}"]
    out = run_cli(*overrides, "train.epochs=1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[finetune] train.epochs=1: train.max_steps=2 = ceil(1 x 8 examples of data.train / 4 per step (micro_batch 2 x " \
           "grad_accum 2 x dp 1)); counted by tokenizing data.train here" in out.stdout
    written = (tmp_path / "run" / "config.yaml").read_text()  # what the ranks read: the counted steps, and the epochs asked
    assert "  max_steps: 2\n  epochs: 1.0\n" in written
    more = run_cli(*overrides, "train.epochs=2", "train.resume=auto", cwd=tmp_path)  # the second epoch, from step 2's checkpoint
    assert more.returncode == 0, more.stderr[-2000:]
    assert re.search(r"train.epochs=2: train.max_steps=4 = .*; counted from the token cache ", more.stdout)
    trained = [m for m in read_metrics(tmp_path / "run") if m.get("kind", "train") == "train" and "loss" in m]
    assert [(m["step"], m["epoch"]) for m in trained] == [(1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0)]
