"""A structurally wrong model config (issue 27) is refused before any rank starts, in one line naming the
keys, their values and what to do, for model.init, a local config.json and model.architecture alike
(finetune/families/structure.py); and transformers itself rejects every config refused here: its config
validation raises, its model cannot be built or run a forward on the meta device, or it warns about the
same key (a RoPE factor below 1: the run would go on, wrong). Nothing is built beyond the meta device but
tiny MoE and GPT-2 models on CPU (the meta device cannot route tokens or run GPT-2's dropout)."""

from __future__ import annotations

import copy
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

from conftest import config_keys, run_cli
from finetune.launcher.compose import preflight
from finetune.config import ConfigError
from finetune.families.structure import ATTENTION_LAYER_TYPES, HEADS_DIVIDE_HIDDEN, MLP_LAYER_TYPES, ROPE_REQUIRED, structure_problem

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LINEAR = {"rope_type": "linear", "rope_theta": 10000.0}

# (id, model_type, config.json keys beyond BASE, the line: {file} is the config.json)
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("heads_divide_hidden", "llama", dict(num_attention_heads=5, num_key_value_heads=5),
     "num_attention_heads=5 does not divide hidden_size=64 in {file}: transformers' llama splits hidden_size evenly over the "
     "attention heads, head_dim or not: use a num_attention_heads that divides 64 (e.g. 4 or 8)"),
    ("heads_divide_hidden_with_head_dim", "llama", dict(num_attention_heads=5, num_key_value_heads=5, head_dim=16),
     "num_attention_heads=5 does not divide hidden_size=64 in {file}: transformers' llama splits hidden_size evenly over the "
     "attention heads, head_dim or not: use a num_attention_heads that divides 64 (e.g. 4 or 8)"),
    ("heads_divide_hidden_stablelm", "stablelm", dict(num_attention_heads=6, head_dim=16),  # its attention refuses it
     "num_attention_heads=6 does not divide hidden_size=64 in {file}: transformers' stablelm splits hidden_size evenly over the "
     "attention heads, head_dim or not: use a num_attention_heads that divides 64 (e.g. 4 or 8)"),
    ("kv_heads_divide_heads", "mistral", dict(num_key_value_heads=3),
     "num_key_value_heads=3 does not divide num_attention_heads=4 in {file}: each key/value head serves a whole group of "
     "query heads, so it must divide 4: use one of 1, 2, 4"),
    ("kv_heads_exceed_heads", "qwen2", dict(num_key_value_heads=8),
     "num_key_value_heads=8 exceeds num_attention_heads=4 in {file}: each key/value head serves a whole group of query "
     "heads, so it must divide 4: use one of 1, 2, 4"),
    ("kv_heads_exceed_heads_llama", "llama", dict(num_key_value_heads=8),
     "num_key_value_heads=8 exceeds num_attention_heads=4 in {file}: each key/value head serves a whole group of query "
     "heads, so it must divide 4: use one of 1, 2, 4"),
    ("size_not_an_integer", "llama", dict(hidden_size=64.5),
     "hidden_size=64.5 in {file} must be a positive integer: fix it (copy it from the model's config.json)"),
    ("size_zero", "llama", dict(num_attention_heads=0),
     "num_attention_heads=0 in {file} must be a positive integer: fix it (copy it from the model's config.json)"),
    ("switch_not_a_bool", "llama", dict(attention_bias="yes"), "attention_bias='yes' in {file} must be true or false"),
    ("odd_head_dim", "qwen3", dict(head_dim=9, rope_theta=1e6),
     "head_dim=9 is odd in {file}: RoPE rotates pairs of dimensions, so a wholly rotated head needs an even head_dim: "
     "change it to an even number"),
    ("odd_head_dim_llama", "llama", dict(head_dim=15, rope_theta=10000.0),
     "head_dim=15 is odd in {file}: RoPE rotates pairs of dimensions, so a wholly rotated head needs an even head_dim: "
     "change it to an even number"),
    ("odd_derived_head_dim", "llama", dict(hidden_size=36, intermediate_size=72, rope_parameters=dict(LINEAR, rope_type="default")),
     "the head_dim hidden_size / num_attention_heads = 9 is odd in {file}: RoPE rotates pairs of dimensions, so a wholly "
     "rotated head needs an even head_dim: change it to an even number"),
    ("layer_types_length", "qwen2", dict(layer_types=["full_attention"]),
     "layer_types in {file} has 1 entry but num_hidden_layers=2: give one entry per layer (or set num_hidden_layers=1)"),
    ("layer_types_unknown", "qwen2", dict(layer_types=["full_attention", "sliding_atention"]),
     "layer_types in {file} has 'sliding_atention', not a layer type transformers has: use one of "
     + ", ".join(ATTENTION_LAYER_TYPES)),
    ("top_k_exceeds_experts", "mixtral", dict(num_local_experts=4, num_experts_per_tok=6),
     "num_experts_per_tok=6 exceeds num_local_experts=4 in {file}: a token is routed to num_experts_per_tok of the "
     "experts: use at most 4"),
    ("rope_unknown_type", "llama", dict(rope_parameters={"rope_type": "linaer", "factor": 2.0, "rope_theta": 10000.0}),
     "rope_parameters.rope_type='linaer' in {file} is not a RoPE type transformers has: use one of default, axial, "
     "proportional, linear, dynamic, yarn, longrope, llama3"),
    ("rope_missing_factor", "llama", dict(rope_parameters=dict(LINEAR)),
     "rope_parameters in {file} has rope_type=linear without factor: add rope_parameters.factor"),
    ("rope_legacy_scaling_missing_factor", "llama", dict(rope_scaling={"type": "dynamic"}),
     "rope_scaling in {file} has rope_type=dynamic without factor: add rope_scaling.factor"),
    ("rope_scaling_unknown_type", "llama", dict(rope_theta=10000.0, rope_scaling={"rope_type": "bogus", "factor": 2.0}),
     "rope_scaling.rope_type='bogus' in {file} is not a RoPE type transformers has: use one of default, axial, proportional, "
     "linear, dynamic, yarn, longrope, llama3"),
    ("rope_scaling_llama3_keys", "llama", dict(rope_theta=10000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "rope_scaling in {file} has rope_type=llama3 without low_freq_factor, high_freq_factor: add rope_scaling.low_freq_factor"),
    ("rope_scaling_linear_factor", "qwen3", dict(head_dim=16, rope_theta=10000.0, rope_scaling={"rope_type": "linear"}),
     "rope_scaling in {file} has rope_type=linear without factor: add rope_scaling.factor"),
    ("rope_factor_below_one", "llama", dict(rope_parameters={**LINEAR, "factor": 0.5}),
     "rope_parameters.factor=0.5 in {file} must be a number of at least 1 (how many times the original context the linear "
     "scaling stretches to)"),
    ("rope_partial_rotary_factor", "stablelm", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                      "partial_rotary_factor": 1.5}),
     "rope_parameters.partial_rotary_factor=1.5 in {file} must be a number from 0 to 1: the share of head_dim that RoPE rotates"),
    ("rope_not_a_mapping", "llama", dict(rope_parameters="linear"),
     "rope_parameters='linear' in {file} must be a mapping (rope_type and its parameters) or null"),
    ("rope_llama3_frequencies", "llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                               "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                                                               "original_max_position_embeddings": 128}),
     "rope_parameters.high_freq_factor=1.0 must be a number above rope_parameters.low_freq_factor=4.0 in {file} "
     "(Llama 3.1 uses 4.0 and 1.0)"),
    ("rope_llama3_original_context", "llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                    "original_max_position_embeddings": 512}),
     "rope_parameters.original_max_position_embeddings=512 must be an integer below max_position_embeddings=256 in {file} "
     "(the pre-training context that llama3 scaling stretches)"),
    ("rope_yarn_betas", "qwen2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 1.0,
                                                       "beta_slow": 32.0, "original_max_position_embeddings": 64}),
     "rope_parameters.beta_fast=1.0 is below rope_parameters.beta_slow=32.0 in {file}: yarn's extrapolation bound must be "
     "above its interpolation bound"),
    ("rope_yarn_attention_factor", "qwen2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                                  "attention_factor": -1.0, "original_max_position_embeddings": 64}),
     "rope_parameters.attention_factor=-1.0 in {file} must be a number of at least 0"),
    ("rope_longrope_factor_lengths", "phi3", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0,
                                                                   "short_factor": [1.0] * 3, "long_factor": [1.0] * 3,
                                                                   "original_max_position_embeddings": 128}),
     "rope_parameters.short_factor in {file} has 3 entries but longrope needs 8 numbers (one per rotated pair of head_dim=16)"),
    ("rope_per_layer_type", "gemma3_text", dict(head_dim=16, layer_types=["sliding_attention", "full_attention"],
                                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                                 "full_attention": dict(LINEAR)}),
     "rope_parameters.full_attention in {file} has rope_type=linear without factor: add rope_parameters.full_attention.factor"),
]
IDS = [c[0] for c in CASES]


