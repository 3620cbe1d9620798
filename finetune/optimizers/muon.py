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
orthogonalised by torch's own Newton-Schulz, and cut back to this rank's shard: one process's bits, as Liu et al. 2025
(section 2.3, "Distributed Muon") do over ZeRO-1 partitions. The matrices of a step are spread over the ranks: each
orthogonalises every N-th one (N ranks) and broadcasts its bf16 result, so Newton-Schulz's work is divided by N where
Moonlight repeats it on every rank; per matrix, an all-gather of the update and a broadcast of the result. What a
rank holds at a time is one whole matrix's update in fp32 beside Newton-Schulz's own bf16 temporaries (the planner's
step temporaries).
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups: dict[int, Any] = {}  # a mesh's process group over all its ranks (a 2-D mesh's flattened), by id

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        turn = 0  # this step's k-th sharded matrix is orthogonalised by the k-th rank of its mesh (mod its size)
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            lr, momentum, ns = float(group["lr"]), group["momentum"], (group["ns_coefficients"], group["ns_steps"], group["eps"])
            for p, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                if isinstance(update, DTensor):
                    update = orthogonalised(update, turn, self.mesh_group(update.device_mesh), *ns)
                    turn += 1
                else:
                    update = _zeropower_via_newtonschulz(update, *ns)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss

    def mesh_group(self, mesh: Any) -> Any:
        if id(mesh) not in self.groups:
            self.groups[id(mesh)] = mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
        return self.groups[id(mesh)]


def orthogonalised(update: DTensor, turn: int, group: Any, coefficients: tuple[float, float, float], steps: int,
                   eps: float) -> DTensor:
    """A DTensor's whole matrix (gathered on every rank of its mesh), orthogonalised by torch's Newton-Schulz on one of
    them, the `turn`-th (so that a step's matrices are spread over the ranks), which sends its bf16 result to the others
    (`group`: a broadcast); each keeps its own slice, placed as the update was. Collective: every rank of the mesh
    calls it for the same matrices in the same order."""
    import torch.distributed as dist

    whole = update.full_tensor()
    ranks = update.device_mesh.mesh.flatten().tolist()
    owner = ranks[turn % len(ranks)]
    if dist.get_rank() == owner:
        done = _zeropower_via_newtonschulz(whole, coefficients, steps, eps).contiguous()  # a tall matrix's comes transposed
    else:  # torch's Newton-Schulz iterates in bf16 and returns its bf16 result
        done = torch.empty(whole.shape, dtype=torch.bfloat16, device=whole.device)
    if len(ranks) > 1:
        dist.broadcast(done, src=owner, group=group)
    return distribute_tensor(done, update.device_mesh, update.placements, src_data_rank=None)


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
