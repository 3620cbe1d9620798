"""What differs between model families, read from a transformers config.json (a dict): the
parameters of every module, counted exactly as `AutoModelForCausalLM.from_config` builds them.

One code path counts every family. Most of what differs is a config key (head_dim,
attention_bias, qkv_bias, mlp_bias, tie_word_embeddings, num_local_experts / num_experts,
moe_intermediate_size, shared_expert_intermediate_size, mlp_only_layers, decoder_sparse_step,
rms_norm_eps vs layer_norm_epsilon); what a family's config.json does not say (Qwen2's q/k/v
biases, Qwen3's and OLMo-2's q/k norms, Gemma-2's four norms per block, Phi-3's fused
projections, GPT-2's layout) is the small `Family` record below, keyed by model_type. A
model_type not listed is counted as a Llama-style decoder from its keys (`Arch.known` False).

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

from dataclasses import dataclass, field
from typing import Any

from finetune.config import ConfigError
from finetune.disk import config_value


@dataclass(frozen=True)
class Family:
    """What a family's config.json does not state (each a default a config key overrides where one exists)."""

    qkv_bias: bool = False
    """q/k/v carry biases (o does not) when config.json has no qkv_bias / attention_bias (Qwen2)."""
    qk_norm: str = ""
    """RMSNorm on queries and keys: "head" (head_dim wide, shared by heads: Qwen3, Gemma-3) or "full"
    (over all heads: OLMo-2); "" none."""
    block_norms: int = 2
    """Norms of the residual stream per block (Gemma-2/3: pre/post attention and pre/post MLP: 4)."""
    fused: bool = False
    """One qkv_proj and one gate_up_proj instead of q/k/v and gate/up (Phi-3)."""
    tied: bool = False
    """tie_word_embeddings when config.json does not say (transformers' default for the family)."""
    head_dim: int | None = None
    """head_dim when config.json does not say; None: hidden_size / num_attention_heads."""
    gpt2: bool = False
    """GPT-2's layout: Conv1D c_attn/c_proj/c_fc with biases, a plain (not gated) MLP, LayerNorms
    with biases, learned positions (max_position_embeddings x hidden_size)."""
    layer_norm: bool = False
    """LayerNorm (weight and bias) rather than RMSNorm (weight): also read from a layer_norm_eps key."""
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


FAMILIES: dict[str, Family] = {
    "llama": Family(), "mistral": Family(), "mixtral": Family(), "granite": Family(),
    "qwen2": Family(qkv_bias=True), "qwen2_moe": Family(qkv_bias=True),
    "qwen3": Family(qk_norm="head", head_dim=128), "qwen3_moe": Family(qk_norm="head"),
    "gemma": Family(tied=True, head_dim=256, norm_fp32=True, act="gelu_pytorch_tanh"),
    "gemma2": Family(block_norms=4, tied=True, head_dim=256, post_norms=2, norm_fp32=True, act="gelu_pytorch_tanh",
                     softcap=(50.0, 30.0), sdpa=False),
    "gemma3_text": Family(qk_norm="head", block_norms=4, tied=True, head_dim=256, post_norms=2, norm_fp32=True,
                          act="gelu_pytorch_tanh"),
    "olmo2": Family(qk_norm="full", post_norms=2, norm_fp32=True),
    "phi3": Family(fused=True),
    "gpt2": Family(gpt2=True, tied=True, layer_norm=True, act="gelu_new", dropout=0.1, tp_plan=False, pp_plan=False),
}
"""The families counted exactly (tests/test_family_params.py builds each and compares with numel)."""

