"""A model config's structure, checked before any rank starts as transformers checks it when a rank
builds the model: the heads against the hidden size, the key/value heads against the heads, head_dim
against RoPE, the RoPE settings per RoPE type, layer_types against the layers, top-k against the
experts, and the types of the sizes and switches.

Each check is keyed on config.json keys, not on a family: a model_type we never named is checked
the same way. The one exception is the heads against the hidden size, a per-family rule in
transformers (HEADS_DIVIDE_HIDDEN: Llama refuses 100 wide over 6 heads, Mistral takes head_dim 16
and builds). Derived from
transformers' validation (`PreTrainedConfig.validate_*`, `RotaryEmbeddingConfigMixin.validate_rope`
and its per-type `_validate_*_rope_parameters`, the families' `validate_architecture`) and from what
its attention modules assume (repeat_kv: whole query heads per key/value head); where transformers
only logs a warning (a RoPE factor below 1, a longrope factor list of the wrong length) and the run
would go on wrong, the check refuses too. tests/test_structure.py checks that transformers rejects
(raises, or warns about the same key) every config refused here.

`structure_problem(config, where)` returns the one line, or None; rules.validate raises it for
model.init, a local model.path's config.json and model.architecture alike. Pure: no transformers.
"""

from __future__ import annotations

from typing import Any, Callable

SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
         "vocab_size", "max_position_embeddings", "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok")
"""Keys that, where a config.json has them (not null), are positive integers (transformers' strict int fields;
0 divides by zero or builds empty layers)."""
ALIASES = {"hidden_size": ("n_embd", "d_model"), "num_attention_heads": ("n_head", "num_heads"),
           "num_hidden_layers": ("n_layer", "num_layers"), "num_key_value_heads": ("num_kv_heads", "n_head_kv")}
"""The same sizes under a family's own names (transformers' attribute_map): checked as they are spelled."""
SWITCHES = ("tie_word_embeddings", "attention_bias", "mlp_bias")
"""Keys that are booleans where a config.json has them (transformers' strict bool fields)."""

HEADS_DIVIDE_HIDDEN = frozenset({
    # the config's validate_architecture refuses it, head_dim or not
    "arcee", "aria_text", "cwm", "deepseek_v2", "exaone", "gemma2", "gemma3_text", "gemma3n_text", "hrm_text", "hyperclovax",
    "internlm3", "iquestcoder", "jais2", "llama", "minicpm3", "vaultgemma", "gpt_neox",
    # the attention raises when its module is built ("embed_dim must be divisible by num_heads" and the like)
    "bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "biogpt", "blenderbot", "blenderbot-small", "bloom",
    "camembert", "codegen", "data2vec-text", "ernie", "falcon", "git", "gpt-sw3", "gpt2", "gpt_bigcode", "gptj", "marian",
    "mbart", "megatron-bert", "modernbert-decoder", "moshi", "mvp", "openai-gpt", "opt", "pegasus", "persimmon", "plbart",
    "prophetnet", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "stablelm", "trocr", "whisper", "xglm", "xlm",
    "xlm-roberta", "xlm-roberta-xl", "xmod",
    # the forward fails: heads x head_dim does not meet a hidden_size-wide projection (no head_dim of their own, or
    # Helium's square o_proj)
    "bitnet", "ctrl", "electra", "gpt_neox_japanese", "helium", "mpt", "olmoe",
})
"""The model_types for which transformers refuses a hidden_size that num_attention_heads does not divide, whatever
head_dim says (its config, its model's build or its forward fails). Every other model_type takes head_dim (its
config's, its family's default, or hidden_size // heads) and builds: Mistral, Mixtral, Qwen2/3, Gemma, OLMo-2,
Granite, Phi-3... are not refused. tests/test_structure.py recomputes this set from transformers (every causal LM,
on the meta device: 100 wide over 6 heads against 96 wide, with head_dim 16 and without)."""

ROPE_REQUIRED = {"default": (), "axial": (), "proportional": (), "linear": ("factor",), "dynamic": ("factor",),
                 "yarn": ("factor",), "longrope": ("short_factor", "long_factor"),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
"""RoPE types transformers has, and the keys each needs that it cannot fill in itself (rope_theta and
original_max_position_embeddings it takes from the config)."""
ROPE_LEGACY = {"su": "longrope", "mrope": "default"}
"""Older names hub configs still carry, which the families that used them read as these types (Phi-3's su,
Qwen2-VL's mrope)."""

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "window_attention", "indexed_attention",
                         "compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse", "conv", "moe",
                         "hybrid", "hybrid_sliding", "reference_sliding_attention", "linear_attention", "mamba", "attention",
                         "deepseek_sparse_attention", "qwen_sparse_attention")
