"""What the engines share: the step result, the optimizer and the learning-rate schedule."""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator

import torch

from finetune import optimizers
from finetune.config import ConfigError, OptimConfig, Precision, Scheduler, StateDtype
from finetune.optimizers.kernels import closure_loss


@contextlib.contextmanager
def no_deepspeed_probe() -> Iterator[None]:
    """For a torch engine's save_pretrained: transformers unwraps the model through accelerate, which imports all of
    DeepSpeed where it is installed, only to test whether a DeepSpeedEngine wraps the model (none does here): about
    0.5 s of the export, more on a busy machine. accelerate is told DeepSpeed is absent meanwhile; nothing changes where
    DeepSpeed is imported already, or where accelerate's function is not where it was (another accelerate version)."""
    other = sys.modules.get("accelerate.utils.other")
    if "deepspeed" in sys.modules or not callable(getattr(other, "is_deepspeed_available", None)):
        yield
        return
    probe = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = probe


@dataclass
class StepResult:
    """A step's numbers as the engine leaves them: device tensors (or numbers), read by the loop once per step
    (finetune.rank.syncs: nothing is read back per micro-batch)."""

    loss_sum: Any
    """This rank's summed loss over its micro-batches (the loop reduces and divides)."""
    grad_norm: Any
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate this step used."""
    loss_scale: Any = None
    """fp16: the dynamic loss scale after this step."""
    skipped: Any = 0
    """fp16: optimizer steps skipped so far because gradients overflowed."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """This rank's sums of the objective's own metrics (DPO rewards...), reduced like `loss_sum`."""
    applied: Any = True
    """Whether the optimizer step was applied (False: skipped because the gradient norm was not finite)."""


def add_metrics(total: dict[str, Any], sums: dict[str, Any]) -> None:
    """Accumulate an objective's metric sums into `total`, on the device (nothing read back)."""
    for k, v in sums.items():
        v = v.detach() if torch.is_tensor(v) else v
        total[k] = total[k] + v if k in total else v


