"""Metrics to a JSONL file and TensorBoard (rank 0), and the loss-curve plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"


class MetricsLog:
    """One JSON object per line: {"kind": "train"|"eval", "step": N, ...metrics}."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.file = open(run_dir / METRICS, "a") if enabled else None
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def read(run_dir: Path) -> list[dict[str, Any]]:
    with open(run_dir / METRICS) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(run_dir: Path, out: Path) -> None:
    """Train loss per step and eval loss at each evaluation, as a PNG. Drawn on matplotlib's Agg canvas (no pyplot, no
    backend to pick), the log axis labelled in plain text: its default labels are mathtext, whose parser costs more to
    build (~0.4 s) than the rest of the plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter

    rows = read(run_dir)
    train = [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r["kind"] == "eval"]
    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per response token)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
