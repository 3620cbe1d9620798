"""Config -> the exact launch command: argv, environment and the files the ranks read (`build`).

A pure function of the typed config (plus the python executable, core count and a free port,
passed in), so it is unit-tested with golden outputs and shown verbatim by a dry run. The
DeepSpeed JSON is generated here from the typed config alone: nobody keeps one by hand.
No torch import.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from finetune import optimizers
from finetune.config import Config, LauncherName, Offload, OptimConfig, Precision, launcher_for, to_yaml
from finetune.devices import Devices

CONFIG_FILE = "config.yaml"
DEEPSPEED_FILE = "deepspeed.json"
ERROR_FILE = "error.txt"  # a rank writes the one-line reason for a user mistake here
RANKS_DIR = "ranks"  # each rank's pid, host and how it ended (finetune.train.RankStatus)
LAUNCHER_ENV = "FINETUNE_LAUNCHER"  # pid@host of the launcher process, set for its job (finetune.supervise.execute)


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
        devices: the devices the launch took (launcher.devices_per_trial, finetune.devices): the ranks see only those
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
        # DeepSpeed's runner (`deepspeed ...`), without its autotuner's `import mlflow` (finetune.deepspeed_runner)
        argv = [python, "-m", "finetune.deepspeed_runner", f"--num_nodes={launch.nnodes}", f"--num_gpus={launch.nproc_per_node}"]
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


def deepspeed_config(cfg: Config) -> dict[str, Any]:
    """The DeepSpeed JSON, every number taken from the typed config.

    The learning-rate schedule is not in it: both engines step the same scheduler object
    (`engine.build_scheduler`), because DeepSpeed's Warmup* schedulers run their first step at
    lr 0 even without warmup, which would make the DeepSpeed run diverge from the torch run.
    """
    t, o, z, p = cfg.train, cfg.optim, cfg.zero, cfg.precision
    ds: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": o.max_grad_norm or 0.0,  # 0: no clipping
        "optimizer": deepspeed_optimizer(o),
        "steps_per_print": t.max_steps + 1,  # we log; keep DeepSpeed's own step lines quiet
        "wall_clock_breakdown": False,
    }
    if p.name == Precision.fp16:
        ds["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0 = dynamic
            "initial_scale_power": p.initial_scale_power,
            "loss_scale_window": p.loss_scale_window,
            "hysteresis": 1,  # back off on the first overflow, as torch's GradScaler does
            "min_loss_scale": 1,
        }
    elif p.name == Precision.bf16:
        ds["bf16"] = {"enabled": True}
    zero: dict[str, Any] = {
        "stage": z.stage,
        "overlap_comm": z.overlap_comm,
        "contiguous_gradients": z.contiguous_gradients,
        "reduce_bucket_size": z.reduce_bucket_size,
    }
    if z.stage in (1, 2):
        zero["allgather_bucket_size"] = z.allgather_bucket_size
    if z.stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": z.stage3_prefetch_bucket_size,
            "stage3_param_persistence_threshold": z.stage3_param_persistence_threshold,
            "stage3_max_live_parameters": z.stage3_max_live_parameters,
            "stage3_max_reuse_distance": z.stage3_max_reuse_distance,
            "sub_group_size": z.sub_group_size,
            "stage3_gather_16bit_weights_on_model_save": True,  # the final export needs whole weights
        }
    for key, where in (("offload_optimizer", z.offload_optimizer), ("offload_param", z.offload_param)):
        if where != Offload.none:
            zero[key] = {"device": where.value, "pin_memory": z.pin_memory}
            if where == Offload.nvme:
                zero[key]["nvme_path"] = z.nvme_path
    ds["zero_optimization"] = zero
    if not optimizers.record(o.name).deepspeed_tested:
        ds["zero_allow_untested_optimizer"] = True  # ZeRO's list of tested optimizers has Adam(W), not SGD
    return ds


def deepspeed_optimizer(o: OptimConfig) -> dict[str, Any]:
    """The JSON "optimizer" section, from the optimizer's record (finetune/optimizers/): what DeepSpeed builds is
    what the torch engine builds.

    "AdamW" and "Adam" become DeepSpeed's FusedAdam (DeepSpeedCPUAdam with zero.offload_optimizer);
    DeepSpeed's "Adam" is AdamW too unless "adam_w_mode" is false. Any other type is looked up in
    torch.optim: "SGD" is torch.optim.SGD.
    """
    rec = optimizers.record(o.name)
    values = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay, "momentum": o.momentum}
    return {"type": rec.deepspeed, "params": {**{k: values[k] for k in rec.deepspeed_keys}, **rec.deepspeed_extra}}
