"""Job recipes (recipes/recipe/*.yaml): each dry-runs through the real CLI, each planned for GPUs
fits them, and the recipe table of docs/memory-planning.md is the one scripts/recipe_table.py generates today."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "scripts"))
import recipe_table  # noqa: E402

RECIPES = sorted(p.stem for p in (REPO / "recipes/recipe").glob("*.yaml"))
JOBS = [name for name in RECIPES if not name.startswith(("quickstart", "optuna", "zero3_offload")) and not name.endswith("_cpu")]


def test_the_real_model_jobs_are_there():
    assert JOBS == ["llama3_70b_qlora_80g", "llama3_70b_qlora_fsdp_2x24g", "llama3_8b_full_zero3_8x80g", "llama3_8b_lora_80g", "llama3_8b_qlora_24g",
                    "long_context", "qwen3_moe_lora_zero3_8x80g"]


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_dry_runs_and_shows_its_plan(name, tmp_path):
    out = run_cli(f"+recipe={name}", "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    plan_lines = [line for line in out.stdout.splitlines() if line.startswith("# memory plan")]
    if "recipe_if_missing:" in (REPO / f"recipes/recipe/{name}.yaml").read_text():  # its model is made by another recipe first
        assert plan_lines and plan_lines[0].startswith("# memory plan skipped: "), out.stdout[-2000:]
        return
    assert len(plan_lines) == 1 and plan_lines[0].endswith("FITS (python -m finetune.plan ... for the breakdown)"), plan_lines


@pytest.mark.parametrize("name", JOBS)
def test_each_job_fits_the_hardware_it_is_planned_for(name, compose):
    from finetune.planner.peak import plan

    cfg = compose([f"+recipe={name}"])
    pl = plan(cfg)
    assert cfg.hardware.name != "cpu" and cfg.model.architecture, name  # a hub model, planned offline
    assert pl.fits and pl.total > 0.2 * pl.budget, (name, pl.total / 2**30, pl.budget / 2**30)  # fits, and not by a mistake of 10x


def test_readme_recipe_table_is_generated_from_the_recipes_and_the_planner():
    assert recipe_table.main(["--check", str(REPO / "docs" / "memory-planning.md")]) == 0
    rows = [line for line in recipe_table.render().splitlines()[2:]]
    assert [re.match(r"\| `([^`]+)`", r)[1] for r in rows] == RECIPES
    assert "| `llama3_8b_qlora_24g` | meta-llama/Llama-3.1-8B | bf16, qlora r=16, checkpointing full, 2048 tokens x 1 | " \
           "1 x rtx4090_24g | fits |" in "\n".join(rows)
