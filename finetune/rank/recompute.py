"""The checkpoint function each decoder block (transformers' GradientCheckpointingLayer) runs its forward through,
for the two policies that are not torch's plain recompute:

- checkpointing=ops: op-level selective recompute (torch.utils.checkpoint's selective-checkpoint contexts, as
  torchtitan's "op" selective AC): the outputs of the block's matmuls and attention kernels are kept, the
  pointwise ops and norms between them are recomputed in backward; no matmul runs twice.
- checkpointing=full_offload: full recompute whose one saved tensor per block, its input, is held in host memory
  (copied out in the forward, back for the block's backward), as Unsloth's long-context runs do.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

SAVED = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
})
"""checkpointing=ops: the ops (aten overload packets) whose outputs are kept: the matmuls (a MoE's grouped ones and
FP8's scaled ones too) and the fused attention kernels. flash-attn's own ops (torch.ops.flash_attn.*) are kept too
(`saves`). Everything else (casts, norms, rotary embeddings, activations, residual adds) is recomputed."""


def saves(func: Any) -> bool:
    """Whether checkpointing=ops keeps the output of `func` (an OpOverload) rather than recomputing it."""
    packet = getattr(func, "_overloadpacket", None)
    name = getattr(packet, "__name__", "")
    return name in SAVED or getattr(func, "namespace", "") == "flash_attn"


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # stateless (no counter of the ops seen), so the same decision holds under torch.compile's tracing
    return CheckpointPolicy.MUST_SAVE if saves(func) else CheckpointPolicy.PREFER_RECOMPUTE


def op_level(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """One block's forward under op-level selective recompute (checkpointing=ops)."""
    contexts = functools.partial(create_selective_checkpoint_contexts, _policy)
    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)


class HostInputs:
    """Saved-tensor hooks around a checkpointed block: the tensors saved outside the checkpoint's own hooks, which
    are the block's inputs (torch's non-reentrant checkpoint saves them in the forward's saved-tensor hooks, the
    rest of the block through its own), copied to host memory (pinned, from a CUDA device) and back in backward.
    `held` counts the bytes held in host memory, `tensors` how many (on a CPU rank they stay where they are)."""

    def __init__(self) -> None:
        self.held = 0
        self.tensors = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):  # sequence parallel's block input: its local shard goes, the layout stays here
            layout = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            return ("dtensor", layout, self.pack(tensor._local_tensor))
        self.held += tensor.numel() * tensor.element_size()
        self.tensors += 1
        if tensor.device.type == "cpu":
            return tensor.device, tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=tensor.is_cuda)
        host.copy_(tensor)
        return tensor.device, host

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed[0], str):  # ("dtensor", layout, its local shard packed)
            from torch.distributed.tensor import DTensor

            (mesh, placements, shape, stride), local = packed[1], HostInputs.unpack(packed[2])
            return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
        device, tensor = packed
        return tensor.to(device, non_blocking=device.type == "cuda")

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One block's forward under full recompute, its input held in host memory (checkpointing=full_offload)."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)


def install(model: torch.nn.Module, function: Callable[..., Any]) -> None:
    """Run every checkpointed module's forward of `model` (its decoder blocks, transformers' GradientCheckpointingLayer,
    and any older-style module with a checkpoint function) through `function`, after transformers'
    gradient_checkpointing_enable set torch's plain checkpoint there."""
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = function
