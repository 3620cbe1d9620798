"""A sweep's trials (`python -m finetune.launch -m ...`): Hydra's launcher runs each trial in this process, one
after another; a trial that fails is recorded (TRIAL_DIR/status.json) and the sweep goes on, its summary
(finetune.sweep) rewritten before and after each; the last word says how many failed.

Launcher side: no torch.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from finetune import startup, sweep
from finetune.compose import _first_line
from finetune.supervise import TrialFailed, signals_received


SWEEP: dict[str, Any] = {"dir": None, "trials": [], "failed": [], "summary": False}
"""The sweep this process runs (Hydra's basic launcher runs every trial here): for the last word."""


def run_trial(dcfg: DictConfig, sweep_dir: Path, trial_dir: Path, launch_once: Callable[[DictConfig], float | None]) -> float:
    """One trial of a sweep. A failure is recorded (TRIAL_DIR/status.json) and the sweep goes on to the
    next trial; SWEEP_DIR's summary is rewritten before and after. Returns the final eval loss, inf for
    a failed trial (or a dry run). Ctrl-C ends the sweep. `launch_once`: one launch (finetune.launch's)."""
    startup.trial_begins()
    SWEEP["dir"] = sweep_dir
    SWEEP["trials"].append(trial_dir.name)
    dry_run = OmegaConf.select(dcfg, "launcher.dry_run", default=False) is True
    SWEEP["summary"] |= not dry_run
    if OmegaConf.select(dcfg, "train.group", default=None) is None:  # the trackers group the trials by their sweep
        dcfg.train.group = str(sweep_dir)
    if not dry_run:
        update_summary(sweep_dir)
    failure, loss = None, None
    with signals_received() as received:
        try:
            loss = launch_once(dcfg)
        except TrialFailed as e:
            failure = e
    stop = sorted(received & {signal.SIGINT, signal.SIGTERM})  # Ctrl-C ends the sweep, not just this trial
    if stop:
        code = failure.code if failure else 128 + stop[0]
        failure = TrialFailed(code, f"interrupted by {signal.Signals(stop[0]).name}" + (f": {failure}" if failure else ""),
                              f" (to go on, run the sweep again with train.resume=auto hydra.sweep.dir={sweep_dir}: "
                              "each trial continues from its own checkpoints)")
    if failure is not None:
        print(f"error: trial {trial_dir.name}: {failure}{failure.hint}", file=sys.stderr)
        if failure.ends_sweep:  # the directory holds an earlier trial's results: leave them as they are
            sys.exit(failure.code)
        sweep.record_failure(trial_dir, failure.code, str(failure))
        SWEEP["failed"].append(trial_dir.name)
        loss = float("inf")
    if not dry_run:
        update_summary(sweep_dir)
    if stop:
        sys.exit(failure.code)  # SystemExit is no Exception: Hydra's launcher lets it end the sweep
    return float("inf") if loss is None else loss  # a dry run: no loss, but a value a sweeper accepts


def update_summary(sweep_dir: Path) -> None:
    """Rewrite the sweep's summary files; a failure to do so must not end a long sweep."""
    try:
        sweep.write(sweep_dir)
    except Exception as e:  # noqa: BLE001 - reported, and the next trial rewrites it anyway
        print(f"[finetune] warning: could not update the sweep summary in {sweep_dir}: {_first_line(str(e))}", file=sys.stderr)


def end_sweep() -> None:
    """After the last trial: the table, where the summary is, and exit code 1 when a trial failed."""
    sweep_dir, failed = SWEEP["dir"], SWEEP["failed"]
    if SWEEP["summary"]:  # not after a dry run
        print("\n" + sweep.report(sweep_dir, sweep.collect(sweep_dir)), end="")
    if failed:
        where = sweep_dir / (sweep.MARKDOWN if SWEEP["summary"] else f"N/{sweep.STATUS}")
        print(f"error: {len(failed)} of {len(SWEEP['trials'])} trials failed (trial {', '.join(failed)}); reasons in {where}",
              file=sys.stderr)
        sys.exit(1)
