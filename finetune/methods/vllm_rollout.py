"""An online method's completions (GRPO's, RLOO's) sampled by vLLM (method.vllm=true): an engine on each rank beside
training ("colocated", as TRL's vllm_mode=colocate), holding method.vllm_memory of the GPU for its weights and KV cache;
or, with method.vllm_servers=[HOST:PORT, ...], the engine of a `python -m finetune.vllm` on devices of its own (TRL's
vllm_mode=server), which training's devices then do not share.

vLLM is built from the policy's config and tokenizer with dummy weights (finetune.vllm.engine); before each rollout the
policy's weights are loaded into it by their Hugging Face names (`model.load_weights`, as a checkpoint would be):
gathered whole on every rank where training shards them (FSDP2's DTensors, ZeRO-3's partitions), with a LoRA adapter
merged in (W + the adapter's delta, computed beside the training weights, which are left untouched); a server is sent
them by rank 0 over a process group of their own (finetune.vllm.wire). Each prompt is one request for
`method.generations` samples, seeded from (train.seed, step, rank, micro-batch) as the transformers path is.

Not run with vLLM itself on the machines this project is tested on (no GPU, and vLLM's wheels are built for CUDA):
tests/test_grpo.py runs this module against a stand-in with vLLM's interface (tests/vllm_standin) on every layout,
colocated and through a server process (gloo for the weights), and its GPU-marked tests run it against vLLM itself.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from finetune.vllm import engine as vllm_engine, wire as vllm_wire
from finetune.config import Config, ConfigError, MethodConfig
from finetune.methods.collectives import barrier, rank0s, this_rank

if TYPE_CHECKING:
    import torch


class VllmSampler:
    """One vLLM engine on this rank; `sync` loads the policy's weights into it, `sample` draws completions."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: MethodConfig, *, prompt_tokens: int | None) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="finetune-vllm-"))  # config and tokenizer only (a few MB)
        atexit.register(shutil.rmtree, self.directory, True)
        base_config(engine.generation_model).save_pretrained(self.directory)
        tokenizer.save_pretrained(self.directory)
        self.llm = vllm_engine.build(str(self.directory), dtype=dtype_name(engine), seed=engine.dp_rank, memory=cfg.vllm_memory,
                                     max_model_len=prompt_tokens + cfg.completion_tokens if prompt_tokens else None)

    def sync(self, engine: Any) -> None:
        """The policy's weights as they are now into vLLM (collective where they are gathered); the rollout calls it once
        before sampling."""
        vllm_engine.load(self.llm, hf_weights(engine.generation_model))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Nothing to release before the process ends."""

    def sample(self, prompts: list[list[int]], cfg: MethodConfig, seed: int) -> list[list[int]]:
        """G completions per prompt (adjacent), as vLLM returns them (cut at EOS, which it keeps)."""
        return vllm_engine.sample(self.llm, prompts, n=cfg.generations, temperature=cfg.temperature, top_p=cfg.top_p,
                                  max_tokens=cfg.completion_tokens, seed=seed)


class ServedSampler:
    """method.vllm_servers=[HOST:PORT, ...]: the vLLM engine of a `python -m finetune.vllm` on devices of
    its own (finetune.vllm.wire says how they talk); with N servers, rank r's is server r mod N. Rank k < N sends the
    policy's config and tokenizer to server k when built and pushes the weights in `sync` (every rank gathers them:
    FSDP2's DTensors, ZeRO-3's partitions; an adapter merged in); each rank asks its server for its own prompts'
    completions, seeded as the colocated engine's are."""

    def __init__(self, servers: list[str], engine: Any, tokenizer: Any, cfg: MethodConfig, *, prompt_tokens: int | None) -> None:
        import base64
        import uuid

        here = this_rank()
        mine = servers[here % len(servers)]
        self.url, self.host = f"http://{mine}", mine.rpartition(":")[0]
        self.first, self.dtype, self.run = here < len(servers), dtype_name(engine), rank0s(uuid.uuid4().hex)  # the run's id
        self.pg: Any = None
        self.store: Any = None
        if self.first:
            with tempfile.TemporaryDirectory() as saved:
                tokenizer.save_pretrained(saved)
                files = {p.name: base64.b64encode(p.read_bytes()).decode() for p in Path(saved).iterdir() if p.is_file()}
            config = json.loads(base_config(engine.generation_model).to_json_string())
            vllm_wire.call(self.url, "/init", {"run": self.run, "config": config, "files": files, "dtype": self.dtype,
                                               "max_model_len": prompt_tokens + cfg.completion_tokens if prompt_tokens else None})
        barrier()

    def sync(self, engine: Any) -> None:
        """The policy's weights as they are now pushed to the servers, in their dtype (every rank gathers; rank k < N sends
        to server k); every rank returns once every server has loaded them."""
        import torch

        model = engine.generation_model
        if not self.first:
            if gathered(model):  # the gathers are collective: every rank takes part; whole weights need none of this rank
                for _ in hf_weights(model):
                    pass
        else:
            weights = ((name, value.to(getattr(torch, self.dtype))) for name, value in hf_weights(model))
            name, value = next(weights)
            device = value.device if value.is_cuda else torch.device("cpu")
            backend = "nccl" if value.is_cuda else "gloo"
            if self.store is None:  # the weights group's rendezvous, on a free port of this machine's address facing the server
                self.store = torch.distributed.TCPStore(vllm_wire.facing(self.host), 0, 2, True, timeout=vllm_wire.TIMEOUT,
                                                        wait_for_workers=False)
            answer: dict[str, Any] = {}

            def push() -> None:
                try:
                    answer.update(vllm_wire.call(self.url, "/weights", {"run": self.run, "host": self.store.host, "port": self.store.port,
                                                                        "backend": backend}))
                except vllm_wire.ServerError as e:
                    answer["error"] = e

            posting = threading.Thread(target=push, daemon=True)
            posting.start()
            if self.pg is None:
                self.pg = vllm_wire.group(self.store, 0, backend)
            sent = vllm_wire.send(self.pg, itertools.chain([(name, value)], weights), device)
            posting.join()
            if "error" in answer:
                raise answer["error"]
            if answer.get("loaded") != sent:
                raise vllm_wire.ServerError(f"the vLLM server at {self.url} loaded {answer.get('loaded')} of the {sent} weights pushed")
        barrier()

    def sample(self, prompts: list[list[int]], cfg: MethodConfig, seed: int) -> list[list[int]]:
        """G completions per prompt (adjacent), as the server's vLLM returns them."""
        return vllm_wire.call(self.url, "/generate", {"run": self.run, "prompts": prompts, "n": cfg.generations, "temperature": cfg.temperature,
                                                      "top_p": cfg.top_p, "max_tokens": cfg.completion_tokens, "seed": seed})["completions"]

    def close(self) -> None:
        """The run's end: the server is free for another (a run that crashes frees it after the server's --idle-s)."""
        if self.first:
            with contextlib.suppress(vllm_wire.ServerError):
                vllm_wire.call(self.url, "/close", {"run": self.run}, timeout=30)


