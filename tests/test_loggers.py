"""Metric sinks behind one interface (finetune/logs/__init__.py): train.loggers chooses them, each sink's files read back
(TensorBoard's through its own event reader), train.tensorboard still maps onto the list, jsonl is added where a list
leaves it out, and an unknown logger is refused at compose time in one line."""

from __future__ import annotations

import json

import pytest

from finetune import logs
from finetune.config import ConfigError

ROWS = [("train", 1, {"loss": 2.5, "lr": 1e-3}), ("train", 2, {"loss": 2.25, "lr": 1e-3}), ("eval", 2, {"eval_loss": 2.0})]


def write_rows(run_dir, loggers):
    log = logs.MetricsLog(run_dir, enabled=True, loggers=loggers)
    for kind, step, values in ROWS:
        log.write(kind, step, values)
    log.close()


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_every_sink_has_the_interface():
    for name, cls in logs.SINKS.items():
        assert all(callable(getattr(cls, m, None)) for m in ("start", "write", "samples", "close", "end")), name
        assert isinstance(cls.output, str), name


def test_jsonl_sink_reads_back(tmp_path):
    write_rows(tmp_path, ["jsonl"])
    assert logs.read(tmp_path) == [{"kind": k, "step": s, **v} for k, s, v in ROWS]
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_sink_reads_back_through_its_event_reader(tmp_path):
    write_rows(tmp_path, ["jsonl", "tensorboard"])
    scalars = tensorboard_scalars(tmp_path)
    assert set(scalars) == {"train/loss", "train/lr", "eval/eval_loss"}
    assert scalars["train/loss"] == [(1, 2.5), (2, 2.25)]
    assert scalars["eval/eval_loss"] == [(2, 2.0)]
    assert [json.loads(line)["step"] for line in (tmp_path / logs.METRICS).read_text().splitlines()] == [1, 2, 2]


def test_samples_go_to_jsonl_and_tensorboard(tmp_path):
    """train.sample_prompts' rows: a metrics.jsonl row of kind `sample` each; a Markdown table in TensorBoard's text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [{"index": 0, "prompt": "reverse: abc", "reference": "cba", "output": "c|a"}]
    log = logs.MetricsLog(tmp_path, enabled=True, loggers=["jsonl", "tensorboard"])
    log.samples(5, rows)
    log.close()
    log.end()
    assert logs.read(tmp_path) == [{"kind": "sample", "step": 5, **rows[0]}]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("samples/text_summary")
    assert text.step == 5 and text.tensor_proto.string_val[0].decode().splitlines()[-1] == "| reverse: abc | cba | c\\|a |"


def test_off_the_main_rank_nothing_is_written(tmp_path):
    log = logs.MetricsLog(tmp_path, enabled=False, loggers=["jsonl", "tensorboard"])
    log.write("train", 1, {"loss": 1.0})
    log.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overrides,loggers", [
    ([], ["jsonl", "tensorboard"]),
    (["train.loggers=[jsonl]"], ["jsonl"]),
    (["train.tensorboard=false"], ["jsonl"]),
    (["train.loggers=[jsonl]", "train.tensorboard=true"], ["jsonl", "tensorboard"]),
    (["train.loggers=[tensorboard,jsonl]", "train.tensorboard=false"], ["jsonl"]),
])
def test_train_loggers_and_the_older_tensorboard_switch(compose, overrides, loggers):
    assert compose(overrides).train.loggers == loggers


def test_an_unknown_logger_is_refused_naming_the_known_ones_and_jsonl_is_always_written(compose):
    with pytest.raises(ConfigError) as e:
        compose(["train.loggers=[jsonl,comet]"])
    assert str(e.value) == ("train.loggers=['jsonl', 'comet'] must be a list of known loggers (jsonl, tensorboard, wandb, mlflow, "
                            "trackio): e.g. train.loggers=[jsonl,tensorboard,mlflow]")
    assert compose(["train.loggers=[mlflow]"]).train.loggers == ["jsonl", "mlflow"]  # the issue's own command
    assert compose(["train.loggers=[tensorboard]"]).train.loggers == ["jsonl", "tensorboard"]


def test_a_run_writes_to_the_loggers_it_names(tmp_path):
    """The rank's own MetricsLog, composed as the launcher does (train_here turns TensorBoard off, so not through it)."""
    import torch

    from finetune.rank import train
    from finetune.launcher.compose import preflight
    from finetune.config import to_yaml
    from finetune.rank.dist import Dist

    cfg = preflight(["train.max_steps=2", "train.global_batch_size=8", "train.micro_batch_size=8", "train.eval_every=0",
                     "data.eval_size=0", "data.eval=null", "train.exact_match_samples=0", "train.memory_report=false",
                     "train.progress_bar=false", "train.loggers=[jsonl,tensorboard]", f"run_dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    train.run(cfg, Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    assert [r["step"] for r in logs.read(tmp_path) if r["kind"] == "train"] == [1, 2]
    assert [step for step, _ in tensorboard_scalars(tmp_path)["train/loss"]] == [1, 2]
