"""The typed config: one dataclass per group, registered in Hydra's ConfigStore, plus the
cross-group rules that no single group can check.

Every group YAML starts with `defaults: [base_<group>]`, so a typo (`optim.lrr=...`) or a wrong
type (`optim.lr=fast`) fails when Hydra composes, naming the key. `validate` then checks what
spans groups (batch sizes vs. launch size, options that need each other) and raises
`ConfigError` with one line that names the keys and says what to do.

This module imports no torch: the launcher and a dry run stay instant.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum, EnumMeta
from pathlib import Path
from typing import Any, Callable

from omegaconf import MISSING, DictConfig, OmegaConf

from finetune import logs, optimizers

ASSETS = Path(__file__).resolve().parent / "assets"


class ConfigError(ValueError):
    """A user mistake in the config: the message is one line that says what to change."""


# ---------------------------------------------------------------------------------------------
# What each field accepts: declared beside the field, checked when the config is composed


@dataclass(frozen=True)
class Accepts:
    """A field's constraint: `ok(value)`, and the words that complete "KEY=VALUE must be ...".

    `outside` holds values just outside what is accepted, as typed on the command line: the
    schema test composes each one and expects the refusal to name the key."""

    words: str
    ok: Callable[[Any], bool]
    outside: tuple[str, ...] = ()


def at_least(n: int) -> Accepts:
    return Accepts(f"at least {n}" if n else "0 or more", lambda v: v >= n, (str(n - 1),))


def in_range(lo: float, hi: float, *, hi_open: bool = False, step: float = 0.01) -> Accepts:
    """A number in [lo, hi] (or [lo, hi) with hi_open); `step`: how far outside the test goes."""
    close = ")" if hi_open else "]"
    return Accepts(f"in [{lo:g}, {hi:g}{close}", lambda v: lo <= v < hi if hi_open else lo <= v <= hi,
                   (f"{lo - step:g}", f"{hi:g}" if hi_open else f"{hi + step:g}"))


def unused(section: Any, key: str, used: tuple[str, ...], why: str) -> None:
    """Refuse fields of `section` (the group `key`) set away from their defaults where the chosen option ignores
    them (the cross-group rules call it: finetune.rules, finetune.methods)."""
    default = type(section)()
    for f in fields(section):
        if f.name not in used and getattr(section, f.name) != getattr(default, f.name):
            value = getattr(section, f.name)
            shown = str(value).lower() if isinstance(value, bool) else getattr(value, "value", value)  # as typed on the command line
            raise ConfigError(f"{key}.{f.name}={shown} has no effect {why}: remove it or change the option")


def one_of(*values: int) -> Accepts:
    return Accepts(f"one of {', '.join(map(str, values))}", lambda v: v in values, (str(max(values) + 1),))


POSITIVE = Accepts("positive", lambda v: v > 0, ("0",))
PROBABILITY = in_range(0, 1, hi_open=True)
PORT = Accepts("a port in [1, 65535]", lambda v: 0 < v < 65536, ("0", "65536"))
TEXT = Accepts("non-empty text", lambda v: bool(str(v).strip()), ("''",))
SOURCES = Accepts("a path or hub id, or a list of sources", lambda v: isinstance(v, list) and bool(v) or isinstance(v, str) and bool(v.strip()),
                  ("''", "[]"))
ANY_TEXT = Accepts("any text", lambda v: True)
NAMES = Accepts("a list of names", lambda v: all(str(x).strip() for x in v), ("['']",))
SOME_NAMES = Accepts("a non-empty list of names", lambda v: len(v) > 0 and NAMES.ok(v), ("[]",))
ENV = Accepts("NAME: value pairs, each NAME a variable name ([A-Za-z_][A-Za-z0-9_]*)",
              lambda v: all(re.fullmatch(r"[A-Za-z_]\w*", str(k)) for k in v), ("{A-B:x}",))
BETAS = Accepts("two numbers, each in [0, 1)", lambda v: len(v) == 2 and all(PROBABILITY.ok(b) for b in v), ("[0.9]", "[0.9,1.0]"))
EXISTING_FILE = Accepts("an existing file", lambda v: Path(v).expanduser().is_file(), ("/nonexistent/file",))
EXISTING_DIR = Accepts("an existing directory", lambda v: Path(v).expanduser().is_dir(), ("/nonexistent/dir",))


def _host_port(value: str) -> bool:
    host, colon, port = value.rpartition(":") if ":" in value else (value, "", "")
    return bool(host) and (not colon or (port.isdigit() and 0 < int(port) < 65536))


ARCHITECTURE = Accepts("empty, or a mapping of the model's config.json keys that names its model_type",
                       lambda v: not v or bool(str(v.get("model_type") or "").strip()), ("{hidden_size:64}",))


HOST_PORT = Accepts("HOST or HOST:PORT (port in [1, 65535])", _host_port, ("host:0", ":29400"))


def checked(accepts: Accepts, default: Any = MISSING, *, factory: Callable[[], Any] | None = None, hint: str = "") -> Any:
    """A dataclass field with its constraint (null is always allowed where the type allows it);
    `hint` follows the refusal after a colon: what a right value looks like for this field."""
    meta = {"accepts": accepts, "hint": hint}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def check_fields(node: Any, prefix: str = "") -> None:
    """Refuse the first field value its constraint rejects: `KEY=VALUE must be WORDS`."""
    for f in fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            check_fields(value, f"{key}.")
        elif value is not None and "accepts" in f.metadata and not f.metadata["accepts"].ok(value):
            shown = "''" if value == "" else value
            hint = f": {f.metadata['hint']}" if f.metadata["hint"] else ""
            raise ConfigError(f"{key}={shown} must be {f.metadata['accepts'].words}{hint}")


def machine_ram_gib() -> float:
    """This machine's physical RAM in GiB (for hardware=cpu: plan against what is really there)."""
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