def config_dir(directory: Path, model_type: str, keys: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": model_type, **BASE, **keys}))
    return directory


@pytest.mark.parametrize("case,model_type,keys,line", CASES, ids=IDS)
def test_a_structural_mistake_is_one_line_before_any_rank(case, model_type, keys, line, tmp_path):
    d = config_dir(tmp_path / "m", model_type, keys)
    with pytest.raises(ConfigError) as e:
        preflight(["+recipe=quickstart_sft", "model=pretrained", f"model.path={d}"])
    assert str(e.value) == line.format(file=d / "config.json")


def transformers_gets(model_type: str, keys: dict[str, Any], upto: int = 3, device: str = "meta") -> tuple[int, str | None]:
    """How far transformers gets with a config, trying no further than `upto` (0 its config raises, 1 its model
    cannot be built, 2 its forward fails, 3 it runs), and why it stopped (None: it did not). A MoE's experts run as
    batched matmuls (transformers' default, grouped_mm, takes only bf16 on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    reached = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.for_model(model_type, **copy.deepcopy(keys))  # it standardises dicts in place
            reached = 1
            if upto > 1:
                with torch.device(device):
                    model = AutoModelForCausalLM.from_config(config, experts_implementation="batched_mm")
                    reached = 2
                    if upto > 2:
                        model(torch.ones(1, 4, dtype=torch.long))
                        reached = 3
    except Exception as e:  # noqa: BLE001 - any refusal of transformers' is its verdict
        return reached, f"{type(e).__name__}: {e}"
    return reached, None


def transformers_verdict(model_type: str, keys: dict[str, Any], device: str = "meta") -> str | None:
    """transformers' own reason to reject a config: its config class raises, its model cannot be built or run
    a forward (meta device: shapes only; a MoE on CPU, 64 wide: its routing is data-dependent, which meta
    cannot run, nor GPT-2's dropout), or it logs a warning naming one of `keys`' RoPE keys; None: accepted."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        _, reason = transformers_gets(model_type, {**BASE, **keys}, device="cpu" if "num_local_experts" in keys else device)
    finally:
        logger.removeHandler(handler)
    if reason:
        return reason
    rope = next((v for k, v in keys.items() if k.startswith("rope_") and isinstance(v, dict)), {})
    named = [m for m in seen if any(f"{k}" in m for k in rope if k not in ("rope_type", "rope_theta"))]
    return named[0] if named else None


@pytest.mark.parametrize("case,model_type,keys,line", CASES, ids=IDS)
def test_transformers_rejects_every_config_refused_here(case, model_type, keys, line):
    assert transformers_verdict(model_type, keys) is not None


@pytest.mark.parametrize("model_type", sorted({c[1] for c in CASES}))
def test_the_base_configs_pass_both(model_type, tmp_path):
    """Without the mistake transformers accepts the config (no raise, no warning about the keys) and so does the check:
    the verdicts above are about the mistake."""
    keys = {"head_dim": 16} if model_type == "gemma3_text" else {}
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
            "original_max_position_embeddings": 128} if model_type == "phi3" else {**LINEAR, "factor": 2.0}  # Phi-3: longrope only
    moe = {"num_local_experts": 4, "num_experts_per_tok": 2} if model_type == "mixtral" else {}
    assert transformers_verdict(model_type, {**keys, **moe, "rope_parameters": rope}) is None
    d = config_dir(tmp_path / "m", model_type, keys)
    preflight(["+recipe=quickstart_sft", "model=pretrained", f"model.path={d}"])


def test_the_lists_copied_from_transformers_are_its_own():
    from transformers import configuration_utils as cu
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ATTENTION_LAYER_TYPES) == set(cu.ALLOWED_ATTN_LAYER_TYPES) | set(cu._LEGACY_LAYER_TYPE_REMAP)
    assert set(MLP_LAYER_TYPES) == set(cu.ALLOWED_MLP_LAYER_TYPES)
    assert set(ROPE_REQUIRED) == set(ROPE_INIT_FUNCTIONS) | {"default", "axial"}


