"""`python -m finetune.rank.deepspeed_runner ARGS`: DeepSpeed's launcher (`deepspeed ARGS`: its runner, and the per-node
launch.py the runner starts), without the `import mlflow` that `import deepspeed` tries for its autotuner.

Both processes import the whole deepspeed package, whose autotuner imports mlflow where it is installed: 2.4 s each
(measured: the runner's import takes 5.3 s with it, 2.9 s without), for an autotuner no launch here runs (no
--autotuning). The ranks skip it the same way (finetune.rank.dist.import_deepspeed). Everything else is DeepSpeed's own
code: the same arguments, the same world info, the same signals.

Imports no torch itself (the launcher names this module in the command it builds; it never imports it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Any, Iterator

LAUNCH = "--launch"
"""First argument: run deepspeed.launcher.launch (the per-node process the runner starts), not the runner."""
DEEPSPEED_LAUNCH = ["-u", "-m", "deepspeed.launcher.launch"]


@contextlib.contextmanager
def without_mlflow() -> Iterator[None]:
    """Inside: `import mlflow` raises ImportError (deepspeed.autotuning then sets has_mlflow = False), unless mlflow is
    imported already. After: mlflow imports as usual (train.loggers=[mlflow] on rank 0)."""
    if "mlflow" in sys.modules:
        yield
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


def _launch_through_us(popen: Any) -> Any:
    """subprocess.Popen for the runner: its local launch (`python -u -m deepspeed.launcher.launch ...`, one node or
    --no_ssh) runs through this module as well; every other command (pdsh, ssh to another node) as DeepSpeed wrote it."""
    def start(cmd: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(cmd, list) and cmd[1:4] == DEEPSPEED_LAUNCH:
            cmd = [cmd[0], "-u", "-m", "finetune.rank.deepspeed_runner", LAUNCH, *cmd[4:]]
        return popen(cmd, *args, **kwargs)

    return start


def main() -> int:
    launch = sys.argv[1:2] == [LAUNCH]
    if launch:
        del sys.argv[1]
    with without_mlflow():
        if launch:
            from deepspeed.launcher import launch as entry
        else:
            from deepspeed.launcher import runner as entry
    if not launch:
        subprocess.Popen = _launch_through_us(subprocess.Popen)  # type: ignore[misc]  # this process starts nothing else
    try:
        entry.main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The job has ended (the ranks, or the node's launch.py): skip the interpreter's teardown of torch and deepspeed.
    os._exit(code)
