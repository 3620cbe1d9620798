"""The optimizer's rules (its record, finetune/optimizers/): the keys it takes, the schedule, the engines and precisions
it runs under, bf16 moments, the kernel, compiling, stepping in backward.
"""

from __future__ import annotations

from finetune.config import Config, ConfigError, NonFinite, OptimKernel, Precision, Scheduler, StateDtype
from finetune.layouts import engine_kind
from finetune import optimizers
from finetune.launcher.rules.layout import layout_words
from finetune.data.steps import check_warmup


def validate_optimizer_keys(cfg: Config) -> None:
    """The optim.* keys the optimizer's constructor takes (its record, finetune/optimizers/): a built-in ignores betas
    and eps where unused, but optim.momentum set without sgd is refused; a torch class refuses any key it does not take."""
    o = cfg.optim
    rec = optimizers.record(o.name)  # a torch class that does not exist or cannot step is refused here
    if o.momentum and "momentum" not in rec.takes and o.name in optimizers.RECORDS:
        takers = " or ".join(n for n, r in optimizers.RECORDS.items() if "momentum" in r.takes)
        raise ConfigError(f"optim.momentum={o.momentum} applies to optim.name={takers} only ({o.name} uses "
                          f"optim.betas): remove it, or use optim=momentum")
    optimizers.refuse_unused_keys(o, rec)


def validate_schedule(cfg: Config) -> None:
    """optim.min_lr_ratio, optim.warmup_steps and train.on_nonfinite against the schedule and the engine."""
    if cfg.optim.min_lr_ratio and cfg.optim.scheduler != Scheduler.cosine:
        raise ConfigError(
            f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} applies to optim.scheduler=cosine only "
            f"(got {cfg.optim.scheduler.value}): set optim.min_lr_ratio=0 or optim.scheduler=cosine"
        )
    if cfg.train.on_nonfinite == NonFinite.skip and cfg.zero.enabled:
        raise ConfigError("train.on_nonfinite=skip needs the torch engine: DeepSpeed applies a step before its loss can be checked "
                          "(use train.on_nonfinite=stop, or zero=none)")
    check_warmup(cfg)


def validate_length(cfg: Config) -> None:
    """How long training runs: train.max_steps or train.epochs, exactly one (epochs only where the data's length is
    known ahead). The launcher fills max_steps in from epochs (finetune.data.steps), so a resolved config has both."""
    t = cfg.train
    if t.epochs is None and t.max_steps is None:
        raise ConfigError("train.max_steps=null and no train.epochs: set train.max_steps=N (optimizer steps) or train.epochs=N "
                          "(passes over data.train)")
    if t.epochs is not None and t.max_steps is not None:
        raise ConfigError(f"train.epochs={t.epochs:g} and train.max_steps={t.max_steps} both set how long training runs: add "
                          "train.max_steps=null to train for epochs, or remove train.epochs")
    if t.epochs is not None and cfg.data.streaming:
        raise ConfigError(f"train.epochs={t.epochs:g} needs the number of training examples, which a stream (data.streaming=true) "
                          "does not know before the run reads it: set train.max_steps instead")


def validate_optimizer_engine(cfg: Config) -> None:
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


def validate_pure(cfg: Config) -> None:
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


def validate_state_dtype(cfg: Config) -> None:
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


def validate_kernel(cfg: Config) -> None:
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


def validate_compile(cfg: Config) -> None:
    """train.compile: the training step's layers compiled; what needs them eager is refused."""
    if cfg.train.compile and cfg.parallelism.tp > 1:
        raise ConfigError(f"train.compile=true with parallelism.tp={cfg.parallelism.tp}: tracing a layer whose weights are "
                          "DTensor shards under transformers' tensor-parallel hooks never ends in AOT autograd (torch 2.13: "
                          "RecursionError in its proxy tracer): use train.compile=true with parallelism=fsdp, ddp or pp, or tp "
                          "without it")
    if cfg.train.compile and cfg.train.memory_snapshot:
        raise ConfigError("train.memory_snapshot=true with train.compile=true: the snapshot is taken by the memory probe, whose "
                          "dispatch mode keeps the layers from compiling (they would run eager): set one of them false")


def validate_in_backward(cfg: Config) -> None:
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
