"""The config groups' options and dataclasses: the enumerations a field takes (each spelled as users type it), and
one dataclass per group (model, data, method, precision, checkpointing, logits, zero, parallelism, peft, optim,
launcher, plan, hardware), each field's constraint declared beside it and its docstring under it. The run's own
group (train) and the root `Config` are in finetune/config/root.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from finetune import logs, optimizers
from finetune.errors import ConfigError, did_you_mean
from finetune.config.data import DataConfig, DataFormat, LongPrompt, Reasoning, Template  # noqa: F401 - re-exported
from finetune.config.fields import (
    ARCHITECTURE, BETAS, ENV, EXISTING_DIR, EXISTING_FILE, HOST_PORT, PORT, POSITIVE, PROBABILITY, TEXT, Accepts, Spelled, at_least, checked, in_range, one_of,
)
from finetune.config.peft import LoraInit, PeftConfig, PeftMethod, QuantType  # noqa: F401 - the peft group, re-exported


class AttnImpl(str, Enum, metaclass=Spelled):
    auto = "auto"
    flash_attention_2 = "flash_attention_2"
    sdpa = "sdpa"
    eager = "eager"


class Reference(str, Enum, metaclass=Spelled):
    precomputed = "precomputed"
    live = "live"
    adapter_disabled = "adapter_disabled"


class Precision(str, Enum, metaclass=Spelled):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    bf16_pure = "bf16_pure"


class Fp8Scaling(str, Enum, metaclass=Spelled):
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class Qat(str, Enum, metaclass=Spelled):
    int4_weight = "int4_weight"
    int8_dynamic_int4_weight = "int8_dynamic_int4_weight"
    int3_weight = "int3_weight"
    int2_weight = "int2_weight"


class Offload(str, Enum, metaclass=Spelled):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class Checkpointing(str, Enum, metaclass=Spelled):
    none = "none"
    full = "full"
    selective = "selective"
    offload = "offload"
    ops = "ops"
    full_offload = "full_offload"


class Logits(str, Enum, metaclass=Spelled):
    full = "full"
    chunked = "chunked"


class LogitsKernel(str, Enum, metaclass=Spelled):
    auto = "auto"
    torch = "torch"
    cce = "cce"
    liger = "liger"


class Kernels(str, Enum, metaclass=Spelled):
    none = "none"
    liger = "liger"


class Strategy(str, Enum, metaclass=Spelled):
    single = "single"
    ddp = "ddp"
    fsdp = "fsdp"


class PipeSchedule(str, Enum, metaclass=Spelled):
    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved_1f1b = "interleaved_1f1b"


class StateDtype(str, Enum, metaclass=Spelled):
    fp32 = "fp32"
    bf16 = "bf16"


class OptimKernel(str, Enum, metaclass=Spelled):
    auto = "auto"
    fused = "fused"
    foreach = "foreach"
    loop = "loop"


OPTIMIZER = Accepts(optimizers.WORDS, lambda v: optimizers.known(v), ("lion", "torch.optim."))
"""optim.name: a record of finetune/optimizers/, or a torch.optim class by its dotted name."""


LOGGERS = Accepts(f"a list of known loggers ({', '.join(logs.SINKS)})", lambda v: all(x in logs.SINKS for x in v), ("[comet]",))
"""train.loggers: names of finetune/logs/__init__.py's SINKS; jsonl is added when not named (TrainConfig: metrics.jsonl feeds the
summary and the plot)."""


class Scheduler(str, Enum, metaclass=Spelled):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class LauncherName(str, Enum, metaclass=Spelled):
    auto = "auto"
    torchrun = "torchrun"
    deepspeed = "deepspeed"


class NonFinite(str, Enum, metaclass=Spelled):
    stop = "stop"
    skip = "skip"


class Device(str, Enum, metaclass=Spelled):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class MemoryReport(str, Enum, metaclass=Spelled):
    peak = "peak"
    categories = "categories"
    off = "off"


MEMORY_REPORT_BOOLS = {"true": MemoryReport.categories, "false": MemoryReport.off}
"""train.memory_report was true/false (true measured by category, the old default): both still mean what they did."""
MEMORY_REPORTS = Accepts("one of peak, categories, off (true: categories, false: off)",
                         lambda v: isinstance(v, MemoryReport), ("all",))


# ---------------------------------------------------------------------------------------------
# Groups


@dataclass
class ModelInit:
    """Architecture of a randomly initialised model (no download); a transformers config."""

    model_type: str = checked(TEXT, "llama")
    """Any `transformers` model type that `AutoConfig.for_model` knows (llama, qwen2, mistral...)."""
    hidden_size: int = checked(at_least(1), 128)
    """Width of the residual stream (embedding size)."""
    intermediate_size: int = checked(at_least(1), 384)
    """Width of each block's MLP."""
    num_hidden_layers: int = checked(at_least(1), 2)
    """Transformer blocks."""
    num_attention_heads: int = checked(at_least(1), 4)
    """Query heads per attention layer."""
    num_key_value_heads: int = checked(at_least(1), 2)
    """Key/value heads per attention layer (fewer than num_attention_heads: grouped-query attention)."""
    max_position_embeddings: int = checked(at_least(1), 512)
    """Longest sequence the model takes (data.max_length may not exceed it)."""
    tie_word_embeddings: bool = False
    """Share one matrix between the input embedding and the output head."""
    vocab_size: int | None = checked(at_least(1), None)
    """Rows of the embedding and the output head; null: the tokenizer's size. Larger leaves the extra
    rows unused (e.g. a realistic 32k or 128k vocabulary for memory measurements)."""
    seed: int = checked(at_least(0), 0)
    """Seed of the random initialisation (the same on every rank)."""


