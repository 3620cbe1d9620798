"""`python -m finetune.prepare ...`: tokenize a recipe's data into the token cache, nothing else (finetune/launcher/prepare.py). This module keeps the name users type."""

import sys

from finetune.launcher.prepare import main

if __name__ == "__main__":
    sys.exit(main())
