"""The cross-group rules: what no single field's constraint can check (batch sizes against the
launch size, options that need or exclude each other, the model's shape against the layout).

Each rule raises `ConfigError` with one line naming the keys that conflict and what to do
instead. Per-field constraints are declared beside the fields in `finetune.config` and checked
when the config is composed, before these rules run. Imports no torch (a torch.optim class named by optim.name
imports it when its record is made: finetune/optimizers.py).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from finetune.config import (
    AttnImpl,
    Checkpointing,
    Config,
    ConfigError,
    DataFormat,
    Device,
    Kernels,
    LauncherConfig,
    LauncherName,
    Logits,
    LogitsKernel,
    ModelConfig,
    NonFinite,
    Offload,
    OptimKernel,
    ParallelismConfig,
    PeftMethod,
    PipeSchedule,
    Precision,
    Reference,
    Scheduler,
    StateDtype,
    Strategy,
    engine_kind,
    launcher_for,
    unused as _unused,
)
from finetune import liger, methods, optimizers
from finetune.data.sources import sources
from finetune.disk import attention, config_source, config_value, local_config, model_config
from finetune.families import (COUNTED, FAMILIES, adapted_outside_linears, arch_from_config, arch_targets, dora_experts,
                                router_loss_split, router_loss_under_pp, unmatched_targets)
from finetune.structure import structure_problem


def layout_words(p: ParallelismConfig) -> str:
    """The layout as the user spelled it: parallelism=fsdp, parallelism.tp=2, ..."""
    return ", ".join([*(["parallelism=fsdp"] if p.strategy == Strategy.fsdp else []),
                      *([f"parallelism.tp={p.tp}"] if p.tp > 1 else []), *([f"parallelism.pp={p.pp}"] if p.pp > 1 else []),
                      *([f"parallelism.cp={p.cp}"] if p.cp > 1 else [])])


def validate(cfg: Config) -> None:
    """Check the rules that span groups. Raises ConfigError naming the keys to change."""
    m, t, launch = cfg.model, cfg.train, cfg.launcher
    if m.path is None and m.init is None:
        raise ConfigError("model: set model.path (hub id or local directory) or model.init (random-init architecture)")
    if m.path is not None and m.init is not None:
        raise ConfigError(f"model.path={m.path!r} and model.init are both set: choose one (model.init=null to load weights)")
    if m.recipe_if_missing is not None and (m.path is None or Path(m.path).name != "final"):
        raise ConfigError(
            f"model.recipe_if_missing={m.recipe_if_missing} makes model.path by running that recipe, so model.path must be "
            f"its RUN_DIR/final (e.g. outputs/{m.recipe_if_missing}/final), got {m.path!r}"
        )
    if m.init is not None and m.architecture:
        raise ConfigError("model.architecture declares a pretrained model.path's config; a random-init model's architecture is "
                          "model.init: use one model recipe (model=tiny or a hub model's), not both")
    if m.path is None and m.tokenizer is None:
        raise ConfigError("model.tokenizer: a random-init model needs a tokenizer path or hub id")
    _validate_structure(m)
    _validate_context(cfg)
    for value, split, key in ((cfg.data.train, cfg.data.train_split, "data.train"), (cfg.data.eval, cfg.data.eval_split, "data.eval")):
        if value is not None:
            sources(value, split, key)  # a mixture's entries, each named when malformed
    _validate_streaming(cfg)
    if m.attn_implementation != AttnImpl.auto:
        attention(cfg, gpu=True)  # refuses a kernel this model cannot run (the device is disk.check_device's)
    if launch.node_rank >= launch.nnodes:
        raise ConfigError(f"launcher.node_rank={launch.node_rank} must be in [0, launcher.nnodes={launch.nnodes})")
    _validate_launcher(cfg)
    _validate_hardware(cfg)
    _validate_optimizer_keys(cfg)
    if cfg.optim.min_lr_ratio and cfg.optim.scheduler != Scheduler.cosine:
        raise ConfigError(
            f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} applies to optim.scheduler=cosine only "
            f"(got {cfg.optim.scheduler.value}): set optim.min_lr_ratio=0 or optim.scheduler=cosine"
        )
    if t.on_nonfinite == NonFinite.skip and cfg.zero.enabled:
        raise ConfigError("train.on_nonfinite=skip needs the torch engine: DeepSpeed applies a step before its loss can be checked "
                          "(use train.on_nonfinite=stop, or zero=none)")
    if cfg.optim.warmup_steps >= t.max_steps and cfg.optim.warmup_steps > 0:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps} must be below train.max_steps={t.max_steps}")

    world = cfg.world_size
    _validate_zero(cfg)
    _validate_layout(cfg)
    if cfg.parallelism.strategy == Strategy.single and world != 1:
        raise ConfigError(
            f"parallelism=single runs one process, but the launcher starts {world} "
            f"(launcher.nproc_per_node={launch.nproc_per_node} x launcher.nnodes={launch.nnodes}): "
            "use parallelism=ddp or launcher.nproc_per_node=1"
        )
    per_step = t.micro_batch_size * cfg.data_parallel_size
    if t.global_batch_size < cfg.data_parallel_size:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is smaller than the data-parallel size "
            f"{cfg.data_parallel_size}: every rank needs at least one sample per step"
        )
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
            f"{t.micro_batch_size} x data-parallel size {cfg.data_parallel_size} = {per_step}: "
            f"use e.g. train.global_batch_size={max(per_step, t.global_batch_size // per_step * per_step)}"
        )
    p = cfg.parallelism
    stages = p.pp * p.pp_stages_per_rank
    if p.pp > 1 and p.pp_schedule != PipeSchedule.gpipe and cfg.grad_accum_steps < stages:
        raise ConfigError(
            f"parallelism.pp_schedule={p.pp_schedule.value} needs at least as many micro-batches per step as pipeline stages "
            f"({stages}), got {cfg.grad_accum_steps} (train.global_batch_size={t.global_batch_size} / (train.micro_batch_size="
            f"{t.micro_batch_size} x data-parallel {cfg.data_parallel_size})): lower train.micro_batch_size"
        )
    if p.pp_schedule == PipeSchedule.interleaved_1f1b and p.pp > 1 and cfg.grad_accum_steps % p.pp:
        raise ConfigError(f"parallelism.pp_schedule=interleaved_1f1b needs a micro-batch count per step ({cfg.grad_accum_steps}) "
                          f"that is a multiple of parallelism.pp={p.pp}: change train.micro_batch_size or train.global_batch_size")
    _validate_optimizer_engine(cfg)
    _validate_pure(cfg)
    _validate_state_dtype(cfg)
    _validate_kernel(cfg)
    _validate_compile(cfg)
    _validate_in_backward(cfg)
    _validate_strategies(cfg)
    _validate_method(cfg)
    padding_free(cfg)
    for key, value in (("exact_match_samples", t.exact_match_samples), ("sample_prompts", t.sample_prompts)):
        if value and cfg.data.eval is None and cfg.data.eval_size == 0:
            raise ConfigError(f"train.{key} needs an eval set: set data.eval or data.eval_size")
    if t.sample_prompts and cfg.parallelism.pp > 1:
        raise ConfigError(f"train.sample_prompts={t.sample_prompts} with parallelism.pp={cfg.parallelism.pp}: pipeline stages cannot "
                          "generate while training (exact match is measured on final/ after it); set train.sample_prompts=0")


def _validate_optimizer_keys(cfg: Config) -> None:
    """The optim.* keys the optimizer's constructor takes (its record, finetune/optimizers.py): a built-in ignores betas
    and eps where unused, but optim.momentum set without sgd is refused; a torch class refuses any key it does not take."""
    o = cfg.optim
    rec = optimizers.record(o.name)  # a torch class that does not exist or cannot step is refused here
    if o.momentum and "momentum" not in rec.takes and o.name in optimizers.RECORDS:
        takers = " or ".join(n for n, r in optimizers.RECORDS.items() if "momentum" in r.takes)
        raise ConfigError(f"optim.momentum={o.momentum} applies to optim.name={takers} only ({o.name} uses "
                          f"optim.betas): remove it, or use optim=momentum")
    optimizers.refuse_unused_keys(o, rec)


def _validate_optimizer_engine(cfg: Config) -> None:
    """The engines the optimizer's record runs on: DeepSpeed builds its own from the JSON's type; a torch class by name
    runs on the torch engine only."""
    rec, kind = optimizers.record(cfg.optim.name), engine_kind(cfg)
    if kind == "deepspeed" and rec.deepspeed is None:
        raise ConfigError(f"{rec.typed} with zero.stage={cfg.zero.stage}: DeepSpeed builds its own optimizer "
                          "from the JSON (FusedAdam, CPUAdam or a torch.optim class over its flat fp32 partitions): use "
                          f"{rec.typed} with zero=none (parallelism=single or ddp), or optim=adamw under ZeRO")
    if kind != "deepspeed" and kind not in rec.engines:
        raise ConfigError(f"{rec.typed} with {layout_words(cfg.parallelism)}: it runs on the torch engine only (parallelism="
                          f"single or ddp), its state unsharded: use {rec.typed} with parallelism=single or ddp, or a built-in "
                          f"optimizer ({', '.join(n for n, r in optimizers.RECORDS.items() if 'mesh' in r.engines)}) with "
                          f"{layout_words(cfg.parallelism)}")


def _validate_pure(cfg: Config) -> None:
    """precision=bf16_pure: a bf16 module stepped by optimi's optimizers (Kahan-compensated) on the torch and mesh engines."""
    if cfg.precision.name != Precision.bf16_pure:
        return
    if cfg.zero.enabled:
        raise ConfigError(f"precision=bf16_pure with zero.stage={cfg.zero.stage}: DeepSpeed's optimizer keeps its own fp32 master "
                          "copy (its bf16 master mode has no compensated update): use precision=bf16 under ZeRO, or "
                          "precision=bf16_pure with zero=none (parallelism=single, ddp, fsdp or tp)")
    rec = optimizers.record(cfg.optim.name)
    if rec.pure is None:
        raise ConfigError(f"precision=bf16_pure with {rec.typed}: bf16 weights need each update added with "
                          "Kahan summation (optimi's AdamW, Adam and SGD do it), which this optimizer has not: use optim=adamw, "
                          "or precision=bf16 with it")


