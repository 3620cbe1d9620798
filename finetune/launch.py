"""`python -m finetune.launch ...`: the launcher: compose, check, plan, then start the job (finetune/launcher/launch.py). This module keeps the name users type."""

from finetune.launcher.launch import main

if __name__ == "__main__":
    main()
