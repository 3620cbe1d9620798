"""Parameters and what training keeps per parameter: the architecture read from the config (finetune/families/),
trainable vs frozen counts (LoRA/DoRA adapters, modules_to_save, QLoRA's 4-bit base), and the bytes of weights,
gradients and optimizer states per parameter for each engine and precision (docs/memory.md's table; the
optimizer's record in finetune/optimizers/ for its state).

Bytes per parameter follow what our engines do, which differs from the textbook table:
- torch engine (zero=none; single/ddp/fsdp/tp/pp): the module stays fp32 and bf16/fp16 only
  autocast the compute (finetune/rank/engine/torch_engine.py, mesh_engine.py), so model states are
  fp32's row in every precision (AdamW 4 + 4 + 8); activations shrink, but autocast keeps the
  residual stream and the norms in fp32 and a 16-bit copy of each weight for backward.
- DeepSpeed engine (zero=stage0..3): bf16/fp16 sections make the module 16-bit with an fp32 master
  copy in the optimizer: 2 + 2 + 12 bytes/param for Adam (ZeRO paper's K = 12); fp32 is 4 + 4 + 8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from finetune import optimizers
from finetune.config import Config, ConfigError, ModelConfig, PeftMethod, Precision, StateDtype
from finetune.disk import config_source, flash_unavailable, local_config, vocabulary
from finetune.families import Arch, Block, adapted, arch_from_config, lora_params, pick_attention
from finetune.families.vision import frozen_parts

GIB = 2**30

GPU_OVERHEAD_BYTES = 1 * GIB
"""Per GPU rank, outside the model: the CUDA context and kernels (~0.3-0.6 GiB), cuBLAS/NCCL
workspaces and the caching allocator's fragmentation slack. An estimate, not a measurement."""
CPU_OVERHEAD_BYTES = GIB // 2
"""Per CPU rank (hardware.gpu_memory_gib=0): the Python process with torch and transformers loaded."""

QLORA_BLOCK = 64
"""bitsandbytes NF4/FP4 block size: one absmax constant per 64 weights."""
QLORA_DOUBLE_QUANT_BLOCK = 256
"""Double quantization: the absmax constants are 8-bit, with one fp32 constant per 256 of them."""

# ---------------------------------------------------------------------------------------------
# Architecture: the structure of every block, read from the config (finetune/families/)


def _vocab_of_tokenizer(path: str | None) -> int | None:
    """Token count of a local tokenizer.json (a random-init model's vocab is len(tokenizer))."""
    vocab = vocabulary(Path(path).expanduser()) if path else None
    return None if vocab is None else len(vocab)


def architecture(m: ModelConfig) -> Arch:
    """The structure from model.init (its vocabulary: the tokenizer's), a local config.json, or
    model.architecture (a hub id's config.json keys, declared in the recipe)."""
    if m.init is not None:
        vocab = m.init.vocab_size or _vocab_of_tokenizer(m.tokenizer)
        if vocab is None:
            raise ConfigError(f"the planner needs the vocabulary size: model.tokenizer={m.tokenizer!r} is not a local "
                              "directory with tokenizer.json")
        init = {k: v for k, v in vars(m.init).items() if k not in ("seed", "vocab_size")}
        return arch_from_config({**init, "vocab_size": vocab}, "model.init")
    config = local_config(m, whole=True)
    if config is None:
        raise ConfigError(f"the planner reads the architecture from model.init, a local config.json or model.architecture: "
                          f"model.path={m.path!r} is not a local model directory and model.architecture is not set (set "
                          "model.architecture to the config.json keys, as recipes/model/llama3_1_8b.yaml does, or download "
                          "the model's config.json into a directory and set model.path to it)")
    return arch_from_config(config, config_source(m))


def attention_kernel(arch: Arch, cfg: Config) -> tuple[str, str]:
    """(kernel, why) the ranks run on cfg.hardware: model.attn_implementation, auto resolved for the
    family (families.pick_attention), flash-attn counted only where a GPU and the package (here) are."""
    return pick_attention(cfg.model.attn_implementation.value, arch.model_type, arch.attention,
                          flash_unavailable(cfg, cfg.hardware.gpu_memory_gib > 0))


