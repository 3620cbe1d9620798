"""The plan: per-rank bytes of a composed config for the rank that needs the most, from the counts
(finetune.planner.counts) and the activations (finetune.planner.activations): weights, gradients, optimizer
states, activations, logits/loss buffers and a fixed framework overhead, and what offload puts in CPU RAM / on
NVMe. The total is the peak: the larger of the backward peak and the optimizer step (the categories do not all
peak together), at the longest batch the run will see (finetune.data.lengths) or data.max_length, an upper bound.

`plan()` imports only the config and the standard library: no torch (but for `optim.name=torch.optim.CLASS`,
whose state is measured on a probe step: finetune/optimizers/), well under a second for any model size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from finetune import methods, optimizers
from finetune.config import Config, ConfigError, Fp8Scaling, Logits, ModelConfig, Offload, OptimKernel, PeftMethod, Precision, Reference, StateDtype, Strategy
from finetune.disk import checkpoint_dir, local_config, stored_dtypes
from finetune.families import COUNTED, Arch
from finetune.families.arch import arch_from_config
from finetune.families.vision import frozen_parts
from finetune.data.lengths import Longest
from finetune.data.rows import padding_free, several_per_row
from finetune.layouts import engine_kind, layouts_of, resolve
from finetune.methods.base import SCORED, Sampling
from finetune.methods.distill import teacher_dir
from finetune.planner.activations import Activations, activation_bytes, dtypes, tower_bytes
from finetune.planner.counts import (CPU_OVERHEAD_BYTES, GIB, GPU_OVERHEAD_BYTES, Counts, architecture, attention_kernel,
                                     count_params, end_shapes, engine_state_bytes, module_bytes, moe_notes, optimizer_kind, state_bytes,
                                     trainable_shapes, trainable_split)
from finetune.planner.terms import States, Work



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
    rollout: float = 0.0
    """GRPO's sampling before the step (generate with its KV cache): the cache of every completion of a micro-batch
    at prompt + completion tokens and one decoding step's logits; freed before the step's forward."""
    reserved: float = 0.0
    """Held through the whole run beside training: method.vllm's engine (its fraction of the GPU: weights and KV cache)."""

    @property
    def backward_peak(self) -> float:
        """Weights, optimizer states and the worst moment of backward."""
        return self.weights + self.optimizer + self.backward + self.overhead + self.reserved

    @property
    def step_peak(self) -> float:
        """Weights, gradients and optimizer states (and its temporaries) at the optimizer step."""
        return self.weights + self.gradients + self.optimizer + self.step_temp + self.overhead + self.reserved

    @property
    def rollout_peak(self) -> float:
        """Weights, optimizer states and GRPO's sampling (the gradients were freed by the last step: set to None)."""
        return self.weights + self.optimizer + self.rollout + self.overhead + self.reserved

    @property
    def peak_at(self) -> str:
        """When the peak falls: backward, the optimizer step or GRPO's sampling."""
        return max((self.backward_peak, "backward"), (self.step_peak, "the optimizer step"), (self.rollout_peak, "sampling (GRPO's rollout)"))[1]

    @property
    def total(self) -> float:
        """The peak: the categories do not peak together (gradients fill in while activations are freed; the KV cache
        of a rollout is freed before the step)."""
        return max(self.backward_peak, self.step_peak, self.rollout_peak)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget and self.cpu_bytes <= self.cpu_budget and self.nvme_bytes <= self.nvme_budget

    @property
    def headroom(self) -> float:
        """Bytes left on the rank (negative: short by)."""
        return self.budget - self.total


