"""Activation bytes, counted tensor by tensor for the block each family runs (finetune/families/ reads what
differs from the config), checked against autograd's saved tensors and MemTracker (tests/test_plan.py,
tests/test_plan_families.py): one block's saved tensors, the head's, and how checkpointing, offload and a
pipeline's micro-batches in flight hold them through backward (Korthikanti et al. 2022; docs/memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.config import Checkpointing, Config, Logits, LogitsKernel, PeftMethod, Precision
from finetune.families import Arch, Block, Linear, adapted, targeted
from finetune.layouts.mesh import fsdp_gathers_bf16
from finetune.planner.counts import adapter_params, attention_kernel, module_bytes


@dataclass(frozen=True)
class Dtypes:
    """How a block's tensors are stored.

    module: bytes of the weights and of the residual stream (4: the torch engine keeps the module
    fp32 in every precision; 2: DeepSpeed's bf16/fp16 module, FSDP2's bf16 gathers); compute: bytes of matmul outputs
    (2 under bf16/fp16, 4 in fp32); autocast: torch.autocast casts each matmul's inputs (and keeps
    a 16-bit copy of every weight it used for backward)."""

    module: int
    compute: int

    @property
    def autocast(self) -> bool:
        return self.module != self.compute


def dtypes(cfg: Config) -> Dtypes:
    """The module's and the compute's bytes; FSDP2 in mixed precision computes on its bf16 gathers as a bf16 module
    does (fp32 shards, no autocast: layouts.mesh.fsdp_gathers_bf16)."""
    compute = 4 if cfg.precision.name == Precision.fp32 else 2
    return Dtypes(module=2 if fsdp_gathers_bf16(cfg) else module_bytes(cfg), compute=compute)


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
    the column-parallel linears (q/k/v, gate/up) by tp; sequence parallel (`sequence_split`) divides the norms (and
    the residual dropout masks) too, as Korthikanti et al.'s s*b*h*(34 + 5as/h)/t, except that torch's column-wise
    layers save the gathered input whole (Megatron gathers it again in backward): the inputs of q/k/v and gate/up stay
    whole on every rank. Under autocast each weight the block used is
    also kept as a 16-bit copy for the input gradient: 2 bytes/param (not for QLoRA's 4-bit base,
    which is dequantized again in backward, nor for a MoE's experts); PEFT's adapted experts keep their
    merged weights (m bytes/param) per forward."""
    block = block or arch.block
    fam, h, tp = arch.family, arch.hidden_size, cfg.parallelism.tp
    d = dtypes(cfg)
    m, c = d.module, d.compute
    pre, post = fam.block_norms - fam.post_norms, fam.post_norms
    normed_in, normed_out = (4, 4) if fam.norm_fp32 else (m, c)  # the normalised input: fp32, or the input's dtype
    # replicated under tensor parallel: the residual stream's norms (split along the sequence under sequence parallel)
    # and what the column-parallel linears read (gathered whole either way)
    split = sequence_split(cfg)
    replicated = (pre * norm_bytes(arch, cfg, h, 1, normed_in) + post * norm_bytes(arch, cfg, h, 1, normed_out)) / split \
        + linear_input_bytes(cfg, d, h, block.role("qkv"), m, False) + linear_input_bytes(cfg, d, h, block.role("up"), m, False)
    attention = attention_bytes(arch, cfg, block, seq, masked, normed_out)
    residual_masks = (2 * h * (1 if cfg.hardware.gpu_memory_gib > 0 else c)) if arch.residual_dropout > 0 else 0
    mlp = mlp_bytes(arch, cfg, block)
    return tokens * (replicated + (attention + mlp) / tp + residual_masks / split + qat_inputs(cfg, block)) \
        + weight_copies(arch, cfg, block)


def sequence_split(cfg: Config) -> int:
    """Over how many ranks the residual stream is split along the sequence: tp under sequence parallel (the default with
    tp > 1: finetune/rank/sequence.py), else 1 (each rank of a TP group holds it whole)."""
    p = cfg.parallelism
    return p.tp if p.tp > 1 and p.sequence_parallel else 1


def qat_linears(cfg: Config, block: Block) -> list[Linear]:
    """The block's linear layers train.qat fake-quantizes (finetune.rank.qat.chosen: nn.Linear, inputs in whole groups)."""
    group = cfg.train.qat_group_size
    return [lin for lin in block.linears if lin.experts == 1 and lin.adaptable and lin.inputs % group == 0]


