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
from typing import TYPE_CHECKING, Any, Callable

from finetune.config import (METHOD_NAME, POSITIVE, TEXT, Accepts, Config, ConfigError, DataFormat, MethodConfig, Spelled, at_least,
                             checked, in_range, unused)
from finetune.disk import vocabulary
from finetune.methods.base import Sampling, TeacherModel
from finetune.methods.sft import Sft

if TYPE_CHECKING:
    import torch

    from finetune.methods.base import Output


Against = Callable[["torch.Tensor", int], "torch.Tensor"]
"""The teacher's side of a batch: (the student's logits of response positions [start, start + n), start) -> [n]."""


class DistillLoss(str, Enum, metaclass=Spelled):
    forward_kl = "forward_kl"
    reverse_kl = "reverse_kl"
    jsd = "jsd"


class TeacherPrecision(str, Enum, metaclass=Spelled):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


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
    teacher_precision: TeacherPrecision | None = None
    """The dtype of the teacher's weights on the ranks (fp32, bf16, fp16); null: the run's weight precision (bf16 under
    precision=bf16_pure, else fp32). A frozen teacher needs no fp32 master weights: bf16 halves it beside a student
    trained with precision=bf16's fp32 weights and autocast. Not under DeepSpeed, whose engine holds it in its own."""
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
    teacher_topk: int | None = checked(POSITIVE, None)
    """K: the teacher's top-K log-probs of every response token computed once before training (and kept beside the
    token cache: a later run on the same data and teacher reads them and loads no teacher), the teacher then freed; the
    divergence is taken over those K tokens plus one bucket for the rest of the vocabulary. null: the teacher runs
    beside the student at every step, over the whole vocabulary."""
    lmbda: float = checked(in_range(0, 1), 0.0)
    """The share of steps that are on-policy (GKD's lambda): on such a step the student samples each row's response
    itself and learns the teacher's distributions on its own tokens; each step is on-policy with this probability, drawn
    from (train.seed, step). 0: offline, the data's responses (1: always the student's)."""
    completion_tokens: int = checked(POSITIVE, 64)
    """With lmbda > 0: the most tokens the student samples for a response (it stops at its EOS token or here)."""
    sampling_temperature: float = checked(POSITIVE, 1.0)
    """With lmbda > 0: the temperature the student samples its responses at (the loss's is `temperature`)."""


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

    def teacher(self, cfg: DistillConfig) -> TeacherModel | None:
        if cfg.teacher is None:
            return None
        return TeacherModel(cfg.teacher, cfg.teacher_precision.value if cfg.teacher_precision is not None else None, cfg.teacher_topk)

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
        if m.teacher_topk is not None and m.lmbda > 0:
            raise ConfigError(f"method.teacher_topk={m.teacher_topk} with method.lmbda={m.lmbda:g} is not supported: the teacher's "
                              "top-k is computed once, before training, and on-policy steps train on responses the student samples "
                              "then; use method.lmbda=0, or drop method.teacher_topk (the teacher runs at every step)")
        if m.lmbda == 0:
            unused(m, "method", tuple(f.name for f in fields(m) if f.name not in ON_POLICY),
                   "with method.lmbda=0 (offline: every step learns on the data's responses)")
        else:
            on_policy_rules(cfg)
        if m.teacher_precision is not None and cfg.zero.enabled:
            raise ConfigError(f"method.teacher_precision={m.teacher_precision.value} with zero=stage{cfg.zero.stage} is not supported: "
                              "DeepSpeed's engine holds the teacher in its own precision (bf16 weights under precision=bf16 or "
                              "bf16_pure); drop method.teacher_precision, or use parallelism=fsdp or ddp without zero")
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

    def sampling(self, cfg: DistillConfig) -> Sampling | None:
        """On-policy steps (lmbda > 0) sample one response per row, up to completion_tokens, through generate."""
        return Sampling(1, cfg.completion_tokens) if cfg.lmbda > 0 else None

    def objective(self, cfg: DistillConfig, reference: Any, router: Any, head: Any) -> DISTILL:
        return (GKD if cfg.lmbda > 0 else DISTILL)(cfg, reference, router, head)