VISION_PARTS = ("vision", "projector", "language")
"""A vision-language model's parts (finetune/rank/vision.py finds them in the built model)."""
PARTS = Accepts(f"a list of {', '.join(VISION_PARTS)}", lambda v: all(str(x) in VISION_PARTS for x in v) and len(set(v)) == len(v),
                ("[tower]", "[vision,vision]"))


@dataclass
class ModelConfig:
    path: str | None = checked(TEXT, None)
    """Hub id or local directory of pretrained weights; null: random init from `init`."""
    init: ModelInit | None = None
    """Architecture for a random-init model; only when `path` is null."""
    tokenizer: str | None = checked(TEXT, None)
    """Hub id or local directory of the tokenizer; null: the same as `path`."""
    attn_implementation: AttnImpl = AttnImpl.auto
    """flash_attention_2 (CUDA, fp16/bf16, the `gpu` extra), sdpa (PyTorch's fused attention),
    eager (plain matmuls), or auto: the first of these three that the model's family and the
    device can run (Gemma-2 soft-caps its attention logits: no sdpa); the launch says which and why,
    and a kernel the family cannot run is refused before launch."""
    kernels: Kernels = Kernels.none
    """none: the family's own modules; liger: Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU (GeGLU for Gemma) swapped
    into the loaded model before PEFT and the layout wrap it, the weights and their names unchanged (the `gpu` extra;
    CUDA only, a family Liger patches, not with parallelism.tp; its fused loss is logits.kernel=liger)."""
    revision: str | None = checked(TEXT, None)
    """Hub revision (branch, tag or commit) for `path` and `tokenizer`."""
    trust_remote_code: bool = False
    """Let `transformers` run model/tokenizer code that ships with a hub repository."""
    from_scratch: bool = False
    """Random weights built from `path`'s config.json (seed 0, the same on every rank), with its tokenizer and processor:
    no weight file is read (LLaMA-Factory's train_from_scratch). Any model type, a vision-language one included; for a
    text architecture given key by key, use model.init."""
    recipe_if_missing: str | None = checked(TEXT, None)
    """When `path` is a local directory that does not exist yet: the recipe whose run makes it
    (run first, in `path`'s parent directory, which must be RUN_DIR/final of that run)."""
    freeze: list[str] | None = checked(PARTS, None)
    """The parts of a vision-language model kept frozen: vision (the vision tower), projector, language (the language
    model); null: the vision tower, as the peers train them; []: none. A text model has none of them (refused)."""
    architecture: dict[str, Any] = checked(ARCHITECTURE, factory=dict, hint="e.g. the keys in recipes/model/llama3_1_8b.yaml")
    """The model's config.json keys the planner and the layout checks need (model_type, sizes,
    head_dim, biases, experts, tie_word_embeddings...), for a hub id the launcher cannot read
    offline ({}: none); a local `path`'s own config.json wins. The ranks refuse to train when the config
    they load differs from it in any of these keys."""


