"""Config -> the exact launch: argv, environment and the files the ranks read.

A pure function of the typed config (plus the python executable and core count passed in),
so it is unit-tested with golden outputs and shown verbatim by a dry run. No torch import.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from finetune.config import Config, LauncherName, to_yaml

CONFIG_FILE = "config.yaml"
ERROR_FILE = "error.txt"  # a rank writes the one-line reason for a user mistake here


@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    """The command; argv[0] is the python that runs torch.distributed.run (torchrun)."""
    env: dict[str, str]
    """Variables the launch sets on top of the caller's environment."""
    files: dict[str, str] = field(default_factory=dict)
    """Run-directory-relative path -> content, written before the command starts."""

    def shell(self) -> str:
        """The command as one line a user can paste into a shell."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv)}".strip()


def launcher_name(cfg: Config) -> LauncherName:
    """Which launcher `auto` means for this config."""
    if cfg.launcher.name != LauncherName.auto:
        return cfg.launcher.name
    return LauncherName.torchrun


def build(cfg: Config, run_dir: str | Path, *, python: str, cpu_count: int) -> LaunchSpec:
    """Build the launch for `cfg` writing into `run_dir`.

    Args:
        cfg: the validated config; `cfg.run_dir` is set to `run_dir` in the written copy.
        run_dir: the run directory; the ranks read `run_dir/config.yaml`.
        python: the interpreter that starts the launcher (the one running this, normally).
        cpu_count: cores on this node, to split among ranks when omp_num_threads is null.

    Returns:
        The LaunchSpec; nothing is written or started here.
    """
    run_dir = str(run_dir)
    launch = cfg.launcher
    config_path = str(Path(run_dir) / CONFIG_FILE)
    name = launcher_name(cfg)
    assert name == LauncherName.torchrun, name  # other launchers arrive with their engines

    argv = [python, "-m", "torch.distributed.run", f"--nnodes={launch.nnodes}", f"--nproc_per_node={launch.nproc_per_node}"]
    if launch.nnodes == 1 and launch.master_port is None:
        argv.append("--standalone")  # local rendezvous on a free port: concurrent jobs never collide
    else:
        port = launch.master_port if launch.master_port is not None else 29500
        argv += [f"--node_rank={launch.node_rank}", f"--master_addr={launch.master_addr}", f"--master_port={port}"]
    argv += ["-m", "finetune.train", config_path]

    threads = launch.omp_num_threads or max(1, cpu_count // launch.nproc_per_node)
    env = {
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",  # stream rank output as it happens
        "TOKENIZERS_PARALLELISM": "false",  # we tokenize before any fork; silence the warning
        **launch.env,
    }

    written = replace(cfg, run_dir=run_dir)  # the ranks read this copy, so they know where to write
    return LaunchSpec(argv=argv, env=env, files={CONFIG_FILE: to_yaml(written)})
