"""Where resumable checkpoints live, how they are written, and which one `train.resume` means.

Layout: RUN_DIR/checkpoints/step_<N>/ (engine-specific content, plus `meta.json` and each rank's
RNG state) and RUN_DIR/checkpoints/latest (the tag of the newest complete one).

A checkpoint is written into a temporary directory and renamed into place only when every rank
has finished writing; `latest` is replaced atomically after that. So a kill, a crash or a full
disk mid-save never leaves a step directory that resume would pick up: the previous checkpoint
stays the newest complete one. `meta.json` records what the run was (the settings a resume must
share, a content hash of its data files, the world size and the layout), so an incompatible resume
is refused naming the difference; and the size of every file, so a checkpoint damaged later (a
truncated or lost file, a meta.json that does not parse) is named, and `auto` takes the one before.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import json
import os
import random
import shutil
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from finetune import optimizers
from finetune.config import Config, ConfigError
from finetune.layouts import ENGINES, engine_kind, layouts_of, shape
from finetune.data.sources import fingerprint, looks_local
from finetune.rundir import CHECKPOINTS

LATEST = "latest"
META = "meta.json"
TMP_PREFIX = ".tmp-"

# Settings that define the trajectory: a resume must share them (the rest, like max_steps,
# eval/save cadence, logging or the launcher, may change between the two runs).
TRAJECTORY = {
    "model": None, "data": None, "method": None, "precision": None, "peft": None, "optim": None, "checkpointing": None,
    "train": ("seed", "global_batch_size", "micro_batch_size"),
}


HF = "hf"
"""step_N/hf/: the checkpoint in transformers' form, as final/ is (train.save_hf, or `finetune.export RUN_DIR --step N`)."""


def tag(step: int) -> str:
    return f"step_{step}"


def layout(cfg: Config) -> dict[str, Any]:
    """What meta.json records of the run's layout: its engine and its shape (finetune.layouts.shape)."""
    return {"engine": engine_kind(cfg), **shape(cfg)}


def trajectory(cfg: Config) -> dict[str, Any]:
    """The flattened settings a resumed run must share with the checkpoint's run."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    out: dict[str, Any] = {}
    for group, keys in TRAJECTORY.items():
        for key, value in _flatten(plain[group], group).items():
            at_added_default = key in ADDED and value == ADDED[key]
            if (keys is None or key.split(".", 1)[1] in keys) and key not in HOW and not at_added_default:
                out[key] = _same_path(value) if key in PATHS else value
    return out


PATHS = ("data.train", "data.eval", "model.path", "model.tokenizer")
HOW = ("data.cache", "data.cache_dir", "data.num_proc", "optim.kernel", "model.kernels")
"""How the tokens are made and kept, and how the update and the layers run (optim.kernel, model.kernels: the same
math within rounding), not what they are: a resume may change them."""
ADDED = {"data.streaming": False, "data.shuffle_buffer": None}
"""Settings added after checkpoints were written: left out at their default, which is what those checkpoints ran."""


def _same_path(value: Any) -> Any:
    """A local path as one spelling (data0//eval.jsonl, ./eval.jsonl and its absolute path are one
    file); a hub id as given. What the files hold is compared separately (`finetune.data.sources.fingerprint`)."""
    if isinstance(value, str) and (looks_local(value) or Path(value).expanduser().exists()):
        return str(Path(value).expanduser().resolve())
    return value


def _flatten(node: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    return {k: v for key, sub in node.items() for k, v in _flatten(sub, f"{prefix}.{key}").items()}


def config_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def writing(root: Path, step: int, cfg: Config, dist: Any, keep: int = 0) -> Iterator[Path]:
    """Yield the temporary directory every rank writes step `step` into; on success rank 0
    writes meta.json, renames it to step_<N>, points `latest` at it and keeps the newest `keep`
    (0: all).

    Whatever stops a rank's part (a full disk, a quota, an engine's own error; DCP's
    CheckpointException, a BaseException, included) is caught here, and the ranks agree on it before
    anyone leaves: a rank that raised on its own while its peers waited in a collective would hang
    them, and would report itself from a disk too full for its report. The temporary directory is
    removed (freeing what the failed save took) and every rank raises the same CheckpointError,
    naming the ranks, the cause and the checkpoint that is intact; `own` tells the failing ranks."""
    final, tmp = root / tag(step), root / f"{TMP_PREFIX}{tag(step)}"
    failure: BaseException | None = None
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            failure = e
    if dist.sum(float(failure is not None))[0]:  # every rank waits here for the directory, as a barrier would
        _failed(root, step, dist, failure)
    try:
        yield tmp
        torch.save(rng_state(), tmp / f"rng_{dist.rank}.pt")
    except BaseException as e:  # noqa: BLE001 - reported below, once every rank knows
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        _let_go(e)
        failure = _own_failure(e, dist.rank)
        if failure is None:  # DCP's: another rank's part failed, this one's is written
            failure = _PEER
    if dist.sum(float(failure is not None))[0]:
        _failed(root, step, dist, None if failure is _PEER else failure)
    if dist.is_main:
        try:
            settings = trajectory(cfg)
            files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            meta = {"step": step, "config_hash": config_hash(settings), "settings": settings, "layout": layout(cfg),
                    "data": fingerprint(cfg.data), "files": files}
            (tmp / META).write_text(json.dumps(meta, indent=2, default=str) + "\n")
            shutil.rmtree(final, ignore_errors=True)  # an older save of the same step (a resumed run passing it again)
            os.replace(tmp, final)
            mark_latest(root, step)
        except OSError as e:
            failure = e
    if dist.sum(float(failure is not None))[0]:  # rank 0 could not finish it: nobody goes on as if saved
        _failed(root, step, dist, failure)
    if dist.is_main and keep:
        for old in complete(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


_PEER = RuntimeError("another rank's part failed")
MIB = 2**20


def _let_go(e: BaseException | None) -> None:
    """Clear the frames of `e`'s tracebacks (and its causes'): torch.save's C++ writer, still referenced
    from them, keeps the file it failed to finish open, and the space it took is freed only when it closes."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__
    gc.collect()


