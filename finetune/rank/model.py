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
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from finetune import disk
from finetune.data.templates import load_tokenizer  # noqa: F401 (the ranks' callers read it here)
from finetune.data.images import save_tokenizer
from finetune.rank.dist import import_deepspeed
from finetune.methods.base import CAUSAL_LM, IMAGE_TEXT, SCORED
from finetune.families import attention_limits, dora_experts, pick_attention, unmatched_targets
from finetune.families.vision import vision_of
from finetune.rank import vision
from finetune.config import (
    AttnImpl,
    Checkpointing,
    CheckpointingConfig,
    ConfigError,
    LoraInit,
    ModelConfig,
    PeftConfig,
    PeftMethod,
    Precision,
)

BASE_DIR = "base"  # RUN_DIR/base: the random-init base weights a PEFT adapter refers to

PEFT_TASKS = {CAUSAL_LM: "CAUSAL_LM", IMAGE_TEXT: "CAUSAL_LM", SCORED: "SEQ_CLS"}
"""A method's model_class (finetune.methods.base.Method) -> PEFT's task_type for it: SEQ_CLS also trains and saves
the classifier's score head (PEFT's modules_to_save), which a random init leaves untrained."""


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
               zero3: bool, run_dir: Path, is_main: bool, barrier: Any, dtype: torch.dtype = torch.float32,
               fsdp: bool = False, model_class: str = CAUSAL_LM) -> torch.nn.Module:
    """The model on CPU, the same on every rank (sharded under ZeRO-3): a pretrained one read in the checkpoint's own
    dtype, memory-mapped (read_dtype: the engine casts it to the training `dtype`, fp32 or bf16 for
    precision=bf16_pure, on the device), a random-init one built in fp32 (the engine casts it).
    `model_class`: the method's transformers Auto class (a causal LM, or a sequence classifier with one score per
    row: its head is new, randomly initialised, on top of a causal LM's checkpoint).

    For QLoRA the base is loaded 4-bit (bitsandbytes NF4/FP4); a random-init base is first saved to
    RUN_DIR/base and loaded from there, which is also where its adapter says its base lives. Under
    FSDP (`fsdp`) the 4-bit model stays in host memory: fully_shard moves each block's shard to the GPU.
    """
    import transformers
    from transformers import AutoConfig

    auto, head = getattr(transformers, model_class), head_config(model_class, tokenizer)
    path = cfg.path
    if path is None or cfg.from_scratch:
        config, seed, what = _random_config(cfg, tokenizer, head)
        torch.manual_seed(seed)  # every rank builds the same initial weights
        with unbuildable(model_class, what):
            model = auto.from_config(config, attn_implementation=attention, dtype=torch.float32)  # same init in every precision
        if peft.name == PeftMethod.none:
            return model
        path = str(run_dir / BASE_DIR)  # adapters need a base on disk to be merged into later
        with _gathered(model, zero3):  # under ZeRO-3 each rank holds a shard: gather to write it whole
            if is_main:
                model.save_pretrained(path)
                save_tokenizer(tokenizer, path)  # a vision-language model's processor files too (QLoRA reloads from here)
        barrier()
        if peft.name != PeftMethod.qlora:
            model.name_or_path = model.config._name_or_path = path  # recorded in adapter_config.json
            return model
    read, how = read_dtype(cfg, path, dtype, quantized=peft.name == PeftMethod.qlora, zero3=zero3)
    kwargs: dict[str, Any] = {"dtype": read}
    if cfg.architecture and cfg.path is not None and not disk.is_local(cfg.path):
        kwargs["config"] = check_architecture(cfg)
        for key, value in head.items():
            setattr(kwargs["config"], key, value)
    else:
        kwargs |= head
    if peft.name == PeftMethod.qlora:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=peft.quant_type.value, bnb_4bit_use_double_quant=peft.double_quant,
            bnb_4bit_compute_dtype=compute_dtype,
            # DeepSpeed shards tensors of one dtype: store the packed 4-bit values as the compute dtype.
            bnb_4bit_quant_storage=compute_dtype if zero3 else torch.uint8,
            # a vision-language model: the language model only (the vision tower and projector stay as they are)
            llm_int8_skip_modules=vision.NOT_QUANTIZED if vision_of(AutoConfig.from_pretrained(
                path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code).to_dict()) else None,
        )
        if not zero3:
            kwargs["device_map"] = {"": torch.cuda.current_device()} if torch.cuda.is_available() and not fsdp else "cpu"
    try:
        with unbuildable(model_class, path):
            loaded = auto.from_pretrained(path, revision=cfg.revision, attn_implementation=attention,
                                          trust_remote_code=cfg.trust_remote_code, **kwargs)
            loaded.read_as = how  # said by the rank's model line (finetune.rank.train.prepare_model)
            loaded.cast_to = dtype  # what the engine casts it to on the device (a frozen reference too)
            return loaded
    except OSError as e:
        raise ConfigError(f"model.path={path!r}: could not load weights: {str(e).splitlines()[0]}") from None
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        local = Path(str(path)).expanduser()
        damaged = [f"{f} ({why})" for f in sorted(local.glob("*.safetensors")) if (why := disk.safetensors_problem(f))]
        which = damaged[0] if damaged else f"a weight file ({str(e).splitlines()[0]})"
        raise ConfigError(f"model.path={path!r}: {which} is damaged or incomplete: copy or download the model again") from None