def clip(params: list[torch.nn.Parameter], max_norm: float | None, norm: torch.Tensor | None = None) -> torch.Tensor:
    """Scale the gradients to at most `max_norm` (None: not clipped) by their global norm (computed here, or given:
    DTensor shards and pipeline stages summed by the caller), without reading it: the factor stays a tensor. Returns
    the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if norm is None:
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if max_norm and grads:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def skip_unless_finite(optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> Any:
    """optimizer.step() unless the gradient norm is not finite (never step on inf/nan gradients: the loop stops or
    skips). A fused torch optimizer is told on the device (its `found_inf`, as GradScaler tells it: the kernel leaves
    weights, moments and step counts as they were), so nothing is read; any other reads the norm, the step's one host
    read before the loop's. Returns whether it stepped (a tensor where the fused kernel decided)."""
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    # each group's own flag: a checkpoint of another layout's kernel (tp's loop) loads its groups' flags with it
    if getattr(optimizer, "_step_supports_amp_scaling", False) and all(g.get("fused") for g in optimizer.param_groups):
        finite = torch.isfinite(norm)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        device = params[0].device if params else norm.device
        optimizer.found_inf = (~finite).to(device, torch.float32)  # read by torch's Adam/AdamW/SGD step
        optimizer.step()
        return finite
    if math.isfinite(float(norm)):
        optimizer.step()
        return True
    return False


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig, kahan: bool | None = None,
                    drop_empty: bool = False, fast: Collection[int] = (), ends: Collection[int] = ()) -> torch.optim.Optimizer:
    """The torch optimizer `optim.name` names (its record's builder, finetune/optimizers/), over `param_groups`
    (no decay on 1-D tensors).

    adamw: decoupled weight decay. adam: torch's Adam adds weight_decay * w to the gradient (L2
    regularisation, scaled by Adam's normalisation), a different regulariser at the same number.
    sgd: optim.momentum 0 keeps no state, > 0 one momentum buffer per parameter; betas/eps unused.
    adamw_8bit: bitsandbytes' AdamW8bit (runs on CPU too). adafactor: torch's, decoupled weight decay. Over DTensor
    shards (FSDP2, TP) both are optimizers.sharded's versions: the same updates, each rank stepping its shard.
    A torch.optim class by name: built with the optim.* keys its constructor takes.
    optim.state_dtype=bf16 (adam/adamw over fp32 weights): `LowPrecisionAdam`, the same update with the
    moments stored in bf16.
    (The DeepSpeed engine builds the same optimizers from `layouts.zero.deepspeed_config`.)

    drop_empty: leave out a parameter group with no parameters (the mesh engine's checkpoints need it).
    fast: ids of the LoRA B matrices (`lora_b`), which learn at optim.lr x optim.loraplus_lr_ratio when it is set (LoRA+).
    ends: ids of the input embeddings' and output layer's weights (`end_weights`): an optimizer whose record keeps them
    apart (muon: AdamW for them, Muon for the hidden matrices) gets them in groups marked `end`.
    kahan (precision=bf16_pure, bf16 parameters): not None selects optimi's class of the record (`pure`), the same
    update as torch's, with the states in the parameters' dtype and, when True, Kahan-compensated addition of
    each update (a bf16 compensation buffer per parameter).
    """
    rec = optimizers.record(cfg.name)
    groups = param_groups(params, cfg.weight_decay, fast=fast, fast_lr=loraplus_lr(cfg))
    if rec.ends_state_bytes is not None:
        groups = [part for g in groups for part in ({**g, "params": [p for p in g["params"] if id(p) not in ends]},
                                                    {**g, "params": [p for p in g["params"] if id(p) in ends], "end": True})
                  if part["params"]]
    if drop_empty:  # DCP's flattened optimizer state cannot load a group without parameters (LoRA: no 1-D ones)
        groups = [g for g in groups if g["params"]] or groups[:1]
    if kahan is not None:
        import optimi

        kwargs = {"momentum": cfg.momentum, "torch_init": True} if "momentum" in rec.takes else \
            {"betas": tuple(cfg.betas), "eps": cfg.eps}
        return getattr(optimi, rec.pure)(groups, lr=cfg.lr, kahan_sum=kahan, **kwargs)
    if cfg.state_dtype == StateDtype.bf16 and rec.moments:
        return LowPrecisionAdam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, decoupled=rec.decoupled)
    return rec.build(groups, cfg, params)


class LowPrecisionAdam(torch.optim.Optimizer):
    """Adam/AdamW (torch's update, step for step) whose two moments are stored in `state_dtype` (bf16: 4
    bytes per parameter instead of 8) whatever the parameters' dtype. Each parameter's step reads its
    moments up to fp32, updates them and the weight in fp32, and rounds the moments back (to nearest): the
    fp32 copies exist for one parameter at a time. Plain tensor ops, so DTensor shards (FSDP2, TP) step too.
    No maintained library keeps low-precision moments over fp32 weights (torch's and optimi's keep them in
    the parameters' dtype; bitsandbytes' and torchao's quantize them to 8 bits)."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, decoupled: bool = True,
                 state_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.decoupled, self.state_dtype = decoupled, state_dtype
        # torch's load_state_dict casts floating-point states to the parameter's dtype: cast them back
        self.register_load_state_dict_post_hook(lambda opt: opt._restore_dtype())

    def _restore_dtype(self) -> None:
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != self.state_dtype:
                    state[key] = state[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        for group in self.param_groups:
            (beta1, beta2), lr, eps, decay = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                grad = p.grad.float()
                if decay and not self.decoupled:  # adam: L2, added to the gradient
                    grad = grad.add(p, alpha=decay)
                mean = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                square = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(mean)
                state["exp_avg_sq"].copy_(square)
                if decay and self.decoupled:
                    p.mul_(1 - lr * decay)
                denom = square.sqrt().div_(math.sqrt(1 - beta2 ** step)).add_(eps)
                p.addcdiv_(mean, denom, value=-lr / (1 - beta1 ** step))
        return loss


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> Any:
    """Linear warmup, then cosine (to lr * min_lr_ratio) or linear decay, or constant: transformers'
    schedules (`get_scheduler`'s cosine_with_min_lr, linear, constant_with_warmup), written out here
    because importing them pulls peft, bitsandbytes and torch's compiler into every rank (1.4 s)."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, functools.partial(lr_factor, scheduler=cfg.scheduler, warmup=cfg.warmup_steps, total=max_steps,
                                                 min_ratio=cfg.min_lr_ratio))