METHOD_CONFIGS: dict[str, type[MethodConfig]] = {}
"""Each method's config class by its name, registered by finetune.methods as it imports the methods (`to_config` and
`load` type the method group with it; the ConfigStore holds each as method/base_NAME)."""

METHOD_NAME = Accepts("a method's name (finetune.methods.METHODS)", lambda v: str(v) in METHOD_CONFIGS, ("dop",))


@dataclass
class MethodConfig:
    """The method group's base. Each method's own config subclasses it in its module (finetune/methods/NAME.py: DpoConfig,
    GrpoConfig, ...) with the keys that method reads; `method=NAME` composes that class, so a key of another method is an
    unknown key, refused naming the method's keys."""

    name: str = checked(METHOD_NAME, "sft")
    """The training method, chosen with method=NAME (which brings its keys): sft, dpo, kto, orpo, reward, grpo,
    rloo, distill (finetune.methods.METHODS)."""


def method_schema(name: Any) -> type[MethodConfig]:
    """The config class of method `name`: ConfigError naming the methods where none has that name."""
    if not METHOD_CONFIGS:
        raise RuntimeError("no method config is registered: import finetune.methods first (it registers each method's config)")
    found = METHOD_CONFIGS.get(str(name))
    if found is None:
        raise ConfigError(f"method.name={name} must be one of {', '.join(METHOD_CONFIGS)}{did_you_mean(str(name), list(METHOD_CONFIGS))} "
                          "(choose the method with method=NAME)")
    return found


@dataclass
class PrecisionConfig:
    name: Precision = Precision.fp32
    """fp32; bf16 (fp32 master weights; autocast, or under parallelism=fsdp FSDP2's mixed precision: each unit
    gathered and computed in bf16, gradients reduce-scattered in fp32); fp16 (autocast + dynamic loss scaling); bf16_pure
    (weights, gradients and optimizer states all bf16, no fp32 master: 2 + 2 + 4 bytes/param with AdamW,
    + 2 for the Kahan compensation)."""
    kahan_sum: bool = True
    """bf16_pure: each update is added with Kahan summation (optimi's optimizers: a bf16 compensation buffer
    per parameter, 2 bytes), so updates smaller than bf16's resolution accumulate instead of rounding away;
    false: plain bf16 updates (torchtune's default, 2 bytes/param less)."""
    initial_scale_power: int = checked(in_range(0, 32, step=1), 16)
    """fp16: the loss scale starts at 2**initial_scale_power."""
    loss_scale_window: int = checked(at_least(1), 1000)
    """fp16: steps without overflow before the scale doubles (it halves on every overflow)."""
    fp8: Fp8Scaling | None = None
    """bf16 only (precision=fp8 sets it): the linear layers' matmuls in FP8 (torchao's float8 training, finetune.rank.fp8)
    with tensorwise or rowwise scaling, the rest of the model in bf16 autocast; the output layer and layers whose sizes
    are not multiples of 16 stay bf16. Weights, gradients and optimizer states keep precision=bf16's dtypes. An NVIDIA
    GPU of compute capability 8.9 or newer (L4, RTX 4090, H100, H200, B200)."""
    fp8_on_cpu: bool = False
    """precision=fp8 only: let a CPU rank run it, through torch's CPU FP8 matmuls (the same e4m3/e5m2 casts and
    scales as on a GPU, accumulated by the CPU; no speed-up: slower than bf16), to check an FP8 recipe's numerics and
    layouts before a GPU run. False: FP8 on CPU is refused."""


