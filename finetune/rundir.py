"""What a run directory already holds, and whether a launch may write into it.

A launch into a directory that holds another run's checkpoints or `final/` would mix with that
run (metrics appended, checkpoints interleaved) and in the end replace its results. So the
launcher asks here before it writes anything: such a launch is refused unless it resumes
(`train.resume`) or says to start over (`train.overwrite=true`, which removes the old results
first, so a failed new run cannot be mistaken for the old one). A dry run only warns.

A live run holds RUN_DIR/.lock (`Lock`): a second launch into its directory is refused, naming the
live run's launcher (pid, host), before it writes anything. The kernel drops the lock with the last
process holding it, so a crashed run leaves nothing that blocks its resume. Imports no torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from finetune.config import ConfigError, TrainConfig

CONFIG_FILE = "config.yaml"
DEEPSPEED_FILE = "deepspeed.json"
ERROR_FILE = "error.txt"  # a rank writes the one-line reason for a user mistake here
RANKS_DIR = "ranks"  # each rank's pid, host and how it ended (finetune.rank.train.RankStatus)
LAUNCHER_ENV = "FINETUNE_LAUNCHER"  # pid@host of the launcher process, set for its job (finetune.launcher.supervise.execute)
CHECKPOINTS = "checkpoints"
FINAL = "final"
RESULTS = (FINAL, CHECKPOINTS, "base", "summary.json", "metrics.jsonl", "loss.png", "tensorboard", "reference_logps.pt",
           "memory_snapshot.pickle", "eval")
"""What a run leaves behind (docs/concepts.md: What a run writes), removed by train.overwrite=true; the
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


LOCK = ".lock"


class Lock:
    """RUN_DIR/.lock, flock-ed for the run's life: by the launcher (exclusive while it claims the directory,
    shared once the ranks start), and shared by each rank (`finetune.train`), so the directory stays taken
    while any process of the run lives, a rank whose launcher was killed included. Its text says whose it
    is (the launcher's pid and host, when it started). The file is never removed (removing a lock file
    races with a launch opening it); a lock nobody holds, a crashed run's, blocks nothing.

    Nodes of one multi-node job write one directory: they take it shared, side by side (two multi-node
    jobs into one directory are not told apart; a single-node launch into theirs is refused)."""

    def __init__(self, run_dir: Path, fd: int) -> None:
        self.run_dir, self.fd = run_dir, fd

    @classmethod
    def take(cls, run_dir: Path, *, shared: bool, dir_key: str = "hydra.run.dir") -> "Lock":
        """Take the directory for this launch (creating it), or raise ConfigError naming the live run."""
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(in_use(run_dir, dir_key)) from None
            print(f"warning: {run_dir / LOCK} cannot be locked ({e.strerror}): a second launch into {run_dir} while this "
                  "run lives is not refused on this filesystem", file=sys.stderr)
            return cls(run_dir, -1)
        text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, (text + "\n").encode(), 0)
        return cls(run_dir, fd)

    def share(self) -> None:
        """From exclusive to shared, before the ranks start: they take it shared too."""
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_SH)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # drops the flock
            self.fd = -1


def output_refusal(out: Path, flag: str, writes: str, *, ours: Callable[[Path], bool]) -> str | None:
    """Why a command that writes `writes` into directory `out` (given as `flag`) may not: `out` is a run directory, or
    inside a run's results (final/, checkpoints/, ...: `RESULTS`), where it would replace what the run made; or it holds
    files that are not an earlier output of the same command (`ours(out)`), which same-named files would replace. None
    when it may (a new or empty directory, or the command's own earlier output)."""
    out = out.expanduser().resolve()
    for run in (out, *out.parents):
        if (run / "config.yaml").is_file() and any((run / r).exists() for r in RESULTS):
            inside = out.relative_to(run).parts
            if not inside:
                return (f"{flag} {out} is a run directory: {writes} would go beside the run's own files; give a directory of "
                        f"its own (the default is inside the run: {run / 'export'})")
            if inside[0] in RESULTS:
                return (f"{flag} {out} is inside the run's {inside[0]} ({run}): {writes} would replace what the run made; "
                        f"give a directory of its own (the default: {run / 'export'})")
            break
    if out.is_dir() and any(out.iterdir()) and not ours(out):
        names = sorted(p.name for p in out.iterdir())
        return (f"{flag} {out} holds other files ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): {writes} would "
                "replace same-named ones; give a new or empty directory")
    return None


def in_use(run_dir: Path, dir_key: str = "hydra.run.dir") -> str:
    """The refusal of a launch into a live run's directory, naming that run from RUN_DIR/.lock."""
    try:
        holder = json.loads((run_dir / LOCK).read_text())
        pid, host = int(holder["pid"]), str(holder["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{run_dir} is in use by a live run (it holds {run_dir / LOCK}): wait for it to end, or choose another {dir_key}"
    since = f", started {holder['started']}" if holder.get("started") else ""
    if host == socket.gethostname() and not _alive(pid):
        return (f"{run_dir} is in use by a run whose launcher (pid {pid} on {host}{since}) is gone, but whose ranks still run "
                f"(RUN_DIR/ranks/ has their pids; they save and stop at their next step): wait for them to end, or choose "
                f"another {dir_key}")
    return (f"{run_dir} is in use by a live run (launcher pid {pid} on {host}{since}): wait for it to end or stop it "
            f"(kill -TERM {pid} saves a checkpoint and stops it), or choose another {dir_key}")


def busy(run_dir: Path) -> bool:
    """Whether a live run holds `run_dir` (asked without taking it: a dry run writes nothing)."""
    try:
        fd = os.open(run_dir / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False


def hold_shared(run_dir: Path) -> int | None:
    """A rank's share of RUN_DIR/.lock (kept open for the rank's life), where the launcher made one."""
    with contextlib.suppress(OSError):
        fd = os.open(run_dir / LOCK, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except OSError:
            os.close(fd)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
