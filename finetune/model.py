"""Tokenizer and model: from a hub id / local directory, or random-init from an architecture.

Under ZeRO-3 the caller holds a `transformers.integrations.HfDeepSpeedConfig` while the model is
built (`zero3_context`): transformers then creates it inside `deepspeed.zero.Init`, so each
rank only ever materialises its own shard of the weights.
"""

from __future__ import annotations

from typing import Any

import torch

from finetune.config import ConfigError, ModelConfig


def load_tokenizer(cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    source = cfg.tokenizer or cfg.path
    try:
        tok = AutoTokenizer.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        key = "model.tokenizer" if cfg.tokenizer else "model.path"
        raise ConfigError(f"{key}={source!r}: could not load a tokenizer: {str(e).splitlines()[0]}") from None
    if tok.pad_token is None:  # many base-model tokenizers have none; padding is masked anyway
        if tok.eos_token is None:
            raise ConfigError(f"model.tokenizer={source!r} has neither a pad nor an eos token to pad with")
        tok.pad_token = tok.eos_token
    return tok


def zero3_context(ds_config: dict[str, Any] | None) -> Any:
    """Keep the returned object alive while loading: transformers sees ZeRO-3 and partitions
    weights as they are created. None when ZeRO-3 is off."""
    if ds_config is None or ds_config["zero_optimization"]["stage"] != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def load_model(cfg: ModelConfig, tokenizer: Any) -> torch.nn.Module:
    """The model in fp32 on CPU, the same weights on every rank (sharded under ZeRO-3)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.path is not None:
        try:
            return AutoModelForCausalLM.from_pretrained(
                cfg.path,
                revision=cfg.revision,
                dtype=torch.float32,
                attn_implementation=cfg.attn_implementation.value,
                trust_remote_code=cfg.trust_remote_code,
            )
        except OSError as e:
            raise ConfigError(f"model.path={cfg.path!r}: could not load weights: {str(e).splitlines()[0]}") from None
    assert cfg.init is not None
    arch = {k: v for k, v in vars(cfg.init).items() if k not in ("model_type", "seed")}
    config = AutoConfig.for_model(
        cfg.init.model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **arch,
    )
    torch.manual_seed(cfg.init.seed)  # every rank builds the same initial weights
    return AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn_implementation.value, dtype=torch.float32)
