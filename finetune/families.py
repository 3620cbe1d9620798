"""What differs between model families, read from a transformers config.json (a dict): the
parameters of every module, counted exactly as `AutoModelForCausalLM.from_config` builds them.

One code path counts every family. Most of what differs is a config key (head_dim,
tie_word_embeddings, num_local_experts / num_experts / n_routed_experts, moe_intermediate_size,
shared_expert_intermediate_size, n_shared_experts, which layers are sparse (mlp_layer_types,
first_k_dense_replace, mlp_only_layers...), kv_lora_rank for DeepSeek's latent attention); what a
family's config.json does not say is the small `Family` record below, keyed by model_type: which
key switches which bias (attention_bias, use_bias, mlp_bias... or always, as Qwen2's q/k/v), its
norms (RMSNorm, LayerNorm, none; q/k norms; how many per block), fused or plain projections and
their names, sinks and other small parameters (EXTRAS). FAMILIES are supported end to end;
COUNTED adds the decoders transformers has whose blocks the same records describe, and
tests/test_causal_lm_counts.py checks every one against `AutoModelForCausalLM.from_config` (meta
device) with each key its record reads flipped. Any other model_type is refused with the reason
(`uncountable`: encoder-decoder, other modalities' towers, state-space or linear-attention layers,
or no record), never counted as a guess.

Mixture-of-experts layers follow transformers 5: each layer's experts are two fused 3-D
parameters (gate_up_proj, down_proj) and the router a plain weight, none of them an nn.Linear.
LoRA reaches the experts through PEFT's `target_parameters` (`adapted`): all-linear adapts every
nn.Linear / Conv1D and the experts' stacks, not the router; bitsandbytes quantizes none of them.

Attention: which kernels a family cannot run (`attention_limits`) is read from the config (soft-capped
attention logits: sdpa has no soft-capping) and from the family record (what transformers publishes
as the model class's `_supports_sdpa` / `_supports_flash_attn`; tests check the two agree);
`pick_attention` chooses for model.attn_implementation=auto and refuses an explicit choice.

Pure arithmetic on the dict: no torch, no transformers.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from finetune.config import ConfigError

ALIASES = {
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
    "num_attention_heads": ("n_head", "n_heads", "num_heads"),
    "num_key_value_heads": ("num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "intermediate_size": ("n_inner", "ffn_dim", "ffn_hidden_size"),
    "hidden_size": ("n_embd", "d_model"),
    "max_position_embeddings": ("n_positions", "max_sequence_length", "max_seq_len", "seq_length"),
    "num_local_experts": ("num_experts", "n_routed_experts", "moe_num_experts"),
    "num_experts_per_tok": ("moe_topk", "moe_k"),
    "n_shared_experts": ("num_shared_experts", "moe_num_shared_experts"),
}
"""Other names of the same config.json keys in some families (transformers' `attribute_map`s: gpt2's
n_head/n_layer/n_embd/n_inner/n_positions, OPT's ffn_dim, MPT's n_heads/n_layers, Qwen-MoE's num_experts, Aria's moe_topk...)."""


def config_value(arch: dict[str, Any], key: str) -> Any:
    """`key` of a config.json, under its own name or a family's alias (ALIASES); None if absent."""
    if key == "num_key_value_heads" and arch.get("multi_query") is True and not arch.get("new_decoder_architecture"):
        return 1  # gpt_bigcode, falcon (whose new architecture reads num_kv_heads)
    for name in (key, *ALIASES.get(key, ())):
        if arch.get(name) is not None:
            return arch[name]
    if key == "intermediate_size" and config_value(arch, "hidden_size"):  # gpt2: n_inner null means 4 x n_embd
        return 4 * config_value(arch, "hidden_size") if "n_inner" in arch else None
    if key == "num_key_value_heads":
        return config_value(arch, "num_attention_heads")
    return None


