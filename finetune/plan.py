"""Memory planner (first slice): per-rank bytes of a composed config, before anything starts.

    python -m finetune.plan +recipe=quickstart_sft [group=option ...] hardware=h100_80g

Composes exactly as `finetune.launch` does (its `preflight`), then `plan(cfg)` adds up, for the
rank that needs the most: weights, gradients, optimizer states, activations, logits/loss buffers
and a fixed framework overhead; plus what offload puts in CPU RAM / on NVMe. The formulas are
those of /work/shared/MEMORY.md (ZeRO paper, Korthikanti et al. 2022), each cited where used.
Exit code 0: fits; 1: does not fit; 2: a config mistake (one line, like the launcher).

Bytes per parameter follow what our engines do, which differs from the textbook table:
- torch engine (zero=none; single/ddp/fsdp/tp/pp): the module stays fp32 and bf16/fp16 only
  autocast the compute (finetune/engine/torch_engine.py, mesh_engine.py), so model states are
  4 + 4 + 8 bytes/param in every precision; only activations and logits shrink.
- DeepSpeed engine (zero=stage0..3): bf16/fp16 sections make the module 16-bit with an fp32 master
  copy in the optimizer: 2 + 2 + 12 bytes/param (ZeRO paper's K = 12); fp32 is 4 + 4 + 8.

Imports only the config and the standard library: no torch, instant for any model size.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune.config import (
    AttnImpl,
    Checkpointing,
    Config,
    ConfigError,
    DpoLoss,
    Method,
    ModelConfig,
    Offload,
    PeftMethod,
    PipeSchedule,
    Precision,
    Reference,
    Strategy,
    local_config,
)

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

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------------------------------------
# Architecture


@dataclass(frozen=True)
class Arch:
    """The Llama-style shape the planner counts (biases ignored: Qwen2's q/k/v biases are ~0.01%)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @property
    def kv_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads * self.num_key_value_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear in one block."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.kv_dim
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def block_linear_params(self) -> int:
        return sum(a * b for a, b in self.linear_shapes().values())

    @property
    def block_params(self) -> int:
        """Attention (GQA: k/v are h x kv_dim) + SwiGLU MLP (3 h i) + two RMSNorm weights."""
        return self.block_linear_params + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """The output head; 0 when tied to the embeddings."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """P = embeddings + L blocks + final norm + head."""
        return self.embedding_params + self.num_hidden_layers * self.block_params + self.hidden_size + self.head_params

    @property
    def largest_layer_params(self) -> int:
        """The largest single module (what ZeRO-3 gathers at a time): the embedding or an MLP linear."""
        return max(self.embedding_params, self.hidden_size * self.intermediate_size)


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
    """The shape from model.init or a local config.json (like config.model_shape, with the sizes)."""
    if m.init is not None:
        init = m.init
        vocab = _vocab_of_tokenizer(m.tokenizer)
        if vocab is None:
            raise ConfigError(f"the planner needs the vocabulary size: model.tokenizer={m.tokenizer!r} is not a local "
                              "directory with tokenizer.json")
        return Arch(init.hidden_size, init.intermediate_size, init.num_hidden_layers, init.num_attention_heads,
                    init.num_key_value_heads, vocab, init.tie_word_embeddings)
    path = Path(m.path or "").expanduser() / "config.json"
    arch = local_config(m)
    if arch is None:
        raise ConfigError(f"the planner reads the architecture from model.init or a local config.json: {path} does not "
                          "exist (download the model's config.json into a directory and set model.path to it)")
    try:
        heads = arch["num_attention_heads"]
        return Arch(arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"], heads,
                    arch.get("num_key_value_heads") or heads, arch["vocab_size"], bool(arch.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ConfigError(f"{path} has no {e.args[0]}: the planner counts Llama-style models") from None


# ---------------------------------------------------------------------------------------------
# Model states


def model_state_bytes_per_param(optimizer: str, precision: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) bytes per parameter, MEMORY.md's table.

    fp32: SGD 4+4+0, momentum SGD 4+4+4, Adam/AdamW 4+4+8 (exp_avg + exp_avg_sq).
    Mixed precision (bf16/fp16) Adam: 2+2+12 (16-bit weights and gradients; fp32 master + 2 moments).
    This is the textbook (DeepSpeed) layout; the torch engine keeps fp32 in every precision.
    """
    opt = {"sgd": 0, "momentum": 4, "adam": 8, "adamw": 8}[optimizer]
    if precision == "fp32":
        return 4, 4, opt
    if optimizer not in ("adam", "adamw"):
        raise ValueError(f"mixed-precision {optimizer}: only Adam/AdamW are tabulated")
    return 2, 2, 12


def engine_state_bytes(cfg: Config) -> tuple[int, int, int]:
    """What our engines hold per trainable parameter (AdamW): DeepSpeed follows the table for its
    precision; the torch engine keeps fp32 weights and autocasts, so 4+4+8 in every precision."""
    if cfg.zero.enabled:
        return model_state_bytes_per_param(cfg.optim.name.value, cfg.precision.name.value)
    return model_state_bytes_per_param(cfg.optim.name.value, "fp32")


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
    targets = set(LINEARS) if "all-linear" in peft.target_modules else set(peft.target_modules) & set(LINEARS)
    shapes = arch.linear_shapes()
    adapter = sum(peft.r * (shapes[n][0] + shapes[n][1]) + (shapes[n][1] if peft.name == PeftMethod.dora else 0)
                  for n in targets) * arch.num_hidden_layers
    saved = 0
    if "lm_head" in peft.modules_to_save:
        saved += arch.head_params or arch.embedding_params
    if "embed_tokens" in peft.modules_to_save and not (arch.tie_word_embeddings and "lm_head" in peft.modules_to_save):
        saved += arch.embedding_params
    frozen = total - saved
    return Counts(total + adapter, adapter + saved, frozen, frozen_weight_bytes(arch, cfg, frozen))


def frozen_weight_bytes(arch: Arch, cfg: Config, frozen: int) -> float:
    """Bytes per frozen base parameter: 4 (torch engine, fp32) or 2 (DeepSpeed bf16/fp16); QLoRA stores
    the block linears in 4 bits (0.5 byte) plus absmax constants (fp32 per 64 weights = 0.0625 byte, or with
    double quantization 1/64 + 4/(64*256) byte), and keeps norms, embeddings and head in fp32."""
    full = 2 if cfg.zero.enabled and cfg.precision.name != Precision.fp32 else 4
    if cfg.peft.name != PeftMethod.qlora or frozen == 0:
        return full
    consts = (1 / QLORA_BLOCK + 4 / (QLORA_BLOCK * QLORA_DOUBLE_QUANT_BLOCK)) if cfg.peft.double_quant else 4 / QLORA_BLOCK
    quantized = arch.num_hidden_layers * arch.block_linear_params
    return (quantized * (0.5 + consts) + (frozen - quantized) * 4) / frozen


# ---------------------------------------------------------------------------------------------
# Activations


def block_activation_bytes(arch: Arch, seq: int, batch: int, tp: int, flash: bool, act_bytes: int) -> float:
    """Saved activations of one Llama block for backward (Korthikanti et al. 2022's method, Llama constants).

    Korthikanti's GPT block (16-bit): s*b*h*(34 + 5*a*s/h); with tensor parallel t:
    s*b*h*(10 + 24/t + 5*a*s/(h*t)). Our block (RMSNorm, GQA, SwiGLU, no dropout) saves, in
    units of s*b*h*2 bytes: both norm inputs and both normed outputs (4, replicated under TP),
    q, o_proj input (2/t), k and v (2*kv/a /t), gate, up, silu(gate) and down's input (4*i/h /t);
    and without FlashAttention the score and softmax matrices, 2*a*s/h /t (the s^2 term:
    Korthikanti's 5 counts a dropout mask too). In bytes with 16-bit activations:
    s*b*h*(8 + (4 + 4*kv/a + 8*i/h + (0 if flash else 4*a*s/h)) / t); fp32 doubles it.
    """
    h, a = arch.hidden_size, arch.num_attention_heads
    split = 4 + 4 * arch.num_key_value_heads / a + 8 * arch.intermediate_size / h + (0 if flash else 4 * a * seq / h)
    return seq * batch * h * (8 + split / tp) * act_bytes / 2


def activation_bytes(arch: Arch, cfg: Config, layers: int, in_flight: int, seq: int, batch: int) -> tuple[float, float]:
    """(GPU, CPU) bytes of saved activations for `layers` blocks and `in_flight` micro-batches.

    none: layers x block; full recompute: each block keeps its input (2*s*b*h per layer in 16-bit,
    MEMORY.md) and one block's worth is live while it is recomputed; selective (blocks 0, k, 2k...
    recomputed): those keep their input, the rest everything; offload: everything goes to CPU RAM
    and one block's worth stays on the GPU. Under pipeline parallel the earlier micro-batches in
    flight hold their stored activations while the current one peaks."""
    tp = cfg.parallelism.tp
    # FlashAttention-2 and PyTorch's sdpa (its flash / memory-efficient kernels) save only the output
    # and the log-sum-exp; eager attention saves the scores and probabilities (the s^2 term)
    flash = cfg.model.attn_implementation != AttnImpl.eager
    act = 4 if cfg.precision.name == Precision.fp32 else 2
    block = block_activation_bytes(arch, seq, batch, tp, flash, act)
    layer_input = seq * batch * arch.hidden_size * act
    ck = cfg.checkpointing
    if ck.name == Checkpointing.none:
        return layers * block * in_flight, 0.0
    if ck.name == Checkpointing.offload:
        return block, layers * block * in_flight
    every = 1 if ck.name == Checkpointing.full else ck.every
    # blocks 0, k, 2k... keep their input; recomputing block j in backward re-creates its activations
    # while the blocks below j still hold theirs (the blocks above are freed by then): peak over j
    kept = [layer_input if j % every == 0 else block for j in range(layers)]
    stored = sum(kept)
    below, peak = 0.0, stored
    for j in range(layers):
        if j % every == 0:
            peak = max(peak, below + block)
        below += kept[j]
    return stored * (in_flight - 1) + peak, 0.0


def logits_bytes(arch: Arch, cfg: Config, seq: int, batch: int) -> float:
    """The logits, b*s*vocab in the compute dtype, plus the fp32 upcast for the loss (MEMORY.md:
    "fp32 upcast doubles it"): b*s*V*(2 + 4) with bf16/fp16, b*s*V*(4 + 4) in fp32."""
    act = 4 if cfg.precision.name == Precision.fp32 else 2
    return batch * seq * arch.vocab_size * (act + 4)


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass
class Plan:
    """Per-rank bytes (the rank that needs the most) and where offloaded states go."""

    params: int
    trainable: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    overhead: float
    cpu_bytes: float = 0.0
    """CPU RAM per node for offloaded states/activations."""
    nvme_bytes: float = 0.0
    """NVMe space per node for offloaded states."""
    budget: float = 0.0
    """Memory one rank may use: hardware.gpu_memory_gib, or cpu RAM / ranks per node on CPU."""
    cpu_budget: float = 0.0
    nvme_budget: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.overhead

    @property
    def fits(self) -> bool:
        return self.total <= self.budget and self.cpu_bytes <= self.cpu_budget and self.nvme_bytes <= self.nvme_budget

    @property
    def headroom(self) -> float:
        """Bytes left on the rank (negative: short by)."""
        return self.budget - self.total


def plan(cfg: Config) -> Plan:
    """Per-rank memory of `cfg` on `cfg.hardware` (raises ConfigError when the architecture is unknown)."""
    arch = architecture(cfg.model)
    p, z, hw = cfg.parallelism, cfg.zero, cfg.hardware
    counts = count_params(arch, cfg)
    w, g, k = engine_state_bytes(cfg)
    mp = p.tp * p.pp  # weights/grads/optimizer split over tensor x pipeline ranks
    dp = cfg.data_parallel_size
    notes: list[str] = []

    # model states of the trainable parameters, then the frozen base (weights only)
    trainable, frozen = counts.trainable / mp, counts.frozen / mp
    cpu = nvme = 0.0
    gathered = 0.0
    if z.enabled:
        weights, grads, opt = zero_states(z.stage, trainable, dp, w, g, k)
        frozen_w = frozen * counts.frozen_bytes_per_param / (dp if z.stage == 3 else 1)
        if z.stage == 3:
            gathered = (w + g) * arch.largest_layer_params  # one module's 16-bit weights + gradients at a time
        if z.offload_optimizer != Offload.none:
            # the reduced gradient partition goes straight into an fp32 buffer next to the offloaded states
            # (MEMORY.md: "moves the 12P and the fp32 gradient copy"); the GPU keeps only reduce buckets
            moved = opt + 4 * trainable / dp
            opt = grads = 0.0
            if z.offload_optimizer == Offload.cpu:
                cpu += moved
            else:
                nvme += moved
        if z.offload_param != Offload.none:
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
        frozen_w = frozen * counts.frozen_bytes_per_param
        if p.strategy == Strategy.fsdp:  # FSDP2: like ZeRO-3 over dp, fp32 states, one block gathered at a time
            weights, grads, opt, frozen_w = weights / dp, grads / dp, opt / dp, frozen_w / dp
            gathered = (w + g) * max(arch.block_params / p.tp, arch.largest_layer_params / p.tp)
            if p.fsdp_offload:
                cpu += weights + grads + opt + frozen_w
                weights = grads = opt = frozen_w = 0.0
            elif not p.fsdp_reshard_after_forward:  # gathered blocks kept from forward to backward
                gathered += w * arch.params / mp
        elif p.strategy == Strategy.ddp and dp > 1 and mp == 1:
            grads *= 2  # DDP's flat all-reduce buckets duplicate the gradients (no gradient_as_bucket_view)
            notes.append("DDP: gradient buckets counted as a second copy of the gradients")
        notes.append("torch engine: fp32 weights and AdamW states in every precision (bf16/fp16 autocast the compute only)")
    weights += frozen_w + gathered

    # DPO: a live reference model adds its weights (frozen, no gradients, sharded like the policy's frozen part)
    if cfg.method.name == Method.dpo and cfg.method.loss != DpoLoss.simpo and cfg.method.reference == Reference.live:
        ref_bytes = (2 if z.enabled and cfg.precision.name != Precision.fp32 else 4) * arch.params / mp
        if (z.enabled and z.stage == 3) or p.strategy == Strategy.fsdp:
            ref_bytes /= dp
        weights += ref_bytes
        notes.append("DPO reference=live: a frozen copy of the model's weights")

    # activations: micro batch (x2 for DPO pairs), sequence length, pipeline stages in flight
    seq = cfg.data.max_length
    batch = cfg.train.micro_batch_size * (2 if cfg.method.name == Method.dpo else 1)
    layers = math.ceil(arch.num_hidden_layers / p.pp)
    micro_batches = max(1, cfg.grad_accum_steps)
    in_flight = 1 if p.pp == 1 else (micro_batches if p.pp_schedule == PipeSchedule.gpipe else min(p.pp, micro_batches))
    act_gpu, act_cpu = activation_bytes(arch, cfg, layers, in_flight, seq, batch)
    logits = logits_bytes(arch, cfg, seq, batch)
    if p.pp > 1:
        notes.append(f"pipeline: {layers} blocks per stage, {in_flight} micro-batches in flight on the first stage; "
                     "the logits (last stage) are added too: a conservative worst rank")

    on_gpu = hw.gpu_memory_gib > 0
    ranks_per_node = cfg.launcher.nproc_per_node
    cpu = (cpu + act_cpu) * ranks_per_node  # per rank -> per node
    nvme *= ranks_per_node
    if cfg.world_size > hw.gpus_per_node * hw.nodes and on_gpu:
        notes.append(f"the launch has {cfg.world_size} ranks but hardware={hw.name} lists {hw.gpus_per_node} x {hw.nodes}")
    budget = hw.gpu_memory_gib * GIB if on_gpu else hw.cpu_memory_gib * GIB / ranks_per_node
    return Plan(params=counts.total, trainable=counts.trainable, weights=weights, gradients=grads, optimizer=opt,
                activations=act_gpu, logits=logits, overhead=GPU_OVERHEAD_BYTES if on_gpu else CPU_OVERHEAD_BYTES,
                cpu_bytes=cpu, nvme_bytes=nvme, budget=budget,
                cpu_budget=hw.cpu_memory_gib * GIB if on_gpu else math.inf, nvme_budget=hw.nvme_gib * GIB, notes=notes)


# ---------------------------------------------------------------------------------------------
# CLI


def render(cfg: Config, pl: Plan) -> str:
    """The per-rank table in GiB, the offload lines and the verdict."""
    hw = cfg.hardware
    gib = lambda b: f"{b / GIB:10.2f}"  # noqa: E731
    where = f"{hw.gpu_memory_gib:g} GiB per GPU" if hw.gpu_memory_gib > 0 else \
        f"no GPU: {hw.cpu_memory_gib:g} GiB RAM shared by {cfg.launcher.nproc_per_node} rank(s)"
    lines = [f"memory plan per rank, GiB (2^30 bytes) -- hardware={hw.name} ({where}); {cfg.world_size} rank(s), "
             f"tp={cfg.parallelism.tp} pp={cfg.parallelism.pp} dp={cfg.data_parallel_size}",
             f"parameters   {pl.params:,} ({pl.trainable:,} trainable)"]
    for name, value in (("weights", pl.weights), ("gradients", pl.gradients), ("optimizer", pl.optimizer),
                        ("activations", pl.activations), ("logits/loss", pl.logits), ("overhead", pl.overhead)):
        lines.append(f"  {name:<12}{gib(value)}")
    lines.append(f"  {'total':<12}{gib(pl.total)}   of {pl.budget / GIB:.2f}")
    if pl.cpu_bytes:
        lines.append(f"cpu RAM per node (offload) {pl.cpu_bytes / GIB:.2f} GiB of {hw.cpu_memory_gib:g}")
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
    from finetune.launch import preflight  # composes and validates like the launcher; imports no torch

    try:
        cfg = preflight(list(sys.argv[1:] if argv is None else argv))
        pl = plan(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(cfg, pl))
    return 0 if pl.fits else 1


if __name__ == "__main__":
    sys.exit(main())
