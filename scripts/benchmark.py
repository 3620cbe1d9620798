"""Run a set of strategies on this machine and write one Markdown table: peak memory by
category, tokens/s, step time and final loss for each.

    python scripts/benchmark.py                         # the default set, tiny model, this machine
    python scripts/benchmark.py --steps 50 --out bench.md
    python scripts/benchmark.py --only "fp32 baseline" "LoRA r=16"
    python scripts/benchmark.py --extra model=pretrained model.path=Qwen/Qwen2.5-0.5B data.max_length=1024   # a real model

Each row is a real launch (`python -m finetune.launch +recipe=quickstart_sft ...`) of the same
recipe; memory is the run's own report (MemTracker: the first 2 steps, rank 0). On a GPU machine
the same command measures CUDA (and `bf16`/flash-attn rows become meaningful).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SINGLE = ["parallelism=single", "launcher.nproc_per_node=1"]
STRATEGIES: dict[str, list[str]] = {
    "fp32 baseline": SINGLE,
    "bf16 autocast": [*SINGLE, "precision=bf16"],
    "bf16 + compile": [*SINGLE, "precision=bf16", "train.compile=true"],  # no memory by category: the probe is off with it
    "bf16 + compile + Liger": [*SINGLE, "precision=bf16", "train.compile=true", "model.kernels=liger"],  # CUDA, the gpu extra
    "fp8 tensorwise + compile": [*SINGLE, "precision=fp8", "train.compile=true"],  # CUDA 8.9+, the gpu extra (torchao)
    "fp8 rowwise + compile": [*SINGLE, "precision=fp8", "precision.fp8=rowwise", "train.compile=true"],
    "full checkpointing": [*SINGLE, "checkpointing=full"],
    "selective checkpointing (every 2nd)": [*SINGLE, "checkpointing=selective"],
    "op-level checkpointing": [*SINGLE, "checkpointing=ops"],
    "FSDP2 bf16 policy x1": ["parallelism=fsdp", "launcher.nproc_per_node=1", "precision=bf16"],  # against "bf16 autocast"
    "packing": [*SINGLE, "data.packing=true"],
    "LoRA r=16": [*SINGLE, "peft=lora"],
    "DoRA r=16": [*SINGLE, "peft=dora"],
    "QLoRA r=16 (NF4)": [*SINGLE, "peft=qlora"],
    "DDP x2": ["parallelism=ddp", "launcher.nproc_per_node=2"],
    "ZeRO-2 x2": ["zero=stage2", "launcher.nproc_per_node=2", "zero.reduce_bucket_size=5000000", "zero.allgather_bucket_size=5000000"],
    "ZeRO-3 + CPU offload x2": ["zero=stage3_offload", "launcher.nproc_per_node=2", "zero.reduce_bucket_size=5000000"],
}

CUDA_ONLY = {"bf16 + compile + Liger", "fp8 tensorwise + compile", "fp8 rowwise + compile"}
"""Rows whose kernels run on CUDA only: left out of the default set unless the runs are on CUDA (train.device=cuda)."""

REALISTIC = ["model.init.vocab_size=32000", "model.init.max_position_embeddings=1024", "data.max_length=1024", "data.packing=true", "train.micro_batch_size=2",
             "train.global_batch_size=2", *SINGLE]
"""The memory switches where they matter: a 32k vocabulary (the tokenizer's ids fill its first rows) and
packed 1,024-token rows, the quickstart's tiny Llama otherwise."""
VOCAB: dict[str, list[str]] = {
    "32k vocab, full logits": REALISTIC,
    "32k vocab, logits=chunked": [*REALISTIC, "logits=chunked"],
    "32k vocab, optim=adamw_8bit": [*REALISTIC, "optim=adamw_8bit"],
    "32k vocab, optim=adafactor": [*REALISTIC, "optim=adafactor"],
    "32k vocab, optim.state_dtype=bf16": [*REALISTIC, "optim.state_dtype=bf16"],
    "32k vocab, precision=bf16": [*REALISTIC, "precision=bf16"],
    "32k vocab, precision=bf16_pure": [*REALISTIC, "precision=bf16_pure"],
    "32k vocab, bf16_pure without Kahan": [*REALISTIC, "precision=bf16_pure", "precision.kahan_sum=false"],
    "32k vocab, optim.in_backward=true": [*REALISTIC, "optim.in_backward=true", "optim.max_grad_norm=null"],
}


def run(name: str, overrides: list[str], steps: int, extra: list[str], root: Path) -> dict:
    run_dir = root / "".join(c if c.isalnum() else "_" for c in name)  # no '=' etc.: it goes on a Hydra command line
    cmd = [sys.executable, "-m", "finetune.launch", "+recipe=quickstart_sft", *overrides, f"train.max_steps={steps}",
           "optim.warmup_steps=0", "train.exact_match_samples=0", "train.eval_every=0", "train.progress_bar=false",
           "train.tensorboard=false", "train.memory_report=categories", *extra, f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"name": name, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    mem = next((r for r in rows if r["kind"] == "memory"), {})
    planned = next((r for r in rows if r["kind"] == "plan"), {})
    steady = train[2:] or train  # the first 2 steps are measured (slow) and warm-up
    return {
        "name": name,
        "peak": mem.get("mem_peak_total_mib", float("nan")),
        "planned": planned.get("plan_peak_mib", float("nan")),
        "planned_activations": planned.get("plan_activations_mib", float("nan")),
        "params": mem.get("mem_params_mib", float("nan")),
        "grads": mem.get("mem_grads_mib", float("nan")),
        "optimizer": mem.get("mem_optimizer_mib", float("nan")),
        "activations": mem.get("mem_activations_mib", float("nan")),
        "backward_activations": mem.get("mem_backward_activations_mib", float("nan")),
        "planned_logits": planned.get("plan_logits_mib", float("nan")),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "step_ms": 1000 * statistics.median(r["step_s"] for r in steady),
        "loss": train[-1]["loss"],
    }


def dry_run_seconds(times: int, root: Path) -> tuple[float, float]:
    """Median wall and CPU seconds of `python -m finetune.launch +recipe=quickstart_sft launcher.dry_run=true`
    (interpreter start, imports, composition, checks, the plan and the launch line)."""
    walls, cpus = [], []
    for i in range(times):
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run([sys.executable, "-m", "finetune.launch", "+recipe=quickstart_sft", "launcher.dry_run=true",
                        f"hydra.run.dir={root / f'dry{i}'}"], capture_output=True, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        walls.append(time.perf_counter() - start)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


MEMORY_COLUMNS = [("peak MiB", "peak", ".1f"), ("planned peak", "planned", ".1f"), ("params", "params", ".2f"),
                  ("grads", "grads", ".2f"), ("optimizer", "optimizer", ".2f"), ("activations", "activations", ".2f"),
                  ("tokens/s", "tokens_per_s", ",.0f"), ("step ms", "step_ms", ".1f")]
VOCAB_COLUMNS = [("peak MiB", "peak", ".1f"), ("planned peak", "planned", ".1f"), ("params", "params", ".1f"),
                 ("grads", "grads", ".1f"), ("optimizer", "optimizer", ".1f"),
                 ("planned logits/loss", "planned_logits", ".1f"),
                 ("measured activations in backward", "backward_activations", ".1f"), ("planned", "planned_activations", ".1f"),
                 ("tokens/s", "tokens_per_s", ",.0f")]


def table(results: list[dict], steps: int, columns: list[tuple[str, str, str]] = MEMORY_COLUMNS) -> str:
    """One row per result: `columns` (header, key, format), then the loss after `steps`."""
    lines = ["| strategy | " + " | ".join(h for h, _, _ in columns) + f" | loss after {steps} steps |",
             "|---|" + "---:|" * (len(columns) + 1)]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error']} " + "|" * (len(columns) + 1))
            continue
        lines.append(f"| {r['name']} | " + " | ".join(format(r[k], f) for _, k, f in columns) + f" | {r['loss']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("benchmark.md"))
    parser.add_argument("--only", nargs="*", help="strategy names to run (default: all)")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every run")
    parser.add_argument("--dry-runs", type=int, default=5, help="how many dry runs to time (0: none)")
    args = parser.parse_args(argv)
    every = {**STRATEGIES, **VOCAB}
    cuda = "train.device=cuda" in args.extra
    names = args.only or [n for n in every if cuda or n not in CUDA_ONLY]
    unknown = [n for n in names if n not in every]
    if unknown:
        print(f"error: unknown strategy {unknown[0]!r}; known: {', '.join(every)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for name in names:
            print(f"running {name} ...", flush=True)
            results.append(run(name, every[name], args.steps, args.extra, Path(tmp)))
        dry = dry_run_seconds(args.dry_runs, Path(tmp)) if args.dry_runs else None
    machine = f"{os.cpu_count()} CPU cores" if "cuda" not in " ".join(args.extra) else "GPU"
    text = (f"Tiny Llama (quickstart recipe), micro batch 16, {args.steps} steps, {machine}; memory: rank 0, MemTracker, "
            "first 2 steps, MiB; planned peak: the memory planner's prediction for the same config (python -m finetune.plan, "
            "without its fixed overhead); tokens/s: median non-pad tokens/s over all ranks after step 2. Under DeepSpeed, gradients "
            "live in DeepSpeed's flat buffers (counted under peak, not grads), and ZeRO-3 random-inits inside zero.Init "
            "(other initial weights, so another loss).\n\n" + table([r for r in results if r["name"] in STRATEGIES], args.steps))
    vocab = [r for r in results if r["name"] in VOCAB]
    if vocab:
        text += ("\nThe same model with a 32k vocabulary, packed 1,024-token rows, micro batch 2 (the logits: 2,048 x 32,000); "
                 "planned logits/loss: the planner's buffers of the loss at its moment in backward; activations in backward: "
                 "MemTracker's, at the start or the peak of the model's backward, against the plan's.\n\n" + table(vocab, args.steps, VOCAB_COLUMNS))
    if dry:
        text += (f"\nDry run (python -m finetune.launch +recipe=quickstart_sft launcher.dry_run=true), median of {args.dry_runs}: "
                 f"{dry[0]:.2f} s wall, {dry[1]:.2f} s CPU\n")
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
