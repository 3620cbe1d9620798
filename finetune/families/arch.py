"""A family's structure read from a config.json (a dict), counted exactly as `AutoModelForCausalLM.from_config`
builds it: `arch_from_config` for a family with a record (finetune.families.records), `arch_from_build` off
transformers' meta-device build for a decoder without one, `uncountable` for what neither can count. The
`Arch` it returns (blocks of `Linear`s, a `Moe`'s experts) is what the planner, the rules and the layouts read.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from typing import Any, Callable

from finetune.config import ConfigError
from finetune.families.checks import adapted, attention_limits
from finetune.families.records import COUNTED, EXTRAS, FAMILIES, LLAMA_NAMES, NORM_TOPK_DEFAULT, Family, config_value
from finetune.families.shapes import Arch, Block, Linear, Moe
from finetune.families.vision import parts as vision_parts

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
        return ("finetune/families/records.py has no record of its blocks (COUNTED: the decoders whose count "
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


def _attention(arch: dict[str, Any], fam: Family, names: dict[str, str], source: str, *, h: int, heads: int, kv: int,
               head_dim: int) -> tuple[tuple[Linear, ...], dict[str, tuple[str, ...]], int, int, int, int, int]:
    """A block's attention: (its linears, their roles, head_dim and kv heads as attention sees them, the q and k widths,
    the latent norms' width: multi-head latent attention's)."""
    family = str(arch.get("model_type") or "")
    q, k = heads * head_dim, kv * head_dim
    qkv_bias, o_bias = _flag(arch, fam.qkv_bias), _flag(arch, fam.o_bias)
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
    return attention, roles, head_dim, kv, q, k, latent_norms


def _mlp(fam: Family, names: dict[str, str], h: int, prefix: str, i: int, bias: bool) -> tuple[tuple[Linear, ...], dict[str, tuple[str, ...]]]:
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


def _sparse_block(arch: dict[str, Any], fam: Family, source: str, mlp: Callable[..., Any], *, attention: tuple[Linear, ...],
                  roles: dict[str, tuple[str, ...]], norms: int, extras: Callable[..., int], width: int, experts: int) -> Block:
    """A MoE block: the router and the experts' fused weights (`width` wide each), a shared expert where the family has one."""
    model_type = family = str(arch.get("model_type") or "")
    h = _int(arch, "hidden_size", source, family)
    expert = width
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
                          f"(n_shared_experts={count}): finetune/families/records.py does not describe this family's")
    if count:  # DeepSeek-style: n_shared_experts experts' width in one gated MLP on every token
        shared = count * _int(arch, fam.shared_width, source, family)
        shared_mlp, shared_roles = mlp(fam.shared + ".", shared)
        sparse_mlp += shared_mlp
        sparse_roles = {role: sparse_roles[role] + shared_roles[role] for role in sparse_roles}
    moe = Moe(experts, top_k, expert, bool(arch.get("norm_topk_prob", NORM_TOPK_DEFAULT.get(model_type, True))))
    return Block(attention + sparse_mlp, norms + extras(expert, experts), top_k * expert + shared, roles | sparse_roles, moe)


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
    mlp_bias = _flag(arch, fam.mlp_bias)
    attention, roles, head_dim, kv, q, k, latent_norms = _attention(arch, fam, names, source, h=h, heads=heads, kv=kv, head_dim=head_dim)
    qk = {"head": 2 * head_dim, "full": q + k}.get(fam.qk_norm, 0) if not fam.qk_norm_key or arch.get(fam.qk_norm_key) else 0
    block_norms = fam.block_norms - bool(fam.parallel_key and arch.get(fam.parallel_key)) \
        - (fam.post_norms if fam.post_norm_key and not arch.get(fam.post_norm_key) else 0)
    norms = block_norms * norm + qk * (2 if fam.qk_norm_bias else 1) + latent_norms

    def extras(i: int, routed: int = 0) -> int:
        return sum(EXTRAS[kind](h, heads, head_dim, i, routed) for kind in fam.extras)

    def mlp(prefix: str, i: int, bias: bool = mlp_bias) -> tuple[tuple[Linear, ...], dict[str, tuple[str, ...]]]:
        return _mlp(fam, names, h, prefix, i, bias)

    blocks = []
    if not all(sparse):
        dense_mlp, dense_roles = mlp("", width)
        blocks.append(Block(attention + dense_mlp, norms + extras(width), width, roles | dense_roles))
    if experts:
        blocks.append(_sparse_block(arch, fam, source, mlp, attention=attention, roles=roles, norms=norms, extras=extras,
                                    width=experts_width or width, experts=experts))
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