def _validate_state_dtype(cfg: Config) -> None:
    """optim.state_dtype: adam/adamw's moments in the dtype named, on the torch and mesh engines."""
    o = cfg.optim
    if o.state_dtype is None:
        return
    rec = optimizers.record(o.name)
    if not rec.moments:
        raise ConfigError(f"optim.state_dtype={o.state_dtype.value} with {rec.typed}: it sets the dtype of adam/adamw's two "
                          f"moments, and {rec.typed} keeps {rec.held(o.momentum)}: use optim=adamw with it, or "
                          "optim.state_dtype=null")
    if cfg.zero.enabled:
        raise ConfigError(f"optim.state_dtype={o.state_dtype.value} with zero.stage={cfg.zero.stage}: DeepSpeed builds its own "
                          "optimizer (FusedAdam or CPUAdam over its fp32 partitions, fp32 moments): use zero=none "
                          "(parallelism=single, ddp, fsdp or tp) with it, or optim.state_dtype=null under ZeRO")
    if o.state_dtype == StateDtype.fp32 and cfg.precision.name == Precision.bf16_pure:
        raise ConfigError("optim.state_dtype=fp32 with precision=bf16_pure: its Kahan-compensated optimizers (optimi) keep the "
                          "moments in the parameters' dtype, bf16: use precision=bf16 for fp32 moments over fp32 weights, or "
                          "optim.state_dtype=null")


