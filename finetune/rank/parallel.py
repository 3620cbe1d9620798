"""Model-parallel layouts on one DeviceMesh of shape (pp, dp, tp), with PyTorch's own machinery,
laid out from what transformers publishes about each family:

- the decoder blocks: the ModuleList of the block class the model names in `_no_split_modules`
  (model.layers, gpt_neox.layers, transformer.h...), whatever the family calls it;
- tensor parallel: the family's own plan (`config.base_model_tp_plan`: q/k/v column-wise and o
  row-wise for Llama, the projections gathered for Phi-3's fused qkv and OLMo-2's full-width q/k
  norms, q/k norms with summed gradients for Qwen3, packed experts for Mixtral), applied per block
  with DTensor; our own Llama plan only for a family with no plan and Llama's block; anything
  else refused with the reason; with sequence parallel (the default) the residual stream and the norms between its
  sublayers split along the sequence (finetune/rank/sequence.py);
- FSDP2: `fully_shard` per block, then the root (kept gathered from forward to backward), over the data-parallel
  dimension; in bf16 over fp32 shards under precision=bf16 (its MixedPrecisionPolicy);
- pipeline parallel: each rank keeps only its stages' blocks; which modules run before the blocks
  (embeddings) and after them (final norm, LM head) is the family's pipeline plan
  (`config.base_model_pp_plan`, the model class's `_pp_plan`), and each stage runs the family's own
  forward (its rotary embeddings, masks, scaling, soft-capping), with the blocks it lacks skipped.

Ranks are laid out tp fastest, then cp (context parallel, finetune/rank/context.py), then dp, then pp: a TP
group is adjacent ranks (one node), pipeline stages are furthest apart (across nodes), as in the 70B
tp8 x pp16 layout.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from finetune.config import ConfigError, ParallelismConfig
from finetune.layouts.mesh import check_layout_fits_model

OWN_TP_PLAN = {  # module path inside a decoder block -> style: a Llama block, for a family transformers has no plan for
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}
COLUMN_STYLES = {"colwise": False, "colwise_gather_output": True, "colwise_rep": True}
"""transformers' column-wise styles for an nn.Linear -> whether the output is gathered (replicated)."""
ROW_STYLES = {"rowwise": False, "rowwise_split_input": True, "rowwise_rep": True}
"""transformers' row-wise styles for an nn.Linear -> whether the input arrives whole (replicated) and is split here."""
PARTIAL_GRADIENT = "replicated_with_grad_allreduce"
"""A replicated parameter that sees only this rank's heads (Qwen3's per-head q/k norms): its gradient is summed over tp."""


def build_mesh(device: torch.device, world_size: int, pp: int, tp: int, cp: int = 1) -> Any:
    """The (pp, dp, cp, tp) mesh: tp fastest, then cp (a context-parallel group exchanges every block's
    attention: near ranks), then dp, then pp."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (pp, world_size // (pp * tp * cp), cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers *ForCausalLM, under a PEFT wrapper or in a pipeline Stage too."""
    model = model.lm if isinstance(model, Stage) else model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def family(model: nn.Module) -> str:
    return str(getattr(causal_lm(model).config, "model_type", "") or type(causal_lm(model)).__name__)


