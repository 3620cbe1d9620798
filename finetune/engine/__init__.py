"""How a step runs. The loop calls one interface; engines differ behind it:

- `TorchEngine`: a plain module, DDP for data parallel, torch autocast + GradScaler.
- `DeepSpeedEngine`: ZeRO stages 0-3 with CPU/NVMe offload, DeepSpeed's precision and scaler.
- `MeshEngine`: FSDP2, tensor parallel and pipeline parallel on one DeviceMesh (pp, dp, tp).

Both expose `train_step(micro_batches, objective, count) -> StepResult`, `inference(fn, batch)`
(no-grad forward in the compute precision: evaluation, DPO's reference pass), `frozen(model)` (a
second, frozen model placed like the policy: DPO's live reference), `generation_model` (None
under pipeline parallel: no rank holds a whole model), `lockstep` (every rank must run the same
number of forwards), `save(root, step)`,
`load(step_dir) -> step` and `export(path, tokenizer)`, and the data layout: `dp_rank`,
`dp_size` (which share of each batch this rank trains on) and `owner` (whether this rank's
data and loss count in global sums: one rank per model replica under tp/pp).
"""

from __future__ import annotations

from typing import Any

from finetune.config import Config, engine_kind
from finetune.dist import Dist
from finetune.engine.common import StepResult, build_scheduler

__all__ = ["StepResult", "build", "build_scheduler"]


def build(cfg: Config, model: Any, dist: Dist) -> Any:
    kind = engine_kind(cfg)
    if kind == "mesh":
        from finetune.engine.mesh_engine import MeshEngine

        return MeshEngine(model, cfg=cfg, dist=dist)
    if kind == "deepspeed":
        from finetune.engine.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(model, cfg=cfg, dist=dist)
    from finetune.engine.torch_engine import TorchEngine

    return TorchEngine(model, optim=cfg.optim, precision=cfg.precision, max_steps=cfg.train.max_steps,
                       strategy=cfg.parallelism.strategy, dist=dist)
