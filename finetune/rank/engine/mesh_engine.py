"""The mesh engine: FSDP2, tensor parallel and pipeline parallel, composed on one DeviceMesh
(pp, dp, tp), behind the same interface as the other engines.

- Data parallel: FSDP2 shards (strategy=fsdp; under precision=bf16 gathered and computed in bf16 by its
  mixed-precision policy, without autocast) or replicas whose gradients are summed over the dp dimension after
  backward (strategy=ddp with tp/pp).
- Tensor parallel: DTensor plans; every rank of a TP group sees the same batch.
- Pipeline parallel: the step's micro-batches are the pipeline's micro-batches; the schedule
  (GPipe, 1F1B, interleaved 1F1B) runs forward and backward, and the objective's `loss(logits,
  batch)` is the last stage's loss. Evaluation runs the stages forward-only, point to point.
- Checkpoints: torch.distributed.checkpoint (each rank writes its shard) for resume; `export`
  gathers one Hugging Face checkpoint on rank 0.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as tdist
from torch import nn

from finetune.data.images import save_tokenizer
from finetune.rank import parallel
from finetune.rank.context import ContextParallel
from finetune.config import Config, ConfigError, Logits, PipeSchedule, Precision, Strategy
from finetune.layouts.mesh import fsdp_gathers_bf16
from finetune.rank.dist import Dist
from finetune.data.host import to_device
from finetune.rank.engine.common import (StepResult, add_metrics, skip_unless_finite, autocast_dtype, build_optimizer, build_scheduler, end_weights, lora_b, no_deepspeed_probe,
                                    place, read_for, training_dtype)

STATE_FILE = "trainer_state.pt"  # scheduler and step, beside the DCP shards


def _strided(value: Any) -> bool:
    """A DTensor sharded with transformers' packed (strided) layout: fused gate/up MoE experts under tp."""
    return any(type(p).__name__ == "_StridedShard" for p in getattr(value, "placements", ()))


def _flat() -> object:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)  # one key per parameter: stages never share a key


FLAT = _flat()


