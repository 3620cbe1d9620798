"""Rebuild the summary of a sweep directory and print its Markdown table.

    python scripts/sweep_summary.py outputs/multirun/DATE/TIME

Writes SWEEP_DIR/summary.csv, summary.md and loss_curves.png from the trials' run directories
(the launch rewrites them after every trial; this is for a sweep still running elsewhere, one that
was interrupted, or one copied from another machine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from finetune.launcher import sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir", type=Path, help="the sweep directory (hydra.sweep.dir), holding one subdirectory per trial")
    args = parser.parse_args(argv)
    if not (args.sweep_dir.is_dir() and sweep.trial_dirs(args.sweep_dir)):
        print(f"error: {args.sweep_dir} is not a sweep directory (one subdirectory per trial, N/.hydra/)", file=sys.stderr)
        return 2
    print(sweep.report(args.sweep_dir, sweep.write(args.sweep_dir)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