def read_dtype(cfg: ModelConfig, path: str, dtype: torch.dtype, *, quantized: bool, zero3: bool) -> tuple[torch.dtype, str]:
    """The dtype a pretrained checkpoint is read in, and the words for it. Its own dtype where all its floating-point
    weights share one (the safetensors headers say): transformers then leaves each weight a view of the memory-mapped
    file, shared by every rank of the node and read only where used (an FSDP2 rank copies its own rows), and the engine
    casts to the training `dtype` on the device, one tensor at a time (finetune.rank.engine.common.place). Otherwise, and
    for a 4-bit base (bitsandbytes quantizes while reading) or ZeRO-3 (its zero.Init partitions while reading), `dtype`."""
    name = str(dtype).removeprefix("torch.")
    if quantized or zero3:
        return dtype, f"read in {name}" + (" around the 4-bit base" if quantized else " into ZeRO-3's partitions")
    where = disk.checkpoint_dir(path, cfg.revision)
    stored = disk.stored_dtypes(where) if where is not None else {}
    if len(stored) == 1:
        own = next(iter(stored))
        cast = "" if own == name else f", cast to {name} on the device"
        return getattr(torch, own), f"read in {own} (the checkpoint's own), memory-mapped{cast}"
    why = (f"the checkpoint mixes {' and '.join(sorted(stored))}" if stored else "no safetensors headers to read here" if where
           else "not downloaded yet: its dtype is unknown")
    return dtype, f"read in {name} on the host ({why})"


