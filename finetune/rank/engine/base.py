"""The interface every engine implements: what the loop, the reference, evaluation, the checkpoints and the
rank's entry (finetune.train) ask of it. Three engines (finetune/rank/engine/__init__.py lists them) implement it
structurally, each a class of its own; tests/test_engines.py checks that each has every member below.

An engine owns the model as it is placed (DDP, FSDP2/TP/PP on a mesh, DeepSpeed ZeRO), the optimizer, the
schedule, the precision and the loss scaler: the loop never touches them. What differs between methods
arrives as an `Objective` (finetune/methods/base.py): the engine runs it forward and backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from finetune.rank.engine.common import StepResult
    from finetune.methods.base import Objective


class Engine(Protocol):
    """How a step runs on this rank, and what the loop, evaluation and checkpoints read of the placement."""

    @classmethod
    def from_config(cls, model: Any, cfg: Any, dist: Any) -> Engine:
        """The engine over `model` that the run's config asks for (finetune.rank.engine.build, from its record in
        finetune.layouts.ENGINES)."""

    dp_rank: int
    """This rank's index among the data-parallel replicas: which share of each batch it trains on."""
    dp_size: int
    """How many data-parallel replicas share each batch."""
    owner: bool
    """Whether this rank's data and loss count in global sums (one rank per model replica under tp/pp/cp)."""
    lockstep: bool
    """Every rank must run the same number of forwards (parameters gathered collectively: ZeRO-3, FSDP)."""
    dtype: torch.dtype | None
    """The compute precision's dtype (bf16, fp16), None for fp32: what a rollout engine beside it runs in."""

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], objective: Objective, count: float) -> StepResult:
        """One optimizer step over this rank's micro-batches (the loop calls it once per step).

        Args:
            micro_batches: this rank's share of the global batch.
            objective: returns the *summed* loss of a batch and sums of its metrics.
            count: loss units (response tokens, pairs) in the whole global batch, over all ranks.
        """

    def inference(self, fn: Callable[[Any, dict[str, torch.Tensor]], Any], batch: dict[str, torch.Tensor]) -> Any:
        """fn(model, batch) without gradients, in eval mode and the compute precision (evaluation, a precomputed
        reference, the logits=chunked probe); under pipeline parallel `fn.loss` of the last stage's logits."""

    def frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A second, frozen model placed like the policy (DPO's live reference)."""

    @property
    def generation_model(self) -> torch.nn.Module | None:
        """The model to `generate` with (exact-match evaluation); None where no rank holds a whole model (pp)."""

    def memory_targets(self) -> Any:
        """(module, optimizer or optimizers) the memory probe tracks; None where it cannot (pipeline stages)."""

    def save(self, directory: Path, step: int) -> None:
        """This rank's part of a checkpoint of `step` (model, optimizer, schedule, scaler) into `directory`."""

    def load(self, step_dir: Path) -> int:
        """Restore a checkpoint saved by `save`; returns its step (ConfigError when it is not this engine's)."""

    def export(self, path: Path, tokenizer: Any) -> None:
        """The trained model in Hugging Face format (safetensors, config, tokenizer) into `path`."""