def plan(cfg: Config, longest: Longest | None = None) -> Plan:
    """Per-rank memory of `cfg` on `cfg.hardware` (raises ConfigError when the architecture is unknown),
    its activations at `longest` (the longest batch the run sees, read from its data: finetune.data.lengths)
    or, without it, at data.max_length, an upper bound for padded batches."""
    arch = architecture(cfg.model)
    if methods.get(cfg.method.name).model_class == SCORED:  # a reward model: a score head of hidden x 1, not lm_head
        arch = arch.scored()
    counts = count_params(arch, cfg)
    on_gpu = cfg.hardware.gpu_memory_gib > 0  # without a GPU, offloading to CPU RAM moves nothing: it stays counted per rank
    notes = model_notes(arch, cfg)
    if cfg.precision.fp8 is not None:
        notes.append("precision=fp8: weights, gradients and optimizer states as precision=bf16's (torchao keeps the weights in "
                     "their dtype), and activations too (its float8 layers save their bf16 inputs for the backward)" +
                     ("; FSDP2 gathers a block's converted weights in FP8 (1 byte each), counted as bf16's: an upper bound"
                      if cfg.parallelism.strategy == Strategy.fsdp and cfg.precision.fp8 == Fp8Scaling.tensorwise else ""))
    s = model_states(arch, cfg, counts, on_gpu, notes)
    policy = s.weights  # one copy of the policy's weights on this rank (a background sampler holds another)
    s.weights += reference_weights(arch, cfg, s, notes)
    seq, said = batch_width(cfg, longest)
    notes.append(said)
    sampling = methods.get(cfg.method.name).sampling(cfg.method)
    if sampling is not None:  # GRPO's rows: a prompt and a sampled completion (bounded by the row + a whole one)
        seq += sampling.completion_tokens * sampling.turns
        notes.append(f"{cfg.method.name} rows: counted at {seq} tokens, that width + method.completion_tokens={sampling.completion_tokens} "
                     "(an upper bound of prompt + completion)" if sampling.turns == 1 else
                     f"{cfg.method.name} rows: counted at {seq} tokens, that width + {sampling.turns} turns of method.completion_tokens="
                     f"{sampling.completion_tokens} (the tools' results are not counted: their length is the functions')")
    acts, backward = activations_through_backward(arch, cfg, counts, s, seq, longest, on_gpu, notes)
    labelled = longest.labelled if longest is not None else seq * cfg.train.micro_batch_size
    if sampling is not None:  # sampled responses (on-policy distillation): each row's up to completion_tokens labelled
        labelled = max(labelled, cfg.train.micro_batch_size * sampling.completions * sampling.completion_tokens * sampling.turns)
    weights, held = teacher_bytes(cfg, s, labelled, notes)
    s.weights += weights
    acts, backward = replace(acts, loss=acts.loss + held), backward + held
    pl = total(cfg, counts, s, acts, backward, step_temp(arch, cfg, counts, s, on_gpu), seq, on_gpu, notes)
    if sampling is not None:
        pl.rollout, pl.reserved = rollout_bytes(arch, cfg, sampling, seq, on_gpu, notes, policy)
        if cfg.zero.enabled:  # DeepSpeed keeps its gradient partitions between steps
            pl.rollout += s.grads
    return pl


def kv_cache_bytes(arch: Arch, rows: int, tokens: int, tp: int, itemsize: float) -> float:
    """transformers' KV cache of `rows` sequences at `tokens` positions: keys and values of every layer
    (num_key_value_heads x head_dim wide), split over tp ranks."""
    return rows * tokens * arch.num_hidden_layers * 2 * arch.kv_dim / tp * itemsize


