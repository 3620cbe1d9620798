"""Every `python -m finetune.launch` / `finetune.plan` command of the site (README.md and every page of docs/ in
mkdocs.yml's nav: conftest.site_pages) and of launch/README.md composes and validates as written (in-process, through
`preflight`, as the CLI does before anything starts), and every example of a mistake there ends with the error line it
shows."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

from finetune.launcher.compose import preflight
from finetune.config import ConfigError

from conftest import REPO, site_pages

DOCS = (*site_pages(), "launch/README.md")
COMMAND = re.compile(r"^\s*(?:\$ )?(python -m finetune\.(?:launch|plan)\b.*)")
# What the docs write for "your own": the recipe of a user's launch (launch/README.md's `+recipe=X`)
# is one of their own, here the quickstart with a global batch that 2 nodes x 8 ranks can split.
OWN_RECIPE = """# @package _global_
defaults:
  - override /model: tiny
  - override /data: quickstart
  - override /parallelism: ddp
  - _self_
train:
  micro_batch_size: 8
  global_batch_size: 128
"""


def fenced_commands(doc: str) -> list[tuple[int, str, str | None]]:
    """(line number, command, the `error:` line shown under it or None) for each command in the
    doc's fenced code blocks; a trailing backslash continues a command on the next line."""
    lines = (REPO / doc).read_text().splitlines()
    out, fenced, i = [], False, 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = COMMAND.match(line) if fenced else None
        if match:
            number, text = i + 1, match.group(1)
            while text.rstrip().endswith("\\"):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i].strip()
            shown = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("error: ") else None
            out.append((number, text.split(" #")[0].strip(), shown))
        i += 1
    return out


def heredocs(doc: str) -> dict[str, str]:
    """Files a doc writes with `cat > PATH <<'EOF'`: path -> content."""
    return {m[0]: m[1] for m in re.findall(r"cat > (\S+) <<'EOF'\n(.*?)\nEOF\n", (REPO / doc).read_text(), re.S)}


def site_heredocs() -> dict[str, str]:
    """Files any page of the site writes with `cat > PATH <<'EOF'` (heredocs), path -> content."""
    return {path: content for doc in site_pages() for path, content in heredocs(doc).items()}


def overrides_of(command: str, tmp: Path) -> list[tuple[list[str], str | None]]:
    """(overrides, --config-dir) for each composition the command makes: one, or under -m one per
    combination of the comma-separated sweep values. Hydra's other flags (--cfg job) are dropped."""
    words = shlex.split(command)[3:]
    config_dir, plain, sweeps = None, [], []
    while words:
        word = words.pop(0)
        if word in ("--cfg", "-c"):
            words.pop(0)
        elif word in ("--config-dir", "-cd"):
            config_dir = str(tmp / words.pop(0))
        elif word in ("-m", "--multirun"):
            sweeps = None
        elif word == "+recipe=X":  # launch/README.md's stand-in for the user's recipe
            (tmp / "own/recipe").mkdir(parents=True, exist_ok=True)
            (tmp / "own/recipe/X.yaml").write_text(OWN_RECIPE)
            config_dir = str(tmp / "own")
            plain.append(word)
        else:
            plain.append(word)
    if sweeps is not None:  # a single run: commas are part of the value
        return [(plain, config_dir)]
    key_values = [(w.split("=", 1)[0], w.split("=", 1)[1].split(",")) if "=" in w and "[" not in w else (w, None) for w in plain]
    choices = [[f"{k}={v}" for v in values] if values else [k] for k, values in key_values]
    return [(list(combination), config_dir) for combination in itertools.product(*choices)]


CASES = [(doc, *c) for doc in DOCS for c in fenced_commands(doc)]


def test_the_docs_have_the_commands_this_test_checks():
    assert {"README.md", "docs/concepts.md", "docs/long-context.md"} <= {c[0] for c in CASES}, CASES  # the front door, pages
    assert len(CASES) >= 29, CASES  # 25 in the old one-page README, 4 in launch/README.md
    assert any(" -m " in c[2] for c in CASES) and any("\\" in (REPO / c[0]).read_text().splitlines()[c[1] - 1] for c in CASES)
    assert any(c[3] for c in CASES)  # the examples of a mistake


