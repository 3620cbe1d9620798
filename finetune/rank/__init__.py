"""The torch side: what each rank runs (train, the loop, the engines, the model and its layouts), and the commands
that load a trained model the way a rank does (generate, export, evaluate). Never imports finetune.launcher."""

import logging

# transformers imports torchao wherever it is installed (its quantizers' registry, at every model load): on a machine
# without CUDA torchao logs that its kernels' libraries do not load, and torch logs a deprecation for each enum torchao
# registers. Neither asks anything of the user, so the rank side keeps them to errors.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