def lr_factor(step: int, *, scheduler: Scheduler, warmup: int, total: int, min_ratio: float) -> float:
    """The learning rate at `step` over the peak (transformers' formulas, equal to theirs: tests/test_optim.py)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if scheduler == Scheduler.constant:
        return 1.0
    if scheduler == Scheduler.linear:
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))  # cosine, half a cycle down to min_ratio
    return max(0, 0.5 * (1.0 + math.cos(math.pi * progress)) * (1 - min_ratio) + min_ratio)


def autocast_dtype(name: Any) -> torch.dtype | None:
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16_pure": torch.bfloat16}[name.value]


def to_bf16(model: torch.nn.Module) -> None:
    """precision=bf16_pure: every floating-point parameter in bf16, in place (quantized 4-bit storage and
    buffers such as the rotary frequencies stay as they are)."""
    place(model.parameters(), None, torch.bfloat16)


def read_for(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype a frozen model beside the policy is cast to on the device: the one finetune.rank.model.load_model read
    it for (DPO's live reference: the training weights' dtype) where it was read in the checkpoint's own; None (kept as
    it is) for one loaded in the dtype it runs in (a distillation teacher's method.teacher precision)."""
    return getattr(model, "cast_to", None)


def training_dtype(precision: Any) -> torch.dtype:
    """The dtype the trained weights are held in: bf16 under precision=bf16_pure, fp32 (the master weights) otherwise."""
    return torch.bfloat16 if precision == Precision.bf16_pure else torch.float32


def place(params: Any, device: torch.device | None, dtype: torch.dtype | None) -> None:
    """Each floating-point parameter moved to `device` (None: where it is) and then cast to `dtype` there, one tensor at a
    time and in place (the Parameter objects stay: PEFT's, the optimizer's): a checkpoint read in its own dtype, memory-
    mapped (finetune.rank.model.read_dtype), reaches the device in it and is cast there, never copied whole to fp32 on
    the host (`dtype` None: each keeps its own). Quantized 4-bit storage (bitsandbytes' Params4bit, bf16 bytes under
    ZeRO-3) stays as it is."""
    from torch.distributed.tensor import DTensor

    for p in params:
        if not p.is_floating_point() or type(p).__name__ == "Params4bit":
            continue
        data = p.data if device is None or p.device == device else p.data.to(device)
        data = data if dtype is None or data.dtype == dtype else data.to(dtype)
        if isinstance(p, DTensor) and data is not p.data:  # a tensor-parallel shard: `.data =` would leave its local tensor
            torch.utils.swap_tensors(p, torch.nn.Parameter(data, requires_grad=p.requires_grad))
        else:
            p.data = data


def param_groups(params: list[torch.nn.Parameter], weight_decay: float, *, fast: Collection[int] = (),
                 fast_lr: float | None = None) -> list[dict[str, Any]]:
    """No weight decay on biases and norm scales (1-D tensors), as is standard for transformers. With `fast_lr`
    (LoRA+), the parameters whose id is in `fast` (the B matrices) go into groups of their own at that rate: torch's
    optimizers, optimi's, bitsandbytes' and DeepSpeed's take a group's "lr" over the default, and the scheduler scales
    each group's own rate."""
    slow = [p for p in params if fast_lr is None or id(p) not in fast]
    groups = [
        {"params": [p for p in slow if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in slow if p.ndim < 2], "weight_decay": 0.0},
    ]
    if fast_lr is not None:
        quick = [p for p in params if id(p) in fast]
        groups += [g for g in ({"params": [p for p in quick if p.ndim >= 2], "weight_decay": weight_decay, "lr": fast_lr},
                               {"params": [p for p in quick if p.ndim < 2], "weight_decay": 0.0, "lr": fast_lr}) if g["params"]]
    return groups


