"""Composition and the error funnel: Hydra + the schema -> a validated `Config`, or one line.

`finetune.launch` (before Hydra takes over), `finetune.plan` and the tests compose through
`preflight`, so every path composes and validates alike; `explain` turns Hydra's and OmegaConf's
exceptions into one line that names the key and says what to type instead. Imports no torch.
"""

from __future__ import annotations

import re
import sys
import types
from enum import Enum
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, get_type_hints

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

from finetune import methods  # noqa: F401 - registers each method's config before the schemas are stored
from finetune.config import Config, ConfigError, MethodConfig, check_fields, did_you_mean, register, spelling, to_config
from finetune.launcher.rules import validate

register()  # the schemas into Hydra's ConfigStore, before anything composes


def _recipes_dir() -> Path:
    package = Path(__file__).resolve().parents[1]
    installed = package / "recipes"  # `pip install .` puts recipes/ here
    return installed if installed.is_dir() else package.parent / "recipes"


RECIPES = _recipes_dir()


def typed(dcfg: DictConfig, *, rules: bool = True) -> Config:
    """Composed DictConfig -> validated typed Config, or ConfigError with one line. With
    rules=False only each field is checked, not the rules across fields (`finetune.launcher.rules`)."""
    try:
        cfg = to_config(dcfg)
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e)) from None
    check_fields(cfg)  # each field against what it accepts (declared beside it in finetune.config)
    if rules:
        validate(cfg)  # then the rules across fields and groups (finetune.launcher.rules)
    return cfg


def preflight(overrides: list[str], *, config_dir: str | None = None, config_name: str = "config", rules: bool = True) -> Config:
    """Compose and validate as the real run will, turning Hydra's errors into one line (rules: as in `typed`)."""
    from hydra import compose, initialize_config_dir

    overrides = _with_config_dir(overrides, config_dir)

    def composed(items: list[str]) -> DictConfig:
        try:
            return compose(config_name, overrides=items)
        except AssertionError as e:  # OmegaConf's, for a key set inside a null node
            raise ConfigError(_explain_null_parent(items, e, composed)) from None
        except COMPOSITION_ERRORS as e:
            raise ConfigError(explain(e)) from None

    if GlobalHydra.instance().is_initialized():  # inside the launcher's Hydra app: its search path holds already
        return typed(composed(overrides), rules=rules)
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        dcfg = composed(overrides)
    return typed(dcfg, rules=rules)


