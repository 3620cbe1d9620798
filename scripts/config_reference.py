"""Generate the site's config reference (docs/reference.md) from the schema (`finetune/config/`).

    python scripts/config_reference.py                            # print the generated section
    python scripts/config_reference.py --write docs/reference.md  # replace it between the marker comments
    python scripts/config_reference.py --check docs/reference.md  # exit 1 naming fields missing, extra or changed

One table per group (nested groups such as model.init get their own, root keys come last), one row
per field: key | default | accepts | what it does. The walk is over the dataclasses, in their field
order; "accepts" is the field's `checked(...)` words (an enum's values, or true/false), and the
description is the first sentence of the docstring under the field, read from the source with
`ast` (field docstrings do not exist at runtime). Nothing else goes in, so the output depends on
finetune/config/ and each method's config class (finetune/methods/).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import types
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import Field, dataclass, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from omegaconf import MISSING

import finetune.methods  # noqa: F401 - registers each method's config class
from finetune.config import METHOD_CONFIGS, Config, MethodConfig

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
ROW_KEY = re.compile(r"^\| `([^`]+)` \|")


@dataclass(frozen=True)
class Row:
    key: str
    default: str
    accepts: str
    doc: str

    def markdown(self) -> str:
        return "| " + " | ".join(cell(c) for c in (f"`{self.key}`", self.default, self.accepts, self.doc)) + " |"


@dataclass(frozen=True)
class Table:
    group: str
    """Dotted group name; "" for the root keys."""
    intro: str
    rows: list[Row]


def cell(text: str) -> str:
    """Text that stays in its table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", r"\|")


def first_sentence(doc: str) -> str:
    """Up to the first '. ' that starts a capitalised sentence, outside parentheses and code."""
    depth, code = 0, False
    for i, ch in enumerate(doc):
        if ch == "`":
            code = not code
        elif not code and ch in "([":
            depth += 1
        elif not code and ch in ")]":
            depth = max(0, depth - 1)
        elif (ch == "." and not code and depth == 0 and doc[i + 1:i + 2] == " " and doc[i + 2:i + 3].isupper()
              and not doc[:i].endswith(("e.g", "i.e", "etc"))):
            return doc[:i + 1]
    return doc


def docstrings(cls: type) -> tuple[str, dict[str, str]]:
    """(the class's own docstring, field name -> the docstring right under it), whitespace collapsed.

    Read from the source: at runtime field docstrings are gone, and a dataclass without a
    docstring gets its signature as `__doc__`. A field inherited (GrpoConfig's from OnlineConfig) has its base's,
    unless the class declares it again with its own."""
    docs: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        node = ast.parse(textwrap.dedent(inspect.getsource(base))).body[0]
        for stmt, after in zip(node.body, node.body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    return " ".join((ast.get_docstring(node) or "").split()), docs


def unwrap(kind: Any) -> tuple[Any, bool]:
    """(the type without `| None`, whether None is allowed)."""
    if get_origin(kind) not in (Union, types.UnionType):
        return kind, False
    args = [a for a in get_args(kind) if a is not type(None)]
    return (args[0] if len(args) == 1 else kind), len(args) < len(get_args(kind))


def default_of(f: Field) -> Any:
    if f.default_factory is not NO_DEFAULT:
        return f.default_factory()
    return f.default


def yaml_value(value: Any) -> str:
    """A default as it is typed in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", r"e\1\2", repr(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return "''" if value == "" else str(value)


def accepts_of(f: Field, kind: Any, nullable: bool) -> str:
    if "accepts" in f.metadata:
        words = f.metadata["accepts"].words
    elif kind is bool:
        words = "true/false"
    elif isinstance(kind, type) and issubclass(kind, Enum):
        words = ", ".join(str(m.value) for m in kind)
    else:
        words = getattr(kind, "__name__", str(kind))
    return f"{words}, or null" if nullable else words


def tables(node: type = Config, group: str = "", intro: str = "", prefix: str | None = None, skip: tuple[str, ...] = ()) -> list[Table]:
    """This dataclass's table, then those of the dataclasses under it (the root's own keys last). The method group is
    one table per method (its own config class, finetune/methods/NAME.py), headed method=NAME. `prefix`: the keys'
    dotted start where it is not the group's name."""
    hints, docs = get_type_hints(node), docstrings(node)[1]
    rows, nested = [], []
    prefix = group if prefix is None else prefix
    for f in fields(node):
        if f.name in skip:
            continue
        kind, nullable = unwrap(hints[f.name])
        key = f"{prefix}.{f.name}" if prefix else f.name
        if kind is MethodConfig:  # the group's own key (name), then each method's keys (its name row said above)
            nested += tables(MethodConfig, key, docstrings(MethodConfig)[0])
            for name, schema in METHOD_CONFIGS.items():
                nested += tables(schema, f"{key}={name}", docstrings(schema)[0], prefix=key, skip=("name",))
            continue
        if is_dataclass(kind):
            about = docs.get(f.name) or docstrings(kind)[0]
            if default_of(f) is None:
                about += f" `{key}` is null unless set; the defaults below apply when it is."
            nested += tables(kind, key, about)
            continue
        default = default_of(f)
        shown = "required" if default is MISSING or default is NO_DEFAULT else f"`{yaml_value(default)}`"
        rows.append(Row(key, shown, accepts_of(f, kind, nullable), first_sentence(docs.get(f.name, ""))))
    own = [Table(group, intro, rows)] if rows else []
    return nested + own if not group else own + nested


