"""Config -> the exact launch command: argv, environment and the files the ranks read (`build`).

A pure function of the typed config (plus the python executable, core count and a free port,
passed in), so it is unit-tested with golden outputs and shown verbatim by a dry run. The
DeepSpeed JSON is generated from the typed config alone (finetune.layouts.zero): nobody keeps one by hand.
No torch import.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from finetune.config import Config, LauncherName, to_yaml
from finetune.layouts import launcher_for
from finetune.launcher.devices import Devices
from finetune.layouts.zero import deepspeed_config
from finetune.rundir import CONFIG_FILE, DEEPSPEED_FILE



@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    """The command; argv[0] is the python that runs torch.distributed.run, the deepspeed runner, or (one process) the rank."""
    env: dict[str, str]
    """Variables the launch sets on top of the caller's environment."""
    files: dict[str, str] = field(default_factory=dict)
    """Run-directory-relative path -> content, written before the command starts."""

    def shell(self) -> str:
        """The command as one line a user can paste into a shell."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv)}".strip()


def build(cfg: Config, run_dir: str | Path, *, python: str, cpu_count: int, port: int = 29500, env_threads: int | None = None,
          devices: Devices | None = None) -> LaunchSpec:
    """Build the launch for `cfg` writing into `run_dir`.

    Args:
        cfg: the validated config; `cfg.run_dir` is set to `run_dir` in the written copy.
        run_dir: the run directory; the ranks read `run_dir/config.yaml` (and deepspeed.json).
        python: the interpreter that starts the launcher (the one running this, normally).
        cpu_count: cores on this node, to split among ranks when omp_num_threads is null.
        port: rendezvous port when launcher.master_port is null and the launcher needs one.
        env_threads: OMP_NUM_THREADS as the launching environment sets it (None: unset): honoured when
            launcher.omp_num_threads is null, as torchrun honours it (a test suite or a shared node that
            runs several jobs at once sets 1; more threads than cores stall every small op).
        devices: the devices the launch took (launcher.devices_per_trial, finetune.launcher.devices): the ranks see only those
            GPUs (CUDA_VISIBLE_DEVICES; deepspeed's --include), or run on only those CPU cores (taskset), their cores
            split among the ranks.

    Returns:
        The LaunchSpec; nothing is written or started here.
    """
    run_dir = str(run_dir)
    launch = cfg.launcher
    config_path = str(Path(run_dir) / CONFIG_FILE)
    files = {CONFIG_FILE: to_yaml(replace(cfg, run_dir=run_dir))}  # the ranks read this copy
    master_port = launch.master_port if launch.master_port is not None else port
    rank_env: dict[str, str] = {}

    if launcher_for(cfg) == LauncherName.deepspeed:
        # DeepSpeed's runner (`deepspeed ...`), without its autotuner's `import mlflow` (finetune.rank.deepspeed_runner)
        argv = [python, "-m", "finetune.rank.deepspeed_runner", f"--num_nodes={launch.nnodes}", f"--num_gpus={launch.nproc_per_node}"]
        if devices is not None and devices.kind == "GPU":  # its runner ignores CUDA_VISIBLE_DEVICES beside --num_gpus
            argv[-1] = f"--include=localhost:{','.join(devices.ids[:launch.nproc_per_node])}"
        if launch.hostfile:
            argv.append(f"--hostfile={launch.hostfile}")
        if launch.no_ssh:
            argv += ["--no_ssh", f"--node_rank={launch.node_rank}"]
        argv += [f"--master_addr={launch.master_addr}", f"--master_port={master_port}", "--module", "finetune.train", config_path]
        files[DEEPSPEED_FILE] = json.dumps(deepspeed_config(cfg), indent=2) + "\n"
    elif launch.name == LauncherName.auto and launch.nnodes == 1 and launch.nproc_per_node == 1 and not launch.rdzv_endpoint:
        # One process (launcher=auto): the rank itself, with the environment torchrun would give it (measured: torchrun's own
        # start costs about 2 s of a short run). The launcher forwards signals to it as it would to torchrun.
        argv = [python, "-m", "finetune.train", config_path]
        rank_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": launch.master_addr,
                    "MASTER_PORT": str(master_port)}  # a device mesh (fsdp on one rank) makes a process group of one
    else:
        argv = [python, "-m", "torch.distributed.run", f"--nnodes={launch.nnodes}", f"--nproc_per_node={launch.nproc_per_node}"]
        if launch.rdzv_endpoint:  # dynamic rendezvous: node ranks come from the c10d store at the endpoint
            argv += ["--rdzv_backend=c10d", f"--rdzv_endpoint={launch.rdzv_endpoint}", f"--rdzv_id={launch.rdzv_id}"]
        elif launch.nnodes == 1 and launch.master_port is None:
            argv.append("--standalone")  # local rendezvous on a free port: concurrent jobs never collide
        else:
            argv += [f"--node_rank={launch.node_rank}", f"--master_addr={launch.master_addr}", f"--master_port={master_port}"]
        argv += ["-m", "finetune.train", config_path]

    if devices is not None and devices.kind == "GPU":
        rank_env["CUDA_VISIBLE_DEVICES"] = ",".join(devices.ids)
    elif devices is not None:  # CPU cores: the job's processes run on those alone, their threads split among the ranks
        argv = ["taskset", "-c", ",".join(devices.ids), *argv]
        cpu_count, env_threads = len(devices.ids), None
    threads = launch.omp_num_threads or env_threads or max(1, cpu_count // launch.nproc_per_node)
    env = {
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",  # stream rank output as it happens
        "TOKENIZERS_PARALLELISM": "false",  # we tokenize before any fork; silence the warning
        **rank_env,
        **launch.env,
    }
    return LaunchSpec(argv=argv, env=env, files=files)
