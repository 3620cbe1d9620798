"""Measured memory of the first training steps, by category: parameters, gradients, optimizer
states, activations (PyTorch's MemTracker, which works on CPU and CUDA alike), plus the CUDA
allocator's own peak on GPU."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

MIB = 2**20
CATEGORIES = {"PARAM": "params", "BUFFER": "buffers", "GRAD": "grads", "OPT": "optimizer", "ACT": "activations",
              "TEMP": "temp", "OTH": "other"}


def _tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        """MemTracker (a private torch tool) adapted to a training step:

        - the root module runs once per micro-batch: each new forward starts fresh module stats
          (MemTracker refuses a second root forward; the totals we read are unaffected);
        - frozen parameters (PEFT bases) get no gradient hook (MemTracker would try and fail);
        - a gradient optim.in_backward already freed is skipped (its hook ran before MemTracker's)."""

        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # the next micro-batch's forward
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

        def _update_and_maybe_create_winfos(self, t: Any, reftype: Any, update_existing: bool = False) -> Any:
            if t is None:  # optim.in_backward freed the gradient in its own hook first (it was tracked when made)
                return set()
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> Any:
            for p in module.parameters():
                if not p.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(p, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return Tracker


class _NoHook:
    def remove(self) -> None:
        pass


class MemoryProbe:
    """Track a few steps; `report()` gives MiB per category.

    - activations, temp, total: at the moment of the peak total;
    - backward_activations: activations + temporaries at the start or at the peak of the model's
      backward, whichever holds more (what the planner's activations + logits predict);
    - grads: the most seen (just before an optimizer step, when every gradient exists);
    - optimizer: the most seen (just after a step, when every state exists);
    - params, buffers: as tracked.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
                 device: torch.device, snapshot: Path | None = None) -> None:
        """`optimizer`: one, or one per parameter (optim.in_backward). `snapshot`: CUDA only, also record
        the allocator's history and dump it there in `report()`."""
        optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        self.device, self.snapshot = device, snapshot
        if snapshot is not None:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.tracker = _tracker_class()()
        self.tracker.track_external(model, *optimizers)
        self.model = model
        self.peak: dict[str, int] = {}
        self.most: dict[str, int] = {}
        self.active = False
        for opt in optimizers:
            opt.register_step_pre_hook(lambda *_: self._sample())
            opt.register_step_post_hook(lambda *_: self._sample())

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.active = True
        with self.tracker:
            self.tracker.reset_mod_stats()
            yield
            self._sample()
            peak = self._snapshot("peak")
        self.active = False
        if peak.get("Total", 0) > self.peak.get("Total", 0):
            self.peak = peak
        if self.device.type == "cuda":
            self.most["cuda_max_allocated"] = max(self.most.get("cuda_max_allocated", 0), torch.cuda.max_memory_allocated(self.device))

    def _snapshot(self, kind: str) -> dict[str, int]:
        snap = self.tracker.get_tracker_snapshot(kind)
        per_device = snap.get(self.device) or next(iter(snap.values()), {})
        return {str(k).split(".")[-1]: int(v) for k, v in per_device.items()}

    def _sample(self) -> None:
        if not self.active:
            return
        for key, value in self._snapshot("current").items():
            self.most[key] = max(self.most.get(key, 0), value)
        # activations (forward's and backward's temporaries) at the start and at the peak of the model's backward
        from torch.distributed._tools.mem_tracker import _ModState

        stats = self.tracker.memory_tracking.get(self.model)
        snaps = [snap for state in (_ModState.PRE_BW, _ModState.PEAK_BW) for snap in (stats.snapshots.get(state, []) if stats else [])]
        for snap in snaps:
            per_device = snap.get(self.device) or next(iter(snap.values()), {})
            by_name = {str(k).split(".")[-1]: int(v) for k, v in per_device.items()}
            self.most["backward_activations"] = max(self.most.get("backward_activations", 0), by_name.get("ACT", 0) + by_name.get("TEMP", 0))

    def report(self) -> dict[str, float]:
        """MiB per category (see the class doc), and the peak total."""
        if self.snapshot is not None:
            torch.cuda.memory._dump_snapshot(str(self.snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
        out = {
            "params": self.most.get("PARAM", 0) + self.most.get("BUFFER", 0),
            "grads": self.most.get("GRAD", 0),
            "optimizer": self.most.get("OPT", 0),
            "activations": self.peak.get("ACT", 0),
            "temp": self.peak.get("TEMP", 0),
            "backward_activations": self.most.get("backward_activations", 0),
            "peak_total": self.peak.get("Total", 0),
        }
        if "cuda_max_allocated" in self.most:
            out["cuda_max_allocated"] = self.most["cuda_max_allocated"]
        return {f"mem_{k}_mib": v / MIB for k, v in out.items()}


def line(report: dict[str, float]) -> str:
    r = {k[len("mem_"):-len("_mib")]: v for k, v in report.items()}
    return (f"memory (rank 0, peak of the first steps): {r['peak_total']:.1f} MiB total | params {r['params']:.1f} "
            f"grads {r['grads']:.1f} optimizer {r['optimizer']:.1f} activations {r['activations']:.1f} temp {r['temp']:.1f} MiB")