def _validate_kernel(cfg: Config) -> None:
    """optim.kernel: how torch's adamw/adam/sgd run; said explicitly, only where torch's own optimizer runs."""
    o = cfg.optim
    if o.kernel == OptimKernel.auto:
        return
    key = f"optim.kernel={o.kernel.value}"
    rec = optimizers.record(o.name)
    if rec.runs is not None:
        raise ConfigError(f"{key} with {rec.typed}: it chooses how torch's adamw, adam and sgd run, and "
                          f"{rec.typed} runs {rec.runs}: leave optim.kernel=auto, or use optim=adamw with it")
    if cfg.zero.enabled:
        raise ConfigError(f"{key} with zero.stage={cfg.zero.stage}: DeepSpeed builds its own optimizer (FusedAdam or CPUAdam over "
                          "its fp32 partitions): leave optim.kernel=auto under ZeRO, or use zero=none with it")
    if cfg.precision.name == Precision.bf16_pure:
        raise ConfigError(f"{key} with precision=bf16_pure: its Kahan-compensated optimizers (optimi) run their own update: "
                          "leave optim.kernel=auto, or use precision=bf16 with it")
    if cfg.parallelism.tp > 1 and o.kernel != OptimKernel.loop:
        raise ConfigError(f"{key} with parallelism.tp={cfg.parallelism.tp}: tensor parallel splits some parameters into DTensor "
                          "shards and leaves the rest plain tensors, and one fused or foreach call takes one kind: leave "
                          "optim.kernel=auto (the loop under tp), or use optim.kernel=loop")
    if o.state_dtype == StateDtype.bf16:
        raise ConfigError(f"{key} with optim.state_dtype=bf16: its update (finetune's LowPrecisionAdam) runs one parameter at "
                          "a time: leave optim.kernel=auto, or optim.state_dtype=null with it")


def _validate_compile(cfg: Config) -> None:
    """train.compile: the training step's layers compiled; what needs them eager is refused."""
    if cfg.train.compile and cfg.parallelism.tp > 1:
        raise ConfigError(f"train.compile=true with parallelism.tp={cfg.parallelism.tp}: tracing a layer whose weights are "
                          "DTensor shards under transformers' tensor-parallel hooks never ends in AOT autograd (torch 2.13: "
                          "RecursionError in its proxy tracer): use train.compile=true with parallelism=fsdp, ddp or pp, or tp "
                          "without it")
    if cfg.train.compile and cfg.train.memory_snapshot:
        raise ConfigError("train.memory_snapshot=true with train.compile=true: the snapshot is taken by the memory probe, whose "
                          "dispatch mode keeps the layers from compiling (they would run eager): set one of them false")


