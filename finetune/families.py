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
parameters (gate_up_proj, down_proj) and the router a plain weight, none of them an nn.Linear,
so LoRA's all-linear adapts attention (and dense / shared-expert MLPs) only.

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
    "gemma": Family(tied=True, head_dim=256), "gemma2": Family(block_norms=4, tied=True, head_dim=256),
    "gemma3_text": Family(qk_norm="head", block_norms=4, tied=True, head_dim=256),
    "olmo2": Family(qk_norm="full"),
    "phi3": Family(fused=True),
    "gpt2": Family(gpt2=True, tied=True, layer_norm=True, tp_plan=False, pp_plan=False),
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
    """> 1: the experts' weights, one fused 3-D parameter (not an nn.Linear: LoRA's all-linear skips it)."""
    adaptable: bool = True
    """An nn.Linear / Conv1D module that LoRA can adapt (and bitsandbytes quantizes)."""

    @property
    def params(self) -> int:
        return self.experts * (self.inputs * self.outputs + (self.outputs if self.bias else 0))


@dataclass(frozen=True)
class Block:
    """One decoder block: its linears (attention, MLP or experts) and its norms' parameters."""

    linears: tuple[Linear, ...]
    norms: int
    mlp_width: int
    """The MLP width one token's activations have (MoE: its top-k experts' and the shared expert's)."""
    roles: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False, hash=False)
    """Linears by what they read: qkv (the normed stream), o (attention output), up (the normed
    stream, MLP side), down (the MLP activation): for the activation count."""

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
        sparse_roles = {"up": ("mlp.experts.gate_up_proj",), "down": ("mlp.experts.down_proj",)}
        if shared:
            shared_mlp, shared_roles = mlp("mlp.shared_expert.", shared)
            sparse_mlp += shared_mlp + (Linear("mlp.shared_expert_gate", h, 1),)
            sparse_roles = {role: sparse_roles[role] + shared_roles[role] for role in sparse_roles}
        sparse = Block(attention + sparse_mlp, norms, top_k * expert + shared, roles | sparse_roles)
        dense_only = set(arch.get("mlp_only_layers") or [])
        step = arch.get("decoder_sparse_step") or 1
        blocks = [sparse if j not in dense_only and (j + 1) % step == 0 else dense for j in range(layers)]
    positions = _int(arch, "max_position_embeddings", source, family) * h if fam.gpt2 else 0
    return Arch(model_type=model_type, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=tied,
                layers=tuple(blocks), final_norm=norm, positions=positions, known=model_type in FAMILIES)
