"""Metrics to the sinks `train.loggers` names (rank 0): JSONL, TensorBoard and the experiment trackers (W&B, MLflow,
trackio: finetune/logs/trackers.py), behind one interface; and the loss-curve plot.

A sink is a class with `start(run_dir, config, resume)`, `write(kind, step, metrics)`, `samples(step, rows)`, `close()` and
`end(files, failed)` (`Sink`), registered by name in `SINKS`. `MetricsLog` fans every row out to the chosen ones. jsonl
is always among them (the rules refuse a list without it): RUN_DIR/metrics.jsonl is what the run's summary, the loss
plot, the sweep summary and the tests read, and its failure is the run's. Any other sink that fails is warned about
once and left out from then on; a tracker (`queued`) runs in a thread of its own, so that neither its failure nor a
slow service holds a training step. Imports no torch (TensorBoard's writer is imported when its sink starts)."""

from __future__ import annotations

import json
import queue
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

from finetune.logs.trackers import TRACKERS, kept

METRICS = "metrics.jsonl"


class Sink(Protocol):
    """Where metric rows go. `kind`: train, eval, memory, plan, ...; `metrics`: name -> number."""

    output: str
    """What it writes under RUN_DIR (a file or directory name), printed at the end of a run; "" for none."""

    def start(self, run_dir: Path, config: Any, resume: bool = False) -> None:
        """Open its files (or its connection). `config`: the run's typed Config (a service records it with the run).
        `resume`: after the run ended (`python -m finetune.evaluate`): a tracker goes on with the run's own record."""

    def write(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        """One row: `metrics` measured at `step`."""

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Generations at the evaluation of `step` (train.sample_prompts): each row's index, prompt, reference, output."""

    def close(self) -> None:
        """Flush and close what it writes under RUN_DIR; called once, also when training fails."""

    def end(self, files: list[Path], failed: bool) -> None:
        """After the run's last file: keep `files` (loss.png, summary.json, config.yaml: those written) with the run and
        end it, marked failed when the run failed (a tracker's; the files' sinks have nothing left). Called once, after close."""


class JsonlSink:
    """One JSON object per line: {"kind": "train"|"eval"|..., "step": N, ...metrics}, flushed per row."""

    output = METRICS

    def start(self, run_dir: Path, config: Any, resume: bool = False) -> None:
        self.file = open(run_dir / METRICS, "a")

    def write(self, kind: str, step: int, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps({"kind": kind, "step": step, **metrics}) + "\n")
        self.file.flush()

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A row of kind `sample` per generation: {"kind": "sample", "step", "index", "prompt", "reference", "output"}."""
        for row in rows:
            self.write(SAMPLE, step, row)

    def close(self) -> None:
        self.file.close()

    def end(self, files: list[Path], failed: bool) -> None:
        pass


class TensorBoardSink:
    """RUN_DIR/tensorboard: each metric a scalar named KIND/NAME (train/loss, eval/eval_loss), at its step."""

    output = "tensorboard"

    def start(self, run_dir: Path, config: Any, resume: bool = False) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / self.output))

    def write(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"{kind}/{k}", v, step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A text summary `samples` at the step: a Markdown table of prompt, reference and output."""
        cell = lambda text: str(text).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        table = ["| prompt | reference | output |", "|---|---|---|"]
        self.writer.add_text("samples", "\n".join(table + [f"| {cell(r['prompt'])} | {cell(r['reference'])} | {cell(r['output'])} |"
                                                         for r in rows]), step)

    def close(self) -> None:
        self.writer.close()

    def end(self, files: list[Path], failed: bool) -> None:
        pass


SINKS: dict[str, type[Sink]] = {"jsonl": JsonlSink, "tensorboard": TensorBoardSink, **TRACKERS}
"""train.loggers' names -> sink classes. A new logger is one class with the `Sink` methods: here, or a tracker in
finetune/logs/trackers.py (with `problem`, the launcher's check that it can start, and `queued = True`)."""

SAMPLE = "sample"
"""The kind of metrics.jsonl's generation rows (train.sample_prompts)."""

REQUIRED = "jsonl"
"""The sink every run has: RUN_DIR/metrics.jsonl feeds the summary, the loss plot and the sweep summary."""


class MetricsLog:
    """The run's sinks (`train.loggers`), on the main rank only: every row goes to each of them. A sink other than jsonl
    that raises is warned about once (stderr) and left out from then on: training goes on, metrics.jsonl complete."""

    END_TIMEOUT_S = 120.0
    """How long `end` waits for a tracker to send what it was given before the run ends without it."""

    def __init__(self, run_dir: Path, *, enabled: bool, loggers: list[str], config: Any = None, resume: bool = False) -> None:
        self.enabled, self.run_dir, self.ended = enabled, run_dir, False
        self.sinks: dict[str, Any] = {}
        for name in loggers if enabled else []:
            sink = SINKS[name]()
            self.sinks[name] = Queued(name, sink) if getattr(sink, "queued", False) else sink
            self._call(name, "start", run_dir, config, resume)

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        for name in list(self.sinks):
            self._call(name, "write", kind, step, values)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        for name in list(self.sinks):
            self._call(name, "samples", step, rows)

    def close(self) -> None:
        """Close every sink's files (jsonl's failure is raised, after the others closed)."""
        failed: list[Exception] = []
        for name in list(self.sinks):
            try:
                self._call(name, "close")
            except Exception as e:  # noqa: BLE001 - the others still flush
                failed.append(e)
        if failed:
            raise failed[0]

    def end(self, failed: bool = False) -> None:
        """After the run's last file (or its failure): the trackers keep RUN_DIR's loss.png, summary.json and config.yaml
        and end their runs (marked failed), each given END_TIMEOUT_S to send what it still holds. Once; never raises."""
        if self.ended:
            return
        self.ended = True
        files = [] if failed else kept(self.run_dir)
        for name in list(self.sinks):
            try:
                self._call(name, "end", files, failed)
                if isinstance(self.sinks.get(name), Queued):
                    self.sinks[name].join(self.END_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - jsonl's end does nothing; this is the end of the run
                warn(name, "end", e)

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        self.end(failed=kind is not None)

    def _call(self, name: str, method: str, *args: Any) -> None:
        sink = self.sinks.get(name)
        if sink is None:
            return
        if name == REQUIRED:
            getattr(sink, method)(*args)
            return
        try:
            getattr(sink, method)(*args)
        except Exception as e:  # noqa: BLE001 - a logger never stops training
            del self.sinks[name]
            warn(name, method, e, step=args[1] if method == "write" else None)


def warn(name: str, method: str, e: BaseException, step: int | None = None) -> None:
    """The one line a failed sink gets."""
    first = (str(e).strip().splitlines() or [""])[0][:300]
    at = f" at step {step}" if step is not None else ""
    print(f"warning: train.loggers: {name} failed in {method}{at} ({type(e).__name__}: {first}); it is left out for the rest "
          f"of the run, which goes on (metrics.jsonl has every row)", file=sys.stderr, flush=True)


STOP = ("stop",)
"""What `Queued.join` puts after a tracker's last call: its thread ends there."""


class Queued:
    """A tracker's calls, in order, in a thread of its own: the loop only puts them on a queue, so a slow or hanging
    service never holds a training step. Rows that waited go out together where the sink takes several at once
    (`write_rows`). The first call that raises is warned about once, and the rest are dropped."""

    def __init__(self, name: str, sink: Any) -> None:
        self.name, self.sink = name, sink
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.failed = False
        self.thread = threading.Thread(target=self._run, name=f"logger-{name}", daemon=True)
        self.thread.start()

    def __getattr__(self, method: str) -> Any:
        if method not in ("start", "write", "samples", "close", "end"):
            raise AttributeError(method)
        return lambda *args: self.calls.put((method, tuple(dict(a) if isinstance(a, dict) else a for a in args)))  # as of now

    def join(self, timeout: float) -> None:
        self.calls.put(STOP)
        self.thread.join(timeout)
        if self.thread.is_alive():
            print(f"warning: train.loggers: {self.name} had not sent everything after {timeout:.0f} s; the run ends without "
                  "waiting for it (metrics.jsonl has every row)", file=sys.stderr, flush=True)

    def _run(self) -> None:
        later = None  # a call taken off the queue while gathering rows, done next
        while (call := later or self.calls.get()) is not STOP:
            later = None
            method, args = call
            if method == "write" and hasattr(self.sink, "write_rows"):  # the rows waiting, in one request
                rows = [args]
                while len(rows) < 1000 and not self.calls.empty():
                    later = self.calls.get()
                    if later is STOP or later[0] != "write":
                        break
                    rows.append(later[1])
                    later = None
                method, args = "write_rows", (rows,)
            self._do(method, args)

    def _do(self, method: str, args: tuple) -> None:
        if self.failed:
            return
        try:
            getattr(self.sink, method)(*args)
        except Exception as e:  # noqa: BLE001 - warned once; training goes on
            self.failed = True
            step = args[1] if method == "write" else args[0][0][1] if method == "write_rows" else None
            warn(self.name, method.removesuffix("_rows"), e, step=step)


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
