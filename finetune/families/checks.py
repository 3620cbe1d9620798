"""The checks on a family's records: which linears PEFT adapts (`targeted`, `adapted`, `unmatched_targets`, DoRA on
experts), which attention kernels it can run (`attention_limits`, `pick_attention`), and the refusals of a MoE's
router loss under context and pipeline parallel. Read by the rules, the planner and the loader alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from finetune.config import ConfigError
from finetune.families.records import FAMILIES, Family

if TYPE_CHECKING:
    from finetune.families.shapes import Arch, Linear

def targeted(name: str, targets: list[str]) -> bool:
    """Whether PEFT adapts the linear at `name` (its path in the block): all-linear, or a target
    that is the name or its last dotted components (PEFT's matching)."""
    return "all-linear" in targets or any(name == t or name.endswith("." + t) for t in targets)


def adapted(lin: Linear, targets: list[str]) -> bool:
    """Whether LoRA adapts `lin` under peft.target_modules: an nn.Linear / Conv1D as PEFT matches it
    (`targeted`); another module's weight (a MoE's experts, its router) when a target names it or
    its module (`experts`, `gate_up_proj`, `experts.down_proj`, `gate`), and under all-linear the
    experts' stacks (not the router: routing is left as pretrained, as in common MoE LoRA recipes)."""
    if lin.adaptable:
        return targeted(lin.name, targets)
    if "all-linear" in targets:
        return lin.experts > 1
    module = lin.name.rsplit(".", 1)[0] if lin.experts > 1 else lin.name  # mlp.experts / the router mlp.gate
    return any(path == t or path.endswith("." + t) for t in targets for path in (lin.name, module))


def lora_params(lin: Linear, r: int, dora: bool = False) -> int:
    """LoRA's parameters for one linear: r x (in + out) (per expert for a fused stack), + out for DoRA's magnitude."""
    return lin.experts * r * (lin.inputs + lin.outputs) + (lin.outputs if dora else 0)


def _matches(path: str, target: str) -> bool:
    """PEFT's matching: the target is the path or its last dotted components."""
    return path == target or path.endswith("." + target)


def unmatched_targets(model_type: str, targets: list[str], linears: list[str], weights: dict[str, int]) -> str | None:
    """The one-line refusal of the peft.target_modules names that match nothing in a model, listing
    what exists; None when each name matches. `linears`: the paths of its linear layers (nn.Linear,
    Conv1D); `weights`: path -> ndim of the weights outside them (a MoE's 3-D experts, its 2-D router),
    which a name reaches by the weight's path or its module's."""
    owner = lambda path: path.rsplit(".", 1)[0]  # noqa: E731 - the module holding a weight
    leaf = lambda path: path.rsplit(".", 1)[-1]  # noqa: E731
    missing = [t for t in targets if t != "all-linear" and not any(_matches(n, t) for n in linears)
               and not any(_matches(w, t) or _matches(owner(w), t) for w in weights)]
    if not missing:
        return None
    stacks = sorted({leaf(w) for w, ndim in weights.items() if ndim == 3})
    experts = sorted({leaf(owner(w)) for w, ndim in weights.items() if ndim == 3})
    routers = sorted({leaf(owner(w)) for w, ndim in weights.items() if ndim == 2})
    extra = (f"; its experts' fused weights {', '.join(stacks)} ({', '.join(experts)}: all of them)" if stacks else "") + \
        (f"; its router {', '.join(routers)}" if routers else "")
    return (f"peft.target_modules: {', '.join(missing)} {'matches' if len(missing) == 1 else 'match'} no module of this "
            f"{model_type} model: its linear layers are {', '.join(sorted({leaf(n) for n in linears}))}{extra} (or use [all-linear])")


def arch_targets(arch: Arch) -> tuple[list[str], dict[str, int]]:
    """(linear layer paths, weights outside them -> ndim) of a counted model, as unmatched_targets takes
    them: every block's linears (paths inside the block) and the output head."""
    linears = sorted({lin.name for b in arch.layers for lin in b.linears if lin.adaptable} | {"lm_head"})
    weights = {lin.name if lin.experts > 1 else f"{lin.name}.weight": 3 if lin.experts > 1 else 2
               for b in arch.layers for lin in b.linears if not lin.adaptable}
    return linears, weights


def dora_experts(model_type: str) -> str:
    """The refusal of DoRA on a MoE's experts: PEFT adapts them through target_parameters (lora.ParamWrapper), without DoRA."""
    return (f"peft=dora cannot adapt this {model_type or 'MoE'} model's experts (fused weights, which PEFT adapts through "
            "target_parameters, without DoRA): use peft=lora, or name linear layers only, e.g. "
            "peft.target_modules=[q_proj,k_proj,v_proj,o_proj]")


SOFTCAP_KEYS = ("attn_logit_softcapping",)
"""config.json keys that soft-cap the attention logits (tanh(x / c) * c): sdpa has no hook for it."""
ATTENTION = ("flash_attention_2", "sdpa", "eager")
"""model.attn_implementation's kernels, in the order auto prefers them (eager runs every family)."""


def attention_limits(arch: dict[str, Any]) -> dict[str, str]:
    """The attention kernels a config.json's model cannot run, each with the reason (a clause said
    after the family name): soft-capped logits (sdpa), or what transformers publishes for the family."""
    model_type = str(arch.get("model_type") or "")
    fam = FAMILIES.get(model_type, Family())
    limits: dict[str, str] = {}
    capped = [f"{key}={arch[key]}" for key in SOFTCAP_KEYS if arch.get(key)]
    if capped:
        limits["sdpa"] = f"soft-caps attention logits ({', '.join(capped)}), which sdpa cannot"
    elif not fam.sdpa:
        limits["sdpa"] = "has no sdpa attention in transformers (its model class's _supports_sdpa is False)"
    if not fam.flash:
        limits["flash_attention_2"] = "has no flash-attn attention in transformers (its model class's _supports_flash_attn is False)"
    return limits


def pick_attention(requested: str, model_type: str, limits: dict[str, str], flash: str | None) -> tuple[str, str]:
    """(kernel, why) for model.attn_implementation=`requested`: auto takes the first of ATTENTION
    that this model and this device can run; an explicit kernel the model cannot run is a
    ConfigError naming the key, the reason and what to type instead. `flash`: None when
    flash_attention_2 can run on the device, else why not (e.g. "needs CUDA")."""
    family = f"{model_type} model" if model_type else "model"
    if requested != "auto":
        if requested in limits:
            alt = next(k for k in ATTENTION[1:] if k not in limits)  # sdpa or eager: they need no GPU
            auto = "flash_attention_2 where flash-attn runs, else " + alt if "flash_attention_2" not in limits else alt
            raise ConfigError(f"model.attn_implementation={requested} cannot run this {family}: it {limits[requested]}: "
                              f"use model.attn_implementation={alt}, or auto ({auto})")
        return requested, f"model.attn_implementation={requested}"
    why = [f"{model_type or 'the model'} {limits[k]}" for k in ATTENTION if k in limits]
    if flash is not None and "flash_attention_2" not in limits:
        why.append(f"flash_attention_2 {flash}")
    for kernel in ATTENTION:
        if kernel not in limits and (kernel != "flash_attention_2" or flash is None):
            return kernel, "auto: " + ("flash-attn runs here" if kernel == "flash_attention_2" else "; ".join(why))
    raise AssertionError("eager runs every family")


def router_loss_split(layout: str) -> str:
    """The refusal of a MoE whose config adds its router loss to the loss, under context parallel."""
    return (f"{layout}: this MoE adds its router loss to the loss (config.json sets output_router_logits), and the load-balancing "
            "loss of each rank's slice of the tokens is not the sequence's (it multiplies the routers' token fractions): set "
            "output_router_logits false in config.json (the loss is then reported, not added), or use parallelism.cp=1")


def router_loss_under_pp(pp: int) -> str:
    """The refusal of a MoE whose config adds its router loss to the loss, under pipeline parallel."""
    return (f"parallelism.pp={pp}: this MoE adds its router loss to the loss (config.json sets output_router_logits), which "
            "pipeline stages cannot collect (each keeps its routers' logits): set output_router_logits false in config.json, "
            "or use parallelism=fsdp or tp")
