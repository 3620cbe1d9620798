"""The optimizer axis as data: one `OptimizerRecord` per `optim.name`, read by the engines (how it is built), the
planner (its state bytes, its step's temporaries, the cheaper ones it may suggest), the rules (the precisions,
engines and keys it takes), the launcher (its DeepSpeed JSON) and the checkpoint code (whether a sharded
checkpoint of it resumes on another layout).

Built in: adamw, adam, sgd, adamw_8bit, muon, adafactor (`RECORDS`). Besides them `optim.name` takes any torch.optim
class by its dotted name (`optim.name=torch.optim.NAdam`): `record()` makes its record from the class itself (the
config keys its constructor takes, by `inspect.signature`; its state bytes, by stepping it once on two probe
tensors and reading its `state_dict`). It runs on the torch engine and checkpoints like torch's own AdamW.

Adding a built-in optimizer is one entry in `RECORDS` (and a recipes/optim/NAME.yaml if it deserves a
group option): a test walks every record through the engine, the planner, the rules and the launcher.

Imports no torch: the builders and the torch-class records import it when called. The package's other modules are
the rank side the builders reach: kernels.py (the kernel keyword, the step's closure), sharded.py (Adafactor and
8-bit AdamW over DTensor shards) and muon.py (torch's Muon and AdamW as one optimizer).
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from enum import Enum

from finetune.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    import torch


class OptimValues(Protocol):
    """What the builders and checks here read of the optim group: finetune.config.OptimConfig has it all (this module
    names no config class: the schema imports this module for its optimizer names)."""

    name: str
    lr: float
    betas: Any
    eps: float
    weight_decay: float
    momentum: float
    kernel: Any


Builder = Callable[[list[dict[str, Any]], OptimValues, list[Any]], Any]
"""(param groups, the optim config, the parameters) -> a torch optimizer over those groups."""

KEYS = ("lr", "betas", "eps", "weight_decay", "momentum")
"""The optim.* keys an optimizer's constructor may take (the rest of optim.* is the loop's: schedule, clipping)."""

TORCH_CLASS = re.compile(r"torch\.optim\.([A-Za-z_]\w*)")
"""How optim.name names a torch optimizer class: torch.optim.NAdam, torch.optim.RAdam, ..."""


@dataclass(frozen=True)
class OptimizerRecord:
    """What the framework needs to know about one optimizer, in one place."""

    name: str
    """What optim.name holds: a built-in name (adamw) or a torch class (torch.optim.NAdam)."""
    build: Builder
    """Makes it over param groups (torch and mesh engines; under DTensor shards the builder picks a sharded version)."""
    takes: tuple[str, ...]
    """The optim.* keys (of KEYS) its constructor takes; a built-in ignores the others, a torch class refuses them set."""
    state_bytes: float
    """fp32 bytes of state per trainable parameter (optim.momentum > 0 adds momentum_bytes), as docs/memory.md's table
    counts them; where the state is not a fixed number per parameter, `by_shape` counts it and this is the large-tensor
    rate."""
    keeps: str
    """The state it keeps, in words (refusals say it)."""
    momentum_bytes: float = 0
    """Bytes per parameter optim.momentum > 0 adds (sgd's momentum buffer)."""
    keeps_with_momentum: str = ""
    """`keeps` where optim.momentum > 0."""
    by_shape: Callable[[tuple[int, ...]], float] | None = None
    """Bytes of state of one trainable tensor of this shape, where that is not state_bytes x its elements (8-bit
    blocks, factored statistics, a step counter per tensor): the planner counts its states tensor by tensor."""
    deepspeed: str | None = None
    """The DeepSpeed JSON's optimizer "type" (DeepSpeed builds it over its fp32 partitions); None: not under ZeRO."""
    deepspeed_keys: tuple[str, ...] = ()
    """The optim.* keys that go into the JSON's "params"."""
    deepspeed_extra: dict[str, Any] = field(default_factory=dict)
    """Fixed JSON params (adam: adam_w_mode false, torch's L2 Adam)."""
    deepspeed_tested: bool = True
    """False: ZeRO needs zero_allow_untested_optimizer (its tested list is Adam(W) and a few more)."""
    engines: tuple[str, ...] = ("torch", "mesh")
    """The torch-side engines that run it (engine_kind): torch (single, DDP), mesh (FSDP2, TP, PP). DeepSpeed: `deepspeed`."""
    moments: bool = False
    """Two fp32 moments per parameter that optim.state_dtype=bf16 can store in bf16 (finetune's LowPrecisionAdam), and
    that the planner may suggest replacing with a `low_memory` optimizer."""
    decoupled: bool = True
    """Weight decay applied to the weights (AdamW), not added to the gradient (Adam's L2)."""
    pure: str | None = None
    """optimi's class for precision=bf16_pure (bf16 weights, Kahan-compensated update); None: not with bf16_pure."""
    runs: str | None = None
    """The kernel it runs, where optim.kernel does not choose it (None: torch's fused / foreach / loop, by optim.kernel)."""
    step_temp: str | None = None
    """What its step allocates besides the states: "foreach" (torch's multi-tensor update: an fp32 temporary per
    parameter on GPU, the largest tensor's on CPU), "tensor" (one fp32 temporary of the largest tensor), None."""
    low_memory: bool = False
    """A cheaper-state alternative the planner suggests in place of adam/adamw's two fp32 moments."""
    ends_state_bytes: float | None = None
    """Bytes per element of its state on the input embeddings and the output layer where they are not what `by_shape`
    says of a matrix (Muon: AdamW's 8 there); not None also marks them apart in the param groups (`end`)."""
    shard_bound: str | None = None
    """Why its state under FSDP/TP is tied to each rank's shard (adamw_8bit's block scales), so that a mesh checkpoint
    of it resumes on the same layout only; None: not tied. Otherwise checkpoints are the optimizer's state_dict (torch engine), DCP's
    flattened state (mesh engine) or DeepSpeed's own, and resume on any layout that engine allows."""

    @property
    def typed(self) -> str:
        """How a user chooses it: optim=adamw (a group option), optim.name=torch.optim.NAdam."""
        return f"optim.name={self.name}" if self.name not in RECORDS else f"optim={self.name}"

    def held(self, momentum: float) -> str:
        return self.keeps_with_momentum if momentum and self.keeps_with_momentum else self.keeps

    def per_param(self, momentum: float) -> float:
        return self.state_bytes + (self.momentum_bytes if momentum else 0)


# ---------------------------------------------------------------------------------------------
# The built-in optimizers' builders (torch imported when one is built)


def _kernel(o: OptimValues, params: list[Any]) -> dict[str, bool]:
    from finetune.optimizers.kernels import kernel

    return kernel(o.kernel, params)


def _sharded(params: list[Any]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)  # FSDP2 / tensor parallel shards


def _adam(decoupled: bool) -> Builder:
    def build(groups: list[dict[str, Any]], o: OptimValues, params: list[Any]) -> Any:
        import torch

        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, **_kernel(o, params))
    return build


