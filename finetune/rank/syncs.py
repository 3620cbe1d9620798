"""Host reads: where a step waits for the device to hand a value back to Python.

On a GPU, every op whose result the host must know (`.item()`, `float(t)`, `bool(t)`, `.tolist()`, `nonzero`, a boolean
mask's indexing: its output's size is data) waits for every kernel queued before it: the host stops queueing, and the
GPU idles while the host catches up. The step reads nothing back per micro-batch: losses and metrics sum on the
device, the gradient is clipped by a norm that stays a tensor, a non-finite step is skipped inside the fused optimizer
(`skip_unless_finite`), and the loop reads the step's numbers once, with its all-reduce (`Dist.read`).

What a step needs on the host that the data already knew there (a padding-free row's sample lengths, how many samples a
batch holds) is read from the micro-batch's host copy, the tensor the data pipeline made before it was moved
(finetune/data/host.py: `to_device` keeps each one as its device tensor's twin, `host_copy` returns it; a tensor without
one is read from the device, and counted).

`HostReads` counts them (train.count_host_reads: the `host_reads` metric of every step). It sees the ops torch
dispatches, so it counts on CPU what would stall a GPU; work on host copies runs inside `on_host()`, which it does not
count. What it cannot see: a device-to-host copy by `.cpu()` / `.to("cpu")` (on a CPU run there is none to see), and
the reads inside DeepSpeed's own step (its overflow check and gradient norm). On a GPU,
`torch.cuda.set_sync_debug_mode("warn")` reports every sync as it happens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from finetune.data import host

READS = {"aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.is_nonzero", "aten.masked_select", "aten._unique2",
         "aten.unique_consecutive", "aten.unique_dim", "aten.masked_scatter"}
"""The ops whose result the host needs (a value, or a size that depends on the data)."""


class HostReads(TorchDispatchMode):
    """Counts the host reads of what runs inside it (`count`), each by op (`by_op`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.by_op = 0, {}
        self._tolist: Any = None

    def note(self, what: str) -> None:
        if not host.PAUSED[0]:
            self.count += 1
            self.by_op[what] = self.by_op.get(what, 0) + 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        if name in READS or (name in ("aten.index", "aten.index_put", "aten.index_put_") and _bool_index(args)):
            self.note(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostReads:
        host.COUNTING.append(self)
        tolist = self._tolist = torch.Tensor.tolist  # .tolist() dispatches no op: counted here

        def counted(t: torch.Tensor) -> Any:
            self.note("Tensor.tolist")
            return tolist(t)

        torch.Tensor.tolist = counted  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        host.COUNTING.remove(self)
        super().__exit__(*exc)


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


