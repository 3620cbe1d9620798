"""Memory planner: per-rank bytes of a composed config, before anything starts.

    python -m finetune.plan +recipe=quickstart_sft [group=option ...] hardware=h100_80g [plan.suggest=true] [plan.simulate=true]

Composes exactly as `finetune.launch` does (its `preflight`), then `plan(cfg)` counts, for the
rank that needs the most: weights, gradients, optimizer states, activations, logits/loss buffers
and a fixed framework overhead, and what offload puts in CPU RAM / on NVMe. The total is the
peak: the larger of the backward peak and the optimizer step (the categories do not all peak
together). The formulas are those of docs/memory.md (ZeRO paper, Korthikanti et al. 2022),
with activations counted tensor by tensor for the block each family runs (finetune/families/
reads what differs from the config), checked against autograd's saved tensors and MemTracker
(tests/test_plan.py, tests/test_plan_families.py), at the longest batch the run will see: the CLI
reads the data (finetune/data/lengths.py; without it, data.max_length, an upper bound). `suggest` walks
docs/memory.md's order of strategies for override sets that fit. Exit code 0: fits; 1: does not
fit; 2: a config mistake (one line).

This module is the command (`python -m finetune.plan` runs its `main`) and the rendering; the package's other
modules are the planner (finetune/planner/__init__.py lists them). Reading the data (here, or a launch that does
not fit at data.max_length) takes about a second for the quickstart's 4,000 rows, without torch.
"""

from __future__ import annotations

import sys

from finetune.data import lengths, steps
from finetune.config import Config, ConfigError
from finetune.data.lengths import Longest
from finetune.planner.counts import GIB
from finetune.planner.peak import Plan, plan
from finetune.launcher.suggest import render_suggestions, suggest
from finetune.launcher import simulation


def render(cfg: Config, pl: Plan) -> str:
    """The per-rank table in GiB, the offload lines and the verdict."""
    hw = cfg.hardware
    gib = lambda b: f"{b / GIB:10.2f}"  # noqa: E731
    where = f"{hw.gpu_memory_gib:g} GiB per GPU" if hw.gpu_memory_gib > 0 else \
        f"no GPU: {hw.cpu_memory_gib:g} GiB RAM shared by {cfg.launcher.nproc_per_node} rank(s)"
    lines = [f"memory plan per rank, GiB (2^30 bytes) -- hardware={hw.name} ({where}); {cfg.world_size} rank(s), "
             f"tp={cfg.parallelism.tp} pp={cfg.parallelism.pp} dp={cfg.data_parallel_size}"
             + (f" cp={cfg.parallelism.cp}" if cfg.parallelism.cp > 1 else ""),
             f"parameters   {pl.params:,} ({pl.trainable:,} trainable)"]
    for name, value in (("weights", pl.weights), ("gradients", pl.gradients), ("optimizer", pl.optimizer),
                        ("activations", pl.activations), ("logits/loss", pl.logits), ("overhead", pl.overhead),
                        *((("rollout", pl.rollout),) if pl.rollout else ()), *((("vllm", pl.reserved),) if pl.reserved else ())):
        lines.append(f"  {name:<12}{gib(value)}")
    when = pl.peak_at
    lines.append(f"  {'total':<12}{gib(pl.total)}   of {pl.budget / GIB:.2f}  (the peak, at {when}: gradients fill in as "
                 "activations are freed, so the categories do not all peak together)")
    if pl.cpu_bytes:
        lines.append(f"cpu RAM per node (offload, loading) {pl.cpu_bytes / GIB:.2f} GiB of {hw.cpu_memory_gib:g}")
    if pl.nvme_bytes:
        lines.append(f"NVMe per node (offload)    {pl.nvme_bytes / GIB:.2f} GiB of {hw.nvme_gib:g}")
    lines += [f"note: {n}" for n in pl.notes]
    if pl.fits:
        lines.append(f"FITS (headroom {pl.headroom / GIB:.2f} GiB)")
    else:
        short = max(pl.total - pl.budget, pl.cpu_bytes - pl.cpu_budget, pl.nvme_bytes - pl.nvme_budget)
        lines.append(f"DOES NOT FIT (short by {short / GIB:.2f} GiB)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from finetune.launcher.compose import preflight  # composes and validates like the launcher; imports no torch

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1])  # the usage line and what it counts
        return 0
    try:
        cfg = preflight(args)
        counted(cfg)
        longest = read_longest(cfg)
        pl = plan(cfg, longest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(cfg, pl), flush=True)
    if cfg.plan.simulate:  # the real step under fake tensors, in a child process (the rank side: torch)
        print(simulation.render(cfg, pl, simulation.measure(cfg, pl)))
    if cfg.plan.suggest and not pl.fits:
        print(render_suggestions(suggest(cfg, args, cfg.plan.suggestions, longest=longest)))
    return 0 if pl.fits else 1


def counted(cfg: Config) -> None:
    """train.epochs -> train.max_steps as the launcher counts them (which rows the steps reach); when they cannot be
    counted here, the plan goes on without (it needs only the longest batch) and says why."""
    try:
        steps.resolve(cfg, lambda line: print(f"# {line}"))
    except ConfigError as e:
        print(f"# train.max_steps not counted: {e}")


def read_longest(cfg: Config) -> Longest | None:
    """The longest batch from the run's data (finetune.data.lengths: tokenizes without torch); its width is
    None, with the reason, when the data cannot be read (the plan then says data.max_length is an upper
    bound); None under pipeline parallel, which pads every micro-batch to data.max_length."""
    if cfg.parallelism.pp > 1:
        return None
    found = lengths.longest_batch(cfg)
    return Longest(None, found) if isinstance(found, str) else found
