"""Suggestions: override sets that make a config fit, found by walking docs/memory.md's order of strategies (16-bit
precision, fused attention, chunked logits; low-memory optimizer states; a smaller micro batch; ZeRO or FSDP;
activation checkpointing; LoRA, QLoRA; tensor, then context parallel), cheapest first, each one planned again.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

from finetune import optimizers
from finetune.config import (AttnImpl, Checkpointing, Config, ConfigError, Logits, Offload, PeftMethod, Precision, StateDtype)
from finetune.layouts import engine_kind
from finetune.data.lengths import Longest
from finetune.planner.counts import GIB
from finetune.planner.peak import Plan, plan
from finetune.launcher.rules import validate


@dataclass(frozen=True)
class Move:
    """One strategy change: the override(s) that make it, its place in docs/memory.md's order of what to
    try first, and a rough step-time factor (relative, for ranking; not a measurement)."""

    overrides: tuple[str, ...]
    level: int
    cost: float
    apply: Callable[[Config], None]


def _set(path: str, value: Any) -> Callable[[Config], None]:
    def apply(cfg: Config) -> None:
        *parents, leaf = path.split(".")
        target: Any = cfg
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)
    return apply


def _all(*fns: Callable[[Config], None]) -> Callable[[Config], None]:
    def apply(cfg: Config) -> None:
        for fn in fns:
            fn(cfg)
    return apply


def moves(cfg: Config) -> list[list[Move]]:
    """The axes a suggestion may change, each a list of alternatives (an empty choice is implied),
    in docs/memory.md's order: 16-bit precision, fused attention and chunked logits; low-memory optimizer states,
    bf16_pure and stepping in backward; a smaller micro batch with more
    accumulation; ZeRO-1/2 (+offload); ZeRO-3 (+offload) or FSDP; activation checkpointing; LoRA,
    then QLoRA; tensor parallel; context parallel. Costs are rough step-time factors: one extra forward for full
    recompute (~4/3), PCIe-bound offload, ~0.8 for LoRA (no weight gradients)."""
    from finetune.config import Strategy as S

    axes: list[list[Move]] = []
    precision = [Move(("precision=bf16",), 0, 1.0, _set("precision.name", Precision.bf16))] if cfg.precision.name == Precision.fp32 else []
    if cfg.precision.name in (Precision.fp32, Precision.bf16):  # no fp32 master: a numerics change, like the optimizer's
        precision.append(Move(("precision=bf16_pure",), 2, 1.0, _set("precision.name", Precision.bf16_pure)))
    axes.append(precision)
    if cfg.model.attn_implementation == AttnImpl.eager:
        axes.append([Move(("model.attn_implementation=sdpa",), 0, 1.0, _set("model.attn_implementation", AttnImpl.sdpa))])
    if cfg.logits.name == Logits.full:  # the head recomputed per chunk: ~one more head matmul
        axes.append([Move(("logits=chunked",), 0, 1.02, _set("logits.name", Logits.chunked))])
    if optimizers.record(cfg.optim.name).moments and not cfg.zero.enabled:  # adam/adamw's two fp32 moments
        states = [Move(("optim.state_dtype=bf16",), 2, 1.02, _set("optim.state_dtype", StateDtype.bf16))] \
            if cfg.precision.name != Precision.bf16_pure and cfg.optim.state_dtype != StateDtype.bf16 else []
        if cfg.precision.name != Precision.bf16_pure:  # its bf16 weights need a compensated update (optimi's)
            states += [Move((f"optim={name}",), 2, 1.03, _set("optim.name", name))
                       for name, rec in optimizers.RECORDS.items() if rec.low_memory]
        axes.append(states)
    if not cfg.optim.in_backward and cfg.world_size == 1 and engine_kind(cfg) == "torch" and cfg.grad_accum_steps == 1:
        axes.append([Move(("optim.in_backward=true", "optim.max_grad_norm=null"), 2, 1.0,
                          _all(_set("optim.in_backward", True), _set("optim.max_grad_norm", None)))])
    micro, dp, batch = cfg.train.micro_batch_size, cfg.data_parallel_size, cfg.train.global_batch_size
    smaller = [m for m in (micro // 2, micro // 4, micro // 8, micro // 16, 1) if 0 < m < micro and batch % (m * dp) == 0]
    axes.append([Move((f"train.micro_batch_size={m}",), 1, 1.08 ** math.log2(micro / m), _set("train.micro_batch_size", m))
                 for m in dict.fromkeys(smaller)])
    p, z = cfg.parallelism, cfg.zero
    if p.tp == p.pp == 1 and p.strategy != S.fsdp:
        zero = lambda stage, opt=Offload.none, par=Offload.none: _all(  # noqa: E731
            _set("zero.stage", stage), _set("zero.offload_optimizer", opt), _set("zero.offload_param", par))
        options = [Move(("zero=stage1",), 2, 1.02, zero(1)), Move(("zero=stage2",), 2, 1.05, zero(2)),
                   Move(("zero=stage2_offload",), 2, 1.6, zero(2, Offload.cpu)), Move(("zero=stage3",), 3, 1.2, zero(3)),
                   Move(("zero=stage3_offload",), 3, 2.5, zero(3, Offload.cpu, Offload.cpu))]
        if not z.enabled and cfg.world_size > 1:
            options.append(Move(("parallelism=fsdp",), 3, 1.15, _set("parallelism.strategy", S.fsdp)))
        rank = {(s, o, q): i for i, (s, o, q) in enumerate([(1, "none", "none"), (2, "none", "none"), (2, "cpu", "none"),
                                                             (3, "none", "none"), (3, "cpu", "cpu")])}
        now = rank.get((z.stage, z.offload_optimizer.value, z.offload_param.value), -1) if z.enabled else -1
        axes.append([m for i, m in enumerate(options) if i > now])
    if cfg.checkpointing.name in (Checkpointing.none, Checkpointing.selective):
        ck = [Move(("checkpointing=full",), 4, 4 / 3, _set("checkpointing.name", Checkpointing.full))]
        if cfg.checkpointing.name == Checkpointing.none:
            ck.insert(0, Move(("checkpointing=selective",), 4, 1.17, _all(_set("checkpointing.name", Checkpointing.selective),
                                                                           _set("checkpointing.every", 2))))
        axes.append(ck)
    if cfg.peft.name in (PeftMethod.none, PeftMethod.lora):
        peft = [Move(("peft=qlora",), 6, 1.0, _set("peft.name", PeftMethod.qlora))]
        if cfg.peft.name == PeftMethod.none:
            peft.insert(0, Move(("peft=lora",), 5, 0.8, _set("peft.name", PeftMethod.lora)))
        axes.append(peft)
    if p.tp == 1 and p.pp == 1 and not z.enabled:
        axes.append([Move((f"parallelism=tp{t}",), 7, 1 + 0.1 * math.log2(t), _all(_set("parallelism.tp", t), _set("parallelism.strategy", S.ddp)))
                     for t in (2, 4, 8) if cfg.world_size % t == 0])
    if p.pp == 1 and p.cp == 1 and not z.enabled:  # the last resort: a sequence's activations split over ranks
        to_fsdp = p.strategy == S.single  # parallelism=cpN is FSDP over the cp ranks; keep the user's dp strategy otherwise
        axes.append([Move((f"parallelism=cp{n}",) if to_fsdp else (f"parallelism.cp={n}",), 8, 1 + 0.15 * math.log2(n),
                          _all(_set("parallelism.cp", n), *([_set("parallelism.strategy", S.fsdp)] if to_fsdp else [])))
                     for n in (2, 4, 8) if cfg.world_size % (n * p.tp) == 0])
    return [axis for axis in axes if axis]


@dataclass
class Suggestion:
    overrides: list[str]
    plan: Plan
    cost: float
    moves: tuple[Move, ...] = ()


def _sibling(a: tuple[Move, ...], b: tuple[Move, ...], axis_of: dict[Move, int]) -> bool:
    """Whether a and b make the same moves but one, on the same axis."""
    only_a, only_b = set(a) - set(b), set(b) - set(a)
    return len(only_a) == len(only_b) == 1 and axis_of[next(iter(only_a))] == axis_of[next(iter(only_b))]


def suggest(cfg: Config, base: list[str] | None = None, count: int = 3, budget_evals: int = 4000,
            longest: Longest | None = None) -> list[Suggestion]:
    """The first `count` override sets that fit, walking docs/memory.md's order (the latest strategy a set
    needs, then its rough step-time cost); a set that adds to one already printed is skipped. With
    `base` (the command line), each one is composed again through the launcher's path and re-planned,
    so what is printed is what that command line would do."""
    axes = moves(cfg)
    axis_of = {m: i for i, axis in enumerate(axes) for m in axis}
    combos = [()]  # type: list[tuple[Move, ...]]
    for axis in axes:
        combos = [c + (m,) for c in combos for m in [None, *axis]]  # type: ignore[list-item]
    ranked = sorted(((tuple(m for m in c if m is not None)) for c in combos if any(c)),
                    key=lambda c: (max(m.level for m in c), math.prod(m.cost for m in c), len(c)))
    found: list[Suggestion] = []
    for combo in ranked[:budget_evals]:
        if len(found) == count:
            break
        overrides = [o for m in combo for o in m.overrides]
        if any(set(f.moves) <= set(combo) or _sibling(f.moves, combo, axis_of) for f in found):
            continue  # adds to a printed set, or is a printed set with one choice made costlier
        trial = copy.deepcopy(cfg)
        for m in combo:
            m.apply(trial)
        try:
            validate(trial)
            pl = plan(trial, longest)
        except ConfigError:
            continue
        if not pl.fits:
            continue
        if base is not None:  # what the printed command line really composes to
            from finetune.launcher.compose import preflight

            keys = {o.split("=", 1)[0] for o in overrides}
            try:
                pl = plan(preflight([b for b in base if b.lstrip("+~").split("=", 1)[0] not in keys] + overrides), longest)
            except ConfigError:
                continue
            if not pl.fits:
                continue
        found.append(Suggestion(overrides, pl, math.prod(m.cost for m in combo), combo))
    return found


def render_suggestions(found: list[Suggestion]) -> str:
    if not found:
        return "no suggestion fits: a smaller model, a shorter data.max_length, more GPUs, or more GPU memory"
    lines = ["fits with (docs/memory.md's order, cheapest first; step time relative to this config, rough):"]
    for s in found:
        lines.append(f"  {' '.join(s.overrides):<60} {s.plan.total / GIB:8.2f} GiB  step x{s.cost:.2f}")
    return "\n".join(lines)
