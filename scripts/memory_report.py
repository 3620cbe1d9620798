"""Predicted beside measured memory, per category, for a run directory or every run of a sweep.

    python scripts/memory_report.py outputs/2026-11-22/10-00-00
    python scripts/memory_report.py outputs/multirun/2026-11-22/10-00-00

Reads the {"kind": "plan"} record (the planner's prediction for the run's own config, written by
rank 0 at the start) and the {"kind": "memory"} record (rank 0's measurement of the first steps) from each
metrics.jsonl: by category with train.memory_report=categories (MemTracker), the peak alone with
train.memory_report=peak, the default (CUDA: the allocator's; CPU: the process's resident set, beside the
plan's peak plus its fixed overhead). MiB; error = predicted/measured - 1.
The prediction is for the batches measured (padded batches are as long as their longest row: the
plan is made at the widest micro-batch of the measured steps); the last line gives the peak the
planner expects at the longest batch of the whole run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from finetune.planner.records import compare, plan_record


def table(run_dir: Path) -> str | None:
    rows = compare(run_dir)
    if rows is None:
        return None
    record = plan_record(run_dir) or {}
    width = f", planned at {record['plan_width']} tokens per row (the widest batch measured)" if "plan_width" in record else ""
    lines = [f"{run_dir}{width}", f"  {'category':<12}{'predicted':>12}{'measured':>12}{'error':>9}"]
    for name, predicted, measured in rows:
        error = f"{predicted / measured - 1:+8.1%}" if measured else f"{'-':>8}"
        lines.append(f"  {name:<12}{predicted:12.1f}{measured:12.1f} {error}")
    if "plan_run_width" in record:
        lines.append(f"  the run's longest batch: {record['plan_run_width']} tokens per row, planned peak "
                     f"{record['plan_run_peak_mib']:.1f} MiB")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/memory_report.py RUN_DIR|SWEEP_DIR", file=sys.stderr)
        return 2
    root = Path(argv[0])
    runs = [root] if (root / "metrics.jsonl").is_file() else sorted(p.parent for p in root.glob("*/metrics.jsonl"))
    tables = [t for t in (table(r) for r in runs) if t is not None]
    if not tables:
        print(f"error: no run under {root} has both a plan and a memory record in metrics.jsonl "
              "(runs record them unless train.memory_report=off; by category with train.memory_report=categories)", file=sys.stderr)
        return 1
    print("memory per rank (rank 0), MiB: planner vs measured\n" + "\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
