"""optim=muon: torch.optim.Muon on the hidden 2-D weight matrices, torch.optim.AdamW on everything else (the input
embeddings, the output layer, 1-D biases and norm scales, 3-D stacks of experts), as Muon's authors train with it
(Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; Liu et al. 2025, "Muon is Scalable for LLM Training",
arXiv:2502.16982, which matches Muon's update RMS to AdamW's so that both take one learning rate:
adjust_lr_fn="match_rms_adamw").

One optimizer object over both, so that the engine's schedule, clipping, checkpoints and resume see one: its param
groups are the two torch optimizers' own groups (each flagged `muon`), its state their shared state, and its step
runs each one's own step. Nothing of either update is written here.
"""

from __future__ import annotations

from typing import Any

import torch


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
            self.parts[True] = torch.optim.Muon(hidden, lr=lr, momentum=momentum, nesterov=True, adjust_lr_fn="match_rms_adamw")
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
