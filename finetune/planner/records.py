"""The plan beside what a run measured: the {"kind": "plan"} record a run writes to metrics.jsonl (`record`), read
back with the memory probe's {"kind": "memory"} one (`compare`: what scripts/memory_report.py prints).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.config import Config, ConfigError
from finetune.data.lengths import Longest
from finetune.planner.peak import plan

MIB = 2**20
COMPARED = (("weights", "params"), ("gradients", "grads"), ("optimizer", "optimizer"),
            ("activations", "backward_activations"), ("peak", "peak_total"))
"""(planner category, the memory probe's) pairs: activations are activations + temporaries at the start
of the model's backward or at its worst moment (Plan.measured_activations; the loss's backward runs
outside the model, where the probe's module hooks do not look); peak excludes the fixed overhead,
which MemTracker does not see (the CUDA context, the Python process)."""


def record(cfg: Config, longest: Longest | None = None) -> dict[str, float] | str:
    """What a run writes to metrics.jsonl as {"kind": "plan"}: MiB per category for rank 0's share at
    `longest` (the batches the memory probe measures), and the tokens per row planned at (the reason,
    when the planner cannot read the architecture)."""
    try:
        pl = plan(cfg, longest)
    except ConfigError as e:
        return str(e)
    # DDP's buckets: MemTracker does not see the reducer allocate them (before the first step), but sees
    # the gradients copied through them in backward, as temporaries: compared there, not as gradients
    values = {"weights": pl.weights, "gradients": pl.gradients - pl.buckets, "optimizer": pl.optimizer,
              "activations": pl.measured_activations + pl.buckets, "peak": pl.total - pl.overhead, "overhead": pl.overhead,
              "logits": pl.logits}
    return {**{f"plan_{k}_mib": v / MIB for k, v in values.items()}, "plan_width": pl.width}


def plan_record(run_dir: Path) -> dict[str, Any] | None:
    """The {"kind": "plan"} record of a run's metrics.jsonl (None without one)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return next((r for r in rows if r.get("kind") == "plan"), None)


def compare(run_dir: Path) -> list[tuple[str, float, float]] | None:
    """[(category, predicted MiB, measured MiB)] from a run's metrics.jsonl; None without both records. A run measured
    with train.memory_report=peak has one row: the peak (CUDA: the allocator's; CPU: the process's resident set, beside
    the plan's peak and its fixed overhead); with categories, one row per COMPARED pair."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    predicted = next((r for r in rows if r.get("kind") == "plan"), None)
    measured = next((r for r in rows if r.get("kind") == "memory"), None)
    if predicted is None or measured is None:
        return None
    if "mem_cuda_max_allocated_mib" in measured and "mem_peak_total_mib" not in measured:  # train.memory_report=peak on CUDA
        return [("peak", predicted["plan_peak_mib"], measured["mem_cuda_max_allocated_mib"])]
    if "mem_peak_rss_mib" in measured:  # train.memory_report=peak on CPU: the whole process, the plan's overhead with it
        return [("peak+overhead", predicted["plan_peak_mib"] + predicted.get("plan_overhead_mib", 0.0), measured["mem_peak_rss_mib"])]
    return [(ours, predicted[f"plan_{ours}_mib"], measured.get(f"mem_{theirs}_mib", 0.0)) for ours, theirs in COMPARED]
