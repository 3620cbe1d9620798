"""Every field of the schema states what it accepts, and composition refuses a value just outside it.

The walk is over the dataclasses themselves: a new field with no constraint, or with one whose
`outside` values are accepted, fails here without anyone listing it.
"""

from __future__ import annotations

import types
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any, get_type_hints

import pytest

from finetune.launcher.compose import preflight
from finetune.config import METHOD_CONFIGS, Config, ConfigError, MethodConfig, PipeSchedule, Precision


def _unwrap(kind: Any) -> Any:
    if isinstance(kind, types.UnionType):
        return next(a for a in kind.__args__ if a is not type(None))
    return kind


def schema_fields(node: type = Config, prefix: str = "", recipe: str = "quickstart_sft") -> list[tuple[str, Any, Any, str]]:
    """(dotted key, type, dataclass field, the recipe it is composed on) for every leaf field of the schema; the method
    group's fields are each method's own (its config class), composed on that method's quickstart recipe."""
    out = []
    hints = get_type_hints(node)
    for f in fields(node):
        kind = _unwrap(hints[f.name])
        if kind is MethodConfig:
            for name, schema in METHOD_CONFIGS.items():
                out += schema_fields(schema, f"{prefix}{f.name}.", f"quickstart_{name}")
        elif is_dataclass(kind):
            out += schema_fields(kind, f"{prefix}{f.name}.", recipe)
        else:
            out.append((f"{prefix}{f.name}", kind, f, recipe))
    return out


def constrained() -> list[tuple[str, str, str]]:
    """(key, override, recipe) for each value just outside each constrained field (a mapping takes new entries with '+')."""
    return [(key, f"{'+' if getattr(kind, '__origin__', None) is dict else ''}{key}={value}", recipe)
            for key, kind, f, recipe in schema_fields() if "accepts" in f.metadata for value in f.metadata["accepts"].outside]


def test_every_number_text_and_list_field_declares_what_it_accepts():
    """Booleans and enums are checked by their type; everything else carries an `accepts` rule."""
    bare = [key for key, kind, f, _ in schema_fields()
            if not (kind is bool or (isinstance(kind, type) and issubclass(kind, Enum))) and "accepts" not in f.metadata]
    assert bare == []
    assert len(constrained()) >= 80  # the walk below really runs over the schema


# Keys under model.init exist only for the random-init model (the quickstart's); everything else
# is composed on top of the quickstart recipe. The field checks run before the rules across
# fields, so each refusal below is the field's own.
@pytest.mark.parametrize("key,override,recipe", constrained())
def test_a_value_just_outside_is_refused_naming_the_key(key, override, recipe):
    with pytest.raises(ConfigError) as e:
        preflight([f"+recipe={recipe}", override])
    message = str(e.value)
    assert message.startswith(f"{key}=") and " must be " in message, message
    assert "\n" not in message


@pytest.mark.parametrize("typed,member", [
    ("parallelism.pp_schedule=1f1b", PipeSchedule.one_f_one_b),
    ("parallelism.pp_schedule=1F1B", PipeSchedule.one_f_one_b),
    ("parallelism.pp_schedule=one_f_one_b", PipeSchedule.one_f_one_b),
    ("parallelism.pp_schedule=interleaved-1f1b", PipeSchedule.interleaved_1f1b),
    ("parallelism.pp_schedule=GPipe", PipeSchedule.gpipe),
    ("precision.name=BF16", Precision.bf16),
    ("precision.name=bfloat16", Precision.bf16),
    ("precision.name=float16", Precision.fp16),
])
def test_enum_values_are_read_the_way_users_spell_them(typed, member):
    key = typed.split("=")[0]
    extra = ["optim.max_grad_norm=null"] if member == Precision.fp16 else []
    cfg = preflight(["+recipe=quickstart_sft", typed, *extra], rules=False)
    group, leaf = key.split(".")
    assert getattr(getattr(cfg, group), leaf) is member


def test_an_enum_value_nobody_spells_is_refused_with_the_values_as_typed():
    with pytest.raises(ConfigError) as e:
        preflight(["+recipe=quickstart_sft", "parallelism.pp_schedule=gpip"])
    assert str(e.value) == "parallelism.pp_schedule=gpip must be one of gpipe, 1f1b, interleaved_1f1b (did you mean 'gpipe'?)"


def test_hardware_cpu_plans_against_this_machines_ram():
    import os

    cfg = preflight(["+recipe=quickstart_sft"])
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert cfg.hardware.name == "cpu" and abs(cfg.hardware.cpu_memory_gib - ram) < 0.1
