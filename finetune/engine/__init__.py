"""How a step runs. The loop calls one interface; engines differ behind it:

- `torch`: a plain module, DDP for data parallel (FSDP2 / TP / PP arrive with the parallelism issue).
- `deepspeed`: ZeRO stages and offload (arrives with the ZeRO issue).

An engine owns the model, optimizer, scheduler and gradient scaling, and exposes
`train_step(micro_batches, objective, count)`, `eval_loss(batch, objective)`, `generation_model`
and `export(path, tokenizer)`.
"""

from __future__ import annotations

from typing import Any

from finetune.config import Config
from finetune.dist import Dist
from finetune.engine.torch_engine import TorchEngine


def build(cfg: Config, model: Any, dist: Dist) -> TorchEngine:
    return TorchEngine(model, optim=cfg.optim, max_steps=cfg.train.max_steps, strategy=cfg.parallelism.strategy, dist=dist)
