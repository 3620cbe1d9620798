"""The launcher side: what runs where the command is typed (compose, check, plan, build and supervise the launch).
Imports no torch, transformers or deepspeed; never imports finetune.rank."""
