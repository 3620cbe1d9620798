"""method=distill's teacher on a rank (finetune.methods.distill): loaded once, frozen, placed by the engine like DPO's
live reference (replicated under DDP, in an optimizer-less DeepSpeed engine, sharded like the policy under ZeRO-3 and
FSDP2), and asked for what the loss compares with: its whole logits (logits=full), or (logits=chunked) the final hidden
states of the response positions, which its output layer then turns into logits a chunk at a time.

For the chunks, the output layer's weight is held whole on every rank: the weight itself where it is not sharded, a
copy gathered once where it is (ZeRO-3, FSDP2; the planner counts it), so that a chunk's logits need no collective
in the middle of the student's forward or in its backward's recomputation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from finetune import methods
from finetune.config import Config, ConfigError, Precision
from finetune.data import rows
from finetune.data.tokenize import IGNORE
from finetune.methods.distill import differences, mismatch
from finetune.methods.losses import forward
from finetune.rank import varlen
from finetune.rank.engine.base import Engine
from finetune.rank.head import post_ops


class Teacher:
    """The frozen teacher (see the module docstring). `vocab`: the tokens both tokenizers share, over which the
    logits are compared."""

    def __init__(self, model: Any, vocab: int) -> None:
        self.model, self.vocab = model, vocab
        head = model.get_output_embeddings()
        self.ops = post_ops(model)
        self.labels: torch.Tensor | None = None
        self.captured: torch.Tensor | None = None
        self._forward, self.head = head.forward, head
        head.forward = self._patched
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def _patched(self, hidden: torch.Tensor) -> torch.Tensor:
        labels, self.labels = self.labels, None
        if labels is None:
            return self._forward(hidden)
        keep = labels[:, 1:] != IGNORE  # the positions that predict a response token (finetune.rank.head's selection)
        self.captured = hidden[:, : labels.shape[1] - 1][keep]
        return hidden[..., :0]

    def place(self, engine: Engine) -> Teacher:
        """Placed by the engine; the output layer's weight kept whole (gathered once where the engine shards it)."""
        self.model = engine.frozen(self.model)
        self.weight, self.bias = whole(self.head.weight), whole(getattr(self.head, "bias", None))
        return self

    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Its logits of the batch, whole (logits=full)."""
        return forward(self.model, batch)

    def hidden(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Its final hidden states at the positions that predict a response token, in row order [N, hidden]."""
        self.labels, self.captured = batch["labels"], None
        try:
            forward(self.model, batch)
        finally:
            self.labels = None
        if self.captured is None:
            raise RuntimeError("method=distill: the teacher's forward did not call its output layer (get_output_embeddings())")
        captured, self.captured = self.captured, None
        return captured

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """What its output layer (and the family's post-processing) makes of `hidden`, over the shared vocabulary."""
        assert self.weight is not None, "place() first"
        # the gathered weight is the shards' dtype (fp32), the hidden states FSDP's bf16 under precision=bf16 (no autocast)
        hidden = hidden.to(self.weight.dtype)
        logits = F.linear(hidden, self.weight[: self.vocab], None if self.bias is None else self.bias[: self.vocab])
        for op in self.ops:
            logits = op(logits)
        return logits


def whole(param: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's whole value on this rank: itself, or a copy gathered from its shards (FSDP2's DTensor, ZeRO-3's
    partitioned parameter); every rank calls it (the gathers are collectives)."""
    if param is None:
        return None
    if hasattr(param, "full_tensor"):
        return param.full_tensor().detach()
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().clone()
    return param.detach()


def load(cfg: Config, *, engine: Engine, tokenizer: Any, attention: str) -> Teacher:
    """`method.teacher` loaded (a run directory's final/, a model directory or a hub id; an adapter merged into its
    base) in method.teacher_precision or the run's weight precision, its tokenizer checked against the student's, attended per sample where the
    student's rows hold several samples, and placed."""
    from finetune.rank.finished import Refusal, load as load_finished, locate

    spec = methods.get(cfg.method.name).teacher(cfg.method)
    assert spec is not None, "a method with a teacher"
    where = spec.where
    try:
        found = locate(where)
    except Refusal as e:
        raise ConfigError(f"method.teacher: {e}") from None
    dtype = spec.precision or ("bf16" if cfg.precision.name == Precision.bf16_pure else "fp32")
    with torch.random.fork_rng(devices=[]):  # loading re-seeds; training's random stream (dropout) stays as it was
        model, theirs = load_finished(found, dtype, attention=attention)
    if (differ := differences(theirs.get_vocab(), tokenizer.get_vocab())) is not None:
        raise mismatch(where, differ)
    model.requires_grad_(False)
    if rows.several_per_row(cfg) and attention in varlen.KERNELS:  # the student's rows: several samples, each alone
        varlen.Varlen(model)
    weight = model.get_output_embeddings().weight
    vocab, rows_out = len(tokenizer), getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 keeps a partition's shape
    if rows_out < vocab:
        raise ConfigError(f"method.teacher={where}: its output layer has {rows_out} rows, fewer than the tokenizer's {vocab} tokens")
    return Teacher(model, vocab).place(engine)
