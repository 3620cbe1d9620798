"""Rows that hold several samples, attended sample by sample: no quadratic mask over the whole row.

A packed row (data.packing) or a padding-free micro-batch (data.padding_free: the micro-batch's samples laid end
to end in one row) carries position ids that restart at 0 for every sample. transformers reads such rows with
sdpa or eager by building a block-diagonal causal mask over the whole row: its memory and its attention
FLOPs grow with the square of the row (a 8,192-token row of 32 samples computes 32 times the scores it needs).
FlashAttention has a variable-length kernel and transformers already calls it for such rows (flash_attention_2
reads the position ids); FlexAttention's backward does not run on a CPU (torch 2.13). So for sdpa and eager,
the model's attention implementation becomes this one (`Varlen`, registered with transformers'
AttentionInterface): where a row holds several samples, the family's own kernel runs once per sample on that
sample's queries, keys and values, causal by itself (sdpa's is_causal; eager gets the sample's small mask), and
the outputs are laid back in order. A row of one sample, and every padded batch (evaluation, generation, the
reference pass, DPO), goes to the family's kernel with transformers' own mask, unchanged.

Where the samples are: the position ids the layer is called with (transformers passes them to the attention
function; the same call in an activation-checkpointing recomputation), else those of the model's forward
(a forward pre-hook, for a family that does not pass them on). Under torch.compile the per-sample split runs
eager (a graph break around attention), since its shapes are the samples' lengths.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from finetune.rank.context import family_eager
from finetune.data.batches import starts
from finetune.data.host import host_copy, on_host

NAME = "finetune_varlen"
"""The attention implementations' (AttentionInterface keys') prefix, one per model: finetune_varlen_sdpa_0, ..."""
_MODELS = itertools.count()
KERNELS = ("sdpa", "eager")
"""The kernels run per sample here; flash_attention_2 has its own variable-length path."""


def sample_lengths(positions: torch.Tensor) -> list[list[int]]:
    """Each row's samples' lengths, in order (they sum to the row's width): read from the micro-batch's host copy
    (finetune.rank.syncs), the position ids the data made, where the engine moved them; else from the device."""
    width, out = positions.shape[1], []
    host = host_copy(positions, "varlen: the samples' lengths from device position ids")
    with on_host():
        for row in starts(host):
            at = row.nonzero().flatten().tolist() + [width]
            out.append([b - a for a, b in zip(at, at[1:])])
    return out


_PACKED = {"find": None, "forwards": 0}
"""transformers' packed-row detection (masking_utils.find_packed_sequence_indices) and how many Varlen forwards run."""


def _packed_rows(position_ids: torch.Tensor) -> torch.Tensor | None:
    """transformers' detection of packed rows, skipped inside a Varlen forward: there a row of several samples gets no
    mask (`Varlen.mask`) and a row of one is not packed, so its answer is None either way, and reading it would wait for
    the device once per forward."""
    return None if _PACKED["forwards"] else _PACKED["find"](position_ids)


def _hook_packed_detection() -> None:
    from transformers import masking_utils

    if _PACKED["find"] is None:
        _PACKED["find"] = masking_utils.find_packed_sequence_indices
        masking_utils.find_packed_sequence_indices = _packed_rows


class Varlen:
    """A model's attention per sample for rows of several samples (see the module's docstring)."""

    def __init__(self, model: nn.Module) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        self.config = model.config
        self.inner = self.config._attn_implementation
        if self.inner not in KERNELS:
            raise ValueError(f"Varlen runs {KERNELS} per sample, not {self.inner}")
        self.eager = family_eager(model) if self.inner == "eager" else None
        if self.inner == "eager" and self.eager is None:
            raise ValueError(f"{self.config.model_type}'s eager attention is not a function transformers names")
        self.inner_mask = ALL_MASK_ATTENTION_FUNCTIONS[self.inner]
        self.lengths: list[list[int]] | None = None  # the forward's rows' samples, when some row holds several
        self.positions: torch.Tensor | None = None
        self.name = f"{NAME}_{self.inner}_{next(_MODELS)}"  # the registry is global: one key per model
        AttentionInterface.register(self.name, self.attention)
        AttentionMaskInterface.register(self.name, self.mask)
        others = {k: getattr(self.config, k) for k in getattr(self.config, "sub_configs", {}) if k != "text_config"}
        self.config._attn_implementation = self.name  # transformers sets it on the sub-configs too
        for sub in (getattr(self.config, "text_config", None),):  # a multimodal wrapper's text model reads its own
            if sub is not None and getattr(sub, "_attn_implementation", None) in (self.inner, self.name):
                sub._attn_implementation = self.name
        for sub in others.values():  # a vision tower's attention is over its patches, not the rows' samples: its own
            if sub is not None and getattr(sub, "_attn_implementation", None) == self.name:
                sub._attn_implementation = self.inner
        model.register_forward_pre_hook(self._forward_begins, with_kwargs=True)
        model.register_forward_hook(self._forward_ends, always_call=True)
        _hook_packed_detection()

    def _forward_ends(self, *_args: Any) -> None:
        _PACKED["forwards"] -= 1

    def _forward_begins(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        positions = kwargs.get("position_ids")
        if positions is not None and positions.dim() == 3:  # M-RoPE's [4, B, S]: the text positions first (vision.rope)
            positions = positions[0]
        _PACKED["forwards"] += 1
        self.positions = positions
        self.lengths = None
        if positions is not None and positions.dim() == 2:
            lengths = sample_lengths(positions)
            if any(len(row) > 1 for row in lengths):
                self.lengths = lengths

    def mask(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' mask for this forward: none where rows hold several samples (each is attended alone),
        else the inner kernel's."""
        return None if self.lengths is not None else self.inner_mask(*args, **kwargs)

    @torch.compiler.disable
    def attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """transformers' attention interface: q [B, H, S, D], k/v [B, K, S, D] -> output [B, S, H, D]."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        kernel = self.eager if self.eager is not None else ALL_ATTENTION_FUNCTIONS[self.inner]
        positions = kwargs.pop("position_ids", None)
        if positions is None:
            positions = self.positions
        lengths = None  # a forward whose rows hold several samples has no mask (self.mask); a recomputation
        if attention_mask is None and positions is not None and positions.shape[-1] == query.shape[2]:  # reads its own
            lengths = self.lengths if positions is self.positions else sample_lengths(positions)
        if lengths is None or all(len(row) == 1 for row in lengths):
            return kernel(module, query, key, value, attention_mask, **kwargs)
        window = kwargs.get("sliding_window")
        rows = []
        for b, row in enumerate(lengths):
            outs = []
            for q, k, v in zip(query[b : b + 1].split(row, 2), key[b : b + 1].split(row, 2), value[b : b + 1].split(row, 2)):
                outs.append(kernel(module, q, k, v, self._sample_mask(q.shape[2], window, q), **kwargs)[0])
            rows.append(torch.cat(outs, dim=1))
        return torch.cat(rows, dim=0), None

    def _sample_mask(self, n: int, window: int | None, q: torch.Tensor) -> torch.Tensor | None:
        """One sample's mask: none for sdpa (its own causal mask) unless a sliding window cuts into the sample;
        eager's additive causal mask (it applies no causality itself)."""
        from finetune.rank.context import whole_mask

        additive = q.dtype if self.eager is not None else None
        return whole_mask(torch.arange(n, device=q.device)[None], window, additive, packed=False)
