"""Tokenizer and model: from a hub id / local directory, or random-init from an architecture,
and the one place where memory strategies are applied to it (`apply_strategies`).

Under ZeRO-3 the caller holds a `transformers.integrations.HfDeepSpeedConfig` while the model is
built (`zero3_context`): transformers then creates it inside `deepspeed.zero.Init`, so each
rank only ever materialises its own shard of the weights.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch

from finetune import disk
from finetune.config import (
    AttnImpl,
    Checkpointing,
    CheckpointingConfig,
    ConfigError,
    ModelConfig,
    PeftConfig,
    PeftMethod,
    Precision,
)

BASE_DIR = "base"  # RUN_DIR/base: the random-init base weights a PEFT adapter refers to


def load_tokenizer(cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    source = cfg.tokenizer or cfg.path
    try:
        tok = AutoTokenizer.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        key = "model.tokenizer" if cfg.tokenizer else "model.path"
        raise ConfigError(f"{key}={source!r}: could not load a tokenizer: {str(e).splitlines()[0]}") from None
    if tok.pad_token is None:  # many base-model tokenizers have none; padding is masked anyway
        if tok.eos_token is None:
            raise ConfigError(f"model.tokenizer={source!r} has neither a pad nor an eos token to pad with")
        tok.pad_token = tok.eos_token
    return tok


def zero3_context(ds_config: dict[str, Any] | None) -> Any:
    """Keep the returned object alive while loading: transformers sees ZeRO-3 and partitions
    weights as they are created. None when ZeRO-3 is off."""
    if ds_config is None or ds_config["zero_optimization"]["stage"] != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def resolve_attention(cfg: ModelConfig, precision: Precision, device: torch.device) -> tuple[str, str]:
    """(kernel, why) to load the model with: model.attn_implementation, auto resolved for this
    family (its config.json, and the model class's `_supports_sdpa` / `_supports_flash_attn` as
    transformers publishes them) and this device; a kernel the model or the device cannot run is a
    ConfigError naming what to use instead."""
    from finetune.families import attention_limits, pick_attention

    impl = cfg.attn_implementation
    cuda, half = device.type == "cuda", precision != Precision.fp32
    flash = ("needs CUDA" if not cuda else "runs in fp16/bf16 only (precision=fp32)" if not half else
             "needs the flash-attn package (pip install -e '.[gpu]')" if importlib.util.find_spec("flash_attn") is None else None)
    if impl == AttnImpl.flash_attention_2 and flash is not None:
        why = "CUDA" if not cuda else "the flash-attn package (pip install -e '.[gpu]')"
        raise ConfigError(f"model.attn_implementation=flash_attention_2 needs {why}: use model.attn_implementation=sdpa (or auto)")
    arch = disk.model_config(cfg) or hub_config(cfg)
    model_type = str(arch.get("model_type") or "")
    return pick_attention(impl.value, model_type, published_limits(model_type) | attention_limits(arch), flash)


def hub_config(cfg: ModelConfig) -> dict[str, Any]:
    """A hub model's (text) config.json keys; {} when it cannot be read (loading the weights then says why)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(cfg.path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError):
        return {}
    return config.get_text_config().to_dict()


def published_limits(model_type: str) -> dict[str, str]:
    """The attention kernels transformers' causal-LM class for `model_type` says it cannot run
    (`_supports_sdpa`, `_supports_flash_attn`), with the reason; {} for a class it does not list."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    flags = (("sdpa", "_supports_sdpa", "sdpa"), ("flash_attention_2", "_supports_flash_attn", "flash-attn"))
    return {kernel: f"has no {words} attention in transformers ({name}.{flag} is False)"
            for kernel, flag, words in flags if cls is not None and getattr(cls, flag, True) is False}


def load_model(cfg: ModelConfig, tokenizer: Any, *, attention: str, peft: PeftConfig, compute_dtype: torch.dtype,
               zero3: bool, run_dir: Path, is_main: bool, barrier: Any) -> torch.nn.Module:
    """The model with fp32 weights on CPU, the same on every rank (sharded under ZeRO-3).

    For QLoRA the base is loaded 4-bit (bitsandbytes NF4/FP4); a random-init base is first saved to
    RUN_DIR/base and loaded from there, which is also where its adapter says its base lives.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = cfg.path
    if path is None:
        assert cfg.init is not None
        arch = {k: v for k, v in vars(cfg.init).items() if k not in ("model_type", "seed")}
        config = AutoConfig.for_model(cfg.init.model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **arch)
        torch.manual_seed(cfg.init.seed)  # every rank builds the same initial weights
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)
        if peft.name == PeftMethod.none:
            return model
        path = str(run_dir / BASE_DIR)  # adapters need a base on disk to be merged into later
        with _gathered(model, zero3):  # under ZeRO-3 each rank holds a shard: gather to write it whole
            if is_main:
                model.save_pretrained(path)
                tokenizer.save_pretrained(path)
        barrier()
        if peft.name != PeftMethod.qlora:
            model.name_or_path = model.config._name_or_path = path  # recorded in adapter_config.json
            return model
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if cfg.architecture and cfg.path is not None and not disk.is_local(cfg.path):
        kwargs["config"] = check_architecture(cfg)
    if peft.name == PeftMethod.qlora:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=peft.quant_type.value, bnb_4bit_use_double_quant=peft.double_quant,
            bnb_4bit_compute_dtype=compute_dtype,
            # DeepSpeed shards tensors of one dtype: store the packed 4-bit values as the compute dtype.
            bnb_4bit_quant_storage=compute_dtype if zero3 else torch.uint8,
        )
        if not zero3:
            kwargs["device_map"] = {"": torch.cuda.current_device()} if torch.cuda.is_available() else "cpu"
    try:
        return AutoModelForCausalLM.from_pretrained(path, revision=cfg.revision, attn_implementation=attention,
                                                    trust_remote_code=cfg.trust_remote_code, **kwargs)
    except OSError as e:
        raise ConfigError(f"model.path={path!r}: could not load weights: {str(e).splitlines()[0]}") from None
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        local = Path(str(path)).expanduser()
        damaged = [f"{f} ({why})" for f in sorted(local.glob("*.safetensors")) if (why := disk.safetensors_problem(f))]
        which = damaged[0] if damaged else f"a weight file ({str(e).splitlines()[0]})"
        raise ConfigError(f"model.path={path!r}: {which} is damaged or incomplete: copy or download the model again") from None