class MeshEngine:
    """finetune.rank.engine.base.Engine on a DeviceMesh (FSDP2, tensor, pipeline and context parallel)."""

    @classmethod
    def from_config(cls, model: nn.Module, cfg: Config, dist: Dist) -> MeshEngine:
        """The engine a run's config asks for (finetune.layouts.ENGINES: what finetune.rank.engine.build calls)."""
        return cls(model, cfg=cfg, dist=dist)

    def __init__(self, model: nn.Module, *, cfg: Config, dist: Dist) -> None:
        p = cfg.parallelism
        self.dist, self.cfg = dist, cfg
        parallel.check_model(model, p)
        self.mesh = parallel.build_mesh(dist.device, dist.world_size, p.pp, p.tp, p.cp)
        self.pp, self.tp, self.cp, self.dp = p.pp, p.tp, p.cp, dist.world_size // (p.pp * p.tp * p.cp)
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = (self.mesh[d].get_local_rank() for d in ("pp", "dp", "cp", "tp"))
        self.dp_size = self.dp
        # The ranks that hold the same parameters and see different tokens: data parallel's, and a context-parallel
        # group's (each has a slice of every sequence): FSDP shards over both, their gradients are summed over both.
        self.replicas = self.mesh["dp", "cp"]._flatten("dp_cp") if p.cp > 1 else self.mesh["dp"]
        self.fsdp = p.strategy == Strategy.fsdp
        self.chunked = cfg.logits.name == Logits.chunked  # under pp: the last stage returns rows' log-probs, not logits
        self.dtype = autocast_dtype(cfg.precision.name)
        # precision=bf16 under FSDP2: its MixedPrecisionPolicy instead of autocast (finetune.rank.parallel.fully_shard)
        self.param_dtype = torch.bfloat16 if fsdp_gathers_bf16(cfg) else None
        pure = cfg.precision.name == Precision.bf16_pure
        # fp32 master weights, or bf16 ones under bf16_pure (no fp32 anywhere); a checkpoint read in its own dtype
        # (bf16, memory-mapped) is cast where each rank's part of it lands, never whole on the host: FSDP2 moves each
        # rank's rows to the device and casts them there (QLoRA's 4-bit base, larger than one GPU, fits so);
        # tensor parallel sends each parameter to the device as it cuts the rank's shard (torch's distribute_tensor), and
        # the rest follows; pipeline stages are cut on the host, then placed as the rest.
        self.weights_dtype = training_dtype(cfg.precision.name)
        if p.pp > 1:
            self.stages = parallel.pipeline_stages(model, pp_rank=self.pp_rank, pp=p.pp, per_rank=p.pp_stages_per_rank)
            self.num_stages = p.pp * p.pp_stages_per_rank
            modules = [stage for _, stage in self.stages]
        else:
            self.stages, self.num_stages, modules = [], 1, [model]
        self.partial: list[nn.Parameter] = []  # replicated under tp, but each rank's gradient covers its heads only
        for m in modules:
            partial = parallel.tensor_parallel(m, self.mesh["tp"], sequence=p.sequence_parallel) if p.tp > 1 else []
            if not (self.fsdp and p.tp == 1):
                place(m.parameters(), dist.device, self.weights_dtype)
                m.to(dist.device)  # and the buffers
            names = [n for n, q in m.named_parameters() if any(q is r for r in partial)]  # FSDP replaces the objects
            if self.fsdp:
                parallel.fully_shard(m, self.replicas, reshard_after_forward=p.fsdp_reshard_after_forward, offload=p.fsdp_offload,
                                     param_dtype=self.param_dtype, dtype=self.weights_dtype)
            self.partial += [m.get_parameter(n) for n in names]
        self.modules = modules
        self.model = modules[0] if p.pp == 1 else None
        # What the checkpoint and export see: the causal LM(s) with their original parameter names.
        self.container: nn.Module = self.model if p.pp == 1 else nn.ModuleList([s.lm for _, s in self.stages])
        self.owner = self.tp_rank == 0 and self.pp_rank == self.pp - 1 and self.cp_rank == 0  # counts a replica's data once
        self.lockstep = self.fsdp and self.dp * self.cp > 1  # FSDP gathers parameters collectively over dp (and cp)
        self.context = ContextParallel(model, self.mesh["cp"].get_group(), self.cp_rank, self.cp) if self.cp > 1 else None
        self.params = [q for m in modules for q in m.parameters() if q.requires_grad]
        self.max_grad_norm = cfg.optim.max_grad_norm
        ends = set().union(*(end_weights(getattr(m, "lm", m)) for m in modules))  # after sharding: FSDP2's own parameters
        self.optimizer = build_optimizer(self.params, cfg.optim, cfg.precision.kahan_sum if pure else None, drop_empty=True,
                                         fast=lora_b(*modules), ends=ends)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.max_steps)
        self._schedule: Any = None
        if p.pp > 1 and dist.is_main:
            m = cfg.grad_accum_steps
            print(f"pipeline: {self.num_stages} stages on {p.pp} ranks, {m} micro-batches per step, {p.pp_schedule.value}, "
                  f"bubble {parallel.bubble_fraction(self.num_stages, m, p.pp_stages_per_rank):.1%}")

    # -- steps ----------------------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager:
        """torch.autocast in the compute dtype, except where FSDP's policy already gathers and computes in it: autocast
        there would cast each bf16 weight again and keep the copies until the forward ends."""
        if self.dtype is None or self.param_dtype is not None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.dtype)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], objective: Any, count: float) -> StepResult:
        for m in self.modules:
            m.train()
        lr = self.scheduler.get_last_lr()[0]
        # FSDP's reduce-scatter averages over dp x cp (hence * dp * cp); replicas' gradients are summed below.
        scale = (self.dp * self.cp if self.fsdp else 1) / count
        batches = [to_device(b, self.dist.device) for b in micro_batches]
        if self.pp > 1:
            loss_sum, metrics = self._pipeline_step(batches, objective, scale)
        else:
            loss_sum, metrics = 0.0, {}
            with self.context.split_attention() if self.context else contextlib.nullcontext():
                for i, batch in enumerate(batches):
                    if self.fsdp:
                        self.model.set_requires_gradient_sync(i == len(batches) - 1)  # reduce-scatter once per step
                    if self.context:  # this rank's slice of every row's tokens
                        batch = self.context.split(batch)
                    with self.autocast():
                        loss, sums = objective(self.model, batch)
                    (loss * scale).backward()
                    loss_sum = loss_sum + loss.detach().float()  # on the device: read once, by the loop
                    add_metrics(metrics, sums)
            if self.context:  # each rank's sums cover its slice of the tokens
                loss_sum, metrics = self._sum_over_cp((loss_sum, metrics))
        if self.partial:
            self._sum_over_tp()
        if not self.fsdp and self.dp * self.cp > 1:
            self._sum_over_dp()
        norm = self._clip()
        applied = skip_unless_finite(self.optimizer, norm)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum=loss_sum if self.owner else 0.0, grad_norm=norm, lr=lr,
                          metrics=metrics if self.owner else {k: 0.0 for k in metrics}, applied=applied)

    def _pipeline_step(self, batches: list[dict[str, torch.Tensor]], objective: Any, scale: float) -> tuple[float, dict]:
        records: dict[int, tuple[torch.Tensor, dict]] = {}  # by micro-batch: the first step may call twice

        def loss_fn(output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            i = int(index[0])
            batch = batches[i]  # the micro-batch this output belongs to: its logits, or its rows' log-probs (chunked)
            loss, sums = objective.rows_loss(output, batch) if self.chunked else objective.loss(output, batch)
            records[i] = (loss.detach(), sums)
            return loss * scale

        schedule = self._pipeline_schedule(len(batches), loss_fn)
        ids = torch.cat([b["input_ids"] for b in batches])
        positions = torch.cat([parallel.position_ids(b) for b in batches])  # each stage hands them on with its output
        target = torch.arange(len(batches), device=self.dist.device)
        has_first = any(s == 0 for s, _ in self.stages)
        has_last = any(s == self.num_stages - 1 for s, _ in self.stages)
        # logits=chunked: the last stage takes its micro-batch's labels as a keyword (each rank splits its own copy)
        labels = {"labels": torch.cat([b["labels"] for b in batches])} if self.chunked and has_last else {}
        with self.autocast():
            if has_first:
                schedule.step(ids, positions, target=target if has_last else None, **labels)
            elif has_last:
                schedule.step(target=target, **labels)
            else:
                schedule.step()
        metrics: dict[str, float] = {}
        for _, sums in records.values():
            add_metrics(metrics, sums)
        return sum((loss.float() for loss, _ in records.values()), torch.zeros((), device=self.dist.device)), metrics

    def _pipeline_schedule(self, microbatches: int, loss_fn: Callable) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if self._schedule is None:
            group = self.mesh["pp"].get_group()
            stages = [PipelineStage(m, s, self.num_stages, self.dist.device, group=group) for s, m in self.stages]
            self._loss_fn: list[Callable] = [loss_fn]
            forward = lambda logits, target: self._loss_fn[0](logits, target)  # noqa: E731 - rebound every step
            name = self.cfg.parallelism.pp_schedule
            if name == PipeSchedule.interleaved_1f1b:
                self._schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=forward, scale_grads=False)
            else:
                cls = Schedule1F1B if name == PipeSchedule.one_f_one_b else ScheduleGPipe
                self._schedule = cls(stages[0], microbatches, loss_fn=forward, scale_grads=False)
        self._loss_fn[0] = loss_fn
        return self._schedule

    def _sum_over_tp(self) -> None:
        """The gradients of replicated parameters that saw only this rank's heads (Qwen3's q/k norms),
        summed over the tensor-parallel group: once per step, after all micro-batches."""
        group = self.mesh["tp"].get_group()
        for q in self.partial:
            if q.grad is not None:
                tdist.all_reduce(q.grad._local_tensor if hasattr(q.grad, "_local_tensor") else q.grad, group=group)

    def _sum_over_dp(self) -> None:
        """Replicas' gradients summed over the data-parallel dimension and the context-parallel one (the loss
        is already / count)."""
        group = self.replicas.get_group()
        for q in self.params:
            if q.grad is not None:
                g = q.grad._local_tensor if hasattr(q.grad, "_local_tensor") else q.grad
                tdist.all_reduce(g, group=group)

    def _clip(self) -> torch.Tensor:
        """Global gradient norm (DTensor shards included, summed over pipeline stages), then clipping: on the device."""
        squares = torch.zeros((), dtype=torch.float64, device=self.dist.device)
        for q in self.params:
            if q.grad is not None:
                n = q.grad.norm(dtype=torch.float64)
                squares += (n.full_tensor() if hasattr(n, "full_tensor") else n) ** 2
        if self.pp > 1:
            tdist.all_reduce(squares, group=self.mesh["pp"].get_group())
        norm = squares.sqrt()
        if self.max_grad_norm:  # torch's factor: max / (norm + 1e-6), at most 1
            factor = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            for q in self.params:
                if q.grad is not None:
                    q.grad.mul_(factor.to(q.grad.dtype))
        return norm

    @torch.no_grad()
    def inference(self, fn: Any, batch: dict[str, torch.Tensor]) -> Any:
        """fn(model, batch) without gradients; under pipeline parallel the stages run forward-only
        and the last stage's fn.loss(logits, batch) is sent to every stage of the pipeline."""
        batch = {k: v.to(self.dist.device) for k, v in batch.items()}
        for m in self.modules:
            m.eval()
        with self.autocast():
            if self.context and "labels" in batch:  # a loss or log-probs: sums over the tokens, each rank's slice of them
                with self.context.split_attention():
                    return self._sum_over_cp(fn(self.model, self.context.split(batch)))
            if self.pp == 1:
                return fn(self.model, batch)
            return self._pipeline_forward(fn, batch)

    def _sum_over_cp(self, value: Any) -> Any:
        """A (nested tuple / dict of) tensor or number result summed over the context-parallel group."""
        if isinstance(value, dict):
            return dict(zip(value, self._sum_over_cp(tuple(value.values()))))
        if isinstance(value, tuple):
            return tuple(self._sum_over_cp(v) for v in value)
        total = torch.as_tensor(value, dtype=torch.float64 if not torch.is_tensor(value) else value.dtype, device=self.dist.device).clone()
        tdist.all_reduce(total, group=self.mesh["cp"].get_group())
        return total if torch.is_tensor(value) else total.item()

    def _pipeline_forward(self, fn: Any, batch: dict[str, torch.Tensor]) -> Any:
        group = self.mesh["pp"].get_group()
        ranks = tdist.get_process_group_ranks(group)
        mine = dict(self.stages)
        x, result = batch["input_ids"], [None]
        positions = parallel.position_ids(batch)  # every rank has the batch: no need to send them
        hidden = (x.shape[0], x.shape[1], self.cfg_hidden())
        for s in range(self.num_stages):
            if s % self.pp != self.pp_rank:
                continue
            if s > 0:  # from the previous stage's rank
                x = torch.empty(hidden, dtype=torch.float32, device=self.dist.device)
                tdist.recv(x, src=ranks[(s - 1) % self.pp], group=group)
            last = s == self.num_stages - 1
            rows = last and self.chunked and "labels" in batch and hasattr(fn, "rows_loss")  # a loss or log-probs: chunked
            x = mine[s](x, positions, labels=batch["labels"]) if rows else mine[s](x, positions)
            if not last:
                x = x[0]
                tdist.send(x.float().contiguous(), dst=ranks[(s + 1) % self.pp], group=group)
            else:
                result = [fn.rows_loss(x, batch) if rows else fn.loss(x, batch)]
        tdist.broadcast_object_list(result, src=ranks[(self.num_stages - 1) % self.pp], group=group)
        return result[0]

    def cfg_hidden(self) -> int:
        return self.stages[0][1].lm.config.hidden_size

    def frozen(self, model: nn.Module) -> nn.Module:
        """A frozen reference placed like the policy: the same TP plan / FSDP sharding and precision policy, no optimizer.
        Every unit, the root too, is resharded after each forward: no backward comes to free what it gathered."""
        model = model.eval().requires_grad_(False)
        if self.tp > 1:
            parallel.tensor_parallel(model, self.mesh["tp"], sequence=self.cfg.parallelism.sequence_parallel)
        if not (self.fsdp and self.tp == 1):  # as the policy's: FSDP2 casts and moves each unit's shard itself
            place(model.parameters(), self.dist.device, read_for(model))
            model = model.to(self.dist.device)
        if self.fsdp:
            parallel.fully_shard(model, self.mesh["dp"], reshard_after_forward=True, offload=self.cfg.parallelism.fsdp_offload,
                                 param_dtype=self.param_dtype, keep_root=False, dtype=read_for(model))
        return model

    @property
    def generation_model(self) -> nn.Module:
        return self.model

    def memory_targets(self) -> tuple[nn.Module, torch.optim.Optimizer] | None:
        """None under pipeline parallel: MemTracker's backward hooks do not work inside the
        schedule's autograd.grad calls."""
        return (self.container, self.optimizer) if self.pp == 1 else None

    # -- checkpoints ------------------------------------------------------------------------------

    def save(self, directory: Path, step: int) -> None:
        """torch.distributed.checkpoint into `directory`: every rank writes its own shards (DTensor-aware)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.container, self.optimizer, options=FLAT)
        state = {"model": model_state, "optim": optim_state}
        for part in state.values():  # DCP cannot lay out strided shards (MoE experts under tp): those are saved whole
            part.update({k: v.full_tensor() for k, v in part.items() if _strided(v)})
        dcp.save(state, checkpoint_id=str(directory))
        if self.dist.is_main:
            torch.save({"step": step, "scheduler": self.scheduler.state_dict()}, directory / STATE_FILE)

    def load(self, step_dir: Path) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.tensor import distribute_tensor

        if not (step_dir / STATE_FILE).is_file():
            raise ConfigError(f"train.resume: {step_dir} holds no torch.distributed.checkpoint of this engine ({STATE_FILE}); "
                              "was it saved with parallelism=fsdp or tp/pp?")
        model_state, optim_state = get_state_dict(self.container, self.optimizer, options=FLAT)
        state = {"model": model_state, "optim": optim_state}
        # Strided shards were saved whole (see save): read them whole, then keep this rank's shard.
        # (dcp.load fills `state` in place, non-tensor values included: the same dicts go back to set_state_dict)
        strided = {(name, k): v for name, part in state.items() for k, v in part.items() if _strided(v)}
        for (name, k), v in strided.items():
            state[name][k] = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        dcp.load(state, checkpoint_id=str(step_dir))
        for (name, k), target in strided.items():
            mine = distribute_tensor(state[name][k], target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(mine.to_local())
            state[name][k] = target
        set_state_dict(self.container, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
        trainer = torch.load(step_dir / STATE_FILE, weights_only=False)
        self.scheduler.load_state_dict(trainer["scheduler"])
        return int(trainer["step"])

    def export(self, path: Path, tokenizer: Any) -> None:
        """One Hugging Face checkpoint on rank 0: gathered from FSDP/TP shards and pipeline stages."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Whole tensors (FSDP / TP shards gathered): on rank 0 only, except under pipeline parallel,
        # where every stage's first rank contributes its blocks.
        full = get_model_state_dict(self.container, options=StateDictOptions(full_state_dict=True, cpu_offload=self.pp == 1))
        if self.pp > 1:  # each stage holds its own blocks: collect them (names without the ModuleList prefix)
            part = {k.split(".", 1)[1]: v.cpu() for k, v in full.items()} if self.tp_rank == 0 and self.dp_rank == 0 else {}
            parts: list[Any] = [None] * self.dist.world_size
            tdist.all_gather_object(parts, part)
            full = {k: v for p in parts for k, v in p.items()}
        if self.dist.is_main:
            module = self.model if self.pp == 1 else self._whole_model()
            with no_deepspeed_probe():
                module.save_pretrained(path, state_dict=full)
            save_tokenizer(tokenizer, path)
        self.dist.barrier()

    def _whole_model(self) -> nn.Module:
        """An empty (meta) model of the full architecture (with its adapters under PEFT), to write the merged stages with."""
        from transformers import AutoModelForCausalLM

        lm = self.stages[0][1].lm
        with torch.device("meta"):
            whole = AutoModelForCausalLM.from_config(lm.config)
            if hasattr(lm, "peft_config"):  # adapters: the whole PEFT model, so that PEFT writes every stage's adapters
                from peft import get_peft_model

                whole = get_peft_model(whole, lm.peft_config["default"])
        return whole