def _sgd(groups: list[dict[str, Any]], o: OptimValues, params: list[Any]) -> Any:
    import torch

    return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, **_kernel(o, params))


def _adamw_8bit(groups: list[dict[str, Any]], o: OptimValues, params: list[Any]) -> Any:
    import bitsandbytes as bnb

    from finetune.optimizers.sharded import ShardedAdamW8bit

    return (ShardedAdamW8bit if _sharded(params) else bnb.optim.AdamW8bit)(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def _adafactor(groups: list[dict[str, Any]], o: OptimValues, params: list[Any]) -> Any:
    import torch

    from finetune.optimizers.sharded import ShardedAdafactor

    return (ShardedAdafactor if _sharded(params) else torch.optim.Adafactor)(groups, lr=o.lr)


def _muon(groups: list[dict[str, Any]], o: OptimValues, params: list[Any]) -> Any:
    from finetune.optimizers.muon import MuonWithAdamW

    return MuonWithAdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, momentum=o.momentum)


def _muon_bytes(shape: tuple[int, ...]) -> float:
    """Muon's momentum buffer (fp32) on a 2-D matrix; AdamW's two moments on any other tensor (the embeddings and the
    output layer are counted by `ends_state_bytes`)."""
    return (4 if len(shape) == 2 else 8) * math.prod(shape)


BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes keeps 32-bit states for tensors smaller than this (its optimizers' min_8bit_size)."""
BNB_BLOCK = 256
"""Elements per blockwise-quantization block of bitsandbytes' 8-bit states (one fp32 absmax each)."""


def _eight_bit_bytes(shape: tuple[int, ...]) -> float:
    """bitsandbytes' AdamW8bit: two uint8 moments, an fp32 absmax per BNB_BLOCK elements each and two 256-entry fp32
    quantization maps, for tensors of BNB_MIN_8BIT_SIZE elements or more; two fp32 moments below."""
    n = math.prod(shape)
    return 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK) + 2 * 256 * 4 if n >= BNB_MIN_8BIT_SIZE else 8 * n


def _factored_bytes(shape: tuple[int, ...]) -> float:
    """torch's Adafactor: a row and a column fp32 vector per matrix (per leading index of a 3-D stack), the whole fp32
    second moment of a vector."""
    return 4 * (math.prod(shape[:-2]) * (shape[-2] + shape[-1]) if len(shape) >= 2 else math.prod(shape))


ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")

