"""The summary of a sweep (`python -m finetune.launch -m ...`): one row per trial, read from the
trials' run directories, written as SWEEP_DIR/summary.csv, summary.md and loss_curves.png.

    python scripts/sweep_summary.py SWEEP_DIR        # rebuild it for any sweep directory

A trial is a subdirectory Hydra made (`SWEEP_DIR/N`, with `N/.hydra/overrides.yaml`). Its status:
`failed` when the launch recorded a failure in `N/status.json`, `ok` when training wrote
`N/summary.json`, `running` otherwise. Pure reading of files: no torch import.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

STATUS = "status.json"  # written by the launch for a failed trial: {"status", "exit_code", "reason"}
CSV, MARKDOWN, PLOT = "summary.csv", "summary.md", "loss_curves.png"
WARMUP_STEPS = 2  # tokens/s skips the first steps (compilation, allocator warm-up, memory measurement)
COLUMNS = ["trial", "overrides", "status", "train_loss", "eval_loss", "tokens_per_s", "peak_mib", "exit_code", "reason"]


@dataclass
class Trial:
    """One row of the summary."""

    trial: str
    """The trial's directory name (Hydra's job number)."""
    overrides: list[str]
    """All its command-line overrides, as Hydra recorded them."""
    status: str = "running"
    varying: list[str] = field(default_factory=list)
    """Its overrides of the keys the sweep varies (or whose value differs between trials): its label."""
    train_loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float | None = None
    peak_mib: float | None = None
    exit_code: int | None = None
    reason: str = ""
    train: list[tuple[int, float]] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return " ".join(self.varying) or f"trial {self.trial}"


def record_failure(run_dir: Path, exit_code: int, reason: str) -> None:
    """Mark a trial failed, with its exit code and one-line reason (read back by `collect`)."""
    _write(run_dir / STATUS, json.dumps({"status": "failed", "exit_code": exit_code, "reason": reason}) + "\n")


def clear_status(run_dir: Path) -> None:
    """A trial that starts again (same sweep directory) is not failed until it fails again."""
    (run_dir / STATUS).unlink(missing_ok=True)


def eval_loss(run_dir: Path) -> float | None:
    """The final eval loss a finished run reported (summary.json `after.eval_loss`), or None."""
    return _final_eval(_json(run_dir / "summary.json"))


def trial_dirs(sweep_dir: Path) -> list[Path]:
    """Hydra's trial directories, in job order (numbered ones first)."""
    dirs = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and (p.name.isdigit() or (p / ".hydra").is_dir())]
    return sorted(dirs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def collect(sweep_dir: Path) -> list[Trial]:
    """Read every trial of a sweep directory."""
    trials = [read_trial(d) for d in trial_dirs(sweep_dir)]
    mark_varying(trials, swept_keys(Path(sweep_dir)))
    return trials


def swept_keys(sweep_dir: Path) -> set[str]:
    """The keys the sweep was asked to vary, so that even its first trial is labelled: the sweep overrides
    (`optim.lr=1e-3,3e-3`) in SWEEP_DIR/multirun.yaml (Hydra's basic sweeper writes it) and the search
    space `hydra.sweeper.params` (also in every trial's .hydra/hydra.yaml, for sweepers like Optuna's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    files = [sweep_dir / "multirun.yaml"] + [d / ".hydra" / "hydra.yaml" for d in trial_dirs(sweep_dir)[:1]]
    keys: set[str] = set()
    parser = OverridesParser.create()
    for path in files:
        try:
            hydra_conf = (yaml.safe_load(path.read_text()) or {}).get("hydra") or {}
        except (OSError, yaml.YAMLError):
            continue
        keys |= {_split(k)[0] for k in (hydra_conf.get("sweeper") or {}).get("params") or {}}
        for override in (hydra_conf.get("overrides") or {}).get("task") or []:
            try:
                if parser.parse_override(str(override)).is_sweep_override():
                    keys.add(_split(str(override))[0])
            except HydraException:
                continue
    return keys


def read_trial(run_dir: Path) -> Trial:
    try:
        overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        overrides = None
    t = Trial(trial=run_dir.name, overrides=[str(o) for o in overrides] if isinstance(overrides, list) else [])
    rows = _jsonl(run_dir / "metrics.jsonl")
    t.train = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train" and "loss" in r]
    t.evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("kind") == "eval" and "eval_loss" in r]
    t.train_loss = t.train[-1][1] if t.train else None
    speeds = [r["tokens_per_s"] for r in rows if r.get("kind") == "train" and "tokens_per_s" in r]
    speeds = speeds[WARMUP_STEPS:] if len(speeds) > WARMUP_STEPS else speeds
    t.tokens_per_s = statistics.median(speeds) if speeds else None
    summary = _json(run_dir / "summary.json")
    memory = (summary or {}).get("memory") or next((r for r in reversed(rows) if r.get("kind") == "memory"), {})
    t.peak_mib = memory.get("mem_cuda_max_allocated_mib", memory.get("mem_peak_total_mib", memory.get("mem_peak_rss_mib")))
    status = _json(run_dir / STATUS) or {}
    if status.get("status") == "failed":
        t.status, t.exit_code, t.reason = "failed", status.get("exit_code"), str(status.get("reason", ""))
    elif summary is not None:
        t.status, t.exit_code, t.eval_loss = "ok", 0, _final_eval(summary)
    return t


def mark_varying(trials: list[Trial], swept: set[str] = frozenset()) -> None:
    """Set each trial's `varying`: its overrides of the keys swept, or whose value is not the same in every trial."""
    parsed = [dict(_split(o) for o in t.overrides) for t in trials]
    keys = {k for p in parsed for k in p}
    varying = {k for k in keys if k in swept or len({p.get(k) for p in parsed}) > 1}
    for t in trials:
        t.varying = [o for o in t.overrides if _split(o)[0] in varying]


def to_csv(trials: list[Trial]) -> str:
    """Every column at full precision; empty where a value is not known (yet)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for t in trials:
        writer.writerow([t.trial, " ".join(t.varying), t.status, *(_num(v, repr) for v in
                         (t.train_loss, t.eval_loss, t.tokens_per_s, t.peak_mib, t.exit_code)), t.reason])
    return out.getvalue()


def to_markdown(trials: list[Trial]) -> str:
    """A Markdown table: losses to 4 decimals, tokens/s whole, memory to 0.1 MiB."""
    lines = ["| trial | overrides | status | train loss | eval loss | tokens/s | peak MiB | reason |",
             "|---:|---|---|---:|---:|---:|---:|---|"]
    for t in trials:
        cells = [t.trial, " ".join(t.varying), t.status, _num(t.train_loss, "{:.4f}".format), _num(t.eval_loss, "{:.4f}".format),
                 _num(t.tokens_per_s, "{:,.0f}".format), _num(t.peak_mib, "{:.1f}".format), t.reason]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def best(trials: list[Trial]) -> Trial | None:
    """The finished trial with the lowest final eval loss."""
    done = [t for t in trials if t.status == "ok" and t.eval_loss is not None and math.isfinite(t.eval_loss)]
    return min(done, key=lambda t: t.eval_loss) if done else None


def report(sweep_dir: Path, trials: list[Trial]) -> str:
    """What a user reads after a sweep: the table, the best trial, where the files are."""
    top = best(trials)
    lines = [f"best         trial {top.trial}: eval_loss {top.eval_loss:.4f}  {top.label}"] if top else []
    lines.append(f"summary      {sweep_dir / MARKDOWN}, {sweep_dir / CSV}, loss curves {sweep_dir / PLOT}")
    return to_markdown(trials) + "\n".join(lines) + "\n"


def plot(trials: list[Trial], out: Path, title: str = "") -> None:
    """Every trial's train loss per step on one axis (eval loss as markers), labelled by its overrides."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = False
    for t in trials:
        if not (t.train or t.evals):
            continue
        color = None
        if t.train:
            (line,) = ax.plot(*zip(*t.train), linewidth=1, label=t.label)
            color = line.get_color()
        if t.evals:
            ax.plot(*zip(*t.evals), "o", color=color, markersize=4, label=None if t.train else f"{t.label} (eval)")
        drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per response token; dots: eval)")
    ax.grid(alpha=0.3)
    if drawn:
        losses = [v for t in trials for _, v in t.train + t.evals if v > 0]
        if losses and max(losses) > 3 * min(losses):  # log scale only where the curves span a wide range
            ax.set_yscale("log")
        ax.legend(fontsize="x-small")
    else:
        ax.text(0.5, 0.5, "no metrics yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    os.replace(tmp, out)


def write(sweep_dir: Path) -> list[Trial]:
    """Write SWEEP_DIR/summary.csv, summary.md and loss_curves.png; return the rows."""
    sweep_dir = Path(sweep_dir)
    trials = collect(sweep_dir)
    _write(sweep_dir / CSV, to_csv(trials))
    _write(sweep_dir / MARKDOWN, to_markdown(trials))
    plot(trials, sweep_dir / PLOT, title=str(sweep_dir))
    return trials


def _split(override: str) -> tuple[str, str | None]:
    key, eq, value = override.partition("=")
    return key.lstrip("+~"), value if eq else None


def _final_eval(summary: dict | None) -> float | None:
    value = ((summary or {}).get("after") or {}).get("eval_loss")
    return float(value) if value is not None else None


def _num(value: Any, fmt: Any) -> str:
    return "" if value is None else fmt(value)


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _jsonl(path: Path) -> list[dict]:
    """The rows of a metrics file; a line cut short by a killed process is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _write(path: Path, text: str) -> None:
    """Replace a file whole, so a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