@pytest.mark.parametrize("doc,line,command,shown", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_readme_command_composes(doc, line, command, shown, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a checkout's copy: the commands run from the repository's root
    (tmp_path / "launch").symlink_to(REPO / "launch")
    for path, content in heredocs(doc).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(content + "\n")
    for overrides, config_dir in overrides_of(command, tmp_path):
        try:
            preflight(overrides, config_dir=config_dir)
        except ConfigError as e:
            if shown is None:
                pytest.fail(f"{doc}:{line}: `{command}` is refused: {e}")
            expected = shown.removeprefix("error: ")
            if expected.endswith("..."):  # the page shortens a long list
                assert str(e).startswith(expected[:-3]), f"{doc}:{line}: shows {shown!r}, the code says {e}"
            else:
                assert str(e) == expected, f"{doc}:{line}: shows {shown!r}, the code says {e}"
        else:
            assert shown is None, f"{doc}:{line}: shows {shown!r}, but `{command}` composes"


@pytest.mark.parametrize("index,extras", [(None, None), ("https://download.pytorch.org/whl/cpu", None), (None, "none")])
def test_install_takes_a_torch_index_when_named(tmp_path, index, extras):
    """scripts/install.sh without torch and without nvidia-smi: FINETUNE_TORCH_INDEX_URL (Getting started's
    install section) becomes that pip call's --index-url; without it, pip's own index as before. Both install at the
    tested versions (constraints/test.txt: torch's pin among them)."""
    import shutil
    import subprocess

    log, bin_dir = tmp_path / "calls.txt", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))  # PATH holds no nvidia-smi
    fake = tmp_path / "python"  # records each call; `-c "import torch"` fails: no torch here
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n[ "$1" != "-c" ]\n')
    fake.chmod(0o755)
    env = {"PATH": str(bin_dir), "PYTHON": str(fake), **({"FINETUNE_TORCH_INDEX_URL": index} if index else {})}
    out = subprocess.run([shutil.which("bash"), str(REPO / "scripts/install.sh"), *([extras] if extras else [])], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    torch_call = f"-m pip install -q --no-compile -c constraints/test.txt torch{f' --index-url {index}' if index else ''}"
    package = "-e ." if extras == "none" else "-e .[test]"  # scripts/quickstart.sh: the package alone; scripts/test.sh: the test extra
    assert log.read_text().splitlines() == ["-c import torch", torch_call, f"-m pip install -q --no-compile -c constraints/test.txt {package}"]


def test_own_recipe_through_the_real_cli(tmp_path):
    """The site's --config-dir example (Concepts), as written, through `python -m finetune.launch` (a dry run):
    Hydra's own --config-dir finds DIR/recipe/NAME.yaml; a name it cannot find says where it goes."""
    from conftest import last_line, run_cli

    ((doc, command),) = {(doc, c) for doc in site_pages() for _, c, _ in fenced_commands(doc) if "--config-dir" in c}
    for path, content in heredocs(doc).items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(content + "\n")
    out = run_cli(*shlex.split(command)[3:], f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "  max_steps: 200\n" in out.stdout and "torch.distributed.run" in out.stdout  # the recipe's value, the command
    missing = run_cli("--config-dir", "my_recipes", "+recipe=minee", cwd=tmp_path)
    assert missing.returncode == 2
    available = sorted(["mine", *(p.stem for p in (REPO / "recipes/recipe").glob("*.yaml"))])  # ours and the user's, together
    assert "quickstart_sft" in available and "llama3_8b_qlora_24g" in available
    assert last_line(missing.stderr) == (f"error: unknown recipe 'minee' (did you mean 'mine'?); available: {', '.join(available)} "
                                         "(a recipe of your own: --config-dir DIR with DIR/recipe/minee.yaml)")
