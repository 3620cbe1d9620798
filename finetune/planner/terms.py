"""The layouts' memory terms: what each layout of finetune.layouts.LAYOUTS changes in the plan, named by its record
(`states`, `work`) and applied by finetune.planner.peak in the records' order.

A states term changes the model states one rank holds (States: weights, gradients, optimizer states, the frozen base,
what is gathered, what offload moves to CPU RAM or NVMe); a work term changes what one rank computes of a micro-batch
(Work: its tokens, its blocks, the micro-batches in flight, the buffers an exchange holds). No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.config import Config, Offload, PipeSchedule
from finetune.families import Arch
from finetune.layouts import engine_kind
from finetune.layouts.mesh import fsdp_gathers_bf16
from finetune.planner.activations import dtypes
from finetune.planner.counts import Counts, fsdp_frozen_and_gathered, tp_whole_params, zero_states


@dataclass
class States:
    """Per-rank bytes of the model states, as the layouts' terms leave them."""

    trainable: float
    """Trainable parameters on this rank's tensor x pipeline share (before data-parallel sharding)."""
    bytes_per_param: tuple[int, int, int]
    """(weights, gradients, optimizer states) bytes per trainable parameter (counts.engine_state_bytes)."""
    weights: float = 0.0
    grads: float = 0.0
    opt: float = 0.0
    frozen: float = 0.0
    """The frozen base's bytes on this rank (PEFT's base, or nothing)."""
    gathered: float = 0.0
    """What a sharded layout gathers whole at a time (a block's weights and gradients): counted in the weights."""
    split: int = 1
    """The ranks a weight is split over (tensor x pipeline, x data-parallel where sharded: ZeRO-3, FSDP2); a frozen copy
    of the model (DPO's live reference) is split the same way."""
    resident: bool = False
    """All gradients held through backward, not filled in block by block (DeepSpeed's partitions, a pipeline's)."""
    buckets: float = 0.0
    """DDP's flat gradient buckets (a second copy of the gradients)."""
    root_end: float = 0.0
    """FSDP2 at the root unit's post-backward, the end of backward (nothing gathered then): the root's unsharded gradients
    and their copy for the reduce-scatter, beside every other unit's sharded gradients."""
    one_grad: float = 0.0
    """optim.in_backward: the largest trainable tensor's gradient, the most it holds."""
    cpu: float = 0.0
    nvme: float = 0.0

    def divide(self, n: int) -> None:
        """Split every state over `n` ranks (tensor or pipeline parallel: each holds 1/n of the model)."""
        self.trainable /= n
        self.weights, self.grads, self.opt, self.frozen = self.weights / n, self.grads / n, self.opt / n, self.frozen / n
        self.split *= n


@dataclass
class Work:
    """What one rank computes of a micro-batch, as the layouts' terms leave it."""

    seq: int
    """Tokens per row."""
    rows: int
    """Rows with gradients in a micro-batch."""
    no_grad_rows: int
    """Rows that run without gradients outside a pipeline (KTO's mismatched row); a pipeline runs them with them."""
    tokens: int
    """Tokens this rank holds activations for: rows x its share of each row."""
    layers: int
    """Blocks on this rank."""
    labelled: int | None
    """Labelled tokens per row (the longest batch's), when the data was read."""
    own_mask: bool = False
    """The layout builds its own attention mask, for packed rows only (context parallel): padded rows need none."""
    in_flight: int = 1
    """Micro-batches whose activations are held at once."""
    exchange: float = 0.0
    """An exchange's buffers live while a block runs (context parallel's all-to-all)."""


# -- states terms ---------------------------------------------------------------------------------------------------

