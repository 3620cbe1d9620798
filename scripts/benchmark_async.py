"""GRPO with its rollout sampled before each step against sampled in the background while the step trains
(method.async_generation): one Markdown table of step times.

    python scripts/benchmark_async.py                        # CPU: the quickstart's model, 12 steps, 1 rank
    python scripts/benchmark_async.py --steps 20 --completion-tokens 48 --generations 8

Each run is a real launch (`python -m finetune.launch +recipe=quickstart_sft method=grpo ...`, random init, one rank)
of the same job; the step's wall time is the difference of consecutive `elapsed_s` in its metrics.jsonl (sampling,
waiting for it, and training all included), the median over the steps after the first 2. Printed per run: that wall
time, the mean `generation_s` (the time the step spent on its rollout: sampling it, or waiting for the background's),
`step_s` (training) and `sampling_s` (the background's own sampling time), and the wall time over the synchronous run's
sampling + training. Runs: synchronous with 1 thread, synchronous with --threads (the cores the overlapped run uses),
overlapped with 1 thread per side (OMP_NUM_THREADS=1: the sampler's thread and training's each run their own), and
overlapped with --threads per side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def launch(root: Path, name: str, args: argparse.Namespace, threads: int, overlapped: bool) -> dict[str, float]:
    run = root / name
    cmd = [sys.executable, "-m", "finetune.launch", "+recipe=quickstart_sft", "method=grpo", "method.rewards=[similarity]",
           f"method.generations={args.generations}", f"method.completion_tokens={args.completion_tokens}", "parallelism=single",
           "launcher.nproc_per_node=1", f"launcher.omp_num_threads={threads}", f"train.max_steps={args.steps}",
           "optim.warmup_steps=0", "optim.lr=1e-4", f"train.micro_batch_size={args.prompts}", f"train.global_batch_size={args.prompts}",
           "train.exact_match_samples=0", "train.eval_every=0", "train.progress_bar=false", "train.tensorboard=false",
           f"method.async_generation={str(overlapped).lower()}", f"hydra.run.dir={run}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if out.returncode:
        sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"][2:]
    walls = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(train, train[1:])]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in train)  # noqa: E731
    return {"wall": statistics.median(walls), "generation": mean("generation_s"), "train": mean("step_s"),
            "sampling": mean("sampling_s")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one-thread-only", action="store_true", help="only the two runs with 1 thread (a quick check)")
    args = parser.parse_args(argv)
    plan = [("synchronous, 1 thread", 1, False), (f"synchronous, {args.threads} threads", args.threads, False),
            ("overlapped, 1 thread each side", 1, True), (f"overlapped, {args.threads} threads each side", args.threads, True)]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: launch(Path(tmp), f"run{i}", args, threads, overlapped) for i, (name, threads, overlapped) in enumerate(plan)
                if threads == 1 or not args.one_thread_only}
    base = runs["synchronous, 1 thread"]
    print("| run | step wall s | generation_s | step_s (training) | sampling_s (background) | wall / (sync sampling + training) |")
    print("|---|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['wall']:.3f} | {r['generation']:.3f} | {r['train']:.3f} | {r['sampling']:.3f} | "
              f"{r['wall'] / (base['generation'] + base['train']):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
