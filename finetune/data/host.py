"""A micro-batch's host copies: what the data pipeline made on the host before the engine moved it to the device.

A step needs a few of the data's facts on the host (a padding-free row's sample lengths, how many samples a batch holds,
the positions whose logits are kept). Read from the device tensor, each would wait for every kernel queued before it
(on a GPU, a sync); the host had them before the move. `to_device` moves a micro-batch and keeps each tensor's host
original as its twin; `host_copy` returns it, or reads a tensor without one from the device and says so to the counter
(finetune/rank/syncs.py: HostReads, which leaves the work inside `on_host()` uncounted). Torch, imported by the ranks
and the methods' loss helpers (finetune/methods/losses.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

COUNTING: list[Any] = []
"""The host-read counters running now (finetune.rank.syncs.HostReads)."""
PAUSED: list[bool] = [False]
"""Whether the work running now is on host copies (`on_host`)."""


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Work on host copies (`host_copy`): no device is waited for, so nothing is counted."""
    before, PAUSED[0] = PAUSED[0], True
    try:
        yield
    finally:
        PAUSED[0] = before


class Twins:
    """Device tensor -> its host original, for the micro-batches of the current step (`to_device` records them)."""

    by_id: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def clear(cls) -> None:
        cls.by_id.clear()


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A micro-batch on the device: from pinned memory, without waiting (CUDA), each tensor's host original kept as its
    twin (`host_copy`). On a CPU the tensors are the same."""
    out = {}
    for k, v in batch.items():
        if device.type == "cuda" and v.device.type == "cpu":
            moved = (v if v.is_pinned() else v.pin_memory()).to(device, non_blocking=True)
        else:
            moved = v.to(device)
        Twins.by_id[id(moved)] = (moved, v)  # the device tensor is held too: its id is not reused this step
        out[k] = moved
    return out


def host_copy(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t`'s host original where the engine moved it, else `t` read from the device (counted as `what`)."""
    twin = Twins.by_id.get(id(t))
    if twin is not None and twin[0] is t:
        return twin[1]
    for mode in COUNTING:  # a CPU run's derived tensor too: on a GPU it would be a device-to-host copy
        mode.note(what)
    return t.cpu()