@dataclass(frozen=True)
class Family:
    """What a family's config.json does not state (each a default a config key overrides where one exists)."""

    qkv_bias: bool | str = "attention_bias"
    """Biases on q/k/v (or the fused qkv): a constant (Qwen2: always), or the config.json key that says (absent: none)."""
    o_bias: bool | str = "attention_bias"
    """Bias on the attention's output projection: a constant or the config.json key that says."""
    mlp_bias: bool | str = "mlp_bias"
    """Biases on the MLP's linears (and a DeepSeek-style shared expert's): a constant or the config.json key that says."""
    o_square: bool = False
    """The attention's output projection maps hidden_size to hidden_size whatever the heads' width (Helium)."""
    qk_norm: str = ""
    """RMSNorm on queries and keys: "head" (head_dim wide, shared by heads: Qwen3, Gemma-3) or "full"
    (over all heads: OLMo-2; Cohere's per-head weights); "" none."""
    qk_norm_key: str = ""
    """The config.json key that switches the q/k norms on (Cohere's use_qk_norm); "": always there."""
    qk_norm_bias: bool = False
    """The q/k norms are LayerNorms with a bias (Persimmon, Phi)."""
    block_norms: int = 2
    """Norms of the residual stream per block (Gemma-2/3: pre/post attention and pre/post MLP: 4)."""
    parallel_key: str = ""
    """The config.json key under which attention and MLP read one norm in parallel (StableLM's
    use_parallel_residual): a block then has block_norms - 1."""
    post_norm_key: str = ""
    """The config.json key that adds post_norms norms to the block (HyperCLOVAX's use_post_norm); "": always there."""
    fused: bool = False
    """One qkv_proj instead of q/k/v (Phi-3, GPT-NeoX)."""
    mlp: str = "gated"
    """The MLP: "gated" (gate, up, down), "fused" (one gate_up and down: Phi-3, GLM) or "plain" (up, down)."""
    names: tuple[tuple[str, str], ...] = ()
    """Paths inside the block that differ from Llama's (LLAMA_NAMES), by role: q, k, v, o, qkv, gate, up, down, gate_up."""
    tied: bool = False
    """tie_word_embeddings when config.json does not say (transformers' default for the family)."""
    head_dim: int | None = None
    """head_dim when config.json does not say; None: hidden_size / num_attention_heads."""
    gpt2: bool = False
    """GPT-2's layout: Conv1D c_attn/c_proj/c_fc with biases, a plain (not gated) MLP, LayerNorms
    with biases, learned positions (max_position_embeddings x hidden_size)."""
    layer_norm: bool = False
    """LayerNorm (weight and bias) rather than RMSNorm (weight)."""
    norm_weight: bool = True
    """The norms have a weight (False: OLMo's parameter-free LayerNorm, nanochat's RMSNorm)."""
    final_norm: bool = True
    """A norm after the last block."""
    extras: tuple[str, ...] = ()
    """Parameters of a block outside its linears and norms, by kind (EXTRAS): attention sinks (one per head),
    DiffLlama's lambdas, BitNet's sub-norms, xIELU's two scalars."""
    head_bias: bool | str = False
    """The output head has a bias (Phi): a constant or the config.json key that says."""
    positions: int | None = None
    """Learned position embeddings: (max_position_embeddings + this) x hidden_size (OPT: 2 rows of offset); None: none."""
    router: str = "mlp.gate"
    """A MoE's router weight (its path inside the block, without .weight)."""
    experts: str = "mlp.experts"
    """A MoE's fused expert stacks (gate_up_proj, down_proj) live under this path."""
    expert_bias: bool = False
    """The router and the experts' stacks carry biases (GPT-OSS)."""
    shared: str = ""
    """DeepSeek-style shared experts: the path of their gated MLP, n_shared_experts x shared_width wide; "" none."""
    shared_width: str = "moe_intermediate_size"
    """The config.json key of one shared expert's width."""
    sdpa: bool = True
    """transformers runs the family with torch's scaled_dot_product_attention (its model class's
    `_supports_sdpa`; Gemma-2: False, its attention logits are soft-capped)."""
    flash: bool = True
    """transformers runs the family with flash-attn (its model class's `_supports_flash_attn`)."""
    post_norms: int = 0
    """How many of block_norms normalise a sublayer's output rather than its input (OLMo-2: both of
    its two; Gemma-2/3: two of four): what the planner's activation count reads."""
    norm_fp32: bool = False
    """The RMSNorm keeps its normalised input in fp32 for the weight's gradient (Gemma's (1 + w) x,
    OLMo-2's w x before the cast back), rather than in the input's dtype (Llama's w x.to(dtype))."""
    act: str = "silu"
    """The MLP's activation when config.json names none (hidden_act, hidden_activation, activation_function)."""
    dropout: float = 0.0
    """Attention, residual and embedding dropout when config.json names none (GPT-2: 0.1 each)."""
    softcap: tuple[float, float] = (0.0, 0.0)
    """(attention, final) logit soft-capping when config.json names none (Gemma-2: 50, 30)."""
    tp_plan: bool = True
    """transformers publishes a tensor-parallel plan for the family (its config's base_model_tp_plan), which
    the ranks apply (finetune/parallel.py); False: tensor parallel is refused before launch (GPT-2's
    fused Conv1D layers have none). tests/test_families_parallel.py checks it against transformers."""
    pp_plan: bool = True
    """transformers publishes a pipeline plan (base_model_pp_plan: the modules before and after the
    blocks), which pipeline stages follow; False: pipeline parallel is refused before launch."""


LLAMA_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "qkv": "self_attn.qkv_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
               "gate_up": "mlp.gate_up_proj"}
"""Each linear's path inside a block, by role, as Llama (and most families) name them."""

EXTRAS = {"sinks": lambda h, heads, head_dim, i, experts: heads, "lambdas": lambda h, heads, head_dim, i, experts: 4 * head_dim,
          "sub_norms": lambda h, heads, head_dim, i, experts: h + i, "xielu": lambda h, heads, head_dim, i, experts: 2,
          "score_bias": lambda h, heads, head_dim, i, experts: experts}
"""Parameters of one block outside its linears and norms, by kind, from (hidden, heads, head_dim, MLP width,
routed experts: 0 in a dense block): attention sinks (a logit per head: GPT-OSS), DiffLlama's four head_dim
lambdas, BitNet's norms inside attention (hidden) and MLP (its width), Apertus' xIELU activation (two
scalars), a router's score correction bias (one per expert: ERNIE-4.5-MoE)."""

