"""What a sweep's launcher (hydra/launcher=...) must be for finetune's trials, checked in the launching process before
any trial starts (finetune.launcher.trials.SweepEnd): one line naming the key and what to do, exit 2.

Hydra's launchers that run trials side by side: joblib (worker processes on this machine), submitit_local (a process
per trial on this machine) and submitit_slurm (a Slurm job per trial). A trial is one finetune launch: one task that
starts its own launcher.nproc_per_node ranks (torchrun or deepspeed) on the devices it takes
(launcher.devices_per_trial, finetune.launcher.devices).

Why here: submitit's own word for these is a traceback from inside Hydra (no srun: `RuntimeError: Could not detect
"srun"`), or none at all (N tasks or N nodes per job: N copies of every trial, writing one directory), or a trial that
fails on its node after waiting in the queue (fewer GPUs than ranks).

Launcher side: no torch.
"""

from __future__ import annotations

import shutil

from omegaconf import DictConfig, OmegaConf

from finetune.config import ConfigError
from finetune.disk import has_gpu

SUBMITIT = "hydra_plugins.hydra_submitit_launcher."
"""The module of submitit's Hydra launchers (hydra.launcher._target_: ...SlurmLauncher or ...LocalLauncher)."""

NPROC = "launcher.nproc_per_node"


def check(config: DictConfig) -> None:
    """Raise ConfigError when the sweep's launcher config (config.hydra.launcher) cannot run finetune's trials here."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")
    if not target.startswith(SUBMITIT):
        return  # Hydra's basic launcher (one trial after another) or joblib's: one process per trial, nothing to check
    launcher = config.hydra.launcher  # submitit's typed queue config (BaseQueueConf): every field below is declared there
    slurm = target.endswith("SlurmLauncher")
    if slurm:
        missing = [command for command in ("sbatch", "srun") if shutil.which(command) is None]
        if missing:
            raise ConfigError(f"hydra/launcher=submitit_slurm submits each trial with sbatch and srun, which this machine "
                              f"does not have ({' and '.join(missing)} not on PATH): run the sweep on the cluster's login "
                              "node, or use hydra/launcher=submitit_local or hydra/launcher=joblib here")
    ranks = widest(config)
    tasks = launcher.tasks_per_node
    if tasks != 1:
        raise ConfigError(f"hydra.launcher.tasks_per_node={tasks}: a trial is one task that starts its own {NPROC}={ranks} "
                          f"ranks, so {tasks} tasks would each start a whole copy of the trial: keep "
                          f"hydra.launcher.tasks_per_node=1 and set {NPROC} to the ranks a trial runs")
    nodes = launcher.nodes
    if nodes != 1:
        raise ConfigError(f"hydra.launcher.nodes={nodes}: a trial of a sweep runs on one node, and {nodes} nodes would each "
                          "start a whole copy of it (finetune's multi-node launches are started once per node: see "
                          "docs/multi-node.md): keep hydra.launcher.nodes=1")
    if not slurm and launcher.gpus_per_node is None and has_gpu():
        # submitit's local executor sets CUDA_VISIBLE_DEVICES to the first gpus_per_node GPUs (none when unset) for
        # every trial alike: launcher.devices_per_trial then gives each trial its own among them
        raise ConfigError("hydra/launcher=submitit_local hides this machine's GPUs from every trial unless "
                          "hydra.launcher.gpus_per_node is set: set it to the GPUs the sweep may use, and "
                          "launcher.devices_per_trial to each trial's share")
    gpus = launcher.gpus_per_node if slurm else None
    if gpus is not None and gpus < ranks:  # None: the job asks Slurm for no GPU by this key (gres, partition defaults)
        raise ConfigError(f"hydra.launcher.gpus_per_node={gpus} gives each trial's job fewer GPUs than its {NPROC}={ranks} "
                          f"ranks, a GPU each: set hydra.launcher.gpus_per_node={ranks} (or {NPROC}={gpus})")


def widest(config: DictConfig) -> int:
    """launcher.nproc_per_node of the sweep's widest trial: the composed value, or the largest one the sweep lists
    (Hydra composes the sweep's config without its swept values; a search it cannot list is left to the trial)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    ranks = int(OmegaConf.select(config, NPROC, default=1) or 1)
    task = [str(o) for o in OmegaConf.select(config, "hydra.overrides.task", default=None) or []]
    try:
        overrides = OverridesParser.create().parse_overrides(task)
    except Exception:  # noqa: BLE001 - Hydra parsed these already to compose the config; nothing more to learn here
        return ranks
    for override in overrides:
        if override.key_or_group != NPROC or not override.is_sweep_override():
            continue
        try:
            ranks = max(ranks, *(int(value) for value in override.sweep_string_iterator()))
        except Exception:  # noqa: BLE001 - not a list of numbers (an interval): each trial's own validation says
            continue
    return ranks