def _explain_null_parent(overrides: list[str], e: AssertionError, compose: Callable[[list[str]], DictConfig]) -> str:
    """OmegaConf asserts (no error of its own) when an override sets a key inside a node that is null once the
    groups are chosen (model.init.num_hidden_layers=4 with model=pretrained): find that override by composing
    the group choices and recipes alone, and say which node is null."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    if "Unexpected type for root" not in str(e):
        raise e
    parsed = OverridesParser.create().parse_overrides(overrides)
    dotted = [o for o in parsed if "." in o.key_or_group and not o.key_or_group.startswith("hydra.") and not o.is_delete()]
    base = compose([text for text, o in zip(overrides, parsed) if o not in dotted])
    for o in dotted:
        parts = o.key_or_group.split(".")
        for end in range(1, len(parts)):
            parent = ".".join(parts[:end])
            if OmegaConf.select(base, parent, default=0) is None:
                return (f"{o.input_line}: '{parent}' is null with the options chosen, so it has no '{parts[end]}' to set: "
                        f"remove the override, or choose an option that sets {parent}")
    raise e


COMPOSITION_ERRORS = (ConfigCompositionException, MissingConfigException, OverrideParseException, OmegaConfBaseException)


def _with_config_dir(overrides: list[str], config_dir: str | None) -> list[str]:
    """--config-dir DIR: the user's recipes come first on the search path, ours after."""
    return [*overrides, f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir else list(overrides)


def run_once(overrides: list[str], task: Callable[[DictConfig, Config, bool], Any], claim: Callable[[Path, Config], bool], *,
             config_dir: str | None = None, config_name: str = "config", job_name: str = "launch") -> Any:
    """One (non-sweep) launch, composed once: what `@hydra.main` does for a run (compose, then
    Hydra's `run_job`: the run directory, `.hydra/`, logging, `HydraConfig`), except that the
    composition is validated and `claim(run_dir, cfg)` asked before Hydra writes into the run
    directory (False: Hydra writes nothing there either), and that Hydra's extra composition to
    read `hydra.mode` is skipped (each composition costs ~0.3 s of a dry run).
    `task(dcfg, cfg, writable)` gets the job's config, its validated `Config` and claim's answer.
    ConfigError for a mistake."""
    from hydra import initialize_config_dir
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import run_job
    from hydra.types import HydraContext, RunMode
    from omegaconf import OmegaConf, open_dict

    with initialize_config_dir(config_dir=str(RECIPES), job_name=job_name, version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        def composed(items: list[str]) -> DictConfig:
            try:
                return hydra.compose_config(config_name, [*items, "hydra.mode=RUN"], run_mode=RunMode.RUN, from_shell=True,
                                            with_log_configuration=True)
            except AssertionError as e:  # OmegaConf's, for a key set inside a null node
                raise ConfigError(_explain_null_parent(items, e, composed)) from None
            except COMPOSITION_ERRORS as e:
                raise ConfigError(explain(e)) from None

        dcfg = composed(_with_config_dir(overrides, config_dir))
        job = OmegaConf.masked_copy(dcfg, [k for k in dcfg if k != "hydra"])  # what the task function sees
        cfg = typed(job)
        with open_dict(dcfg):  # the directory is named once: a ${now:...} resolved again could differ
            dcfg.hydra.run.dir = str(Path(dcfg.hydra.run.dir).resolve())
            writable = claim(Path(cfg.run_dir).resolve() if cfg.run_dir else Path(dcfg.hydra.run.dir), cfg)
            if not writable:  # another run's directory, or a dry run there: Hydra leaves its files alone too
                dcfg.hydra.output_subdir = None
        callbacks = Callbacks(dcfg)
        callbacks.on_run_start(config=dcfg, config_name=config_name)
        ret = run_job(hydra_context=HydraContext(config_loader=hydra.config_loader, callbacks=callbacks),
                      task_function=lambda job_cfg: task(job_cfg, cfg, writable), config=dcfg,
                      job_dir_key="hydra.run.dir", job_subdir_key=None, configure_logging=writable)
        callbacks.on_run_end(config=dcfg, config_name=config_name, job_return=ret)
        return ret.return_value  # re-raises what the task raised


def explain(e: BaseException) -> str:
    """One line for a Hydra/OmegaConf error: what is wrong, and what to type instead."""
    if isinstance(e, MissingConfigException):
        return _explain_missing(str(e))
    if isinstance(e, OverrideParseException):
        return _explain_grammar(e.override, e.message)
    text = str(e)
    for pattern, say in HYDRA_MISTAKES:
        found = re.search(pattern, text)
        if found and say(*found.groups()):
            return say(*found.groups())
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        key = getattr(cause, "full_key", None) or getattr(cause, "key", "?")
        if str(key).startswith("hydra."):
            hint = did_you_mean(str(key), HYDRA_KEYS)
            return f"unknown key '{key}' in Hydra's settings{hint}; the usual ones: {', '.join(HYDRA_KEYS)}"
        parent, _, leaf = str(key).rpartition(".")
        known = _fields_at(parent)
        schema = getattr(cause, "object_type", None)
        if parent == "method" and isinstance(schema, type) and issubclass(schema, MethodConfig):  # the method's own class
            keys = [f.name for f in fields(schema)]
            return f"{key}: not a key of method={schema.name}{did_you_mean(leaf, keys)}; its keys are {', '.join(keys)}"
        where = f"'{parent}'" if parent else "the config"
        hint = did_you_mean(leaf, known, prefix=f"{parent}." if parent else "")
        return f"unknown key '{key}' in {where}{hint}; known keys: {', '.join(known)}"
    if isinstance(cause, MissingMandatoryValue):
        key = getattr(cause, "full_key", "?")
        return f"'{key}' has no value and needs one: set it in the recipe or on the command line ({key}=...)"
    if isinstance(cause, ValidationError):
        key = getattr(cause, "full_key", "?")
        words = _kind_words(key, _given(cause))
        return f"{key}={_given(cause)} must be {words}" if words else f"invalid value for '{key}': {_first_line(str(cause))}"
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None)
        return f"{key + ': ' if key else ''}{_first_line(str(cause))}"
    return _first_line(str(e))


HYDRA_KEYS = ["hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.job.chdir", "hydra.job.name", "hydra.verbose",
              "hydra.searchpath", "hydra.sweeper", "hydra.output_subdir"]


def sweep_trials(overrides: list[str]) -> list[list[str]]:
    """For `-m`: the first trial (each swept key at its first value), then for each swept key each
    other value with the rest at their first: every value of the sweep is composed once, so a
    mistake in any of them (composition, a field's constraint) is refused before the first trial
    runs. Rules across fields are left to each trial: a value may be right with some of the
    others. A sweep that cannot be listed (an optuna interval) is left to the sweeper."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    first, values = [], {}
    for i, (text, override) in enumerate(zip(overrides, OverridesParser.create().parse_overrides(overrides))):
        if not override.is_sweep_override():
            first.append(text)
            continue
        try:
            listed = [f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()]
        except Exception:  # noqa: BLE001 - not listable: the sweeper reports on it
            continue
        values[len(first)] = listed[1:]
        first.append(listed[0])
    return [first] + [first[:at] + [value] + first[at + 1:] for at, rest in values.items() for value in rest]


HYDRA_MISTAKES: list[tuple[str, Any]] = [
    (r"Could not override '([^']+)'\.\nTo append to your config use \+(\S+)",
     lambda key, add: f"{add}: '{key}' is a mapping that takes new entries with a '+': type +{add}" if _is_mapping(key) else None),
    (r"Could not override '([^']+)'\. No match in the defaults list\.\nTo append to your default list use \+(\S+)",
     lambda group, choice: f"{choice}: '{group}' is not chosen by default, so it is added with a '+': type +{choice}"),
    (r"Could not append to config\. An item is already at '([^']+)'\.\nEither remove \+ prefix: '([^']*)'",
     lambda key, plain: f"+{plain}: '{key}' exists already, and '+' adds a new key: type {plain} (or ++{plain} to set it either way)"),
    (r"Multiple values for (\S+)\. To override a value use 'override \S+: (\S+)'",
     lambda group, choice: f"+{group}={choice}: the group '{group}' is chosen already, and '+' adds a new one: type {group}={choice}"),
    (r"Could not delete from config\. (?:The value of )?'([^']+)'",
     lambda key: f"~{key}: there is no '{key}' to delete: check the key (python -m finetune.launch --cfg job shows the config)"),
]
"""Hydra's composition mistakes (its message pattern, our one line). Each says what to type instead."""


def _explain_grammar(override: str, message: str) -> str:
    problem = message.removeprefix(f"Error parsing override '{override}'\n").splitlines()[0]
    if "=" not in override:
        return (f"'{override}' is not an override: write KEY=VALUE (e.g. {override}=...), +KEY=VALUE to add a key, "
                f"or ~KEY to delete one")
    return (f"cannot read the override '{override}' ({problem}): quote a value with spaces or special characters "
            f"as KEY='VALUE' (and the whole argument for the shell: \"KEY='a=b'\")")


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


def _given(cause: BaseException) -> str:
    """The value the user typed, as typed."""
    value = getattr(cause, "value", "?")
    return str(value).lower() if isinstance(value, bool) else str(value)


def _kind_words(key: str, value: Any) -> str | None:
    """What a field of the schema accepts by its type: the words after "KEY=VALUE must be"."""
    parent, _, leaf = key.rpartition(".")
    node = _schema_at(parent)
    kind = get_type_hints(node).get(leaf) if node is not None else None
    if isinstance(kind, types.UnionType):  # X | None
        kind = next(a for a in kind.__args__ if a is not type(None))
    if isinstance(kind, type) and issubclass(kind, Enum):
        values = [m.value for m in kind]
        return f"one of {', '.join(values)}{did_you_mean(spelling(str(value)), values)}"
    words = {int: "an integer", float: "a number", bool: "true or false", str: "text"}
    if kind in words:
        return words[kind]
    origin = getattr(kind, "__origin__", None)
    return {list: f"a list, e.g. [{value}]", dict: "a mapping, e.g. {NAME:value}"}.get(origin)


def _is_mapping(key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = _schema_at(parent)
    return node is not None and getattr(get_type_hints(node).get(leaf), "__origin__", None) is dict


def _schema_at(path: str) -> Any:
    """The config dataclass at a dotted path ('' = the root), or None."""
    node: Any = Config
    for part in filter(None, path.split(".")):
        node = get_type_hints(node).get(part)
        if isinstance(node, types.UnionType):  # X | None
            node = next(a for a in node.__args__ if a is not type(None))
        if not is_dataclass(node):
            return None
    return node


def _fields_at(path: str) -> list[str]:
    """Field names of the config dataclass at a dotted path ('' = the root)."""
    node = _schema_at(path)
    return [f.name for f in fields(node)] if node is not None else []


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def fail(e: Exception) -> None:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