def _validate_in_backward(cfg: Config) -> None:
    """optim.in_backward: each parameter steps in its gradient hook, so nothing may need every gradient first."""
    o, t = cfg.optim, cfg.train
    if not o.in_backward:
        return
    if cfg.grad_accum_steps > 1:
        raise ConfigError(f"optim.in_backward=true steps every parameter during each backward, so it cannot accumulate "
                          f"{cfg.grad_accum_steps} micro-batches per step (train.global_batch_size={t.global_batch_size} / "
                          f"(train.micro_batch_size={t.micro_batch_size} x data-parallel {cfg.data_parallel_size})): set "
                          f"train.micro_batch_size={t.global_batch_size // cfg.data_parallel_size} (or train.global_batch_size="
                          f"{t.micro_batch_size * cfg.data_parallel_size}), or optim.in_backward=false")
    if o.max_grad_norm is not None:
        raise ConfigError(f"optim.in_backward=true with optim.max_grad_norm={o.max_grad_norm:g}: clipping by the global norm "
                          "needs every gradient before the first step: set optim.max_grad_norm=null (the norm is still "
                          "reported), or optim.in_backward=false")
    if cfg.precision.name == Precision.fp16:
        raise ConfigError("optim.in_backward=true with precision=fp16: the loss scaler checks every gradient for overflow "
                          "before any step: use precision=bf16 or bf16_pure")
    if t.on_nonfinite == NonFinite.skip:
        raise ConfigError("optim.in_backward=true with train.on_nonfinite=skip: the parameters have stepped before the loss "
                          "and the gradient norm can be checked: use train.on_nonfinite=stop")
    where = (f"zero.stage={cfg.zero.stage} (DeepSpeed steps its own optimizer)" if cfg.zero.enabled else
             layout_words(cfg.parallelism) + " (the layout reduces its DTensor gradients outside the per-parameter hooks)"
             if engine_kind(cfg) == "mesh" else
             f"{cfg.world_size} ranks of parallelism=ddp (DDP averages the gradients after the hook would fire)"
             if cfg.world_size > 1 else "")
    if where:
        raise ConfigError(f"optim.in_backward=true with {where}: it runs on one rank of the torch engine "
                          "(parallelism=single, launcher.nproc_per_node=1)")


def _validate_strategies(cfg: Config) -> None:
    ck, peft = cfg.checkpointing, cfg.peft
    if ck.name != Checkpointing.selective:
        _unused(ck, "checkpointing", ("name",), f"with checkpointing={ck.name.value} (only with selective)")
    if peft.name == PeftMethod.none:
        _unused(peft, "peft", ("name",), "with peft=none")
    elif peft.name != PeftMethod.qlora:
        _unused(peft, "peft", ("name", "r", "alpha", "dropout", "target_modules", "modules_to_save"), f"with peft={peft.name.value} (only with qlora)")
    own = {Precision.fp16: ("initial_scale_power", "loss_scale_window"), Precision.bf16_pure: ("kahan_sum",)}
    for owner, keys in own.items():  # each precision's own keys, refused under the others
        if owner != cfg.precision.name:
            _unused(cfg.precision, "precision", tuple(f.name for f in fields(cfg.precision) if f.name not in keys),
                    f"with precision={cfg.precision.name.value} (only with {owner.value})")
    if cfg.logits.name == Logits.full:
        _unused(cfg.logits, "logits", ("name",), "with logits=full (only with logits=chunked)")
    if cfg.logits.kernel == LogitsKernel.cce and cfg.train.device == Device.cpu:
        raise ConfigError("logits.kernel=cce with train.device=cpu: cut-cross-entropy's kernels are Triton, CUDA only: use "
                          "logits.kernel=torch (or auto) on CPU")
    arch = model_config(cfg.model)
    _validate_liger(cfg, arch)
    if cfg.parallelism.pp > 1 and arch is not None and arch.get("output_router_logits") is True:
        raise ConfigError(router_loss_under_pp(cfg.parallelism.pp))
    if peft.name != PeftMethod.none and arch is not None:
        _validate_targets(arch, peft.target_modules)
    if peft.name == PeftMethod.dora and arch is not None and adapted_outside_linears(arch, peft.target_modules):
        raise ConfigError(dora_experts(str(arch.get("model_type") or "")))
    tp = cfg.parallelism.tp
    if peft.name != PeftMethod.none and tp > 1 and arch is not None and adapted_outside_linears(arch, peft.target_modules):
        raise ConfigError(f"peft={peft.name.value} with peft.target_modules={list(peft.target_modules)} adapts this "
                          f"{arch.get('model_type') or 'MoE'} model's experts (fused 3-D weights), which parallelism.tp={tp} shards "
                          "with transformers' expert style that PEFT's adapter cannot follow: name the linear layers "
                          "(e.g. peft.target_modules=[q_proj,k_proj,v_proj,o_proj]), or use parallelism=fsdp")
    if cfg.model.attn_implementation == AttnImpl.flash_attention_2 and cfg.precision.name == Precision.fp32:
        raise ConfigError("model.attn_implementation=flash_attention_2 runs in fp16/bf16 only: add precision=bf16 (or use sdpa)")
    if peft.name == PeftMethod.qlora and cfg.zero.stage == 3 and cfg.precision.name == Precision.fp32:
        raise ConfigError(
            "peft=qlora under zero=stage3 stores the 4-bit weights in the compute dtype so DeepSpeed can shard them: "
            "use precision=bf16 or fp16"
        )