OmegaConf.register_new_resolver("machine_ram_gib", machine_ram_gib, replace=True)
# `${asset:tokenizer}` in a YAML file is the absolute path of a file the package ships.
OmegaConf.register_new_resolver("asset", lambda rel: str(ASSETS / rel), replace=True)


# ---------------------------------------------------------------------------------------------
# Enumerations. OmegaConf looks members up by name (`Enum[name]`); `Spelled` lets that lookup take
# the spellings users type: any case, '-' for '_', the value (`1f1b`) or a common alias (`bfloat16`).


ENUM_ALIASES: dict[str, dict[str, str]] = {
    "Precision": {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"},
    "AttnImpl": {"flash": "flash_attention_2", "flash_attn": "flash_attention_2", "fa2": "flash_attention_2"},
    "PipeSchedule": {"interleaved": "interleaved_1f1b"},
}
"""Other words users type for an enum's value, by enum class name."""


def spelling(word: str) -> str:
    return word.strip().lower().replace("-", "_")


class Spelled(EnumMeta):
    def __getitem__(cls, name: str) -> Any:
        members = cls.__members__
        if name in members:
            return members[name]
        spelled = {spelling(n): m for n, m in members.items()} | {spelling(m.value): m for m in members.values()}
        spelled |= {spelling(a): cls(v) for a, v in ENUM_ALIASES.get(cls.__name__, {}).items()}
        if isinstance(name, str) and spelling(name) in spelled:
            return spelled[spelling(name)]
        raise KeyError(name)


class AttnImpl(str, Enum, metaclass=Spelled):
    auto = "auto"
    flash_attention_2 = "flash_attention_2"
    sdpa = "sdpa"
    eager = "eager"


class DataFormat(str, Enum, metaclass=Spelled):
    auto = "auto"
    alpaca = "alpaca"
    chat = "chat"
    sharegpt = "sharegpt"
    completion = "completion"
    text = "text"
    preference = "preference"


class Template(str, Enum, metaclass=Spelled):
    auto = "auto"
    tokenizer = "tokenizer"
    builtin = "builtin"


class LongPrompt(str, Enum, metaclass=Spelled):
    drop = "drop"
    error = "error"


class Method(str, Enum, metaclass=Spelled):
    sft = "sft"
    dpo = "dpo"


class DpoLoss(str, Enum, metaclass=Spelled):
    sigmoid = "sigmoid"
    ipo = "ipo"
    hinge = "hinge"
    simpo = "simpo"


class Reference(str, Enum, metaclass=Spelled):
    precomputed = "precomputed"
    live = "live"
    adapter_disabled = "adapter_disabled"


class Precision(str, Enum, metaclass=Spelled):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    bf16_pure = "bf16_pure"


class Offload(str, Enum, metaclass=Spelled):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class Checkpointing(str, Enum, metaclass=Spelled):
    none = "none"
    full = "full"
    selective = "selective"
    offload = "offload"


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


class PeftMethod(str, Enum, metaclass=Spelled):
    none = "none"
    lora = "lora"
    qlora = "qlora"
    dora = "dora"


class QuantType(str, Enum, metaclass=Spelled):
    nf4 = "nf4"
    fp4 = "fp4"


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
"""optim.name: a record of finetune/optimizers.py, or a torch.optim class by its dotted name."""


LOGGERS = Accepts(f"a list of known loggers ({', '.join(logs.SINKS)}), {logs.REQUIRED} among them",
                  lambda v: all(x in logs.SINKS for x in v) and logs.REQUIRED in v, ("[wandb]", "[tensorboard]"))
"""train.loggers: names of finetune/logs.py's SINKS; jsonl always (metrics.jsonl feeds the summary and the plot)."""


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
    recipe_if_missing: str | None = checked(TEXT, None)
    """When `path` is a local directory that does not exist yet: the recipe whose run makes it
    (run first, in `path`'s parent directory, which must be RUN_DIR/final of that run)."""
    architecture: dict[str, Any] = checked(ARCHITECTURE, factory=dict, hint="e.g. the keys in recipes/model/llama3_1_8b.yaml")
    """The model's config.json keys the planner and the layout checks need (model_type, sizes,
    head_dim, biases, experts, tie_word_embeddings...), for a hub id the launcher cannot read
    offline ({}: none); a local `path`'s own config.json wins. The ranks refuse to train when the config
    they load differs from it in any of these keys."""


@dataclass
class DataConfig:
    train: Any = checked(SOURCES, MISSING)
    """A local .jsonl/.json file, a local dataset directory, or a hub dataset id; or a mixture: a list of
    those, each optionally {path, split, weight, rows}. `rows`: exactly that many rows of it (seeded
    sample; repeated past its size); `weight`: the weighted sources share their part of the mixture
    in these proportions, as many rows as that allows without repeating one."""
    eval: Any = checked(SOURCES, None)
    """The same forms as `train`; null: hold out `eval_size` rows of `train` instead."""
    eval_size: int = checked(at_least(0), 0)
    """Rows of `train` held out for evaluation when `eval` is null (0: no evaluation)."""
    train_split: str = checked(TEXT, "train")
    """Split to read from a dataset directory or hub id (ignored for .jsonl files)."""
    eval_split: str = checked(TEXT, "train")
    """Split to read from `eval` when it is a dataset directory or hub id."""
    format: DataFormat = DataFormat.auto
    """alpaca (instruction/input/output), chat (OpenAI-style messages: role/content, other keys ignored),
    sharegpt (conversations: from/value), completion (prompt/completion or question/answer), text (plain
    text for continued pre-training: every token is trained on, long rows split into max_length pieces),
    preference (prompt/chosen/rejected, for method=dpo), or auto: decided per row by its keys."""
    template: Template = Template.auto
    """tokenizer: its chat template; builtin: ours; auto: the tokenizer's if it has one."""
    system_prompt: str | None = checked(ANY_TEXT, None)
    """Prepended as a system message to rows that have none."""
    max_length: int = checked(at_least(1), 512)
    """Tokens per sample (per prompt+response for preference pairs); longer responses are cut at
    the end (and counted), the prompt is kept whole."""
    long_prompt: LongPrompt = LongPrompt.drop
    """Rows whose prompt leaves no room for a response token: drop (counted) or error."""
    packing: bool = False
    """Train on rows of several samples (up to max_length), each attending only to itself."""
    padding_free: bool | None = None
    """Lay each training micro-batch's rows end to end in one row instead of padding them to the longest: no
    compute on padding, each sample attending only to itself (the same loss). null: on for method=sft wherever
    it runs (not under pipeline or context parallel, not with one row per micro-batch); true: on, refused where
    it cannot run; false: padded rows. Evaluation batches are padded either way."""
    cache: bool = True
    """Tokenize once into Arrow files under `cache_dir`, keyed by everything that changes the tokens,
    and memory-map them on every rank (later launches with the same key skip tokenizing); false:
    tokenize in memory on every rank at every launch."""
    cache_dir: str | None = checked(TEXT, None)
    """Where tokenized data is cached; null: $FINETUNE_CACHE_DIR if set, else $XDG_CACHE_HOME/finetune/tokens
    (~/.cache/finetune/tokens)."""
    num_proc: int | None = checked(at_least(1), None)
    """Processes that tokenize a dataset into the cache (one per 1,000 rows at most); null: the node's cores."""
    streaming: bool = False
    """Read `train` as a stream, for a set larger than the disk cache: rows in a seeded shuffle-buffer order,
    tokenized on the fly by a DataLoader worker on every rank, no token cache (`cache` does not apply; the eval
    set, `eval` or the first `eval_size` rows of `train`, is tokenized in memory). Step k is still examples
    [kG, (k+1)G) of one order, a function of the seed, on any layout; a resume continues it. A mixture needs
    a weight on every source; packing packs each 1,000 rows."""
    shuffle_buffer: int | None = checked(at_least(1), None)
    """streaming: rows held in the shuffle buffer, each next row drawn from it by the seed; null: 10,000;
    1: the source's own order."""


@dataclass
class MethodConfig:
    name: Method = Method.sft
    """sft: cross-entropy on response tokens only. dpo: preference optimisation on
    (prompt, chosen, rejected) pairs, with the DPO-family loss `loss`."""
    loss: DpoLoss = DpoLoss.sigmoid
    """dpo: sigmoid (DPO), ipo (squared loss on length-averaged log-ratios), hinge (SLiC),
    simpo (reference-free, length-averaged log-probs, target margin `gamma`)."""
    beta: float | None = checked(POSITIVE, None)
    """dpo: inverse temperature of the implicit reward; null: 0.1, or 2.0 for simpo (the papers' values)."""
    gamma: float = checked(at_least(0), 1.0)
    """simpo: the target reward margin between chosen and rejected."""
    label_smoothing: float = checked(in_range(0, 0.5, hi_open=True), 0.0)
    """sigmoid/simpo: probability that a preference label is flipped (conservative DPO), in [0, 0.5)."""
    sft_weight: float = checked(at_least(0), 0.0)
    """dpo: weight of an added SFT loss on the chosen response (per-token mean; RPO-style)."""
    reference: Reference = Reference.precomputed
    """dpo: where the reference log-probs come from. precomputed: one no-grad pass of the initial
    policy over the data before training (no reference model in memory while training);
    live: a frozen copy of the initial model (sharded like the policy under ZeRO-3);
    adapter_disabled: with peft, the policy itself with its adapter switched off (no copy)."""

    @property
    def beta_value(self) -> float:
        if self.beta is not None:
            return self.beta
        return 2.0 if self.loss == DpoLoss.simpo else 0.1


@dataclass
class PrecisionConfig:
    name: Precision = Precision.fp32
    """fp32; bf16 (autocast, fp32 master weights); fp16 (autocast + dynamic loss scaling); bf16_pure
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


@dataclass
class CheckpointingConfig:
    name: Checkpointing = Checkpointing.none
    """none; full (recompute every block in backward); selective (every k-th block);
    offload (keep saved activations in CPU memory instead of recomputing)."""
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
    ZeRO-3-like memory; false keeps them until backward (ZeRO-2-like, less communication)."""
    fsdp_offload: bool = False
    """fsdp: keep parameters, gradients and optimizer states in CPU memory (FSDP2 CPUOffloadPolicy)."""


@dataclass
class PeftConfig:
    name: PeftMethod = PeftMethod.none
    """none (full fine-tuning), lora, dora (weight-decomposed LoRA), or qlora (LoRA on a 4-bit base)."""
    r: int = checked(at_least(1), 16)
    """Adapter rank."""
    alpha: int = checked(at_least(1), 32)
    """Scaling: the adapter's update is multiplied by alpha / r."""
    dropout: float = checked(PROBABILITY, 0.05)
    """Dropout on the adapter's input (lora_dropout)."""
    target_modules: list[str] = checked(SOME_NAMES, factory=lambda: ["all-linear"])
    """Module names to adapt (e.g. [q_proj,v_proj]); [all-linear]: every linear layer but the output head."""
    modules_to_save: list[str] = checked(NAMES, factory=list)
    """Modules trained fully and saved with the adapter (e.g. [lm_head,embed_tokens])."""
    quant_type: QuantType = QuantType.nf4
    """qlora: 4-bit data type of the frozen base."""
    double_quant: bool = True
    """qlora: quantize the quantization constants too (~0.4 bits/param less)."""


@dataclass
class OptimConfig:
    name: str = checked(OPTIMIZER, "adamw")
    """adamw (decoupled weight decay), adam (weight decay added to the gradient: L2), sgd
    (optim.momentum 0: no optimizer state; > 0: one momentum buffer per parameter), adamw_8bit
    (bitsandbytes' AdamW8bit: both moments in 8 bits, blockwise-quantized, for tensors of 4,096+
    elements; smaller ones keep 32-bit states) or adafactor (torch.optim.Adafactor: no first moment, the
    second factored into a row and a column vector per matrix; betas and eps unused). Both run on every
    layout but DeepSpeed's: under FSDP/TP each rank steps its own shard (finetune.engine.sharded). Or a torch.optim
    class by name (torch.optim.NAdam, torch.optim.RAdam): built with the optim.* keys its constructor takes, torch engine
    only (parallelism=single or ddp). Each is a record in finetune/optimizers.py."""
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
    """Steps of linear warmup from 0 to lr (must be below train.max_steps)."""
    min_lr_ratio: float = checked(in_range(0, 1), 0.0)
    """Cosine decays to lr * min_lr_ratio."""
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


@dataclass
class PlanConfig:
    """The memory planner (`python -m finetune.plan`; the launcher runs it before every launch)."""

    suggest: bool = False
    """When the config does not fit: print the cheapest override sets that do (the launcher always does)."""
    suggestions: int = checked(at_least(1), 3)
    """How many fitting override sets to print."""
    force: bool = False
    """Launch even if the plan says the config does not fit the hardware (the plan is still printed)."""


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


@dataclass
class TrainConfig:
    max_steps: int = checked(at_least(1), 100)
    """Optimizer steps."""
    micro_batch_size: int = checked(at_least(1), 8)
    """Samples per rank per forward/backward."""
    global_batch_size: int = checked(at_least(1), 32)
    """Samples per optimizer step over all ranks; accumulation = global / (micro x data-parallel)."""
    seed: int = checked(at_least(0), 42)
    """Data order; the same seed gives the same samples per step on any number of ranks."""
    eval_every: int = checked(at_least(0), 0)
    """Evaluate every N steps (0: only before and after training)."""
    eval_batch_size: int = checked(at_least(1), 32)
    """Samples per rank per forward in evaluation, exact match and the DPO reference pass."""
    exact_match_samples: int = checked(at_least(0), 0)
    """Eval rows scored by greedy generation (response == reference) before and after training."""
    max_new_tokens: int = checked(at_least(1), 64)
    """Generation length limit for exact match and the samples."""
    sample_prompts: int = checked(at_least(0), 0)
    """Generate for the first N eval prompts at each evaluation and log prompt, reference and output (metrics.jsonl rows
    of kind `sample`, a table in each tracker, text in TensorBoard); 0: off."""
    log_every: int = checked(at_least(1), 10)
    """Print a metrics line every N steps when there is no progress bar."""
    progress_bar: bool = True
    """A tqdm progress bar on the main rank (else a metrics line every log_every steps)."""
    loggers: list[str] = checked(LOGGERS, factory=lambda: ["jsonl", "tensorboard"],
                                 hint="jsonl writes RUN_DIR/metrics.jsonl, which the summary and the loss plot read; "
                                      "e.g. train.loggers=[jsonl,tensorboard]")
    """Where the metrics go (finetune/logs.py SINKS): jsonl (RUN_DIR/metrics.jsonl, always: the summary, the loss plot and
    the sweep summary read it), tensorboard (RUN_DIR/tensorboard), and the trackers wandb, mlflow, trackio
    (finetune/trackers.py; `pip install -e ".[track]"`, each configured by its own environment variables)."""
    group: str | None = checked(TEXT, None)
    """The trackers' group for this run (W&B group, MLflow parent run, trackio group); null: none, except that a
    sweep's trials get their sweep directory (the launcher sets it)."""
    tensorboard: bool | None = None
    """The older switch, still read: true adds tensorboard to train.loggers, false takes it out; null: as
    train.loggers says."""
    compile: bool = False
    """Compile each decoder layer in place (torch.compile, regional: one graph reused by every layer) for the
    training steps; evaluation and generation run eager. The first step (and each new shape) pays the
    compile time, reported apart as compile_s. CPU: inductor builds C++ with the system compiler."""
    memory_report: str = checked(MEMORY_REPORTS, "peak")
    """Measure memory over the first 2 steps: peak (the allocator's or the process's high-water mark, no cost), categories
    (parameters, gradients, optimizer, activations, with PyTorch's MemTracker: those steps run 2-3x slower) or off; printed
    beside the memory plan."""
    memory_snapshot: bool = False
    """CUDA only: write RUN_DIR/memory_snapshot.pickle of the first steps (open it at pytorch.org/memory_viz)."""
    save_every: int = checked(at_least(0), 0)
    """Save a resumable checkpoint every N steps into RUN_DIR/checkpoints (0: never; SIGTERM/SIGINT
    save one at the next step boundary in any case)."""
    keep_checkpoints: int = checked(at_least(0), 0)
    """Keep only the newest K complete checkpoints (0: keep all)."""
    on_nonfinite: NonFinite = NonFinite.stop
    """A step whose loss or gradient norm is inf/nan: stop (naming the step, weights untouched by
    it) or skip it (no update; counted as `nonfinite_skipped`). fp16's loss scaler skips overflowing
    gradients on its own either way."""
    resume: str | None = checked(TEXT, None)
    """null: start fresh; auto: the newest checkpoint in RUN_DIR/checkpoints (same hydra.run.dir),
    or start fresh if there is none; a path: that checkpoint directory."""
    overwrite: bool = False
    """Start over in a run directory that holds another run's checkpoints or final/: they (and its
    metrics and summary) are removed first. Without it (or train.resume) such a launch is refused."""
    device: Device = Device.auto
    """auto: cuda when available, else cpu."""

    def __post_init__(self) -> None:
        # A str field, not an enum: OmegaConf refuses a bool for an enum, and true/false are still accepted (MEMORY_REPORT_BOOLS).
        word = spelling(str(self.memory_report))
        with contextlib.suppress(KeyError):
            self.memory_report = MEMORY_REPORT_BOOLS.get(word) or MemoryReport[word]
        if self.tensorboard is not None:  # train.tensorboard=true/false, as before train.loggers
            others = [name for name in self.loggers if name != "tensorboard"]
            self.loggers = [*others, "tensorboard"] if self.tensorboard else others


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    method: MethodConfig = MISSING
    precision: PrecisionConfig = MISSING
    checkpointing: CheckpointingConfig = MISSING
    logits: LogitsConfig = MISSING
    zero: ZeroConfig = MISSING
    parallelism: ParallelismConfig = MISSING
    peft: PeftConfig = MISSING
    optim: OptimConfig = MISSING
    launcher: LauncherConfig = MISSING
    train: TrainConfig = MISSING
    hardware: HardwareConfig = MISSING
    """The machine the memory plan is checked against; the ranks themselves ignore it."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """The memory planner's switches (plan.suggest, plan.force)."""
    run_dir: str | None = checked(TEXT, None)
    """Where the run writes; null: Hydra's run directory (`hydra.run.dir`)."""

    @property
    def world_size(self) -> int:
        return self.launcher.nproc_per_node * self.launcher.nnodes

    @property
    def data_parallel_size(self) -> int:
        p = self.parallelism
        return max(1, self.world_size // (p.tp * p.pp * p.cp))

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size)


GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "method": MethodConfig,
    "precision": PrecisionConfig,
    "checkpointing": CheckpointingConfig,
    "logits": LogitsConfig,
    "zero": ZeroConfig,
    "parallelism": ParallelismConfig,
    "peft": PeftConfig,
    "optim": OptimConfig,
    "launcher": LauncherConfig,
    "train": TrainConfig,
    "hardware": HardwareConfig,
}


