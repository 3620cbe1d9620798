"""Sequence parallel under tensor parallel (`parallelism.sequence_parallel`, on by default with tp > 1; Korthikanti et
al. 2022, laid out as torchtitan lays out Llama, with torch's DTensor), for any family whose tensor-parallel plan
finetune.rank.parallel applies.

Tensor parallel alone leaves every rank of a TP group the whole sequence between the sublayers it splits: the
residual stream and the norms' tensors are replicated. With sequence parallel they are split along the sequence
(`Shard(1)`): each rank holds 1/tp of the tokens of the residual stream, runs the norms (and dropouts) on its tokens,
and saves 1/tp of what they keep for backward; under activation checkpointing each block's input, the one tensor a
checkpointed block keeps, is 1/tp too. Where a sublayer needs the whole sequence (attention, the MLP: whatever the
block holds besides its norms), its input is all-gathered; the row-wise projection that ends it (o_proj, down_proj)
reduce-scatters its partial sums straight into this rank's tokens instead of all-reducing them. The communication is
tensor parallel's: an all-gather and a reduce-scatter per sublayer where there was one all-reduce.

Where the sequence is split, and why there: the embedding output stays whole, so the family's forward builds its mask,
rotary embeddings and cache positions for the whole sequence from it (transformers reads them off the embedding
output's shape: a sliced one would give masks of the wrong length), and a padding-free row's per-sample attention
(finetune.rank.varlen) reads the whole row's position ids. The first block's input is sliced (its gradient gathered in
backward: the embeddings' gradient is whole on every rank, as without sequence parallel), and the final norm's output
is gathered (the output layer and the loss stay replicated, as they are under tensor parallel). In a pipeline stage
the stage's first block slices and its last gathers: the stages hand each other whole hidden states, as without.

How: between blocks the residual stream is a DTensor sharded on the sequence (its global length travels with it: a
length tp does not divide is split unevenly, as torch.chunk splits it, and nothing is padded); the block's own forward
adds DTensors. A norm (or dropout) runs the family's own code on its local tokens (any implementation: Liger's kernels
too); its weight stays a plain replicated parameter whose gradient covers this rank's tokens only, so the engine sums
it over tp once per step, as it sums Qwen3's per-head q/k norms. A sublayer gets its input gathered: as a DTensor where
every parameter in it is one (torch's column-wise layers then reduce-scatter the input's gradient), else as a plain
tensor (the gradient all-reduced by the column-wise layers themselves, then sliced): a MoE router, LoRA's adapters,
Qwen3's q/k norms. Its output becomes this rank's tokens: the row-wise layer's reduce-scatter, or a slice of a whole
output (transformers' MoE experts all-reduce theirs).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

LOCAL = re.compile(r"(RMS|Layer)Norm|Dropout|Identity")
"""Block children that act on each token alone (by class name: every family's RMSNorm/LayerNorm, Liger's): they run
on this rank's tokens. Any other child is a sublayer that gets the whole sequence."""


def token_local(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.Dropout, nn.Identity)) or bool(LOCAL.search(type(module).__name__))


def sequence_parallel(blocks: list[nn.Module], final_norm: nn.Module | None, tp_mesh: Any) -> list[nn.Parameter]:
    """Install sequence parallel on `blocks` (this module's decoder blocks, in order, already split by tensor parallel)
    and `final_norm` (the norm after the model's last block where this module holds it: its output is gathered; else the
    last block's is). Returns the parameters that now see this rank's tokens only (the norms'): the engine sums their
    gradients over tp."""
    if not blocks:
        return []
    partial: list[nn.Parameter] = []
    for block in blocks:
        for _, child in block.named_children():
            if token_local(child):
                child.register_forward_pre_hook(_local_in, with_kwargs=True)
                child.register_forward_hook(lambda m, a, out: _local_out(m, out, tp_mesh))
                partial += list(child.parameters())
            else:
                whole = all(_is_dtensor(q) for q in child.parameters()) and any(True for _ in child.parameters())
                child.register_forward_pre_hook(lambda m, a, k, whole=whole: _gather_in(m, a, k, keep=whole), with_kwargs=True)
                child.register_forward_hook(lambda m, a, out: _shard_out(m, out, tp_mesh))
    blocks[0].register_forward_pre_hook(lambda m, a, k: _split_first(a, k, tp_mesh), with_kwargs=True)
    if final_norm is None or not token_local(final_norm):  # a stage's (or a family's without a known final norm) last
        blocks[-1].register_forward_hook(lambda m, a, out: _gathered(out))  # block hands on the whole sequence
    else:
        final_norm.register_forward_pre_hook(_local_in, with_kwargs=True)
        final_norm.register_forward_hook(lambda m, a, out: _gathered(_local_out(m, out, tp_mesh)))
        partial += list(final_norm.parameters())
    return [q for q in partial if q.requires_grad]