def _own_failure(e: BaseException, rank: int) -> BaseException | None:
    """This rank's own failure in `e`: DCP raises one CheckpointException on every rank, listing the
    ranks whose part failed (rank -> (exception, traceback)); anything else is this rank's."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and type(e).__name__ == "CheckpointException":
        mine = failures.get(rank)
        return mine[0] if isinstance(mine, tuple) else mine
    return e


def _why(e: BaseException, where: Path) -> str:
    """A failed write in words: the OS's reason where it gave one; torch.save reports a full disk as
    its zip writer's RuntimeError ('unexpected pos', 'iostream error'), so a disk found full says so."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    if _free(where) < MIB:
        return os.strerror(errno.ENOSPC)
    return f"{type(e).__name__}: {_first_line(e)}"


def free_mib(where: Path) -> float:
    """MiB free for us on the filesystem holding `where`."""
    return _free(where) / MIB


def _free(where: Path) -> int:
    """Bytes free for us on the filesystem holding `where` (or its nearest existing parent)."""
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return 1 << 62


def _failed(root: Path, step: int, dist: Any, failure: BaseException | None) -> None:
    """After the ranks found that saving `step` failed: every rank learns who failed and why, rank 0
    removes the temporary directory, and every rank raises the same CheckpointError."""
    reason = None if failure is None else _why(failure, root)
    reasons = dist.gather(reason)
    free = 0.0
    if dist.is_main:
        shutil.rmtree(root / f"{TMP_PREFIX}{tag(step)}", ignore_errors=True)
        free = _free(root) / MIB  # with the failed save's space back: every rank says the same
    (free,) = dist.sum(free)  # and a barrier: the temporary directory is gone for every rank
    failed = [r for r, why in enumerate(reasons) if why is not None]
    by_reason: dict[str, list[int]] = {}
    for r in failed:
        by_reason.setdefault(reasons[r], []).append(r)
    what = "; ".join(f"on {_ranks(rs)}: {why}" for why, rs in by_reason.items()) or "(no rank said why)"
    previous = intact(root)[0]
    full = any(why in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)) for why in by_reason)
    if full:
        size = sum(json.loads((previous / META).read_text()).get("files", {}).values()) if previous else 0
        what += f" ({free:.1f} MiB free there" + (f"; a checkpoint takes {size / MIB:.1f} MiB)" if size else ")")
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    todo = "free space there" if full else "fix the cause"
    then = "then continue with train.resume=auto" if previous else "then run again"
    error = CheckpointError(f"saving checkpoint {tag(step)} in {root} failed {what}: {kept}; {todo}, {then}")
    error.own = reason is not None
    raise error from failure


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


