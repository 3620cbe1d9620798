"""train.memory_report: the peak by default (no hooks: the measured steps run at full speed), MemTracker's
categories when asked for, off; true/false still mean what they did; the plan comparison reads either record."""

from __future__ import annotations

import json

import pytest

from finetune.rank import memory
from finetune.planner.records import compare
from finetune.config import MemoryReport

from conftest import read_metrics, train_here

FEW = ["+recipe=quickstart_sft", "launcher.nproc_per_node=1", "parallelism=single", "train.max_steps=3", "optim.warmup_steps=0",
       "train.eval_every=0", "train.exact_match_samples=0", "data.eval=null", "data.eval_size=0"]


@pytest.mark.parametrize(("typed", "meant"), [(None, MemoryReport.peak), ("peak", MemoryReport.peak),
                                              ("Categories", MemoryReport.categories), ("off", MemoryReport.off),
                                              ("true", MemoryReport.categories), ("false", MemoryReport.off)])
def test_the_values_and_the_old_booleans(compose, typed, meant):
    cfg = compose(["+recipe=quickstart_sft", *([f"train.memory_report={typed}"] if typed else [])])
    assert cfg.train.memory_report is meant


def test_a_wrong_value_is_one_line(compose):
    from finetune.config import ConfigError

    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "train.memory_report=all"])
    assert str(e.value) == "train.memory_report=all must be one of peak, categories, off (true: categories, false: off)"


def never_tracked(*_a, **_k):
    raise AssertionError("MemTracker was built")


def test_the_default_measures_the_peak_without_memtracker(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(memory, "_tracker_class", never_tracked)  # the per-category probe would build it
    summary = train_here(FEW, tmp_path)
    out = capsys.readouterr().out
    record = next(r for r in read_metrics(tmp_path) if r["kind"] == "memory")
    assert set(record) == {"kind", "step", "mem_peak_rss_mib"} and record["step"] == 2
    assert 50 < record["mem_peak_rss_mib"] < 100_000
    assert summary["memory"] == {"mem_peak_rss_mib": record["mem_peak_rss_mib"]}
    planned = next(r for r in read_metrics(tmp_path) if r["kind"] == "plan")
    expected = planned["plan_peak_mib"] + planned["plan_overhead_mib"]
    assert (f"memory (rank 0, peak of the first steps): {record['mem_peak_rss_mib']:.1f} MiB resident (the whole process, since "
            f"the first step) | planned {expected:.1f} MiB ({planned['plan_peak_mib']:.1f} + 512 for the process); by category: "
            "train.memory_report=categories") in out
    rows = compare(tmp_path)  # what scripts/memory_report.py prints
    assert rows == [("peak+overhead", pytest.approx(expected), pytest.approx(record["mem_peak_rss_mib"]))]


def test_off_measures_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(memory, "_tracker_class", never_tracked)
    summary = train_here([*FEW, "train.memory_report=off"], tmp_path)
    assert summary["memory"] == {}
    assert not any(r["kind"] == "memory" for r in read_metrics(tmp_path))
    assert "memory (rank 0" not in capsys.readouterr().out


def test_categories_still_measure_by_category(tmp_path, capsys):
    summary = train_here([*FEW, "train.memory_report=categories"], tmp_path)
    record = next(r for r in read_metrics(tmp_path) if r["kind"] == "memory")
    assert {"mem_params_mib", "mem_grads_mib", "mem_optimizer_mib", "mem_activations_mib", "mem_peak_total_mib"} <= set(record)
    assert record["mem_optimizer_mib"] == pytest.approx(2 * record["mem_params_mib"], rel=0.01)  # AdamW's two states
    assert summary["memory"]["mem_peak_total_mib"] == record["mem_peak_total_mib"]
    planned = next(r for r in read_metrics(tmp_path) if r["kind"] == "plan")
    assert f"temp {record['mem_temp_mib']:.1f} MiB | planned {planned['plan_peak_mib']:.1f} MiB" in capsys.readouterr().out
    assert [name for name, *_ in compare(tmp_path)] == ["weights", "gradients", "optimizer", "activations", "peak"]


def test_a_cuda_peak_record_is_compared_with_the_planned_peak(tmp_path):
    rows = [{"kind": "plan", "step": 0, "plan_peak_mib": 100.0, "plan_overhead_mib": 1024.0},
            {"kind": "memory", "step": 2, "mem_cuda_max_allocated_mib": 90.0, "mem_cuda_max_reserved_mib": 128.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert compare(tmp_path) == [("peak", 100.0, 90.0)]
    line = memory.PeakProbe.__new__(memory.PeakProbe)
    line.planned = rows[0]
    assert line.line(rows[1]) == ("memory (rank 0, peak of the first steps): 90.0 MiB allocated, 128.0 MiB reserved (CUDA) | "
                                  "planned 100.0 MiB; by category: train.memory_report=categories")