FAMILIES: dict[str, Family] = {
    "llama": Family(), "mistral": Family(), "mixtral": Family(), "granite": Family(),
    "qwen2": Family(qkv_bias=True, o_bias=False), "qwen2_moe": Family(qkv_bias=True, o_bias=False),
    "qwen3": Family(qk_norm="head", head_dim=128), "qwen3_moe": Family(qk_norm="head"),
    "gemma": Family(tied=True, head_dim=256, norm_fp32=True, act="gelu_pytorch_tanh"),
    "gemma2": Family(block_norms=4, tied=True, head_dim=256, post_norms=2, norm_fp32=True, act="gelu_pytorch_tanh",
                     softcap=(50.0, 30.0), sdpa=False),
    "gemma3_text": Family(qk_norm="head", block_norms=4, tied=True, head_dim=256, post_norms=2, norm_fp32=True,
                          act="gelu_pytorch_tanh"),
    "olmo2": Family(qk_norm="full", post_norms=2, norm_fp32=True),
    "phi3": Family(fused=True, mlp="fused"),
    "gpt2": Family(gpt2=True, tied=True, layer_norm=True, mlp="plain", positions=0, qkv_bias=True, o_bias=True, mlp_bias=True,
                   act="gelu_new", dropout=0.1, tp_plan=False, pp_plan=False),
}
"""The families supported end to end (loader, layouts, attention kernels, the family matrix); the
planner counts each exactly (tests/test_family_params.py builds each and compares with numel)."""

@dataclass(frozen=True)
class Linear:
    """One weight matrix (and bias) of a block: `name` is its path inside the block."""

    name: str
    inputs: int
    outputs: int
    bias: bool = False
    experts: int = 1
    """> 1: the experts' weights, one fused 3-D parameter (not an nn.Linear: PEFT adapts it through
    target_parameters, one r-rank pair per expert; bitsandbytes does not quantize it)."""
    adaptable: bool = True
    """An nn.Linear / Conv1D module: PEFT's target_modules adapt it and bitsandbytes quantizes it. False:
    a weight of another module (a MoE's router, its experts), which only target_parameters reach."""

    @property
    def params(self) -> int:
        return self.experts * (self.inputs * self.outputs + (self.outputs if self.bias else 0))


NORM_TOPK_DEFAULT = {"qwen2_moe": False, "qwen3_moe": False, "olmoe": False}
"""transformers' default of norm_topk_prob where a family's config has the key (a config.json may leave it
out); Mixtral has none and always renormalises."""


@dataclass(frozen=True)
class Moe:
    """A sparse MLP: each token goes to top_k of `experts` experts of `width`, chosen by a router."""

    experts: int
    top_k: int
    width: int
    normalized: bool = True
    """The top-k routing weights are renormalised to sum to one (Mixtral; norm_topk_prob)."""


@dataclass(frozen=True)
class Block:
    """One decoder block: its linears (attention, MLP or experts) and its norms' parameters."""

    linears: tuple[Linear, ...]
    norms: int
    mlp_width: int
    """The MLP width one token's activations have (MoE: its top-k experts' and the shared expert's)."""
    roles: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False, hash=False)
    """Linears by what they read: qkv (the normed stream), o (attention output), up (the normed
    stream, MLP side: a MoE's router and shared expert), down (the MLP activation): for the activation count."""
    moe: Moe | None = None
    """The routed experts of a sparse block (their linears are `experts` > 1)."""

    @property
    def params(self) -> int:
        return sum(lin.params for lin in self.linears) + self.norms

    def role(self, name: str) -> tuple[Linear, ...]:
        """The linears that read one input: qkv, o, up or down."""
        return tuple(lin for lin in self.linears if lin.name in self.roles.get(name, ()))

    @property
    def linear_params(self) -> int:
        return sum(lin.params for lin in self.linears)


@dataclass(frozen=True)
class Arch:
    """A decoder-only model as the planner counts it: every block's modules, the embeddings and the head."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    layers: tuple[Block, ...]
    final_norm: int
    positions: int = 0
    """Learned position embeddings (GPT-2): max_position_embeddings x hidden_size."""
    head_bias: int = 0
    """The output head's bias (vocab_size; 0: none)."""
    known: bool = True
    """Whether model_type is one of FAMILIES (supported end to end: its module names are checked against
    peft.target_modules before launch); else one COUNTED lists for its count only."""
    attention: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    """The attention kernels this model cannot run, with the reason (attention_limits)."""
    family: Family = field(default=Family(), compare=False)
    """The family record it was read with (norm placement and dtype, GPT-2's layout...): for the activation count."""
    act: str = "silu"
    """The MLP's activation function (hidden_act)."""
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    """Dropout on each sublayer's output before the residual add (resid_pdrop)."""
    embedding_dropout: float = 0.0
    attn_softcap: float = 0.0
    """tanh soft-capping of the attention logits (attn_logit_softcapping); 0: none."""
    final_softcap: float = 0.0
    """tanh soft-capping of the output logits (final_logit_softcapping); 0: none."""

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.num_key_value_heads

    @property
    def q_dim(self) -> int:
        return self.head_dim * self.num_attention_heads

    @property
    def block(self) -> Block:
        """The largest block (MoE models with dense layers: a sparse one)."""
        return max(self.layers, key=lambda b: b.params)

    @property
    def intermediate_size(self) -> int:
        """The MLP width one token's activations have in the largest block."""
        return self.block.mlp_width

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each adaptable linear (nn.Linear / Conv1D) of the largest block, by its path in the block."""
        return {lin.name: (lin.inputs, lin.outputs) for lin in self.block.linears if lin.adaptable}

    @property
    def block_linear_params(self) -> int:
        return self.block.linear_params

    @property
    def block_params(self) -> int:
        return self.block.params

    @property
    def quantized_params(self) -> int:
        """Weights bitsandbytes stores in 4 bits under QLoRA: those of every nn.Linear of the blocks."""
        return sum(lin.inputs * lin.outputs for b in self.layers for lin in b.linears if lin.adaptable)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """The output head (and its bias); 0 when tied to the embeddings."""
        return (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size) + self.head_bias

    @property
    def params(self) -> int:
        """P = embeddings (+ learned positions) + every block + final norm + head."""
        return self.embedding_params + self.positions + sum(b.params for b in self.layers) + self.final_norm + self.head_params

    @property
    def largest_layer_params(self) -> int:
        """The largest single module (what ZeRO-3 gathers at a time): the embedding, the head, one
        linear (weight and bias), or one layer's experts (their two fused parameters are one module)."""
        experts = (sum(lin.params for lin in b.linears if lin.experts > 1) for b in self.layers)
        return max(self.embedding_params, self.head_params, *experts, *(lin.params for b in self.layers for lin in b.linears))


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


