"""Measured memory of the first training steps, as train.memory_report says:

- peak (the default): the high-water marks the system keeps anyway, read after the steps: on CUDA the
  allocator's (torch.cuda.max_memory_allocated / max_memory_reserved), on CPU the process's peak resident
  set (VmHWM). Nothing hooks the steps, which run at full speed.
- categories: parameters, gradients, optimizer states, activations (PyTorch's MemTracker, which works
  on CPU and CUDA alike), plus the CUDA allocator's own peak on GPU. Its hooks on every module and tensor
  make the measured steps 2-3x slower, so it is asked for, not the default.

Both print one line beside the memory plan's numbers (finetune.plan) and write {"kind": "memory"}.

Loading (`LoadWatch`, always): the host memory a rank takes from the model's first byte read to the engine built,
its private (anonymous) part apart from the file-backed pages of a memory-mapped checkpoint, which the node's ranks
share and the kernel can drop; each rank's numbers in RUN_DIR/ranks/RANK.json ("loading").
"""

from __future__ import annotations

import contextlib
import threading
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


class PeakProbe:
    """train.memory_report=peak: the peak of a few steps, from the high-water marks the system keeps (no hooks):
    on CUDA the allocator's, reset when the first tracked step starts; on CPU the process's resident set
    (VmHWM, reset through /proc/self/clear_refs where the kernel allows it, so the peak is the steps', not
    the loading's; it counts the Python process with torch loaded, which the plan's overhead stands for)."""

    def __init__(self, device: torch.device, planned: dict[str, float] | None = None) -> None:
        self.device, self.planned = device, planned
        self.started = False
        self.since = "the process start"  # what the CPU peak covers: until the reset works, the loading too

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        if not self.started:
            self.started = True
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            elif _reset_peak_rss():
                self.since = "the first step"
        yield

    def report(self) -> dict[str, float]:
        if self.device.type == "cuda":
            return {"mem_cuda_max_allocated_mib": torch.cuda.max_memory_allocated(self.device) / MIB,
                    "mem_cuda_max_reserved_mib": torch.cuda.max_memory_reserved(self.device) / MIB}
        return {"mem_peak_rss_mib": peak_rss() / MIB}

    def line(self, report: dict[str, float]) -> str:
        if "mem_peak_rss_mib" in report:
            measured = f"{report['mem_peak_rss_mib']:.1f} MiB resident (the whole process, since {self.since})"
            planned = _planned(self.planned, overhead=True)
        else:
            measured = (f"{report['mem_cuda_max_allocated_mib']:.1f} MiB allocated, "
                        f"{report['mem_cuda_max_reserved_mib']:.1f} MiB reserved (CUDA)")
            planned = _planned(self.planned, overhead=False)
        return f"memory (rank 0, peak of the first steps): {measured}{planned}; by category: train.memory_report=categories"


