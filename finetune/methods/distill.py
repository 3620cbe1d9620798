"""Knowledge distillation (method=distill): the student (the trained model) learns the next-token distributions of a
frozen teacher (`method.teacher`) on the data's response tokens.

The losses, per response token t, between the teacher's distribution P = softmax(z_teacher / T) and the student's
Q = softmax(z_student / T) at temperature T (`method.temperature`), over the one vocabulary both share:

    forward_kl   KL(P || Q) = sum_v P_v (log P_v - log Q_v)       the classic (Hinton et al. 2015, without the T^2
                                                                  factor, as TRL's GKDTrainer and torchtune's KD write it)
    reverse_kl   KL(Q || P) = sum_v Q_v (log Q_v - log P_v)       mode-seeking (MiniLLM, Gu et al. 2024)
    jsd          beta KL(P || M) + (1 - beta) KL(Q || M),  M = beta P + (1 - beta) Q
                                                                  generalized JSD (GKD, Agarwal et al. 2024, eq. 2;
                                                                  TRL's generalized_jsd_loss), beta in (0, 1)

plus `method.sft_weight` x the student's cross-entropy on the response tokens (at temperature 1). The sum over the
response tokens is the loss; the loop divides it by the step's response tokens, as for SFT.

The data is SFT's (every form it reads, packing and padding-free rows included): distillation only changes what each
response token is trained towards. The teacher is loaded once on each rank (a model directory, a run directory's final/
or a hub id; a PEFT adapter merged into its base), frozen, in eval mode, in the run's precision, and placed by the
engine like DPO's live reference (finetune.rank.reference.teacher): replicated under DDP, sharded like the policy under
ZeRO-3 and FSDP2. Its vocabulary must be the student's, token for token: the launcher compares local tokenizers before
a rank starts and a rank compares the loaded ones; the logits are compared over that shared vocabulary (a family may pad
its output layer past the tokenizer, by different amounts at different sizes: Qwen2.5's 0.5B and 7B).

With logits=chunked neither model's [tokens x vocab] logits exist at once: the teacher's forward leaves the final hidden
states of the response positions (its output layer patched, as the student's is by finetune.rank.head), and the student's
output layer computes each chunk of `logits.chunk_tokens` positions from both hidden states inside a checkpoint
(recomputed in backward). With logits=full both models' logits are whole, the plain reference the chunked path equals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.config import (METHOD_NAME, POSITIVE, TEXT, Accepts, Config, ConfigError, MethodConfig, Spelled, at_least, checked,
                             unused)
from finetune.disk import vocabulary
from finetune.methods.sft import Sft

if TYPE_CHECKING:
    import torch

    from finetune.methods.base import Output


class DistillLoss(str, Enum, metaclass=Spelled):
    forward_kl = "forward_kl"
    reverse_kl = "reverse_kl"
    jsd = "jsd"


@dataclass
class DistillConfig(MethodConfig):
    """method=distill: the student learns a frozen teacher's next-token distributions on the response tokens."""

    name: str = checked(METHOD_NAME, "distill")
    teacher: str | None = checked(TEXT, None)
    """The model to learn from: a model directory, a run directory (its final/) or a hub id; its tokenizer must be the
    student's, token for token."""
    teacher_recipe_if_missing: str | None = checked(TEXT, None)
    """When method.teacher (a run directory, or its final/) does not exist yet, the launcher first runs this recipe into it
    (as model.recipe_if_missing does for the student)."""
    loss: DistillLoss = DistillLoss.forward_kl
    """forward_kl (KL(teacher || student), the classic), reverse_kl (KL(student || teacher), mode-seeking) or jsd (the
    generalized Jensen-Shannon divergence of GKD, weighted by `beta`)."""
    beta: float = checked(Accepts("in (0, 1)", lambda v: 0 < v < 1, ("0", "1")), 0.5)
    """jsd: the teacher's weight in the mixture M = beta P + (1 - beta) Q (GKD's beta; its ends are forward_kl and
    reverse_kl in the limit, which method.loss names)."""
    temperature: float = checked(POSITIVE, 1.0)
    """Both models' logits are divided by it before the softmax (above 1: softer distributions)."""
    sft_weight: float = checked(at_least(0), 0.0)
    """Weight of the student's cross-entropy on the response tokens, added to the divergence (0: distillation alone)."""


