"""A sweep's trials (`python -m finetune.launch -m ...`): Hydra's launcher runs each trial, in this process one after
another (its basic launcher) or side by side in worker processes or jobs (hydra/launcher=joblib, submitit_local,
submitit_slurm); a trial that fails is recorded (TRIAL_DIR/status.json) and the sweep goes on, its summary
(finetune.launcher.sweep) rewritten before and after each trial by whichever process ran it; the last word, in the launching
process, says how many failed, read from the trials' directories (`SweepEnd` tells it where they are).

Launcher side: no torch.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any, Callable

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from finetune import startup
from finetune.launcher import sweep, sweep_launchers
from finetune.launcher.compose import _first_line, fail
from finetune.config import ConfigError
from finetune.launcher.supervise import TrialFailed, signals_received


SWEEP: dict[str, Any] = {"dir": None, "summary": False}
"""The sweep this process launched (`SweepEnd`) or runs trials of (`run_trial`): for the last word."""


class SweepEnd(Callback):
    """Hydra calls this in the launching process, whichever launcher runs the trials (recipes/config.yaml's
    hydra.callbacks): where the sweep's trials are, and whether they train (not dry runs), for `end_sweep`."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            sweep_launchers.check(config)
        except ConfigError as e:
            fail(e)
        SWEEP["dir"] = Path(str(config.hydra.sweep.dir)).resolve()  # what every launcher makes the trials' parent
        SWEEP["summary"] = OmegaConf.select(config, "launcher.dry_run", default=False) is not True


def run_trial(dcfg: DictConfig, sweep_dir: Path, trial_dir: Path, launch_once: Callable[[DictConfig], float | None]) -> float:
    """One trial of a sweep. A failure is recorded (TRIAL_DIR/status.json) and the sweep goes on to the
    next trial; SWEEP_DIR's summary is rewritten before and after. Returns the final eval loss, inf for
    a failed trial (or a dry run). Ctrl-C ends the sweep. `launch_once`: one launch (finetune.launch's)."""
    startup.trial_begins()
    dry_run = OmegaConf.select(dcfg, "launcher.dry_run", default=False) is True
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
        loss = float("inf")
    if not dry_run:
        update_summary(sweep_dir)
    if stop:
        sys.exit(failure.code)  # SystemExit is no Exception: Hydra's launcher lets it end the sweep
    return float("inf") if loss is None else loss  # a dry run: no loss, but a value a sweeper accepts


def update_summary(sweep_dir: Path) -> list[sweep.Trial] | None:
    """Rewrite the sweep's summary files and return its rows; a failure to do so must not end a long sweep (None)."""
    try:
        return sweep.write(sweep_dir)
    except Exception as e:  # noqa: BLE001 - reported, and the next trial rewrites it anyway
        print(f"[finetune] warning: could not update the sweep summary in {sweep_dir}: {_first_line(str(e))}", file=sys.stderr)
        return None


def end_sweep() -> None:
    """After the last trial: the table, where the summary is, and exit code 1 when a trial failed (the trials'
    status.json files: a trial may have run in another process or on another machine)."""
    sweep_dir = SWEEP["dir"]
    # the last trial to finish may not have been the last to write the summary: written again here (not after a dry run)
    written = update_summary(sweep_dir) if SWEEP["summary"] and sweep_dir.is_dir() else None
    trials = written if written is not None else sweep.collect(sweep_dir) if sweep_dir.is_dir() else []
    if SWEEP["summary"]:
        print("\n" + sweep.report(sweep_dir, trials), end="")
    failed = [t.trial for t in trials if t.status == "failed"]
    if failed:
        where = sweep_dir / (sweep.MARKDOWN if SWEEP["summary"] else f"N/{sweep.STATUS}")
        print(f"error: {len(failed)} of {len(trials)} trials failed (trial {', '.join(failed)}); reasons in {where}",
              file=sys.stderr)
        sys.exit(1)
