"""Metrics to the sinks `train.loggers` names (rank 0): JSONL and TensorBoard today, behind one interface; and the
loss-curve plot.

A sink is a class with `start(run_dir, config)`, `write(kind, step, metrics)` and `close()` (`Sink`), registered by
name in `SINKS`. `MetricsLog` fans every row out to the chosen ones. jsonl is always among them (the rules refuse a
list without it): RUN_DIR/metrics.jsonl is what the run's summary, the loss plot, the sweep summary and the tests read.
Imports no torch (TensorBoard's writer is imported when its sink starts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

METRICS = "metrics.jsonl"


class Sink(Protocol):
    """Where metric rows go. `kind`: train, eval, memory, plan, ...; `metrics`: name -> number."""

    output: str
    """What it writes under RUN_DIR (a file or directory name), printed at the end of a run; "" for none."""

    def start(self, run_dir: Path, config: Any) -> None:
        """Open its files (or its connection). `config`: the run's typed Config (a service records it with the run)."""

    def write(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        """One row: `metrics` measured at `step`."""

    def close(self) -> None:
        """Flush and close; called once, also when training fails."""


class JsonlSink:
    """One JSON object per line: {"kind": "train"|"eval"|..., "step": N, ...metrics}, flushed per row."""

    output = METRICS

    def start(self, run_dir: Path, config: Any) -> None:
        self.file = open(run_dir / METRICS, "a")

    def write(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"kind": kind, "step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """RUN_DIR/tensorboard: each metric a scalar named KIND/NAME (train/loss, eval/eval_loss), at its step."""

    output = "tensorboard"

    def start(self, run_dir: Path, config: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / self.output))

    def write(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        self.writer.close()


SINKS: dict[str, type[Sink]] = {"jsonl": JsonlSink, "tensorboard": TensorBoardSink}
"""train.loggers' names -> sink classes. A new logger (W&B, MLflow, ...) is one class with start/write/close here."""

REQUIRED = "jsonl"
"""The sink every run has: RUN_DIR/metrics.jsonl feeds the summary, the loss plot and the sweep summary."""


class MetricsLog:
    """The run's sinks (`train.loggers`), on the main rank only: every row goes to each of them."""

    def __init__(self, run_dir: Path, *, enabled: bool, loggers: list[str], config: Any = None) -> None:
        self.enabled = enabled
        self.sinks: list[Sink] = [SINKS[name]() for name in loggers] if enabled else []
        for sink in self.sinks:
            sink.start(run_dir, config)

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(kind, step, values)

    def close(self) -> None:
        """Close every sink, even when one fails (the first failure is raised after)."""
        failed: list[Exception] = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - the others still flush
                failed.append(e)
        if failed:
            raise failed[0]


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