def teacher_dir(where: str) -> Path | None:
    """The local directory `method.teacher` names (a run directory's final/), or None for a hub id."""
    path = Path(where).expanduser()
    if (path / "config.yaml").is_file():
        return path / "final"
    if path.exists() or where.startswith((".", "/", "~")) or where.count("/") != 1:
        return path
    return None


def differences(teacher: dict[str, int], student: dict[str, int]) -> str | None:
    """The first tokens in which two vocabularies differ, in words, or None when they are the same."""
    if teacher == student:
        return None
    said = []
    for token in sorted(set(teacher) | set(student), key=lambda t: (teacher.get(t, student.get(t, 0)), t)):
        t, s = teacher.get(token), student.get(token)
        if t != s:
            said.append(f"{token!r} is {'absent' if t is None else t} in the teacher's and {'absent' if s is None else s} in "
                        f"the student's")
        if len(said) == 3:
            break
    return f"{len(set(teacher) ^ set(student))} tokens in one only, {len(teacher)} against {len(student)} in all; " + "; ".join(said)


def mismatch(where: str, differ: str) -> ConfigError:
    return ConfigError(f"method.teacher={where}: its tokenizer is not the student's ({differ}): distillation compares the two "
                       "models' distributions token by token, so both need one vocabulary; use a teacher of the student's family")


class Distill(Sft):
    """The distillation record (finetune.methods.base.Method): SFT's data, a teacher's loss."""

    name = "distill"
    config = DistillConfig
    split_tokens = ("the teacher's forward is not split over context-parallel ranks; use parallelism.cp=1 (with "
                    "logits=chunked and checkpointing=full for long rows)")

    def teacher(self, cfg: DistillConfig) -> str | None:
        return cfg.teacher

    def make_first(self, cfg: DistillConfig, make: Any) -> None:
        if cfg.teacher is not None and cfg.teacher_recipe_if_missing is not None:
            cfg.teacher = make("method.teacher", "method.teacher_recipe_if_missing", cfg.teacher, cfg.teacher_recipe_if_missing)

    def validate(self, cfg: Config) -> None:
        super().validate(cfg)
        m = cfg.method
        if m.teacher is None:
            raise ConfigError("method=distill needs method.teacher: the model to learn from (a model directory, a run directory "
                              "or a hub id), whose tokenizer is the student's")
        if m.loss != DistillLoss.jsd:
            unused(m, "method", tuple(f.name for f in fields(m) if f.name != "beta"), f"with method.loss={m.loss.value} (only with jsd)")
        p = cfg.parallelism
        if p.tp > 1 or p.pp > 1:
            key, value = ("parallelism.tp", p.tp) if p.tp > 1 else ("parallelism.pp", p.pp)
            raise ConfigError(f"method=distill with {key}={value} is not supported: the teacher is placed replicated (DDP) or "
                              "sharded like the student (zero=stage3, parallelism=fsdp), not split by layers or heads; use one "
                              "of those to fit it")
        local = teacher_dir(m.teacher)
        if local is None or (m.teacher_recipe_if_missing is not None and not local.exists()):
            return  # a hub id, or made first by its recipe: the ranks compare the tokenizers once both are loaded
        if not (local / "config.json").is_file() and not (local / "adapter_config.json").is_file():
            what = "no such directory" if not local.exists() else "not a model directory (no config.json or adapter_config.json)"
            raise ConfigError(f"method.teacher={m.teacher}: {what}: give a model directory, a run directory or a hub id")
        student_dir = cfg.model.tokenizer or cfg.model.path
        mine, theirs = (vocabulary(Path(student_dir).expanduser()) if student_dir else None), vocabulary(local)
        if mine is not None and theirs is not None and (differ := differences(theirs, mine)) is not None:
            raise mismatch(m.teacher, differ)

    def objective(self, cfg: DistillConfig, reference: Any, router: Any, head: Any) -> DISTILL:
        return DISTILL(cfg, reference, router, head)


METHOD = Distill()


