"""The package's layout as the tests hold it: the two sides and the shared modules (imports only run down), no import
circles, no module over MAX_LINES or function over MAX_FUNCTION, and the launcher side importing no torch.

Read from the source (ast), nothing imported: every import is an edge, inside a function (it runs when the function
does) or under `if TYPE_CHECKING:` (a reader and a type checker follow it: a circle through it is a circle in the
design). Importing `a.b.c` runs the packages `a` and `a.b` too: the graph holds those edges as well.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "finetune"

MAX_LINES = 600
"""No module of finetune/ is longer: one that grows past it does more than one job (split it by topic)."""

MAX_FUNCTION = 80
"""No function of finetune/ is longer (its docstring included): one that is reads as several steps (name them)."""

ENTRIES = {"finetune.launch": "launcher", "finetune.plan": "launcher", "finetune.prepare": "launcher",
           "finetune.train": "rank", "finetune.generate": "rank", "finetune.export": "rank", "finetune.evaluate": "rank"}
"""The commands users type (`python -m finetune.NAME`), kept at the top under those names: each only runs its side's
module."""

MAX_FLAT = 12
"""At most this many modules at the top of finetune/ (the entries above and the shared pure modules that fit no
package): the rest lives in launcher/, rank/ or a shared package."""

TORCH_SHARED = ("finetune.methods.losses", "finetune.data.host", "finetune.optimizers.kernels", "finetune.optimizers.sharded", "finetune.optimizers.muon")
"""Shared modules that import torch: the torch half of a shared record (the methods' loss helpers, the optimizers'
builders), imported only inside the record's functions that run on the ranks, and by the rank side."""


def side(module: str) -> str:
    """launcher, rank, entry (a command's name at the top), or shared (read by both sides)."""
    if module in ENTRIES:
        return "entry"
    for name in ("launcher", "rank"):
        if module == f"finetune.{name}" or module.startswith(f"finetune.{name}."):
            return name
    return "shared"


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, from its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found




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
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
    """The checker itself: an import inside a function is an edge, and so is one under TYPE_CHECKING."""
    graph = import_graph()
    assert "finetune.optimizers.kernels" in graph["finetune.optimizers"]  # inside a builder: `from finetune.optimizers.kernels import kernel`
    assert "finetune.rank.engine.common" in graph["finetune.rank.engine.base"]  # under TYPE_CHECKING
    assert "finetune.families.shapes" in graph["finetune.families.checks"]  # only for type hints, under TYPE_CHECKING
    assert "finetune.methods" in graph["finetune.methods.dpo"] or "finetune.methods.base" in graph["finetune.methods.dpo"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles in finetune/ (move the shared piece below both): " + "; ".join(" -> ".join(c) for c in found)


def test_no_function_is_over_80_lines():
    long = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION:
                long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"functions over {MAX_FUNCTION} lines (name their steps as functions): {long}"


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by topic): {long}"


def test_the_sides_import_only_down():
    """launcher/ and rank/ import the shared modules and never each other; a shared module imports neither; an entry
    imports its own side."""
    graph = import_graph()
    wrong = []
    for module, targets in graph.items():
        mine = side(module)
        for target in targets:
            theirs = side(target)
            allowed = {"launcher": {"launcher", "shared"}, "rank": {"rank", "shared"}, "shared": {"shared"},
                       "entry": {ENTRIES.get(module, ""), "shared"}}[mine]
            if theirs not in allowed:
                wrong.append(f"{module} ({mine}) -> {target} ({theirs})")
    assert not wrong, "imports across the sides (move the shared piece into a shared module): " + "; ".join(sorted(wrong))


def test_few_modules_sit_flat_at_the_top():
    flat = sorted(m for m, p in modules().items() if m.count(".") == 1 and p.name != "__init__.py")
    assert len(flat) <= MAX_FLAT, f"{len(flat)} modules at the top of finetune/ (at most {MAX_FLAT}): {flat}"
    assert set(ENTRIES) <= set(flat), f"the commands' names are gone from the top: {sorted(set(ENTRIES) - set(flat))}"


def launcher_side() -> list[str]:
    """What may run where the command is typed: launcher/, the shared modules, the launcher's entries."""
    return sorted(m for m in modules() if side(m) in ("launcher", "shared") or ENTRIES.get(m) == "launcher")


def test_the_launcher_imports_nothing_of_the_ranks():
    """The launcher's commands import launcher/ and shared modules only."""
    code = ("import sys, finetune.launch, finetune.plan, finetune.prepare; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('finetune'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    other = sorted(set(done.stdout.split()) - set(launcher_side()) - {"finetune"})
    assert not other, f"the launcher imports {other}: import them on the ranks"


HEAVY = ("torch", "transformers", "deepspeed")


def test_the_launcher_side_imports_no_torch():
    """Every launcher-side and shared module imported in one process (but the TORCH_SHARED ones): none of torch,
    transformers or deepspeed is loaded. On a failure each is imported alone to name the one that does."""
    mods = [m for m in launcher_side() if m not in TORCH_SHARED]
    code = ("import importlib, sys; mods = sys.argv[1:]\n"
            "for m in mods: importlib.import_module(m)\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}); print(heavy[:5]); sys.exit(bool(heavy))")
    done = subprocess.run([sys.executable, "-c", code, *mods], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return
    culprits = []
    for m in mods:
        one = subprocess.run([sys.executable, "-c", code, m], cwd=ROOT, capture_output=True, text=True, timeout=120)
        if one.returncode:
            culprits.append(f"{m}: {one.stdout.strip() or one.stderr[-300:]}")
    raise AssertionError("the launcher side imports torch, transformers or deepspeed: " + "; ".join(culprits or [done.stderr[-2000:]]))


HIDE = """
import runpy, sys
hidden = set(sys.argv[1].split(","))
class Hide:  # a finder that finds nothing of the hidden packages, else what the finder it wraps finds
    def __init__(self, finder): self.finder = finder
    def find_spec(self, name, path=None, target=None):
        return None if name.partition(".")[0] in hidden else self.finder.find_spec(name, path, target)
    def __getattr__(self, name): return getattr(self.finder, name)
sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""
"""Run `python -m MODULE ARGS` as on a machine without the packages named first: `import torch` raises
ModuleNotFoundError and importlib.util.find_spec("torch") is None (what libraries ask before they use it)."""


def test_the_launcher_commands_run_without_torch(tmp_path):
    """A dry run, the planner and a prepare, each with torch and deepspeed unimportable (and transformers too but for
    prepare, which loads the tokenizer through transformers' torch-free half): each does its whole job."""
    quick = ["+recipe=quickstart_sft", f"run_dir={tmp_path / 'run'}"]
    cache = f"data.cache_dir={tmp_path / 'tokens'}"
    for hidden, module, args, last in (
            ("torch,deepspeed,transformers", "finetune.launch", [*quick, "launcher.dry_run=true"], "-m finetune.train"),
            ("torch,deepspeed,transformers", "finetune.plan", quick, "FITS"),
            ("torch,deepspeed", "finetune.prepare", [*quick, cache], "(train 4,000 rows, 87,395 tokens, eval 256 rows, 5,557 tokens)")):
        done = subprocess.run([sys.executable, "-c", HIDE, hidden, module, *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, f"{module} without {hidden}: {done.stderr[-2000:]}"
        assert last in done.stdout, f"{module}: {done.stdout[-1000:]}"
