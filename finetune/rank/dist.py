"""Process group set-up and the few collectives the loop needs (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from finetune.config import Device
from finetune.rank.deepspeed_runner import without_mlflow


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, *values: float) -> list[float]:
        """All-reduce (sum) a few scalars in one collective; identity on one process."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t)
        return t.tolist()

    def on_device(self, *values: Any) -> torch.Tensor:
        """Numbers and 0-d tensors (DTensors' whole values) as one float64 vector on the device, read nothing back."""
        parts = [v.full_tensor() if hasattr(v, "full_tensor") else v for v in values]
        return torch.stack([v.detach().to(self.device, torch.float64).reshape(()) if torch.is_tensor(v)
                            else torch.tensor(float(v), dtype=torch.float64, device=self.device) for v in parts])

    def read(self, summed: list[Any], local: list[Any] = ()) -> tuple[list[float], list[float]]:
        """The step's one host read: `summed` all-reduced (sum) over the ranks, `local` as this rank has it, in one
        collective and one device-to-host copy (each may hold numbers and device tensors)."""
        t = self.on_device(*summed, *local)
        if self.world_size > 1 and summed:
            head = t[:len(summed)]
            dist.all_reduce(head)
            t = torch.cat([head, t[len(summed):]])
        values = t.tolist()
        return values[:len(summed)], values[len(summed):]

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) a tensor (moved to the device for the collective); identity on one process."""
        if self.world_size == 1:
            return t
        on_device = t.to(self.device)
        dist.all_reduce(on_device)
        return on_device.to(t.device)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), in rank order, on every rank; [value] on one process."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def init(device: Device, *, deepspeed: bool = False) -> Dist:
    """Join the process group torchrun (or deepspeed) set up through the environment.

    With `deepspeed`, DeepSpeed's communication layer wraps the same torch process group
    (ZeRO-3's zero.Init needs it before the engine exists)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = device == Device.cuda or (device == Device.auto and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but CUDA is not available on this machine: use train.device=cpu or auto")
    dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    backend = "nccl" if cuda else "gloo"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    if deepspeed:
        import_deepspeed().init_distributed(dist_backend=backend)
    return Dist(rank=rank, local_rank=local_rank, world_size=world, device=dev)


def import_deepspeed() -> Any:
    """`import deepspeed`, without the `import mlflow` its autotuner tries at import (deepspeed.autotuning.autotuner):
    2 s per rank where mlflow is installed, for an autotuner no run here starts (finetune.rank.deepspeed_runner). mlflow
    itself still imports afterwards (train.loggers=[mlflow] on rank 0)."""
    with without_mlflow():
        import deepspeed
    with contextlib.suppress(ImportError):  # py-cpuinfo: DeepSpeed's CPU op builders need it (else they ask lscpu)
        import cpuinfo

        if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
            # Each call starts a python process to read the CPU (1.5 s); DeepSpeed's CPU optimizer builder asks twice per
            # rank (-march, then SIMD width) for the same machine. Once per process is enough.
            cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
    return deepspeed


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    # DeepSpeed's CPU accelerator creates a shared-memory all-reduce buffer per rank (~66 MB in /dev/shm,
    # named by uid, master address, port and rank) and never removes it: a node running many jobs
    # fills its RAM-backed /dev/shm. Unlinking is safe now: a peer's mapping stays valid until it exits.
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}_{os.environ.get('RANK', 0)}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{name}")
