"""vLLM's engine as this project builds and drives it, in one process: beside training on each rank (method.vllm,
"colocated": finetune.methods.vllm_rollout) or in a server on devices of its own (method.vllm_servers:
finetune.vllm). Built from a directory holding the policy's config and tokenizer with dummy weights; the policy's
weights are loaded into it by their Hugging Face names before it samples; each prompt is one request for G samples
with a seed of its own.

It imports nothing of finetune but this module: the server runs in vLLM's own virtualenv (vLLM pins its torch), where
`pip install --no-deps finetune` brings it.
"""

from __future__ import annotations

import os
from typing import Any, Iterable


def build(directory: str, *, dtype: str, seed: int, memory: float, max_model_len: int | None) -> Any:
    """vLLM's LLM over `directory` (config and tokenizer) with dummy weights, its model in this process (vLLM's external
    launcher, one process: its process group's place set in the environment where not already), holding `memory` of
    the GPU (gpu_memory_utilization) for its weights and KV cache."""
    from vllm import LLM

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, value)
    with untouched_rng():  # its dummy weights' initialization leaves the process's random stream (dropout) as it was
        return LLM(model=str(directory), load_format="dummy", dtype=dtype, seed=seed, gpu_memory_utilization=memory,
                   tensor_parallel_size=1, distributed_executor_backend="external_launcher",
                   **({"max_model_len": max_model_len} if max_model_len else {}))


def load(llm: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """(Hugging Face name, tensor) pairs into the engine's model, as a checkpoint's would be (vLLM maps them onto its
    fused layers)."""
    runner_model(llm).load_weights(weights)


def sample(llm: Any, prompts: list[list[int]], *, n: int, temperature: float, top_p: float, max_tokens: int, seed: int) -> list[list[int]]:
    """`n` completions of each prompt (adjacent), as vLLM returns them (cut at EOS, which it keeps)."""
    from vllm import SamplingParams

    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=s) for s in prompt_seeds(seed, len(prompts), n)]
    with untouched_rng():
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.token_ids) for out in outputs for o in out.outputs]


def prompt_seeds(seed: int, prompts: int, generations: int) -> list[int]:
    """A seed per prompt's request, spaced `generations` apart: vLLM seeds a request's k-th sample with its seed + k
    (vllm/v1/engine/parallel_sampling.py, a child request per sample), so prompt i's samples draw from seeds
    base + i * G + k, each its own; seeds one apart (seed + i) would give sample k of prompt i the random stream of
    sample k - 1 of prompt i + 1. Below 2**63, as vLLM takes them."""
    base = seed % (2**63 - prompts * generations)
    return [base + i * generations for i in range(prompts)]


def untouched_rng() -> Any:
    """torch's random state (CPU and this process's GPU) restored on exit."""
    import torch

    return torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else [])


def runner_model(llm: Any) -> Any:
    """The torch model inside an engine built by `build` (its place moved between vLLM's V0 and V1 workers)."""
    worker = llm.llm_engine.model_executor.driver_worker
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    if runner is None or not hasattr(getattr(runner, "model", None), "load_weights"):
        import vllm

        raise RuntimeError(f"method.vllm: vLLM {vllm.__version__} does not expose its model at "
                           "llm.llm_engine.model_executor.driver_worker[.worker].model_runner.model: use vLLM 0.8 to 0.11, or method.vllm=false")
    return runner.model
