"""Train the same recipe under several override sets and plot their loss curves on one chart.

    python scripts/loss_curves.py --steps 150 --out docs/bf16_pure.png \
        "precision=bf16" "precision=bf16_pure" "precision=bf16_pure precision.kahan_sum=false"
    python scripts/loss_curves.py --base parallelism=single launcher.nproc_per_node=1 train.global_batch_size=16 \
        optim.max_grad_norm=null --out docs/in_backward.png "optim.in_backward=false" "optim.in_backward=true"

Each curve is a real launch (`python -m finetune.launch +recipe=RECIPE BASE... CURVE...`); the chart
(train loss per step, and each run's eval loss at the end) goes to --out, and a Markdown table of the
loss every steps/5 steps and the final eval loss is printed and written beside it (.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from finetune import logs


def launch(recipe: str, overrides: list[str], steps: int, run_dir: Path) -> tuple[list[float], float | None]:
    """(train loss per step, final eval loss) of one run; exits with the run's last line if it fails."""
    cmd = [sys.executable, "-m", "finetune.launch", f"+recipe={recipe}", *overrides, f"train.max_steps={steps}",
           "train.exact_match_samples=0", "train.eval_every=0", "train.progress_bar=false", "train.tensorboard=false",
           f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        sys.exit(f"error: {' '.join(overrides)}: {lines[-1] if lines else 'failed'}")
    rows = logs.read(run_dir)
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    evals = [r["eval_loss"] for r in rows if r["kind"] == "eval"]
    return losses, (evals[-1] if evals else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("curves", nargs="+", help="one quoted override set per curve")
    parser.add_argument("--recipe", default="quickstart_sft")
    parser.add_argument("--base", nargs="*", default=[], help="overrides shared by every curve")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path("loss_curves.png"))
    args = parser.parse_args(argv)
    if args.steps < 5:
        parser.error("--steps must be at least 5")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, curve in enumerate(args.curves):
            print(f"running {curve} ...", flush=True)
            results[curve] = launch(args.recipe, [*args.base, *curve.split()], args.steps, Path(tmp) / f"run{i}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for curve, (losses, final) in results.items():
        label = curve + (f" (eval {final:.3f})" if final is not None else "")
        ax.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_yscale("log")
    ax.set_title(f"+recipe={args.recipe} " + " ".join(args.base), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)

    marks = sorted({max(1, args.steps * k // 5) for k in range(1, 6)})
    lines = ["| overrides | " + " | ".join(f"loss @ {m}" for m in marks) + " | final eval loss |",
             "|---|" + "---:|" * (len(marks) + 1)]
    for curve, (losses, final) in results.items():
        lines.append(f"| `{curve}` | " + " | ".join(f"{losses[m - 1]:.4f}" for m in marks) + " | "
                     + (f"{final:.4f}" if final is not None else "-") + " |")
    table = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(table)
    print(table + f"chart: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