def peak_rss() -> int:
    """This process's peak resident set in bytes (Linux: VmHWM, which `_reset_peak_rss` resets)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for row in f:
                if row.startswith("VmHWM:"):
                    return int(row.split()[1]) * 1024
    import resource  # no /proc (macOS): the peak since the process started, in bytes there

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current resident set (Linux 4.0+: '5' to /proc/self/clear_refs); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def host_use() -> dict[str, int]:
    """This process's resident memory now, in bytes: "private" (anonymous: its own) and "file" (pages of mapped files:
    the page cache, shared with every process that maps the same file). {} without /proc (macOS)."""
    found: dict[str, int] = {}
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for row in f:
                if row.startswith(("RssAnon:", "RssFile:")):
                    found["private" if row.startswith("RssAnon") else "file"] = int(row.split()[1]) * 1024
    return found


class LoadWatch:
    """The host memory one phase takes (loading the model and building its engine): the private part's peak, sampled
    every `every` seconds on a thread of its own (what lives shorter than that is missed), the whole resident set's peak
    (VmHWM, reset at the start), and both at the end, each over what the process held before."""

    def __init__(self, every: float = 0.005) -> None:
        self.before = host_use()
        self.peak_private = self.before.get("private", 0)
        self.reset = _reset_peak_rss()
        self.marks: dict[str, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every,), daemon=True)
        self._thread.start()

    def _sample(self, every: float) -> None:
        while not self._done.wait(every):
            self.peak_private = max(self.peak_private, host_use().get("private", 0))

    def mark(self, name: str) -> None:
        """What the process holds now over the start: NAME_private_mib and NAME_file_mib in stop()'s numbers."""
        now = host_use()
        if now:
            self.marks[f"{name}_private_mib"] = (now["private"] - self.before["private"]) / MIB
            self.marks[f"{name}_file_mib"] = (now["file"] - self.before["file"]) / MIB

    def stop(self) -> dict[str, float]:
        """MiB: private_peak and resident_peak over the start, private and file (mapped pages) held at the end over it,
        and each mark's."""
        self._done.set()
        self._thread.join()
        now, before = host_use(), self.before
        if not now:
            return {}
        whole = sum(before.values())
        out = {**self.marks, "private_peak_mib": (max(self.peak_private, now["private"]) - before["private"]) / MIB,
               "private_mib": (now["private"] - before["private"]) / MIB, "file_mib": (now["file"] - before["file"]) / MIB}
        if self.reset:
            out["resident_peak_mib"] = (peak_rss() - whole) / MIB
        return {k: round(v, 1) for k, v in out.items()}


def load_line(measured: dict[str, float], device: str) -> str:
    """The rank's line for what loading took from the host (rank 0's numbers): the model read (before any engine placed
    it), then the engine built (on a CPU device, the training weights are host memory too)."""
    gib = {k: v / 1024 for k, v in measured.items()}
    line = f"loading (rank 0): the model read with {gib.get('read_private_mib', 0):.2f} GiB of private host memory"
    if gib.get("read_file_mib", 0) > 0.05:
        line += f" and {gib['read_file_mib']:.2f} GiB of the memory-mapped checkpoint's pages (shared by the node's ranks)"
    line += f"; the engine built: {gib['private_peak_mib']:.2f} GiB private at the peak, {gib['private_mib']:.2f} GiB kept"
    return line + (" (the training weights among them: the device is the host)" if device == "cpu" else "")


def _planned(planned: dict[str, float] | None, *, overhead: bool) -> str:
    """' | planned X MiB' from the run's plan record: its peak, and its fixed overhead where the measure counts it."""
    if not planned:
        return ""
    if not overhead:
        return f" | planned {planned['plan_peak_mib']:.1f} MiB"
    extra = planned.get("plan_overhead_mib", 0.0)
    return f" | planned {planned['plan_peak_mib'] + extra:.1f} MiB ({planned['plan_peak_mib']:.1f} + {extra:.0f} for the process)"


class MemoryProbe:
    """train.memory_report=categories: track a few steps; `report()` gives MiB per category.

    - activations, temp, total: at the moment of the peak total;
    - backward_activations: activations + temporaries at the start or at the peak of the model's
      backward, whichever holds more (what the planner's activations + logits predict);
    - grads: the most seen (just before an optimizer step, when every gradient exists);
    - optimizer: the most seen (just after a step, when every state exists);
    - params, buffers: as tracked.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
                 device: torch.device, snapshot: Path | None = None, planned: dict[str, float] | None = None) -> None:
        """`optimizer`: one, or one per parameter (optim.in_backward). `snapshot`: CUDA only, also record
        the allocator's history and dump it there in `report()`. `planned`: the run's plan record, for the line."""
        optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        self.device, self.snapshot, self.planned = device, snapshot, planned
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

    def line(self, report: dict[str, float]) -> str:
        return line(report) + _planned(self.planned, overhead=False)


def line(report: dict[str, float]) -> str:
    r = {k[len("mem_"):-len("_mib")]: v for k, v in report.items()}
    return (f"memory (rank 0, peak of the first steps): {r['peak_total']:.1f} MiB total | params {r['params']:.1f} "
            f"grads {r['grads']:.1f} optimizer {r['optimizer']:.1f} activations {r['activations']:.1f} temp {r['temp']:.1f} MiB")
