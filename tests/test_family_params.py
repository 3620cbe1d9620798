"""The planner counts every family's parameters exactly from its config.json (finetune/families/),
LoRA's trainable parameters as PEFT does, and a hub model's published size from its recipe's
model.architecture, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_cli
from finetune.launcher.compose import preflight
from finetune.config import ConfigError, ModelConfig
from finetune.families import FAMILIES, arch_from_config
from finetune.planner.counts import architecture, count_params

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GPT2 = dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2)

CASES = [  # (family, config keys beyond SMALL): tied and untied, biases, head_dim != hidden/heads, dense and MoE
    ("llama", {}),
    ("llama", dict(attention_bias=True, mlp_bias=True, head_dim=24, tie_word_embeddings=True)),
    ("qwen2", {}),
    ("qwen2", dict(tie_word_embeddings=True)),
    ("qwen3", {}),  # head_dim 128 by default, q/k norms
    ("qwen3", dict(head_dim=8, attention_bias=True, tie_word_embeddings=True)),
    ("mistral", dict(head_dim=32)),
    ("gemma", {}),
    ("gemma2", {}),  # head_dim 256, four norms per block, tied
    ("gemma2", dict(head_dim=8, tie_word_embeddings=False)),
    ("gemma3_text", {}),
    ("phi3", {}),
    ("phi3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    ("olmo2", dict(head_dim=24)),
    ("granite", dict(attention_bias=True, mlp_bias=True)),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("mixtral", dict(num_local_experts=4, head_dim=8, tie_word_embeddings=True)),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0])),  # a dense layer among sparse ones
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2)),  # every second layer sparse
    ("qwen2_moe", dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    ("gpt2", {}),  # Conv1D, learned positions, biases, LayerNorm, tied, n_* aliases
    ("gpt2", dict(n_inner=80, tie_word_embeddings=False)),
]


def build(family: str, keys: dict, directory: Path, device: str = "meta") -> torch.nn.Module:
    """The family built from its config, and that config written as DIRECTORY/config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **{**(GPT2 if family == "gpt2" else SMALL), **keys})
    directory.mkdir(parents=True, exist_ok=True)
    config.to_json_file(directory / "config.json")
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family,keys", CASES, ids=[f"{f}-{'-'.join(k) or 'defaults'}" for f, k in CASES])
def test_the_planner_counts_each_family_exactly(family, keys, tmp_path):
    model = build(family, keys, tmp_path / family)
    arch = architecture(ModelConfig(path=str(tmp_path / family)))
    assert arch.known
    assert arch.params == sum(p.numel() for p in model.parameters())
    modules = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    assert arch.largest_layer_params == max(modules)  # what ZeRO-3 gathers at a time


def test_every_listed_family_is_tested():
    assert {f for f, _ in CASES} == set(FAMILIES)


@pytest.mark.parametrize("family,keys,lora", [
    ("llama", dict(attention_bias=True), ["peft=lora"]),
    ("llama", {}, ["peft=dora", "peft.target_modules=[q_proj,v_proj]"]),
    ("qwen3", dict(head_dim=8), ["peft=lora"]),
    ("phi3", {}, ["peft=lora"]),
    ("phi3", {}, ["peft=lora", "peft.target_modules=[qkv_proj]"]),
    # MoE: all-linear adapts the fused experts too (PEFT's target_parameters, r per expert), not the router
    ("mixtral", dict(num_local_experts=4), ["peft=lora", "peft.target_modules=[q_proj,k_proj,v_proj,o_proj]"]),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), ["peft=lora"]),
    ("mixtral", dict(num_local_experts=4), ["peft=lora", "peft.target_modules=[q_proj,experts,gate]"]),  # the router named
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), ["peft=lora", "peft.dropout=0"]),
    ("mixtral", dict(num_local_experts=4, head_dim=8), ["peft=dora", "peft.target_modules=[q_proj,v_proj]"]),
    ("qwen2_moe", dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48), ["peft=lora"]),
    ("gpt2", {}, ["peft=lora", "peft.r=4"]),
    ("gpt2", {}, ["peft=lora", "peft.target_modules=[c_proj]"]),  # attn.c_proj and mlp.c_proj
])
def test_lora_trainable_count_matches_peft(family, keys, lora, tmp_path):
    from finetune.rank.model import apply_strategies, trainable_parameters

    model = build(family, keys, tmp_path / family, device="cpu")
    cfg = preflight(["+recipe=quickstart_sft", "model=pretrained", f"model.path={tmp_path / family}", *lora])
    counts = count_params(architecture(cfg.model), cfg)
    trainable, total = trainable_parameters(apply_strategies(model, checkpointing=cfg.checkpointing, peft=cfg.peft))
    assert (counts.trainable, counts.total) == (trainable, total)


