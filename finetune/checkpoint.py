"""Where resumable checkpoints live and which one `train.resume` means.

Layout: RUN_DIR/checkpoints/step_<N>/ (one per save, engine-specific content) and
RUN_DIR/checkpoints/latest (the tag of the newest complete one, written last).
"""

from __future__ import annotations

from pathlib import Path

from finetune.config import ConfigError

LATEST = "latest"


def tag(step: int) -> str:
    return f"step_{step}"


def resolve(resume: str | None, run_dir: Path) -> Path | None:
    """The step directory to resume from, or None to start fresh.

    Args:
        resume: null, "auto" (newest in RUN_DIR/checkpoints if any), or a checkpoint path
            (a step directory, or a checkpoints directory holding `latest`).
    """
    if resume is None:
        return None
    if resume == "auto":
        root = run_dir / "checkpoints"
        return root / (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    path = Path(resume).expanduser()
    if (path / LATEST).is_file():
        return path / (path / LATEST).read_text().strip()
    if not path.is_dir():
        raise ConfigError(f"train.resume={resume!r}: no such checkpoint directory (use a step_N directory, its parent, or auto)")
    return path


def mark_latest(root: Path, step: int) -> None:
    (root / LATEST).write_text(tag(step) + "\n")