def adapted_outside_linears(arch: dict[str, Any], targets: list[str]) -> bool:
    """Whether peft.target_modules adapt weights outside linear layers (a MoE's experts or router) of
    the model a config.json describes (the structure only: counts it does not need may be missing)."""
    if not config_value(arch, "num_local_experts"):
        return False
    try:
        structure = arch_from_config({"vocab_size": 1, **arch}, "config.json")
    except ConfigError:  # a key the count needs is missing: all-linear adapts the experts all the same
        return "all-linear" in targets
    return any(adapted(lin, targets) for block in structure.layers for lin in block.linears if not lin.adaptable)


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


def _int(arch: dict[str, Any], key: str, source: str, family: str) -> int:
    value = config_value(arch, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        got = "has no" if value is None else f"has {key}={value!r}, not a positive integer, for"
        raise ConfigError(f"{source} {got} {key}: the planner needs it to count a {family} model's parameters "
                          f"(copy it from the model's config.json)")
    return value


def _flag(arch: dict[str, Any], spec: bool | str) -> bool:
    """A Family bias spec read from config.json: a constant, or the key that says (absent: False, transformers' default)."""
    return spec if isinstance(spec, bool) else bool(arch.get(spec))


SUB_CONFIGS = ("vision_config", "audio_config", "speech_config", "vq_config", "audio_encoder_config", "encoder_config",
               "decoder_config", "depth_decoder_config", "per_layer_config")
"""Sub-configs of a model the planner does not count: other modalities' towers, encoder/decoder halves,
per-layer overrides (a model whose layers differ from one another)."""


def uncountable(arch: dict[str, Any]) -> str | None:
    """Why the planner cannot count the model a config.json describes (completing "the planner cannot count
    model_type=X: ..."), read from its keys; None when it is a decoder whose model_type COUNTED lists."""
    model_type = str(arch.get("model_type") or "")
    subs = [k for k in SUB_CONFIGS if arch.get(k)]
    if arch.get("is_encoder_decoder"):
        return "an encoder-decoder model (is_encoder_decoder=true): the planner counts decoder-only language models"
    if subs:
        return (f"its config has {', '.join(subs)}: the planner counts decoder-only language models, not other towers, "
                "encoder/decoder halves or layers that differ from one another")
    if arch.get("text_config"):
        return "its language model is nested in text_config, beside parts the planner does not count"
    kinds = sorted({str(t) for t in arch.get("layer_types") or [] if str(t) not in ATTENTION_LAYERS})
    if kinds:
        return f"its layer_types include {', '.join(kinds)}: the planner counts attention + MLP blocks only"
    if model_type not in COUNTED:
        return ("finetune/families.py has no record of its blocks (COUNTED: the decoders whose count "
                "tests/test_causal_lm_counts.py checks against transformers' own build)")
    return None


ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
"""layer_types of attention blocks (any other: linear attention, state-space or convolution layers)."""


def sparse_layers(arch: dict[str, Any], layers: int) -> list[bool]:
    """Which blocks of a MoE route to experts, from whichever key its config.json uses: mlp_layer_types
    (dense/sparse per layer), moe_layers (their indices), first_k_dense_replace (that many dense first),
    mlp_only_layers and decoder_sparse_step (Qwen-MoE), moe_layer_start_index/end/interval (ERNIE)."""
    if isinstance(arch.get("mlp_layer_types"), list):
        return [t == "sparse" for t in arch["mlp_layer_types"]]
    if isinstance(arch.get("moe_layers"), list):
        return [j in arch["moe_layers"] for j in range(layers)]
    first = arch.get("first_k_dense_replace") or 0
    dense_only = set(arch.get("mlp_only_layers") or [])
    step = arch.get("decoder_sparse_step") or 1
    start, interval = arch.get("moe_layer_start_index") or 0, arch.get("moe_layer_interval") or 1
    end = arch.get("moe_layer_end_index")
    end = layers - 1 if end is None or end < 0 else end
    return [j >= first and j not in dense_only and (j + 1) % step == 0 and start <= j <= end and (j - start) % interval == 0
            for j in range(layers)]


def arch_from_config(arch: dict[str, Any], source: str) -> Arch:
    """The structure of the model a config.json describes; ConfigError naming `source` and the
    first key the count needs that it lacks, or the model_type the planner cannot count (uncountable)."""
    model_type = str(arch.get("model_type") or "")
    why = uncountable(arch)
    if why:
        built = arch_from_build(arch)  # no record describes it: read it off transformers' own build
        if isinstance(built, Arch):
            return built
        raise ConfigError(f"the planner cannot count model_type={model_type or '(none)'} ({source}): {why}, and {built}; "
                          "no memory plan can be made for it")
    fam = COUNTED[model_type]
    names = {**LLAMA_NAMES, **dict(fam.names)}
    family = model_type
    h = _int(arch, "hidden_size", source, family)
    layers = _int(arch, "num_hidden_layers", source, family)
    heads = _int(arch, "num_attention_heads", source, family)
    kv = _int(arch, "num_key_value_heads", source, family)
    vocab = _int(arch, "vocab_size", source, family)
    experts = config_value(arch, "num_local_experts") or 0
    sparse = sparse_layers(arch, layers) if experts else [False] * layers
    experts_width = arch.get("moe_intermediate_size")  # else the experts are intermediate_size wide (Mixtral)
    width = _int(arch, "intermediate_size", source, family) if not all(sparse) or not experts_width else 0
    head_dim = arch.get("head_dim") or fam.head_dim or h // heads
    tied = arch.get("tie_word_embeddings")
    tied = fam.tied if tied is None else bool(tied)
    norm = (2 * h if fam.layer_norm else h) if fam.norm_weight else 0
    q, k = heads * head_dim, kv * head_dim

    qkv_bias, o_bias, mlp_bias = _flag(arch, fam.qkv_bias), _flag(arch, fam.o_bias), _flag(arch, fam.mlp_bias)
    latent_norms = 0
    if arch.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3): low-rank q and a shared k/v latent
        rank, rope, nope = arch["kv_lora_rank"], _int(arch, "qk_rope_head_dim", source, family), arch.get("qk_nope_head_dim") or 0
        q_rank, v = arch.get("q_lora_rank"), _int(arch, "v_head_dim", source, family)
        head_dim, kv = nope + rope, heads  # what attention sees, after kv_b_proj
        query = (Linear("self_attn.q_a_proj", h, q_rank, qkv_bias), Linear("self_attn.q_b_proj", q_rank, heads * head_dim)) \
            if q_rank else (Linear("self_attn.q_proj", h, heads * head_dim),)
        attention = (*query, Linear("self_attn.kv_a_proj_with_mqa", h, rank + rope, qkv_bias),
                     Linear("self_attn.kv_b_proj", rank, heads * (nope + v)), Linear("self_attn.o_proj", heads * v, h, o_bias))
        roles = {"qkv": (query[0].name, "self_attn.kv_a_proj_with_mqa"), "o": ("self_attn.o_proj",)}
        latent_norms = rank + (q_rank or 0)  # kv_a_layernorm, q_a_layernorm
        q, k = heads * head_dim, heads * head_dim
    elif fam.gpt2:
        attention = (Linear("attn.c_attn", h, q + 2 * k, True), Linear("attn.c_proj", q, h, True))
        roles = {"qkv": ("attn.c_attn",), "o": ("attn.c_proj",)}
    elif fam.fused:
        attention = (Linear(names["qkv"], h, q + 2 * k, qkv_bias), Linear(names["o"], q, h, o_bias))
        roles = {"qkv": (names["qkv"],), "o": (names["o"],)}
    else:
        attention = (Linear(names["q"], h, q, qkv_bias), Linear(names["k"], h, k, qkv_bias),
                     Linear(names["v"], h, k, qkv_bias), Linear(names["o"], h if fam.o_square else q, h, o_bias))
        roles = {"qkv": (names["q"], names["k"], names["v"]), "o": (names["o"],)}
    qk = {"head": 2 * head_dim, "full": q + k}.get(fam.qk_norm, 0) if not fam.qk_norm_key or arch.get(fam.qk_norm_key) else 0
    block_norms = fam.block_norms - bool(fam.parallel_key and arch.get(fam.parallel_key)) \
        - (fam.post_norms if fam.post_norm_key and not arch.get(fam.post_norm_key) else 0)
    norms = block_norms * norm + qk * (2 if fam.qk_norm_bias else 1) + latent_norms

    def extras(i: int, routed: int = 0) -> int:
        return sum(EXTRAS[kind](h, heads, head_dim, i, routed) for kind in fam.extras)

    def mlp(prefix: str, i: int, bias: bool = mlp_bias) -> tuple[tuple[Linear, ...], dict[str, tuple[str, ...]]]:
        """A dense MLP of width i: the block's own (prefix ""), or a shared expert's under `prefix`."""
        at = {role: prefix + (names[role].rsplit(".", 1)[-1] if prefix else names[role]) for role in ("gate", "up", "down", "gate_up")}
        if fam.gpt2:
            return ((Linear(f"{prefix or 'mlp.'}c_fc", h, i, True), Linear(f"{prefix or 'mlp.'}c_proj", i, h, True)),
                    {"up": (f"{prefix or 'mlp.'}c_fc",), "down": (f"{prefix or 'mlp.'}c_proj",)})
        down = Linear(at["down"], i, h, bias)
        if fam.mlp == "plain" and not prefix:
            return (Linear(at["up"], h, i, bias), down), {"up": (at["up"],), "down": (down.name,)}
        if fam.mlp == "fused" and not prefix:
            return (Linear(at["gate_up"], h, 2 * i, bias), down), {"up": (at["gate_up"],), "down": (down.name,)}
        return ((Linear(at["gate"], h, i, bias), Linear(at["up"], h, i, bias), down),
                {"up": (at["gate"], at["up"]), "down": (down.name,)})

    blocks = []
    if not all(sparse):
        dense_mlp, dense_roles = mlp("", width)
        blocks.append(Block(attention + dense_mlp, norms + extras(width), width, roles | dense_roles))
    if experts:
        expert = experts_width or width
        top_k = config_value(arch, "num_experts_per_tok") or 1
        b = fam.expert_bias
        sparse_mlp = (Linear(fam.router, h, experts, b, adaptable=False),
                      Linear(f"{fam.experts}.gate_up_proj", h, 2 * expert, b, experts=experts, adaptable=False),
                      Linear(f"{fam.experts}.down_proj", expert, h, b, experts=experts, adaptable=False))
        sparse_roles = {"up": (fam.router,), "down": ()}  # the experts read gathered copies (Block.moe)
        shared = arch.get("shared_expert_intermediate_size") or 0
        if shared:  # Qwen-MoE: one shared expert, gated by a sigmoid of the stream
            shared_mlp, shared_roles = mlp("mlp.shared_expert.", shared, False)
            sparse_mlp += shared_mlp + (Linear("mlp.shared_expert_gate", h, 1),)
            sparse_roles = {role: sparse_roles[role] + shared_roles[role] for role in sparse_roles}
        count = config_value(arch, "n_shared_experts") or 0
        if count and not fam.shared:
            raise ConfigError(f"the planner cannot count model_type={model_type} ({source}) with shared experts "
                              f"(n_shared_experts={count}): finetune/families.py does not describe this family's")
        if count:  # DeepSeek-style: n_shared_experts experts' width in one gated MLP on every token
            shared = count * _int(arch, fam.shared_width, source, family)
            shared_mlp, shared_roles = mlp(fam.shared + ".", shared)
            sparse_mlp += shared_mlp
            sparse_roles = {role: sparse_roles[role] + shared_roles[role] for role in sparse_roles}
        moe = Moe(experts, top_k, expert, bool(arch.get("norm_topk_prob", NORM_TOPK_DEFAULT.get(model_type, True))))
        blocks.append(Block(attention + sparse_mlp, norms + extras(expert, experts), top_k * expert + shared,
                            roles | sparse_roles, moe))
    blocks = [blocks[-1] if is_sparse else blocks[0] for is_sparse in sparse]
    positions = (_int(arch, "max_position_embeddings", source, family) + fam.positions) * h if fam.positions is not None else 0

    def first(*keys: str, default: Any) -> Any:
        return next((arch[k] for k in keys if arch.get(k) is not None), default)

    return Arch(model_type=model_type, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=tied,
                layers=tuple(blocks), final_norm=norm if fam.final_norm else 0, positions=positions,
                head_bias=vocab if _flag(arch, fam.head_bias) else 0, known=model_type in FAMILIES, family=fam,
                attention=attention_limits(arch),
                act=str(first("hidden_act", "hidden_activation", "activation_function", default=fam.act)),
                attention_dropout=float(first("attention_dropout", "attn_pdrop", default=fam.dropout)),
                residual_dropout=float(first("resid_pdrop", default=fam.dropout)),
                embedding_dropout=float(first("embd_pdrop", default=fam.dropout)),
                attn_softcap=float(first("attn_logit_softcapping", default=fam.softcap[0])),
                final_softcap=float(first("final_logit_softcapping", default=fam.softcap[1])))


