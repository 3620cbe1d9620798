"""An online method's completions (GRPO's, RLOO's) sampled by vLLM (method.vllm=true): an engine on each rank beside training ("colocated", as
TRL's vllm_mode=colocate), holding method.vllm_memory of the GPU for its weights and KV cache.

vLLM is built once per rank from the policy's config and tokenizer (written to a temporary directory) with dummy
weights; before each rollout the policy's weights are loaded into it by their Hugging Face names
(`model.load_weights`, as a checkpoint would be): gathered whole on every rank where the engine shards them (FSDP2's
DTensors, ZeRO-3's partitions), with a LoRA adapter merged in (W + the adapter's delta, computed beside the training
weights, which are left untouched). Each prompt is one request for `method.generations` samples, seeded from
(train.seed, step, rank, micro-batch) as the transformers path is.

Not run on the machines this project is tested on (no GPU, and vLLM's wheels are built for CUDA): tests/test_grpo.py
runs this module against a stand-in with vLLM's interface (tests/vllm_standin) on every layout, and
tests/test_gpu.py runs it against vLLM itself where a GPU is.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from finetune.config import MethodConfig

if TYPE_CHECKING:
    import torch


class VllmSampler:
    """One vLLM engine on this rank; `sync` loads the policy's weights into it, `sample` draws completions."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: MethodConfig, *, prompt_tokens: int | None) -> None:
        from vllm import LLM

        model = engine.generation_model
        self.directory = Path(tempfile.mkdtemp(prefix="finetune-vllm-"))  # config and tokenizer only (a few MB)
        atexit.register(shutil.rmtree, self.directory, True)
        base_config(model).save_pretrained(self.directory)
        tokenizer.save_pretrained(self.directory)
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
            os.environ.setdefault(key, value)  # vLLM's external launcher reads the process group's place (one process: set here)
        with untouched_rng():  # its dummy weights' initialization leaves the run's random stream (dropout) as it was
            self.llm = LLM(model=str(self.directory), load_format="dummy", dtype=str(engine.dtype or "torch.float32").removeprefix("torch."),
                           seed=engine.dp_rank,
                           gpu_memory_utilization=cfg.vllm_memory, tensor_parallel_size=1, distributed_executor_backend="external_launcher",
                           **({"max_model_len": prompt_tokens + cfg.completion_tokens} if prompt_tokens else {}))

    def sync(self, engine: Any) -> None:
        """The policy's weights as they are now into vLLM (collective where they are gathered); the rollout calls it once
        before sampling."""
        runner_model(self.llm).load_weights(hf_weights(engine.generation_model))
        self.llm.reset_prefix_cache()

    def sample(self, prompts: list[list[int]], cfg: MethodConfig, seed: int) -> list[list[int]]:
        """G completions per prompt (adjacent), as vLLM returns them (cut at EOS, which it keeps)."""
        from vllm import SamplingParams

        params = [SamplingParams(n=cfg.generations, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.completion_tokens,
                                 seed=s) for s in prompt_seeds(seed, len(prompts), cfg.generations)]
        with untouched_rng():
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
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


def base_config(model: Any) -> Any:
    """The transformers config of the model under any PEFT or compile wrapper."""
    inner = getattr(model, "_orig_mod", model)
    return (inner.get_base_model() if hasattr(inner, "get_base_model") else inner).config


def runner_model(llm: Any) -> Any:
    """The torch model inside a colocated vLLM engine (its place moved between vLLM's V0 and V1 workers)."""
    worker = llm.llm_engine.model_executor.driver_worker
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    if runner is None or not hasattr(getattr(runner, "model", None), "load_weights"):
        import vllm

        raise RuntimeError(f"method.vllm: vLLM {vllm.__version__} does not expose its model at "
                           "llm.llm_engine.model_executor.driver_worker[.worker].model_runner.model: use vLLM 0.8 to 0.11, or method.vllm=false")
    return runner.model


@contextlib.contextmanager
def whole(model: Any) -> Iterator[None]:
    """ZeRO-3's partitioned parameters gathered on every rank for the duration (collective); others as they are."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            yield
    else:
        yield


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2, TP) gathered whole on every rank (collective); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def hf_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter as a Hugging Face checkpoint of the merged model names it, whole: PEFT's wrappers
    (base_model.model., .base_layer, modules_to_save) unnamed, LoRA's A and B left out and merged into their base
    weight (W + B A scale, peft's own `get_delta_weight`). Every rank iterates it to the end, in the same order (it
    gathers); a value is valid until the next one is drawn (ZeRO-3's gathered storage is released at the end)."""
    import torch
    from peft.tuners.lora import LoraLayer

    inner = getattr(model, "_orig_mod", model)
    layers = {name: m for name, m in inner.named_modules() if isinstance(m, LoraLayer)}
    with torch.no_grad(), whole(inner):
        for name, param in inner.named_parameters():
            if ".lora_" in name or ".original_module." in name:
                continue
            value = full(param.detach())
            owner, _, leaf = name.rpartition(".base_layer.")
            if owner in layers and leaf == "weight":
                layer = layers[owner]
                for adapter in layer.active_adapters:
                    value = value + full(layer.get_delta_weight(adapter)).to(value.dtype)
            yield hf_name(name), value


def hf_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