def zero_partitions(arch: Arch, cfg: Config, s: States, counts: Counts, on_gpu: bool, notes: list[str]) -> None:
    """A ZeRO stage: optimizer states (1), gradients (2) and weights (3) partitioned over the data-parallel ranks;
    stage 3 gathers one module's 16-bit weights and gradients at a time. DeepSpeed allocates the gradient partitions
    up front."""
    z, dp = cfg.zero, cfg.data_parallel_size
    w, g, k = s.bytes_per_param
    s.weights, s.grads, s.opt = zero_states(z.stage, s.trainable, dp, w, g, k)
    s.resident = True
    if z.stage == 3:
        s.frozen /= dp
        s.split *= dp
        s.gathered = (w + g) * arch.largest_layer_params
    notes.append(f"DeepSpeed ZeRO stage {z.stage}: {w}+{g}+{k} bytes/param, sharded over {dp} data-parallel ranks "
                 "(DeepSpeed's own estimator adds a 4 bytes/param fp32 gradient copy: 18P/N)")


def _move(s: States, where: Offload, moved: float) -> None:
    if where == Offload.cpu:
        s.cpu += moved
    else:
        s.nvme += moved


def zero_offload_optimizer(arch: Arch, cfg: Config, s: States, counts: Counts, on_gpu: bool, notes: list[str]) -> None:
    """The optimizer states and the fp32 gradient partition to CPU RAM or NVMe (docs/memory.md: offload moves the 12P and
    the fp32 gradient copy; the GPU keeps only reduce buckets). On CPU ranks CPU offload moves nothing."""
    z = cfg.zero
    if z.offload_optimizer == Offload.nvme or on_gpu:
        moved = s.opt + 4 * s.trainable / cfg.data_parallel_size
        s.opt = s.grads = 0.0
        _move(s, z.offload_optimizer, moved)


def zero_offload_param(arch: Arch, cfg: Config, s: States, counts: Counts, on_gpu: bool, notes: list[str]) -> None:
    """ZeRO-3's parameter partitions (trainable and frozen) to CPU RAM or NVMe; a gathered module still comes to the rank."""
    z = cfg.zero
    if z.offload_param == Offload.nvme or on_gpu:
        moved = s.weights + s.frozen
        s.weights = s.frozen = 0.0
        _move(s, z.offload_param, moved)


def tensor_split(arch: Arch, cfg: Config, s: States, counts: Counts, on_gpu: bool, notes: list[str]) -> None:
    """Tensor parallel: each rank holds 1/tp of the blocks' states (their linears split by rows or columns) and the
    whole of what lies outside them (embeddings, final norm, output layer: counts.tp_whole_params)."""
    tp = cfg.parallelism.tp
    trained, frozen = tp_whole_params(arch, cfg, counts)
    keep = lambda whole, part: part / whole + (1 - part / whole) / tp if whole else 1 / tp  # noqa: E731
    t, f = keep(counts.trainable, trained), keep(counts.frozen, frozen)
    s.trainable, s.weights, s.grads, s.opt, s.frozen = s.trainable * t, s.weights * t, s.grads * t, s.opt * t, s.frozen * f
    s.split *= tp
    whole = trained + frozen
    notes.append(f"tensor parallel: the blocks' linears split over {tp} ranks; the embeddings, final norm and output layer "
                 f"({whole / 1e6:,.1f}M parameters) whole on each")


def pipeline_split(arch: Arch, cfg: Config, s: States, counts: Counts, on_gpu: bool, notes: list[str]) -> None:
    """Pipeline parallel: each rank holds its stages' blocks (counted as 1/pp of the model); the gradients of every
    micro-batch in the schedule are held until the step."""
    s.divide(cfg.parallelism.pp)
    s.resident = True


def ddp_buckets(arch: Arch, cfg: Config, s: States, counts: Counts, on_gpu: bool, notes: list[str]) -> None:
    """DDP on the torch engine: its flat all-reduce buckets, a second copy of the gradients held throughout (the mesh
    engine sums the gradients over dp itself; DeepSpeed's buckets are its own)."""
    if engine_kind(cfg) == "torch" and cfg.data_parallel_size > 1:
        s.buckets = s.grads
        notes.append("DDP: gradient buckets counted as a second copy of the gradients")


