"""plan.simulate: the formula planner against the config's real step under FakeTensorMode (finetune/rank/simulate.py).

The shapes are Llama-3.1-8B's and -70B's (recipes/model/), cut to 2 decoder blocks (model.architecture.num_hidden_layers=2):
the planner counts every block alike, so what agrees for 2 blocks of a shape agrees for 32 or 80 (the embeddings and the
output layer, the parts that are not per block, are whole). 512 tokens per row (1,024 under context parallel), micro
batch 1 (2 for one case, with its mask); one process, FSDP2 over 8 or 64 ranks, tensor parallel with sequence parallel
(alone, and x FSDP2), context parallel; full fine-tuning and LoRA; checkpointing none, full, selective (every k-th
block) and ops. Each case is one simulation in this process (3-10 s); the command line runs one more in a child process.
"""

from __future__ import annotations

import re

import pytest

from conftest import REPO, run_cli
from finetune.planner.counts import GIB
from finetune.planner.peak import plan

BOUND = 0.10
"""The formula within 10% of the simulation."""

BASE = ("+recipe=quickstart_sft", "hardware=h100_80g", "precision=bf16", "model.architecture.num_hidden_layers=2",
        "data.max_length=512", "train.micro_batch_size=1")


def layout(ranks: int, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """One process, or FSDP2 over `ranks` (8 per node): a row per data-parallel rank; with parallelism=tp2 in `extra`,
    tensor parallel alone."""
    if ranks == 1:
        return ("parallelism=single", "launcher.nproc_per_node=1", "train.global_batch_size=1")
    tp = next((int(o.split("=")[1]) for o in extra if o.startswith("parallelism.tp=")), 1)
    cp = next((int(o.split("=")[1]) for o in extra if o.startswith("parallelism.cp=")), 1)
    group = next((o for o in extra if o.startswith("parallelism=")), "parallelism=fsdp")
    rows = ranks // (tp * cp) if group == "parallelism=fsdp" else 1
    return (group, f"launcher.nproc_per_node={min(ranks, 8)}", f"launcher.nnodes={max(1, ranks // 8)}",
            f"train.global_batch_size={rows}")


CASES = {  # name -> (model, ranks, extra overrides)
    "8b-single-full": ("llama3_1_8b", 1, ()),
    "8b-single-lora-ckpt": ("llama3_1_8b", 1, ("peft=lora", "checkpointing=full")),
    "8b-fsdp8-full": ("llama3_1_8b", 8, ()),
    "8b-fsdp8-full-ckpt-mb2": ("llama3_1_8b", 8, ("checkpointing=full", "train.micro_batch_size=2", "train.global_batch_size=16")),
    "8b-fsdp64-lora": ("llama3_1_8b", 64, ("peft=lora",)),
    "70b-fsdp64-full-ckpt": ("llama3_1_70b", 64, ("checkpointing=full",)),
    "8b-single-selective": ("llama3_1_8b", 1, ("checkpointing=selective", "checkpointing.every=2")),
    "8b-fsdp8-ops": ("llama3_1_8b", 8, ("checkpointing=ops",)),
    "8b-tp2-sp": ("llama3_1_8b", 2, ("parallelism=tp2",)),
    "8b-tp2-sp-lora-ckpt": ("llama3_1_8b", 2, ("parallelism=tp2", "peft=lora", "checkpointing=full")),
    "8b-fsdp4-tp2-sp-ckpt": ("llama3_1_8b", 8, ("parallelism.tp=2", "checkpointing=full")),
    "8b-fsdp4-cp2": ("llama3_1_8b", 8, ("parallelism.cp=2", "data.max_length=1024")),
    "70b-fsdp8-tp8-sp-ckpt": ("llama3_1_70b", 64, ("parallelism.tp=8", "checkpointing=full")),
}


def simulated(compose, name: str):
    from finetune.launcher import simulation
    from finetune.rank import simulate

    model, ranks, extra = CASES[name]
    cfg = compose([*BASE, f"model={model}", *layout(ranks, extra), *[o for o in extra if not o.startswith("parallelism=")]])
    pl = plan(cfg)
    sim = simulate.simulate(cfg, pl.width, cfg.world_size)
    return {row[0]: row[1:] for row in simulation.rows(pl, sim)}, sim


def ratios(rows) -> dict[str, float]:
    """formula / simulated per category; a category under 1% of the simulated peak on both sides counts as agreeing (LoRA's
    adapters' states: kilobytes, their ratio says nothing)."""
    floor = rows["peak"][1] / 100
    return {k: 1.0 if max(f, m) < floor else (f / m if m else float("inf")) for k, (f, m, _) in rows.items()}


GATHER = "weights: FSDP2 keeps a group's all-gather output until the next group's all-gather in forward (AllGatherState), beside the unsharded parameters copied out of it: the formula counts the gathered parameters once"
FSDP_ACTS = ("activations: under FSDP2 the tracker books the root group's unsharded gradients (embeddings and output layer) as "
             "activations; the formula counts them at their own moment, the root's post-backward (Plan: root_end; the peaks agree)")
LORA_PEAK = ("peak: the formula puts the gathered parameters at every moment of the step, so LoRA's worst one (in the "
             "forward) gets the backward's activations on top: over by 20%, on the safe side (a forward moment of its own is next)")
GAPS = {  # case -> {category: cause}: more than 10% apart, reported (not loosened); strict: a fixed formula fails here
    "8b-single-full": {},
    "8b-single-lora-ckpt": {},
    "8b-fsdp8-full": {"activations": FSDP_ACTS},
    "8b-fsdp8-full-ckpt-mb2": {"activations": FSDP_ACTS},
    "8b-fsdp64-lora": {"peak": LORA_PEAK},
    "70b-fsdp64-full-ckpt": {"weights": GATHER, "activations": FSDP_ACTS},
    "8b-single-selective": {},
    "8b-fsdp8-ops": {"activations": FSDP_ACTS},
    "8b-tp2-sp": {},
    "8b-tp2-sp-lora-ckpt": {},
    "8b-fsdp4-tp2-sp-ckpt": {"activations": FSDP_ACTS},
    "8b-fsdp4-cp2": {"activations": FSDP_ACTS},
    "70b-fsdp8-tp8-sp-ckpt": {"activations": FSDP_ACTS},
}


@pytest.mark.parametrize("name", list(CASES))
def test_formula_within_10_percent_of_the_simulation(compose, name):
    rows, sim = simulated(compose, name)
    table = "; ".join(f"{k} {f / GIB:.3f}/{m / GIB:.3f}" for k, (f, m, _) in rows.items())
    print(f"{name}: formula/simulated GiB: {table}; peak at {sim['peak_at']}")
    off = {k: round(r, 2) for k, r in ratios(rows).items() if abs(r - 1) > BOUND}
    assert set(off) == set(GAPS[name]), (f"{name}: formula/simulated off by more than {BOUND:.0%}: {off}, known gaps "
                                         f"{sorted(GAPS[name])} ({table})")


def test_the_command_prints_the_table(tmp_path):
    """python -m finetune.plan ... plan.simulate=true: the plan, then the simulated table (8B shape, 2 blocks, FSDP x 8)."""
    done = run_cli(*BASE, "model=llama3_1_8b", *layout(8), "plan.simulate=true", cwd=tmp_path, module="finetune.plan", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "memory plan per rank" in out and "simulated step, GiB -- rank 0 of 8 under FakeTensorMode (MeshEngine, FSDPMemTracker" in out
    for name in ("weights", "gradients", "optimizer", "activations", "temporaries", "peak"):
        assert re.search(rf"^  {name} +[\d.]+ +[\d.]+ ", out, re.M), (name, out)
    peak = re.search(r"^  peak +([\d.]+) +([\d.]+)", out, re.M)
    assert abs(float(peak[1]) / float(peak[2]) - 1) <= BOUND, out


def test_a_layout_it_cannot_simulate_is_refused_in_one_line(tmp_path):
    done = run_cli(*BASE, "model=llama3_1_8b", "parallelism=pp2", "launcher.nproc_per_node=2", "train.global_batch_size=2",
                   "plan.simulate=true", cwd=tmp_path, module="finetune.plan", timeout=120)
    assert "simulated step: none (plan.simulate: parallelism.pp=2: MemTracker cannot hook the pipeline schedule's backward)" in done.stdout, \
        done.stdout + done.stderr