def divergence(student: torch.Tensor, teacher: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
    """The per-position divergence of `cfg.loss` between the teacher's and the student's logits ([..., V], both over the
    shared vocabulary), in fp32 (the module docstring's formulas)."""
    import torch
    import torch.nn.functional as F

    q = F.log_softmax(student.float() / cfg.temperature, -1)
    p = F.log_softmax(teacher.float() / cfg.temperature, -1)
    if cfg.loss == DistillLoss.forward_kl:
        return (p.exp() * (p - q)).sum(-1)
    if cfg.loss == DistillLoss.reverse_kl:
        return (q.exp() * (q - p)).sum(-1)
    m = torch.logsumexp(torch.stack([p + math.log(cfg.beta), q + math.log(1 - cfg.beta)]), 0)
    return cfg.beta * (p.exp() * (p - m)).sum(-1) + (1 - cfg.beta) * (q.exp() * (q - m)).sum(-1)


class DISTILL:
    """The distillation loss over a batch of SFT rows (`teacher`: finetune.rank.reference.Teacher)."""

    def __init__(self, cfg: DistillConfig, teacher: Any, router: Any = None, head: Any = None) -> None:
        self.cfg, self.teacher, self.router, self.head = cfg, teacher, router, head
        self.metrics: tuple[str, ...] = ("divergence", *(("nll",) if cfg.sft_weight else ()), *((router.metric,) if router else ()))

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Units the loss is averaged over: the response tokens (SFT's)."""
        from finetune.data.tokenize import IGNORE

        return int((batch["labels"][:, 1:] != IGNORE).sum())

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        import torch

        from finetune.methods.losses import forward_aux, tie

        if self.teacher is None:
            raise RuntimeError("method=distill needs its teacher: finetune.rank.reference.setup loads it")
        if self.head is None:
            with torch.no_grad():
                teacher = self.teacher.logits(batch)
            logits, aux = forward_aux(model, batch, self.router is not None)
            loss, metrics = self.loss(logits, batch, teacher)
        else:  # logits=chunked: the teacher's hidden states, then the student's chunks make both logits a chunk at a time
            with torch.no_grad():
                hidden = self.teacher.hidden(batch)
            chunk = self.chunk(hidden)
            with self.head.labelled(batch["labels"], chunk=chunk):
                logits, aux = forward_aux(model, batch, self.router is not None)
            sums = self.head.take()[0]
            loss, metrics = self.total(sums[:, 0], sums[:, 1] if sums.shape[1] > 1 else None)
            loss = loss + tie(logits)
        return self.router.apply(loss, metrics, aux, self.count(batch)) if self.router else (loss, metrics)

    def chunk(self, hidden: torch.Tensor) -> Any:
        """The student's output layer's per-chunk function: positions [start, start + n) of the response tokens -> their
        divergence (and with sft_weight their cross-entropy), from the student's and the teacher's hidden states."""
        import torch
        import torch.nn.functional as F

        def per_chunk(head: Any, student: torch.Tensor, targets: torch.Tensor, start: int) -> torch.Tensor:
            vocab = self.teacher.vocab
            logits = head.logits(student)[..., :vocab]
            values = [divergence(logits, self.teacher.head_logits(hidden[start:start + student.shape[0]]), self.cfg)]
            if self.cfg.sft_weight:
                values.append(F.cross_entropy(logits.float(), targets, reduction="none"))
            return torch.stack(values, -1)

        return per_chunk

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], teacher: torch.Tensor | None = None) -> Output:
        """The loss from both models' whole logits (logits=full)."""
        import torch.nn.functional as F

        from finetune.data.tokenize import IGNORE
        from finetune.methods.losses import predicting

        if teacher is None:
            raise RuntimeError("method=distill under a pipeline's last stage is refused before launch")
        labels, vocab = batch["labels"], self.teacher.vocab
        keep = labels[:, 1:] != IGNORE
        student, taught = predicting(logits, labels)[keep][..., :vocab], predicting(teacher, labels)[keep][..., :vocab]
        nll = F.cross_entropy(student.float(), labels[:, 1:][keep], reduction="sum") if self.cfg.sft_weight else None
        return self.total(divergence(student, taught, self.cfg).sum(), nll)

    def total(self, divergence: torch.Tensor, nll: torch.Tensor | None) -> Output:
        """(summed loss, metric sums) from the summed divergence and, with sft_weight, the summed cross-entropy."""
        metrics = {"divergence": divergence.detach().sum()}
        loss = divergence.sum()
        if nll is not None:
            metrics["nll"] = nll.detach().sum()
            loss = loss + self.cfg.sft_weight * nll.sum()
        return loss, metrics

    def rows_loss(self, logps: torch.Tensor, batch: dict[str, torch.Tensor]) -> Output:
        raise RuntimeError("method=distill under a pipeline's last stage is refused before launch")