def _is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def _first(output: Any) -> torch.Tensor | None:
    return output[0] if isinstance(output, tuple) and output and torch.is_tensor(output[0]) else output if torch.is_tensor(output) else None


def _with_first(output: Any, value: torch.Tensor) -> Any:
    return (value, *output[1:]) if isinstance(output, tuple) else value


def _split_first(args: tuple, kwargs: dict, mesh: Any) -> tuple[tuple, dict] | None:
    """The first block's input, whole on every rank, becomes this rank's tokens (a DTensor sharded on the sequence);
    its gradient is gathered whole in backward."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def split(x: torch.Tensor) -> torch.Tensor:
        if _is_dtensor(x) or x.dim() < 2:
            return x
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])

    if args:
        return (split(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": split(kwargs["hidden_states"])}
    return None


def _local_in(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A token-local module's DTensor inputs as this rank's plain tokens (their global length kept for the output)."""
    module._sequence_length = next((x.shape[1] for x in (*args, *kwargs.values()) if _is_dtensor(x)), None)
    return (tuple(x.to_local() if _is_dtensor(x) else x for x in args),
            {k: x.to_local() if _is_dtensor(x) else x for k, x in kwargs.items()})


def _local_out(module: nn.Module, output: Any, mesh: Any) -> Any:
    """A token-local module's output as a DTensor of this rank's tokens again, of the input's global length."""
    from torch.distributed.tensor import DTensor, Shard

    length, module._sequence_length = getattr(module, "_sequence_length", None), None
    first = _first(output)
    if length is None or first is None or _is_dtensor(first):
        return output
    shape = (first.shape[0], length, *first.shape[2:])
    stride = torch.empty(shape, device="meta").stride()
    return _with_first(output, DTensor.from_local(first, mesh, [Shard(1)], run_check=False, shape=shape, stride=stride))


def _gather_in(module: nn.Module, args: tuple, kwargs: dict, *, keep: bool) -> tuple[tuple, dict]:
    """A sublayer's sequence-sharded inputs gathered whole: as DTensors (`keep`: every parameter of it is one) or plain."""
    from torch.distributed.tensor import Replicate

    def whole(x: Any) -> Any:
        if not _is_dtensor(x) or not any(p.is_shard(1) for p in x.placements):
            return x
        module._sequence_split = True
        x = x.redistribute(x.device_mesh, [Replicate()])
        return x if keep else x.to_local()

    module._sequence_split = False
    return tuple(whole(x) for x in args), {k: whole(x) for k, x in kwargs.items()}


def _shard_out(module: nn.Module, output: Any, mesh: Any) -> Any:
    """A sublayer's output (its first tensor) as this rank's tokens: a row-wise layer's reduce-scatter already is; a
    whole output (replicated on the TP group) is sliced, its gradient gathered in backward."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    split, module._sequence_split = getattr(module, "_sequence_split", False), False
    first = _first(output)
    if not split or first is None or first.dim() < 2:
        return output
    if _is_dtensor(first):
        return output if first.placements == (Shard(1),) else _with_first(output, first.redistribute(mesh, [Shard(1)]))
    return _with_first(output, DTensor.from_local(first, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]))


def _gathered(output: Any) -> Any:
    """The residual stream whole again (a plain tensor on every rank): the output layer and the loss are replicated."""
    from torch.distributed.tensor import Replicate

    first = _first(output)
    if first is None or not _is_dtensor(first):
        return output
    return _with_first(output, first.redistribute(first.device_mesh, [Replicate()]).to_local())
