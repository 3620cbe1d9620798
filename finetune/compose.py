"""Composition and the error funnel: Hydra + the schema -> a validated `Config`, or one line.

`finetune.launch` (before Hydra takes over), `finetune.plan` and the tests compose through
`preflight`, so every path composes and validates alike; `explain` turns Hydra's and OmegaConf's
exceptions into one line that names the key and says what to type instead. Imports no torch.
"""

from __future__ import annotations

import re
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from finetune.config import Config, ConfigError, did_you_mean, to_config
from finetune.rules import validate


def _recipes_dir() -> Path:
    installed = Path(__file__).resolve().parent / "recipes"  # `pip install .` puts recipes/ here
    return installed if installed.is_dir() else Path(__file__).resolve().parent.parent / "recipes"


RECIPES = _recipes_dir()


def typed(dcfg: DictConfig) -> Config:
    """Composed DictConfig -> validated typed Config, or ConfigError with one line."""
    try:
        cfg = to_config(dcfg)
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e)) from None
    validate(cfg)
    return cfg


def preflight(overrides: list[str], *, config_dir: str | None = None, config_name: str = "config") -> Config:
    """Compose and validate as the real run will, turning Hydra's errors into one line."""
    from hydra import compose, initialize_config_dir

    if config_dir:  # --config-dir: the user's recipes come first, ours after
        overrides = [*overrides, f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
    try:
        if GlobalHydra.instance().is_initialized():  # inside the launcher's Hydra app: its search path holds already
            dcfg = compose(config_name, overrides=overrides)
        else:
            with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
                dcfg = compose(config_name, overrides=overrides)
    except (ConfigCompositionException, MissingConfigException, OverrideParseException, OmegaConfBaseException) as e:
        raise ConfigError(explain(e)) from None
    return typed(dcfg)


def explain(e: BaseException) -> str:
    """One line for a Hydra/OmegaConf error: what is wrong, and what would be right."""
    if isinstance(e, MissingConfigException):
        return _explain_missing(str(e))
    if isinstance(e, OverrideParseException):
        return f"cannot parse the command line: {_first_line(str(e))} (see Hydra's override grammar)"
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        key = getattr(cause, "full_key", None) or getattr(cause, "key", "?")
        parent, _, leaf = str(key).rpartition(".")
        known = _fields_at(parent)
        where = f"'{parent}'" if parent else "the config"
        hint = did_you_mean(leaf, known, prefix=f"{parent}." if parent else "")
        return f"unknown key '{key}' in {where}{hint}; known keys: {', '.join(known)}"
    if isinstance(cause, MissingMandatoryValue):
        key = getattr(cause, "full_key", "?")
        return f"'{key}' has no value and needs one: set it in the recipe or on the command line ({key}=...)"
    if isinstance(cause, ValidationError):
        key = getattr(cause, "full_key", "?")
        return f"invalid value for '{key}': {_first_line(str(cause))}"
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None)
        return f"{key + ': ' if key else ''}{_first_line(str(cause))}"
    return _first_line(str(e))


def _explain_missing(message: str) -> str:
    found = re.search(r"Could not find '([^']+)'", message)
    options_block = re.search(r"Available options in '([^']+)':\n((?:\t.*\n?)*)", message)
    where = re.search(r"In '([^']+)'", message)
    missing = found.group(1) if found else "?"
    group, _, option = missing.rpartition("/")
    options = [o.strip() for o in options_block.group(2).splitlines()] if options_block else []
    options = [o for o in options if o and not o.startswith("base_")]  # schemas are not options
    source = f" (in {where.group(1)}.yaml)" if where and where.group(1) != "config" else ""
    if not group:
        return f"config '{missing}' not found{source}"
    kind = "recipe" if group == "recipe" else f"{group} option"
    own = f" (a recipe of your own: --config-dir DIR with DIR/recipe/{option}.yaml)" if group == "recipe" else ""
    return f"unknown {kind} '{option}'{source}{did_you_mean(option, options)}; available: {', '.join(options) or '(none)'}{own}"


def _fields_at(path: str) -> list[str]:
    """Field names of the config dataclass at a dotted path ('' = the root)."""
    node: Any = Config
    for part in filter(None, path.split(".")):
        hints = get_type_hints(node)
        node = hints.get(part)
        node = next((a for a in getattr(node, "__args__", ()) if is_dataclass(a)), node)  # X | None
        if not is_dataclass(node):
            return []
    return [f.name for f in fields(node)]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def fail(e: Exception) -> None:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