class Skipped(nn.Module):
    """Stands in for a module this pipeline stage does not hold (no parameters): passes its input through."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


class Handoff(Skipped):
    """Stands in for the block just before a stage's first: returns the activation the stage received
    from the previous stage (what the family's forward made of its placeholder input is dropped here)."""

    incoming: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.incoming


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder blocks and their path in the causal LM (model.layers, gpt_neox.layers, transformer.h):
    the one ModuleList of the block class transformers names in the model's `_no_split_modules`."""
    lm = causal_lm(model)
    classes = set(getattr(lm, "_no_split_modules", None) or ())
    found = [(name, m) for name, m in lm.named_modules() if isinstance(m, nn.ModuleList) and len(m)
             and all(type(b).__name__ in classes or isinstance(b, Skipped) for b in m)
             and any(type(b).__name__ in classes for b in m)]
    if len(found) != 1:
        what = ("names no decoder block class (_no_split_modules)" if not classes else
                f"has {len(found)} lists of its blocks ({', '.join(sorted(classes))})")
        raise ConfigError(f"{type(lm).__name__} (model_type={family(lm)}) {what}, so tensor and pipeline parallel cannot tell "
                          "its decoder blocks: use parallelism=fsdp or ddp")
    return found[0]


def check_model(model: nn.Module, p: ParallelismConfig) -> None:
    """The layout-vs-model checks for models whose config was not readable before launch (hub ids)."""
    c = causal_lm(model).config.get_text_config()  # attribute_map reads each family's own names; a wrapper's language model
    check_layout_fits_model(p, {"model_type": getattr(c, "model_type", None), "num_hidden_layers": c.num_hidden_layers,
                                "num_attention_heads": c.num_attention_heads,
                                "num_key_value_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                                "intermediate_size": getattr(c, "intermediate_size", None),
                                "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False))})


# -- tensor parallel ------------------------------------------------------------------------------


def block_tp_plan(model: nn.Module) -> tuple[dict[str, str], str]:
    """The tensor-parallel plan of one decoder block (module or parameter path inside the block -> style)
    and where it comes from: transformers' plan for the family (config.base_model_tp_plan, its
    `layers.*.` entries), else ours when the block is a Llama block, else ConfigError with the reason."""
    lm = causal_lm(model)
    path, blocks = block_list(lm)
    base = lm.base_model_prefix
    inside = path[len(base) + 1:] if path.startswith(base + ".") else path  # the list's path in the base model
    published = dict(getattr(lm.config, "base_model_tp_plan", None) or {})
    plan = {k[len(inside) + 3:]: v for k, v in published.items() if k.startswith(inside + ".*.")}
    if plan:
        return plan, "transformers' plan"
    block = next(b for b in blocks if not isinstance(b, Skipped))
    inner = sorted(n for n in _parameter_owners(block) if "." in n)  # inside attention and the MLP (residual norms are fine)
    if inner == sorted(OWN_TP_PLAN) and all(isinstance(_base(block.get_submodule(n)), nn.Linear) for n in inner):
        return dict(OWN_TP_PLAN), "our Llama plan"
    raise ConfigError(f"parallelism.tp: transformers publishes no tensor-parallel plan for model_type={family(lm)} "
                      f"(base_model_tp_plan), and its blocks are not Llama blocks, the only ones our own plan splits "
                      f"(they hold {', '.join(inner)}): use parallelism=fsdp or ddp")


def _parameter_owners(block: nn.Module) -> set[str]:
    """Paths of the modules that own parameters in a block, as in the plain model (PEFT's adapters left out)."""
    out = set()
    for name, m in block.named_modules():
        if any(True for _ in m.parameters(recurse=False)) and "lora_" not in name:
            out.add(name.replace(".base_layer", ""))
    return out


def _base(module: nn.Module) -> nn.Module:
    return getattr(module, "base_layer", module)


def tensor_parallel(model: nn.Module, tp_mesh: Any, *, sequence: bool = False) -> list[nn.Parameter]:
    """Shard every (remaining) decoder block over the TP mesh with the family's plan; the rest stays
    replicated. Returns the replicated parameters whose gradients are partial (each rank's heads
    only; under `sequence` parallel the norms', which see this rank's tokens only): the engine sums
    them over tp once per step.

    Linear layers take torch's Colwise/RowwiseParallel (gathered / split variants for transformers'
    colwise_gather_output / rowwise_split_input); other styles (packed MoE experts) transformers' own.
    A LoRA layer follows its base: under a column-wise base, lora_B is column-wise too (each rank
    adds its slice of B A x); under a row-wise base, lora_A is row-wise (its output all-reduced,
    like the base's) and lora_B stays replicated."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan, _ = block_tp_plan(model)
    partial: list[nn.Parameter] = []
    for block in block_list(model)[1]:
        if isinstance(block, Skipped):
            continue
        linear, other = {}, []
        for path, style in plan.items():
            target = _lookup(block, path)
            if target is None:  # e.g. the dense MLP entries in a sparse block
                continue
            if style == PARTIAL_GRADIENT:
                partial += [target] if isinstance(target, nn.Parameter) else list(target.parameters())
            elif isinstance(target, nn.Module) and (style in COLUMN_STYLES or style in ROW_STYLES):
                # sequence parallel: a sublayer's own row-wise layer (self_attn.o_proj, mlp.down_proj) reduce-scatters
                # into this rank's tokens (finetune.rank.sequence); one deeper (a shared expert's) all-reduces
                linear.update(_linear_plan(model, path, target, style, scatter=sequence and path.count(".") == 1))
            else:
                if isinstance(target, nn.Module) and hasattr(target, "base_layer"):
                    raise ConfigError(f"peft: an adapter on {family(model)}'s {path} cannot follow transformers' tensor-parallel "
                                      f"style for it ({style}): leave it out of peft.target_modules (e.g. "
                                      "peft.target_modules=[q_proj,k_proj,v_proj,o_proj]), or use parallelism=fsdp")
                other.append((path, style, target))
        if linear:
            parallelize_module(block, tp_mesh, linear)
        _transformers_styles(block, tp_mesh, other, model)
    if sequence:
        from finetune.rank.sequence import sequence_parallel

        blocks = [b for b in block_list(model)[1] if not isinstance(b, Skipped)]
        partial += sequence_parallel(blocks, _final_norm(model), tp_mesh)
    return [q for q in partial if q.requires_grad]


def _final_norm(model: nn.Module) -> nn.Module | None:
    """The module after the model's last block (the final norm, as the family's pipeline plan lists it), where this
    module (a pipeline stage) holds that block; None where it does not, or the family publishes no pipeline plan."""
    lm = causal_lm(model)
    blocks = block_list(lm)[1]
    if isinstance(blocks[len(blocks) - 1], Skipped):
        return None
    try:
        after = pipe_layout(lm).after
    except ConfigError:
        return None
    found = lm.get_submodule(after[0]) if after and "." in after[0] else None
    return None if found is None or isinstance(found, Skipped) else found


def _lookup(block: nn.Module, path: str) -> nn.Module | nn.Parameter | None:
    owner, _, leaf = path.rpartition(".")
    try:
        parent = block.get_submodule(owner) if owner else block
    except AttributeError:
        return None
    if leaf in parent._parameters:
        return parent._parameters[leaf]
    return getattr(parent, leaf, None) if isinstance(getattr(parent, leaf, None), nn.Module) else None


def _linear_plan(model: nn.Module, path: str, layer: nn.Module, style: str, scatter: bool = False) -> dict[str, Any]:
    """torch ParallelStyles for one linear layer (and its LoRA adapters), from transformers' style name. `scatter`: a
    row-wise layer without adapters reduce-scatters its output along the sequence (a DTensor: sequence parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(_base(layer), nn.Linear):
        raise ConfigError(f"parallelism.tp: {family(model)}'s {path} is a {type(_base(layer)).__name__}, not an nn.Linear: "
                          f"its tensor-parallel style {style} cannot split it; use parallelism=fsdp or ddp")
    if style in COLUMN_STYLES:
        make = (lambda: ColwiseParallel(output_layouts=Replicate())) if COLUMN_STYLES[style] else ColwiseParallel
    else:
        out = {"output_layouts": Shard(1), "use_local_output": False} if scatter and not hasattr(layer, "base_layer") else {}
        make = (lambda: RowwiseParallel(input_layouts=Replicate(), **out)) if ROW_STYLES[style] else (lambda: RowwiseParallel(**out))
    if not hasattr(layer, "base_layer"):
        return {path: make()}
    adapters = "lora_B" if style in COLUMN_STYLES else "lora_A"
    return {f"{path}.base_layer": make(), **{f"{path}.{adapters}.{name}": make() for name in getattr(layer, adapters)}}


def _transformers_styles(block: nn.Module, tp_mesh: Any, entries: list[tuple[str, str, Any]], model: nn.Module) -> None:
    """transformers' own parallel styles (packed MoE experts and what else its plans name): each
    named parameter sharded, then each named module's forward hooked. The parameters are first made
    equal on the TP group (transformers shards each rank's own copy, without sending)."""
    if not entries:
        return
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    except ImportError:
        from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
    root = tdist.get_global_rank(tp_mesh.get_group(), 0)
    planned = {path for path, _, _ in entries}
    for path, style_name, target in sorted(entries, key=lambda e: isinstance(e[2], nn.Module)):  # parameters first
        style = ALL_PARALLEL_STYLES.get(style_name)
        if style is None or not hasattr(style, "shard_param") or not hasattr(style, "install_forward"):
            raise ConfigError(f"parallelism.tp: {family(model)}'s plan shards {path} with transformers' {style_name} style, which "
                              "this transformers version cannot apply here (transformers 5.21 or newer can): upgrade "
                              "transformers, or use parallelism=fsdp")
        owner, _, leaf = path.rpartition(".")
        if isinstance(target, nn.Parameter):
            module, names = (block.get_submodule(owner) if owner else block), [leaf]
        else:
            module, names = target, [n for n in target._parameters if f"{path}.{n}" not in planned]
        for name in names:
            tdist.broadcast(module._parameters[name].data, src=root, group=tp_mesh.get_group())
            style.shard_param(module, name, tp_mesh)
        if isinstance(target, nn.Module):
            style.install_forward(target, tp_mesh)


# -- FSDP2 ----------------------------------------------------------------------------------------


def fully_shard(model: nn.Module, dp_mesh: Any, *, reshard_after_forward: bool, offload: bool,
                param_dtype: torch.dtype | None = None, keep_root: bool = True, dtype: torch.dtype | None = None) -> None:
    """FSDP2: each decoder block is one unit (gathered for its forward/backward), a vision-language model's projector and
    vision tower, then the root: the transformers model itself, inside any PEFT wrapper (which holds no parameters of its
    own). The root's forward gathers what lies outside the blocks (embeddings, final norm, head), and `generate` calls
    the inner model's forward, not the wrapper's: rooted at the wrapper, generation under LoRA met the embedding still
    sharded.

    `reshard_after_forward` is the blocks' (and the vision parts'). `keep_root`: the root is not resharded after its
    forward (torchtitan's default): its forward spans every block's, so its parameters are gathered through the whole
    forward anyway, and backward starts with its output layer; resharding would free them for the loss only, to gather
    them again at once. A frozen model (no backward to reshard it) passes False.

    `param_dtype` (precision=bf16: FSDP's MixedPrecisionPolicy, as torchtitan trains): every unit gathers its floating-
    point parameters in that dtype and computes in it (inputs cast at each unit), while the shards stay fp32 (the
    optimizer's master weights) and the gradients are reduce-scattered in fp32. Integer storage (QLoRA's 4-bit bytes)
    is gathered as it is; torchao's FP8 weights all-gather in FP8 either way.

    `dtype`: the shards' (the training weights'). A checkpoint read in bf16 (memory-mapped) is sharded as it is (each
    rank copies its rows of each weight to the device) and then each shard is cast there: no rank ever holds more than
    its own shard in both dtypes, and the host nothing but the checkpoint's mapped pages."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp import fully_shard as shard
    from transformers.modeling_layers import GradientCheckpointingLayer

    from finetune.families.vision import parts

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    kwargs = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": policy,
              "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()}
    cast = [] if dtype is None else [n for n, q in model.named_parameters()
                                     if q.is_floating_point() and q.dtype != dtype and type(q).__name__ != "Params4bit"]
    for block in [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]:
        shard(block, **kwargs)
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    found = parts(root)  # a vision-language model's generate runs them before its first forward (get_image_features),
    for part in (found.projector, found.vision):  # outside the root's: units of their own, the projector (inside
        if part is not None:                      # Qwen's tower) first
            shard(part, **kwargs)
    shard(root, **{**kwargs, "reshard_after_forward": not keep_root})
    if cast:  # each shard cast where it now is (the device), one tensor at a time: FSDP2 takes module._apply after
        own = {id(model.get_parameter(n)) for n in cast}  # sharding (it re-registers each shard) until its first forward
        with torch.no_grad():
            model._apply(lambda t: t.to(dtype) if id(t) in own else t)
    keep_quant_states(model, dp_mesh.device_type)


def keep_quant_states(model: nn.Module, device_type: str) -> None:
    """QLoRA under FSDP2: bitsandbytes' 4-bit weights are sharded like any tensor (their packed bytes split
    over dp), but the weight FSDP gathers for a forward is a plain tensor without the Params4bit's quantization
    constants (absmax, code), which stay whole on every rank. bitsandbytes would then wrap the gathered weight in
    a new Params4bit, which FSDP does not track (measured: every forward after the first computes with stale
    bytes). So each 4-bit layer hands its constants to the gathered weight before it runs. bitsandbytes' CPU
    repack for inference is off, as for every 4-bit model (model.keep_4bit_layout): here it would rewrite FSDP's
    gathered buffer (a frozen DPO reference too, which never goes through PEFT)."""
    if "bitsandbytes" not in sys.modules:  # nothing was quantized in this process
        return
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if not isinstance(module, Linear4bit):  # (PEFT's LoRA wrapper of one is also named Linear4bit)
            continue
        module.quant_state.to(torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else device_type)
        module.support_avx512bf16_for_cpu = False
        module.register_forward_pre_hook(_hand_quant_state)


def _hand_quant_state(module: nn.Module, _args: Any) -> None:
    if getattr(module.weight, "quant_state", None) is None:
        module.weight.quant_state = module.quant_state


# -- pipeline parallel ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PipeLayout:
    """Where a causal LM's pieces are, by path: what a pipeline stage keeps or drops."""

    body: str
    """The base model (model, gpt_neox, transformer): what stages other than the last run."""
    blocks: str
    """The decoder block list (model.layers, gpt_neox.layers)."""
    before: tuple[str, ...]
    """Modules that run before the blocks (the embeddings): the first stage's."""
    after: tuple[str, ...]
    """Modules that run after them (the final norm, the LM head): the last stage's."""


def pipe_layout(model: nn.Module) -> PipeLayout:
    """The family's pipeline plan, as transformers publishes it: `config.base_model_pp_plan` lists the
    base model's modules in the order they run (embeddings, the block list, the final norm) and the
    class's `_pp_plan` the head. ConfigError when the family has none, or has parameters it leaves out."""
    lm = causal_lm(model)
    blocks, _ = block_list(lm)
    body = lm.base_model_prefix
    plan = list(getattr(lm.config, "base_model_pp_plan", None) or ())
    head = list(getattr(type(lm), "_pp_plan", None) or ())
    inside = blocks[len(body) + 1:] if blocks.startswith(body + ".") else None
    if not plan or not head or inside not in plan:
        raise ConfigError(f"parallelism.pp: transformers publishes no pipeline plan for model_type={family(lm)} (base_model_pp_plan: "
                          "which modules run before and after its blocks), so it cannot be cut into stages: use parallelism=fsdp "
                          "or tp")
    i = plan.index(inside)
    layout = PipeLayout(body=body, blocks=blocks, before=tuple(f"{body}.{k}" for k in plan[:i]),
                        after=tuple(f"{body}.{k}" for k in plan[i + 1:]) + tuple(head))
    placed = (blocks, *layout.before, *layout.after)
    stray = [n for n, _ in lm.named_parameters() if not any(n == p or n.startswith(p + ".") for p in placed)]
    if stray:
        raise ConfigError(f"parallelism.pp: {family(lm)}'s {', '.join(stray[:3])} lie outside transformers' pipeline plan for it "
                          f"({', '.join(placed)}), so no stage would hold them: use parallelism=fsdp or tp")
    return layout


class Stage(nn.Module):
    """One pipeline stage: a pruned copy of the causal LM that keeps only blocks `first..last-1`
    (plus the modules before the blocks on stage 0, those after them on the last stage), and runs
    the family's own forward: the blocks it lacks are skipped, and the block before its first hands
    over the activation received from the previous stage. Parameter names stay those of the whole
    model, so the stages' state dicts merge into one HF checkpoint."""

    def __init__(self, lm: nn.Module, blocks: range, *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        layout = pipe_layout(lm)
        inner = causal_lm(lm)
        listed = inner.get_submodule(layout.blocks)
        for i in range(len(listed)):
            if i not in blocks:
                listed[i] = Skipped()  # no parameters: the kept blocks keep their indices
        self.handoff = None
        if not is_first:
            self.handoff = listed[blocks.start - 1] = Handoff()
            for path in layout.before:
                _replace(inner, path, Skipped())
        if not is_last:
            for path in layout.after:
                _replace(inner, path, Skipped())
        self.lm, self.layout, self.blocks, self.is_first, self.is_last = lm, layout, blocks, is_first, is_last

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token ids (the first stage) or the previous stage's hidden states, and the rows' position ids, which
        every stage passes on with its output: they place each token for the rotary embeddings and, in packed
        rows (restarting at 0 for each sample), give the family's causal mask its per-sample blocks. Plain rows
        are right-padded: the causal mask alone keeps every real token from seeing padding.

        `labels` (logits=chunked; the schedule hands every stage its micro-batch's keyword arguments): the last
        stage returns each row's summed label log-probs [B] in fp32 instead of the logits (finetune.rank.head)."""
        inner = causal_lm(self.lm)
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        if self.handoff is not None:
            self.handoff.incoming = x
        try:
            if self.is_last and labels is not None:
                from finetune.rank.head import ChunkedHead
                from finetune.methods.losses import tie

                head = ChunkedHead.of(self.lm)
                if head is None:
                    raise RuntimeError("pipeline: labels were given to the last stage, but its output layer is not chunked")
                with head.labelled(labels):
                    logits = inner(**inputs, position_ids=position_ids, use_cache=False).logits
                return head.take()[0] + tie(logits)
            if self.is_last:  # the whole head: final norm, LM head, the family's logit soft-capping
                return inner(**inputs, position_ids=position_ids, use_cache=False).logits
            body = inner.get_submodule(self.layout.body)
            return body(**inputs, position_ids=position_ids, use_cache=False).last_hidden_state, position_ids
        finally:
            if self.handoff is not None:
                self.handoff.incoming = None


def position_ids(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A batch's position ids: its own (packed rows), else 0..width-1 on every row (right-padded rows)."""
    if "position_ids" in batch:
        return batch["position_ids"]
    ids = batch["input_ids"]
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


def _replace(root: nn.Module, path: str, module: nn.Module) -> None:
    owner, _, name = path.rpartition(".")
    setattr(root.get_submodule(owner) if owner else root, name, module)


def split_blocks(num_blocks: int, num_stages: int) -> list[range]:
    """Contiguous, as even as possible (the first stages take one more when it does not divide)."""
    per, extra = divmod(num_blocks, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = per + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


def pipeline_stages(model: nn.Module, *, pp_rank: int, pp: int, per_rank: int) -> list[tuple[int, Stage]]:
    """This rank's (stage index, stage module) pairs: stages pp_rank, pp_rank + pp, ... (looped)."""
    num_stages = pp * per_rank
    pipe_layout(model)  # refused before anything is copied
    ranges = split_blocks(len(block_list(model)[1]), num_stages)
    indices = [pp_rank + k * pp for k in range(per_rank)]
    out = []
    for k, s in enumerate(indices):
        lm = model if k == len(indices) - 1 else copy.deepcopy(model)  # the last one prunes the original
        out.append((s, Stage(lm, ranges[s], is_first=s == 0, is_last=s == num_stages - 1)))
    return out


def bubble_fraction(num_stages: int, microbatches: int, per_rank: int) -> float:
    """Idle fraction of a (looped) 1F1B / GPipe schedule: (p - 1) / (v m + p - 1), p ranks, v stages each."""
    p = num_stages // per_rank
    return (p - 1) / (per_rank * microbatches + p - 1)