def rollout_bytes(arch: Arch, cfg: Config, sampling: Sampling, seq: int, on_gpu: bool, notes: list[str],
                  policy: float = 0.0) -> tuple[float, float]:
    """An online method's sampling before each step: (model.generate's KV cache of micro_batch_size x completions rows
    at `seq` tokens, prompt + completion, with one decoding step's fp32 logits and probabilities; vLLM's reservation
    beside training, where its own KV cache lives instead). A background sampler (method.async_generation) holds a copy
    of the policy's weights (`policy` bytes) through the run and samples during the step: all of it is counted at
    every peak."""
    name, per = cfg.method.name, sampling.completions
    rows = cfg.train.micro_batch_size * per
    if sampling.sampler == "vllm":
        reserved = sampling.reserved * cfg.hardware.gpu_memory_gib * GIB if on_gpu else 0.0
        notes.append(f"{name} rollout: vLLM samples {rows} completions per micro-batch; it holds method.vllm_memory={sampling.reserved:g} "
                     f"of the GPU for its weights and KV cache through the run ({reserved / GIB:.2f} GiB, counted at every peak)"
                     if on_gpu else f"{name} rollout: vLLM on CPU keeps its KV cache in VLLM_CPU_KVCACHE_SPACE, not counted here")
        return 0.0, reserved
    logits = rows * arch.vocab_size * 4 * 2
    if sampling.sampler == "vllm_server":
        copy = policy + logits if sampling.copy else 0.0
        notes.append(f"{name} rollout: a vLLM server (method.vllm_servers) samples {rows} completions per micro-batch on devices "
                     "of its own: nothing of it on this rank" + (
                         f"; a copy of the policy scores them in the background while the step trains (method.async_generation: "
                         f"{policy / 2**20:.1f} MiB, and {logits / 2**20:.1f} MiB of logits for its {rows} rows, counted at every peak)"
                         if copy else ""))
        return 0.0, copy
    kv = kv_cache_bytes(arch, rows, seq, cfg.parallelism.tp, dtypes(cfg).compute)
    if sampling.sampler == "background":
        notes.append(f"{name} rollout: sampled in the background while the step trains (method.async_generation), by a copy "
                     f"of the policy ({policy / 2**20:.1f} MiB, held through the run) with a KV cache of {kv / 2**20:.1f} MiB "
                     f"at {seq} tokens and {logits / 2**20:.1f} MiB of logits for its {rows} rows: counted at every peak")
        return 0.0, policy + kv + logits
    notes.append(f"{name} rollout: {rows} completions per micro-batch ({cfg.train.micro_batch_size} prompts x {per}), "
                 f"each a row with gradients; sampling holds a KV cache of {kv / 2**20:.1f} MiB at {seq} tokens and "
                 f"{logits / 2**20:.1f} MiB of logits, freed before the step")
    return kv + logits, 0.0


def model_notes(arch: Arch, cfg: Config) -> list[str]:
    """The plan's first lines: how the model is counted, its attention kernel, its rows, its experts under PEFT."""
    notes: list[str] = []
    if not arch.known and arch.model_type in COUNTED:
        notes.append(f"model_type={arch.model_type}: its parameters are counted as transformers builds them (finetune/families/records.py "
                     "COUNTED); its activations are estimated from the families measured (FAMILIES), not measured for it")
    elif not arch.known:
        notes.append(f"model_type={arch.model_type}: no record in finetune/families/records.py, so its parameters are read off transformers' "
                     "build of its config on the meta device (exact); its activations are estimated as for a Llama-style block "
                     "of the same linears, not measured for it")

    if arch.image_parts:
        frozen = frozen_parts(cfg.model.freeze, adapters=cfg.peft.name != PeftMethod.none)
        sizes = ", ".join(f"{part} {n:,}" for part, n in arch.image_parts)
        tower = ("the frozen vision tower keeps no activations for backward" if "vision" in frozen else
                 "the vision tower trains: its blocks' activations are counted per image patch (the most image tokens a "
                 "micro-batch of the data holds, as patches), where the data's images were read" if arch.tower is not None else
                 "the vision tower trains, and its activations are not counted (no stack of blocks found in it): measure a "
                 "first step (train.memory_report)")
        notes.append(f"vision-language model ({sizes} parameters): frozen {', '.join(frozen) or 'nothing'} (model.freeze); "
                     f"an image's tokens are counted as tokens of the language model's rows (data.max_length); {tower}")
    notes.append("attention: %s (%s)" % attention_kernel(arch, cfg))
    if several_per_row(cfg):  # finetune.rank.varlen, or flash-attn's variable-length kernel
        notes.append(f"rows: {several_per_row(cfg)}, each sample attended alone (no mask over the whole row)")
    return notes + moe_notes(arch, cfg)


