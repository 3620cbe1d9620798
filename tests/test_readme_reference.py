"""The site's config reference (docs/reference.md, once README.md's) lists every field of the schema, and nothing else,
as generated.

The key list is walked here from the dataclasses independently of the generator, so a field the
generator skipped would show up as missing. A field added to finetune/config/ (or a changed default,
constraint or docstring) fails until `python scripts/config_reference.py --write docs/reference.md` is run.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import fields, is_dataclass
from typing import Union, get_args, get_origin, get_type_hints

import pytest

from finetune import methods  # noqa: F401 - registers each method's config class
from finetune.config import METHOD_CONFIGS, Config, MethodConfig

from conftest import REPO

PAGE = REPO / "docs" / "reference.md"
FIX = "regenerate: python scripts/config_reference.py --write docs/reference.md"


@pytest.fixture(scope="module")
def reference() -> types.ModuleType:
    """scripts/config_reference.py, imported (it runs nothing at import)."""
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def schema_keys(node: type = Config, prefix: str = "", table: str = "") -> list[str]:
    """Dotted key of every leaf field (nested dataclasses such as model.init walked into; each method's own keys under its
    table's name, as "method=dpo: method.beta")."""
    out = []
    hints = get_type_hints(node)
    for f in fields(node):
        kind = hints[f.name]
        if get_origin(kind) in (Union, types.UnionType):
            kind = next(a for a in get_args(kind) if a is not type(None))
        if kind is MethodConfig:
            out.append(f"{prefix}{f.name}.name")
            for name, schema in METHOD_CONFIGS.items():
                out += [k for k in schema_keys(schema, f"{prefix}{f.name}.", f"method={name}: ") if not k.endswith(".name")]
            continue
        out += schema_keys(kind, f"{prefix}{f.name}.", table) if is_dataclass(kind) else [f"{table}{prefix}{f.name}"]
    return out


def test_every_schema_field_is_in_the_reference_and_nothing_else(reference):
    section = reference.section_of(PAGE.read_text())
    assert section is not None, f"docs/reference.md has no {reference.START} ... {reference.END} section; {FIX}"
    listed, schema = list(reference.rows_of(section)), schema_keys()
    missing = [k for k in schema if k not in listed]
    extra = [k for k in listed if k not in schema]
    assert (missing, extra) == ([], []), f"missing from docs/reference.md: {missing}; not in the schema: {extra}; {FIX}"
    assert len(schema) >= 100  # the walk really covers the schema


def test_the_reference_is_the_generated_one(reference):
    """A changed default, constraint or docstring shows here, row by row."""
    found = reference.problems(PAGE.read_text())
    assert found == [], "\n".join(found + [FIX])


def test_check_names_missing_extra_and_changed_rows_and_write_fixes_them(reference, tmp_path, capsys):
    readme = tmp_path / "reference.md"
    text = PAGE.read_text()
    rows = reference.rows_of(reference.section_of(text))
    text = text.replace(rows["train.seed"] + "\n", "")
    text = text.replace(rows["optim.lr"], rows["optim.lr"].replace("`0.0001`", "`0.001`"))
    text = text.replace(rows["run_dir"], rows["run_dir"] + "\n| `train.no_such_key` | `1` | at least 1 | gone |")
    readme.write_text(text)

    assert reference.main(["--check", str(readme)]) == 1
    err = capsys.readouterr().err
    assert "missing from the reference: train.seed" in err
    assert "in the reference but not in the schema: train.no_such_key" in err
    assert "row differs: optim.lr" in err

    assert reference.main(["--write", str(readme)]) == 0
    assert reference.main(["--check", str(readme)]) == 0
    before, after = text.split(reference.START)[0], text.split(reference.END)[1]
    assert readme.read_text().startswith(before) and readme.read_text().endswith(after)


def test_write_adds_the_section_before_layout_when_the_markers_are_missing(reference, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Usage\n\ntext\n\n## Layout\n\nfiles\n")
    assert reference.main(["--write", str(readme)]) == 0
    text = readme.read_text()
    assert text.index("## Usage") < text.index(reference.START) < text.index("## Layout")
    assert reference.problems(text) == []
