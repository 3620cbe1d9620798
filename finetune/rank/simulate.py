"""The step simulated: memory measured without a GPU (`python -m finetune.plan ... plan.simulate=true` runs it).

    python -m finetune.rank.simulate RUN_CONFIG.yaml --width TOKENS --out RESULT.json [--world-size N]

Rank 0 of the run as its own code builds it, under torch's FakeTensorMode (tensors with shapes and dtypes, no
storage, no arithmetic): the model from its config (model.architecture, model.init or model.path's config.json,
random init: no weights read), the strategies (finetune.rank.train.prepare_model: PEFT's adapters, activation
checkpointing), the engine (finetune.rank.engine.build: the torch engine, or the mesh engine's FSDP2, tensor parallel
with sequence parallel and context parallel over a fake process group of N ranks, torch.testing's FakeStore), then two of the engine's own train_step at the plan's
longest shape (micro_batch_size rows of TOKENS tokens, each row one sample: what a padding-free micro-batch or a
packed row attends, sample by sample). MemTracker (FSDPMemTracker under FSDP) counts every tensor by category;
the second step's numbers are reported (the first has no optimizer states yet). About a minute for Llama-3.1-8B
on two cores, at any world size.

What it cannot see, said by the launcher's table: the CUDA allocator's fragmentation and caching, the CUDA
context and NCCL's buffers (the plan's fixed overhead), kernels' workspaces. The device is faked as the CPU, so
the kernels chosen are the CPU's (sdpa's flash kernel for CPU saves what CUDA's does: the output and its
log-sum-exp; fused AdamW is built on both). Layouts it cannot run are refused in one line (`refusal`).

Four traps, each handled here and nowhere else:
- `Module.to(device)` of fake parameters swaps them (torch.utils.swap_tensors), which the fake mode's own weak
  references forbid: a move to where the tensors already are is made a no-op while the engine builds (`_placed`).
- host reads (`loss.item()`, `float(norm)`) of a fake tensor have no value: they read 1 (`FakeReads`), so the
  step takes its normal path (a finite norm, the optimizer steps).
- a DeviceMesh computes its ranks' coordinates with data-dependent ops: every mesh (the engine's, and those FSDP2 and
  DTensor derive from it) is built outside the fake mode (`_mesh_outside`).
- transformers builds a full attention mask for a fake attention_mask (it takes them for tracing): the batch
  carries one only where the plan counts one (padded rows of several, the planner's `masked`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from finetune import config, methods
from finetune.config import Config, ConfigError, PeftMethod, Strategy, uses_deepspeed
from finetune.data.rows import several_per_row

GIB = 2**30


def refusal(cfg: Config) -> str | None:
    """Why `cfg`'s step cannot be simulated (one line), or None."""
    p, method = cfg.parallelism, methods.get(cfg.method.name)
    why = (f"zero.stage={cfg.zero.stage}: DeepSpeed's engine allocates its buffers outside torch's dispatch"
           if uses_deepspeed(cfg) else
           f"parallelism=ddp on {cfg.world_size} ranks: DDP's reducer reads real storage (use parallelism=fsdp, or one process)"
           if p.strategy == Strategy.ddp and cfg.world_size > 1 and p.tp == p.pp == p.cp == 1 else
           f"parallelism.pp={p.pp}: MemTracker cannot hook the pipeline schedule's backward" if p.pp > 1 else
           "peft=qlora: bitsandbytes quantizes real weights" if cfg.peft.name == PeftMethod.qlora else
           "precision=fp8: torchao's float8 layers are not simulated" if cfg.precision.fp8 is not None else
           "train.compile=true: the layers would be compiled under fake tensors" if cfg.train.compile else
           "train.qat: torchao's fake-quantized layers are not simulated" if cfg.train.qat is not None else
           f"method={method.name}: its step needs a reference, a teacher or a rollout; the simulation runs a step "
           "with the policy alone" if method.reference(cfg.method) is not None or method.teacher(cfg.method) is not None
           or method.sampling(cfg.method) is not None or method.rows_per_example != 1 else
           "a vision-language model: its image inputs are not simulated" if cfg.model.architecture.get("vision_config") else
           None)
    return f"plan.simulate: {why}" if why else None


class FakeReads(TorchDispatchMode):
    """A host read of a fake tensor (`.item()`, `float()`: aten._local_scalar_dense) reads 1."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].dtype.is_floating_point else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _placed() -> Iterator[None]:
    """Module.to(device[, dtype]) is a no-op where every parameter and buffer is already there (see the module doc)."""
    original = torch.nn.Module.to

    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if all((device is None or t.device.type == device.type) and (dtype is None or t.dtype == dtype or not t.is_floating_point())
               for t in tensors):
            return self
        return original(self, *args, **kwargs)

    torch.nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.to = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _mesh_outside() -> Iterator[None]:
    """Every DeviceMesh built outside the fake mode: the engine's, and those FSDP2 and DTensor derive from it (a TP
    mesh concatenated with FSDP's, sub-meshes); a mesh's ranks and coordinates are real tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    from finetune.rank import parallel

    original = DeviceMesh.__init__

    def init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    def build_mesh(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return built(*args, **kwargs)

    built, parallel.build_mesh = parallel.build_mesh, build_mesh
    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]
        parallel.build_mesh = built