def model_states(arch: Arch, cfg: Config, counts: Counts, on_gpu: bool, notes: list[str]) -> States:
    """Weights (the frozen base and what is gathered included), gradients and optimizer states of this rank: the
    engine's bytes per parameter, then each layout's states term (finetune.layouts.LAYOUTS, in order: a ZeRO stage's
    partitions and offloads, tensor and pipeline splits, DDP's buckets, FSDP2's shards and offload)."""
    s = States(counts.trainable, engine_state_bytes(cfg))
    w, g, k = s.bytes_per_param
    s.weights, s.grads, s.opt = w * s.trainable, g * s.trainable, k * s.trainable
    if optimizers.record(cfg.optim.name).by_shape:  # by tensor shape, not per parameter (ZeRO's partitions replace it)
        s.opt = state_bytes(trainable_shapes(arch, cfg), cfg.optim.name, end_shapes(arch, cfg))
    s.frozen = counts.frozen * counts.frozen_bytes_per_param
    for rec in layouts_of(cfg):
        if rec.states is not None:
            resolve(rec.states)(arch, cfg, s, counts, on_gpu, notes)
    if cfg.optim.in_backward:  # each gradient is stepped and freed in its hook: the largest one is the most held
        s.one_grad = g * max(math.prod(shape) for shape in trainable_shapes(arch, cfg)) / (cfg.parallelism.tp * cfg.parallelism.pp)
        notes.append("optim.in_backward: each parameter steps in backward and frees its gradient: the largest "
                     "trainable tensor's gradient counted")
    s.weights += s.frozen + s.gathered
    if engine_kind(cfg) == "deepspeed":  # the stage's term said how DeepSpeed holds them
        pass
    elif cfg.precision.name == Precision.bf16_pure:
        notes.append(f"precision=bf16_pure: bf16 weights, gradients and {optimizer_kind(cfg)} states ({w}+{g}+{k} bytes/param"
                     + (", 2 of them Kahan's compensation)" if cfg.precision.kahan_sum else ")"))
    else:
        states = "bf16 states (optim.state_dtype=bf16: 4 bytes/param)" if cfg.optim.state_dtype == StateDtype.bf16 else "states"
        compute = "FSDP2 gathers and computes in bf16" if dtypes(cfg).module == 2 else "bf16/fp16 autocast the compute only"
        notes.append(f"torch engine: fp32 weights and {optimizer_kind(cfg)} {states} in every precision ({compute})")
    if cfg.peft.name == PeftMethod.dora:
        notes.append("DoRA: its magnitude path keeps more per forward than LoRA (base and adapter outputs per token, "
                     "weight-sized norms); counted as LoRA, so activations are low (~1.5-2x at h=256 measured)")
    return s


def reference_weights(arch: Arch, cfg: Config, s: States, notes: list[str]) -> float:
    """A live reference model (DPO's): its weights (frozen, no gradients, split over the ranks like the policy's)."""
    method = methods.get(cfg.method.name)
    if method.reference(cfg.method) != Reference.live:
        return 0.0
    notes.append(f"{method.name.upper()} reference=live: a frozen copy of the model's weights")
    return module_bytes(cfg) * arch.params / s.split


def completion_logits(cfg: Config, sampling: Sampling | None, rows: int, notes: list[str]) -> int | None:
    """An online method's padding-free rollout computes the output layer at its completion tokens only (transformers'
    logits_to_keep, finetune.methods.losses.labelled_logps): rows x completion_tokens (x turns) positions at most;
    None (every position) otherwise."""
    if sampling is None or not sampling.completion_logits or not padding_free(cfg)[0]:
        return None
    notes.append(f"{cfg.method.name} rollout batch: logits at the completion tokens only ({rows} rows x up to "
                 f"{sampling.completion_tokens * sampling.turns}), not the prompts'")
    return rows * sampling.completion_tokens * sampling.turns