HEADS = dict(intermediate_size=128, num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2, vocab_size=128,
             max_position_embeddings=256, moe_intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def test_heads_divide_hidden_is_where_transformers_refuses_it():
    """Every causal LM of transformers, 100 wide over 6 heads, with head_dim 16 stated (as a config.json may, whatever
    the family reads) and without: it refuses where the same config 96 wide gets further (its config, build or forward),
    accepts where it runs. HEADS_DIVIDE_HIDDEN is exactly the refusing set, none of which accepts either way; the check
    refuses those and passes every type that accepts (Mistral, Qwen2...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    logging.disable(logging.ERROR)  # transformers' notes on keys a family does not take (falcon's head_dim)
    refuses, accepts = set(), set()
    try:
        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            keys = config_keys(model_type)
            if not {"hidden_size", "num_attention_heads"} <= keys:
                continue
            small = {k: v for k, v in HEADS.items() if k in keys}
            for head_dim in ({"head_dim": 16}, {}):
                odd, _ = transformers_gets(model_type, {**small, **head_dim, "hidden_size": 100})
                if odd == 3:
                    accepts.add(model_type)
                elif transformers_gets(model_type, {**small, **head_dim, "hidden_size": 96}, upto=odd + 1)[0] > odd:
                    refuses.add(model_type)
    finally:
        logging.disable(logging.NOTSET)
    assert refuses == HEADS_DIVIDE_HIDDEN, (sorted(refuses - HEADS_DIVIDE_HIDDEN), sorted(HEADS_DIVIDE_HIDDEN - refuses))
    assert not refuses & accepts, sorted(refuses & accepts)
    assert {"mistral", "mixtral", "qwen2", "qwen3", "gemma", "olmo2", "granite", "phi3"} <= accepts  # docs/concepts.md names these
    refused = {t for t in refuses | accepts
               if structure_problem({**HEADS, "model_type": t, "hidden_size": 100, "head_dim": 16}, lambda k: k)}
    assert refused == refuses


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_heads_that_do_not_divide_hidden_size_pass_where_the_family_takes_head_dim(model_type, tmp_path):
    """Mistral and Qwen2 size q/k/v by head_dim, not hidden_size / heads: 100 wide over 6 heads of 16 builds and runs
    (meta device), the dry run's checks pass it, and the planner counts what transformers builds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.planner.counts import architecture

    keys = dict(hidden_size=100, num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    cfg = preflight(["+recipe=quickstart_sft", "model=pretrained", f"model.path={config_dir(tmp_path / 'm', model_type, keys)}"])
    assert transformers_verdict(model_type, keys) is None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**BASE, **keys}))
    assert tuple(model.model.layers[0].self_attn.q_proj.weight.shape) == (6 * 16, 100)
    assert architecture(cfg.model).params == sum(p.numel() for p in model.parameters())