def render(all_tables: list[Table] | None = None) -> str:
    """The Markdown that goes between the markers."""
    out = []
    for table in tables() if all_tables is None else all_tables:
        out.append(f"### `{table.group}`" if table.group else "### Top-level keys")
        out += ["", table.intro] if table.intro else []
        out += ["", "| key | default | accepts | what it does |", "|---|---|---|---|"]
        out += [row.markdown() for row in table.rows] + [""]
    return "\n".join(out)


def section_of(text: str) -> str | None:
    """What lies between the markers (None without both)."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start + len(START):end].strip("\n") + "\n"


def rows_of(section: str) -> dict[str, str]:
    """Key -> its table row, for every row of the section; a key that several tables hold (method.beta: each method's
    own) is named with its table's heading (method=dpo: method.beta)."""
    out, heading = {}, ""
    for line in section.splitlines():
        if line.startswith("### "):
            heading = line[4:].strip("`")
        elif m := ROW_KEY.match(line):
            out[f"{heading}: {m.group(1)}" if heading.startswith("method=") else m.group(1)] = line
    return out


def problems(readme: str) -> list[str]:
    """What differs between a page's text and the generated reference, one line each ([] when equal)."""
    section, generated = section_of(readme), render()
    if section is None:
        return [f"no config reference: the markers {START} / {END} are missing"]
    have, want = rows_of(section), rows_of(generated)
    out = [f"missing from the reference: {k}" for k in want if k not in have]
    out += [f"in the reference but not in the schema: {k}" for k in have if k not in want]
    out += [f"row differs: {k}\n  page:   {have[k]}\n  schema: {want[k]}" for k in want if k in have and have[k] != want[k]]
    if not out and section != generated:
        out.append("the section differs from the generated one outside the rows (headings, intros or order)")
    return out


def write(path: Path) -> None:
    """Replace the section between the markers; without them, add one before '## Layout' (or at the end)."""
    text, block = path.read_text(), f"{START}\n{render()}{END}"
    if section_of(text) is not None:
        text = text[:text.find(START)] + block + text[text.find(END) + len(END):]
    else:
        new = f"## Config reference\n\n{block}\n\n"
        at = text.find("\n## Layout")
        text = text[:at + 1] + new + text[at + 1:] if at >= 0 else text.rstrip("\n") + "\n\n" + new.rstrip("\n") + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", type=Path, metavar="PAGE", help="replace the section between the markers (docs/reference.md)")
    mode.add_argument("--check", type=Path, metavar="PAGE", help="exit 1 if the section is not the generated one")
    args = parser.parse_args(argv)
    undocumented = [row.key for table in tables() for row in table.rows if not row.doc]
    if undocumented:
        print(f"note: no docstring under {', '.join(undocumented)} in finetune/config/schema.py or root.py: "
              "their 'what it does' is empty", file=sys.stderr)
    if args.write:
        write(args.write)
        print(f"{args.write}: config reference written ({sum(len(t.rows) for t in tables())} fields)")
    elif args.check:
        found = problems(args.check.read_text())
        for line in found:
            print(f"{args.check}: {line}", file=sys.stderr)
        if found:
            print(f"regenerate: python scripts/config_reference.py --write {args.check}", file=sys.stderr)
            return 1
    else:
        print(render(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
