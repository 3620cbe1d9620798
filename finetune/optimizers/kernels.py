"""How a torch optimizer steps, for every builder: the kernel keyword optim.kernel picks (fused, foreach, the loop)
and the step's closure. The records' builders (finetune/optimizers/__init__.py) call it, and so do the optimizers
written here (optimizers.sharded, engine.common.LowPrecisionAdam). Rank side (torch); it reads no config, because
finetune.config imports the records.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from finetune.errors import ConfigError

FUSED_DEVICES = ("cpu", "cuda")
"""Where torch's fused AdamW/Adam/SGD run (torch.optim's _get_fused_kernels_supported_devices, less the rarer ones)."""


def kernel(choice: Any, params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """torch.optim's keyword for optim.kernel: fused, foreach, or neither (the loop); auto: fused where every
    parameter is on a CPU or CUDA device, all DTensor shards or none, else torch's default ({}); the loop where
    both kinds are (tensor parallel leaves what it does not split plain tensors, and a fused or foreach call
    takes one kind only). `choice`: an OptimKernel or its value (this module reads no config: the records of
    finetune/optimizers/, which the config imports, build through it)."""
    choice = getattr(choice, "value", choice)
    mixed = len({isinstance(p, DTensor) for p in params}) > 1
    if choice == "auto":
        if mixed:  # torch's own default may pick foreach on CUDA
            return {"foreach": False}
        return {"fused": True} if params and all(p.device.type in FUSED_DEVICES for p in params) else {}
    if mixed and choice != "loop":
        raise ConfigError(f"optim.kernel={choice}: some parameters are DTensor shards (tensor parallel) and some plain "
                          "tensors, and one fused or foreach call takes one kind: use optim.kernel=auto or loop")
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[choice]


def closure_loss(closure: Any) -> Any:
    """An optimizer step's closure, called with gradients on (torch.optim's contract), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
