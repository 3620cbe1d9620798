"""`python -m finetune.generate ...`: sample from a trained model (finetune/rank/generate.py). This module keeps the name users type."""

import sys

from finetune.rank.generate import main

if __name__ == "__main__":
    sys.exit(main())