def _validate_liger(cfg: Config, arch: dict[str, Any] | None) -> None:
    """model.kernels=liger and logits.kernel=liger (finetune/liger.py): CUDA, the package, a family Liger patches, no
    tensor parallel. The ranks check the device and the family again (train.device=auto, a hub id's config)."""
    wanted = [(key, instead) for key, instead, on in (
        ("model.kernels=liger", "model.kernels=none", cfg.model.kernels == Kernels.liger),
        ("logits.kernel=liger", "logits.kernel=torch (or auto)", cfg.logits.kernel == LogitsKernel.liger)) if on]
    for key, instead in wanted:
        if cfg.train.device == Device.cpu:
            raise ConfigError(f"{key} with train.device=cpu: {liger.CUDA_ONLY}: use {instead} on CPU")
        if not liger.installed():
            raise ConfigError(liger.not_installed(key, instead))
    if cfg.model.kernels != Kernels.liger:
        return
    supported, model_type = liger.families(), (arch or {}).get("model_type")
    if supported is not None and model_type and model_type not in supported:
        raise ConfigError(liger.unsupported(str(model_type), supported))
    if cfg.parallelism.tp > 1:
        raise ConfigError(f"model.kernels=liger with parallelism.tp={cfg.parallelism.tp}: Liger's Triton kernels take plain "
                          "tensors, and under tensor parallel some layers see DTensor shards (transformers' styles for experts "
                          "and gathered outputs); the pairing was never run: use model.kernels=liger with parallelism=fsdp, ddp "
                          "or pp, or model.kernels=none with tp")


def _validate_targets(arch: dict[str, Any], targets: list[str]) -> None:
    """peft.target_modules names (without dots: a dotted path is the ranks' to check) against the
    modules of a family finetune.families knows, read from its config.json (the ranks check again)."""
    try:
        structure = arch_from_config({"vocab_size": 1, **arch}, "config.json")
    except ConfigError:  # a key the structure needs is missing: the ranks check
        return
    if structure.known:
        refusal = unmatched_targets(structure.model_type, [t for t in targets if "." not in t], *arch_targets(structure))
        if refusal:
            raise ConfigError(refusal)


def _validate_streaming(cfg: Config) -> None:
    """What a stream (data.streaming=true) cannot do, each refused with what to do instead; and its
    shuffle buffer set without one."""
    d, m = cfg.data, cfg.method
    if not d.streaming:
        if d.shuffle_buffer is not None:
            raise ConfigError(f"data.shuffle_buffer={d.shuffle_buffer} applies to data.streaming=true only (otherwise the whole set is "
                              "shuffled by train.seed): remove it, or set data.streaming=true")
        return
    for name in ("cache_dir", "num_proc"):
        if getattr(d, name) is not None:
            raise ConfigError(f"data.{name}={getattr(d, name)} has no effect with data.streaming=true (a stream is tokenized on the fly, "
                              "with no token cache): remove it, or set data.streaming=false")
    srcs = sources(d.train, d.train_split, "data.train")
    for s in srcs:
        if s.rows is not None:
            raise ConfigError(f"{s.key}.rows={s.rows} is an exact count of the source's rows, whose number data.streaming=true does "
                              "not read ahead: give the source a weight instead")
        if s.weight is None and len(srcs) > 1:
            raise ConfigError(f"{s.key}: a streamed mixture draws each next row from a source by its weight (data.streaming=true): "
                              "give every source a weight")
    if len(srcs) > 1 and d.eval is None and d.eval_size:
        raise ConfigError(f"data.eval_size={d.eval_size} with a streamed mixture: data.streaming=true holds out the first rows of one "
                          "source, and a mixture has several: set data.eval")
    method = methods.get(m.name)
    if method.reference(m) == Reference.precomputed:
        raise ConfigError(f"method.reference=precomputed scores every train {method.unit} before training, which a stream cannot "
                          "(data.streaming=true): use method.reference=live (or adapter_disabled with peft), or data.streaming=false")


def padding_free(cfg: Config) -> tuple[bool, str]:
    """(whether the training micro-batches are padding-free, why): data.padding_free, null resolved."""
    asked = cfg.data.padding_free
    p = cfg.parallelism
    why_not = methods.get(cfg.method.name).unpacked or (
        f"parallelism.pp={p.pp} sends every micro-batch through the stages at one shape (data.max_length)" if p.pp > 1 else
        f"parallelism.cp={p.cp} splits each row's tokens over ranks and masks the whole row" if p.cp > 1 else None)
    if asked is False:
        return False, "data.padding_free=false"
    if why_not is not None:
        if asked:
            raise ConfigError(f"data.padding_free=true cannot run here: {why_not}: set data.padding_free=false (or null)")
        return False, f"padded: {why_not}"
    if asked is None and cfg.train.micro_batch_size == 1:
        return False, "padded: one row per micro-batch has no padding"
    return True, "data.padding_free=true" if asked else "auto"


def several_per_row(cfg: Config) -> str:
    """What lays several samples in a training row, each attended alone (finetune.varlen; "" when nothing does):
    packing, padding-free micro-batches. Under pipeline or context parallel the rows keep transformers' mask."""
    if cfg.parallelism.pp > 1 or cfg.parallelism.cp > 1:
        return ""
    return " and ".join(w for w, on in (("packed rows", cfg.data.packing), ("padding-free micro-batches", padding_free(cfg)[0])) if on)


def _validate_method(cfg: Config) -> None:
    """The method's own rules (its finetune.methods record), then what every method's record declares: the data
    forms it reads, whether its rows can be packed."""
    method = methods.get(cfg.method.name)
    method.validate(cfg)
    fmt = cfg.data.format
    if fmt != DataFormat.auto and fmt not in method.forms:
        raise ConfigError(f"method={method.name} reads data.format={' or '.join(f.value for f in method.forms)} rows (or auto): "
                          f"data.format={fmt.value} is not one of them")
    if cfg.data.packing and method.unpacked:
        raise ConfigError(f"data.packing=true cannot run here: {method.unpacked}: set data.packing=false")


