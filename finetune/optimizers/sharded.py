"""The low-memory optimizers over DTensor shards (FSDP2, tensor parallel): the same update as on one process.

torch's Adafactor and bitsandbytes' AdamW8bit take plain tensors: the first reduces a matrix's squared
gradient over rows and columns with in-place ops DTensor cannot run on a partial sum, the second's kernels
read raw memory. `ShardedAdafactor` is torch's algorithm in ops DTensor can shard (its statistics are
DTensors: the row statistic sharded like the rows, the column one like the columns). `ShardedAdamW8bit`
runs bitsandbytes' kernels on each rank's own shard; its checkpoint state is DTensors too, so DCP saves
every rank's part (the 8-bit moments reshard like the weights; the block scales are tied to the layout,
which checkpoint.check_compatible enforces on resume).
"""

from __future__ import annotations

import math
from typing import Any

import bitsandbytes as bnb
import torch
from torch.distributed.tensor import DTensor, Shard

from finetune.optimizers.kernels import closure_loss


def _item(t: torch.Tensor) -> float:
    """A scalar of a reduction (a DTensor's is a partial sum on each rank until it is gathered)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).item()


class ShardedAdafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor's update (torch 2.x `_single_tensor_adafactor`: the same step size, relative to the
    weights' RMS, factored second moment, update clipped to RMS d), written so that DTensor shards step: the
    squared gradient is reduced out of place, and every scalar is gathered. The states have torch's names and
    shapes (`row_var` [..., rows, 1], `col_var` [..., 1, cols], `variance` for vectors), so a checkpoint loads
    into either. One temporary of the tensor's size at a time, as torch's."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, decay, d, beta2_decay = group["lr"], group["weight_decay"], group["d"], group["beta2_decay"]
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    if grad.dim() > 1:  # the reductions' own placements: sharded rows keep their row statistic
                        state["row_var"] = torch.zeros_like(grad.square().mean(dim=-1, keepdim=True))
                        state["col_var"] = torch.zeros_like(grad.square().mean(dim=-2, keepdim=True))
                    else:
                        state["variance"] = torch.zeros_like(grad)
                tiny = torch.finfo(p.dtype).eps if eps1 is None else eps1
                state["step"] += 1
                step = state["step"].item()
                beta = step ** beta2_decay
                alpha = max(eps2, _item(p.norm(2)) / p.numel() ** 0.5) * min(lr, 1 / step ** 0.5)
                if decay:
                    p.mul_(1 - lr * decay)
                square = grad.square()
                if grad.dim() > 1:
                    row = state["row_var"].lerp(square.mean(dim=-1, keepdim=True), beta)
                    col = state["col_var"].lerp(square.mean(dim=-2, keepdim=True), beta)
                    del square
                    state["row_var"].copy_(row)
                    state["col_var"].copy_(col)
                    estimate = (row @ col).div_(row.mean(dim=-2, keepdim=True).clamp(min=tiny))
                else:
                    estimate = state["variance"].lerp(square, beta)
                    state["variance"].copy_(estimate)
                    del square
                update = estimate.clamp_(min=tiny * tiny).rsqrt_().mul_(grad)
                denom = max(1.0, _item(update.norm(2)) / (update.numel() ** 0.5 * d))
                p.add_(update, alpha=-alpha / denom)
        return loss


BLOCK = 256
"""Elements per block of bitsandbytes' blockwise 8-bit states (one fp32 absmax each)."""
MOMENTS = ("state1", "state2")
SCALES = ("absmax1", "absmax2")