def dtype_name(engine: Any) -> str:
    """The dtype vLLM computes in: the engine's (its precision), float32 where it has none."""
    return str(engine.dtype or "torch.float32").removeprefix("torch.")


def base_config(model: Any) -> Any:
    """The transformers config of the model under any PEFT or compile wrapper."""
    inner = getattr(model, "_orig_mod", model)
    return (inner.get_base_model() if hasattr(inner, "get_base_model") else inner).config


def gathered(model: Any) -> bool:
    """Its weights are sharded (ZeRO-3's partitions, FSDP2's or TP's DTensors): `hf_weights` gathers them collectively."""
    inner = getattr(model, "_orig_mod", model)
    return any(hasattr(p, "ds_id") or hasattr(p, "full_tensor") for p in inner.parameters())


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


def vllm_mismatch() -> str | None:
    """What the installed vLLM requires of torch and transformers that this environment does not have (vLLM's releases
    pin their own torch: 0.33.0 needs torch==2.14.0 and transformers<5.21), as `vLLM V needs NAME SPEC, but this
    environment has NAME W`; None when they agree, or vLLM has no package metadata (a source checkout)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        version, required = metadata.version("vllm"), metadata.requires("vllm") or []
    except metadata.PackageNotFoundError:
        return None
    for text in required:
        req = Requirement(text)
        if req.name not in ("torch", "transformers") or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue
        if not req.specifier.contains(have, prereleases=True):
            return f"vLLM {version} needs {req.name}{req.specifier}, but this environment has {req.name} {have}"
    return None


def vllm_rules(cfg: Config) -> None:
    """method.vllm=true: vLLM installed, and a layout whose weights it can load whole (finetune.methods.vllm_rollout)."""
    import importlib.util

    from finetune.config import PeftMethod

    m, p = cfg.method, cfg.parallelism
    servers = len(m.vllm_servers or [])
    if servers and m.vllm_memory != type(m)().vllm_memory:
        raise ConfigError(f"method.vllm_memory={m.vllm_memory:g} with method.vllm_servers: a server takes its share of its own GPU "
                          "(`python -m finetune.vllm --gpu-memory`); drop method.vllm_memory")
    if not servers and importlib.util.find_spec("vllm") is None:
        raise ConfigError("method.vllm=true: vLLM is not installed here: pip install vllm (its wheels are built for CUDA GPUs), or "
                          "drop method.vllm to sample with transformers' generate")
    mismatch = None if servers else vllm_mismatch()
    if mismatch:
        raise ConfigError(f"method.vllm=true: {mismatch}, so vLLM and this training would not run on the versions either was "
                          "built for: install vLLM in a virtualenv of its own and sample through it as a server (method.vllm_servers, docs/grpo.md), "
                          "not into this one")
    if (p.tp > 1 or p.cp > 1) and not servers:
        raise ConfigError(f"method.vllm=true with parallelism.tp={p.tp} cp={p.cp} is not supported: each rank's vLLM engine holds "
                          "the whole model and its own process group would cut across the model's; use fsdp or zero (gathered "
                          "for vLLM), method.vllm_servers (vLLM on devices of its own), or method.vllm=false")
    if p.tp > 1 or p.cp > 1:
        raise ConfigError(f"method.vllm_servers with parallelism.tp={p.tp} cp={p.cp} is not supported: the ranks that share a batch would "
                          "each ask the server for its completions, and a server's batches are not bitwise repeatable; use fsdp or zero")
    if servers > cfg.world_size:
        raise ConfigError(f"method.vllm_servers names {servers} servers for {cfg.world_size} ranks: rank k pushes the weights to server k, so "
                          f"some would never get them; name at most {cfg.world_size}")
    if cfg.peft.name == PeftMethod.qlora:
        raise ConfigError("method.vllm=true with peft=qlora is not supported: vLLM would load the 4-bit base dequantized and merged "
                          "at every step; use peft=lora, or method.vllm=false (generate runs on the 4-bit model)")
    if cfg.peft.name == PeftMethod.dora:
        raise ConfigError("method.vllm=true with peft=dora is not supported: a DoRA weight is not W + its delta (its magnitude "
                          "rescales it); use peft=lora, or method.vllm=false")
