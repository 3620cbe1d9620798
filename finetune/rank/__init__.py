"""The torch side: what each rank runs (train, the loop, the engines, the model and its layouts), and the commands
that load a trained model the way a rank does (generate, export, evaluate). Never imports finetune.launcher."""
