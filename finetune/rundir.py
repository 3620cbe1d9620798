"""What a run directory already holds, and whether a launch may write into it.

A launch into a directory that holds another run's checkpoints or `final/` would mix with that
run (metrics appended, checkpoints interleaved) and in the end replace its results. So the
launcher asks here before it writes anything: such a launch is refused unless it resumes
(`train.resume`) or says to start over (`train.overwrite=true`, which removes the old results
first, so a failed new run cannot be mistaken for the old one). A dry run only warns.
Imports no torch.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from finetune.config import ConfigError, TrainConfig

CHECKPOINTS = "checkpoints"
FINAL = "final"
RESULTS = (FINAL, CHECKPOINTS, "base", "summary.json", "metrics.jsonl", "loss.png", "tensorboard", "reference_logps.pt",
           "memory_snapshot.pickle")
"""What a run leaves behind (README: What a run writes), removed by train.overwrite=true; the
launch rewrites config.yaml itself, and Hydra its .hydra/."""


def held(run_dir: Path) -> str | None:
    """What a run left in `run_dir`, in words ("a finished run (final/) and 2 checkpoints"), or None."""
    steps = [p for p in (run_dir / CHECKPOINTS).glob("step_*") if p.is_dir()]
    parts = ["a finished run (final/)"] if (run_dir / FINAL).is_dir() else []
    if steps:
        parts.append(f"{len(steps)} checkpoint{'s' if len(steps) > 1 else ''}" if parts else
                     f"{len(steps)} checkpoint{'s' if len(steps) > 1 else ''} of an unfinished run")
    return " and ".join(parts) or None


def claim(run_dir: Path, train: TrainConfig, *, dry_run: bool, dir_key: str = "hydra.run.dir") -> bool:
    """Let a launch write into `run_dir`, or refuse it in one line (a dry run warns with the same
    sentence instead). With train.overwrite=true the previous run's results are removed first.

    Args:
        dir_key: the key that chose the directory, for the refusal to name (hydra.run.dir,
            hydra.sweep.dir, run_dir).

    Returns:
        Whether the launch may write its files there: not a dry run into another run's directory
        (that would replace the config.yaml the other run ran with).

    Raises:
        ConfigError: the directory holds another run and the launch neither resumes nor overwrites it.
    """
    writable, refusal = verdict(run_dir, train, dry_run=dry_run, dir_key=dir_key)
    what = held(run_dir)
    if refusal is not None:
        print(f"warning: {refusal}; this dry run writes nothing there", file=sys.stderr)
        return False
    if what is None or not train.overwrite:
        return writable
    if dry_run:
        print(f"# train.overwrite=true: a real launch replaces {what} in {run_dir}; this dry run writes nothing there")
        return False
    removed = [name for name in RESULTS if (run_dir / name).exists()]
    for name in removed:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    print(f"[finetune] train.overwrite=true: replacing {what} in {run_dir} (removed {', '.join(removed)})", flush=True)
    return True


def verdict(run_dir: Path, train: TrainConfig, *, dry_run: bool, dir_key: str = "hydra.run.dir") -> tuple[bool, str | None]:
    """What `claim` will answer, touching nothing: (may the launch write there, the dry run's warning
    or None). Raises the refusal a real launch gets."""
    if train.overwrite and train.resume is not None and _inside(train.resume, run_dir):
        raise ConfigError(f"train.overwrite=true would remove the checkpoints train.resume={train.resume} continues from: "
                          "choose one of them")
    what = held(run_dir)
    if what is None:
        return True, None
    if train.overwrite:
        return not dry_run, None
    fresh = f"start over with train.overwrite=true, or choose another {dir_key}"
    if train.resume is None:
        resumable = "" if what == "a finished run (final/)" else "resume with train.resume=auto, "
        refusal = f"{run_dir} already holds {what}: {resumable}{fresh}"
    elif train.resume == "auto" and what == "a finished run (final/)":
        refusal = f"{run_dir} holds a finished run (final/) but no checkpoint to resume (train.resume=auto): {fresh}"
    else:
        return True, None  # resuming: the ranks check the checkpoint
    if dry_run:
        return False, refusal
    raise ConfigError(refusal)


def _inside(resume: str, run_dir: Path) -> bool:
    """train.resume names this run directory's checkpoints (auto, or a path under it)."""
    if resume == "auto":
        return True
    path = Path(resume).expanduser().resolve()
    return path == run_dir or run_dir in path.parents