def test_a_mistral_model_init_whose_heads_do_not_divide_hidden_size_passes_the_dry_run(tmp_path):
    """model.init has no head_dim: Mistral takes 100 // 6 = 16 and builds; the dry run passes it (and refuses Llama's)."""
    init = ["model.init.hidden_size=100", "model.init.num_attention_heads=6", "model.init.num_key_value_heads=2"]
    assert transformers_verdict("mistral", dict(hidden_size=100, num_attention_heads=6, num_key_value_heads=2)) is None
    out = run_cli("+recipe=quickstart_sft", "model.init.model_type=mistral", *init, "launcher.dry_run=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    with pytest.raises(ConfigError) as e:
        preflight(["+recipe=quickstart_sft", *init])
    assert str(e.value) == ("model.init.num_attention_heads=6 does not divide model.init.hidden_size=100: transformers' llama "
                            "splits hidden_size evenly over the attention heads, head_dim or not: use a "
                            "model.init.num_attention_heads that divides 100 (e.g. 5 or 10)")


def test_a_config_transformers_builds_passes():
    """Real models' configs (the hub recipes' model.architecture) pass the check."""
    for name in ("llama3_1_8b", "gemma2_9b", "phi3_5_mini", "qwen3_30b_a3b", "mixtral_8x7b", "olmo2_7b"):
        cfg = preflight(["+recipe=quickstart_sft", f"model={name}"])
        assert structure_problem(dict(cfg.model.architecture), lambda k: k) is None


def test_model_init_and_a_recipes_architecture_are_checked_alike(compose):
    """model.init has no RoPE keys: a family that rotates (COUNTED, no learned positions) is checked under its default
    RoPE, GPT-2 (learned positions) is not; a recipe's model.architecture is checked as a config.json would be."""
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "model.init.num_attention_heads=8", "model.init.num_key_value_heads=3"])
    assert str(e.value) == ("model.init.num_key_value_heads=3 does not divide model.init.num_attention_heads=8: each key/value "
                            "head serves a whole group of query heads, so it must divide 8: use one of 1, 2, 4, 8")
    odd = ["model.init.hidden_size=120", "model.init.num_attention_heads=8", "model.init.num_key_value_heads=8"]  # 15 wide
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", *odd])
    assert str(e.value) == ("the head_dim model.init.hidden_size / model.init.num_attention_heads = 15 is odd: RoPE rotates "
                            "pairs of dimensions, so a wholly rotated head needs an even head_dim: change it to an even number")
    assert transformers_verdict("llama", dict(hidden_size=120, num_attention_heads=8, num_key_value_heads=8)) is not None
    with pytest.raises(ConfigError) as e:
        compose(["model=llama3_1_8b", "+model.architecture.rope_scaling={rope_type:llama3,factor:8.0}"])
    assert str(e.value) == ("model.architecture.rope_scaling has rope_type=llama3 without low_freq_factor, high_freq_factor: add "
                            "model.architecture.rope_scaling.low_freq_factor")
    compose(["model=llama3_1_8b"])  # the shipped real-model recipes pass
    compose(["+recipe=quickstart_sft", "model.init.model_type=gpt2", *odd])  # learned positions, no rotary: an odd head is fine
    assert transformers_verdict("gpt2", dict(hidden_size=120, num_attention_heads=8, num_key_value_heads=8), "cpu") is None
    compose(["+recipe=quickstart_sft", "model.init.model_type=qwen3", *odd])  # Qwen3's head_dim is its own 128, whatever 120 / 8
    assert transformers_verdict("qwen3", dict(hidden_size=120, num_attention_heads=8, num_key_value_heads=8)) is None