"""layer_types entries transformers accepts (its ALLOWED_ATTN_LAYER_TYPES and the legacy names it maps onto them)."""
MLP_LAYER_TYPES = ("sparse", "dense")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def _divisors(n: int, near: int) -> str:
    """The divisors of n nearest `near` (below and above), as a suggestion."""
    below = max((d for d in range(1, near) if n % d == 0), default=None)
    above = min((d for d in range(near + 1, n + 1) if n % d == 0), default=None)
    return " or ".join(str(d) for d in (below, above) if d is not None)


def structure_problem(config: dict[str, Any], key: Callable[[str], str], source: str = "") -> str | None:
    """The first structural mistake of a model's config.json keys, as one line naming each key (`key(name)`
    spells it as the user wrote it: model.init.X, model.architecture.X, or X with `source` (" in FILE")),
    its value and what to do; None when transformers would build it."""
    for check in (_sizes, _switches, _heads, _layer_types, _experts, _rope):
        problem = check(config, key, source)
        if problem:
            return problem
    return None


def _spelled(config: dict[str, Any], name: str) -> tuple[str, Any]:
    """(the key as the config spells it, its value) for a size under its own name or an alias; (name, None) if absent."""
    for spelling in (name, *ALIASES.get(name, ())):
        if config.get(spelling) is not None:
            return spelling, config[spelling]
    return name, None


def _sizes(config: dict[str, Any], key: Callable[[str], str], source: str) -> str | None:
    for name in SIZES:
        spelling, value = _spelled(config, name)
        if value is not None and not _positive_int(value):
            return f"{key(spelling)}={value!r}{source} must be a positive integer: fix it (copy it from the model's config.json)"
    return None


def _switches(config: dict[str, Any], key: Callable[[str], str], source: str) -> str | None:
    for name in SWITCHES:
        if config.get(name) is not None and not isinstance(config[name], bool):
            return f"{key(name)}={config[name]!r}{source} must be true or false"
    return None


def head_dim(config: dict[str, Any]) -> int | None:
    """head_dim as transformers reads it: the config's, else hidden_size // num_attention_heads (None: unknown)."""
    if _positive_int(config.get("head_dim")):
        return config["head_dim"]
    hidden, heads = _spelled(config, "hidden_size")[1], _spelled(config, "num_attention_heads")[1]
    return hidden // heads if hidden and heads else None


def _heads(config: dict[str, Any], key: Callable[[str], str], source: str) -> str | None:
    (h_key, hidden), (a_key, heads) = _spelled(config, "hidden_size"), _spelled(config, "num_attention_heads")
    kv_key, kv = _spelled(config, "num_key_value_heads")
    model_type = config.get("model_type")
    if hidden and heads and hidden % heads and model_type in HEADS_DIVIDE_HIDDEN:
        return (f"{key(a_key)}={heads} does not divide {key(h_key)}={hidden}{source}: transformers' {model_type} splits "
                f"{h_key} evenly over the attention heads, head_dim or not: use a {key(a_key)} that divides {hidden} "
                f"(e.g. {_divisors(hidden, heads)})")
    if heads and kv and not config.get("kv_lora_rank") and heads % kv:
        relation = "exceeds" if kv > heads else "does not divide"
        divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        return (f"{key(kv_key)}={kv} {relation} {key(a_key)}={heads}{source}: each key/value head serves a whole group of "
                f"query heads, so it must divide {heads}: use one of {divisors}")
    return None


