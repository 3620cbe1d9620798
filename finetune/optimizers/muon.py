"""optim=muon: torch.optim.Muon on the hidden 2-D weight matrices, torch.optim.AdamW on everything else (the input
embeddings, the output layer, 1-D biases and norm scales, 3-D stacks of experts), as Muon's authors train with it
(Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; Liu et al. 2025, "Muon is Scalable for LLM Training",
arXiv:2502.16982, which matches Muon's update RMS to AdamW's so that both take one learning rate:
adjust_lr_fn="match_rms_adamw").

One optimizer object over both, so that the engine's schedule, clipping, checkpoints and resume see one: its param
groups are the two torch optimizers' own groups (each flagged `muon`), its state their shared state, and its step
runs each one's own step. Nothing of either update is written here, but for one thing sharding needs:

Over DTensor shards (FSDP2, tensor parallel, their 2-D meshes) a rank holds a slice of each matrix, and Newton-Schulz
orthogonalises the whole matrix. torch.optim.Muon given DTensors runs its five Newton-Schulz iterations through
DTensor's sharded matmuls: operands gathered and bf16 partial sums reduced inside every iteration, another rounding
than one process's (2% of the update on a 64 x 96 matrix, three times what a 1e-6 change of the input moves it).
`WholeMatrixMuon` is torch's Muon with each update (momentum and Nesterov: elementwise, on the shard) gathered once,
orthogonalised by torch's own Newton-Schulz, and cut back to this rank's shard: one all-gather per matrix and one
process's bits, as Liu et al. 2025 (section 2.3, "Distributed Muon") do over ZeRO-1 partitions. Every rank
orthogonalises every matrix (the same result on each); spreading the matrices over the ranks, each orthogonalising its
share and scattering it, would divide that work and is not built. What it holds at a time is one whole matrix's update
in fp32 beside Newton-Schulz's own bf16 temporaries (the planner's step temporaries).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from finetune.optimizers.kernels import closure_loss


class WholeMatrixMuon(torch.optim.Muon):
    """torch.optim.Muon for DTensor shards: torch's `_single_tensor_muon`, step for step, with each update orthogonalised
    whole (`orthogonalised`); on plain tensors it is torch's update exactly."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            lr, momentum = float(group["lr"]), group["momentum"]
            for p, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalised(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def orthogonalised(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """torch's Newton-Schulz orthogonalisation of a matrix; of a DTensor's whole matrix (gathered on every rank: a
    collective), returned placed as the update was (each rank keeps its own slice: no communication)."""
    if not isinstance(update, DTensor):
        return _zeropower_via_newtonschulz(update, coefficients, steps, eps)
    whole = _zeropower_via_newtonschulz(update.full_tensor(), coefficients, steps, eps)
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over the groups of hidden matrices, torch.optim.AdamW over the rest (see the module docstring)."""

    def __init__(self, groups: list[dict[str, Any]], *, lr: float, betas: tuple[float, float], eps: float, momentum: float) -> None:
        """`groups`: finetune.rank.engine.common.param_groups's, the embeddings' and output layer's weights in groups
        marked `end` (they go to AdamW, as every other tensor that is not 2-D)."""
        hidden, rest = [], []
        for g in groups:
            matrices = [p for p in g["params"] if p.ndim == 2 and not g.get("end")]
            others = [p for p in g["params"] if not (p.ndim == 2 and not g.get("end"))]
            hidden += [{**g, "params": matrices, "muon": True}] if matrices else []
            rest += [{**g, "params": others, "muon": False}] if others else []
        self.parts: dict[bool, torch.optim.Optimizer] = {}  # by the groups' `muon` flag
        if hidden:
            sharded = any(isinstance(p, DTensor) for g in hidden for p in g["params"])
            self.parts[True] = (WholeMatrixMuon if sharded else torch.optim.Muon)(hidden, lr=lr, momentum=momentum, nesterov=True, adjust_lr_fn="match_rms_adamw")
        if rest:
            self.parts[False] = torch.optim.AdamW(rest, lr=lr, betas=betas, eps=eps)
        super().__init__([g for part in self.parts.values() for g in part.param_groups], {})
        self._link()

    def _link(self) -> None:
        """Each part's groups are this optimizer's (the schedule's rates reach them) and its state this one's."""
        for muon, part in self.parts.items():
            part.param_groups = [g for g in self.param_groups if g["muon"] == muon]
            part.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts.values():
            part.step()
        return loss
