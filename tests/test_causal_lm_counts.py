"""The planner's parameter count against transformers' own build, for every model_type transformers can
build as a causal LM (issue 27): each type finetune.families.COUNTED lists is counted within 0.1% of
`AutoModelForCausalLM.from_config` (built on the meta device: no memory, no weights; a vision-language model's
config, with a vision_config, as `AutoModelForImageTextToText`: what the ranks build, methods.base.built_as), with each config
key its record reads flipped as well; every other type is counted from transformers' own build of its
config.json (finetune.families.arch_from_build), within the same tolerance. A type whose tiny config
transformers cannot build on CPU is skipped with transformers' reason.

`python -m pytest -q -n 0 tests/test_causal_lm_counts.py -k summary -s` prints how many are counted from a
record and from the build, how many skipped, and the worst relative error."""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import config_keys, run_cli
from finetune.config import ModelConfig
from finetune.families import COUNTED, FAMILIES, Family
from finetune.planner.counts import architecture

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,  # noqa: E402
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

CAUSAL = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=256, head_dim=16, moe_intermediate_size=32, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
"""Small sizes, each set where the family's config class has the key (a field, or an attribute_map alias)."""
TOLERANCE = 1e-3


@functools.cache
def built(model_type: str, extra: tuple[tuple[str, Any], ...] = ()) -> tuple[dict[str, Any] | None, int, str]:
    """(config.json as save_pretrained writes it, the built model's parameter count, why not built). The small
    sizes first; where transformers refuses them (its own validation of a family's shape), fewer of them, then
    its defaults (meta device: the size costs nothing)."""
    small = {k: v for k, v in SMALL.items() if k in config_keys(model_type)}
    reason = ""
    for keys in (small, {k: v for k, v in small.items() if k not in ("num_hidden_layers", "head_dim")}, {}):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = AutoConfig.for_model(model_type, **{**keys, **dict(extra)})
                image_text = getattr(config, "vision_config", None) is not None and \
                    model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # the ranks' class (methods.base.built_as)
                with torch.device("meta"):
                    model = (AutoModelForImageTextToText if image_text else AutoModelForCausalLM).from_config(config)
        except Exception as e:  # noqa: BLE001 - transformers' reason, printed with the skip
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            continue
        return json.loads(config.to_json_string()), sum(p.numel() for p in model.parameters()), ""  # tied: counted once
    return None, 0, reason


def planned(config: dict[str, Any], directory: Path) -> int:
    """The planner's count from that config.json in a model directory (the launcher's path: model.path)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return architecture(ModelConfig(path=str(directory))).params


@pytest.mark.parametrize("model_type", CAUSAL)
def test_every_causal_lm_is_counted_within_tolerance(model_type, tmp_path):
    """A type COUNTED lists, from its record; any other, from transformers' build of its config.json (arch_from_build)."""
    config, reference, reason = built(model_type)
    if config is None:
        pytest.skip(f"{model_type}: transformers cannot build it on CPU: {reason}")
    count = planned(config, tmp_path / "m")
    assert abs(count - reference) <= TOLERANCE * reference, \
        f"{model_type}: the planner counts {count:,}, transformers builds {reference:,} ({(count - reference) / reference:+.3%})"


def record_keys(fam: Family) -> list[str]:
    """The config.json keys a record reads: its bias specs and switches, and tie_word_embeddings."""
    specs = (fam.qkv_bias, fam.o_bias, fam.mlp_bias, fam.head_bias, fam.qk_norm_key, fam.parallel_key, fam.post_norm_key)
    return sorted({s for s in specs if isinstance(s, str) and s} | {"tie_word_embeddings"})


VARIANTS = [(t, key) for t in sorted(set(COUNTED) & set(CAUSAL)) for key in [*record_keys(COUNTED[t]), "head_dim"]
            if key in config_keys(t)]


