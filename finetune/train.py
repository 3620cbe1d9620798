"""`python -m finetune.train RUN_DIR/config.yaml`: one rank (finetune/rank/train.py), under the name the launch
commands and the docs use."""

from finetune.rank.train import main_and_exit

if __name__ == "__main__":
    main_and_exit()