def _layer_types(config: dict[str, Any], key: Callable[[str], str], source: str) -> str | None:
    layers_key, layers = _spelled(config, "num_hidden_layers")
    for name, allowed in (("layer_types", ATTENTION_LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
        types = config.get(name)
        if types is None:
            continue
        if not isinstance(types, list):
            return f"{key(name)}={types!r}{source} must be a list, one entry per layer"
        wrong = [t for t in types if t not in allowed]
        if wrong:
            return f"{key(name)}{source} has {wrong[0]!r}, not a layer type transformers has: use one of {', '.join(allowed)}"
        if _positive_int(layers) and len(types) != layers:
            return (f"{key(name)}{source} has {_entries(len(types))} but {key(layers_key)}={layers}: give one entry per layer "
                    f"(or set {key(layers_key)}={len(types)})")
    return None


def _experts(config: dict[str, Any], key: Callable[[str], str], source: str) -> str | None:
    experts_key, experts = next(((k, config[k]) for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
                                 if _positive_int(config.get(k))), (None, None))
    top_k = config.get("num_experts_per_tok")
    if experts_key and _positive_int(top_k) and top_k > experts:
        return (f"{key('num_experts_per_tok')}={top_k} exceeds {key(experts_key)}={experts}{source}: a token is routed to "
                f"num_experts_per_tok of the experts: use at most {experts}")
    return None


def _rope(config: dict[str, Any], key: Callable[[str], str], source: str) -> str | None:
    name = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    rope = config.get(name)
    if rope is None:
        return _rotary_dim(config, key, source, {}, "") if config.get("rope_theta") is not None else None
    if not isinstance(rope, dict):
        return f"{key(name)}={rope!r}{source} must be a mapping (rope_type and its parameters) or null"
    layer_types = set(config.get("layer_types") or ())
    nested = [k for k in rope if k in layer_types]
    for at, params in ([(f"{name}.{k}", rope[k]) for k in nested] if nested else [(name, rope)]):
        if params is None:
            continue
        if not isinstance(params, dict):
            return f"{key(at)}={params!r}{source} must be a mapping (rope_type and its parameters) or null"
        problem = _rope_parameters(config, key, source, params, at)
        if problem:
            return problem
    return None


def _rope_parameters(config: dict[str, Any], key: Callable[[str], str], source: str, rope: dict[str, Any], at: str) -> str | None:
    kind_key = "rope_type" if "rope_type" in rope or "type" not in rope else "type"
    named = rope.get(kind_key, "default")
    kind = ROPE_LEGACY.get(named, named)
    if kind not in ROPE_REQUIRED:
        return (f"{key(at)}.{kind_key}={kind!r}{source} is not a RoPE type transformers has: use one of "
                f"{', '.join(ROPE_REQUIRED)}")
    legacy = ("original_max_position_embeddings",) if named in ROPE_LEGACY and kind == "longrope" else ()  # not filled in for su
    missing = [k for k in (*ROPE_REQUIRED[kind], *legacy) if rope.get(k) is None]
    if missing:
        return f"{key(at)}{source} has rope_type={kind} without {', '.join(missing)}: add {key(at)}.{missing[0]}"
    factor = rope.get("factor")
    if factor is not None and (not _number(factor) or factor < 1):
        return (f"{key(at)}.factor={factor!r}{source} must be a number of at least 1 (how many times the original context "
                f"the {kind} scaling stretches to)")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if not _number(partial) or not 0 <= partial <= 1:
        return (f"{key(at)}.partial_rotary_factor={partial!r}{source} must be a number from 0 to 1: the share of head_dim "
                "that RoPE rotates")
    for name in ("attention_factor",):
        if rope.get(name) is not None and (not _number(rope[name]) or rope[name] < 0):
            return f"{key(at)}.{name}={rope[name]!r}{source} must be a number of at least 0"
    if kind == "yarn":
        fast, slow = rope.get("beta_fast"), rope.get("beta_slow")
        for name, value in (("beta_fast", fast), ("beta_slow", slow)):
            if value is not None and not _number(value):
                return f"{key(at)}.{name}={value!r}{source} must be a number"
        if (fast or 32) < (slow or 1):
            return (f"{key(at)}.beta_fast={fast if fast is not None else 32} is below {key(at)}.beta_slow="
                    f"{slow if slow is not None else 1}{source}: yarn's extrapolation bound must be above its interpolation bound")
    if kind == "llama3":
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        if not _number(low) or not _number(high) or high <= low:
            return (f"{key(at)}.high_freq_factor={high!r} must be a number above {key(at)}.low_freq_factor={low!r}{source} "
                    "(Llama 3.1 uses 4.0 and 1.0)")
        original, longest = rope.get("original_max_position_embeddings"), config.get("max_position_embeddings")
        if original is not None and (not _positive_int(original) or (_positive_int(longest) and original >= longest)):
            return (f"{key(at)}.original_max_position_embeddings={original!r} must be an integer below "
                    f"{key('max_position_embeddings')}={longest}{source} (the pre-training context that llama3 scaling stretches)")
    return _rotary_dim(config, key, source, rope, at)


def _rotary_dim(config: dict[str, Any], key: Callable[[str], str], source: str, rope: dict[str, Any], at: str) -> str | None:
    """RoPE rotates pairs: a wholly rotated head_dim must be even (transformers allows <= 4, for test models); a
    longrope factor list has one entry per pair."""
    dim = head_dim(config)
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if dim is None or not _number(partial):
        return None
    rotary = int(dim * partial)
    if dim > 4 and dim % 2 and rotary == dim:
        what = f"{key('head_dim')}={dim}" if config.get("head_dim") is not None else \
            f"the head_dim {key('hidden_size')} / {key('num_attention_heads')} = {dim}"
        return (f"{what} is odd{source}: RoPE rotates pairs of dimensions, so a wholly rotated head needs an even "
                "head_dim: change it to an even number")
    kind = rope.get("rope_type", rope.get("type"))
    if ROPE_LEGACY.get(kind, kind) == "longrope":
        for name in ("short_factor", "long_factor"):
            factors = rope[name]
            if not isinstance(factors, list) or not all(_number(f) for f in factors) or len(factors) != rotary // 2:
                has = _entries(len(factors)) if isinstance(factors, list) and all(_number(f) for f in factors) else repr(factors)
                return (f"{key(at)}.{name}{source} has {has} but longrope needs {rotary // 2} numbers (one per rotated pair "
                        f"of head_dim={dim})")
    return None