def qat_inputs(cfg: Config, block: Block) -> float:
    """Bytes per token train.qat=int8_dynamic_* adds: each quantized linear's fake-quantized input, saved for its
    weight gradient, and the rounding's mask (measured on the quickstart: 17.0 against 11.3 MiB of activations for
    weights alone)."""
    if cfg.train.qat is None or not cfg.train.qat.value.startswith("int8_dynamic_"):
        return 0.0
    return sum(lin.inputs for lin in qat_linears(cfg, block)) * (dtypes(cfg).module + 1)


def attention_bytes(arch: Arch, cfg: Config, block: Block, seq: int, masked: bool, normed_out: int) -> float:
    """Per token, what the attention saves (block_activation_bytes' attention items, before tensor parallel divides
    them): the q/k norms, the kernel's tensors, o_proj's input."""
    fam, a, q, kv = arch.family, arch.num_attention_heads, arch.q_dim, arch.kv_dim  # q: heads x head_dim; h in Llama
    d = dtypes(cfg)
    c = d.compute
    on_gpu = cfg.hardware.gpu_memory_gib > 0
    kernel = attention_kernel(arch, cfg)[0]
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
    return attention + linear_input_bytes(cfg, d, q, block.role("o"), c, kernel != "eager" and not math and not fam.fused)


def mlp_bytes(arch: Arch, cfg: Config, block: Block) -> float:
    """Per token, what the MLP saves (block_activation_bytes' MLP items, before tensor parallel divides them): the
    gated or plain MLP's tensors, down's input, and a MoE's router and routed tokens."""
    d, moe, h = dtypes(cfg), block.moe, arch.hidden_size
    m, c = d.module, d.compute
    down = block.role("down")
    if moe is None:
        i = block.mlp_width
        mlp = (ACT_SAVES.get(arch.act, 1) if arch.family.mlp == "plain" else 3) * c * i
    else:  # a shared expert (Qwen2-MoE) runs a gated MLP on every token
        i = down[0].inputs if down else 0
        mlp = 3 * c * i
    mlp += linear_input_bytes(cfg, d, i, down, c, False)
    if moe is not None:  # the router, then each token's top-k experts on gathered copies of it
        k, e = moe.top_k, moe.width
        trains = cfg.peft.name == PeftMethod.none or experts_adapted(arch, cfg)
        router = 4 * moe.experts + 8 * k + ((4 + 4 * k) if moe.normalized else 0)
        # per routed token: gate_up's output (the activation reads a view), the activation, down's output
        # (weighted by the router); trainable experts also keep the gathered input and down's input
        row = m * (2 * e + e + h) + 4 + 24 + (m * (h + e) if trains else 0)
        mlp += router + k * row
    return mlp


def weight_copies(arch: Arch, cfg: Config, block: Block) -> float:
    """Bytes of weights one block keeps for backward beside its activations: under autocast the 16-bit copies it made
    (adapters' too; not a MoE's experts, nor QLoRA's 4-bit base); PEFT's adapted experts' merged weights; train.qat's
    rounded weights (what the fake quantization saves: measured on the quickstart, 2.5 fp32 copies of each quantized
    weight without autocast (3.8 MiB more activations), one under bf16 autocast (1.6 MiB))."""
    d, tp = dtypes(cfg), cfg.parallelism.tp
    copies = 0.0
    if d.autocast:  # the 16-bit weights autocast made, kept for the input gradient (adapters' too); not the experts'
        dense = sum(lin.inputs * lin.outputs for lin in block.linears if lin.experts == 1)
        copies = 2 * ((dense if cfg.peft.name != PeftMethod.qlora else 0) + adapter_params(block, cfg)) / tp
    if block.moe is not None and cfg.peft.name != PeftMethod.none and experts_adapted(arch, cfg):  # PEFT's ParamWrapper: W + BA
        copies += d.module * sum(lin.params for lin in block.linears if lin.experts > 1) / tp
    if cfg.train.qat is not None:  # the rounded weights (and, without autocast, the rounded weight the matmul saves): measured
        copies += (1.0 if d.autocast else 2.5) * d.module * sum(lin.inputs * lin.outputs for lin in qat_linears(cfg, block))
    return copies


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
    """Offloaded to CPU RAM on GPU ranks: checkpointing=offload's saved tensors, full_offload's block inputs (the plan's
    host memory per node, peak.py)."""

    @property
    def measured(self) -> float:
        """What MemoryProbe's backward_activations measures: activations and temporaries at the start of
        the model's backward or at its worst moment, whichever holds more."""
        return max(self.stored + self.logits_grad, self.blocks)


def recompute_every(cfg: Config) -> int:
    """Every how many blocks one is recomputed in backward (keeping its input, and under ops its matmuls' outputs):
    0 for none and offload, 1 for full, ops and full_offload, checkpointing.every for selective."""
    ck = cfg.checkpointing
    return {Checkpointing.none: 0, Checkpointing.offload: 0}.get(ck.name, ck.every if ck.name == Checkpointing.selective else 1)


