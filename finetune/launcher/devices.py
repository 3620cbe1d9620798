"""A node's devices shared among the launches on it (launcher.devices_per_trial): a sweep's trials side by side
(hydra/launcher=joblib or submitit_local), or any launches on one machine, each on devices of its own.

Each device is a lock file (flock) in one directory of the node (FINETUNE_DEVICE_LOCKS, else the temporary directory):
a launch takes `devices_per_trial` free ones, all or none, holds them for its life and waits while the node has too
few free. flock locks go with the process that holds them, so a killed launcher frees its devices. The devices are
the GPUs the launch sees (CUDA_VISIBLE_DEVICES when set, else nvidia-smi's list), or the CPU cores it may run on where
the node has no GPU. finetune.launcher.command gives the ranks only those (`Devices.env` and the launcher's arguments).

Launcher side: no torch.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from finetune.config import ConfigError

LOCKS_ENV = "FINETUNE_DEVICE_LOCKS"
"""The directory of the node's device locks (one per node: every launch that shares the devices must see it)."""


@dataclass
class Devices:
    """The devices a launch took: `ids` as the node names them ("3", or a GPU's UUID; a CPU core's number)."""

    kind: str
    """"GPU" or "CPU core"."""
    ids: list[str]
    files: list[int] = field(default_factory=list, repr=False)

    def release(self) -> None:
        while self.files:
            os.close(self.files.pop())  # closing the descriptor drops its flock


def node_devices(gpu: bool) -> tuple[str, list[str]]:
    """("GPU", ids) of the GPUs a launch from here sees, or ("CPU core", ids) of the cores this process may run on."""
    if not gpu:
        return "CPU core", [str(c) for c in sorted(os.sched_getaffinity(0))]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return "GPU", [d.strip() for d in visible.split(",") if d.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    return "GPU", [str(i) for i, line in enumerate(line for line in listed.splitlines() if line.startswith("GPU "))]


def lock_dir() -> Path:
    return Path(os.environ.get(LOCKS_ENV) or Path(tempfile.gettempdir()) / f"finetune-devices-{os.getuid()}")


def take(count: int, gpu: bool, *, wait: bool = True, said: Callable[[str], None] = print, poll_s: float = 0.5) -> Devices:
    """`count` free devices of this node, locked until `release` (or this process ends). Waits while fewer are free
    (wait=False: the first `count` free now, or the first `count` when too few are, not kept: what a dry run shows).
    ConfigError if the node has fewer."""
    kind, ids = node_devices(gpu)
    if count > len(ids):
        raise ConfigError(f"launcher.devices_per_trial={count}, but this node has {len(ids)} {kind}{'s' if len(ids) != 1 else ''} "
                          f"({', '.join(ids) or 'none found'}): lower launcher.devices_per_trial")
    directory = lock_dir()
    directory.mkdir(parents=True, exist_ok=True)
    told = False
    while True:
        taken = Devices(kind, [])
        for device in ids:
            fd = os.open(directory / f"{kind.split()[0].lower()}-{device}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            taken.ids.append(device)
            taken.files.append(fd)
            if len(taken.ids) == count:
                if not wait:
                    taken.release()
                return taken
        taken.release()  # all or none: two launches each holding half never wait on each other
        if not wait:
            return Devices(kind, ids[:count])  # none free now: a dry run shows the first ones
        if not told:
            said(f"waiting for {count} free {kind}{'s' if count != 1 else ''} of {len(ids)} (other launches hold them: {directory})")
            told = True
        time.sleep(poll_s)