def _named(**paths: str) -> tuple[tuple[str, str], ...]:
    return tuple(paths.items())


COUNTED: dict[str, Family] = {
    **FAMILIES,
    **{name: Family() for name in ("cwm", "exaone", "internlm3", "iquestcoder", "ministral", "ministral3")},
    "smollm3": Family(tied=True),
    "helium": Family(o_bias=False, o_square=True),
    "ernie4_5": Family(qkv_bias="use_bias", o_bias="use_bias", mlp_bias="use_bias", tied=True),
    "seed_oss": Family(o_bias="attention_out_bias"),
    "olmo": Family(norm_weight=False),
    "olmo3": Family(qk_norm="full", post_norms=2, norm_fp32=True),
    "exaone4": Family(qk_norm="head", post_norms=2),
    "hunyuan_v1_dense": Family(qk_norm="head"),
    "hyperclovax": Family(block_norms=4, post_norms=2, post_norm_key="use_post_norm"),
    "vaultgemma": Family(tied=True, head_dim=256, norm_fp32=True, act="gelu_pytorch_tanh"),
    "bitnet": Family(extras=("sub_norms",)),
    "diffllama": Family(extras=("lambdas",)),
    "granite_swa": Family(extras=("sinks",), tied=True),
    "cohere": Family(block_norms=1, tied=True, qk_norm="full", qk_norm_key="use_qk_norm"),
    "cohere2": Family(block_norms=1, tied=True),
    "glm": Family(mlp="fused", o_bias=False),
    "glm4": Family(mlp="fused", o_bias=False, block_norms=4, post_norms=2),
    "stablelm": Family(layer_norm=True, qkv_bias="use_qkv_bias", o_bias=False, qk_norm="full", qk_norm_key="qk_layernorm",
                       parallel_key="use_parallel_residual"),
    "arcee": Family(mlp="plain"),
    "apertus": Family(mlp="plain", qk_norm="head", extras=("xielu",)),
    "apertus1p5_text": Family(mlp="plain", qk_norm="head", extras=("xielu",)),
    "nemotron": Family(mlp="plain", layer_norm=True),
    "jais2": Family(mlp="plain", layer_norm=True),
    "nanochat": Family(mlp="plain", norm_weight=False, names=_named(up="mlp.fc1", down="mlp.fc2")),
    "starcoder2": Family(mlp="plain", layer_norm=True, qkv_bias="use_bias", o_bias="use_bias", mlp_bias="use_bias", tied=True,
                         names=_named(up="mlp.c_fc", down="mlp.c_proj")),
    "phi": Family(mlp="plain", layer_norm=True, block_norms=1, qkv_bias=True, o_bias=True, mlp_bias=True, head_bias=True,
                  qk_norm="head", qk_norm_key="qk_layernorm", qk_norm_bias=True,
                  names=_named(o="self_attn.dense", up="mlp.fc1", down="mlp.fc2")),
    "persimmon": Family(fused=True, mlp="plain", layer_norm=True, qkv_bias=True, o_bias=True, mlp_bias=True,
                        qk_norm="head", qk_norm_key="qk_layernorm", qk_norm_bias=True,
                        names=_named(qkv="self_attn.query_key_value", o="self_attn.dense", up="mlp.dense_h_to_4h",
                                     down="mlp.dense_4h_to_h")),
    "gpt_neox": Family(fused=True, mlp="plain", layer_norm=True, mlp_bias=True,
                       names=_named(qkv="attention.query_key_value", o="attention.dense", up="mlp.dense_h_to_4h",
                                    down="mlp.dense_4h_to_h")),
    "gptj": Family(mlp="plain", layer_norm=True, block_norms=1, qkv_bias=False, o_bias=False, mlp_bias=True, head_bias=True,
                   names=_named(q="attn.q_proj", k="attn.k_proj", v="attn.v_proj", o="attn.out_proj", up="mlp.fc_in",
                                down="mlp.fc_out")),
    "codegen": Family(fused=True, mlp="plain", layer_norm=True, block_norms=1, qkv_bias=False, o_bias=False, mlp_bias=True,
                      head_bias=True, names=_named(qkv="attn.qkv_proj", o="attn.out_proj", up="mlp.fc_in", down="mlp.fc_out")),
    "gpt_bigcode": Family(gpt2=True, tied=True, layer_norm=True, mlp="plain", positions=0, act="gelu_pytorch_tanh"),
    "gpt_neo": Family(mlp="plain", layer_norm=True, qkv_bias=False, o_bias=True, mlp_bias=True, positions=0, tied=True,
                      act="gelu_new", names=_named(q="attn.attention.q_proj", k="attn.attention.k_proj", v="attn.attention.v_proj",
                                                   o="attn.attention.out_proj", up="mlp.c_fc", down="mlp.c_proj")),
    "gpt-sw3": Family(gpt2=True, tied=True, layer_norm=True, mlp="plain", positions=0, act="gelu_new"),
    # mixtures of experts
    "granitemoe": Family(router="block_sparse_moe.router", experts="block_sparse_moe.experts"),
    "mellum": Family(qk_norm="head"),
    "olmoe": Family(qk_norm="full"),
    "flex_olmo": Family(qk_norm="full", post_norms=2, norm_fp32=True),
    "minimax_m2": Family(qk_norm="full"),
    "phimoe": Family(layer_norm=True, router="mlp.router", head_bias="lm_head_bias"),
    "gpt_oss": Family(extras=("sinks",), router="mlp.router", expert_bias=True),
    "cohere2_moe": Family(block_norms=1, tied=True),
    "solar_open": Family(shared="mlp.shared_experts"),
    "aria_text": Family(router="mlp.router", shared="mlp.shared_experts", shared_width="intermediate_size"),
    "exaone_moe": Family(qk_norm="head", shared="mlp.shared_experts"),
    "hy_v3": Family(qk_norm="head", shared="mlp.shared_experts"),
    "sarvam_moe": Family(qk_norm="head", qk_norm_key="use_qk_norm", shared="mlp.shared_experts"),
    "glm4_moe": Family(qk_norm="head", qk_norm_key="use_qk_norm", shared="mlp.shared_experts"),
    **{name: Family(shared="mlp.shared_experts") for name in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "sarvam_mla")},
    "minicpm3": Family(tied=True),
    "youtu": Family(tied=True),
    "ernie4_5_moe": Family(qkv_bias="use_bias", o_bias="use_bias", mlp_bias="use_bias", tied=True, shared="mlp.shared_experts",
                           extras=("score_bias",)),
}
"""Every model_type the planner counts: FAMILIES, and decoders of transformers whose blocks the same records
describe (their count only: attention kernels and parallel plans of these are left to the ranks).
tests/test_family_params.py builds every causal LM transformers has and checks each count listed here
(within 0.1%) and that every other model_type is refused (uncountable)."""


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