def fsdp_shards(arch: Arch, cfg: Config, s: States, counts: Counts, on_gpu: bool, notes: list[str]) -> None:
    """FSDP2: like ZeRO-3 over the data-parallel (x context-parallel) ranks, fp32 states, the root unit kept gathered
    from forward to backward beside one block at a time (every block kept gathered with
    parallelism.fsdp_reshard_after_forward=false); in bf16 under precision=bf16 (layouts.mesh.fsdp_gathers_bf16)."""
    p = cfg.parallelism
    n = cfg.data_parallel_size * p.cp
    w, g, _ = s.bytes_per_param
    s.weights, s.grads, s.opt = s.weights / n, s.grads / n, s.opt / n
    s.split *= n
    gather = 2 if fsdp_gathers_bf16(cfg) else w  # a weight as gathered; gradients reduce-scattered in fp32 either way
    s.frozen, s.gathered = fsdp_frozen_and_gathered(arch, cfg, s.frozen, gather, g)
    root_trained = tp_whole_params(arch, cfg, counts)[0]  # the root's trainable part: whole on every rank of a TP group
    s.root_end = (gather + g) * root_trained - g * root_trained / n  # its own shards' gradients not there yet
    if not p.fsdp_reshard_after_forward and not (p.fsdp_offload and on_gpu):  # the other blocks too
        s.gathered += gather * (sum(b.params for b in arch.layers) - arch.block_params) / (p.tp * p.pp)
    if fsdp_gathers_bf16(cfg):
        notes.append("FSDP2 in mixed precision (precision=bf16): fp32 shards, each unit gathered and computed in bf16 "
                     "(MixedPrecisionPolicy, no autocast), gradients reduce-scattered in fp32")


def fsdp_offload(arch: Arch, cfg: Config, s: States, counts: Counts, on_gpu: bool, notes: list[str]) -> None:
    """FSDP2's CPUOffloadPolicy: the shards (weights, gradients, optimizer states, the frozen base) live in CPU RAM and
    are copied in for each block. On CPU ranks it moves nothing."""
    if on_gpu:
        s.cpu += s.weights + s.grads + s.opt + s.frozen
        s.weights = s.grads = s.opt = s.frozen = 0.0


# -- work terms -----------------------------------------------------------------------------------------------------

def context_work(arch: Arch, cfg: Config, w: Work, notes: list[str]) -> None:
    """Context parallel: each rank holds 1/cp of every row's tokens (attention: all of them, for 1/cp of the heads), one
    block's all-to-all buffers in flight (q, k, v as sent and as received); its own mask covers packed rows only."""
    cp = cfg.parallelism.cp
    w.tokens = -(-w.seq // cp) * w.rows
    w.exchange = w.tokens * 2 * dtypes(cfg).compute * (arch.q_dim + 2 * arch.kv_dim) / cfg.parallelism.tp
    w.labelled = -(-w.labelled // cp) if w.labelled is not None else None
    w.own_mask = True
    notes.append(f"context parallel: {w.tokens // w.rows} of each row's {w.seq} tokens on each of {cp} ranks; attention over all "
                 f"{w.seq} for 1/{cp} of the heads (the score terms stay per token x {w.seq}); one block's all-to-all "
                 "buffers added")


def pipeline_work(arch: Arch, cfg: Config, w: Work, notes: list[str]) -> None:
    """Pipeline parallel: a stage's blocks, the micro-batches its schedule keeps in flight on the first stage (all of
    them for gpipe, up to pp for 1f1b), every row with gradients (a stage cannot run part of a micro-batch without)."""
    p = cfg.parallelism
    micro_batches = max(1, cfg.grad_accum_steps)
    w.layers = math.ceil(arch.num_hidden_layers / p.pp)
    w.in_flight = micro_batches if p.pp_schedule == PipeSchedule.gpipe else min(p.pp, micro_batches)
    w.tokens += w.seq * w.no_grad_rows
    w.rows, w.no_grad_rows = w.rows + w.no_grad_rows, 0
    notes.append(f"pipeline: {w.layers} blocks per stage, {w.in_flight} micro-batches in flight on the first stage; "
                 "the logits (last stage) are added too: a conservative worst rank")
