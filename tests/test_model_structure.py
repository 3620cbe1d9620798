"""A model config that is structurally wrong is refused in the dry run, in one line, whatever its model_type and
wherever it comes from (model.init, a local config.json, a recipe's model.architecture), and transformers
itself rejects each of these configs too (so the check is theirs, said earlier and plainly)."""

from __future__ import annotations

import json

import pytest

from conftest import last_line, run_cli

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)

CASES = {  # name: (model_type, config keys beyond SMALL, the line's text after "error: CONFIG: ")
    "kv_group": ("mistral", dict(num_key_value_heads=3),
                 "num_attention_heads=4 is not a multiple of num_key_value_heads=3: each key/value head serves an equal group of "
                 "query heads; use a num_key_value_heads that divides 4 (1, 2, 4)"),
    "kv_above_heads": ("llama", dict(num_key_value_heads=8),
                       "num_attention_heads=4 is not a multiple of num_key_value_heads=8: each key/value head serves an equal group "
                       "of query heads; use a num_key_value_heads that divides 4 (1, 2, 4)"),
    "odd_head_dim": ("llama", dict(head_dim=15),
                     "rotary position embeddings rotate pairs of dimensions, but each head has head_dim=15 (rotated: 15), an odd "
                     "number: choose sizes that give an even head size"),
    "rope_unknown": ("llama", dict(rope_scaling={"rope_type": "bogus", "factor": 2.0}),
                     "rope_scaling: rope_type='bogus' is not a rotary embedding transformers knows: use one of default, linear, "
                     "dynamic, yarn, longrope, llama3, proportional"),
    "rope_llama3_keys": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                         "rope_scaling: rope_type='llama3' needs low_freq_factor, high_freq_factor, original_max_position_embeddings "
                         "(set low_freq_factor and high_freq_factor and original_max_position_embeddings in rope_scaling), or use "
                         "another rope_type"),
    "rope_linear_factor": ("qwen3", dict(head_dim=16, rope_scaling={"rope_type": "linear"}),
                           "rope_scaling: rope_type='linear' needs factor (set factor in rope_scaling), or use another rope_type"),
}


def transformers_rejects(model_type: str, keys: dict) -> str:
    """transformers' own verdict: build the config and the model, run one forward (its validators, or a shape error)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(model_type, **{**SMALL, **keys})
        AutoModelForCausalLM.from_config(config)(torch.tensor([[1, 2, 3]]))
    except Exception as e:  # noqa: BLE001 - any refusal is what we want to see
        return type(e).__name__
    return ""


@pytest.mark.parametrize("case", list(CASES))
def test_a_structural_mistake_in_a_local_config_is_one_line_in_the_dry_run(case, tmp_path):
    model_type, keys, line = CASES[case]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": model_type, **SMALL, "rope_theta": 10000.0, **keys}))
    assert transformers_rejects(model_type, keys), f"transformers accepts {case}: the check would refuse a working model"
    out = run_cli("+recipe=quickstart_sft", "model=pretrained", f"model.path={model}", "launcher.dry_run=true",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and last_line(out.stderr) == f"error: {model / 'config.json'}: {line}", out.stderr[-2000:]


def test_the_same_checks_read_model_init_and_a_recipes_architecture(compose):
    from finetune.config import ConfigError

    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "model.init.num_attention_heads=8", "model.init.num_key_value_heads=3"])
    assert str(e.value) == ("model.init.num_attention_heads=8 is not a multiple of model.init.num_key_value_heads=3: each key/value "
                            "head serves an equal group of query heads; use a num_key_value_heads that divides 8 (1, 2, 4, 8)")
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "model.init.hidden_size=120", "model.init.num_attention_heads=8",
                 "model.init.num_key_value_heads=8"])
    assert str(e.value) == ("rotary position embeddings rotate pairs of dimensions, but each head has model.init.hidden_size=120 / "
                            "model.init.num_attention_heads=8 = 15 (rotated: 15), an odd number: choose sizes that give an even head size")
    with pytest.raises(ConfigError) as e:
        compose(["model=llama3_1_8b", "+model.architecture.rope_scaling={rope_type:llama3,factor:8.0}"])
    assert str(e.value).startswith("model.architecture: rope_scaling: rope_type='llama3' needs low_freq_factor")
    compose(["model=llama3_1_8b"])  # the shipped real-model recipes pass
    compose(["+recipe=quickstart_sft", "model.init.model_type=gpt2", "model.init.hidden_size=120", "model.init.num_attention_heads=8",
             "model.init.num_key_value_heads=8"])  # gpt2 has learned positions, no rotary: an odd head size is fine