@contextlib.contextmanager
def _without_zero3() -> Any:
    """transformers' ZeRO-3 flag off while the planner builds on the meta device: a ZeRO-3 rank keeps it set for the
    whole run (finetune.rank.model.zero3_context), and under it from_config would partition the build with collectives
    that only this rank (rank 0 plans) enters."""
    from transformers.integrations import deepspeed as hf_deepspeed

    held = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = held


@functools.lru_cache(maxsize=16)
def _built(key: str) -> Arch | str:
    arch = json.loads(key)
    model_type = str(arch.get("model_type") or "")
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    from transformers.pytorch_utils import Conv1D
    from transformers.utils import logging as hf_logging

    image_text = isinstance(arch.get("vision_config"), dict) and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not image_text:
        return "transformers has no causal language model of this model_type to build it from"
    auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM  # what the ranks build (methods.base.built_as)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kind = CONFIG_MAPPING[model_type]
            decode = getattr(kind, "_decode_special_floats", lambda obj: obj)  # {"__float__": "Infinity"}, as from_pretrained reads it
            config = kind.from_dict(decode(arch))
            with torch.device("meta"), _without_zero3():
                model = auto.from_config(config)
    except Exception as e:  # noqa: BLE001 - its reason, in the refusal
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"transformers cannot build it from this config ({type(e).__name__}: {first[:200]})"
    finally:
        hf_logging.set_verbosity(verbosity)
    found = vision_parts(model)  # a vision-language model: its layers are the language model's
    root = found.language if found.vision is not None and found.language is not None else model
    lists = [m for m in root.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
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

    tower, patch_input = _tower(found.vision, (torch.nn.Linear, Conv1D)) if found.vision is not None else (None, 0)
    return Arch(model_type=model_type, hidden_size=h, num_hidden_layers=len(blocks), num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, tie_word_embeddings=tied, layers=blocks,
                final_norm=rest, head_bias=head_bias, known=False, attention=attention_limits(arch),
                act=str(first("hidden_act", "hidden_activation", "activation_function", default="silu")),
                attention_dropout=float(first("attention_dropout", "attn_pdrop", default=0.0)),
                residual_dropout=float(first("resid_pdrop", default=0.0)),
                image_parts=tuple((part, found.count(part)) for part in ("vision", "projector", "language")) if found.vision is not None else (),
                tower=tower, patch_input=patch_input)


def _tower(vision: Any, linear_types: tuple[type, ...]) -> tuple[Arch | None, int]:
    """A built vision tower as the planner counts its activations: its largest stack of blocks read as the language
    model's are (`_block`), and the pixel values its patch embedding reads per patch (its first convolution's kernel, or
    its first linear's input); (None, 0) where it has no stack of blocks."""
    import torch

    lists = [m for m in vision.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return None, 0
    stack = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    first = next((m for m in stack[0].modules() if isinstance(m, linear_types)), None)
    if first is None:
        return None, 0
    h = int(first.weight.shape[1] if first.weight.dim() == 2 and not hasattr(first, "nf") else first.weight.shape[0])
    blocks = tuple(_block(layer, h, {}, linear_types, set()) for layer in stack)
    conv = next((m for m in vision.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))), None)
    patch = math.prod(conv.weight.shape[1:]) if conv is not None else int(first.weight.shape[-1])
    heads = next((int(getattr(m, k)) for m in stack[0].modules() for k in ("num_heads", "num_attention_heads")
                  if isinstance(getattr(m, k, None), int)), 1)
    return Arch(model_type="vision_tower", hidden_size=h, num_hidden_layers=len(blocks), num_attention_heads=heads,
                num_key_value_heads=heads, head_dim=max(h // heads, 1), vocab_size=0, tie_word_embeddings=False, layers=blocks,
                final_norm=0, known=False, act="gelu"), int(patch)


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
