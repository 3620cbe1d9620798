"""A stand-in with the part of vLLM's interface finetune.methods.vllm_rollout uses, for machines where vLLM cannot run
(no GPU; vLLM's wheels are built for CUDA). Put its parent directory on PYTHONPATH to use it.

`LLM` builds the model from the directory's config with dummy weights, as vLLM's load_format="dummy" does, and holds
it where a colocated vLLM engine does (llm.llm_engine.model_executor.driver_worker.worker.model_runner.model).
`load_weights` takes (Hugging Face name, tensor) pairs, refusing an unknown name or a wrong shape; `generate` refuses to
run before every parameter was loaded once. It samples with transformers' generate from the first request's seed
(left-padded prompts, n per prompt, top_k off), so that it draws what finetune's own generate path draws from the
same weights: a run through it follows the run without it exactly when the weights it was given are the policy's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable

import torch

__version__ = "0.0+standin"


class SamplingParams:
    def __init__(self, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, max_tokens: int = 16, seed: int | None = None) -> None:
        self.n, self.temperature, self.top_p, self.max_tokens, self.seed = n, temperature, top_p, max_tokens, seed


class Runner:
    """The model vLLM's worker holds, with its load_weights."""

    def __init__(self, net: torch.nn.Module) -> None:
        self.net = net
        self.loaded: set[str] = set()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.net.named_parameters())
        for name, value in weights:
            if name not in params:
                raise KeyError(f"vllm stand-in: the model has no parameter {name}")
            if tuple(params[name].shape) != tuple(value.shape):
                raise ValueError(f"vllm stand-in: {name} is {tuple(params[name].shape)}, given {tuple(value.shape)}")
            with torch.no_grad():
                params[name].copy_(value)
            self.loaded.add(name)
        return self.loaded


class LLM:
    def __init__(self, model: str, *, load_format: str, dtype: str, seed: int, gpu_memory_utilization: float,
                 tensor_parallel_size: int, distributed_executor_backend: str, max_model_len: int | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        assert load_format == "dummy" and tensor_parallel_size == 1 and 0 < gpu_memory_utilization < 1 and distributed_executor_backend == "external_launcher"
        config = AutoConfig.from_pretrained(model)
        # the class itself, as vLLM builds its own: not from_config, which a training process under ZeRO-3 would partition
        net = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).to(getattr(torch, dtype)).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.runner = Runner(net)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=self.runner))))
        self.runner.model = self.runner  # vLLM's model_runner.model: the torch module with load_weights
        self.resets, self.max_model_len = 0, max_model_len

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    @torch.no_grad()
    def generate(self, prompts: list[dict[str, list[int]]], params: list[SamplingParams], use_tqdm: bool = True) -> list[Any]:
        net = self.runner.net
        missing = {n for n, _ in net.named_parameters()} - self.runner.loaded
        if missing:
            raise RuntimeError(f"vllm stand-in: generating with dummy weights, {sorted(missing)[:3]} never loaded")
        p, pad, eos = params[0], self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        ids = [q["prompt_token_ids"] for q in prompts]
        if max(map(len, ids)) + p.max_tokens > self.max_model_len:
            raise ValueError(f"vllm stand-in: a prompt of {max(map(len, ids))} tokens + {p.max_tokens} is over max_model_len={self.max_model_len}")
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(q)) + q for q in ids])
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in ids])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(p.seed)
            out = net.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=p.temperature, top_p=p.top_p,
                               top_k=0, max_new_tokens=p.max_tokens, num_return_sequences=p.n, pad_token_id=pad, eos_token_id=eos)
        rows = [r[: r.index(eos) + 1] if eos in r else r for r in out[:, width:].tolist()]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=r) for r in rows[i * p.n : (i + 1) * p.n]]) for i in range(len(ids))]
