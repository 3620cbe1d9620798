"""`train.compile=true`: regional compilation, each decoder layer compiled in place.

Every decoder layer of a transformers model (its `GradientCheckpointingLayer`s) gets `nn.Module.compile()`,
as torchtune and torchtitan compile per block: the layers share one code object, so one graph serves them
all (compiled once per shape, then reused), the module tree and state_dict keys stay as they are, and
whatever wraps a layer afterwards (PEFT's adapters inside it, activation checkpointing around it, FSDP2's
fully_shard, tensor parallel's DTensors, a pipeline stage, DDP or DeepSpeed around the model) still sees
the same modules. Compilation is lazy: the first training step traces and compiles each new shape
(padded batches of a new length compile once more, then dynamically); its seconds are reported apart
from the step's (`compile_s`). Only the training step runs compiled: evaluation, generation and the
reference pass run eager (other shapes and modes, run rarely: compiling them costs more than it saves).
"""

from __future__ import annotations

import contextlib
import shutil
from typing import Iterator

import torch

from finetune.config import Checkpointing, CheckpointingConfig, ConfigError


def compile_layers(model: torch.nn.Module, device: torch.device) -> int:
    """Compile each decoder layer of `model` in place; returns how many. A model whose layers are not
    transformers' GradientCheckpointingLayer (remote code, an old class) is refused: which module is a
    block is not ours to guess."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
        if shutil.which(compiler) is None:
            raise ConfigError(f"train.compile=true on CPU compiles C++ with {compiler}, which is not installed: install "
                              "a C++ compiler (apt install g++), or set train.compile=false")
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(f"train.compile=true compiles each decoder layer (transformers' GradientCheckpointingLayer), "
                          f"and this {kind} model has none (remote code or an older model class): set train.compile=false")
    import torch._inductor.config

    torch._inductor.config.fallback_random = True  # dropout draws eager's masks: the eager run's trajectory, not another
    for layer in layers:
        layer.compile()
    return len(layers)


def checkpointed_eager(checkpointing: CheckpointingConfig, per_sample: str) -> str:
    """What the compile line adds where checkpointed layers hold the per-sample attention (`per_sample`: what lays several
    samples in a row, finetune.rank.varlen, "" where none does): that attention runs outside the graph, and dynamo
    cannot split a checkpointed layer around it (a checkpoint is one higher-order op), so those layers run eagerly. Under
    checkpointing=full (ops, full_offload) that is every layer, and nothing would compile: refused."""
    if not per_sample or checkpointing.name in (Checkpointing.none, Checkpointing.offload):
        return ""
    why = (f"{per_sample} attend each sample alone outside the compiled graph (finetune.rank.varlen), and dynamo cannot split "
           "a checkpointed layer around it")
    if checkpointing.name != Checkpointing.selective:
        raise ConfigError(f"train.compile=true with checkpointing={checkpointing.name.value}: {why}, so every layer would run "
                          "eagerly and nothing compile: use checkpointing=offload (or selective) with train.compile=true, or set "
                          "data.packing=false and data.padding_free=false (padded rows compile under checkpointing)")
    k = checkpointing.every
    return f"; the checkpointed layers (blocks 0, {k}, {2 * k}, ...) run eagerly: {why}"


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run compiled layers eagerly in this block (evaluation, generation, the reference pass)."""
    with torch.compiler.set_stance("force_eager"):
        yield


def seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo, AOT autograd and inductor, forward and
    backward graphs)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))