def recomputed_outputs(arch: Arch, cfg: Config, seq: int, tokens: float) -> float:
    """What a recomputed block keeps besides its input: under checkpointing=ops its ops' outputs (the largest block's
    op_outputs_bytes), else nothing."""
    if cfg.checkpointing.name != Checkpointing.ops:
        return 0.0
    return tokens * max(op_outputs_bytes(arch, cfg, b, seq) for b in set(arch.layers))


def op_outputs_bytes(arch: Arch, cfg: Config, block: Block, seq: int) -> float:
    """Per token, what checkpointing=ops keeps of a block besides its input: the outputs of the ops
    finetune.rank.recompute.SAVED names, whether or not backward reads them (c bytes each; a MoE's experts in the
    weights' dtype, grouped_mm is not autocast): every linear's (a frozen base's too; tensor parallel divides the
    column-parallel ones, q/k/v and gate/up, whose outputs are sharded; o's and down's are whole partial sums), each
    adapter's lora_A and lora_B outputs (r + outputs), a MoE's routed tokens' gate_up and down outputs (k per token),
    and the attention kernel's: sdpa / FlashAttention its output and fp32 log-sum-exp per head, eager (and sdpa's
    math kernel, fp32 on CPU) the two batched matmuls, the a x s scores and the output. The pointwise ops, norms,
    casts (autocast's weight copies too) are recomputed. Checked tensor by tensor (tests/test_checkpointing.py)."""
    d, tp = dtypes(cfg), cfg.parallelism.tp
    m, c = d.module, d.compute
    sharded = {lin.name for role in ("qkv", "up") for lin in block.role(role)}
    dense = sum(lin.outputs / (tp if lin.name in sharded else 1) for lin in block.linears if lin.experts == 1)
    lora = 0.0
    if cfg.peft.name != PeftMethod.none:
        lora = sum(cfg.peft.r + lin.outputs for lin in block.linears
                   if lin.experts == 1 and lin.adaptable and targeted(lin.name, cfg.peft.target_modules))
    experts = 0.0
    if block.moe is not None:
        experts = block.moe.top_k * m * (2 * block.moe.width + arch.hidden_size) / tp
    kernel = attention_kernel(arch, cfg)[0]
    q, a = arch.q_dim / tp, arch.num_attention_heads / tp
    math = kernel == "sdpa" and arch.attention_dropout > 0 and cfg.hardware.gpu_memory_gib <= 0
    if kernel == "eager" or math:
        attention = (4 if math else c) * (a * seq + q)
    else:
        attention = c * q + 4 * a
    return c * (dense + lora) + experts + attention