def test_a_missing_key_is_named():
    config = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    with pytest.raises(ConfigError) as e:
        arch_from_config(config, "/m/config.json")
    assert str(e.value).startswith("/m/config.json has no intermediate_size: the planner needs it to count a qwen2 model's")


def test_a_model_type_the_planner_cannot_count_is_refused_in_one_line(compose, tmp_path):
    """Never a Llama-style guess: a model_type outside COUNTED that transformers cannot build either (no causal LM of
    that type: a remote-code model) is refused, naming it (the dry run skips the plan)."""
    from finetune.planner.peak import plan

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**SMALL, "model_type": "newfam"}))
    cfg = compose(["+recipe=quickstart_sft", "model=pretrained", f"model.path={tmp_path / 'm'}"])
    with pytest.raises(ConfigError) as e:
        plan(cfg)
    assert str(e.value) == (f"the planner cannot count model_type=newfam ({tmp_path / 'm' / 'config.json'}): finetune/families/records.py "
                            "has no record of its blocks (COUNTED: the decoders whose count tests/test_causal_lm_counts.py checks "
                            "against transformers' own build), and transformers has no causal language model of this model_type "
                            "to build it from; no memory plan can be made for it")


def test_a_multimodal_wrapper_is_counted_whole_not_as_its_text_model(compose, tmp_path):
    """local_config hands the layout checks the text_config; the planner counts what AutoModelForCausalLM loads from the
    whole config (the vision tower too), read off transformers' build on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.planner.counts import architecture

    (tmp_path / "m").mkdir()
    text = {**SMALL, "model_type": "gemma3_text", "head_dim": 16}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text, "vision_config": vision,
                                                            "mm_tokens_per_image": 4}))
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "m"))
    arch = architecture(ModelConfig(path=str(tmp_path / "m")))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(text))
    assert arch.params == sum(p.numel() for p in built.parameters()) > architecture(ModelConfig(path=str(tmp_path / "t"))).params
    assert not arch.known


# ---------------------------------------------------------------------------------------------
# Hub models: recipes/model/<name>.yaml declares model.architecture

PUBLISHED = {  # the hub's "model size" (safetensors parameter count), as printed on each model page
    "llama3_2_1b": "1.24", "llama3_1_8b": "8.03", "llama3_1_70b": "70.6", "qwen2_5_7b": "7.62", "qwen3_8b": "8.19",
    "qwen3_30b_a3b": "30.5", "mistral_7b_v0_3": "7.25", "gemma2_9b": "9.24", "phi3_5_mini": "3.82", "olmo2_7b": "7.30",
    "mixtral_8x7b": "46.7",
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_recipes_plan_their_published_size_offline(name):
    """Billions, compared at the precision published: 3 significant digits (rounding the planner's exact
    count to them gives the published figure; a 0.1% tolerance would be finer than the figure itself)."""
    cfg = preflight(["+recipe=quickstart_sft", f"model={name}", "hardware=h100_80g", "precision=bf16"])
    assert cfg.model.tokenizer is None and cfg.model.architecture
    published = PUBLISHED[name]
    decimals = len(published.split(".")[1])
    assert f"{architecture(cfg.model).params / 1e9:.{decimals}f}" == published
    text = (REPO / "recipes" / "model" / f"{name}.yaml").read_text()
    assert f"https://huggingface.co/{cfg.model.path}/blob/main/config.json" in text and f"parameters: {published}B" in text


def test_every_hub_recipe_has_a_published_size():
    hub = {p.stem for p in (REPO / "recipes" / "model").glob("*.yaml") if p.stem not in ("tiny", "tiny_vlm", "pretrained")}
    assert hub == set(PUBLISHED)


def test_plan_and_dry_run_of_a_hub_recipe_need_no_network(tmp_path):
    planned = run_cli("+recipe=quickstart_sft", "model=llama3_1_8b", "hardware=h100_80g", "precision=bf16", "zero=stage3",
                      "launcher.nproc_per_node=8", "train.global_batch_size=8", "train.micro_batch_size=1",
                      cwd=tmp_path, module="finetune.plan")
    assert planned.returncode == 0, planned.stderr
    assert "parameters   8,030,261,248 (8,030,261,248 trainable)" in planned.stdout
    launched = run_cli("+recipe=quickstart_sft", "model=mixtral_8x7b", "launcher.dry_run=true", cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    assert "memory plan" in launched.stdout and "finetune.train" in launched.stdout


def test_the_layout_is_checked_against_the_declared_architecture():
    with pytest.raises(ConfigError) as e:
        preflight(["+recipe=quickstart_sft", "model=qwen2_5_7b", "parallelism=tp8", "launcher.nproc_per_node=8", "hardware=h100_80g"])
    assert str(e.value) == "parallelism.tp=8 must divide the model's num_attention_heads=28: use a tp that divides 28"


def test_a_hub_id_without_architecture_is_refused_by_the_planner():
    from finetune.planner.peak import plan

    cfg = preflight(["+recipe=quickstart_sft", "model=pretrained", "model.path=org/some-model"])
    with pytest.raises(ConfigError) as e:
        plan(cfg)
    assert "model.architecture is not set" in str(e.value)


def test_the_rank_refuses_a_hub_config_that_differs_from_the_declared_one(monkeypatch):
    """load_model reads the hub config first and names the first key that differs, before any weights."""
    import transformers
    from transformers import LlamaConfig

    from finetune.rank import model as model_module

    cfg = preflight(["+recipe=quickstart_sft", "model=llama3_1_8b"]).model
    published = LlamaConfig(**{k: v for k, v in cfg.architecture.items() if k != "model_type"})
    assert model_module.disk.architecture_mismatch(cfg.architecture, published, "x") is None
    wrong = LlamaConfig(**{**{k: v for k, v in cfg.architecture.items() if k != "model_type"}, "num_key_value_heads": 4})
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(lambda cls, *a, **k: wrong))
    with pytest.raises(ConfigError) as e:
        model_module.load_model(cfg, None, attention="sdpa", peft=preflight(["+recipe=quickstart_sft"]).peft,
                                compute_dtype=torch.float32, zero3=False, run_dir=Path("."), is_main=True, barrier=lambda: None)
    assert str(e.value) == ("model.architecture.num_key_value_heads=8 but meta-llama/Llama-3.1-8B's config.json has "
                            "num_key_value_heads=4: the memory plan and the layout checks were made for the declared "
                            "architecture; correct model.architecture.num_key_value_heads (copy it from the model's config.json)")


def test_architecture_with_a_random_init_model_is_refused():
    with pytest.raises(ConfigError) as e:
        preflight(["+recipe=quickstart_sft", "+model.architecture={model_type:llama,hidden_size:64}"])
    assert str(e.value).startswith("model.architecture declares a pretrained model.path's config")


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_routing_renormalisation_default_is_transformers_when_config_json_leaves_it_out(family):
    """norm_topk_prob missing from a config.json: the planner takes the family's transformers default
    (False for Qwen-MoE; Mixtral has no key and always renormalises)."""
    from transformers import AutoConfig

    from finetune.families import arch_from_config

    keys = dict(model_type=family, vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                **({"num_local_experts": 4} if family == "mixtral" else {"num_experts": 4}))
    moe = next(b.moe for b in arch_from_config(keys, "config.json").layers if b.moe is not None)
    assert moe.normalized is bool(getattr(AutoConfig.for_model(family), "norm_topk_prob", True))