RECORDS: dict[str, OptimizerRecord] = {r.name: r for r in (
    OptimizerRecord(
        "adamw", _adam(True), ADAM_KEYS, 8, "two fp32 moments", deepspeed="AdamW", deepspeed_keys=ADAM_KEYS,
        moments=True, pure="AdamW", step_temp="foreach"),
    OptimizerRecord(
        "adam", _adam(False), ADAM_KEYS, 8, "two fp32 moments", deepspeed="Adam", deepspeed_keys=ADAM_KEYS,
        deepspeed_extra={"adam_w_mode": False},  # L2 weight decay, like torch.optim.Adam
        moments=True, decoupled=False, pure="Adam", step_temp="foreach"),
    OptimizerRecord(
        "sgd", _sgd, ("lr", "momentum", "weight_decay"), 0, "no state", momentum_bytes=4,
        keeps_with_momentum="its momentum buffer in the parameters' dtype", deepspeed="SGD",
        deepspeed_keys=("lr", "momentum", "weight_decay"), deepspeed_tested=False, pure="SGD"),
    # Why bitsandbytes and not torchao's AdamW8bit (docs/strategies.md, scripts/benchmark_optimizer_states.py): the
    # same 2.03 bytes a parameter, 170 ms a step against 215 ms on the benchmark's 10M parameters and no compile (torchao's
    # first step compiles for 2-7 s). torchao's does step a DTensor shard as its whole tensor, where ours
    # (optimizers.sharded.ShardedAdamW8bit, bitsandbytes' kernel per shard) follows it within 1.5%; but it quantizes with
    # its own map, so FSDP on torchao would leave the one-process trajectory on bitsandbytes: every layout moves at once
    # or none does. (optim.state_dtype=bf16 stays ours, LowPrecisionAdam: torchao keeps Adam's moments in the
    # parameters' dtype and has no bf16 moments over fp32 weights; its AdamW4bit asserts on a DTensor shard.)
    OptimizerRecord(
        "adamw_8bit", _adamw_8bit, ADAM_KEYS, 2, "its moments in 8 bits", by_shape=_eight_bit_bytes,
        runs="bitsandbytes' 8-bit kernel", low_memory=True,
        shard_bound="block scales cover each rank's own shard of a weight"),
    OptimizerRecord(
        "muon", _muon, ("lr", "betas", "eps", "weight_decay", "momentum"), 4,
        "a momentum buffer per hidden matrix (Muon), two fp32 moments for the rest (AdamW)", by_shape=_muon_bytes,
        ends_state_bytes=8, runs="torch.optim.Muon (hidden matrices, orthogonalised whole under FSDP2/TP) and torch.optim.AdamW "
        "(the rest)", step_temp="muon"),
    OptimizerRecord(
        "adafactor", _adafactor, ("lr", "weight_decay"), 0, "factored fp32 statistics", by_shape=_factored_bytes,
        runs="torch's Adafactor (no fused version)", step_temp="tensor", low_memory=True),
)}
"""The built-in optimizers, by the name optim.name takes."""

Optimizer = Enum("Optimizer", {name: name for name in RECORDS}, type=str)
"""The built-in names as an enum (finetune.config re-exports it): Optimizer("adamw") == "adamw"."""


# ---------------------------------------------------------------------------------------------
# optim.name: a built-in name, or a torch.optim class


def spelled(name: Any) -> str:
    """optim.name as stored: a built-in name in any case, '-' for '_' (AdamW, adamw-8bit) becomes its record's key;
    a torch class stays as typed (class names are case-sensitive); anything else is left for the check to refuse."""
    word = str(getattr(name, "value", name)).strip()
    plain = word.lower().replace("-", "_")
    return plain if plain in RECORDS else word


def known(name: str) -> bool:
    """What the schema accepts: a built-in name, or torch.optim.<Class> (whether the class exists is the rules')."""
    return name in RECORDS or bool(TORCH_CLASS.fullmatch(name))


WORDS = f"one of {', '.join(RECORDS)}, or a torch.optim class by name (e.g. torch.optim.NAdam)"


def record(name: str) -> OptimizerRecord:
    """The record of optim.name: a built-in's, or one made from the torch class it names (ConfigError if there is
    none, or it cannot step a probe tensor)."""
    if name in RECORDS:
        return RECORDS[name]
    if TORCH_CLASS.fullmatch(name):
        return torch_record(name)
    raise ConfigError(f"optim.name={name} must be {WORDS}")