def loraplus_lr(cfg: OptimConfig) -> float | None:
    """The LoRA B matrices' rate under LoRA+ (optim.loraplus_lr_ratio), None without it."""
    return cfg.lr * cfg.loraplus_lr_ratio if cfg.loraplus_lr_ratio else None


def end_weights(model: torch.nn.Module) -> set[int]:
    """ids of the input embeddings' and the output layer's weights (what Muon leaves to AdamW)."""
    layers = (getattr(model, name, lambda: None)() for name in ("get_input_embeddings", "get_output_embeddings"))
    return {id(layer.weight) for layer in layers if getattr(layer, "weight", None) is not None}


LORA_B = ("lora_B", "lora_embedding_B")
"""PEFT's names of the adapters' B matrices (linear and embedding adapters), the ones LoRA+ speeds up."""


def lora_b(*modules: torch.nn.Module) -> set[int]:
    """ids of the LoRA B parameters in `modules` (the ones a LoRA+ group trains at the higher rate)."""
    return {id(p) for m in modules for name, p in m.named_parameters() if any(f".{b}." in f".{name}" for b in LORA_B)}


class InBackward:
    """optim.in_backward: one optimizer per parameter, stepped by that parameter's post-accumulate-grad hook
    the moment its gradient is complete; the gradient is freed right after, so at most the gradients of
    the parameters autograd is finishing exist at once, never the whole model's.

    `lead` is an optimizer over every parameter that never steps (torch's optimizers create state on
    their first step, so it holds none): the learning-rate scheduler drives it, and `begin()` copies its
    rate to the per-parameter optimizers before each backward. The gradient norm is summed in the hooks
    (reported, not clipped: a global norm is known only after every parameter has stepped)."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: OptimConfig, kahan: bool | None, fast: Collection[int] = (),
                 ends: Collection[int] = ()) -> None:
        self.params = params
        self.lead = build_optimizer(params, cfg, kahan, fast=fast, ends=ends)
        self.optimizers = [build_optimizer([p], cfg, kahan, fast=fast, ends=ends) for p in params]
        self.peak = cfg.lr  # each optimizer's groups keep their own peak (LoRA+): begin() scales them all alike
        self.peaks = [[g["lr"] for g in opt.param_groups] for opt in self.optimizers]
        self.handles: list[Any] = []
        self.squares: torch.Tensor | None = None

    def hook(self) -> None:
        """Install the hooks (after any memory tracker's own, so that it sees each gradient before it is freed)."""
        if self.handles:
            return
        for p, opt in zip(self.params, self.optimizers):
            self.handles.append(p.register_post_accumulate_grad_hook(self._stepper(opt)))

    def _stepper(self, opt: torch.optim.Optimizer) -> Any:
        def step(p: torch.nn.Parameter) -> None:
            square = p.grad.detach().float().pow(2).sum()
            self.squares = square if self.squares is None else self.squares + square
            opt.step()
            p.grad = None
        return step

    def begin(self) -> None:
        self.hook()
        factor = self.lead.param_groups[0]["lr"] / self.peak
        for opt, peaks in zip(self.optimizers, self.peaks):
            for group, peak in zip(opt.param_groups, peaks):
                group["lr"] = peak * factor
        self.squares = None

    def end(self) -> None:
        """After backward: every gradient is gone, so the lead's step changes nothing; it only tells the
        scheduler that an optimizer step happened (torch warns about the order otherwise)."""
        self.lead.step()

    def norm(self) -> Any:
        """The global norm of this step's gradients (each summed in its hook before the step), on the device."""
        return self.squares.sqrt() if self.squares is not None else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"per_param": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["per_param"]) != len(self.optimizers):
            raise ConfigError(f"train.resume: the checkpoint steps {len(state['per_param'])} parameters in backward, "
                              f"this model trains {len(self.optimizers)}: resume with the same model and peft settings")
        for opt, s in zip(self.optimizers, state["per_param"]):
            opt.load_state_dict(s)