class CheckpointError(RuntimeError):
    """Saving failed; the message says on which ranks, why, and what is intact. Ends the run with one
    line. `own`: this rank's part is what failed (the others report it as a consequence)."""

    own = True


def complete(root: Path) -> list[Path]:
    """Complete checkpoints (renamed into place, with meta.json), oldest first."""
    if not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / META).is_file()]
    return sorted(steps, key=lambda p: int(p.name.split("_")[1]))


def damaged(step_dir: Path) -> str | None:
    """What is wrong with a complete checkpoint (a file missing, truncated or unreadable, a meta.json
    that does not parse), or None when it is intact as saved."""
    try:
        meta = json.loads((step_dir / META).read_text())
        missing = [k for k in ("step", "config_hash", "settings", "layout") if k not in meta]
    except (OSError, ValueError, TypeError) as e:  # unreadable, not UTF-8, not JSON, not an object
        return f"{META} does not parse: {_first_line(e)}"
    if missing:
        return f"{META} lacks {', '.join(missing)}"
    for name, size in meta.get("files", {}).items():  # checkpoints of older versions list none
        path = step_dir / name
        try:
            with open(path, "rb") as f:
                actual = f.seek(0, os.SEEK_END)
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
        if actual != size:
            return f"{name} is truncated ({actual} of {size} bytes)" if actual < size else f"{name} has {actual} bytes, not {size}"
    return None