@dataclass
class CheckpointingConfig:
    name: Checkpointing = Checkpointing.none
    """none; full (recompute every block in backward); selective (every k-th block);
    offload (keep saved activations in CPU memory instead of recomputing); ops (op-level selective recompute in
    every block: its matmuls' and attention's outputs kept, the pointwise ops and norms recomputed, no matmul run
    twice); full_offload (full recompute, each block's input held in CPU memory: about one block's activations on
    the GPU)."""
    every: int = checked(at_least(1), 2)
    """selective: recompute blocks 0, k, 2k, ... (k = every)."""


@dataclass
class LogitsConfig:
    name: Logits = Logits.full
    """full: the model's whole [tokens, vocab] logits, then the loss (fp32, ~12 bytes per vocabulary entry
    per token); chunked: the output layer and the loss per chunk of labelled tokens, recomputed in
    backward, so only one chunk's logits ever exist (the same loss and gradients)."""
    chunk_tokens: int = checked(at_least(1), 1024)
    """chunked: labelled tokens per chunk (memory of one chunk: ~(12 + 2 c) x vocab x chunk_tokens bytes)."""
    kernel: LogitsKernel = LogitsKernel.auto
    """chunked: torch (the chunks above, in torch), cce (cut-cross-entropy's fused Triton kernel, the `gpu` extra:
    the head's matmul and the loss in one, no chunk's logits in memory; CUDA only, exact gradients), liger
    (Liger-Kernel's fused linear cross-entropy, the `gpu` extra: the same fusion, in vocabulary-sized chunks of
    tokens; CUDA only, an output-layer bias included), or auto: cce where it can run (CUDA, installed, an output
    layer without a bias), else torch; each rank says which and why."""


@dataclass
class ZeroConfig:
    stage: int | None = checked(one_of(0, 1, 2, 3), None)
    """null: no DeepSpeed (the torch engine). 0-3: the DeepSpeed engine with this ZeRO stage
    (0 plain data parallel, 1 optimizer states sharded, 2 + gradients, 3 + parameters)."""
    offload_optimizer: Offload = Offload.none
    """Optimizer states (and the fp32 gradient copy) to cpu or nvme: stage 2 or 3."""
    offload_param: Offload = Offload.none
    """Parameters to cpu or nvme: stage 3 only."""
    nvme_path: str | None = checked(EXISTING_DIR, None)
    """Directory on a fast local disk for nvme offload."""
    pin_memory: bool = True
    """Page-locked CPU buffers for offload: faster copies, more locked RAM."""
    overlap_comm: bool = True
    """Overlap gradient reduction with the backward pass (costs bucket memory)."""
    contiguous_gradients: bool = True
    """Copy gradients into one buffer as they are produced: less fragmentation."""
    reduce_bucket_size: int = checked(at_least(1), 500_000_000)
    """Elements reduced at a time."""
    allgather_bucket_size: int = checked(at_least(1), 500_000_000)
    """Stages 1-2: elements all-gathered at a time after the step."""
    stage3_prefetch_bucket_size: int = checked(at_least(0), 50_000_000)
    """Stage 3: elements of upcoming parameters fetched ahead."""
    stage3_param_persistence_threshold: int = checked(at_least(0), 100_000)
    """Stage 3: parameters smaller than this stay unpartitioned (saves communication)."""
    stage3_max_live_parameters: int = checked(at_least(0), 1_000_000_000)
    """Stage 3: gathered parameters kept before releasing."""
    stage3_max_reuse_distance: int = checked(at_least(0), 1_000_000_000)
    """Stage 3: keep a parameter gathered if it is reused within this many parameters."""
    sub_group_size: int = checked(at_least(1), 1_000_000_000)
    """Stage 3: optimizer step granularity (lower it if the offloaded step runs out of memory)."""

    @property
    def enabled(self) -> bool:
        return self.stage is not None