def _random_config(cfg: ModelConfig, tokenizer: Any, head: dict[str, Any]) -> tuple[Any, int, str]:
    """(the transformers config, the seed, what it is for messages) of a random-init model: model.init's keys with the
    tokenizer's vocabulary and special tokens, or model.path's own config.json (model.from_scratch, seed 0)."""
    from transformers import AutoConfig

    if cfg.init is None:
        assert cfg.path is not None
        try:
            config = AutoConfig.from_pretrained(cfg.path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path={cfg.path!r}: could not load its config: {str(e).splitlines()[0]}") from None
        for key, value in head.items():
            setattr(config, key, value)
        return config, 0, cfg.path
    arch = {k: v for k, v in vars(cfg.init).items() if k not in ("model_type", "seed", "vocab_size")}
    config = AutoConfig.for_model(cfg.init.model_type, vocab_size=cfg.init.vocab_size or len(tokenizer),
                                  **{"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                                     "eos_token_id": tokenizer.eos_token_id} | arch | head)
    return config, cfg.init.seed, cfg.init.model_type


def head_config(model_class: str, tokenizer: Any) -> dict[str, Any]:
    """Config keys `model_class` needs that a causal LM's checkpoint does not state: a sequence classifier's one
    label (a scalar score) and the pad id its forward pools by (each row's last token that is not padding, as
    training batches are padded: the exported config keeps it, so the model scores the same when loaded back)."""
    return {"num_labels": 1, "pad_token_id": tokenizer.pad_token_id} if model_class == SCORED else {}


@contextlib.contextmanager
def unbuildable(model_class: str, what: Any) -> Any:
    """transformers' refusal of a model type its Auto class has no class for, as one line (the launcher refuses the
    families it knows, finetune.families' `scored`; a hub id's type is known here first)."""
    try:
        yield
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        raise ConfigError(f"{what}: transformers has no {model_class.removeprefix('AutoModelFor')} class for this model type, which "
                          f"the method needs (its {model_class} lists none): use a model family that has one") from None


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
    return import_deepspeed().zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


def apply_strategies(model: torch.nn.Module, *, checkpointing: CheckpointingConfig, peft: PeftConfig,
                     model_class: str = CAUSAL_LM, neftune_alpha: float | None = None, kept: set[str] = frozenset()) -> torch.nn.Module:
    """Adapters (PEFT's task type for the method's `model_class`; none in `kept`, the linear layers model.freeze keeps
    frozen), then activation checkpointing / offload, each from its own config slice; NEFTune's embedding noise
    (train.neftune_alpha) last."""
    if peft.name != PeftMethod.none:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if peft.name == PeftMethod.qlora:  # norms and head in fp32, frozen 4-bit base
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
            keep_4bit_layout(model)
        modules, parameters = lora_targets(model, peft, kept)
        if parameters and peft.name == PeftMethod.dora:
            raise ConfigError(dora_experts(model.config.model_type))
        exact = is_moe(model)  # modules and parameters named one by one: check PEFT adapted just those
        model = get_peft_model(model, LoraConfig(
            r=peft.r, lora_alpha=peft.alpha, target_modules=modules, target_parameters=parameters or None,
            # PEFT cannot drop out inside a weight it adapts through target_parameters: on a MoE, dropout goes on the
            # linear layers' adapters only (_linear_dropout)
            lora_dropout=0.0 if exact else peft.dropout,
            modules_to_save=list(peft.modules_to_save) or None, use_dora=peft.name == PeftMethod.dora, task_type=PEFT_TASKS[model_class],
            use_rslora=peft.use_rslora, init_lora_weights=LORA_INIT[peft.init],
        ))
        if peft.init in MUTATING:
            keep_initial_adapter(model)
        if exact:
            check_adapted(model, modules, parameters)
            if peft.dropout:
                _linear_dropout(model, peft.dropout)
    if checkpointing.name in RECOMPUTED:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if checkpointing.name in (Checkpointing.ops, Checkpointing.full_offload):  # each block's own checkpoint function
            from finetune.rank import recompute

            recompute.install(model, recompute.op_level if checkpointing.name == Checkpointing.ops else
                              recompute.HostInputs().checkpoint)
        if checkpointing.name == Checkpointing.selective:
            from transformers.modeling_layers import GradientCheckpointingLayer

            blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
            for i, block in enumerate(blocks):
                block.gradient_checkpointing = i % checkpointing.every == 0
    elif checkpointing.name == Checkpointing.offload:
        model.forward = functools.partial(_offloaded_forward, model.forward)
    if neftune_alpha:
        from finetune.rank.neftune import add_noise

        add_noise(model, neftune_alpha)
    return model


RECOMPUTED = (Checkpointing.full, Checkpointing.selective, Checkpointing.ops, Checkpointing.full_offload)
"""The options that checkpoint decoder blocks (transformers' gradient checkpointing, finetune.rank.recompute's
functions for ops and full_offload)."""
LORA_INIT = {LoraInit.default: True, LoraInit.gaussian: "gaussian", LoraInit.pissa: "pissa", LoraInit.olora: "olora",
             LoraInit.loftq: "loftq"}
"""peft.init -> LoraConfig's init_lora_weights."""
MUTATING = (LoraInit.pissa, LoraInit.olora)
"""Inits that move part of each base weight into the adapter (the base holds the residual)."""


def keep_initial_adapter(model: torch.nn.Module) -> None:
    """pissa/olora: keep the adapter's step-0 weights, from which `adapter_save_kwargs` converts the trained adapter
    into a plain LoRA adapter of the original base (PEFT's documented conversion at save)."""
    from peft import get_peft_model_state_dict

    model.initial_adapter = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}


@contextlib.contextmanager
def adapter_save_kwargs(model: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """save_pretrained's extra keywords for `model`: with a pissa/olora adapter, the step-0 adapter written to a
    temporary directory as path_initial_model_for_weight_conversion (PEFT then saves the difference to the original
    base: rank 2r, alpha doubled); nothing otherwise."""
    initial = getattr(model, "initial_adapter", None)
    if initial is None:
        yield {}
        return
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp, "initial")
        where.mkdir()
        save_file(initial, str(where / "adapter_model.safetensors"))
        yield {"path_initial_model_for_weight_conversion": str(where)}


def keep_4bit_layout(model: torch.nn.Module) -> None:
    """Keep bitsandbytes from repacking 4-bit weights for its CPU inference kernel (on CPUs with AVX512-BF16,
    at the first forward without gradients, i.e. the first evaluation): it rewrites the weight in place, and
    training after it computes other gradients than before it (measured on a tiny Llama: the loss fell 0.05
    instead of 0.17 in the step after an evaluation). Training always uses the layout the weights were quantized in."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


LINEAR_TYPES = ("Linear4bit", "Linear8bitLt", "Conv1D")
"""Modules PEFT adapts as linear layers besides nn.Linear (bitsandbytes' quantized linears, GPT-2's Conv1D)."""


def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ in LINEAR_TYPES


def _matches(path: str, target: str) -> bool:
    """PEFT's matching: the target is the module's path or its last dotted components."""
    return path == target or path.endswith("." + target)


def weights_outside_linears(model: torch.nn.Module) -> dict[str, int]:
    """path -> ndim of the weights PEFT reaches only through target_parameters: a MoE's fused expert
    stacks (3-D) and the 2-D weights of modules that are neither linear layers nor embeddings (its router)."""
    out = {}
    for name, module in model.named_modules():
        if _is_linear(module) or isinstance(module, torch.nn.Embedding):
            continue
        for leaf, param in module.named_parameters(recurse=False):
            ndim = len(getattr(param, "ds_shape", param.shape))  # ZeRO-3: the whole shape
            if ndim in (2, 3):
                out[f"{name}.{leaf}" if name else leaf] = ndim
    return out


def lora_targets(model: torch.nn.Module, peft: PeftConfig, kept: set[str] = frozenset()) -> tuple[Any, list[str]]:
    """(target_modules, target_parameters) for PEFT, by families.adapted's rule on this model's modules:
    all-linear is every linear layer but the output head, and a MoE's fused experts; a name adapts
    the linear layers it matches and the weights outside them it or its module matches (`experts`,
    `gate_up_proj`, the router `gate`). A name that matches nothing, or a modules_to_save entry that is
    no module, is refused in one line listing what exists. A model with no weights outside linears
    gets peft.target_modules as written (PEFT's own all-linear). `kept`: linear layers model.freeze keeps frozen (a
    vision-language model's vision tower): none of them is adapted."""
    names = {name: module for name, module in model.named_modules() if name}
    linear = [n for n, m in names.items() if _is_linear(m)]
    weights = weights_outside_linears(model)
    all_linear = peft.target_modules == ["all-linear"]
    wanted = [] if all_linear else list(peft.target_modules)
    refusal = unmatched_targets(model.config.model_type, wanted, linear, weights)
    if refusal:
        raise ConfigError(refusal)
    leaves = {n.rsplit(".", 1)[-1] for n in names}
    unsaved = [w for w in peft.modules_to_save if w not in leaves and w not in names]
    if unsaved:
        raise ConfigError(f"peft.modules_to_save: {', '.join(unsaved)} {'matches' if len(unsaved) == 1 else 'match'} no module of "
                          f"this {model.config.model_type} model: its module names are "
                          f"{', '.join(sorted(n for n in leaves if not n.isdigit()))}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if kept:  # a vision-language model with parts frozen (model.freeze, finetune.rank.vision): its other layers, one by one
        return [n for n in linear if n not in kept and names[n] is not head and (all_linear or any(_matches(n, t) for t in wanted))], []
    if not is_moe(model):  # PEFT's own matching, as written
        return (peft.target_modules[0] if all_linear else wanted), []
    # A MoE: name every module and weight, so PEFT's conversion of transformers-4 MoE names (mixtral, qwen3_moe: it
    # would add the router and double the experts' rank under all-linear) leaves them as they are (check_adapted).
    if all_linear:
        return [n for n in linear if names[n] is not head], [w for w, ndim in weights.items() if ndim == 3]
    return ([n for n in linear if any(_matches(n, t) for t in wanted)],
            [w for w in weights if any(_matches(w, t) or _matches(w.rsplit(".", 1)[0], t) for t in wanted)])


def is_moe(model: torch.nn.Module) -> bool:
    """Whether the model has fused expert weights (3-D parameters outside linear layers)."""
    return any(ndim == 3 for ndim in weights_outside_linears(model).values())


def check_adapted(model: Any, modules: list[str], parameters: list[str]) -> None:
    """PEFT adapted exactly the linear layers and weights asked for (its conversion of transformers-4 MoE
    names can retarget some, e.g. a dense layer's gate_proj in a qwen3_moe model)."""
    tuner = model.base_model
    lost = sorted(set(modules) - set(tuner.targeted_module_names)) + sorted(set(parameters) ^ set(tuner.targeted_parameter_names))
    if lost:
        names = sorted({n.rsplit(".", 1)[-1] for n in lost})
        raise ConfigError(f"peft.target_modules: PEFT converted {', '.join(names)} of this {model.config.model_type} model to other "
                          f"targets (its renaming of transformers-4 MoE layers), so LoRA would not adapt what was asked: leave "
                          f"{', '.join(names)} out of peft.target_modules (the experts are named experts, gate_up_proj, down_proj)")


def _linear_dropout(model: torch.nn.Module, p: float) -> None:
    """peft.dropout on the adapters of linear layers, none on those of weights adapted through
    target_parameters (lora.ParamWrapper: dropout on the input cannot be factored out of a weight)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    for module in model.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper):
            for adapter in module.lora_dropout:
                module.lora_dropout[adapter] = torch.nn.Dropout(p=p)


def _offloaded_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # Tensors saved for backward go to (pinned) CPU memory and come back when backward needs them.
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return forward(*args, **kwargs)


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]  # ZeRO-3: whole sizes
    return sum(n for n, trains in sizes if trains), sum(n for n, _ in sizes)