@contextlib.contextmanager
def _own_propagation() -> Iterator[None]:
    """DTensor's sharding propagation infers output shapes on global-shape fake tensors in the fake mode it detects: ours,
    where the tracker would count them as this rank's. It gets a fake mode of its own instead."""
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


def model_config(cfg: Config) -> Any:
    """The transformers config the run builds: model.init's keys, model.path's config.json (a local directory), or a
    hub model's model.architecture (the keys its recipe declares)."""
    from transformers import AutoConfig

    from finetune import disk

    if cfg.model.init is not None:
        keys = {k: v for k, v in vars(cfg.model.init).items() if k not in ("model_type", "seed", "vocab_size")}
        return AutoConfig.for_model(cfg.model.init.model_type, vocab_size=cfg.model.init.vocab_size or 32000, **keys)
    local = disk.model_config(cfg.model)
    keys = dict(local or cfg.model.architecture or {})
    if not keys.get("model_type"):
        raise ConfigError(f"plan.simulate: model.path={cfg.model.path!r} has no config.json here and its recipe declares no "
                          "model.architecture")
    keys = {k: v for k, v in keys.items() if k not in ("architectures", "transformers_version", "torch_dtype", "dtype")}
    return AutoConfig.for_model(keys.pop("model_type"), **keys)


def simulate(cfg: Config, width: int, world_size: int) -> dict[str, Any]:
    """Rank 0's memory over two simulated steps of `cfg` at `width` tokens per row, on `world_size` ranks: bytes per
    category at the peak and at the moments that can be the peak (see `Moments`)."""
    import torch.distributed as tdist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    why = refusal(cfg)
    if why:
        raise ConfigError(why)
    start = time.perf_counter()
    if tdist.is_initialized():  # another simulation's (a test's): this one's world size
        tdist.destroy_process_group()
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        return _simulate(cfg, width, world_size, start)
    finally:
        tdist.destroy_process_group()


def _simulate(cfg: Config, width: int, world_size: int, start: float) -> dict[str, Any]:
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode

    from finetune.rank import dist, engine, train

    d = dist.Dist(rank=0, local_rank=0, world_size=world_size, device=torch.device("cpu"))
    mc = model_config(cfg)
    attention = "eager" if cfg.model.attn_implementation.value == "eager" else "sdpa"
    # rows of one sample each: per-sample attention (finetune.rank.varlen) then runs the family's kernel, causal by itself
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        torch.manual_seed(0)
        auto = getattr(transformers, methods.get(cfg.method.name).model_class)
        model = auto.from_config(mc, attn_implementation=attention, dtype=torch.float32)
        with contextlib.redirect_stdout(sys.stderr):  # the rank's own lines (model: ...) are not the result
            one = replace(cfg, data=replace(cfg.data, packing=False, padding_free=False))  # rows of one sample
            with _placed():  # PEFT moves each adapter to its base layer's device: where it already is
                net = train.prepare_model(one, d, model, attention, "simulated", methods.get(cfg.method.name).model_class)
            with _placed(), _mesh_outside():
                eng = engine.build(cfg, net, d)
    objective = train.objective_for(cfg, d, model.config, None, None)
    rows = cfg.train.micro_batch_size
    masked = not several_per_row(cfg) and (cfg.data.packing or rows > 1)  # the planner's `masked`: a padded batch of several
    with fake:
        ids = torch.randint(0, mc.vocab_size, (rows, width))
        batch = {"input_ids": ids, "labels": ids.clone()} | ({"attention_mask": torch.ones_like(ids)} if masked else {})
        module, optimizer = eng.memory_targets()
        moments = Moments(module, optimizer, fsdp=cfg.parallelism.strategy == Strategy.fsdp)
        count = float(rows * width * cfg.grad_accum_steps * world_size)
        with moments.tracker, FakeReads(), _own_propagation():
            for step in range(2):
                moments.step = step
                eng.train_step([batch] * cfg.grad_accum_steps, objective, count)
                if step == 0:
                    moments.tracker.reset_mod_stats()
    built = time.perf_counter() - start
    out = moments.result()
    out |= {"world_size": world_size, "width": width, "rows": rows, "masked": masked, "engine": type(eng).__name__,
            "tracker": type(moments.tracker).__name__, "seconds": built}
    return out


