"""Generation that does not stall training (method.async_generation=true): the next step's rollout is sampled in a
thread, by a copy of the policy, while this step trains.

At step k the copy is refreshed with the policy as it is before step k trains (its weights theta_k-1), and given step
k + 1's prompts; the thread samples and scores them, and takes the copy's log-probs of every completion token, while
the main thread trains step k on the rollout sampled the step before. Step k + 1 then trains, at theta_k, on
completions sampled at theta_k-1: one step off-policy, corrected by the importance ratio pi_theta / pi_sampler per
token against the sampler's log-probs (`old_logps`), clipped by method.epsilon / epsilon_high as PPO's is
(the "one-step off-policy" of Noukhovitch et al. 2024, "Asynchronous RLHF", arXiv:2410.18252). The first step samples
before it trains, with the copy.

Sampling in the thread draws from a generator of its own (finetune.methods.online.GumbelMax): torch's global one
belongs to the training step running meanwhile (dropout), so both stay a function of the seed. A checkpoint keeps
the rollout sampled ahead (`rollout_<rank>.pt`): a resumed run trains on what the uninterrupted one would.

What limits the overlap: both threads share the rank's cores. On a GPU the sampler's kernels and training's
interleave on the device; on CPU the overlap needs a core for each (one rank, OMP_NUM_THREADS below the cores).
With method.vllm_servers (vLLM on devices of its own, finetune.vllm) the thread asks the server for the next
step's completions instead, the policy's weights pushed to it when the copy is refreshed; the copy still scores them
(the sampler's log-probs, in training's own numerics), so the ratio stays exactly 1 where nothing moved. A colocated
vLLM engine (method.vllm without a server) is refused here: it would sample on the training's device meanwhile.
"""

from __future__ import annotations

import contextlib
import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

FILE = "rollout_{rank}.pt"


class SamplerEngine:
    """The engine surface `online.sample` and the log-probs use, over the policy's copy: its own eval mode, the
    policy engine's precision (autocast is per thread: entered again here)."""

    lockstep = False

    def __init__(self, engine: Any) -> None:
        self.policy, self.dp_rank = engine, engine.dp_rank
        self.owner = getattr(engine, "owner", 1)
        self.generation_model = copy.deepcopy(engine.generation_model).eval().requires_grad_(False)
        self.device = next(self.generation_model.parameters()).device

    def inference(self, fn: Callable[[Any, dict[str, torch.Tensor]], Any], batch: dict[str, torch.Tensor]) -> Any:
        import torch

        autocast = getattr(self.policy, "autocast", contextlib.nullcontext)
        with torch.no_grad(), autocast():
            return fn(self.generation_model, {k: v.to(self.device) for k, v in batch.items()})

    def refresh(self) -> None:
        """The policy's weights into the copy (the trainable ones: the rest never change)."""
        import torch

        with torch.no_grad():
            for mine, theirs in zip(self.generation_model.parameters(), self.policy.generation_model.parameters()):
                if theirs.requires_grad:
                    mine.copy_(theirs)


class Background:
    """A rollout made ahead: `submit(step, make)` runs make() in the thread; `take(step)` waits for it. `lag` 1: the
    copy samples the next step's while this one trains; 0 (the tests' reference): each step's is sampled, by the
    copy refreshed just before, and waited for (on policy, nothing overlapped)."""

    lag = 1

    def __init__(self, engine: Any) -> None:
        self.sampler = SamplerEngine(engine)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout")
        self.pending: tuple[int, Future | list[dict[str, torch.Tensor]]] | None = None
        self.sampled_s = 0.0  # how long the last rollout took in the thread

    def submit(self, step: int, make: Callable[[SamplerEngine], list[dict[str, torch.Tensor]]]) -> None:
        def timed() -> list[dict[str, torch.Tensor]]:
            tic = time.perf_counter()
            out = make(self.sampler)
            self.sampled_s = time.perf_counter() - tic
            return out

        self.pending = (step, self.pool.submit(timed))

    def take(self, step: int) -> list[dict[str, torch.Tensor]] | None:
        """The rollout made for `step` (waiting for the thread), or None where none was."""
        if self.pending is None or self.pending[0] != step:
            return None
        held, self.pending = self.pending[1], None
        return held.result() if isinstance(held, Future) else held

    def save(self, directory: Path, rank: int) -> None:
        """The rollout sampled ahead, waited for and written with the checkpoint (a resumed run trains on it)."""
        import torch

        if self.pending is not None:
            step, held = self.pending
            batches = held.result() if isinstance(held, Future) else held
            self.pending = (step, batches)
            torch.save({"step": step, "batches": batches}, directory / FILE.format(rank=rank))

    def load(self, directory: Path, rank: int) -> None:
        import torch

        path = directory / FILE.format(rank=rank)
        if path.is_file():
            state = torch.load(path, weights_only=True)
            self.pending = (state["step"], state["batches"])

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
