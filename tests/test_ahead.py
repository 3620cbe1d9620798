"""The next step's micro-batches made while this one computes (loop.Ahead), and the wait the metrics show."""

from __future__ import annotations

import threading
import time

import pytest

from finetune.config import ConfigError
from finetune.data.batches import TrainBatches
from finetune.data.tokenize import Example
from finetune.rank.loop import Ahead

from conftest import read_metrics, train_here


class Slow:
    """Batches that take `seconds` to make, recording the thread and order that made them."""

    pure = True

    def __init__(self, seconds: float, fail_at: int | None = None) -> None:
        self.seconds, self.fail_at, self.made = seconds, fail_at, []

    def micro_batches(self, step: int) -> list[dict]:
        time.sleep(self.seconds)
        if step == self.fail_at:
            raise ConfigError(f"row {step} is broken")
        self.made.append((step, threading.current_thread().name))
        return [{"step": step}]


def test_the_next_step_is_made_while_this_one_computes():
    batches = Slow(0.3)
    ahead = Ahead(batches, last=3)
    waits = []
    for step in range(4):
        micro, waited = ahead.get(step)
        assert micro == [{"step": step}]
        waits.append(waited)
        time.sleep(0.9)  # the step's compute: far longer than making the next one
    ahead.close()
    assert waits[0] >= 0.29 and max(waits[1:]) < 0.05, waits  # only the first step waited for its data
    assert [s for s, _ in batches.made] == [0, 1, 2, 3]  # none made twice, none beyond the last step
    assert batches.made[0][1] == "MainThread" and all(name.startswith("next-batches") for _, name in batches.made[1:])


def test_a_step_slower_to_make_than_to_compute_shows_its_wait():
    ahead = Ahead(Slow(0.4), last=2)
    ahead.get(0)
    time.sleep(0.1)
    _, waited = ahead.get(1)
    assert 0.25 < waited < 0.4 + 0.5  # the 0.3 s it had left, give or take a loaded machine


def test_an_error_made_ahead_is_raised_at_the_step_that_needs_it():
    ahead = Ahead(Slow(0.0, fail_at=2), last=3)
    ahead.get(0)
    ahead.get(1)  # step 2 fails in the thread, unseen until asked for
    with pytest.raises(ConfigError, match="row 2 is broken"):
        ahead.get(2)


def test_a_stream_is_read_in_order_on_the_loops_own_thread():
    class Stream(Slow):
        pure = False  # its checkpoint records the next step to read: nothing is read ahead

    batches = Stream(0.0)
    ahead = Ahead(batches, last=3)
    for step in range(3):
        ahead.get(step)
    assert batches.made == [(0, "MainThread"), (1, "MainThread"), (2, "MainThread")]


def test_train_batches_made_ahead_are_the_ones_made_in_order():
    examples = [Example(input_ids=list(range(1, 3 + i % 7)), labels=list(range(1, 3 + i % 7)), prompt_len=1, reference="") for i in range(40)]
    make = lambda: TrainBatches(examples, global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, seed=3, pad_id=0)  # noqa: E731
    direct, ahead = make(), Ahead(make(), last=9)
    for step in range(10):
        got, _ = ahead.get(step)
        want = direct.micro_batches(step)
        assert [{k: v.tolist() for k, v in mb.items()} for mb in got] == [{k: v.tolist() for k, v in mb.items()} for mb in want]


@pytest.mark.slow
def test_the_metrics_show_the_wait_for_data(tmp_path, capsys):
    train_here(["+recipe=quickstart_sft", "train.max_steps=3", "optim.warmup_steps=1", "train.exact_match_samples=0",
                "train.memory_report=false", "train.log_every=1", "parallelism=single", "launcher.nproc_per_node=1"], tmp_path)
    train = [m for m in read_metrics(tmp_path) if m["kind"] == "train"]
    assert all(0 <= m["data_wait_s"] < m["step_s"] for m in train)
    out = capsys.readouterr().out
    assert f"data_wait {1000 * train[2]['data_wait_s']:.0f} ms" in out