def teacher_bytes(cfg: Config, s: States, labelled: float, notes: list[str]) -> tuple[float, float]:
    """method=distill's teacher (finetune.rank.teacher): (its weights on this rank, split like the policy's, with its
    output layer gathered whole under logits=chunked where they are split; what it adds at the loss's backward: with
    logits=full its fp32 log-softmax and probabilities over every response token, with logits=chunked its hidden states
    of those tokens and one chunk's)."""
    spec = methods.get(cfg.method.name).teacher(cfg.method)
    if spec is None:
        return 0.0, 0.0
    where, size = spec.where, ({"fp32": 4, "bf16": 2, "fp16": 2}[spec.precision] if spec.precision else module_bytes(cfg))
    local = teacher_dir(where)
    config = local_config(ModelConfig(path=str(local))) if local is not None else None
    if config is None:
        raise ConfigError(f"the planner reads the teacher's architecture from its config.json: method.teacher={where} is not a local "
                          "model directory yet (a hub id, or a run its recipe has not made)")
    arch = arch_from_config(config, f"method.teacher={where}")
    weights, v, h = size * arch.params / s.split, arch.vocab_size, arch.hidden_size
    if spec.topk:  # scored once before training, then freed: the loss holds K + 1 log-probs per token for each model
        k = spec.topk
        notes.append(f"method.teacher_topk={k}: the teacher's {arch.params / 1e6:.1f}M weights ({weights / GIB:.2f} GiB here) only "
                     f"while it scores the data before training; its table ({8 * k + 4} bytes per response token of the data) "
                     "is read from disk through host memory; the loss holds K + 1 log-probs per response token for each model")
        return 0.0, labelled * (k + 1) * 4 * 2
    if cfg.logits.name == Logits.chunked:
        head = size * v * h if s.split > 1 else 0.0
        held = labelled * h * (size if spec.precision else 4) + min(cfg.logits.chunk_tokens, labelled) * v * 8
        notes.append(f"method=distill: the teacher's {arch.params / 1e6:.1f}M weights ({size} bytes each)"
                     + (f" and its output layer gathered whole ({v} x {h})" if head else "")
                     + "; its hidden states of the response tokens and one chunk's probabilities at the loss")
        return weights + head, held
    notes.append(f"method=distill: the teacher's {arch.params / 1e6:.1f}M weights ({size} bytes each) and its log-softmax and probabilities over "
                 f"every response token ({v} entries each, fp32; logits=chunked holds one chunk's)")
    return weights, labelled * v * 8