ON_POLICY = ("completion_tokens", "sampling_temperature")
"""The keys of on-policy steps (method.lmbda > 0)."""


def on_policy_rules(cfg: Config) -> None:
    """method.lmbda > 0: rows with a prompt to sample after, one sample per row or laid end to end, a text model."""
    from finetune.disk import local_vision

    said = f"method.lmbda={cfg.method.lmbda:g}"
    if cfg.data.format == DataFormat.text:
        raise ConfigError(f"{said}: on-policy steps sample a response to each row's prompt, and data.format=text rows have none: "
                          "use alpaca, chat, sharegpt or completion rows, or method.lmbda=0")
    if cfg.data.packing:
        raise ConfigError(f"data.packing=true with {said} is not supported: an on-policy step replaces each sample's response with "
                          "the student's, of another length, so rows cannot be packed in advance: set data.packing=false "
                          "(padding-free micro-batches still lay the samples end to end)")
    if local_vision(cfg.model) is not None:
        raise ConfigError(f"{said} with model.path={cfg.model.path}, a vision-language model, is not built: the student's "
                          "samples would need the rows' images again; use method.lmbda=0")


METHOD = Distill()


def divergence(student: torch.Tensor, teacher: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
    """The per-position divergence of `cfg.loss` between the teacher's and the student's logits ([..., V], both over the
    shared vocabulary), in fp32 (the module docstring's formulas)."""
    import torch.nn.functional as F

    return divergence_of(F.log_softmax(student.float() / cfg.temperature, -1), F.log_softmax(teacher.float() / cfg.temperature, -1), cfg)


def divergence_of(q: torch.Tensor, p: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
    """`divergence` from the student's and the teacher's log-probs over one set of outcomes ([..., n], fp32): the whole
    vocabulary, or (method.teacher_topk) the teacher's top-k tokens and the rest of the vocabulary as one."""
    import torch

    if cfg.loss == DistillLoss.forward_kl:
        return (p.exp() * (p - q)).sum(-1)
    if cfg.loss == DistillLoss.reverse_kl:
        return (q.exp() * (q - p)).sum(-1)
    m = torch.logsumexp(torch.stack([p + math.log(cfg.beta), q + math.log(1 - cfg.beta)]), 0)
    return cfg.beta * (p.exp() * (p - m)).sum(-1) + (1 - cfg.beta) * (q.exp() * (q - m)).sum(-1)


def buckets(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N, V] logits -> [N, K + 1] log-probs at `temperature` of the K tokens `ids` [N, K] names and of all the others
    together (the tail bucket): method.teacher_topk's outcomes, the same for the teacher (its top K) and the student."""
    import torch

    z = logits.float() / temperature
    whole = torch.logsumexp(z, -1, keepdim=True)
    rest = torch.logsumexp(z.scatter(-1, ids, float("-inf")), -1, keepdim=True)
    return torch.cat([z.gather(-1, ids), rest], -1) - whole


def top_k(logits: torch.Tensor, cfg: DistillConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's table rows (method.teacher_topk) for its [N, V] logits: its top K tokens [N, K] (int32) and the
    log-probs of those and of the tail bucket [N, K + 1], at the temperature."""
    import torch

    assert cfg.teacher_topk is not None, "method.teacher_topk"
    top = logits.float().topk(cfg.teacher_topk, -1).indices
    return top.to(torch.int32), buckets(logits, top, cfg.temperature)


def table_settings(cfg: DistillConfig) -> dict[str, Any]:
    """What a top-k table depends on of the method's settings (finetune.rank.topk's key)."""
    return {"k": cfg.teacher_topk, "temperature": cfg.temperature}


class DISTILL:
    """The distillation loss over a batch of SFT rows (`teacher`: finetune.rank.teacher.Teacher, or with method.teacher_topk
    finetune.rank.topk.TopK)."""

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
            raise RuntimeError("method=distill needs its teacher: finetune.rank.teacher loads it")
        with torch.no_grad():
            against = self.against(batch)
        if self.head is None:
            logits, aux = forward_aux(model, batch, self.router is not None)
            loss, metrics = self.loss(logits, batch, against)
        else:  # logits=chunked: the student's chunks make its logits a chunk at a time, each compared with the teacher's
            with self.head.labelled(batch["labels"], chunk=self.chunk(against)):
                logits, aux = forward_aux(model, batch, self.router is not None)
            sums = self.head.take()[0]
            loss, metrics = self.total(sums[:, 0], sums[:, 1] if sums.shape[1] > 1 else None)
            loss = loss + tie(logits)
        return self.router.apply(loss, metrics, aux, self.count(batch)) if self.router else (loss, metrics)

    def against(self, batch: dict[str, torch.Tensor]) -> Against:
        """The teacher's side of the batch's response tokens, as a function of the student's logits of positions
        [start, start + n) (row order) and start -> their divergence: from the teacher's whole logits (logits=full),
        its hidden states and output layer a chunk at a time (logits=chunked), or its top-k table (method.teacher_topk)."""
        from finetune.data.tokenize import IGNORE
        from finetune.methods.losses import predicting

        cfg = self.cfg
        if cfg.teacher_topk:
            ids, logps = self.teacher.lookup(batch)
            return lambda logits, start: divergence_of(
                buckets(logits, ids[start : start + len(logits)].to(logits.device), cfg.temperature),
                logps[start : start + len(logits)].to(logits.device), cfg)
        if self.head is not None:
            hidden = self.teacher.hidden(batch)
            return lambda logits, start: divergence(logits, self.teacher.head_logits(hidden[start : start + len(logits)]), cfg)
        labels = batch["labels"]
        taught = predicting(self.teacher.logits(batch), labels)[labels[:, 1:] != IGNORE][..., : self.teacher.vocab]
        return lambda logits, start: divergence(logits, taught[start : start + len(logits)], cfg)

    def chunk(self, against: Against) -> Any:
        """The student's output layer's per-chunk function: positions [start, start + n) of the response tokens -> their
        divergence (and with sft_weight their cross-entropy)."""
        import torch
        import torch.nn.functional as F

        def per_chunk(head: Any, student: torch.Tensor, targets: torch.Tensor, start: int) -> torch.Tensor:
            logits = head.logits(student)[..., : self.teacher.vocab]
            values = [against(logits, start)]
            if self.cfg.sft_weight:
                values.append(F.cross_entropy(logits.float(), targets, reduction="none"))
            return torch.stack(values, -1)

        return per_chunk

    def loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], against: Against | None = None) -> Output:
        """The loss from the student's whole logits (logits=full)."""
        import torch.nn.functional as F

        from finetune.data.tokenize import IGNORE
        from finetune.methods.losses import predicting

        if against is None:
            raise RuntimeError("method=distill under a pipeline's last stage is refused before launch")
        labels = batch["labels"]
        keep = labels[:, 1:] != IGNORE
        student = predicting(logits, labels)[keep][..., : self.teacher.vocab]
        nll = F.cross_entropy(student.float(), labels[:, 1:][keep], reduction="sum") if self.cfg.sft_weight else None
        return self.total(against(student, 0).sum(), nll)

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


@dataclass(frozen=True)
class Draw:
    """How an on-policy step samples (what finetune.methods.sampling.sample reads of an online method's settings)."""

    completion_tokens: int
    temperature: float
    generations: int = 1
    top_p: float = 1.0


def on_policy(lmbda: float, seed: int, step: int) -> bool:
    """Whether `step` samples the student's responses: a draw with probability lmbda from (seed, step) alone, the same
    on every rank and in a resumed run."""
    import numpy as np

    return bool(np.random.default_rng([seed, step, 0x676B64]).random() < lmbda)


def prompts_of(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """Each sample's prompt: its tokens before its last response (the last run of labelled tokens)."""
    from finetune.data.batches import samples
    from finetune.data.tokenize import IGNORE

    prompts = []
    ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
    for r, a, b in samples(batch):
        labelled = [i for i in range(a, b) if labels[r][i] != IGNORE]
        if not labelled:
            raise RuntimeError("method.lmbda: a training sample has no response tokens to sample in its place (data.format=text "
                               "rows are refused before launch; is the data's format detected as text?)")
        first = labelled[-1]
        while first - 1 >= a and labels[r][first - 1] != IGNORE:
            first -= 1
        if first == a:
            raise RuntimeError("method.lmbda: a training sample is all response, with no prompt to sample after")
        prompts.append(ids[r][a:first])
    return prompts


class GKD(DISTILL):
    """On-policy distillation (GKD, Agarwal et al. 2024, arXiv:2306.13649, algorithm 1): on a share `method.lmbda` of the
    steps the student samples each row's response after its prompt (finetune.methods.sampling.sample, the online
    methods' path: generate through the engine, seeded by (train.seed, step, rank, micro-batch)), and the step learns the
    teacher's distributions on those tokens; the other steps are DISTILL's, on the data's responses. An
    OnlineObjective: the loop calls `rollout` before each step. The metric `on_policy` is 1 on a sampled step, else 0."""

    rollout_every = 1

    def __init__(self, cfg: DistillConfig, teacher: Any, router: Any = None, head: Any = None) -> None:
        super().__init__(cfg, teacher, router, head)
        self.prompt_tokens: int | None = None
        self.eval_metrics = self.metrics  # evaluation scores the data's responses: no sampling
        self.metrics = (*self.metrics, "on_policy")

    def rollout(self, engine: Any, micro_batches: list[dict[str, torch.Tensor]], *, step: int, tokenizer: Any, seed: int,
                refill: Any = None, ahead: Any = None) -> tuple[list[dict[str, torch.Tensor]], float]:
        """The step's micro-batches as they are (an offline step), or with each sample's response the student's."""
        import time

        if not on_policy(self.cfg.lmbda, seed, step):
            return micro_batches, 0.0
        tic = time.perf_counter()
        out = [self.sampled(engine, mb, tokenizer, (seed, step, engine.dp_rank, k)) for k, mb in enumerate(micro_batches)]
        return out, time.perf_counter() - tic

    def sampled(self, engine: Any, batch: dict[str, torch.Tensor], tokenizer: Any, seed: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """A micro-batch of the same prompts with the student's sampled responses (labelled; cut after its EOS), laid out
        as the data's were (padded rows, or end to end)."""
        import torch

        from finetune.data.batches import collate
        from finetune.data.tokenize import IGNORE, Example
        from finetune.methods.sampling import sample

        prompts = prompts_of(batch)
        draw = Draw(self.cfg.completion_tokens, self.cfg.sampling_temperature)
        completions = sample(engine, prompts, draw, tokenizer, seed=seed)
        examples = [Example(p + c, [IGNORE] * len(p) + c, len(p), "") for p, c in zip(prompts, completions)]
        out = collate(examples, tokenizer.pad_token_id, flat="attention_mask" not in batch)
        out["sampled"] = torch.ones(out["input_ids"].shape[0])
        return out

    def __call__(self, model: Any, batch: dict[str, torch.Tensor]) -> Output:
        loss, metrics = super().__call__(model, batch)
        metrics["on_policy"] = loss.new_tensor(float(self.count(batch)) if "sampled" in batch else 0.0).detach()
        return loss, metrics

    def save_ahead(self, directory: Any, rank: int) -> None:
        """Nothing is sampled ahead."""

    def restore_ahead(self, engine: Any, directory: Any, rank: int) -> None:
        """Nothing is sampled ahead."""

    def close(self) -> None:
        """No sampler to stop."""
