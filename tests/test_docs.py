"""The documentation site (mkdocs.yml, docs/) and its front door (README.md): the site builds with `mkdocs build
--strict` (no broken link or anchor, every page in the nav, no warning), every page of docs/ is in the nav (which is
also the order the tests read the pages' commands in: conftest.site_pages), README.md stays a front door, and the
architecture page names the code as it is."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO, site_pages

DOCS = REPO / "docs"
FRONT_DOOR_LINES = 300
"""README.md is the front door: what it is, the two commands, one run, what it does, links into the site."""


def test_the_site_builds_strictly(tmp_path):
    """Into a temporary directory: nothing is written into the checkout (mkdocs' own site/ is never made here)."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
                          "--site-dir", str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    said = out.stdout + out.stderr
    assert out.returncode == 0, f'mkdocs build --strict failed (pip install -e ".[docs]" installs it):\n{said[-4000:]}'
    assert not re.search(r"^(WARNING|ERROR)\b", said, re.M), said[-4000:]
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    for page in site_pages()[1:]:
        name = page.removeprefix("docs/").removesuffix(".md")
        assert ("index.html" if name == "index" else f"{name}/index.html") in built, page


def test_every_page_of_docs_is_in_the_nav():
    pages = site_pages()
    assert pages[0] == "README.md" and len(pages) == len(set(pages)), pages
    on_disk = {p.relative_to(REPO).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk == set(pages[1:]), (f"not in mkdocs.yml's nav: {sorted(on_disk - set(pages))}; "
                                       f"in the nav but not in docs/: {sorted(set(pages[1:]) - on_disk)}")


def test_the_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < FRONT_DOOR_LINES, f"README.md has {len(text.splitlines())} lines: move what it explains into docs/"
    assert ("## The two commands\n\n```bash\n"
            "bash scripts/quickstart.sh   # installs, then trains the quickstart recipe on 2 CPU ranks (~40 s)\n"
            "bash scripts/test.sh         # installs, then runs the whole test suite on CPU\n```\n") in text
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]+)?\)", text))
    assert linked == set(site_pages()[1:]), f"README.md links no page {sorted(set(site_pages()[1:]) - linked)}"
    for page in linked:
        assert (REPO / page).is_file(), page


def test_the_architecture_page_names_every_module_and_only_paths_that_exist():
    """docs/architecture.md is the code's map: a module added to finetune/ (or a package) is named there, and a path it
    names (finetune/..., tests/..., scripts/..., recipes/..., launch/...) exists."""
    text = (DOCS / "architecture.md").read_text()
    package = REPO / "finetune"
    modules = [p for p in package.rglob("*.py") if "assets" not in p.relative_to(package).parts and p.name != "__init__.py"]
    unnamed = sorted(p.relative_to(REPO).as_posix() for p in modules if not re.search(rf"(?<![\w/]){re.escape(p.name)}\b", text))
    packages = [p.parent.name for p in package.glob("*/__init__.py")]
    unnamed += sorted(f"finetune/{name}/" for name in packages if f"{name}/" not in text)
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"
    named = set(re.findall(r"(?<![\w/.])((?:finetune|tests|scripts|recipes|launch)/[\w./]*\w)", text))
    missing = sorted(path for path in named if "NAME" not in path and not (REPO / path).exists())  # NAME: yours
    assert len(named) > 20 and not missing, f"docs/architecture.md names paths that do not exist: {missing}"