@dataclass
class ParallelismConfig:
    strategy: Strategy = Strategy.single
    """How data-parallel ranks hold the model. single: one process; ddp: each holds a replica
    (gradients all-reduced); fsdp: FSDP2 `fully_shard`, each holds a shard of parameters,
    gradients and optimizer states (gathered per block for compute)."""
    tp: int = checked(at_least(1), 1)
    """Tensor-parallel degree: each block split over `tp` ranks by the family's transformers plan
    (DTensor); must divide the attention heads and key/value heads. Ranks of one TP group are adjacent."""
    pp: int = checked(at_least(1), 1)
    """Pipeline-parallel degree: the blocks split into `pp` stages (torch.distributed.pipelining);
    the data-parallel degree is world size / (tp x pp x cp)."""
    cp: int = checked(at_least(1), 1)
    """Context-parallel degree: every sequence's tokens split over `cp` ranks (DeepSpeed-Ulysses: an
    all-to-all gives each rank the whole sequence for 1/cp of the heads inside attention; everything else
    holds 1/cp of the tokens): for sequences whose activations do not fit one GPU. Must divide each tp
    rank's attention and key/value heads; the data-parallel degree is world size / (tp x pp x cp)."""
    pp_schedule: PipeSchedule = PipeSchedule.one_f_one_b
    """gpipe (all forwards, then all backwards), 1f1b (one forward one backward: less activation
    memory), interleaved_1f1b (`pp_stages_per_rank` stages per rank: a smaller bubble)."""
    pp_stages_per_rank: int = checked(at_least(1), 1)
    """Virtual stages per rank (interleaved_1f1b needs 2 or more). The pipeline's micro-batches
    are the step's micro-batches: train.micro_batch_size each, global batch / (micro batch x
    data-parallel degree) of them; the bubble is (stages - 1) / (micro-batches x virtual stages + stages - 1)."""
    fsdp_reshard_after_forward: bool = True
    """fsdp: free gathered parameters after each block's forward (gather again for backward):
    ZeRO-3-like memory; false keeps them until backward (ZeRO-2-like, less communication). The blocks' (and a
    vision-language model's tower and projector): the root unit (embeddings, final norm, output layer) is never
    resharded after forward, as torchtitan's is not: its forward spans every block's, so it is gathered through the
    whole forward anyway and backward starts with its output layer (resharding would free it for the loss only, to
    gather it again at once). A frozen reference or teacher, with no backward to free them, reshards every unit."""
    fsdp_offload: bool = False
    """fsdp: keep parameters, gradients and optimizer states in CPU memory (FSDP2 CPUOffloadPolicy)."""
    sequence_parallel: bool = True
    """tp > 1: sequence parallel (Korthikanti et al. 2022, as torchtitan lays it out): between the sublayers tensor
    parallel splits, the residual stream and the norms hold 1/tp of the sequence on each rank (the inputs of attention
    and the MLP all-gathered, o_proj's and down_proj's partial sums reduce-scattered), so their activations, and a
    checkpointed block's input, are 1/tp; the same communication volume. false keeps them whole on every rank. No
    effect without tp (finetune/rank/sequence.py)."""


