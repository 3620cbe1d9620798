"""The package's layout as the tests hold it: no import circles (module-level or inside a function), no
module over MAX_LINES, and the launcher side importing no torch.

Read from the source (ast), nothing imported: an import inside a function counts like one at the top (it runs
when the function does, and a circle it closes is only hidden), one under `if TYPE_CHECKING:` does not (it never
runs). Importing `a.b.c` runs the packages `a` and `a.b` too: the graph holds those edges as well.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "finetune"

MAX_LINES = 600
"""No module of finetune/ is longer: one that grows past it does more than one job (split it by topic)."""

LAUNCHER_SIDE = (
    "finetune.launch", "finetune.compose", "finetune.command", "finetune.supervise", "finetune.trials", "finetune.sweep",
    "finetune.rundir", "finetune.startup", "finetune.prepare", "finetune.errors", "finetune.config", "finetune.config.fields",
    "finetune.config.schema", "finetune.config.peft", "finetune.config.root", "finetune.rules", "finetune.rules.model", "finetune.rules.data",
    "finetune.rules.optim", "finetune.rules.layout", "finetune.rules.strategies", "finetune.rules.peft", "finetune.plan", "finetune.planner",
    "finetune.planner.counts", "finetune.planner.activations", "finetune.planner.peak", "finetune.planner.records",
    "finetune.planner.suggest", "finetune.planner.cli", "finetune.lengths", "finetune.disk", "finetune.structure",
    "finetune.families", "finetune.families.records", "finetune.families.arch", "finetune.families.checks",
    "finetune.methods", "finetune.optimizers",
    "finetune.liger", "finetune.logs", "finetune.trackers", "finetune.benchmarks", "finetune.data", "finetune.data.sources", "finetune.data.forms",
    "finetune.data.tokenize", "finetune.data.examples", "finetune.data.pack", "finetune.data.batches", "finetune.data.templates",
    "finetune.data.tools", "finetune.steps", "finetune.config.data", "finetune.devices", "finetune.sweep_launchers",
)
"""The launcher side: what `python -m finetune.launch` and `python -m finetune.plan` import (composition, rules,
planner, command, supervision, the data checks, the records they read; every module of finetune/methods/ is added
below: the launcher reads each method's record). None of it may import torch, transformers
or deepspeed, so that a dry run is instant on a machine without them. Every other module of finetune/ is the rank
side (docs/architecture.md: "The rank side")."""


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, from its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


LAUNCHER_SIDE += tuple(m for m in modules() if m.startswith("finetune.methods."))  # every method's record, none named here


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under `if TYPE_CHECKING:`."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement of module `name` may load."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        here = here[: len(here) - node.level + 1]
        base = ".".join(here + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (and the packages those run on the way)."""
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for name, path in known.items():
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(name, path, node):
                while target and target not in known:  # `from pkg import function`: the module pkg
                    target = target.rpartition(".")[0]
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # a.b.c runs a.b first; the importer's own packages are already running
                    step = ".".join(parts[:i])
                    if step in known and step != name and not name.startswith(step + "."):
                        graph[name].add(step)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each group of modules that import each other (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, set(g)) for g in groups]


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle inside a strongly connected group, as a path that ends where it starts."""
    start = min(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & group):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    raise AssertionError(group)


def test_the_graph_sees_function_level_imports():
    """The checker itself: an import inside a function is an edge, one under TYPE_CHECKING is not."""
    graph = import_graph()
    assert "finetune.optimizers.kernels" in graph["finetune.optimizers"]  # inside a builder: `from finetune.optimizers.kernels import kernel`
    assert "finetune.config" not in graph["finetune.optimizers"]  # only for type hints, under TYPE_CHECKING
    assert "finetune.methods" in graph["finetune.methods.dpo"] or "finetune.methods.base" in graph["finetune.methods.dpo"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles in finetune/ (move the shared piece below both): " + "; ".join(" -> ".join(c) for c in found)


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by topic): {long}"


def test_the_launcher_side_is_a_known_list():
    """LAUNCHER_SIDE names modules that exist, and the launcher's commands import none but those."""
    known = modules()
    missing = [m for m in LAUNCHER_SIDE if m not in known]
    assert not missing, f"LAUNCHER_SIDE names modules that are gone: {missing}"
    code = ("import sys, finetune.launch, finetune.plan, finetune.prepare; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('finetune'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    other = sorted(set(done.stdout.split()) - set(LAUNCHER_SIDE) - {"finetune"})
    assert not other, f"the launcher imports {other}: add them to LAUNCHER_SIDE (and keep them free of torch) or import them on the ranks"


@pytest.mark.parametrize("module", LAUNCHER_SIDE)
def test_the_launcher_side_imports_no_torch(module):
    if module not in modules():
        pytest.skip(f"{module} is not a module of this tree")
    code = (f"import sys, {module}; heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'deepspeed')); print(heavy); sys.exit(bool(heavy))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{module} imports {done.stdout.strip() or done.stderr[-2000:]}"