SHAPE = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "max_position_embeddings",
         "tie_word_embeddings")
"""What the layout and the context length are checked against (model_shape)."""


def model_shape(cfg: ModelConfig) -> dict[str, Any] | None:
    """The SHAPE keys from model.init, a local config.json or model.architecture, read under the
    families' aliases (disk.ALIASES; None where the config says nothing). None: a hub id without
    model.architecture, checked on the ranks."""
    if cfg.init is not None:
        return {k: getattr(cfg.init, k) for k in SHAPE}
    arch = local_config(cfg)
    if arch is None:
        return None
    return {k: config_value(arch, k) for k in SHAPE}


def check_layout_fits_model(p: ParallelismConfig, shape: dict[str, Any]) -> None:
    """The family has the tensor-parallel / pipeline plan the layout needs (families.FAMILIES; a
    model_type not listed is left to the ranks), tp divides the heads and the MLP width, there are
    at least as many blocks as pipeline stages, and pipeline stages have untied embeddings. A size
    the shape lacks (None) is not checked."""
    model_type = shape.get("model_type")
    fam = FAMILIES.get(str(model_type))
    if p.tp > 1 and fam is not None and not fam.tp_plan:
        conv = " and its fused Conv1D layers (c_attn, c_proj, c_fc) are not the Llama layout our own plan splits" if fam.gpt2 else ""
        raise ConfigError(f"parallelism.tp={p.tp}: transformers publishes no tensor-parallel plan for model_type={model_type}{conv}: "
                          "use parallelism=fsdp or ddp")
    if p.pp > 1 and fam is not None and not fam.pp_plan:
        raise ConfigError(f"parallelism.pp={p.pp}: transformers publishes no pipeline plan for model_type={model_type} (which "
                          "modules run before and after its blocks), so it cannot be cut into stages: use parallelism=fsdp or ddp")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if p.tp > 1 and shape.get(key) and shape[key] % p.tp:
            raise ConfigError(f"parallelism.tp={p.tp} must divide the model's {key}={shape[key]}: "
                              f"use a tp that divides {shape[key]}")
    for key in ("num_attention_heads", "num_key_value_heads"):  # the all-to-all hands each cp rank whole heads
        heads = shape.get(key) or (shape.get("num_attention_heads") if key == "num_key_value_heads" else None)
        if p.cp > 1 and heads and heads % p.tp == 0 and (heads // p.tp) % p.cp:
            per = f"{heads // p.tp} per tensor-parallel rank ({key}={heads} / parallelism.tp={p.tp})" if p.tp > 1 else f"the model's {key}={heads}"
            raise ConfigError(f"parallelism.cp={p.cp} must divide {per}: each context-parallel rank attends over whole heads; "
                              f"use a cp that divides {heads // p.tp}")
    stages, blocks = p.pp * p.pp_stages_per_rank, shape.get("num_hidden_layers")
    if p.pp > 1 and blocks and stages > blocks:
        raise ConfigError(f"parallelism.pp={p.pp} x pp_stages_per_rank={p.pp_stages_per_rank} = {stages} pipeline stages, but the "
                          f"model has {blocks} blocks: use at most {blocks} stages")
    if p.pp > 1 and shape.get("tie_word_embeddings") is True:
        raise ConfigError("pipeline parallel needs untied input/output embeddings (the first and last stages hold them): "
                          "this model ties them; use tp or fsdp")


def _validate_structure(m: ModelConfig) -> None:
    """The model's config as transformers would check it when a rank builds it (finetune.structure), from
    model.init, a local model.path's config.json (its text_config, for a multimodal wrapper) or model.architecture,
    with what transformers fills in from the family's defaults where the config says nothing (family_defaults)."""
    if m.init is not None:
        config, key, source = model_config(m), (lambda k: f"model.init.{k}"), ""
    else:
        config = local_config(m)
        if config is None:
            return
        file = config_source(m)
        nested = "text_config." if file != "model.architecture" and "text_config" in local_config(m, whole=True) else ""
        key = (lambda k: f"model.architecture.{k}") if file == "model.architecture" else (lambda k: nested + k)
        source = "" if file == "model.architecture" else f" in {file}"
    assert config is not None
    problem = structure_problem({**family_defaults(config.get("model_type"), m.init is not None), **config}, key, source)
    if problem:
        raise ConfigError(problem)


def family_defaults(model_type: Any, init: bool) -> dict[str, Any]:
    """The structural keys a family's transformers config fills in when config.json leaves them out (COUNTED
    records; other model_types: none): its own head_dim (Qwen3's 128, Gemma's 256) and, for a model.init (which
    has no RoPE keys to state), default RoPE unless the family has learned positions (GPT-2)."""
    fam = COUNTED.get(model_type)
    if fam is None:
        return {}
    return {**({"head_dim": fam.head_dim} if fam.head_dim else {}),
            **({"rope_parameters": {"rope_type": "default"}} if init and fam.positions is None else {})}


def _validate_context(cfg: Config) -> None:
    """data.max_length within the model's positions (model.init's, or a local config.json's)."""
    shape, length = model_shape(cfg.model), cfg.data.max_length
    limit = shape.get("max_position_embeddings") if shape else None
    if not isinstance(limit, int) or length <= limit:
        return
    if cfg.model.init is not None:
        raise ConfigError(f"data.max_length={length} exceeds model.init.max_position_embeddings={limit}: lower one or raise the other")
    config = config_source(cfg.model)
    raise ConfigError(f"data.max_length={length} exceeds the model's max_position_embeddings={limit} ({config}): "
                      f"use data.max_length={limit} or less")


def _validate_layout(cfg: Config) -> None:
    p, launch, world = cfg.parallelism, cfg.launcher, cfg.world_size
    model_parallel = p.tp * p.pp * p.cp
    if model_parallel > 1 and world % model_parallel:
        cp = f" x parallelism.cp={p.cp}" if p.cp > 1 else ""
        raise ConfigError(
            f"parallelism.tp={p.tp} x parallelism.pp={p.pp}{cp} = {model_parallel} ranks per model replica does not divide the "
            f"launch size {world} (launcher.nproc_per_node={launch.nproc_per_node} x launcher.nnodes={launch.nnodes}): "
            f"launch a multiple of {model_parallel} ranks"
        )
    if model_parallel > 1 and p.strategy == Strategy.single:
        cp = f"/cp={p.cp}" if p.cp > 1 else ""
        raise ConfigError(f"parallelism.tp={p.tp}/pp={p.pp}{cp} need parallelism.strategy=ddp or fsdp (data parallel over "
                          f"world / (tp x pp{' x cp' if cp else ''}) replicas), not single")
    if p.pp == 1:
        _unused(p, "parallelism", ("strategy", "tp", "pp", "cp", "fsdp_reshard_after_forward", "fsdp_offload"), "without pipeline parallel (pp=1)")
    if p.strategy != Strategy.fsdp:
        _unused(p, "parallelism", ("strategy", "tp", "pp", "cp", "pp_schedule", "pp_stages_per_rank"), f"with strategy={p.strategy.value} (only with fsdp)")
    interleaved = p.pp_schedule == PipeSchedule.interleaved_1f1b
    if p.pp > 1 and interleaved != (p.pp_stages_per_rank > 1):
        raise ConfigError(f"parallelism.pp_schedule={p.pp_schedule.value} with pp_stages_per_rank={p.pp_stages_per_rank}: "
                          "interleaved_1f1b needs 2 or more stages per rank, gpipe and 1f1b exactly 1")
    shape = model_shape(cfg.model)
    if shape is not None:
        check_layout_fits_model(p, shape)
    if not (model_parallel > 1 or p.strategy == Strategy.fsdp):
        return
    layout = f"parallelism.strategy={p.strategy.value} tp={p.tp} pp={p.pp}"
    if cfg.precision.name == Precision.fp16:
        raise ConfigError(f"precision=fp16 is not supported with {layout} (no sharded loss scaler here): use precision=bf16")
    if cfg.peft.name == PeftMethod.qlora and p.tp > 1:
        raise ConfigError(f"peft=qlora is not supported with tensor parallel (parallelism.tp={p.tp}): bitsandbytes keeps a 4-bit "
                          "weight as one flat buffer of packed pairs with per-block constants, which has no rows or columns to "
                          "split (no maintained library splits it): use peft=qlora with parallelism=fsdp or pp, or peft=lora with tp")
    if p.cp > 1:
        _validate_context_parallel(cfg)
    if cfg.peft.name == PeftMethod.dora and p.tp > 1:
        raise ConfigError("peft=dora is not supported with tensor parallel (its weight norm spans the sharded dimension): "
                          "use peft=lora with tp, or dora with fsdp/ddp")
    if p.pp > 1:
        if methods.get(cfg.method.name).reference(cfg.method) not in (None, Reference.precomputed):
            raise ConfigError(f"method.reference={cfg.method.reference.value} is not supported with pipeline parallel: "
                              "use method.reference=precomputed")
        if cfg.checkpointing.name == Checkpointing.offload:
            raise ConfigError("checkpointing=offload is not supported with pipeline parallel: use checkpointing=full or selective")


def _validate_context_parallel(cfg: Config) -> None:
    """What context parallel (finetune/context.py) does not combine with, and why."""
    p = cfg.parallelism
    if p.pp > 1:
        raise ConfigError(f"parallelism.cp={p.cp} with pipeline parallel (parallelism.pp={p.pp}) is not supported (a stage hands "
                          "whole sequences to the next): use cp with fsdp or ddp, and tp")
    method = methods.get(cfg.method.name)
    if method.split_tokens:
        raise ConfigError(f"method={method.name} with parallelism.cp={p.cp} is not supported: {method.split_tokens}")
    arch = model_config(cfg.model)
    if arch is not None and arch.get("output_router_logits") is True:
        raise ConfigError(router_loss_split(f"parallelism.cp={p.cp}"))


def _validate_hardware(cfg: Config) -> None:
    """A GPU launch cannot start more ranks on a node than the declared hardware has GPUs."""
    hw, launch = cfg.hardware, cfg.launcher
    if hw.gpu_memory_gib and launch.nproc_per_node > hw.gpus_per_node:
        raise ConfigError(f"launcher.nproc_per_node={launch.nproc_per_node} exceeds hardware.gpus_per_node={hw.gpus_per_node} of "
                          f"hardware={hw.name}: lower launcher.nproc_per_node, or declare the machine with hardware.gpus_per_node=N")


def _validate_launcher(cfg: Config) -> None:
    """The c10d rendezvous (launcher.rdzv_endpoint) against the static one and the deepspeed launcher."""
    launch, default = cfg.launcher, LauncherConfig()
    endpoint = launch.rdzv_endpoint
    if endpoint is None:
        if launch.rdzv_id != default.rdzv_id:
            raise ConfigError(f"launcher.rdzv_id={launch.rdzv_id} has no effect without launcher.rdzv_endpoint (c10d rendezvous): "
                              "set launcher.rdzv_endpoint=HOST:PORT or remove launcher.rdzv_id")
        return
    if launcher_for(cfg) == LauncherName.deepspeed:
        raise ConfigError(f"launcher.rdzv_endpoint={endpoint} is a torchrun (c10d rendezvous) setting, but this run uses the deepspeed "
                          "launcher: unset launcher.rdzv_endpoint and use launcher.hostfile or launcher.no_ssh=true launcher.node_rank=R, "
                          "or add launcher=torchrun")
    static = [f"launcher.{key}={getattr(launch, key)}" for key in ("node_rank", "master_addr", "master_port")
              if getattr(launch, key) != getattr(default, key)]
    if static:
        raise ConfigError(f"{' and '.join(static)} {'conflicts' if len(static) == 1 else 'conflict'} with launcher.rdzv_endpoint="
                          f"{endpoint} (the c10d rendezvous assigns node ranks): remove {'it' if len(static) == 1 else 'them'}, "
                          "or unset launcher.rdzv_endpoint to use the static rendezvous")


def _validate_zero(cfg: Config) -> None:
    z, launch = cfg.zero, cfg.launcher
    if launch.name == LauncherName.deepspeed and not z.enabled:
        raise ConfigError("launcher=deepspeed starts the DeepSpeed engine, which needs a zero option: use zero=stage0..stage3 or launcher=torchrun")
    if (launch.hostfile or launch.no_ssh) and launch.name == LauncherName.torchrun:
        raise ConfigError("launcher.hostfile and launcher.no_ssh are deepspeed launcher settings: use launcher=deepspeed (or unset them)")
    if not z.enabled:
        if z.offload_optimizer != Offload.none or z.offload_param != Offload.none:
            raise ConfigError("zero.offload_* needs DeepSpeed: choose a zero option (e.g. zero=stage2_offload), not zero=none")
        _unused(z, "zero", ("stage",), "with zero=none (no DeepSpeed)")
        return
    if z.stage == 3:
        _unused(z, "zero", tuple(f.name for f in fields(z) if f.name != "allgather_bucket_size"), "with ZeRO stage 3 (stages 1-2 only)")
    else:  # offload_param below stage 3 gets its own message further down
        stage3_knobs = [f.name for f in fields(z) if f.name.startswith("stage3_") or f.name == "sub_group_size"]
        _unused(z, "zero", tuple(f.name for f in fields(z) if f.name not in stage3_knobs), f"with ZeRO stage {z.stage} (stage 3 only)")
    if cfg.parallelism.strategy not in (Strategy.single, Strategy.ddp) or cfg.parallelism.tp * cfg.parallelism.pp * cfg.parallelism.cp > 1:
        p = cfg.parallelism
        raise ConfigError(
            f"zero=stage{z.stage} shards over data-parallel ranks; parallelism strategy={p.strategy.value} tp={p.tp} pp={p.pp} is "
            "a torch-engine layout (FSDP2 / DTensor / pipelining): use parallelism=ddp with zero, or zero=none"
        )
    if z.offload_optimizer != Offload.none and z.stage < 2:
        raise ConfigError(
            f"zero.offload_optimizer={z.offload_optimizer.value} needs ZeRO stage 2 or 3 (got stage {z.stage}): "
            "use zero=stage2_offload or zero=stage3_offload"
        )
    if z.offload_param != Offload.none and z.stage != 3:
        raise ConfigError(f"zero.offload_param={z.offload_param.value} needs ZeRO stage 3 (got stage {z.stage}): use zero=stage3_offload")
    if Offload.nvme in (z.offload_optimizer, z.offload_param) and not z.nvme_path:
        raise ConfigError("NVMe offload needs a directory on a fast local disk: set zero.nvme_path=/local/nvme")
    if launch.nnodes > 1 and launcher_for(cfg) == LauncherName.deepspeed and not launch.hostfile:
        raise ConfigError(
            f"launcher.nnodes={launch.nnodes} with the deepspeed launcher needs launcher.hostfile "
            "(one 'host slots=N' line per node; see launch/hostfile.example)"
        )
