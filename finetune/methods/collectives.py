"""The collectives the online methods' rollouts take part in (torch imported where called): the largest of a number over
every rank (dynamic sampling's rounds), the global batch's reward std (scale_rewards=batch), and what a vLLM server's
client needs (this rank, a barrier, rank 0's value on every rank). Each is this process's own where there is no
process group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def world_max(value: float, engine: Any) -> float:
    """The largest `value` over every rank (one collective; this rank's where there is no process group)."""
    import torch

    return float(_all_reduce(torch.tensor([value], dtype=torch.float64), max_=True)[0])


def _grouped() -> bool:
    import torch.distributed as td

    return td.is_available() and td.is_initialized()


def this_rank() -> int:
    import torch.distributed as td

    return td.get_rank() if _grouped() else 0


def barrier() -> None:
    """Every rank waits here."""
    import torch.distributed as td

    if _grouped():
        td.barrier()


def rank0s(value: Any) -> Any:
    """Rank 0's `value` (any picklable object) on every rank."""
    import torch.distributed as td

    held = [value]
    if _grouped():
        td.broadcast_object_list(held, src=0)
    return held[0]


def _all_reduce(t: torch.Tensor, max_: bool = False) -> torch.Tensor:
    import torch
    import torch.distributed as td

    if _grouped() and td.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if td.get_backend() == "nccl" else torch.device("cpu")
        t = t.to(device)
        td.all_reduce(t, op=td.ReduceOp.MAX if max_ else td.ReduceOp.SUM)
        t = t.cpu()
    return t


def batch_std(rewards: list[torch.Tensor], engine: Any) -> float:
    """The sample std of every reward of the global batch: this rank's (`rewards`) with every other data-parallel
    replica's (one rank per replica counts: `engine.owner`), summed across ranks in one collective."""
    import torch

    r = torch.cat([t.double().view(-1) for t in rewards])
    moments = torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(), (r * r).sum()]) * float(engine.owner)
    n, total, squares = _all_reduce(moments).tolist()
    return max((squares - total * total / n) / max(n - 1, 1), 0.0) ** 0.5