@functools.cache
def torch_record(name: str) -> OptimizerRecord:
    """A torch.optim class's record: the keys its constructor takes, and its state measured on a probe step."""
    import torch

    attr = TORCH_CLASS.fullmatch(name).group(1)
    cls = getattr(torch.optim, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        classes = sorted(n for n, c in vars(torch.optim).items()
                         if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer)
        raise ConfigError(f"optim.name={name}: torch.optim has no optimizer class {attr}"
                          f"{did_you_mean(attr, classes, 'torch.optim.')}; it has {', '.join(classes)}")
    takes = tuple(k for k in KEYS if k in inspect.signature(cls).parameters)
    per_element, per_tensor = probe(cls, name, takes)
    return OptimizerRecord(
        name, functools.partial(_build_torch_class, cls, takes), takes, per_element,
        f"the state torch's {attr} keeps ({per_element:g} bytes per parameter, {per_tensor:g} per tensor)",
        by_shape=lambda shape: per_element * math.prod(shape) + per_tensor,
        engines=("torch",), runs=f"torch's own choice of implementation for {attr}", step_temp="foreach")


def constructor_kwargs(takes: tuple[str, ...], o: OptimValues | ProbeValues) -> dict[str, Any]:
    """The optim.* values a torch class's constructor takes (weight_decay goes per param group)."""
    values = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "momentum": o.momentum}
    return {k: values[k] for k in takes if k in values}


def _build_torch_class(cls: type, takes: tuple[str, ...], groups: list[dict[str, Any]], o: OptimValues, params: list[Any]) -> Any:
    if "weight_decay" not in takes:  # the per-group weight_decay key means nothing to it (the rules refuse it set)
        groups = [{k: v for k, v in g.items() if k != "weight_decay"} for g in groups]
    return cls(groups, **constructor_kwargs(takes, o))


PROBES = ((3, 5), (7,))
"""Two probe tensors of different sizes: their state bytes give a rate per element and a constant per tensor."""


@dataclass(frozen=True)
class ProbeValues:
    """The optim.* values the probe step constructs a class with: optim.*'s defaults (tests/test_optimizers.py
    checks they are OptimConfig's), here so that this module does not import the schema that imports it."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0


PROBE_VALUES = ProbeValues()


def probe(cls: type, name: str, takes: tuple[str, ...]) -> tuple[float, float]:
    """(bytes per parameter element, bytes per tensor) of `cls`'s state after one step on tiny fp32 CPU tensors, read
    from its state_dict. ConfigError where it cannot step without more (a closure: LBFGS; sparse gradients:
    SparseAdam) or where its state is not a rate per element plus a constant per tensor (a factored one)."""
    import torch

    params = [torch.nn.Parameter(torch.linspace(-1, 1, math.prod(s)).reshape(s)) for s in PROBES]
    try:
        opt = cls([{"params": [p]} for p in params], **constructor_kwargs(takes, PROBE_VALUES))
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        opt.step()
    except Exception as e:  # noqa: BLE001 - whatever the class needs that a plain step does not give
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"optim.name={name}: it cannot step a probe tensor with a plain gradient ({type(e).__name__}: {why}): "
                          "use another torch.optim class, or optim=adamw") from None
    sizes = [state_tensor_bytes(opt.state_dict()["state"].get(i, {})) for i in range(len(params))]
    (n1, b1), (n2, b2) = [(math.prod(s), b) for s, b in zip(PROBES, sizes)]
    per_element = (b1 - b2) / (n1 - n2)
    per_tensor = b1 - per_element * n1
    whole = [t for i in range(len(params)) for t in opt.state_dict()["state"].get(i, {}).values() if torch.is_tensor(t)]
    if any(t.numel() not in (1, *map(math.prod, PROBES)) for t in whole) or per_element < 0 or per_tensor < 0:
        raise ConfigError(f"optim.name={name}: its state is not a fixed number of bytes per parameter (a factored or "
                          "shaped one), which the planner cannot count from a probe: use optim=adafactor for factored "
                          "statistics, or another torch.optim class")
    return per_element, per_tensor


def state_tensor_bytes(state: dict[str, Any]) -> int:
    """Bytes of the tensors in one parameter's optimizer state (its step counter included)."""
    import torch

    return sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))


def state_dict_bytes(optimizer: "torch.optim.Optimizer") -> int:
    """Bytes of every tensor in an optimizer's state_dict (what a checkpoint of it holds)."""
    return sum(state_tensor_bytes(s) for s in optimizer.state_dict()["state"].values())


def refuse_unused_keys(o: OptimValues, rec: OptimizerRecord) -> None:
    """A torch class: an optim.* key set away from its default that the class's constructor does not take."""
    if rec.name in RECORDS:
        return
    defaults = type(o)()
    for key in KEYS:
        value = getattr(o, key)
        if key not in rec.takes and value != getattr(defaults, key):
            shown = "[" + ",".join(f"{v:g}" for v in value) + "]" if isinstance(value, list) else f"{value:g}"
            raise ConfigError(f"optim.{key}={shown} with optim.name={o.name}: its constructor takes no {key} (it takes "
                              f"{', '.join(rec.takes)} of optim.*): remove optim.{key}, or use an optimizer that takes it")