def check_architecture(cfg: ModelConfig) -> Any:
    """The hub model's config, refused (one line naming the first differing key) when it differs
    from model.architecture, which the launcher planned and checked the layout with."""
    from transformers import AutoConfig

    assert cfg.path is not None
    try:
        config = AutoConfig.from_pretrained(cfg.path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={cfg.path!r}: could not load its config: {str(e).splitlines()[0]}") from None
    problem = disk.architecture_mismatch(cfg.architecture, config.get_text_config(), f"{cfg.path}'s config.json")
    if problem:
        raise ConfigError(problem)
    return config


def _gathered(model: torch.nn.Module, zero3: bool) -> Any:
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


def apply_strategies(model: torch.nn.Module, *, checkpointing: CheckpointingConfig, peft: PeftConfig) -> torch.nn.Module:
    """Adapters, then activation checkpointing / offload, each from its own config slice."""
    if peft.name != PeftMethod.none:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if peft.name == PeftMethod.qlora:  # norms and head in fp32, frozen 4-bit base
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        target = peft.target_modules[0] if peft.target_modules == ["all-linear"] else list(peft.target_modules)
        check_targets(model, peft)
        model = get_peft_model(model, LoraConfig(
            r=peft.r, lora_alpha=peft.alpha, lora_dropout=peft.dropout, target_modules=target,
            modules_to_save=list(peft.modules_to_save) or None, use_dora=peft.name == PeftMethod.dora, task_type="CAUSAL_LM",
        ))
    if checkpointing.name in (Checkpointing.full, Checkpointing.selective):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if checkpointing.name == Checkpointing.selective:
            from transformers.modeling_layers import GradientCheckpointingLayer

            blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
            for i, block in enumerate(blocks):
                block.gradient_checkpointing = i % checkpointing.every == 0
    elif checkpointing.name == Checkpointing.offload:
        model.forward = functools.partial(_offloaded_forward, model.forward)
    return model


def check_targets(model: torch.nn.Module, peft: PeftConfig) -> None:
    """Each name in peft.target_modules must name a linear layer of this model, and each in
    peft.modules_to_save a module of it (PEFT matches a name or the end of a dotted path);
    refuse naming those that exist."""
    names = {name: module for name, module in model.named_modules() if name}
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in names.items()
                     if isinstance(m, torch.nn.Linear) or type(m).__name__ in ("Linear4bit", "Linear8bitLt", "Conv1D")})
    leaves = {n.rsplit(".", 1)[-1] for n in names}
    targets = [] if peft.target_modules == ["all-linear"] else list(peft.target_modules)
    for key, wanted, have in (("peft.target_modules", targets, set(linear)), ("peft.modules_to_save", list(peft.modules_to_save), leaves)):
        missing = [w for w in wanted if w not in have and w not in names]
        if missing:
            what = (f"its linear layers are {', '.join(linear)} (or use [all-linear])" if key == "peft.target_modules" else
                    f"its module names are {', '.join(sorted(n for n in leaves if not n.isdigit()))}")
            raise ConfigError(f"{key}: {', '.join(missing)} {'matches' if len(missing) == 1 else 'match'} no module of this "
                              f"{model.config.model_type} model: {what}")


def _offloaded_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # Tensors saved for backward go to (pinned) CPU memory and come back when backward needs them.
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return forward(*args, **kwargs)


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]  # ZeRO-3: whole sizes
    return sum(n for n, trains in sizes if trains), sum(n for n, _ in sizes)
