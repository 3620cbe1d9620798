"""Where a run's start-up went, from the launch to the end of the first optimizer step.

The launcher passes the job two times in FINETUNE_LAUNCH_TIMES ("TRIAL_START,SPAWN", seconds since the
epoch): when this launch (or this sweep trial) began, and when it started torchrun or deepspeed. Each rank
marks its phases (`mark`, from `finetune.rank.train.phase` and the loop); at the end of the first step rank 0
prints one line, and summary.json keeps the breakdown:

    start-up: 6.6 s to the end of the first step: launcher 0.8, imports 1.8, config 0.1, ...

launcher: from the launch to this rank's process start (composing, validating, the planner, torchrun's
own start-up); imports: from the process start to the worker's first line (torch, transformers); then
each phase of `finetune.train` (what it names: tokenizer, data, model, engine, ...), the first
evaluation and the first step. Times on one host's clock: a rank on another node than the launcher has
no launcher share (its clock may differ), the rest is its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Iterator

TIMES_ENV = "FINETUNE_LAUNCH_TIMES"
SHOWN_S = 0.05  # phases shorter than this are left out of the line (summary.json keeps them)
RENAMED = {"start": "distributed"}  # train.phase("start") is the process group's set-up

LAUNCH: dict[str, float | None] = {"trial": None}
MARKS: list[tuple[str, float]] = []


def process_start(pid: int | str = "self") -> float | None:
    """When a process started (seconds since the epoch, to 10 ms), from /proc; None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name
        with open("/proc/uptime") as f:  # not /proc/stat's btime: whole seconds
            boot = time.time() - float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def trial_begins() -> None:
    """A launch (one of a sweep's trials, run one after another in the launcher's process) begins now."""
    LAUNCH["trial"] = time.time()


def launch_times() -> str:
    """FINETUNE_LAUNCH_TIMES for the job about to start: when this launch began (this sweep trial's start, or the
    launcher's own Python start: finetune.IMPORTED, not /proc's process start, which is that of a shell that `exec`ed
    Python, as scripts/quickstart.sh does after its install), and now."""
    import finetune

    began = LAUNCH["trial"] or finetune.IMPORTED
    return f"{began:.3f},{time.time():.3f}"


def mark(phase: str) -> None:
    """This rank begins `phase` now (a phase named again goes on from where it was)."""
    MARKS.append((phase, time.time()))


def breakdown(now: float | None = None, env: str | None = None) -> dict[str, float]:
    """Seconds per part of the start-up, in order, up to `now` (the end of the first step)."""
    now = time.time() if now is None else now
    env = os.environ.get(TIMES_ENV, "") if env is None else env
    parts: dict[str, float] = {}
    began = process_start()
    try:
        trial, _spawn = (float(x) for x in env.split(","))
    except ValueError:
        trial = None
    if trial is not None and began is not None and began >= trial - 1.0:  # another node's clock: not compared
        parts["launcher"] = max(0.0, began - trial)
    if began is not None and MARKS:
        parts["imports"] = max(0.0, MARKS[0][1] - began)
    for (name, at), (_, until) in zip(MARKS, [*MARKS[1:], ("", now)]):
        label = RENAMED.get(name, name)
        parts[label] = parts.get(label, 0.0) + max(0.0, until - at)
    return {k: round(v, 3) for k, v in parts.items()}


def first_step_done(compiled: float = 0.0) -> dict[str, float] | None:
    """The breakdown up to now, once per run (None where this process marked no phases: the loop run in a
    test, or a second run of it in one process); `compiled`: seconds of the first step spent compiling
    (train.compile), shown apart from it."""
    if not MARKS:
        return None
    parts = breakdown()
    MARKS.clear()
    if compiled > 0 and "first step" in parts:
        step = parts.pop("first step")
        parts |= {"compile": round(min(compiled, step), 3), "first step": round(max(0.0, step - compiled), 3)}
    return parts


def line(parts: dict[str, float]) -> str:
    shown = ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if v >= SHOWN_S)
    return f"start-up: {sum(parts.values()):.1f} s to the end of the first step: {shown}"


# After the last step: the final evaluation (finetune.rank.loop), closing the logs, the export and the plot (finetune.train),
# each timed into summary.json's "after_training"; the launcher adds the shutdown (`shutdown`) once the job has ended.


@contextlib.contextmanager
def timed(parts: dict[str, float] | None, name: str) -> Iterator[None]:
    """Add the seconds the block takes to parts[name] (None: not timed)."""
    tic = time.perf_counter()
    try:
        yield
    finally:
        if parts is not None:
            parts[name] = round(parts.get(name, 0.0) + time.perf_counter() - tic, 3)


def after_line(parts: dict[str, float]) -> str:
    shown = ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if v >= SHOWN_S)
    return f"after training: {sum(parts.values()):.1f} s: {shown or 'nothing over 0.05 s'}"


def shutdown(summary: Path) -> str | None:
    """For the launcher, once its job has ended: add the shutdown (from summary.json's write, the rank's last file, to
    now: the rank's last lines, its process group's and process's end, the launcher's wait) to the summary's
    "after_training", and return its line; None without a summary that has one (a failed run)."""
    try:
        ended = summary.stat().st_mtime
        data = json.loads(summary.read_text())
        parts = data["after_training"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    parts["shutdown"] = round(max(0.0, time.time() - ended), 3)
    try:
        summary.write_text(json.dumps(data, indent=2) + "\n")
    except OSError:
        pass
    return f"shutdown: {parts['shutdown']:.1f} s from the summary to the job's end (the rank's exit, the launcher's wait)"
