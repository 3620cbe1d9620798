"""`python -m finetune.export ...`: a trained model in transformers' form, GGUF, a model card, an upload (finetune/rank/export.py). This module keeps the name users type."""

import sys

from finetune.rank.export import main

if __name__ == "__main__":
    sys.exit(main())