WEIGHTS = ("PARAM", "BUFFER", "SHARDED_PARAM")
GATHERED = ("UNSHARDED_PARAM", "ALL_GATHER")
GRADS = ("GRAD", "SHARDED_GRAD", "UNSHARDED_GRAD", "REDUCE_SCATTER")
ACTS = ("ACT", "INP")
TEMPS = ("TEMP",)
BACKWARD_STATES = ("Pre-Backward", "Peak Backward", "After Pre-Backward")
"""MemTracker's and FSDPMemTracker's module states at the start of a module's backward and at its worst moment."""


class Moments:
    """The tracker, and the snapshots taken at the moments the plan names: the peak of forward + backward (read at the
    optimizer step's start) and the optimizer step's (at its end), each a dict of category -> bytes."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> None:
        if fsdp:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
            from torch.distributed.fsdp import FSDPModule

            module = next(m for m in module.modules() if isinstance(m, FSDPModule))  # under PEFT: the sharded causal LM
            self.tracker = FSDPMemTracker(module, optimizer)
        else:
            from finetune.rank.memory import _tracker_class

            self.tracker = _tracker_class()()
            self.tracker.track_external(module, optimizer)
        self.module, self.step = module, 0
        self.before: dict[str, int] = {}
        self.after: dict[str, int] = {}
        self.current: dict[str, int] = {}
        self.states: dict[str, int] = {}
        optimizer.register_step_pre_hook(lambda *_: self._sample("before"))
        optimizer.register_step_post_hook(lambda *_: self._sample("after"))

    def _snapshot(self, kind: str) -> dict[str, int]:
        snap = self.tracker.get_tracker_snapshot(kind)
        per_device = next(iter(snap.values()), {}) if snap else {}
        return {str(k).split(".")[-1]: int(v) for k, v in per_device.items()}

    def _sample(self, when: str) -> None:
        if self.step != 1:
            return
        setattr(self, when, self._snapshot("peak"))
        if when == "after":  # the states alone (the tracker books what the step allocates as OPT, its temporaries too)
            self.states = self._snapshot("current")
        if when == "before":  # every gradient exists, the states too (from the first step); the step's own peak from here
            self.current = self._snapshot("current")
            t = self.tracker
            t._peak_mem_snap = {dev: dict(snap) for dev, snap in t.get_tracker_snapshot("current").items()}
            t._peak_mem = {dev: snap["Total"] for dev, snap in t._peak_mem_snap.items()}

    def result(self) -> dict[str, Any]:
        stats = self.tracker.memory_tracking.get(self.module)
        backward = 0  # activations + temporaries at the start of the model's backward or its worst moment (MemoryProbe's)
        gathered = 0  # FSDP's gathered parameters and all-gather buffers, the most the root module saw at once
        for state, snaps in (stats.snapshots.items() if stats else ()):
            for snap in snaps if isinstance(snaps, list) else [snaps]:
                per = {str(k).split(".")[-1]: int(v) for k, v in next(iter(snap.values()), {}).items()}
                gathered = max(gathered, sum(per.get(k, 0) for k in GATHERED))
                if getattr(state, "value", "") in BACKWARD_STATES:
                    backward = max(backward, sum(per.get(k, 0) for k in ACTS + TEMPS))
        at_step = self.after.get("Total", 0) > self.before.get("Total", 0)
        peak = self.after if at_step else self.before
        total = lambda s, keys: sum(s.get(k, 0) for k in keys)  # noqa: E731
        return {
            "peak": peak.get("Total", 0), "peak_at": "the optimizer step" if at_step else "backward", "at_peak": peak,
            "moments": {name: {"total": s.get("Total", 0), "weights": total(s, WEIGHTS), "gathered": total(s, GATHERED),
                               "gradients": total(s, GRADS), "optimizer": total(s, ("OPT",)), "activations": total(s, ACTS),
                               "temporaries": total(s, TEMPS)} for name, s in (("backward", self.before), ("step", self.after))},
            "weights": total(self.current, WEIGHTS), "gathered": gathered, "gradients": total(self.current, GRADS),
            "optimizer": total(self.states, ("OPT",)), "backward_activations": backward,
            "step_temporaries": total(self.after, TEMPS) + max(0, total(self.after, ("OPT",)) - total(self.states, ("OPT",))),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a resolved config.yaml (finetune.config.to_yaml)")
    parser.add_argument("--width", type=int, required=True, help="tokens per row: the plan's longest batch")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: the config's world size)")
    parser.add_argument("--out", required=True, help="where the result goes (JSON)")
    args = parser.parse_args(argv)
    cfg = config.load(args.config)
    try:
        result = simulate(cfg, args.width, args.world_size or cfg.world_size)
    except ConfigError as e:
        result = {"refused": str(e)}
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    import os

    os._exit(code)  # skip the interpreter's teardown (the fake process group, transformers' threads)