@pytest.mark.parametrize("model_type,key", VARIANTS, ids=[f"{t}-{k}" for t, k in VARIANTS])
def test_each_key_a_record_reads_is_counted(model_type, key, tmp_path):
    """The key flipped (a boolean) or changed (head_dim 16 -> 8) from the tiny config, so that the count follows it."""
    config, _, reason = built(model_type)
    if config is None:
        pytest.skip(f"{model_type}: transformers cannot build it on CPU: {reason}")
    value = 8 if key == "head_dim" else not config.get(key)
    changed, reference, reason = built(model_type, ((key, value),))
    if changed is None or changed.get(key) != value:
        pytest.skip(f"{model_type} with {key}={value}: transformers refuses it: {reason or 'its build ignores the key'}")
    count = planned(changed, tmp_path / "m")
    assert abs(count - reference) <= TOLERANCE * reference, \
        f"{model_type} {key}={value}: the planner counts {count:,}, transformers builds {reference:,}"


def test_every_record_names_a_model_type_transformers_builds_and_its_tied_default():
    """No stale record; tie_word_embeddings when config.json leaves it out is transformers' default for the type."""
    assert set(COUNTED) <= set(CAUSAL) | set(FAMILIES), sorted(set(COUNTED) - set(CAUSAL))
    wrong = {t: fam.tied for t, fam in COUNTED.items() if t in CAUSAL
             and fam.tied != bool(getattr(CONFIG_MAPPING[t](), "tie_word_embeddings", False))}
    assert not wrong, f"Family.tied differs from transformers' default for {wrong}"


def test_summary(tmp_path):
    """How many model_types are checked, counted from a record or from the build (printed with -s), and the worst relative error."""
    recorded, read, skipped, worst = [], [], [], (0.0, "")
    for model_type in CAUSAL:
        config, reference, reason = built(model_type)
        if config is None:
            skipped.append(f"{model_type} ({reason})")
            continue
        arch = architecture(ModelConfig(path=str(tmp_path / model_type))) if planned(config, tmp_path / model_type) else None
        (recorded if model_type in COUNTED else read).append(model_type)
        assert model_type in COUNTED or not arch.known  # read off the build: supported for its count, not end to end
        worst = max(worst, (abs(arch.params - reference) / reference, model_type))
    print(f"\ncausal LM model_types: {len(CAUSAL)}; built on CPU: {len(recorded) + len(read)}; counted from a record: "
          f"{len(recorded)}; from transformers' build: {len(read)}; skipped: {len(skipped)}; "
          f"worst relative error {worst[0]:.2e} ({worst[1] if worst[0] else 'all exact'})")
    print("skipped:", "; ".join(skipped))
    assert set(recorded) == set(COUNTED) & (set(CAUSAL) - {s.split(" ")[0] for s in skipped})
    assert worst[0] <= TOLERANCE


def test_a_type_no_record_describes_is_planned_through_the_cli_with_its_exact_count(tmp_path):
    """A state-space model (Mamba: no attention, no record in finetune/families/records.py) saved as a model directory:
    `python -m finetune.plan` counts what transformers loads from it, and says how the rest is estimated."""
    from transformers import AutoTokenizer

    from finetune.config import ASSETS

    config = AutoConfig.for_model("mamba", hidden_size=64, num_hidden_layers=2, vocab_size=128, intermediate_size=128)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "mamba")
    AutoTokenizer.from_pretrained(ASSETS / "tokenizer").save_pretrained(tmp_path / "mamba")
    out = run_cli("+recipe=quickstart_sft", "model=pretrained", f"model.path={tmp_path / 'mamba'}", cwd=tmp_path,
                  module="finetune.plan")
    assert out.returncode == 0, out.stderr[-2000:]
    total = sum(p.numel() for p in model.parameters())
    assert f"parameters   {total:,} ({total:,} trainable)" in out.stdout.splitlines()
    assert ("note: model_type=mamba: no record in finetune/families/records.py, so its parameters are read off transformers' build of "
            "its config on the meta device (exact); its activations are estimated as for a Llama-style block of the same "
            "linears, not measured for it") in out.stdout.splitlines()
