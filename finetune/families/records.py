"""What differs between model families, as data: the `Family` record per model_type (FAMILIES, supported end to
end; COUNTED, counted only), the names families give the same config.json keys (ALIASES, `config_value`), the
paths of a block's linears (LLAMA_NAMES) and its other small parameters (EXTRAS). finetune/families/ tells the
rest (the package's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    the ranks apply (finetune/rank/parallel.py); False: tensor parallel is refused before launch (GPT-2's
    fused Conv1D layers have none). tests/test_families_parallel.py checks it against transformers."""
    pp_plan: bool = True
    """transformers publishes a pipeline plan (base_model_pp_plan: the modules before and after the
    blocks), which pipeline stages follow; False: pipeline parallel is refused before launch."""
    scored: bool = True
    """transformers has a ForSequenceClassification class for the family (one score per row: method=reward's
    model); False: method=reward is refused before launch (Granite has none). tests/test_reward.py checks it
    against transformers' mapping."""


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
    "llama": Family(), "mistral": Family(), "mixtral": Family(), "granite": Family(scored=False),
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

NORM_TOPK_DEFAULT = {"qwen2_moe": False, "qwen3_moe": False, "olmoe": False}
"""transformers' default of norm_topk_prob where a family's config has the key (a config.json may leave it
out); Mixtral has none and always renormalises."""


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