def largest_shard(p: DTensor) -> int:
    """Elements of the largest local shard of `p` (the first rank's: torch.chunk's chunks are ceil-sized)."""
    shape = list(p.shape)
    for dim, placement in zip(p.device_mesh.shape, p.placements):
        if placement.is_shard():
            shape[placement.dim] = -(-shape[placement.dim] // dim)
    return math.prod(shape)


class ShardedAdamW8bit(bnb.optim.AdamW8bit):
    """bitsandbytes' AdamW8bit where parameters are DTensors: each rank runs the kernels on its own shard (the
    update is elementwise; the block scales are over the shard). Whether a tensor gets 8-bit or 32-bit states is
    decided by the whole tensor's size, so every rank of a tensor agrees. Plain parameters step as in
    bitsandbytes. state_dict() gives DTensors (moments placed like their weights, block scales one padded chunk
    per rank), so a distributed checkpoint keeps every rank's part."""

    _whole: int | None = None
    """While a shard steps: its whole tensor's size (get_config decides 8-bit states by it)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        if not self.initialized:
            self.check_overrides()
            self.initialized = True
        for gindex, group in enumerate(self.param_groups):
            for pindex, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if not isinstance(p, DTensor):
                    if not self.state[p]:
                        self.init_state(group, p, gindex, pindex)
                    self.update_step(group, p, gindex, pindex)
                    continue
                local = p.to_local().detach()  # shares the shard's storage: bitsandbytes updates it in place
                if not (local.is_contiguous() and p.grad.to_local().is_contiguous()):
                    raise RuntimeError(f"adamw_8bit: a non-contiguous shard of a {tuple(p.shape)} parameter")
                local.grad = p.grad.to_local()
                self.state[local] = self.state.pop(p, {})
                self._whole = p.numel()
                try:
                    if not self.state[local]:
                        self.init_state(group, local, gindex, pindex)
                    if local.numel():
                        self.update_step(group, local, gindex, pindex)
                    else:  # an empty shard (more ranks than rows): nothing to update, the same step count
                        self.state[local]["step"] += 1
                finally:
                    self._whole = None
                    self.state[p] = self.state.pop(local)
        return loss

    def get_config(self, gindex: int, pindex: int, group: dict[str, Any]) -> dict[str, Any]:
        config = super().get_config(gindex, pindex, group)
        if self._whole is not None:  # a shard: 8-bit states when the whole tensor is large enough, whatever its shard's size
            config["min_8bit_size"] = 0 if self._whole >= config["min_8bit_size"] else math.inf
        return config

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        out = torch.optim.Optimizer.state_dict(self)  # not bitsandbytes' FSDP1 nesting: DCP flattens plain keys
        out["state"] = {k: dict(v) for k, v in out["state"].items()}
        for index, p in enumerate(self._params()):
            state = out["state"].get(index)
            if not isinstance(p, DTensor) or not state:
                continue
            for key in MOMENTS:
                state[key] = DTensor.from_local(state[key], p.device_mesh, p.placements, run_check=False,
                                                shape=p.shape, stride=p.stride())
            for key in SCALES:
                if key in state:
                    blocks = -(-largest_shard(p) // BLOCK)
                    padded = torch.zeros(blocks, dtype=state[key].dtype, device=state[key].device)
                    padded[: state[key].numel()] = state[key]
                    ranks = p.device_mesh.size()
                    state[key] = DTensor.from_local(padded, p.device_mesh, [Shard(0)] * p.device_mesh.ndim, run_check=False,
                                                    shape=(blocks * ranks,), stride=(1,))
        return out

    def load_state_dict(self, state_dict: dict[str, Any], move_to_device: bool = True) -> None:
        state_dict = {**state_dict, "state": {k: dict(v) for k, v in state_dict["state"].items()}}
        saved = [key for g in state_dict["param_groups"] for key in g["params"]]  # indices, or FQNs from DCP's set_state_dict
        for key, p in zip(saved, self._params()):
            state = state_dict["state"].get(key)
            if not isinstance(p, DTensor) or not state:
                continue
            for key in MOMENTS:
                if isinstance(state[key], DTensor):
                    state[key] = state[key].to_local()
            for key in SCALES:
                if isinstance(state.get(key), DTensor):
                    state[key] = state[key].to_local()[: -(-state["state1"].numel() // BLOCK)]
        super().load_state_dict(state_dict, move_to_device)