@dataclass
class OptimConfig:
    name: str = checked(OPTIMIZER, "adamw")
    """adamw (decoupled weight decay), adam (weight decay added to the gradient: L2), sgd
    (optim.momentum 0: no optimizer state; > 0: one momentum buffer per parameter), adamw_8bit
    (bitsandbytes' AdamW8bit: both moments in 8 bits, blockwise-quantized, for tensors of 4,096+
    elements; smaller ones keep 32-bit states) or adafactor (torch.optim.Adafactor: no first moment, the
    second factored into a row and a column vector per matrix; betas and eps unused). Both run on every
    layout but DeepSpeed's: under FSDP/TP each rank steps its own shard (finetune.optimizers.sharded). muon:
    torch.optim.Muon on the hidden 2-D matrices (a momentum buffer each, optim.momentum) and AdamW on the embeddings,
    the output layer and the rest, at one rate (finetune.optimizers.muon; under FSDP/TP each matrix's update is
    orthogonalised whole). Or a torch.optim
    class by name (torch.optim.NAdam, torch.optim.RAdam): built with the optim.* keys its constructor takes, torch engine
    only (parallelism=single or ddp). Each is a record in finetune/optimizers/."""
    lr: float = checked(POSITIVE, 1e-4)
    """Peak learning rate (after warmup)."""
    weight_decay: float = checked(at_least(0), 0.0)
    """Weight decay strength; not applied to biases and norm scales. adamw decays the weights directly; adam and sgd add
    weight_decay * w to the gradient (L2), so Adam rescales it like the gradient."""
    betas: list[float] = checked(BETAS, factory=lambda: [0.9, 0.999])
    """adam/adamw: decay rates of the gradient mean and of its square; unused by sgd."""
    eps: float = checked(POSITIVE, 1e-8)
    """adam/adamw: added to the denominator; unused by sgd."""
    momentum: float = checked(PROBABILITY, 0.0, hint="0 for plain SGD, e.g. 0.9 with momentum")
    """sgd only, in [0, 1): 0 plain SGD, 0.9 the usual heavy-ball momentum (adam/adamw use betas)."""
    scheduler: Scheduler = Scheduler.cosine
    """cosine or linear decay after warmup, or constant."""
    warmup_steps: int = checked(at_least(0), 0)
    """Steps of linear warmup from 0 to lr (must be below train.max_steps, or the steps train.epochs makes)."""
    min_lr_ratio: float = checked(in_range(0, 1), 0.0)
    """Cosine decays to lr * min_lr_ratio."""
    loraplus_lr_ratio: float | None = checked(POSITIVE, None)
    """LoRA+ (with peft): the adapters' B matrices (lora_B) learn at optim.lr x this (the paper suggests 16), the rest
    at optim.lr: separate parameter groups, so every optimizer and engine gets it; null: one rate."""
    max_grad_norm: float | None = checked(POSITIVE, 1.0)
    """Clip the global gradient norm to this; null: no clipping."""
    state_dtype: StateDtype | None = None
    """adam/adamw: the dtype the two moments are stored in; null: the parameters' (fp32, bf16 under
    precision=bf16_pure). bf16 over fp32 weights: 4 bytes/param of states instead of 8; each step reads the
    moments up to fp32, updates them and the weights in fp32, and rounds the moments back to bf16."""
    kernel: OptimKernel = OptimKernel.auto
    """How torch's adamw, adam and sgd run their update: fused (one kernel over every parameter, on CPU and CUDA, plain
    tensors and DTensor shards alike; measured on CPU, 10M parameters: 7.7 ms a step against 41 for loop), foreach
    (torch's multi-tensor ops), loop (one parameter at a time: torch's CPU default). The same update within float
    rounding (fused vs loop: at most 1 ulp a step; a test checks). auto: fused where every parameter is on a CPU or
    CUDA device, else torch's own default; the loop under tensor parallel (its shards and its plain tensors
    cannot share one fused or foreach call). The other optimizers, optimi's (bf16_pure), optim.state_dtype=bf16 and
    DeepSpeed's run their own kernels: an explicit kernel with them is refused."""
    in_backward: bool = False
    """Step each parameter inside backward, as soon as its gradient is complete, and free that gradient at
    once (torch's register_post_accumulate_grad_hook): gradients never exist for the whole model together.
    Needs one micro-batch per step and no global clipping (optim.max_grad_norm=null); torch engine, one rank."""

    def __post_init__(self) -> None:
        # A str field, not an enum: it also takes a torch.optim class by name. A built-in name is read as users spell
        # it (AdamW, adamw-8bit), as the enums are.
        self.name = optimizers.spelled(self.name)