# The same mistakes through the real command line, one per source: model.init, model.architecture, a config.json.
CLI = [
    (["model.init.num_attention_heads=6"],
     "error: model.init.num_attention_heads=6 does not divide model.init.hidden_size=128: transformers' llama splits "
     "hidden_size evenly over the attention heads, head_dim or not: use a model.init.num_attention_heads that divides 128 "
     "(e.g. 4 or 8)"),
    (["model=pretrained", "model.path=org/model", "model.tokenizer={tokenizer}",
      "+model.architecture={{model_type:llama,hidden_size:64,num_attention_heads:4,num_key_value_heads:3}}"],
     "error: model.architecture.num_key_value_heads=3 does not divide model.architecture.num_attention_heads=4: each "
     "key/value head serves a whole group of query heads, so it must divide 4: use one of 1, 2, 4"),
    (["model=pretrained", "model.path={dir}"],
     "error: rope_parameters in {dir}/config.json has rope_type=llama3 without low_freq_factor, high_freq_factor: add "
     "rope_parameters.low_freq_factor"),
]


@pytest.mark.parametrize("overrides,line", CLI, ids=["init", "architecture", "config_json"])
def test_the_dry_run_refuses_it_in_one_line(overrides, line, tmp_path):
    from finetune.config import ASSETS

    d = config_dir(tmp_path / "m", "llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}))
    subst = {"dir": d, "tokenizer": ASSETS / "tokenizer"}
    out = run_cli("+recipe=quickstart_sft", "launcher.dry_run=true", *(o.format(**subst) for o in overrides), cwd=tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stdout + out.stderr
    assert (out.stderr.strip() or out.stdout.strip()).splitlines()[-1] == line.format(**subst)


def test_a_legacy_rope_name_is_read_as_transformers_reads_it(tmp_path):
    """Phi-3 configs on the hub may say rope_scaling.type=su (longrope's old name), which transformers reads as longrope
    but without filling in original_max_position_embeddings: refused without it, by both; accepted with it, by both."""
    rope = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    d = config_dir(tmp_path / "m", "phi3", {"rope_scaling": rope})
    with pytest.raises(ConfigError) as e:
        preflight(["+recipe=quickstart_sft", "model=pretrained", f"model.path={d}"])
    assert str(e.value) == (f"rope_scaling in {d / 'config.json'} has rope_type=longrope without original_max_position_embeddings: "
                            "add rope_scaling.original_max_position_embeddings")
    assert transformers_verdict("phi3", {"rope_scaling": rope}) is not None
    rope.update(original_max_position_embeddings=128, factor=2.0)
    assert transformers_verdict("phi3", {"rope_scaling": rope}) is None
    d = config_dir(tmp_path / "n", "phi3", {"rope_scaling": rope})
    preflight(["+recipe=quickstart_sft", "model=pretrained", f"model.path={d}"])
