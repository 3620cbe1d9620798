"""A sweep of one-rank trials, one after another against side by side: the wall time each way, and whether the summaries
agree (train and eval loss per trial).

    python scripts/benchmark_sweep.py [--trials 4] [--steps 20] [--workers 2]

Each way runs the quickstart recipe on the shipped data with `--trials` learning rates:
- one after another: Hydra's basic launcher, every trial on every core (what `-m` does by default);
- side by side: hydra/launcher=joblib with `--workers` workers and launcher.devices_per_trial=1 (a core each here);
- side by side: hydra/launcher=submitit_local (a process per trial) with launcher.devices_per_trial=1.
Prints a table of seconds and the ratio to the first. Needs the sweep extra (pip install -e '.[sweep]').
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def sweep(name: str, extra: list[str], lrs: str, steps: int, work: Path) -> tuple[float, list[dict]]:
    d = work / name
    args = [sys.executable, "-m", "finetune.launch", "-m", "+recipe=quickstart_sft", f"optim.lr={lrs}", f"train.max_steps={steps}",
            "optim.warmup_steps=2", "train.exact_match_samples=0", "train.eval_every=0", "train.progress_bar=false",
            "train.tensorboard=false", "launcher.nproc_per_node=1", "parallelism=single", *extra, f"hydra.sweep.dir={d}"]
    env = {**os.environ, "FINETUNE_DEVICE_LOCKS": str(work / "locks")}
    env.pop("OMP_NUM_THREADS", None)  # each launch decides its threads from its cores
    tic = time.perf_counter()
    out = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - tic
    if out.returncode != 0:
        sys.exit(f"{name}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return seconds, list(csv.DictReader((d / "summary.csv").open()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    lrs = ",".join(f"{(i + 1) * 1e-3:g}" for i in range(args.trials))
    ways = [("one after another", []),
            (f"joblib, {args.workers} workers", ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.workers}",
                                                 "launcher.devices_per_trial=1"]),
            ("submitit_local", ["hydra/launcher=submitit_local", "launcher.devices_per_trial=1"])]
    print(f"{args.trials} one-rank trials of {args.steps} steps on {os.cpu_count()} cores\n")
    print("| how | seconds | vs one after another | train loss per trial |\n|---|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        first = None
        for i, (name, extra) in enumerate(ways):
            seconds, rows = sweep(f"way{i}", extra, lrs, args.steps, Path(tmp))
            first = first or seconds
            losses = " ".join(f"{float(r['train_loss']):.4f}" for r in rows)
            print(f"| {name} | {seconds:.1f} | {seconds / first:.2f}x | {losses} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