@dataclass
class LauncherConfig:
    name: LauncherName = LauncherName.auto
    """torchrun, or auto (torchrun until a backend needs another launcher)."""
    nproc_per_node: int = checked(at_least(1), 1)
    """Processes (ranks) per node: one per GPU, or per CPU process group member."""
    nnodes: int = checked(at_least(1), 1)
    """Nodes in the job; every node runs the same command (see launch/README.md)."""
    node_rank: int = checked(at_least(0), 0)
    """This node's rank in [0, nnodes) for the static rendezvous (not with rdzv_endpoint)."""
    master_addr: str = checked(TEXT, "127.0.0.1")
    """Static rendezvous: address of node 0, reachable from every node."""
    master_port: int | None = checked(PORT, None)
    """Static rendezvous port on node 0; null on a single node: torchrun --standalone picks a free port."""
    rdzv_endpoint: str | None = checked(HOST_PORT, None, hint="the same on every node, e.g. launcher.rdzv_endpoint=10.0.0.1:29400")
    """torchrun: HOST:PORT of a c10d dynamic rendezvous (--rdzv_backend=c10d; port 29400 if omitted), the
    same on every node, instead of the static node_rank/master_addr/master_port; the rendezvous assigns
    node ranks. HOST is one of the job's nodes (it serves the rendezvous store)."""
    rdzv_id: str = checked(TEXT, "finetune", hint="give every node of the job the same id, e.g. launcher.rdzv_id=job42")
    """torchrun with rdzv_endpoint: the job id (--rdzv_id) every node of one job shares."""
    omp_num_threads: int | None = checked(at_least(1), None)
    """Threads per rank; null: OMP_NUM_THREADS if the launching environment sets it, else CPU cores / nproc_per_node."""
    env: dict[str, str] = checked(ENV, factory=dict)
    """Extra environment variables for every rank."""
    hostfile: str | None = checked(EXISTING_FILE, None)
    """deepspeed: hostfile ('host slots=N' lines) for multi-node jobs."""
    no_ssh: bool = False
    """deepspeed: start this node's ranks only (run once per node with launcher.node_rank), no ssh."""
    dry_run: bool = False
    """Print the resolved config and the exact command, start nothing."""
    devices_per_trial: int | None = checked(at_least(1), None)
    """Devices of this node the launch takes for itself (GPUs; CPU cores on a machine without one), so that a sweep's
    trials run side by side (hydra/launcher=joblib or submitit_local), each on its own: the ranks see only those
    (CUDA_VISIBLE_DEVICES, deepspeed --include, taskset on CPU), and a launch waits while the node has too few free.
    null: the launch uses every device (trials one at a time)."""


@dataclass
class PlanConfig:
    """The memory planner (`python -m finetune.plan`; the launcher runs it before every launch)."""

    suggest: bool = False
    """When the config does not fit: print the cheapest override sets that do (the launcher always does)."""
    suggestions: int = checked(at_least(1), 3)
    """How many fitting override sets to print."""
    force: bool = False
    """Launch even if the plan says the config does not fit the hardware (the plan is still printed)."""
    simulate: bool = False
    """python -m finetune.plan only: also run the config's real step (model, strategies, layout, optimizer) under
    torch's FakeTensorMode over a fake process group of the run's world size, in a child process, and print its
    measured memory per category beside the formula's (finetune/rank/simulate.py; about a minute for an 8B model)."""


@dataclass
class HardwareConfig:
    """The machine the memory plan is checked against: `python -m finetune.plan`, and the launcher
    before it starts anything (hardware=cpu by default: CPU ranks sharing the node's RAM)."""

    name: str = checked(TEXT, "cpu")
    """A label for the hardware, printed by the planner."""
    gpu_memory_gib: float = checked(at_least(0), 0.0)
    """Memory of one accelerator in GiB (2^30 bytes); 0: no GPU, the ranks run on CPU and share
    cpu_memory_gib."""
    gpus_per_node: int = checked(at_least(1), 1)
    """Accelerators per node: with gpu_memory_gib > 0, launcher.nproc_per_node may not exceed it
    (the number of nodes is launcher.nnodes)."""
    cpu_memory_gib: float = checked(POSITIVE, 64.0)
    """CPU RAM per node in GiB: holds offloaded optimizer states/parameters/activations
    (hardware=cpu reads this machine's RAM: `${machine_ram_gib:}`)."""
    nvme_gib: float = checked(at_least(0), 0.0)
    """Local NVMe space per node in GiB for zero.offload_*=nvme (0: none)."""