def activations_through_backward(arch: Arch, cfg: Config, counts: Counts, s: States, seq: int, longest: Longest | None,
                                 on_gpu: bool, notes: list[str]) -> tuple[Activations, float]:
    """The activations of a micro batch (x the method's rows per example with gradients: 2 for DPO pairs, 1 for KTO's
    row and its mismatched row outside a pipeline) at `seq` tokens per row, as each layout's work term cuts it
    (finetune.layouts.LAYOUTS: context parallel's share of the tokens, a pipeline's blocks and micro-batches in flight),
    and the worst moment of backward with the gradients held by then (`s.grads` gains DDP's buckets; under
    optim.in_backward it becomes the one gradient held)."""
    method = methods.get(cfg.method.name)
    sampling = method.sampling(cfg.method)
    per = cfg.train.micro_batch_size * (sampling.completions if sampling is not None else 1)  # GRPO: each prompt's completions
    rows = per * (method.rows_per_example - method.no_grad_rows)
    w = Work(seq=seq, rows=rows, no_grad_rows=per * method.no_grad_rows, tokens=seq * rows, layers=arch.num_hidden_layers,
             labelled=longest.labelled if longest is not None else None)
    for rec in layouts_of(cfg):
        if rec.work is not None:
            resolve(rec.work)(arch, cfg, w, notes)
    # padding (rows of different lengths) or packed samples: sdpa gets a mask (a layout's own: packed rows only),
    # unless each sample is attended alone (finetune.rank.varlen: packed rows and padding-free micro-batches)
    masked = not several_per_row(cfg) and (cfg.data.packing or (w.rows > 1 and not w.own_mask))
    # gradients held throughout backward: those of earlier micro-batches (accumulation, or a pipeline's
    # schedule), and buffers allocated up front (DDP buckets; DeepSpeed's gradient partitions / buckets);
    # otherwise they fill in block by block, the head's first
    per_param = s.grads / max(s.trainable, 1)  # gradient bytes per trainable parameter held here
    block_trainable, head_trainable = trainable_split(arch, cfg, counts)
    resident = s.grads if (s.resident or cfg.grad_accum_steps > 1) else 0.0
    block_grads = 0.0 if resident else per_param * block_trainable / cfg.parallelism.tp
    head_grads = 0.0 if resident else per_param * head_trainable  # whole on every TP rank (counts.tp_whole_params)
    if cfg.optim.in_backward:  # stepped and freed in backward: one gradient at a time, never all of them
        s.grads = resident = s.one_grad
        block_grads = head_grads = 0.0
    acts = activation_bytes(arch, cfg, w.layers, w.in_flight, seq, w.tokens, block_grads, head_grads, moves=on_gpu, masked=masked,
                            labelled=w.labelled, exchange=w.exchange, logit_tokens=completion_logits(cfg, sampling, rows, notes))
    tower = tower_bytes(arch, cfg, patches(arch, cfg, longest))  # held until the tower's own backward, the last
    if tower:
        acts = replace(acts, stored=acts.stored + tower, blocks=acts.blocks + tower, filled=acts.filled + tower)
    # the worst moment of backward: the loss's own backward (everything saved, and its buffers), or
    # inside the blocks (the gradients filled in by then)
    # or (FSDP2) the root's post-backward: its unsharded gradients and their reduce-scatter copy, nothing gathered
    root_end = s.root_end - s.gathered + (0.0 if resident else s.grads) if s.root_end else 0.0
    backward = s.buckets + resident + max(acts.stored + acts.loss, acts.filled, root_end)
    s.grads += s.buckets
    return acts, backward


def patches(arch: Arch, cfg: Config, longest: Longest | None) -> float:
    """The image patches a micro-batch's training vision tower runs on: its image tokens (the most one micro-batch holds,
    read from the data) x the pixel values the processor makes per token / the pixel values of one patch. 0 where the
    tower is frozen (model.freeze) or the data's images were not read."""
    adapters = cfg.peft.name != PeftMethod.none
    if arch.tower is None or "vision" in frozen_parts(cfg.model.freeze, adapters) or longest is None or not longest.image_tokens \
            or not arch.patch_input:
        return 0.0
    return longest.image_tokens * longest.pixels_per_token / arch.patch_input


