"""The model's own rules: model.path or model.init, its structure as transformers would check it (finetune.families.structure,
with the family's defaults), data.max_length within its positions, an explicit attention kernel it can run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune import methods
from finetune.config import AttnImpl, Config, ConfigError, ModelConfig
from finetune.disk import attention, config_source, local_config, model_config
from finetune.families import COUNTED, config_value
from finetune.families.structure import structure_problem
from finetune.families.vision import vision_of
from finetune.methods.base import built_as


def validate_model(m: ModelConfig) -> None:
    """model.path or model.init (one of them), model.recipe_if_missing, model.architecture, model.tokenizer."""
    if m.path is None and m.init is None:
        raise ConfigError("model: set model.path (hub id or local directory) or model.init (random-init architecture)")
    if m.path is not None and m.init is not None:
        raise ConfigError(f"model.path={m.path!r} and model.init are both set: choose one (model.init=null to load weights)")
    if m.from_scratch and m.path is None:
        raise ConfigError("model.from_scratch=true builds model.path's config.json with random weights, and model.path is null: set "
                          "model.path (a directory or hub id with a config.json), or use model.init for a random-init text model")
    if m.from_scratch and m.recipe_if_missing is not None:
        raise ConfigError(f"model.from_scratch=true with model.recipe_if_missing={m.recipe_if_missing}: the recipe would train the "
                          "weights that from_scratch does not read: remove one of them")
    if m.recipe_if_missing is not None and (m.path is None or Path(m.path).name != "final"):
        raise ConfigError(
            f"model.recipe_if_missing={m.recipe_if_missing} makes model.path by running that recipe, so model.path must be "
            f"its RUN_DIR/final (e.g. outputs/{m.recipe_if_missing}/final), got {m.path!r}"
        )
    if m.init is not None and m.architecture:
        raise ConfigError("model.architecture declares a pretrained model.path's config; a random-init model's architecture is "
                          "model.init: use one model recipe (model=tiny or a hub model's), not both")
    if m.path is None and m.tokenizer is None:
        raise ConfigError("model.tokenizer: a random-init model needs a tokenizer path or hub id")


MAPPINGS = {"AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
            "AutoModelForImageTextToText": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
            "AutoModelForSequenceClassification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"}
"""The model types each method's Auto class builds, as transformers lists them (transformers.models.auto.modeling_auto)."""


def validate_vision(cfg: Config) -> None:
    """A vision-language checkpoint (finetune.families.vision: its config has a vision_config) trains where the method's
    Auto class builds it, its parts frozen as model.freeze says; model.freeze on a text model is refused. Read from a
    local config.json or model.architecture; a hub id without either is checked on the ranks."""
    m = cfg.model
    whole = local_config(m, whole=True) if m.init is None else None
    vision = vision_of(whole) if whole else None
    if vision is None:
        if m.freeze is not None and (whole is not None or m.init is not None):
            what = "model.init" if m.init is not None else config_source(m)
            raise ConfigError(f"model.freeze={_listed(m.freeze)} names parts of a vision-language model, but {what} is a text model "
                              "(no vision_config): remove model.freeze")
        return
    if cfg.data.packing:
        from finetune.data.rows import vision_unpacked

        if (why := vision_unpacked(cfg)) is not None:
            raise ConfigError(f"data.packing=true cannot run with {why}: set data.packing=false")
    auto = built_as(methods.get(cfg.method.name).model_class, True)
    from transformers.models.auto import modeling_auto  # imports torch (3-4 s): only for a vision-language model

    builds = getattr(modeling_auto, MAPPINGS[auto])
    if vision.model_type not in builds:
        image_text = sorted(set(builds) & set(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))
        what = (f"of the image-text models, {auto} builds {', '.join(image_text)}" if image_text else
                f"{auto} builds none of the image-text models")
        raise ConfigError(f"model.path={m.path} is a vision-language model (model_type={vision.model_type}: {vision.describe()}) "
                          f"that transformers' {auto}, the class method={cfg.method.name} trains, cannot build: {what}")


def _listed(values: list[str]) -> str:
    return "[" + ",".join(values) + "]"


def validate_structure(m: ModelConfig) -> None:
    """The model's config as transformers would check it when a rank builds it (finetune.families.structure), from
    model.init, a local model.path's config.json (its text_config, for a multimodal wrapper) or model.architecture,
    with what transformers fills in from the family's defaults where the config says nothing (family_defaults)."""
    if m.init is not None:
        config, key, source = model_config(m), (lambda k: f"model.init.{k}"), ""
    else:
        config = local_config(m)
        if config is None:
            return
        file = config_source(m)
        nested = "text_config." if file != "model.architecture" and "text_config" in local_config(m, whole=True) else ""
        key = (lambda k: f"model.architecture.{k}") if file == "model.architecture" else (lambda k: nested + k)
        source = "" if file == "model.architecture" else f" in {file}"
    assert config is not None
    problem = structure_problem({**family_defaults(config.get("model_type"), m.init is not None), **config}, key, source)
    if problem:
        raise ConfigError(problem)


def family_defaults(model_type: Any, init: bool) -> dict[str, Any]:
    """The structural keys a family's transformers config fills in when config.json leaves them out (COUNTED
    records; other model_types: none): its own head_dim (Qwen3's 128, Gemma's 256) and, for a model.init (which
    has no RoPE keys to state), default RoPE unless the family has learned positions (GPT-2)."""
    fam = COUNTED.get(model_type)
    if fam is None:
        return {}
    return {**({"head_dim": fam.head_dim} if fam.head_dim else {}),
            **({"rope_parameters": {"rope_type": "default"}} if init and fam.positions is None else {})}


SHAPE = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "max_position_embeddings",
         "tie_word_embeddings")
"""What the layout and the context length are checked against (model_shape)."""


def model_shape(cfg: ModelConfig) -> dict[str, Any] | None:
    """The SHAPE keys from model.init, a local config.json or model.architecture, read under the
    families' aliases (families.ALIASES; None where the config says nothing). None: a hub id without
    model.architecture, checked on the ranks."""
    if cfg.init is not None:
        return {k: getattr(cfg.init, k) for k in SHAPE}
    arch = local_config(cfg)
    if arch is None:
        return None
    return {k: config_value(arch, k) for k in SHAPE}


def validate_context(cfg: Config) -> None:
    """data.max_length within the model's positions (model.init's, or a local config.json's)."""
    shape, length = model_shape(cfg.model), cfg.data.max_length
    limit = shape.get("max_position_embeddings") if shape else None
    if not isinstance(limit, int) or length <= limit:
        return
    if cfg.model.init is not None:
        raise ConfigError(f"data.max_length={length} exceeds model.init.max_position_embeddings={limit}: lower one or raise the other")
    config = config_source(cfg.model)
    raise ConfigError(f"data.max_length={length} exceeds the model's max_position_embeddings={limit} ({config}): "
                      f"use data.max_length={limit} or less")


def validate_attention(cfg: Config) -> None:
    """An explicit model.attn_implementation this model cannot run (the device is disk.check_device's)."""
    if cfg.model.attn_implementation != AttnImpl.auto:
        attention(cfg, gpu=True)  # refuses a kernel this model cannot run (the device is disk.check_device's)