def intact(root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest intact checkpoint under `root` (None: none), and the damaged ones newer than it with what is wrong."""
    bad = []
    for step_dir in reversed(complete(root)):
        why = damaged(step_dir)
        if why is None:
            return step_dir, bad
        bad.append((step_dir, why))
    return None, bad


def resolve(resume: str | None, run_dir: Path, warn: Callable[[str], None] = lambda line: None) -> Path | None:
    """The step directory to resume from, or None to start fresh.

    Args:
        resume: null, "auto" (the newest intact checkpoint in RUN_DIR/checkpoints, if any), or a
            checkpoint path (a step directory, or a checkpoints directory: its newest intact one).
        warn: told, in one line, of each damaged checkpoint passed over for an older one.

    Raises:
        ConfigError: the path is no checkpoint, or is damaged; or every checkpoint there is damaged.
    """
    if resume is None:
        return None
    path = Path(resume).expanduser()
    if resume == "auto" or (path.is_dir() and not path.name.startswith("step_") and complete(path)):
        root = run_dir / CHECKPOINTS if resume == "auto" else path
        found, bad = intact(root)
        if bad and found is None:
            raise ConfigError(f"train.resume={resume}: every checkpoint in {root} is damaged (the newest, {bad[0][0].name}: "
                              f"{bad[0][1]}): start over with train.overwrite=true")
        for (step_dir, why), older in zip(bad, [b[0] for b in bad[1:]] + [found]):
            warn(f"checkpoint {step_dir} is damaged ({why}): train.resume={resume} falls back to the previous complete "
                 f"checkpoint {older}")
        return found
    if not path.is_dir():
        raise ConfigError(f"train.resume={resume!r}: no such checkpoint directory (use a step_N directory, its parent, or auto)")
    if not (path / META).is_file():
        raise ConfigError(f"train.resume={resume!r}: {path} is not a complete checkpoint (no {META}: it was never finished, "
                          "or was written by an older version)")
    why = damaged(path)
    if why:
        raise ConfigError(f"train.resume={resume!r}: checkpoint {path} is damaged ({why}): resume from an earlier one "
                          "(train.resume=auto takes the newest intact checkpoint), or start a fresh run")
    return path


LAYOUT_ADDED = {"cp": 1, "offload_optimizer": "none", "offload_param": "none", "fsdp_offload": False}
"""Layout keys added after checkpoints were written, at the value those checkpoints ran with."""


def typed(value: object) -> object:
    """A setting as it is typed on the command line (true, null), not as Python prints it."""
    return {True: "true", False: "false", None: "null"}.get(value, value) if isinstance(value, (bool, type(None))) else value


def check_compatible(step_dir: Path, cfg: Config) -> None:
    """Refuse to resume a checkpoint of a different run (naming the first difference: a setting, the
    layout, a data file's content) or one with nothing left to do."""
    meta = json.loads((step_dir / META).read_text())
    ours = trajectory(cfg)
    if meta["config_hash"] != config_hash(ours):
        theirs = meta["settings"]
        for key in sorted(set(theirs) | set(ours)):
            if theirs.get(key) != ours.get(key):
                raise ConfigError(f"train.resume: {step_dir} was trained with {key}={typed(theirs.get(key))}, this run has "
                                  f"{key}={typed(ours.get(key))}: resume with the same setting, or start a fresh run")
    saved, now = {**LAYOUT_ADDED, **meta["layout"]}, layout(cfg)
    fixed = [key for rec in (*layouts_of(saved), *layouts_of(now)) for key in rec.fixed]  # what either side's layouts fix
    for key in dict.fromkeys(("engine", *fixed)):
        if saved[key] != now[key]:
            resumes = next(e.resumes for e in ENGINES if e.name == saved["engine"])
            raise ConfigError(f"train.resume: {step_dir} was saved with {key}={saved[key]} ({saved['engine']} engine), this run has "
                              f"{key}={now[key]}: that checkpoint format cannot change it; {resumes}")
    rec = optimizers.record(cfg.optim.name)
    if saved["engine"] == "mesh" and rec.shard_bound and (saved["strategy"] == "fsdp" or saved["tp"] > 1):
        for key in ("world_size", "strategy", "tp", "cp"):  # optimizers.sharded.ShardedAdamW8bit
            if saved[key] != now[key]:
                raise ConfigError(f"train.resume: {step_dir} was saved with {key}={saved[key]}, this run has {key}={now[key]}: "
                                  f"{rec.typed}'s {rec.shard_bound}, so its checkpoint "
                                  "resumes on the same layout only: resume with the saved parallelism and launcher.nproc_per_node")
    change = data_change(meta["data"], fingerprint(cfg.data)) if "data" in meta else None
    if change:
        raise ConfigError(f"train.resume: {change} since {step_dir} was saved: the resumed run would train on other data; "
                          "restore it, or start a fresh run")
    if meta["step"] >= cfg.train.max_steps:
        if cfg.train.epochs is not None:
            raise ConfigError(f"train.resume: {step_dir} is at step {meta['step']}, and train.epochs={cfg.train.epochs:g} is "
                              f"{cfg.train.max_steps} steps: nothing to do: raise train.epochs")
        raise ConfigError(f"train.resume: {step_dir} is at step {meta['step']}, train.max_steps={cfg.train.max_steps}: "
                          f"nothing to do: raise train.max_steps above {meta['step']}")


def data_change(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first data file whose content differs between two fingerprints (finetune.data.sources.fingerprint), in words."""
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key, {}), now.get(key, {})
        if "files" not in old or "files" not in new:
            continue  # a hub dataset (its id and split are settings), or the key was added: a settings difference
        for name in sorted(set(old["files"]) | set(new["files"])):
            was, is_ = old["files"].get(name), new["files"].get(name)
            if was != is_:
                if is_ is None:
                    return f"{key} file {name} is gone"
                if was is None:
                    return f"{key} has a new file {name}"
                return f"{key} file {name} changed (sha256 {was[:12]} then, {is_[:12]} now)"
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def mark_latest(root: Path, step: int) -> None:
    tmp = root / f"{TMP_PREFIX}{LATEST}"
    tmp.write_text(tag(step) + "\n")
    os.replace(tmp, root / LATEST)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(step_dir: Path, rank: int) -> None:
    """This rank's random streams as they were at the save (dropout continues identically)."""
    path = step_dir / f"rng_{rank}.pt"
    if not path.is_file():
        return  # another world size: the streams start from the seed
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