O_NAMES = frozenset({"o_proj", "out_proj", "c_proj", "dense", "wo", "o", "proj", "out", "o_dense", "linear_out"})
"""Last path components of an attention block's output projection, in the families transformers has."""


def arch_from_build(arch: dict[str, Any]) -> Arch | str:
    """The structure of a decoder no record describes, read off the model transformers builds from its
    config.json on the meta device (no memory, no weights; transformers' own code, so the count is exact):
    each decoder layer's nn.Linear / Conv1D modules as built, the rest of a layer's parameters (norms,
    convolutions, a MoE's fused experts) counted beside them, the embeddings and head as built, and what
    is outside the layers (final norm, positions, other parts) as the final norm. Activations are then
    estimated as for a Llama-style block of the same linears (the plan says so). Returns the Arch, or why
    it cannot be built (a clause)."""
    key = json.dumps(arch, sort_keys=True, default=str)
    return _built(key)


@functools.lru_cache(maxsize=16)
def _built(key: str) -> Arch | str:
    arch = json.loads(key)
    model_type = str(arch.get("model_type") or "")
    import warnings

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.pytorch_utils import Conv1D
    from transformers.utils import logging as hf_logging

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "transformers has no causal language model of this model_type to build it from"
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kind = CONFIG_MAPPING[model_type]
            decode = getattr(kind, "_decode_special_floats", lambda obj: obj)  # {"__float__": "Infinity"}, as from_pretrained reads it
            config = kind.from_dict(decode(arch))
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - its reason, in the refusal
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"transformers cannot build it from this config ({type(e).__name__}: {first[:200]})"
    finally:
        hf_logging.set_verbosity(verbosity)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return "its transformers build has no list of decoder layers"
    stack = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    h = config_value(arch, "hidden_size") or model.get_input_embeddings().weight.shape[1]
    seen: set[int] = set()  # a module shared by several layers (Zamba's shared attention) is counted in the first
    blocks = tuple(_block(layer, h, arch, (torch.nn.Linear, Conv1D), seen) for layer in stack)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is None or head.weight is embed.weight
    vocab = embed.weight.shape[0] if tied else min(embed.weight.shape[0], head.weight.shape[0])  # extra input rows: prompts
    # the head beyond vocab_size x hidden_size: its bias, rows for more outputs than the input has
    head_bias = 0 if tied else sum(p.numel() for p in head.parameters()) - vocab * h
    heads = config_value(arch, "num_attention_heads") or 1
    kv = config_value(arch, "num_key_value_heads") or heads
    head_dim = arch.get("head_dim") or max(h // heads, 1)
    total = sum(p.numel() for p in model.parameters())  # a tied head counted once
    layers = sum(b.params for b in blocks)
    rest = total - layers - vocab * h - (0 if tied else vocab * h) - head_bias
    if rest < 0 or head_bias < 0:
        return f"its embeddings or head are not vocab_size x hidden_size ({tuple(embed.weight.shape)}, hidden_size {h})"

    def first(*keys: str, default: Any) -> Any:
        return next((arch[k] for k in keys if isinstance(arch.get(k), (int, float, str)) and not isinstance(arch.get(k), bool)),
                    default)

    return Arch(model_type=model_type, hidden_size=h, num_hidden_layers=len(blocks), num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=tied, layers=blocks,
                final_norm=rest, head_bias=head_bias, known=False, attention=attention_limits(arch),
                act=str(first("hidden_act", "hidden_activation", "activation_function", default="silu")),
                attention_dropout=float(first("attention_dropout", "attn_pdrop", default=0.0)),
                residual_dropout=float(first("resid_pdrop", default=0.0)))


def _block(layer: Any, h: int, arch: dict[str, Any], linear_types: tuple[type, ...], seen: set[int]) -> Block:
    """One built decoder layer as the planner counts it: its linears by path, with roles read from the path
    (attention side: the output projection `o`, the rest `qkv`; elsewhere: a linear reading the stream `up`,
    any other `down`), and every other parameter of the layer counted as its norms; a parameter `seen` in an
    earlier layer (shared between layers) is not counted again."""
    linears, roles = [], {"qkv": [], "o": [], "up": [], "down": []}
    for name, module in layer.named_modules():
        if not isinstance(module, linear_types) or id(module.weight) in seen:
            continue
        weight = module.weight
        inputs, outputs = (weight.shape[1], weight.shape[0]) if weight.dim() == 2 and not hasattr(module, "nf") else \
            (weight.shape[0], weight.shape[1])  # Conv1D (GPT-2 style) stores (in, out)
        lin = Linear(name, int(inputs), int(outputs), getattr(module, "bias", None) is not None)
        linears.append(lin)
        parts = name.lower().split(".")
        if any("attn" in p or "attention" in p for p in parts[:-1]):
            roles["o" if parts[-1] in O_NAMES else "qkv"].append(name)
        else:
            roles["up" if lin.inputs == h else "down"].append(name)
    own = [p for p in layer.parameters() if id(p) not in seen]
    seen.update(id(p) for p in own)
    others = sum(p.numel() for p in own) - sum(lin.params for lin in linears)
    width = config_value(arch, "intermediate_size")  # per layer in some families: the widest
    width = max(width) if isinstance(width, list) and width else width
    if not isinstance(width, int) or isinstance(width, bool):
        width = max((lin.outputs for lin in linears if lin.name in roles["up"]), default=4 * h)
    return Block(tuple(linears), others, width, {k: tuple(v) for k, v in roles.items()})