LLAMA_STYLE = Family()


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
    known: bool = True
    """Whether model_type is one of FAMILIES (else counted as a Llama-style decoder)."""
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
        """The output head; 0 when tied to the embeddings."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

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
    fam = FAMILIES.get(model_type, LLAMA_STYLE)
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


def arch_from_config(arch: dict[str, Any], source: str) -> Arch:
    """The structure of the model a config.json describes; ConfigError naming `source` and the
    first key the count needs that it lacks."""
    model_type = str(arch.get("model_type") or "")
    fam = FAMILIES.get(model_type, LLAMA_STYLE)
    family = model_type or "Llama-style"
    h = _int(arch, "hidden_size", source, family)
    layers = _int(arch, "num_hidden_layers", source, family)
    heads = _int(arch, "num_attention_heads", source, family)
    kv = _int(arch, "num_key_value_heads", source, family)
    vocab = _int(arch, "vocab_size", source, family)
    width = _int(arch, "intermediate_size", source, family)
    head_dim = arch.get("head_dim") or fam.head_dim or h // heads
    tied = arch.get("tie_word_embeddings")
    tied = fam.tied if tied is None else bool(tied)
    layer_norm = fam.layer_norm or ("rms_norm_eps" not in arch and ("layer_norm_eps" in arch or "layer_norm_epsilon" in arch))
    norm = 2 * h if layer_norm else h
    q, k = heads * head_dim, kv * head_dim

    attention_bias = bool(arch.get("attention_bias", False))
    qkv_bias = arch.get("qkv_bias")
    qkv_bias = (fam.qkv_bias or attention_bias) if qkv_bias is None else bool(qkv_bias)
    mlp_bias = bool(arch.get("mlp_bias", False))
    if fam.gpt2:
        attention = (Linear("attn.c_attn", h, q + 2 * k, True), Linear("attn.c_proj", q, h, True))
        roles = {"qkv": ("attn.c_attn",), "o": ("attn.c_proj",)}
    elif fam.fused:
        attention = (Linear("self_attn.qkv_proj", h, q + 2 * k, qkv_bias), Linear("self_attn.o_proj", q, h, attention_bias))
        roles = {"qkv": ("self_attn.qkv_proj",), "o": ("self_attn.o_proj",)}
    else:
        attention = (Linear("self_attn.q_proj", h, q, qkv_bias), Linear("self_attn.k_proj", h, k, qkv_bias),
                     Linear("self_attn.v_proj", h, k, qkv_bias), Linear("self_attn.o_proj", q, h, attention_bias))
        roles = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",)}
    norms = fam.block_norms * norm + {"head": 2 * head_dim, "full": q + k}.get(fam.qk_norm, 0)

    def mlp(prefix: str, i: int) -> tuple[tuple[Linear, ...], dict[str, tuple[str, ...]]]:
        if fam.gpt2:
            return ((Linear(f"{prefix}c_fc", h, i, True), Linear(f"{prefix}c_proj", i, h, True)),
                    {"up": (f"{prefix}c_fc",), "down": (f"{prefix}c_proj",)})
        down = Linear(f"{prefix}down_proj", i, h, mlp_bias)
        if fam.fused:
            return (Linear(f"{prefix}gate_up_proj", h, 2 * i, mlp_bias), down), {"up": (f"{prefix}gate_up_proj",), "down": (down.name,)}
        return ((Linear(f"{prefix}gate_proj", h, i, mlp_bias), Linear(f"{prefix}up_proj", h, i, mlp_bias), down),
                {"up": (f"{prefix}gate_proj", f"{prefix}up_proj"), "down": (down.name,)})

    dense_mlp, dense_roles = mlp("mlp.", width)
    dense = Block(attention + dense_mlp, norms, width, roles | dense_roles)
    experts = config_value(arch, "num_local_experts") or 0
    blocks = [dense] * layers
    if experts:
        expert = arch.get("moe_intermediate_size") or width
        top_k = arch.get("num_experts_per_tok") or 1
        sparse_mlp = (Linear("mlp.gate", h, experts, adaptable=False),
                      Linear("mlp.experts.gate_up_proj", h, 2 * expert, experts=experts, adaptable=False),
                      Linear("mlp.experts.down_proj", expert, h, experts=experts, adaptable=False))
        shared = arch.get("shared_expert_intermediate_size") or 0
        sparse_roles = {"up": ("mlp.gate",), "down": ()}  # the experts read gathered copies (Block.moe)
        if shared:
            shared_mlp, shared_roles = mlp("mlp.shared_expert.", shared)
            sparse_mlp += shared_mlp + (Linear("mlp.shared_expert_gate", h, 1),)
            sparse_roles = {role: sparse_roles[role] + shared_roles[role] for role in sparse_roles}
        moe = Moe(experts, top_k, expert, bool(arch.get("norm_topk_prob", NORM_TOPK_DEFAULT.get(model_type, True))))
        sparse = Block(attention + sparse_mlp, norms, top_k * expert + shared, roles | sparse_roles, moe)
        dense_only = set(arch.get("mlp_only_layers") or [])
        step = arch.get("decoder_sparse_step") or 1
        blocks = [sparse if j not in dense_only and (j + 1) % step == 0 else dense for j in range(layers)]
    positions = _int(arch, "max_position_embeddings", source, family) * h if fam.gpt2 else 0

    def first(*keys: str, default: Any) -> Any:
        return next((arch[k] for k in keys if arch.get(k) is not None), default)

    return Arch(model_type=model_type, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=tied,
                layers=tuple(blocks), final_norm=norm, positions=positions, known=model_type in FAMILIES, family=fam,
                attention=attention_limits(arch),
                act=str(first("hidden_act", "hidden_activation", "activation_function", default=fam.act)),
                attention_dropout=float(first("attention_dropout", "attn_pdrop", default=fam.dropout)),
                residual_dropout=float(first("resid_pdrop", default=fam.dropout)),
                embedding_dropout=float(first("embd_pdrop", default=fam.dropout)),
                attn_softcap=float(first("attn_logit_softcapping", default=fam.softcap[0])),
                final_softcap=float(first("final_logit_softcapping", default=fam.softcap[1])))


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
