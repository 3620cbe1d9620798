"""`python -m finetune.evaluate ...`: lm-eval benchmarks on a run's final/ (finetune/rank/evaluate.py). This module keeps the name users type."""

import sys

from finetune.rank.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
