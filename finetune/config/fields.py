"""How a config field is declared and read: what it accepts (`Accepts`, declared beside the field with `checked`,
checked when the config is composed: `check_fields`), the resolvers recipes use (`${machine_ram_gib:}`,
`${asset:...}`), and the spellings an enum takes (`Spelled`: any case, '-' for '_', common aliases).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from enum import EnumMeta
from pathlib import Path
from typing import Any, Callable

from omegaconf import MISSING, OmegaConf

from finetune.errors import ConfigError

ASSETS = Path(__file__).resolve().parent.parent / "assets"


# ---------------------------------------------------------------------------------------------
# What each field accepts: declared beside the field, checked when the config is composed


@dataclass(frozen=True)
class Accepts:
    """A field's constraint: `ok(value)`, and the words that complete "KEY=VALUE must be ...".

    `outside` holds values just outside what is accepted, as typed on the command line: the
    schema test composes each one and expects the refusal to name the key."""

    words: str
    ok: Callable[[Any], bool]
    outside: tuple[str, ...] = ()


def at_least(n: int) -> Accepts:
    return Accepts(f"at least {n}" if n else "0 or more", lambda v: v >= n, (str(n - 1),))


def in_range(lo: float, hi: float, *, hi_open: bool = False, step: float = 0.01) -> Accepts:
    """A number in [lo, hi] (or [lo, hi) with hi_open); `step`: how far outside the test goes."""
    close = ")" if hi_open else "]"
    return Accepts(f"in [{lo:g}, {hi:g}{close}", lambda v: lo <= v < hi if hi_open else lo <= v <= hi,
                   (f"{lo - step:g}", f"{hi:g}" if hi_open else f"{hi + step:g}"))


def unused(section: Any, key: str, used: tuple[str, ...], why: str) -> None:
    """Refuse fields of `section` (the group `key`) set away from their defaults where the chosen option ignores
    them (the cross-group rules call it: finetune.launcher.rules, finetune.methods)."""
    default = type(section)()
    for f in fields(section):
        if f.name not in used and getattr(section, f.name) != getattr(default, f.name):
            value = getattr(section, f.name)
            shown = str(value).lower() if isinstance(value, bool) else getattr(value, "value", value)  # as typed on the command line
            raise ConfigError(f"{key}.{f.name}={shown} has no effect {why}: remove it or change the option")


def one_of(*values: int) -> Accepts:
    return Accepts(f"one of {', '.join(map(str, values))}", lambda v: v in values, (str(max(values) + 1),))


POSITIVE = Accepts("positive", lambda v: v > 0, ("0",))
PROBABILITY = in_range(0, 1, hi_open=True)
PORT = Accepts("a port in [1, 65535]", lambda v: 0 < v < 65536, ("0", "65536"))
TEXT = Accepts("non-empty text", lambda v: bool(str(v).strip()), ("''",))
SOURCES = Accepts("a path or hub id, a source {path, name, split, revision, columns}, or a list of sources",
                  lambda v: isinstance(v, (list, dict)) and bool(v) or isinstance(v, str) and bool(v.strip()),
                  ("''", "[]"))
ANY_TEXT = Accepts("any text", lambda v: True)
NAMES = Accepts("a list of names", lambda v: all(str(x).strip() for x in v), ("['']",))
SOME_NAMES = Accepts("a non-empty list of names", lambda v: len(v) > 0 and NAMES.ok(v), ("[]",))
ENV = Accepts("NAME: value pairs, each NAME a variable name ([A-Za-z_][A-Za-z0-9_]*)",
              lambda v: all(re.fullmatch(r"[A-Za-z_]\w*", str(k)) for k in v), ("{A-B:x}",))
BETAS = Accepts("two numbers, each in [0, 1)", lambda v: len(v) == 2 and all(PROBABILITY.ok(b) for b in v), ("[0.9]", "[0.9,1.0]"))
EXISTING_FILE = Accepts("an existing file", lambda v: Path(v).expanduser().is_file(), ("/nonexistent/file",))
EXISTING_DIR = Accepts("an existing directory", lambda v: Path(v).expanduser().is_dir(), ("/nonexistent/dir",))


def _host_port(value: str) -> bool:
    host, colon, port = value.rpartition(":") if ":" in value else (value, "", "")
    return bool(host) and (not colon or (port.isdigit() and 0 < int(port) < 65536))


ARCHITECTURE = Accepts("empty, or a mapping of the model's config.json keys that names its model_type",
                       lambda v: not v or bool(str(v.get("model_type") or "").strip()), ("{hidden_size:64}",))


HOST_PORT = Accepts("HOST or HOST:PORT (port in [1, 65535])", _host_port, ("host:0", ":29400"))


def checked(accepts: Accepts, default: Any = MISSING, *, factory: Callable[[], Any] | None = None, hint: str = "") -> Any:
    """A dataclass field with its constraint (null is always allowed where the type allows it);
    `hint` follows the refusal after a colon: what a right value looks like for this field."""
    meta = {"accepts": accepts, "hint": hint}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def check_fields(node: Any, prefix: str = "") -> None:
    """Refuse the first field value its constraint rejects: `KEY=VALUE must be WORDS`."""
    for f in fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            check_fields(value, f"{key}.")
        elif value is not None and "accepts" in f.metadata and not f.metadata["accepts"].ok(value):
            shown = "''" if value == "" else value
            hint = f": {f.metadata['hint']}" if f.metadata["hint"] else ""
            raise ConfigError(f"{key}={shown} must be {f.metadata['accepts'].words}{hint}")


def machine_ram_gib() -> float:
    """This machine's physical RAM in GiB (for hardware=cpu: plan against what is really there)."""
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


OmegaConf.register_new_resolver("machine_ram_gib", machine_ram_gib, replace=True)
# `${asset:tokenizer}` in a YAML file is the absolute path of a file the package ships.
OmegaConf.register_new_resolver("asset", lambda rel: str(ASSETS / rel), replace=True)


# ---------------------------------------------------------------------------------------------
# Enumerations. OmegaConf looks members up by name (`Enum[name]`); `Spelled` lets that lookup take
# the spellings users type: any case, '-' for '_', the value (`1f1b`) or a common alias (`bfloat16`).


ENUM_ALIASES: dict[str, dict[str, str]] = {
    "Precision": {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"},
    "AttnImpl": {"flash": "flash_attention_2", "flash_attn": "flash_attention_2", "fa2": "flash_attention_2"},
    "PipeSchedule": {"interleaved": "interleaved_1f1b"},
}
"""Other words users type for an enum's value, by enum class name."""


def spelling(word: str) -> str:
    return word.strip().lower().replace("-", "_")


class Spelled(EnumMeta):
    def __getitem__(cls, name: str) -> Any:
        members = cls.__members__
        if name in members:
            return members[name]
        spelled = {spelling(n): m for n, m in members.items()} | {spelling(m.value): m for m in members.values()}
        spelled |= {spelling(a): cls(v) for a, v in ENUM_ALIASES.get(cls.__name__, {}).items()}
        if isinstance(name, str) and spelling(name) in spelled:
            return spelled[spelling(name)]
        raise KeyError(name)
