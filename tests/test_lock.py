"""constraints/test.txt: the versions the suite is tested with. scripts/install.sh installs `.[test]` under it, so a new
machine tests what CI tested; scripts/lock.sh refreshes it on purpose."""

from __future__ import annotations

import os
import re
from importlib.metadata import PackageNotFoundError, distribution

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO

LOCK = REPO / "constraints" / "test.txt"


def pins() -> dict[str, str]:
    """name (canonical) -> pinned version."""
    found = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            assert canonicalize_name(name) not in found, f"{name} is pinned twice"
            found[canonicalize_name(name)] = version.strip()
    return found


def test_install(extras: tuple[str, ...] = ("test",)) -> dict[str, str]:
    """Every distribution finetune[test] needs here, through its requirements' requirements: name -> installed version."""
    need: dict[str, str] = {}
    todo = [("finetune", frozenset(extras))]
    while todo:
        name, wanted = todo.pop()
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # a requirement whose marker held but that is not installed: pip would have refused the install
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (wanted or {""})):
                continue
            key = canonicalize_name(req.name)
            if key == "finetune":  # finetune[sweep] and the other extras of the test extra
                todo.append(("finetune", frozenset(req.extras)))
            elif key not in need:
                try:
                    need[key] = distribution(req.name).version
                except PackageNotFoundError:
                    continue
                todo.append((req.name, frozenset(req.extras)))
    return need


test_install.__test__ = False  # a helper, not a test (its name says what it returns)


def test_the_lock_pins_every_distribution_the_test_install_brings():
    header = "\n".join(line for line in LOCK.read_text().splitlines() if line.startswith("#"))
    assert re.search(r"Made by scripts/lock\.sh on \d{4}-\d\d-\d\d from a new virtualenv: Python 3\.\d+", header), header
    pinned, installed = pins(), test_install()
    assert "torch" in pinned and "+" not in pinned["torch"]  # the release, for the CPU and the CUDA build alike
    missing = sorted(set(installed) - set(pinned))
    assert not missing, f"not in {LOCK.relative_to(REPO)}: {missing}: run bash scripts/lock.sh"


@pytest.mark.skipif(not os.environ.get("CI"), reason="CI installs through scripts/install.sh; a developer's environment may differ")
def test_ci_tests_the_locked_versions():
    pinned = pins()
    differ = {name: (version, pinned[name]) for name, version in test_install().items()
              if name in pinned and version.split("+")[0] != pinned[name]}
    assert not differ, f"installed != {LOCK.relative_to(REPO)}: {differ}"