def activation_bytes(arch: Arch, cfg: Config, layers: int, in_flight: int, seq: int, tokens: int,
                     block_grads: float = 0.0, head_grads: float = 0.0, moves: bool = True, masked: bool = False,
                     labelled: int | None = None, exchange: float = 0.0, logit_tokens: int | None = None) -> Activations:
    """Saved activations for `layers` blocks and `in_flight` micro-batches, through backward;
    `block_grads` per block and `head_grads` are the gradients that fill in as backward goes down.

    none: every block's; full recompute (non-reentrant checkpoint): each block keeps its input
    (m s b h; the literature's 2sbh per layer in 16-bit, docs/memory.md) and the block being
    recomputed is whole again in backward; selective (blocks 0, k, 2k... recomputed): those keep their input, the rest
    everything; ops: each block its input and its matmuls' outputs (op_outputs_bytes), recomputed whole in
    backward; offload: everything saved goes to CPU RAM (one block's worth in flight on the
    device); full_offload: the blocks' inputs go to CPU RAM, the device holds the block being recomputed. Under
    pipeline parallel the earlier micro-batches in flight hold their stored activations while the current one peaks. `moves`: False when the ranks run on CPU, where
    offloading to CPU RAM moves nothing (counted as none). `exchange`: context parallel's all-to-all buffers,
    live while a block runs. `logit_tokens`: the positions the output layer computes where not every token's
    (transformers' logits_to_keep: an online method's padding-free rollout, its completion tokens only)."""
    d = dtypes(cfg)
    block = max(block_activation_bytes(arch, cfg, seq, tokens, b, masked) for b in set(arch.layers))
    # differentiating a block: the gradient of the residual stream (m h) and about one MLP-wide
    # gradient at a time while its saved tensors are freed one by one (measured with MemTracker)
    width = max(b.mlp_width * (d.module if b.moe else d.compute) for b in arch.layers)
    working = tokens * (width / cfg.parallelism.tp + d.module * arch.hidden_size) + exchange
    layer_input = tokens * arch.hidden_size * d.module / sequence_split(cfg)  # a recomputed block's input: this rank's tokens
    ck = cfg.checkpointing
    if ck.name == Checkpointing.offload and moves:
        kept = [0.0] * layers
        offloaded = layers * block * in_flight
    elif ck.name == Checkpointing.full_offload and moves:  # the inputs in host memory; one block whole at a time
        kept = [0.0] * layers
        offloaded = layers * layer_input * in_flight
    else:
        every = recompute_every(cfg)
        keeps = layer_input + recomputed_outputs(arch, cfg, seq, tokens)
        kept = [keeps if every and j % every == 0 else block for j in range(layers)]
        offloaded = 0.0
    earlier = sum(kept) * (in_flight - 1)  # pipeline micro-batches waiting for their backward
    # a block recomputed under PEFT holds more in its backward than its forward saved (RECOMPUTE_PEFT)
    recomputed = block * (1 + RECOMPUTE_PEFT[dtypes(cfg).autocast]) if cfg.peft.name != PeftMethod.none else block
    # backward of block j: the blocks below still hold theirs, block j is whole (recomputed or kept),
    # the blocks above are freed and their gradients exist
    below, blocks, filled = 0.0, 0.0, 0.0
    for j in range(layers):
        whole = recomputed if kept[j] != block else block  # full_offload: the input back from host memory is in it
        blocks = max(blocks, below + whole + working)
        filled = max(filled, below + whole + working + (layers - 1 - j) * block_grads)
        below += kept[j]
    v = arch.head_width  # the output layer is replicated under tensor parallel (no loss parallel): every rank's logits are whole
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
    scored = tokens if logit_tokens is None else min(tokens, logit_tokens)
    return Activations(stored=earlier + sum(kept) + head_bytes(arch, cfg, tokens), loss=scored * (12 * v + 8),
                       logits_grad=scored * d.compute * v, blocks=earlier + blocks, filled=earlier + filled + head_grads,
                       cpu=offloaded)


def tower_bytes(arch: Arch, cfg: Config, patches: float) -> float:
    """What a training vision tower (Arch.tower, read off the meta build) keeps for backward while the language model's
    backward runs, for `patches` image patches: each of its blocks' saved tensors counted as the language model's are
    (block_activation_bytes, with the patches for tokens; under checkpointing, which covers the tower's blocks too, each
    block keeps its input), and under autocast the 16-bit copy of the pixel values its patch embedding saves (in fp32 it
    saves the batch's own tensor). Measured on the image quickstart's Qwen2-VL: 2.2 MiB counted, 2.2 MiB more than with
    the tower frozen (tests/test_images.py)."""
    tower, d = arch.tower, dtypes(cfg)
    if tower is None or patches <= 0:
        return 0.0
    seq = int(patches)
    block = max(block_activation_bytes(tower, cfg, seq, seq, b) for b in set(tower.layers))
    every = recompute_every(cfg)
    keeps = patches * tower.hidden_size * d.module + recomputed_outputs(tower, cfg, seq, patches)
    kept = [keeps if every and j % every == 0 else block for j in range(tower.num_hidden_layers)]
    return (patches * arch.patch_input * d.compute if d.autocast else 0.0) + sum(kept)


def head_bytes(arch: Arch, cfg: Config, tokens: int) -> float:
    """What the model saves outside its blocks: the final norm (norm_bytes), lm_head's input (when lm_head
    trains: a 16-bit cast under autocast, else the norm's output) and, under autocast, its 16-bit
    weight; the tanh of soft-capped logits (Gemma-2: c V); the embedding dropout's mask (GPT-2)."""
    d, fam, h = dtypes(cfg), arch.family, arch.hidden_size  # the output layer whole on every rank, under tp too
    trains = cfg.peft.name == PeftMethod.none or "lm_head" in cfg.peft.modules_to_save
    # the final norm on this rank's tokens under sequence parallel (its output gathered whole for the output layer)
    per_token = norm_bytes(arch, cfg, h, 1, 4 if fam.norm_fp32 else d.module) / sequence_split(cfg) + (d.compute if trains else 0) * h
    chunked = cfg.logits.name == Logits.chunked
    per_token += d.compute * arch.vocab_size if arch.final_softcap and not chunked else 0  # chunked: recomputed
    per_token += d.module * h if chunked else 0  # the labelled positions' hidden states, gathered for the chunks
    per_token += h * (1 if cfg.hardware.gpu_memory_gib > 0 else d.module) if arch.embedding_dropout > 0 else 0
    return tokens * per_token + (2 * arch.head_width * h if d.autocast else 0)