# ---------------------------------------------------------------------------------------------
# Model states


def model_state_bytes_per_param(optimizer: str, precision: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) bytes per parameter, docs/memory.md's table.

    fp32: SGD 4+4+0, momentum SGD 4+4+4, Adam/AdamW 4+4+8 (exp_avg + exp_avg_sq).
    Mixed precision (bf16/fp16): 16-bit weights and gradients, and the optimizer holds an fp32
    master copy (4) besides its states: Adam 2+2+12 (the ZeRO paper's K = 12), momentum 2+2+8,
    SGD 2+2+4. This is the textbook (DeepSpeed) layout; the torch engine keeps fp32 in every precision.
    """
    momentum = optimizer == "momentum"  # sgd with optim.momentum > 0
    states = optimizers.record("sgd" if momentum else optimizer).per_param(momentum)  # 8-bit, factored: about that
    # for large matrices; the planner counts them per tensor (state_bytes)
    if precision == "fp32":
        return 4, 4, states
    return 2, 2, 4 + states


BNB_MIN_8BIT_SIZE, BNB_BLOCK = optimizers.BNB_MIN_8BIT_SIZE, optimizers.BNB_BLOCK  # adamw_8bit's (finetune/optimizers/)


def trainable_shapes(arch: Arch, cfg: Config) -> list[tuple[int, ...]]:
    """The shape of every trainable tensor (what an optimizer keeps state for): the blocks' weights, biases
    and norms, the embeddings, the final norm and the head; under LoRA/DoRA the adapters' A (r x in) and
    B (out x r) per adapted linear (per expert: experts x r rows), DoRA's magnitude, modules_to_save."""
    peft, h, shapes = cfg.peft, arch.hidden_size, []
    full = peft.name == PeftMethod.none
    for block in arch.layers:
        for lin in block.linears:
            if full:
                shapes += [(lin.experts, lin.outputs, lin.inputs) if lin.experts > 1 else (lin.outputs, lin.inputs)]
                shapes += [(lin.experts * lin.outputs,)] if lin.bias else []
            elif adapted(lin, peft.target_modules):
                shapes += [(lin.experts * peft.r, lin.inputs), (lin.outputs, lin.experts * peft.r)]
                shapes += [(lin.outputs,)] if peft.name == PeftMethod.dora else []
        shapes += [(block.norms,)] if full and block.norms else []
    if full or "embed_tokens" in peft.modules_to_save:
        shapes += [(arch.vocab_size, h)]
    if (full or "lm_head" in peft.modules_to_save) and arch.head_params:
        shapes += [(arch.head_width, h)]
    if full:
        shapes += [(arch.final_norm,)] + ([(arch.positions,)] if arch.positions else [])
    return shapes


def end_shapes(arch: Arch, cfg: Config) -> list[tuple[int, ...]]:
    """Of `trainable_shapes`, the input embeddings' and the output layer's (optim=muon gives them to AdamW)."""
    full = cfg.peft.name == PeftMethod.none
    return ([(arch.vocab_size, arch.hidden_size)] if full or "embed_tokens" in cfg.peft.modules_to_save else []) + (
        [(arch.head_width, arch.hidden_size)] if (full or "lm_head" in cfg.peft.modules_to_save) and arch.head_params else [])


def state_bytes(shapes: list[tuple[int, ...]], optimizer: str, ends: list[tuple[int, ...]] = ()) -> float:
    """Optimizer state bytes over these tensors, as the optimizer's record counts one tensor (`by_shape`, else its
    bytes per parameter): adamw_8bit (bitsandbytes) two uint8 moments and their block scales (fp32 below 4,096
    elements), adafactor (torch) a row and a column fp32 vector per matrix, muon a momentum buffer per matrix and AdamW's
    moments on the rest (of `shapes`, `ends` are the embeddings and output layer: its `ends_state_bytes`), a torch.optim
    class what its state_dict held after one probe step (per element and per tensor)."""
    rec = optimizers.record(optimizer)
    total = sum(rec.by_shape(shape) if rec.by_shape else rec.state_bytes * math.prod(shape) for shape in shapes)
    if rec.ends_state_bytes is not None and rec.by_shape:
        total += sum(rec.ends_state_bytes * math.prod(shape) - rec.by_shape(shape) for shape in ends)
    return float(total)


def optimizer_kind(cfg: Config) -> str:
    """sgd, momentum (sgd with optim.momentum > 0), adam, adamw, ... or a torch class's dotted name."""
    name = cfg.optim.name
    return "momentum" if name == "sgd" and cfg.optim.momentum > 0 else name


def engine_state_bytes(cfg: Config) -> tuple[int, int, int]:
    """What our engines hold per trainable parameter: DeepSpeed follows the table for its
    precision; the torch engine keeps fp32 weights and autocasts, so fp32's row in every precision,
    except bf16_pure: bf16 weights, gradients and states (AdamW 2 + 2 + 4), + 2 for Kahan's compensation,
    and optim.state_dtype=bf16: AdamW 4 + 4 + 4."""
    if cfg.precision.name == Precision.bf16_pure:
        states = int(optimizers.record(cfg.optim.name).per_param(cfg.optim.momentum)) // 2  # bf16: half of fp32's
        return 2, 2, states + (2 if cfg.precision.kahan_sum else 0)
    if cfg.optim.state_dtype == StateDtype.bf16:  # adam/adamw's two moments in bf16 over fp32 weights
        return 4, 4, 4
    return model_state_bytes_per_param(optimizer_kind(cfg), cfg.precision.name.value if cfg.zero.enabled else "fp32")


def module_bytes(cfg: Config) -> int:
    """Bytes of each weight of the module itself: 2 for DeepSpeed's bf16/fp16 module and for bf16_pure, else 4."""
    return 2 if (cfg.zero.enabled and cfg.precision.name != Precision.fp32) or cfg.precision.name == Precision.bf16_pure else 4


def zero_states(stage: int, params: float, ranks: int, w: int = 2, g: int = 2, k: int = 12) -> tuple[float, float, float]:
    """ZeRO per-rank (weights, gradients, optimizer) bytes for `params` over `ranks` (ZeRO paper):
    stage 0: (w + g + k) P; stage 1: w P + g P + k P/N; stage 2: w P + (g + k) P/N; stage 3: (w + g + k) P/N."""
    n = ranks
    return (params * w / (n if stage >= 3 else 1), params * g / (n if stage >= 2 else 1), params * k / (n if stage >= 1 else 1))


@dataclass
class Counts:
    """Parameter counts the states are computed from."""

    total: int
    trainable: int
    frozen: int
    frozen_bytes_per_param: float


def count_params(arch: Arch, cfg: Config) -> Counts:
    """Trainable vs frozen parameters: all trainable without PEFT (but the parts of a vision-language model model.freeze
    keeps frozen); with LoRA/DoRA/QLoRA the adapters
    r * (in + out) per targeted linear (DoRA adds a magnitude vector of `out`), plus modules_to_save."""
    total = arch.params
    peft = cfg.peft
    if peft.name == PeftMethod.none:  # a vision-language model's parts model.freeze keeps frozen: weights only
        frozen = sum(n for part, n in arch.image_parts if part in frozen_parts(cfg.model.freeze, adapters=False))
        return Counts(total, total - frozen, frozen, float(module_bytes(cfg)) if frozen else 0.0)
    adapter = sum(adapter_params(block, cfg) for block in arch.layers)
    saved = 0
    if "lm_head" in peft.modules_to_save:
        saved += arch.head_params or arch.embedding_params
    if "embed_tokens" in peft.modules_to_save and not (arch.tie_word_embeddings and "lm_head" in peft.modules_to_save):
        saved += arch.embedding_params
    frozen = total - saved
    return Counts(total + adapter, adapter + saved, frozen, frozen_weight_bytes(arch, cfg, frozen))


def trainable_split(arch: Arch, cfg: Config, counts: Counts) -> tuple[float, float]:
    """(trainable parameters per block, trainable parameters of the head: lm_head or tied embeddings
    and the final norm, whose gradients arrive first in backward)."""
    if cfg.peft.name == PeftMethod.none:
        return arch.block_params, (arch.head_params or arch.embedding_params) + arch.final_norm
    saved = 0 if "lm_head" not in cfg.peft.modules_to_save else (arch.head_params or arch.embedding_params)
    embed = arch.embedding_params if "embed_tokens" in cfg.peft.modules_to_save else 0
    return (counts.trainable - saved - embed) / arch.num_hidden_layers, saved


def adapter_params(block: Block, cfg: Config) -> int:
    """LoRA/DoRA parameters of one block: r * (in + out) per targeted linear (+ out for DoRA's magnitude),
    per expert for a MoE's fused experts; all-linear adapts every nn.Linear / Conv1D and the experts
    (families.adapted)."""
    peft = cfg.peft
    if peft.name == PeftMethod.none:
        return 0
    return sum(lora_params(lin, peft.r, peft.name == PeftMethod.dora) for lin in block.linears if adapted(lin, peft.target_modules))


def adapter_params_per_block(arch: Arch, cfg: Config) -> int:
    """adapter_params of the largest block."""
    return adapter_params(arch.block, cfg)


def frozen_weight_bytes(arch: Arch, cfg: Config, frozen: int) -> float:
    """Bytes per frozen base parameter: 4 (torch engine, fp32) or 2 (DeepSpeed bf16/fp16); QLoRA stores
    the block linears in 4 bits (0.5 byte) plus absmax constants (fp32 per 64 weights = 0.0625 byte, or with
    double quantization 1/64 + 4/(64*256) byte), and keeps norms, embeddings and head in fp32 (bf16 under
    precision=bf16_pure)."""
    full = module_bytes(cfg)
    if cfg.peft.name != PeftMethod.qlora or frozen == 0:
        return full
    quantized = arch.quantized_params
    return (quantized * (0.5 + qlora_constants(cfg)) + (frozen - quantized) * qlora_rest_bytes(cfg)) / frozen


def qlora_rest_bytes(cfg: Config) -> int:
    """Bytes per weight QLoRA does not quantize (embeddings, head, norms): PEFT's preparation makes them fp32,
    and precision=bf16_pure casts them back to bf16."""
    return 2 if cfg.precision.name == Precision.bf16_pure else 4


def qlora_constants(cfg: Config) -> float:
    """Bytes of quantization constants per 4-bit weight: an fp32 absmax per 64 weights, or with double
    quantization an 8-bit one plus an fp32 constant per 256 of those."""
    return (1 / QLORA_BLOCK + 4 / (QLORA_BLOCK * QLORA_DOUBLE_QUANT_BLOCK)) if cfg.peft.double_quant else 4 / QLORA_BLOCK


def fsdp_frozen_and_gathered(arch: Arch, cfg: Config, frozen_w: float, w: int, g: int) -> tuple[float, float]:
    """FSDP2's per-rank frozen base and the most it holds gathered, `w` bytes per gathered weight (2 where precision=bf16
    gathers in bf16: layouts.mesh.fsdp_gathers_bf16; an unsharded gradient is the same dtype) and `g` per gradient
    reduce-scattered (fp32). The root unit (embeddings, final norm, head) stays gathered from forward to backward, and
    FSDP keeps each all-gather's buffer until the next all-gather: in backward the root with its output layer's gradient
    where it trains, beside one block's buffer, weights and gradients (or, resharded, its gradients and their
    reduce-scatter's fp32 copy); in forward, the root's and a block's weights and buffers at once (LoRA's worst moment).
    Checked against finetune.rank.simulate's FSDP2 step on Llama-3.1-8B's and -70B's shapes (tests/test_simulate.py).
    QLoRA: the 4-bit bytes are sharded, their constants stay whole on every rank (bitsandbytes keeps them beside the
    weight, outside what FSDP shards), and a gathered block is 4-bit."""
    p = cfg.parallelism
    dp = cfg.data_parallel_size * p.cp  # FSDP shards over the context-parallel ranks too
    adapters = adapter_params(arch.block, cfg)
    trained = arch.block_params if cfg.peft.name == PeftMethod.none else adapters
    if cfg.peft.name != PeftMethod.qlora:
        block_w, root_w, frozen = w * (arch.block_params + adapters), w * fsdp_root_params(arch, cfg), frozen_w / dp
    else:
        constants = arch.quantized_params * qlora_constants(cfg) / (p.tp * p.pp)
        quantized = sum(lin.inputs * lin.outputs for lin in arch.block.linears if lin.adaptable)
        rest = min(w, qlora_rest_bytes(cfg))  # bf16 gathers make the unquantized rest bf16 too
        block_w = 0.5 * quantized + rest * (arch.block_params - quantized) + w * adapters
        root_w, frozen = rest * fsdp_root_params(arch, cfg), (frozen_w - constants) / dp + constants
    head_g = w * (arch.head_params or arch.embedding_params) if cfg.peft.name == PeftMethod.none else 0.0
    # a block's backward: its buffer, then its weights and gradients, or (resharded) its gradients and their fp32 copy;
    # tensor parallel splits the block's, the root is whole on every rank of a TP group (tp_whole_params)
    backward = root_w + head_g + (block_w + w * trained + max(block_w, g * trained)) / p.tp
    return frozen, max(2 * (root_w + block_w / p.tp), backward)  # forward: the root's buffer held at a block's gather


def tp_whole_params(arch: Arch, cfg: Config, counts: Counts) -> tuple[float, float]:
    """(trainable, frozen) parameters that tensor parallel leaves whole on every rank of a TP group: what lies outside
    the blocks (the embeddings, final norm and output layer: finetune.rank.parallel splits the blocks' linears only).
    Without PEFT all of them train; with it, modules_to_save's part trains and the rest is the frozen base's."""
    outside = arch.embedding_params + arch.positions + arch.final_norm + arch.head_params
    if cfg.peft.name == PeftMethod.none:
        return float(min(outside, counts.trainable)), 0.0
    saved = (arch.head_params or arch.embedding_params) if "lm_head" in cfg.peft.modules_to_save else 0
    saved += arch.embedding_params if "embed_tokens" in cfg.peft.modules_to_save and not (
        arch.tie_word_embeddings and "lm_head" in cfg.peft.modules_to_save) else 0
    return float(saved), float(max(0, outside - saved))


def fsdp_root_params(arch: Arch, cfg: Config) -> int:
    """What FSDP2's root unit gathers: the embeddings, final norm and head (a vision-language model's tower and projector
    are units of their own); under pipeline parallel the worst stage's (the first's embeddings or the last's head)."""
    vision = sum(n for part, n in arch.image_parts if part != "language")
    before, after = arch.embedding_params + arch.positions, arch.final_norm - vision + arch.head_params
    return max(before, after) if cfg.parallelism.pp > 1 else before + after


def moe_notes(arch: Arch, cfg: Config) -> list[str]:
    """What LoRA and QLoRA do to a MoE's experts (fused 3-D weights, not nn.Linear), one line each."""
    experts = [lin for b in arch.layers for lin in b.linears if lin.experts > 1]
    if not experts or cfg.peft.name == PeftMethod.none:
        return []
    family, notes = arch.model_type or "MoE", []
    if any(adapted(lin, cfg.peft.target_modules) for lin in experts):
        dropout = (f"; peft.dropout={cfg.peft.dropout:g} applies to the nn.Linear adapters only (PEFT cannot drop out "
                   "inside a fused weight)") if cfg.peft.dropout else ""
        notes.append(f"LoRA adapts this {family} model's experts through PEFT's target_parameters, r per expert{dropout}")
    if cfg.peft.name == PeftMethod.qlora:
        n = sum(lin.params for lin in experts)
        notes.append(f"QLoRA: bitsandbytes quantizes nn.Linear layers only: this {family} model's experts ({n:,} parameters, "
                     f"{n / arch.params:.0%} of the model) stay unquantized, fp32: 4 bytes each, counted so")
    return notes