def step_temp(arch: Arch, cfg: Config, counts: Counts, s: States, on_gpu: bool) -> float:
    """The optimizer step's temporaries.

    Adam/AdamW's step: on GPU torch's foreach implementation makes torch._foreach_sqrt(exp_avg_sq), one fp32
    tensor per trainable parameter held here; on CPU it runs tensor by tensor (the largest one's worth).
    optim.state_dtype=bf16 steps tensor by tensor everywhere, with the moments and the denominator in fp32;
    adafactor too, with one fp32 temporary of the tensor's size (its second-moment estimate, then the update)."""
    p, z, dp = cfg.parallelism, cfg.zero, cfg.data_parallel_size
    shard = (dp * p.cp if p.strategy == Strategy.fsdp else 1) * p.tp * p.pp
    if cfg.optim.state_dtype == StateDtype.bf16 and cfg.precision.name != Precision.bf16_pure:
        return 12 * min(counts.trainable, arch.largest_layer_params) / shard
    if optimizers.record(cfg.optim.name).step_temp == "muon":
        return muon_temp(arch, cfg, shard)
    if optimizers.record(cfg.optim.name).step_temp == "tensor" and not z.enabled:
        return 4 * min(counts.trainable, arch.largest_layer_params) / shard
    if optimizers.record(cfg.optim.name).step_temp == "foreach" and fused_step(cfg):
        return 0.0
    if optimizers.record(cfg.optim.name).step_temp == "foreach" and looped_step(cfg):
        return looped_temp(arch, cfg)
    if optimizers.record(cfg.optim.name).step_temp == "foreach" and not (z.enabled and z.offload_optimizer != Offload.none):
        return 4 * (s.trainable / (dp * p.cp if (z.enabled or p.strategy == Strategy.fsdp) else 1) if on_gpu
                    else min(counts.trainable, arch.largest_layer_params))
    return 0.0


def fused_step(cfg: Config) -> bool:
    """Whether the run builds torch's fused kernel for adamw/adam/sgd (finetune.optimizers.kernels.kernel: optim.kernel=auto
    or fused, every parameter of one kind; tensor parallel leaves some plain, and takes the loop): one kernel over
    every parameter, no temporary beside the states (measured under fake tensors: tests/test_simulate.py)."""
    return (not cfg.zero.enabled and cfg.optim.kernel in (OptimKernel.auto, OptimKernel.fused) and not looped_step(cfg)
            and cfg.optim.state_dtype != StateDtype.bf16 and cfg.precision.name != Precision.bf16_pure and not cfg.optim.in_backward)


def looped_temp(arch: Arch, cfg: Config) -> float:
    """adamw/adam stepping tensor by tensor (`looped_step`): the largest tensor's sqrt of its second moment and that
    divided by the bias correction, both fp32 and alive at once (torch.optim.adam._single_tensor_adam's denominator).
    The largest on this rank: tensor parallel splits the blocks' weights and leaves the embeddings and the output layer
    whole; FSDP2 shards each one (measured under fake tensors: tests/test_simulate.py)."""
    p = cfg.parallelism
    ends = end_shapes(arch, cfg)
    split = [math.prod(shape) / p.tp for shape in trainable_shapes(arch, cfg) if shape not in ends]
    largest = max([float(math.prod(shape)) for shape in ends] + split, default=0.0)
    return 8 * largest / (cfg.data_parallel_size * p.cp if p.strategy == Strategy.fsdp else 1)


def looped_step(cfg: Config) -> bool:
    """Whether adamw/adam/sgd step tensor by tensor (optim.kernel=loop, or auto under tensor parallel without FSDP2: the
    blocks' split weights are DTensors, what tensor parallel leaves whole plain tensors, and one fused call takes one kind;
    FSDP2 makes every parameter a DTensor)."""
    mixed = cfg.parallelism.tp > 1 and cfg.parallelism.strategy != Strategy.fsdp
    return not cfg.zero.enabled and (cfg.optim.kernel == OptimKernel.loop or (cfg.optim.kernel == OptimKernel.auto and mixed))


def muon_temp(arch: Arch, cfg: Config, shard: int) -> float:
    """optim=muon's step, one hidden matrix (n elements, smaller side m) at a time: the Nesterov update (fp32, the
    rank's shard), torch's Newton-Schulz in bf16 (its iterate and the next, two m x m grams); over shards the whole
    update gathered in fp32 and the orthogonalised slice kept (finetune.optimizers.muon). The largest matrix's;
    LoRA's adapter matrices are small beside the rest (not counted)."""
    if cfg.peft.name != PeftMethod.none:
        return 0.0
    sizes = [(lin.inputs * lin.outputs, min(lin.inputs, lin.outputs)) for b in arch.layers for lin in b.linears if lin.experts == 1]
    whole = 4.0 if shard > 1 else 0.0
    return max((4 * n / shard + whole * n + 4 * n + 4 * m * m + (2 * n / shard if shard > 1 else 0) for n, m in sizes), default=0.0)


