"""The family matrix (issue 16): eleven families x nine strategies through the real CLI.

scripts/family_matrix.py runs every cell (~20 minutes on 2 cores) and records it in
scripts/family_matrix.json, which the family table of docs/families.md renders. Here: the record is whole
and has no failed cell, the page shows it, every refused cell is still refused with the same line
(refusals cost a dry run), and a covering subset of the cells that train is run again: each family
once, each strategy at least once (FINETUNE_FULL_MATRIX=1 runs every cell that trains)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from conftest import REPO
from ranks import launch_here

sys.path.insert(0, str(REPO / "scripts"))
import family_matrix as fm  # noqa: E402

RECORDED = json.loads(fm.RESULTS.read_text()) if fm.RESULTS.is_file() else {}
FAMILIES, STRATEGIES = list(fm.FAMILIES), list(fm.STRATEGIES)


def status(family: str, strategy: str) -> str:
    return RECORDED.get(family, {}).get(strategy, {}).get("status", "missing")


def covering() -> list[tuple[str, str]]:
    """One strategy per family, rotating, so that every strategy comes up at least once (11 families, 9
    strategies: the suite's time; FINETUNE_FULL_MATRIX=1 re-runs every cell)."""
    return [(f, STRATEGIES[i % len(STRATEGIES)]) for i, f in enumerate(FAMILIES)]


TRAINED = [(f, s) for f in FAMILIES for s in STRATEGIES if status(f, s) == "ok"]
RERUN = TRAINED if os.environ.get("FINETUNE_FULL_MATRIX") == "1" else [c for c in covering() if c in TRAINED]
REFUSED = [(f, s) for f in FAMILIES for s in STRATEGIES if status(f, s) == "refused"]


def test_the_record_has_every_cell_and_none_failed():
    missing = [(f, s) for f in FAMILIES for s in STRATEGIES if status(f, s) == "missing"]
    failed = [(f, s, RECORDED[f][s]["detail"]) for f in FAMILIES for s in STRATEGIES if status(f, s) == "failed"]
    assert not missing and not failed, (missing, failed)
    assert len(TRAINED) + len(REFUSED) == len(FAMILIES) * len(STRATEGIES)
    assert {s for _, s in covering()} == set(STRATEGIES) and {f for f, _ in covering()} == set(FAMILIES)


def test_readme_shows_the_recorded_matrix():
    assert fm.main(["--check", str(REPO / "docs" / "families.md")]) == 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return fm.build_models(tmp_path_factory.mktemp("family_models"), FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("family,strategy", REFUSED, ids=[f"{f}-{s}" for f, s in REFUSED])
def test_a_refused_cell_is_refused_before_launch_with_its_reason(family, strategy, models, tmp_path):
    cell = fm.run_cell(models[family], strategy, tmp_path / "run")
    assert cell == RECORDED[family][strategy]
    assert not (tmp_path / "run" / "ranks").exists() or not any((tmp_path / "run" / "ranks").glob("*.log"))  # no rank started


@pytest.mark.slow
@pytest.mark.parametrize("family,strategy", RERUN, ids=[f"{f}-{s}" for f, s in RERUN])
def test_a_cell_that_trains_still_trains(family, strategy, models, tmp_path):
    cell = fm.run_cell(models[family], strategy, tmp_path / "run", launch=launch_here)  # the ranks' part: refusals use the CLI
    assert cell["status"] == "ok", cell.get("output", cell["detail"])
    assert math.isfinite(cell["detail"]) and 0 < cell["detail"] < 20  # a language-model loss, ~ln(vocab) at random init
