"""Memory planner: per-rank bytes of a composed config, before anything starts.

    python -m finetune.plan +recipe=quickstart_sft [group=option ...] hardware=h100_80g [plan.suggest=true]

Composes exactly as `finetune.launch` does (its `preflight`), then `plan(cfg)` counts, for the
rank that needs the most: weights, gradients, optimizer states, activations, logits/loss buffers
and a fixed framework overhead, and what offload puts in CPU RAM / on NVMe. The total is the
peak: the larger of the backward peak and the optimizer step (the categories do not all peak
together). The formulas are those of docs/memory.md (ZeRO paper, Korthikanti et al. 2022),
with activations counted tensor by tensor for the block each family runs (finetune/families.py
reads what differs from the config), checked against autograd's saved tensors and MemTracker
(tests/test_plan.py, tests/test_plan_families.py), at the longest batch the run will see: the CLI
reads the data (finetune/lengths.py; without it, data.max_length, an upper bound). `suggest` walks
docs/memory.md's order of strategies for override sets that fit. Exit code 0: fits; 1: does not
fit; 2: a config mistake (one line).

Bytes per parameter follow what our engines do, which differs from the textbook table:
- torch engine (zero=none; single/ddp/fsdp/tp/pp): the module stays fp32 and bf16/fp16 only
  autocast the compute (finetune/engine/torch_engine.py, mesh_engine.py), so model states are
  fp32's row in every precision (AdamW 4 + 4 + 8); activations shrink, but autocast keeps the
  residual stream and the norms in fp32 and a 16-bit copy of each weight for backward.
- DeepSpeed engine (zero=stage0..3): bf16/fp16 sections make the module 16-bit with an fp32 master
  copy in the optimizer: 2 + 2 + 12 bytes/param for Adam (ZeRO paper's K = 12); fp32 is 4 + 4 + 8.

`plan()` imports only the config and the standard library: no torch (but for `optim.name=torch.optim.CLASS`,
whose state is measured on a probe step: finetune/optimizers.py), well under a second for any model size; reading
the data (CLI, or a launch that does not fit at data.max_length) takes about a second for the quickstart's 4,000
rows, still without torch.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from finetune.config import (
    AttnImpl,
    Checkpointing,
    Config,
    ConfigError,
    Logits,
    LogitsKernel,
    ModelConfig,
    Offload,
    PeftMethod,
    PipeSchedule,
    Precision,
    Reference,
    StateDtype,
    Strategy,
    engine_kind,
)
from finetune import lengths, methods, optimizers
from finetune.lengths import Longest
from finetune.disk import config_source, flash_unavailable, local_config
from finetune.families import COUNTED, Arch, Block, Linear, adapted, arch_from_config, lora_params, pick_attention, targeted
from finetune.rules import several_per_row

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
# Architecture: the structure of every block, read from the config (finetune/families.py)


def _vocab_of_tokenizer(path: str | None) -> int | None:
    """Token count of a local tokenizer.json (a random-init model's vocab is len(tokenizer))."""
    file = Path(path or "").expanduser() / "tokenizer.json"
    if not path or not file.is_file():
        return None
    tok = json.loads(file.read_text())
    vocab = tok.get("model", {}).get("vocab", {})
    added = {t["content"] for t in tok.get("added_tokens", [])} - set(vocab if isinstance(vocab, dict) else [])
    return len(vocab) + len(added)


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


BNB_MIN_8BIT_SIZE, BNB_BLOCK = optimizers.BNB_MIN_8BIT_SIZE, optimizers.BNB_BLOCK  # adamw_8bit's (finetune/optimizers.py)


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
        shapes += [(arch.vocab_size, h)]
    if full:
        shapes += [(arch.final_norm,)] + ([(arch.positions,)] if arch.positions else [])
    return shapes


def state_bytes(shapes: list[tuple[int, ...]], optimizer: str) -> float:
    """Optimizer state bytes over these tensors, as the optimizer's record counts one tensor (`by_shape`, else its
    bytes per parameter): adamw_8bit (bitsandbytes) two uint8 moments and their block scales (fp32 below 4,096
    elements), adafactor (torch) a row and a column fp32 vector per matrix, a torch.optim class what its state_dict
    held after one probe step (per element and per tensor)."""
    rec = optimizers.record(optimizer)
    return float(sum(rec.by_shape(shape) if rec.by_shape else rec.state_bytes * math.prod(shape) for shape in shapes))


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
    """Trainable vs frozen parameters: all trainable without PEFT; with LoRA/DoRA/QLoRA the adapters
    r * (in + out) per targeted linear (DoRA adds a magnitude vector of `out`), plus modules_to_save."""
    total = arch.params
    peft = cfg.peft
    if peft.name == PeftMethod.none:
        return Counts(total, total, 0, 0.0)
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
    """FSDP2's per-rank frozen base and the most it gathers at a time (one block's weights and gradients, or
    the root's embeddings and head). QLoRA: the 4-bit bytes are sharded, their constants stay whole on
    every rank (bitsandbytes keeps them beside the weight, outside what FSDP shards), and a gathered block
    is 4-bit."""
    p = cfg.parallelism
    dp = cfg.data_parallel_size * p.cp  # FSDP shards over the context-parallel ranks too
    if cfg.peft.name != PeftMethod.qlora:
        return frozen_w / dp, (w + g) * max(arch.block_params / p.tp, arch.largest_layer_params / p.tp)
    constants = arch.quantized_params * qlora_constants(cfg) / (p.tp * p.pp)
    quantized = sum(lin.inputs * lin.outputs for lin in arch.block.linears if lin.adaptable)
    rest = qlora_rest_bytes(cfg)
    block = 0.5 * quantized + rest * (arch.block_params - quantized) + (w + g) * adapter_params(arch.block, cfg)
    root = rest * max(arch.embedding_params, arch.head_params)
    return (frozen_w - constants) / dp + constants, max(block, root) / p.tp


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


# ---------------------------------------------------------------------------------------------
# Activations


@dataclass(frozen=True)
class Dtypes:
    """How a block's tensors are stored.

    module: bytes of the weights and of the residual stream (4: the torch engine keeps the module
    fp32 in every precision; 2: DeepSpeed's bf16/fp16 module); compute: bytes of matmul outputs
    (2 under bf16/fp16, 4 in fp32); autocast: torch.autocast casts each matmul's inputs (and keeps
    a 16-bit copy of every weight it used for backward)."""

    module: int
    compute: int

    @property
    def autocast(self) -> bool:
        return self.module != self.compute


def dtypes(cfg: Config) -> Dtypes:
    compute = 4 if cfg.precision.name == Precision.fp32 else 2
    return Dtypes(module=module_bytes(cfg), compute=compute)


def linear_input_bytes(cfg: Config, d: Dtypes, width: int, linears: tuple[Linear, ...], stored: int, saved: bool) -> float:
    """Bytes per token that `linears`, all reading one input of `width` elements stored in
    `stored` bytes each, save for backward (`saved`: the input is saved by another op anyway).

    A trainable linear saves its input for the weight gradient: under autocast an input that is not
    already 16-bit is cast once per linear, and each cast is saved; otherwise the linears share it.
    A frozen base (LoRA/QLoRA) saves nothing. An adapter (a targeted linear) saves its r-wide lora_A
    output and its input. PEFT first casts the input to the adapter weights' dtype (the module's),
    so under autocast lora_A casts it back: a 16-bit copy per adapter. With lora dropout each
    adapter also keeps the dropout mask (CUDA's fused kernel: 1 byte; elsewhere a tensor in the
    input's, i.e. the module's, dtype) and its input is the dropped-out copy."""
    cast = d.autocast and stored != d.compute
    shared = 0 if saved else width * stored
    if cfg.peft.name == PeftMethod.none:
        return len(linears) * width * d.compute if cast else shared
    adapted = sum(1 for lin in linears if lin.adaptable and targeted(lin.name, cfg.peft.target_modules))
    if adapted == 0:
        return 0.0
    per_adapter = cfg.peft.r * d.compute
    if cfg.peft.dropout > 0:
        mask = 1 if cfg.hardware.gpu_memory_gib > 0 else d.module
        return adapted * (per_adapter + width * (mask + d.compute))
    if d.autocast:  # the input in the module's dtype (PEFT's cast), then lora_A's own 16-bit cast of it
        return adapted * (per_adapter + width * d.compute)
    return adapted * per_adapter + (0 if saved else width * d.module)


ACT_SAVES = {"gelu_new": 4, "gelu_fast": 4, "quick_gelu": 2}
"""i-wide tensors an MLP activation saves for backward besides its output, when it is composed of
several ops (GPT-2's gelu_new: x, tanh(...), x/2 and 1 + tanh(...)); one-op activations (silu,
gelu, gelu_pytorch_tanh, relu) save their input only."""


def experts_adapted(arch: Arch, cfg: Config) -> bool:
    """Whether LoRA adapts a MoE's fused experts (PEFT's target_parameters: all-linear reaches them)."""
    return cfg.peft.name != PeftMethod.none and any(lin.experts > 1 and adapted(lin, cfg.peft.target_modules)
                                                    for b in arch.layers for lin in b.linears)


def norm_bytes(arch: Arch, cfg: Config, width: float, rows: float, normed: int) -> float:
    """What one norm saves per token over `width` elements in `rows` groups: RMSNorm its input in
    fp32 (the input itself, or its upcast), 1/rms per row and, when its weight trains (not under
    PEFT), the normalised input (`normed` bytes: the input's dtype, or fp32 for Gemma and OLMo-2);
    LayerNorm its input, mean and 1/std (the normalised input is recomputed in backward)."""
    if arch.family.layer_norm:
        return 4 * width + 8 * rows
    return 4 * width + 4 * rows + (normed * width if cfg.peft.name == PeftMethod.none else 0)


def block_activation_bytes(arch: Arch, cfg: Config, seq: int, tokens: int, block: Block | None = None,
                           masked: bool = False) -> float:
    """Bytes one block (the largest) saves for backward, for `tokens` tokens in sequences of `seq`.

    Counted tensor by tensor as torch.autograd.graph.saved_tensors_hooks lists them for the block
    transformers runs (tests/test_plan.py checks Llama byte for byte, tests/test_plan_families.py
    every family against MemTracker). Per token, with h hidden, q the attention width (heads x
    head_dim), kv the k/v width, i the MLP width, a heads, s the sequence, m the module dtype's bytes
    and c the compute dtype's:
    - norms (norm_bytes): the pre-norms (two per block; none in OLMo-2) read the residual stream,
      the post-norms (Gemma-2's two, OLMo-2's two) a sublayer's output, the q/k norms (Qwen3 per
      head, OLMo-2 over all heads) the projections;
    - the inputs of q/k/v, o, gate/up (and a MoE's router) and down: linear_input_bytes;
    - sdpa / FlashAttention: q, k, v and the output, c (2q + 2kv), and the fp32 log-sum-exp per head;
      a fused qkv projection (Phi-3) keeps its whole output alive through v, a view of it, and o
      reads a copy of the attention output; `masked` (padded or packed rows): sdpa keeps the mask,
      converted to the query's dtype in every block (c s), and k and v repeated to q's width
      (transformers uses sdpa's own GQA only without a mask);
    - eager attention: q and the repeated k and v (3 c q), the fp32 softmax (4 a s) and its 16-bit cast
      under autocast (c a s), the tanh of soft-capped logits (Gemma-2: c a s), attention dropout's mask
      and output; sdpa with attention dropout runs PyTorch's math kernel on CPU (fp32 throughout);
    - the MLP: gated, the gate (for the activation), its activation and up (for their product): 3 c i;
      plain (GPT-2, Phi...), what the activation saves (ACT_SAVES); dropout masks on each sublayer's output;
    - a MoE's sparse MLP: the router's fp32 softmax (4 E), its top-k indices and weights; per routed
      token (k per token) the gathered input, gate_up's output, the activation, down's input and
      output (experts run in the weights' dtype: grouped_mm is not autocast) and the dispatch indices.
    fp32 Llama full fine-tuning: 32h+8kv+16i bytes/token; autocast bf16 30h+4kv+8i; a bf16 module
    (DeepSpeed) 20h+4kv+8i -- Korthikanti et al. (2022) count 34h for GPT's block in 16-bit.
    Tensor parallel divides everything but the residual-stream norms and the replicated inputs of
    the column-parallel linears (q/k/v, gate/up) by tp. Under autocast each weight the block used is
    also kept as a 16-bit copy for the input gradient: 2 bytes/param (not for QLoRA's 4-bit base,
    which is dequantized again in backward, nor for a MoE's experts); PEFT's adapted experts keep their
    merged weights (m bytes/param) per forward."""
    block = block or arch.block
    fam, moe = arch.family, block.moe
    h, a, tp = arch.hidden_size, arch.num_attention_heads, cfg.parallelism.tp
    q, kv = arch.q_dim, arch.kv_dim  # q: the attention width (heads x head_dim; h in Llama)
    d = dtypes(cfg)
    m, c = d.module, d.compute
    on_gpu = cfg.hardware.gpu_memory_gib > 0
    kernel = attention_kernel(arch, cfg)[0]
    peft = cfg.peft.name != PeftMethod.none
    pre, post = fam.block_norms - fam.post_norms, fam.post_norms
    normed_in, normed_out = (4, 4) if fam.norm_fp32 else (m, c)  # the normalised input: fp32, or the input's dtype
    # replicated under tensor parallel: the residual stream's norms and what the column-parallel linears read
    replicated = pre * norm_bytes(arch, cfg, h, 1, normed_in) + post * norm_bytes(arch, cfg, h, 1, normed_out) \
        + linear_input_bytes(cfg, d, h, block.role("qkv"), m, False) + linear_input_bytes(cfg, d, h, block.role("up"), m, False)
    rows = {"head": (a, arch.num_key_value_heads), "full": (1, 1)}.get(fam.qk_norm)  # q/k norms: per head, or over all heads
    attention = norm_bytes(arch, cfg, q, rows[0], normed_out) + norm_bytes(arch, cfg, kv, rows[1], normed_out) if rows else 0.0
    dropout = arch.attention_dropout > 0
    math = kernel == "sdpa" and dropout and not on_gpu  # PyTorch's math kernel: fp32 on CPU, s^2 tensors
    if kernel == "eager":
        probs = c * a * seq if d.autocast else 0  # the softmax's 16-bit cast, read by the matmul with v
        if dropout:  # the mask (CUDA: bool) and the dropped-out probabilities replace the cast
            probs = (1 if on_gpu else c) * a * seq + c * a * seq
        attention += 3 * c * q + 4 * a * seq + probs + (c * a * seq if arch.attn_softcap else 0)
    elif math:  # q (scaled) and the repeated k, v, the softmax, the dropout mask and its output, all fp32
        attention += 4 * 3 * q + 3 * 4 * a * seq
    else:  # q, k, v, the output and the fp32 log-sum-exp per head; a fused qkv's whole output lives on through v
        attention += c * (2 * q + 2 * kv) + 4 * a + (c * (q + kv) if fam.fused else 0)
        if masked and kernel == "sdpa":
            attention += c * seq + 2 * c * (q - kv)
    # o_proj reads the tensor sdpa saved, or a copy (eager's transposed output; a fused qkv's)
    attention += linear_input_bytes(cfg, d, q, block.role("o"), c, kernel != "eager" and not math and not fam.fused)
    residual_masks = (2 * h * (1 if on_gpu else c)) if arch.residual_dropout > 0 else 0
    down = block.role("down")
    if moe is None:
        i = block.mlp_width
        mlp = (ACT_SAVES.get(arch.act, 1) if fam.mlp == "plain" else 3) * c * i
    else:  # a shared expert (Qwen2-MoE) runs a gated MLP on every token
        i = down[0].inputs if down else 0
        mlp = 3 * c * i
    mlp += linear_input_bytes(cfg, d, i, down, c, False)
    if moe is not None:  # the router, then each token's top-k experts on gathered copies of it
        k, e = moe.top_k, moe.width
        trains = not peft or experts_adapted(arch, cfg)
        router = 4 * moe.experts + 8 * k + ((4 + 4 * k) if moe.normalized else 0)
        # per routed token: gate_up's output (the activation reads a view), the activation, down's output
        # (weighted by the router); trainable experts also keep the gathered input and down's input
        row = m * (2 * e + e + h) + 4 + 24 + (m * (h + e) if trains else 0)
        mlp += router + k * row
    copies = 0.0
    if d.autocast:  # the 16-bit weights autocast made, kept for the input gradient (adapters' too); not the experts'
        dense = sum(lin.inputs * lin.outputs for lin in block.linears if lin.experts == 1)
        copies = 2 * ((dense if cfg.peft.name != PeftMethod.qlora else 0) + adapter_params(block, cfg)) / tp
    if moe is not None and peft and experts_adapted(arch, cfg):  # PEFT's ParamWrapper: W + BA per forward
        copies += m * sum(lin.params for lin in block.linears if lin.experts > 1) / tp
    return tokens * (replicated + (attention + mlp + residual_masks) / tp) + copies


RECOMPUTE_PEFT = {True: 0.35, False: 0.10}
"""How much more than its forward saved a block recomputed by checkpointing holds during its backward
under PEFT (LoRA/QLoRA), by autocast: measured with MemTracker (tests/test_plan_families.py; the same
fraction at h 128 and 256, 2 to 4 blocks, with and without dropout, all-linear or attention-only
adapters), not explained: the recompute saves the same tensors as the forward (counted through
torch.utils.checkpoint's recomputation hook), full fine-tuning shows none of it."""


@dataclass(frozen=True)
class Activations:
    """Activation bytes on one rank through a step's backward (the moments that can be its peak)."""

    stored: float
    """Saved for backward when it starts: every block's (or, recomputed, its input), the head's, and
    those of the earlier micro-batches a pipeline holds."""
    loss: float
    """On top of `stored` while the loss's backward runs: log_softmax's fp32 output, the gradient
    arriving at it and the one it returns (12 V per token)."""
    logits_grad: float
    """On top of `stored` when the model's own backward starts: the gradient of the logits (c V per token)."""
    blocks: float
    """The worst moment in the blocks' backward: the blocks below still hold theirs, the one being
    differentiated is whole (recomputed under checkpointing) with its gradients' working set."""
    filled: float
    """`blocks` with the gradients that exist by then (the blocks above, the head's)."""
    cpu: float = 0.0
    """Offloaded to CPU RAM (checkpointing=offload on GPU ranks)."""

    @property
    def measured(self) -> float:
        """What MemoryProbe's backward_activations measures: activations and temporaries at the start of
        the model's backward or at its worst moment, whichever holds more."""
        return max(self.stored + self.logits_grad, self.blocks)


def activation_bytes(arch: Arch, cfg: Config, layers: int, in_flight: int, seq: int, tokens: int,
                     block_grads: float = 0.0, head_grads: float = 0.0, moves: bool = True, masked: bool = False,
                     labelled: int | None = None, exchange: float = 0.0) -> Activations:
    """Saved activations for `layers` blocks and `in_flight` micro-batches, through backward;
    `block_grads` per block and `head_grads` are the gradients that fill in as backward goes down.

    none: every block's; full recompute (non-reentrant checkpoint): each block keeps its input
    (m s b h; the literature's 2sbh per layer in 16-bit, docs/memory.md) and the block being
    recomputed is whole again in backward; selective (blocks 0, k, 2k... recomputed): those keep their input, the rest
    everything; offload: everything saved goes to CPU RAM (one block's worth in flight on the
    device). Under pipeline parallel the earlier micro-batches in flight hold their stored
    activations while the current one peaks. `moves`: False when the ranks run on CPU, where
    offloading to CPU RAM moves nothing (counted as none). `exchange`: context parallel's all-to-all buffers,
    live while a block runs."""
    d = dtypes(cfg)
    block = max(block_activation_bytes(arch, cfg, seq, tokens, b, masked) for b in set(arch.layers))
    # differentiating a block: the gradient of the residual stream (m h) and about one MLP-wide
    # gradient at a time while its saved tensors are freed one by one (measured with MemTracker)
    width = max(b.mlp_width * (d.module if b.moe else d.compute) for b in arch.layers)
    working = tokens * (width / cfg.parallelism.tp + d.module * arch.hidden_size) + exchange
    layer_input = tokens * arch.hidden_size * d.module
    ck = cfg.checkpointing
    if ck.name == Checkpointing.offload and moves:
        kept = [0.0] * layers
        offloaded = layers * block * in_flight
    else:
        every = {Checkpointing.none: 0, Checkpointing.offload: 0, Checkpointing.full: 1}.get(ck.name, ck.every)
        kept = [layer_input if every and j % every == 0 else block for j in range(layers)]
        offloaded = 0.0
    earlier = sum(kept) * (in_flight - 1)  # pipeline micro-batches waiting for their backward
    # a block recomputed under PEFT holds more in its backward than its forward saved (RECOMPUTE_PEFT)
    recomputed = block * (1 + RECOMPUTE_PEFT[dtypes(cfg).autocast]) if cfg.peft.name != PeftMethod.none else block
    # backward of block j: the blocks below still hold theirs, block j is whole (recomputed or kept),
    # the blocks above are freed and their gradients exist
    below, blocks, filled = 0.0, 0.0, 0.0
    for j in range(layers):
        whole = recomputed if kept[j] != block else block
        blocks = max(blocks, below + whole + working)
        filled = max(filled, below + whole + working + (layers - 1 - j) * block_grads)
        below += kept[j]
    v = arch.vocab_size / cfg.parallelism.tp
    if cfg.logits.name == Logits.chunked:  # one chunk's logits, their fp32 log-softmax and gradients, at the backward's start
        chunk = min(cfg.logits.chunk_tokens, tokens, labelled or tokens)  # only labelled positions reach the head
        # a chunk's backward (inside the model's now): log_softmax's fp32 output, the gradient arriving at it and the one
        # it returns (12 V per token), and under autocast the 16-bit logits the fp32 ones were cast from (measured)
        moment = chunk * (12 * v + (d.compute * v if d.autocast else 0) + 8)
        if cfg.logits.kernel == LogitsKernel.cce:  # fused (logits.kernel=auto counts the torch chunks it may fall back to)
            moment = (labelled or tokens) * 16  # per token: its log-sum-exp, loss and their gradients; no vocabulary-wide buffer
        elif cfg.logits.kernel == LogitsKernel.liger:  # Liger's, by its source (not measured: no GPU here): in backward one
            # chunk of logits about the size of the tokens' hidden states (compute dtype, and its gradient in place), the
            # hidden states' gradient, and the output layer's gradient summed over the chunks in fp32 (accum_dtype)
            n = labelled or tokens
            moment = n * 16 + n * arch.hidden_size * 2 * d.compute + 4 * v * arch.hidden_size
        return Activations(stored=earlier + sum(kept) + head_bytes(arch, cfg, tokens), loss=moment, logits_grad=moment,
                           blocks=earlier + blocks,
                           filled=earlier + filled + head_grads, cpu=offloaded)
    return Activations(stored=earlier + sum(kept) + head_bytes(arch, cfg, tokens), loss=tokens * (12 * v + 8),
                       logits_grad=tokens * d.compute * v, blocks=earlier + blocks, filled=earlier + filled + head_grads,
                       cpu=offloaded)


def head_bytes(arch: Arch, cfg: Config, tokens: int) -> float:
    """What the model saves outside its blocks: the final norm (norm_bytes), lm_head's input (when lm_head
    trains: a 16-bit cast under autocast, else the norm's output) and, under autocast, its 16-bit
    weight; the tanh of soft-capped logits (Gemma-2: c V); the embedding dropout's mask (GPT-2)."""
    d, fam, h, tp = dtypes(cfg), arch.family, arch.hidden_size, cfg.parallelism.tp
    trains = cfg.peft.name == PeftMethod.none or "lm_head" in cfg.peft.modules_to_save
    per_token = norm_bytes(arch, cfg, h, 1, 4 if fam.norm_fp32 else d.module) + (d.compute if trains else 0) * h
    chunked = cfg.logits.name == Logits.chunked
    per_token += d.compute * arch.vocab_size / tp if arch.final_softcap and not chunked else 0  # chunked: recomputed
    per_token += d.module * h if chunked else 0  # the labelled positions' hidden states, gathered for the chunks
    per_token += h * (1 if cfg.hardware.gpu_memory_gib > 0 else d.module) if arch.embedding_dropout > 0 else 0
    return tokens * per_token + (2 * arch.vocab_size * h / tp if d.autocast else 0)


# ---------------------------------------------------------------------------------------------
# The plan


def batch_width(cfg: Config, longest: Longest | None) -> tuple[int, str]:
    """(tokens per row the activations are planned at, the plan's line saying which and why)."""
    cap = cfg.data.max_length
    if cfg.parallelism.pp > 1:
        return cap, f"activations at data.max_length={cap} tokens: pipeline parallel pads every micro-batch to it"
    if longest is not None and longest.width is not None:
        width = min(longest.width, cap)
        return width, f"activations at the longest batch: {width} tokens (max_length {cap}; {longest.why})"
    why = f"the data was not read: {longest.why}" if longest is not None else "the data was not read"
    rows = "packed rows hold up to" if cfg.data.packing else "padded batches are as long as their longest row, at most"
    return cap, f"activations at max_length {cap} tokens: an upper bound ({why}; {rows} data.max_length)"


@dataclass
class Plan:
    """Per-rank bytes (the rank that needs the most) and where offloaded states go."""

    params: int
    trainable: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    """Saved for backward when it starts (the blocks' and the head's)."""
    logits: float
    """The loss's buffers on top of them while its backward runs."""
    overhead: float
    backward: float = 0.0
    """Activations, loss buffers and gradients held together at the worst moment of backward
    (gradients fill in block by block as the activations are freed)."""
    step_temp: float = 0.0
    """The optimizer step's temporaries (torch's foreach AdamW: one fp32 tensor per parameter)."""
    cpu_bytes: float = 0.0
    """CPU RAM per node for offloaded states/activations."""
    nvme_bytes: float = 0.0
    """NVMe space per node for offloaded states."""
    budget: float = 0.0
    """Memory one rank may use: hardware.gpu_memory_gib, or cpu RAM / ranks per node on CPU."""
    cpu_budget: float = 0.0
    nvme_budget: float = 0.0
    notes: list[str] = field(default_factory=list)
    measured_activations: float = 0.0
    """What MemoryProbe's backward_activations measures: activations and temporaries at the start of the
    model's backward or at its worst moment (the loss's backward runs outside the model)."""
    width: int = 0
    """Tokens per row the activations are planned at: the longest batch, or data.max_length."""
    buckets: float = 0.0
    """DDP's flat gradient buckets, counted in `gradients`."""

    @property
    def backward_peak(self) -> float:
        """Weights, optimizer states and the worst moment of backward."""
        return self.weights + self.optimizer + self.backward + self.overhead

    @property
    def step_peak(self) -> float:
        """Weights, gradients and optimizer states (and its temporaries) at the optimizer step."""
        return self.weights + self.gradients + self.optimizer + self.step_temp + self.overhead

    @property
    def total(self) -> float:
        """The peak: the categories do not peak together (gradients fill in while activations are freed)."""
        return max(self.backward_peak, self.step_peak)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget and self.cpu_bytes <= self.cpu_budget and self.nvme_bytes <= self.nvme_budget

    @property
    def headroom(self) -> float:
        """Bytes left on the rank (negative: short by)."""
        return self.budget - self.total


def plan(cfg: Config, longest: Longest | None = None) -> Plan:
    """Per-rank memory of `cfg` on `cfg.hardware` (raises ConfigError when the architecture is unknown),
    its activations at `longest` (the longest batch the run sees, read from its data: finetune.lengths)
    or, without it, at data.max_length, an upper bound for padded batches."""
    arch = architecture(cfg.model)
    p, z, hw = cfg.parallelism, cfg.zero, cfg.hardware
    counts = count_params(arch, cfg)
    w, g, k = engine_state_bytes(cfg)
    mp = p.tp * p.pp  # weights/grads/optimizer split over tensor x pipeline ranks
    dp = cfg.data_parallel_size
    on_gpu = hw.gpu_memory_gib > 0  # without a GPU, offloading to CPU RAM moves nothing: it stays counted per rank
    notes: list[str] = []
    if not arch.known and arch.model_type in COUNTED:
        notes.append(f"model_type={arch.model_type}: its parameters are counted as transformers builds them (finetune/families.py "
                     "COUNTED); its activations are estimated from the families measured (FAMILIES), not measured for it")
    elif not arch.known:
        notes.append(f"model_type={arch.model_type}: no record in finetune/families.py, so its parameters are read off transformers' "
                     "build of its config on the meta device (exact); its activations are estimated as for a Llama-style block "
                     "of the same linears, not measured for it")

    notes.append("attention: %s (%s)" % attention_kernel(arch, cfg))
    if several_per_row(cfg):  # finetune.varlen, or flash-attn's variable-length kernel
        notes.append(f"rows: {several_per_row(cfg)}, each sample attended alone (no mask over the whole row)")
    notes += moe_notes(arch, cfg)

    # model states of the trainable parameters, then the frozen base (weights only)
    trainable, frozen = counts.trainable / mp, counts.frozen / mp
    cpu = nvme = 0.0
    gathered = buckets = one_grad = 0.0
    if z.enabled:
        weights, grads, opt = zero_states(z.stage, trainable, dp, w, g, k)
        frozen_w = frozen * counts.frozen_bytes_per_param / (dp if z.stage == 3 else 1)
        if z.stage == 3:
            gathered = (w + g) * arch.largest_layer_params  # one module's 16-bit weights + gradients at a time
        if z.offload_optimizer == Offload.nvme or (z.offload_optimizer == Offload.cpu and on_gpu):
            # the reduced gradient partition goes straight into an fp32 buffer next to the offloaded states
            # (docs/memory.md: offload moves the 12P and the fp32 gradient copy); the GPU keeps only reduce buckets
            moved = opt + 4 * trainable / dp
            opt = grads = 0.0
            if z.offload_optimizer == Offload.cpu:
                cpu += moved
            else:
                nvme += moved
        if z.offload_param == Offload.nvme or (z.offload_param == Offload.cpu and on_gpu):
            moved = weights + frozen_w
            weights = frozen_w = 0.0
            if z.offload_param == Offload.cpu:
                cpu += moved
            else:
                nvme += moved
        notes.append(f"DeepSpeed ZeRO stage {z.stage}: {w}+{g}+{k} bytes/param, sharded over {dp} data-parallel ranks "
                     "(DeepSpeed's own estimator adds a 4 bytes/param fp32 gradient copy: 18P/N)")
    else:
        weights, grads, opt = w * trainable, g * trainable, k * trainable
        if optimizers.record(cfg.optim.name).by_shape:  # by tensor shape, not per parameter
            opt = state_bytes(trainable_shapes(arch, cfg), cfg.optim.name) / mp
        frozen_w = frozen * counts.frozen_bytes_per_param
        if p.strategy == Strategy.fsdp:  # FSDP2: like ZeRO-3 over dp (x cp), fp32 states, one block gathered at a time
            weights, grads, opt = weights / (dp * p.cp), grads / (dp * p.cp), opt / (dp * p.cp)
            frozen_w, gathered = fsdp_frozen_and_gathered(arch, cfg, frozen_w, w, g)
            if p.fsdp_offload and on_gpu:
                cpu += weights + grads + opt + frozen_w
                weights = grads = opt = frozen_w = 0.0
            elif not p.fsdp_reshard_after_forward:  # gathered blocks kept from forward to backward
                gathered += w * arch.params / mp
        elif p.strategy == Strategy.ddp and dp > 1 and mp == 1 and p.cp == 1:
            buckets = grads  # DDP's flat all-reduce buckets: a second copy of the gradients, held throughout
            notes.append("DDP: gradient buckets counted as a second copy of the gradients")
        if cfg.precision.name == Precision.bf16_pure:
            notes.append(f"precision=bf16_pure: bf16 weights, gradients and {optimizer_kind(cfg)} states ({w}+{g}+{k} bytes/param"
                         + (", 2 of them Kahan's compensation)" if cfg.precision.kahan_sum else ")"))
        else:
            states = "bf16 states (optim.state_dtype=bf16: 4 bytes/param)" if cfg.optim.state_dtype == StateDtype.bf16 else "states"
            notes.append(f"torch engine: fp32 weights and {optimizer_kind(cfg)} {states} in every precision "
                         "(bf16/fp16 autocast the compute only)")
        if cfg.optim.in_backward:  # each gradient is stepped and freed in its hook: the largest one is the most held
            one_grad = g * max(math.prod(shape) for shape in trainable_shapes(arch, cfg)) / mp
            notes.append("optim.in_backward: each parameter steps in backward and frees its gradient: the largest "
                         "trainable tensor's gradient counted")
    weights += frozen_w + gathered

    if cfg.peft.name == PeftMethod.dora:
        notes.append("DoRA: its magnitude path keeps more per forward than LoRA (base and adapter outputs per token, "
                     "weight-sized norms); counted as LoRA, so activations are low (~1.5-2x at h=256 measured)")

    # a live reference model (DPO's) adds its weights (frozen, no gradients, sharded like the policy's frozen part)
    method = methods.get(cfg.method.name)
    if method.reference(cfg.method) == Reference.live:
        ref_bytes = module_bytes(cfg) * arch.params / mp
        if (z.enabled and z.stage == 3) or p.strategy == Strategy.fsdp:
            ref_bytes /= dp * p.cp
        weights += ref_bytes
        notes.append(f"{method.name.upper()} reference=live: a frozen copy of the model's weights")

    # activations: micro batch (x the method's rows per example: 2 for DPO pairs) at the longest batch's width, pipeline stages in flight
    seq, said = batch_width(cfg, longest)
    notes.append(said)
    rows = cfg.train.micro_batch_size * method.rows_per_example
    tokens = -(-seq // p.cp) * rows  # context parallel: this rank's slice of every row (attention: all of it, 1/cp of the heads)
    labelled = longest.labelled if longest is not None else None
    exchange = 0.0
    if p.cp > 1:  # one block's all-to-all buffers in flight: q, k, v as sent and as received
        exchange = tokens * 2 * dtypes(cfg).compute * (arch.q_dim + 2 * arch.kv_dim) / p.tp
        labelled = -(-labelled // p.cp) if labelled is not None else None
        notes.append(f"context parallel: {tokens // rows} of each row's {seq} tokens on each of {p.cp} ranks; attention over all "
                     f"{seq} for 1/{p.cp} of the heads (the score terms stay per token x {seq}); one block's all-to-all "
                     "buffers added")
    # padding (rows of different lengths) or packed samples: sdpa gets a mask (context parallel's own: packed rows only),
    # unless each sample is attended alone (finetune.varlen: packed rows and padding-free micro-batches)
    masked = not several_per_row(cfg) and (cfg.data.packing or (rows > 1 and p.cp == 1))
    layers = math.ceil(arch.num_hidden_layers / p.pp)
    micro_batches = max(1, cfg.grad_accum_steps)
    in_flight = 1 if p.pp == 1 else (micro_batches if p.pp_schedule == PipeSchedule.gpipe else min(p.pp, micro_batches))
    # gradients held throughout backward: those of earlier micro-batches (accumulation, or a pipeline's
    # schedule), and buffers allocated up front (DDP buckets; DeepSpeed's gradient partitions / buckets);
    # otherwise they fill in block by block, the head's first
    per_param = grads / max(trainable, 1)  # gradient bytes per trainable parameter held here
    block_trainable, head_trainable = trainable_split(arch, cfg, counts)
    resident = grads if (z.enabled or micro_batches > 1 or p.pp > 1) else 0.0
    block_grads = 0.0 if resident else per_param * block_trainable / p.tp
    head_grads = 0.0 if resident else per_param * head_trainable / p.tp
    if cfg.optim.in_backward:  # stepped and freed in backward: one gradient at a time, never all of them
        grads = resident = one_grad
        block_grads = head_grads = 0.0
    acts = activation_bytes(arch, cfg, layers, in_flight, seq, tokens, block_grads, head_grads, moves=on_gpu, masked=masked,
                            labelled=labelled, exchange=exchange)
    # the worst moment of backward: the loss's own backward (everything saved, and its buffers), or
    # inside the blocks (the gradients filled in by then)
    backward = buckets + resident + max(acts.stored + acts.loss, acts.filled)
    grads += buckets
    if p.pp > 1:
        notes.append(f"pipeline: {layers} blocks per stage, {in_flight} micro-batches in flight on the first stage; "
                     "the logits (last stage) are added too: a conservative worst rank")
    # Adam/AdamW's step: on GPU torch's foreach implementation makes torch._foreach_sqrt(exp_avg_sq), one fp32
    # tensor per trainable parameter held here; on CPU it runs tensor by tensor (the largest one's worth)
    # optim.state_dtype=bf16 steps tensor by tensor everywhere, with the moments and the denominator in fp32;
    # adafactor too, with one fp32 temporary of the tensor's size (its second-moment estimate, then the update)
    step_temp = 0.0
    shard = (dp * p.cp if p.strategy == Strategy.fsdp else 1) * mp
    if cfg.optim.state_dtype == StateDtype.bf16 and cfg.precision.name != Precision.bf16_pure:
        step_temp = 12 * min(counts.trainable, arch.largest_layer_params) / shard
    elif optimizers.record(cfg.optim.name).step_temp == "tensor" and not z.enabled:
        step_temp = 4 * min(counts.trainable, arch.largest_layer_params) / shard
    elif optimizers.record(cfg.optim.name).step_temp == "foreach" and not (z.enabled and z.offload_optimizer != Offload.none):
        step_temp = 4 * (trainable / (dp * p.cp if (z.enabled or p.strategy == Strategy.fsdp) else 1) if on_gpu
                         else min(counts.trainable, arch.largest_layer_params))

    ranks_per_node = cfg.launcher.nproc_per_node
    cpu = (cpu + acts.cpu) * ranks_per_node  # per rank -> per node
    if cfg.peft.name == PeftMethod.qlora and p.strategy == Strategy.fsdp and on_gpu:
        # each rank quantizes the whole base in host memory before fully_shard moves its shard to the GPU
        loading = counts.frozen * counts.frozen_bytes_per_param * ranks_per_node
        notes.append(f"QLoRA under FSDP: each rank loads the whole 4-bit base into host memory before sharding it: "
                     f"{loading / ranks_per_node / GIB:.2f} GiB per rank, {loading / GIB:.2f} GiB per node at start")
        cpu = max(cpu, loading)
    nvme *= ranks_per_node
    budget = hw.gpu_memory_gib * GIB if on_gpu else hw.cpu_memory_gib * GIB / ranks_per_node
    return Plan(params=counts.total, trainable=counts.trainable, weights=weights, gradients=grads, optimizer=opt,
                activations=acts.stored, logits=acts.loss, overhead=GPU_OVERHEAD_BYTES if on_gpu else CPU_OVERHEAD_BYTES,
                backward=backward, step_temp=step_temp, measured_activations=acts.measured, width=seq, buckets=buckets,
                cpu_bytes=cpu, nvme_bytes=nvme, budget=budget,
                cpu_budget=hw.cpu_memory_gib * GIB if on_gpu else math.inf, nvme_budget=hw.nvme_gib * GIB, notes=notes)


# ---------------------------------------------------------------------------------------------
# Predicted beside measured

MIB = 2**20
COMPARED = (("weights", "params"), ("gradients", "grads"), ("optimizer", "optimizer"),
            ("activations", "backward_activations"), ("peak", "peak_total"))
"""(planner category, the memory probe's) pairs: activations are activations + temporaries at the start
of the model's backward or at its worst moment (Plan.measured_activations; the loss's backward runs
outside the model, where the probe's module hooks do not look); peak excludes the fixed overhead,
which MemTracker does not see (the CUDA context, the Python process)."""


def record(cfg: Config, longest: Longest | None = None) -> dict[str, float] | str:
    """What a run writes to metrics.jsonl as {"kind": "plan"}: MiB per category for rank 0's share at
    `longest` (the batches the memory probe measures), and the tokens per row planned at (the reason,
    when the planner cannot read the architecture)."""
    try:
        pl = plan(cfg, longest)
    except ConfigError as e:
        return str(e)
    # DDP's buckets: MemTracker does not see the reducer allocate them (before the first step), but sees
    # the gradients copied through them in backward, as temporaries: compared there, not as gradients
    values = {"weights": pl.weights, "gradients": pl.gradients - pl.buckets, "optimizer": pl.optimizer,
              "activations": pl.measured_activations + pl.buckets, "peak": pl.total - pl.overhead, "overhead": pl.overhead,
              "logits": pl.logits}
    return {**{f"plan_{k}_mib": v / MIB for k, v in values.items()}, "plan_width": pl.width}


def plan_record(run_dir: Path) -> dict[str, Any] | None:
    """The {"kind": "plan"} record of a run's metrics.jsonl (None without one)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return next((r for r in rows if r.get("kind") == "plan"), None)


def compare(run_dir: Path) -> list[tuple[str, float, float]] | None:
    """[(category, predicted MiB, measured MiB)] from a run's metrics.jsonl; None without both records. A run measured
    with train.memory_report=peak has one row: the peak (CUDA: the allocator's; CPU: the process's resident set, beside
    the plan's peak and its fixed overhead); with categories, one row per COMPARED pair."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    predicted = next((r for r in rows if r.get("kind") == "plan"), None)
    measured = next((r for r in rows if r.get("kind") == "memory"), None)
    if predicted is None or measured is None:
        return None
    if "mem_cuda_max_allocated_mib" in measured and "mem_peak_total_mib" not in measured:  # train.memory_report=peak on CUDA
        return [("peak", predicted["plan_peak_mib"], measured["mem_cuda_max_allocated_mib"])]
    if "mem_peak_rss_mib" in measured:  # train.memory_report=peak on CPU: the whole process, the plan's overhead with it
        return [("peak+overhead", predicted["plan_peak_mib"] + predicted.get("plan_overhead_mib", 0.0), measured["mem_peak_rss_mib"])]
    return [(ours, predicted[f"plan_{ours}_mib"], measured.get(f"mem_{theirs}_mib", 0.0)) for ours, theirs in COMPARED]


# ---------------------------------------------------------------------------------------------
# Suggestions


@dataclass(frozen=True)
class Move:
    """One strategy change: the override(s) that make it, its place in docs/memory.md's order of what to
    try first, and a rough step-time factor (relative, for ranking; not a measurement)."""

    overrides: tuple[str, ...]
    level: int
    cost: float
    apply: Callable[[Config], None]


def _set(path: str, value: Any) -> Callable[[Config], None]:
    def apply(cfg: Config) -> None:
        *parents, leaf = path.split(".")
        target: Any = cfg
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)
    return apply


def _all(*fns: Callable[[Config], None]) -> Callable[[Config], None]:
    def apply(cfg: Config) -> None:
        for fn in fns:
            fn(cfg)
    return apply


def moves(cfg: Config) -> list[list[Move]]:
    """The axes a suggestion may change, each a list of alternatives (an empty choice is implied),
    in docs/memory.md's order: 16-bit precision, fused attention and chunked logits; low-memory optimizer states,
    bf16_pure and stepping in backward; a smaller micro batch with more
    accumulation; ZeRO-1/2 (+offload); ZeRO-3 (+offload) or FSDP; activation checkpointing; LoRA,
    then QLoRA; tensor parallel; context parallel. Costs are rough step-time factors: one extra forward for full
    recompute (~4/3), PCIe-bound offload, ~0.8 for LoRA (no weight gradients)."""
    from finetune.config import Strategy as S

    axes: list[list[Move]] = []
    precision = [Move(("precision=bf16",), 0, 1.0, _set("precision.name", Precision.bf16))] if cfg.precision.name == Precision.fp32 else []
    if cfg.precision.name in (Precision.fp32, Precision.bf16):  # no fp32 master: a numerics change, like the optimizer's
        precision.append(Move(("precision=bf16_pure",), 2, 1.0, _set("precision.name", Precision.bf16_pure)))
    axes.append(precision)
    if cfg.model.attn_implementation == AttnImpl.eager:
        axes.append([Move(("model.attn_implementation=sdpa",), 0, 1.0, _set("model.attn_implementation", AttnImpl.sdpa))])
    if cfg.logits.name == Logits.full:  # the head recomputed per chunk: ~one more head matmul
        axes.append([Move(("logits=chunked",), 0, 1.02, _set("logits.name", Logits.chunked))])
    if optimizers.record(cfg.optim.name).moments and not cfg.zero.enabled:  # adam/adamw's two fp32 moments
        states = [Move(("optim.state_dtype=bf16",), 2, 1.02, _set("optim.state_dtype", StateDtype.bf16))] \
            if cfg.precision.name != Precision.bf16_pure and cfg.optim.state_dtype != StateDtype.bf16 else []
        if cfg.precision.name != Precision.bf16_pure:  # its bf16 weights need a compensated update (optimi's)
            states += [Move((f"optim={name}",), 2, 1.03, _set("optim.name", name))
                       for name, rec in optimizers.RECORDS.items() if rec.low_memory]
        axes.append(states)
    if not cfg.optim.in_backward and cfg.world_size == 1 and engine_kind(cfg) == "torch" and cfg.grad_accum_steps == 1:
        axes.append([Move(("optim.in_backward=true", "optim.max_grad_norm=null"), 2, 1.0,
                          _all(_set("optim.in_backward", True), _set("optim.max_grad_norm", None)))])
    micro, dp, batch = cfg.train.micro_batch_size, cfg.data_parallel_size, cfg.train.global_batch_size
    smaller = [m for m in (micro // 2, micro // 4, micro // 8, micro // 16, 1) if 0 < m < micro and batch % (m * dp) == 0]
    axes.append([Move((f"train.micro_batch_size={m}",), 1, 1.08 ** math.log2(micro / m), _set("train.micro_batch_size", m))
                 for m in dict.fromkeys(smaller)])
    p, z = cfg.parallelism, cfg.zero
    if p.tp == p.pp == 1 and p.strategy != S.fsdp:
        zero = lambda stage, opt=Offload.none, par=Offload.none: _all(  # noqa: E731
            _set("zero.stage", stage), _set("zero.offload_optimizer", opt), _set("zero.offload_param", par))
        options = [Move(("zero=stage1",), 2, 1.02, zero(1)), Move(("zero=stage2",), 2, 1.05, zero(2)),
                   Move(("zero=stage2_offload",), 2, 1.6, zero(2, Offload.cpu)), Move(("zero=stage3",), 3, 1.2, zero(3)),
                   Move(("zero=stage3_offload",), 3, 2.5, zero(3, Offload.cpu, Offload.cpu))]
        if not z.enabled and cfg.world_size > 1:
            options.append(Move(("parallelism=fsdp",), 3, 1.15, _set("parallelism.strategy", S.fsdp)))
        rank = {(s, o, q): i for i, (s, o, q) in enumerate([(1, "none", "none"), (2, "none", "none"), (2, "cpu", "none"),
                                                             (3, "none", "none"), (3, "cpu", "cpu")])}
        now = rank.get((z.stage, z.offload_optimizer.value, z.offload_param.value), -1) if z.enabled else -1
        axes.append([m for i, m in enumerate(options) if i > now])
    if cfg.checkpointing.name in (Checkpointing.none, Checkpointing.selective):
        ck = [Move(("checkpointing=full",), 4, 4 / 3, _set("checkpointing.name", Checkpointing.full))]
        if cfg.checkpointing.name == Checkpointing.none:
            ck.insert(0, Move(("checkpointing=selective",), 4, 1.17, _all(_set("checkpointing.name", Checkpointing.selective),
                                                                           _set("checkpointing.every", 2))))
        axes.append(ck)
    if cfg.peft.name in (PeftMethod.none, PeftMethod.lora):
        peft = [Move(("peft=qlora",), 6, 1.0, _set("peft.name", PeftMethod.qlora))]
        if cfg.peft.name == PeftMethod.none:
            peft.insert(0, Move(("peft=lora",), 5, 0.8, _set("peft.name", PeftMethod.lora)))
        axes.append(peft)
    if p.tp == 1 and p.pp == 1 and not z.enabled:
        axes.append([Move((f"parallelism=tp{t}",), 7, 1 + 0.1 * math.log2(t), _all(_set("parallelism.tp", t), _set("parallelism.strategy", S.ddp)))
                     for t in (2, 4, 8) if cfg.world_size % t == 0])
    if p.pp == 1 and p.cp == 1 and not z.enabled:  # the last resort: a sequence's activations split over ranks
        to_fsdp = p.strategy == S.single  # parallelism=cpN is FSDP over the cp ranks; keep the user's dp strategy otherwise
        axes.append([Move((f"parallelism=cp{n}",) if to_fsdp else (f"parallelism.cp={n}",), 8, 1 + 0.15 * math.log2(n),
                          _all(_set("parallelism.cp", n), *([_set("parallelism.strategy", S.fsdp)] if to_fsdp else [])))
                     for n in (2, 4, 8) if cfg.world_size % (n * p.tp) == 0])
    return [axis for axis in axes if axis]


@dataclass
class Suggestion:
    overrides: list[str]
    plan: Plan
    cost: float
    moves: tuple[Move, ...] = ()


def _sibling(a: tuple[Move, ...], b: tuple[Move, ...], axis_of: dict[Move, int]) -> bool:
    """Whether a and b make the same moves but one, on the same axis."""
    only_a, only_b = set(a) - set(b), set(b) - set(a)
    return len(only_a) == len(only_b) == 1 and axis_of[next(iter(only_a))] == axis_of[next(iter(only_b))]


def suggest(cfg: Config, base: list[str] | None = None, count: int = 3, budget_evals: int = 4000,
            longest: Longest | None = None) -> list[Suggestion]:
    """The first `count` override sets that fit, walking docs/memory.md's order (the latest strategy a set
    needs, then its rough step-time cost); a set that adds to one already printed is skipped. With
    `base` (the command line), each one is composed again through the launcher's path and re-planned,
    so what is printed is what that command line would do."""
    from finetune.rules import validate

    axes = moves(cfg)
    axis_of = {m: i for i, axis in enumerate(axes) for m in axis}
    combos = [()]  # type: list[tuple[Move, ...]]
    for axis in axes:
        combos = [c + (m,) for c in combos for m in [None, *axis]]  # type: ignore[list-item]
    ranked = sorted(((tuple(m for m in c if m is not None)) for c in combos if any(c)),
                    key=lambda c: (max(m.level for m in c), math.prod(m.cost for m in c), len(c)))
    found: list[Suggestion] = []
    for combo in ranked[:budget_evals]:
        if len(found) == count:
            break
        overrides = [o for m in combo for o in m.overrides]
        if any(set(f.moves) <= set(combo) or _sibling(f.moves, combo, axis_of) for f in found):
            continue  # adds to a printed set, or is a printed set with one choice made costlier
        trial = copy.deepcopy(cfg)
        for m in combo:
            m.apply(trial)
        try:
            validate(trial)
            pl = plan(trial, longest)
        except ConfigError:
            continue
        if not pl.fits:
            continue
        if base is not None:  # what the printed command line really composes to
            from finetune.compose import preflight

            keys = {o.split("=", 1)[0] for o in overrides}
            try:
                pl = plan(preflight([b for b in base if b.lstrip("+~").split("=", 1)[0] not in keys] + overrides), longest)
            except ConfigError:
                continue
            if not pl.fits:
                continue
        found.append(Suggestion(overrides, pl, math.prod(m.cost for m in combo), combo))
    return found


def render_suggestions(found: list[Suggestion]) -> str:
    if not found:
        return "no suggestion fits: a smaller model, a shorter data.max_length, more GPUs, or more GPU memory"
    lines = ["fits with (docs/memory.md's order, cheapest first; step time relative to this config, rough):"]
    for s in found:
        lines.append(f"  {' '.join(s.overrides):<60} {s.plan.total / GIB:8.2f} GiB  step x{s.cost:.2f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI


def render(cfg: Config, pl: Plan) -> str:
    """The per-rank table in GiB, the offload lines and the verdict."""
    hw = cfg.hardware
    gib = lambda b: f"{b / GIB:10.2f}"  # noqa: E731
    where = f"{hw.gpu_memory_gib:g} GiB per GPU" if hw.gpu_memory_gib > 0 else \
        f"no GPU: {hw.cpu_memory_gib:g} GiB RAM shared by {cfg.launcher.nproc_per_node} rank(s)"
    lines = [f"memory plan per rank, GiB (2^30 bytes) -- hardware={hw.name} ({where}); {cfg.world_size} rank(s), "
             f"tp={cfg.parallelism.tp} pp={cfg.parallelism.pp} dp={cfg.data_parallel_size}"
             + (f" cp={cfg.parallelism.cp}" if cfg.parallelism.cp > 1 else ""),
             f"parameters   {pl.params:,} ({pl.trainable:,} trainable)"]
    for name, value in (("weights", pl.weights), ("gradients", pl.gradients), ("optimizer", pl.optimizer),
                        ("activations", pl.activations), ("logits/loss", pl.logits), ("overhead", pl.overhead)):
        lines.append(f"  {name:<12}{gib(value)}")
    when = "backward" if pl.backward_peak >= pl.step_peak else "the optimizer step"
    lines.append(f"  {'total':<12}{gib(pl.total)}   of {pl.budget / GIB:.2f}  (the peak, at {when}: gradients fill in as "
                 "activations are freed, so the categories do not all peak together)")
    if pl.cpu_bytes:
        lines.append(f"cpu RAM per node (offload, loading) {pl.cpu_bytes / GIB:.2f} GiB of {hw.cpu_memory_gib:g}")
    if pl.nvme_bytes:
        lines.append(f"NVMe per node (offload)    {pl.nvme_bytes / GIB:.2f} GiB of {hw.nvme_gib:g}")
    lines += [f"note: {n}" for n in pl.notes]
    if pl.fits:
        lines.append(f"FITS (headroom {pl.headroom / GIB:.2f} GiB)")
    else:
        short = max(pl.total - pl.budget, pl.cpu_bytes - pl.cpu_budget, pl.nvme_bytes - pl.nvme_budget)
        lines.append(f"DOES NOT FIT (short by {short / GIB:.2f} GiB)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from finetune.compose import preflight  # composes and validates like the launcher; imports no torch

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1])  # the usage line and what it counts
        return 0
    try:
        cfg = preflight(args)
        longest = read_longest(cfg)
        pl = plan(cfg, longest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(cfg, pl))
    if cfg.plan.suggest and not pl.fits:
        print(render_suggestions(suggest(cfg, args, cfg.plan.suggestions, longest=longest)))
    return 0 if pl.fits else 1


def read_longest(cfg: Config) -> Longest | None:
    """The longest batch from the run's data (finetune.lengths: tokenizes without torch); its width is
    None, with the reason, when the data cannot be read (the plan then says data.max_length is an upper
    bound); None under pipeline parallel, which pads every micro-batch to data.max_length."""
    if cfg.parallelism.pp > 1:
        return None
    found = lengths.longest_batch(cfg)
    return Longest(None, found) if isinstance(found, str) else found


if __name__ == "__main__":
    sys.exit(main())