def uses_deepspeed(cfg: Config) -> bool:
    """The DeepSpeed engine runs when a ZeRO stage is set."""
    return cfg.zero.enabled


def engine_kind(cfg: Config) -> str:
    """deepspeed (a ZeRO stage), mesh (FSDP2 / tensor / pipeline parallel) or torch (single, DDP)."""
    p = cfg.parallelism
    if uses_deepspeed(cfg):
        return "deepspeed"
    return "mesh" if p.strategy == Strategy.fsdp or p.tp * p.pp * p.cp > 1 else "torch"


def register() -> None:
    """Store the schemas: `base_config` for the root, `base_<group>` in each group. Called by finetune.compose, which
    composes: a rank only reads its config.yaml and needs no Hydra (its import is ~0.2 s of the rank's start)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schema in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)


# ---------------------------------------------------------------------------------------------
# Typed config <-> YAML


def to_config(dcfg: DictConfig) -> Config:
    """Resolve a composed DictConfig into the typed `Config`.

    Goes through a plain container so that keys added with `+key=...` are checked against the
    schema too (merging two DictConfigs would let them through).
    """
    plain = OmegaConf.to_container(dcfg, resolve=True)
    plain.pop("hydra", None)
    merged = OmegaConf.merge(OmegaConf.structured(Config), plain)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def to_yaml(cfg: Config) -> str:
    """The config as YAML, as OmegaConf writes it (through plain values: twice as fast as a structured config)."""
    return OmegaConf.to_yaml(_plain(cfg))


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def load(path: str | Path) -> Config:
    """Read a resolved config.yaml (what the launcher wrote into the run directory)."""
    return to_config(OmegaConf.load(path))


def launcher_for(cfg: Config) -> LauncherName:
    """Which launcher `launcher=auto` means: deepspeed for the DeepSpeed engine, else torchrun."""
    if cfg.launcher.name != LauncherName.auto:
        return cfg.launcher.name
    return LauncherName.deepspeed if cfg.zero.enabled else LauncherName.torchrun


def __getattr__(name: str) -> Any:
    if name == "Optimizer":  # the built-in optimizer names as an enum, where they were defined before finetune/optimizers.py
        return optimizers.Optimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def did_you_mean(word: str, options: list[str], prefix: str = "") -> str:
    """" (did you mean 'PREFIXx'?)" for the option closest to `word`, or "" when none is close."""
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""