def loading_bytes(cfg: Config, counts: Counts) -> tuple[float, str]:
    """The host memory each rank holds of its own while the model loads on a GPU machine (finetune.rank.model.read_dtype,
    measured by scripts/benchmark_loading.py), and the words for it. A checkpoint whose weights share one dtype is
    read memory-mapped in it: its pages are the page cache, shared by the node's ranks and dropped under pressure (not
    counted), and each rank's part is cast on its GPU. Otherwise the whole model is on every rank's host first, in
    the dtype it is read or built in."""
    m, dtype = cfg.model, 2 if cfg.precision.name == Precision.bf16_pure else 4
    if cfg.zero.stage == 3:
        return 0.0, ""  # ZeRO-3's zero.Init partitions the model while it is built or read
    if cfg.peft.name == PeftMethod.qlora:
        if cfg.parallelism.strategy != Strategy.fsdp:
            return 0.0, ""  # bitsandbytes quantizes each weight on the GPU as it is read
        return counts.frozen * counts.frozen_bytes_per_param, ("QLoRA under FSDP: each rank quantizes the whole base into "
                                                               "host memory before sharding it")
    if m.path is None or m.from_scratch:
        return 4.0 * counts.total, ("a random-init model is built whole in fp32 on every rank's host before it is placed "
                                    "(parallelism=ddp zero=stage3 builds it partitioned)")
    where = checkpoint_dir(m.path, m.revision)
    stored = stored_dtypes(where) if where is not None else {}
    if where is None or len(stored) == 1 or not (stored or any(where.glob("*.bin"))):
        return 0.0, ""  # one dtype, or no weights here to read yet
    why = f"its weights mix {' and '.join(sorted(stored))}" if stored else "its weights are .bin files, not safetensors"
    return dtype * counts.total, (f"model.path={m.path} is read whole on every rank's host ({why}; a checkpoint in one dtype, "
                                  "as save_pretrained writes it, is memory-mapped and shared instead)")


def total(cfg: Config, counts: Counts, s: States, acts: Activations, backward: float, temp: float, seq: int, on_gpu: bool,
          notes: list[str]) -> Plan:
    """The Plan: per-rank categories, CPU RAM and NVMe per node (QLoRA under FSDP loads the whole base first), and the
    budgets they are checked against."""
    hw, p = cfg.hardware, cfg.parallelism
    ranks_per_node = cfg.launcher.nproc_per_node
    cpu = (s.cpu + acts.cpu) * ranks_per_node  # per rank -> per node
    loading, how = loading_bytes(cfg, counts) if on_gpu else (0.0, "")
    if how:
        notes.append(f"loading: {how}" + (f": {loading / GIB:.2f} GiB per rank, {loading * ranks_per_node / GIB:.2f} GiB per "
                                          "node at start" if loading else ""))
    cpu = max(cpu, loading * ranks_per_node)  # loading ends before offloaded states fill in
    nvme = s.nvme * ranks_per_node
    budget = hw.gpu_memory_gib * GIB if on_gpu else hw.cpu_memory_gib * GIB / ranks_per_node
    return Plan(params=counts.total, trainable=counts.trainable, weights=s.weights, gradients=s.grads, optimizer=s.opt,
                activations=acts.stored, logits=acts.loss, overhead=GPU_OVERHEAD_BYTES if on_gpu else CPU_OVERHEAD_BYTES,
                backward=backward, step_temp=temp, measured_activations=acts.measured, width=seq, buckets=s.buckets,
                cpu_bytes=cpu, nvme_bytes=nvme, budget=budget,
                cpu_budget=hw.cpu_memory_gib * GIB if on_gpu else math.inf, nvme_budget=hw.nvme_gib * GIB, notes=notes)
