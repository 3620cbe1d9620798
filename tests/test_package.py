"""The package as a user installs it: `python -m build` makes the sdist, and the wheel from that sdist; the wheel, not
this editable checkout, is installed into a new environment (which reuses the dependencies already installed here);
from a directory outside the checkout, `finetune --version`, a dry run of a shipped recipe and a 2-step quickstart run
from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import ranks
from conftest import REPO, last_line

pytestmark = pytest.mark.slow


def packages_in_checkout() -> set[str]:
    """Every package directory under finetune/ (an __init__.py), as a dotted name, and the recipes package."""
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "finetune").rglob("__init__.py")}
    return found | {"finetune.recipes"}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("finetune-*.whl")
    (sdist,) = out.glob("finetune-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_the_wheel_holds_every_package_recipe_and_asset(built):
    names = zipfile.ZipFile(built["wheel"]).namelist()
    packages = {str(Path(n).parent).replace("/", ".") for n in names if n.endswith("__init__.py") or n.endswith(".yaml")}
    assert packages_in_checkout() <= packages, sorted(packages_in_checkout() - packages)
    recipes = sorted(p.relative_to(REPO / "recipes").as_posix() for p in (REPO / "recipes").rglob("*.yaml"))
    assert sorted(n.removeprefix("finetune/recipes/") for n in names if n.startswith("finetune/recipes/")) == recipes
    assets = sorted(p.relative_to(REPO / "finetune").as_posix() for p in (REPO / "finetune/assets").rglob("*") if p.is_file()
                    and "__pycache__" not in p.parts)
    assert sorted(n.removeprefix("finetune/") for n in names if n.startswith("finetune/assets/")) == assets
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "finetune = finetune.launcher.cli:main" in zipfile.ZipFile(built["wheel"]).read(entry).decode()
    # the sdist holds what the wheel was built from (python -m build builds the wheel from the sdist)
    members = tarfile.open(built["sdist"]).getnames()
    assert any(m.endswith("/recipes/recipe/quickstart_sft.yaml") for m in members) and any(m.endswith("/setup.py") for m in members)


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Path:
    """A new environment holding the wheel; the dependencies are this environment's (a .pth line, which processes no
    .pth files there: this checkout's editable finder stays out)."""
    env = tmp_path_factory.mktemp("env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    site = Path(subprocess.run([str(env / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    done = subprocess.run([str(env / "bin/python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(built["wheel"])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return env


def run_installed(env: Path, args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    path = f"{env / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**environ, "PATH": path, "PYTHONUNBUFFERED": "1", "VIRTUAL_ENV": str(env)})


def test_the_installed_wheel_runs_outside_the_checkout(installed, tmp_path):
    where = run_installed(installed, ["python", "-c", "import finetune, finetune.config, finetune.families, finetune.optimizers, "
                                      "finetune.planner, finetune.launcher.rules, finetune.launcher.compose; print(finetune.__file__)"], tmp_path)
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout  # the wheel's copy, not this checkout
    version = run_installed(installed, ["finetune", "--version"], tmp_path)
    assert (version.returncode, version.stdout) == (0, "finetune 0.1.0\n"), version.stderr
    dry = run_installed(installed, ["finetune", "train", "+recipe=quickstart_sft", "launcher.dry_run=true"], tmp_path)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert f"{installed / 'bin/python'} -m torch.distributed.run" in dry.stdout  # the ranks start from the new environment
    assert "/finetune/assets/tokenizer" in dry.stdout and str(REPO) not in dry.stdout  # the wheel's assets
    with ranks.cores(2):
        run = run_installed(installed, ["finetune", "train", "+recipe=quickstart_sft", "train.max_steps=2", "optim.warmup_steps=0",
                                        "train.eval_every=0", "train.exact_match_samples=0", "train.progress_bar=false",
                                        "hydra.run.dir=run"], tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert [m["step"] for m in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines()) if m["kind"] == "train"] == [1, 2]
    assert (tmp_path / "run/final/model.safetensors").is_file()
    wrong = run_installed(installed, ["finetune", "trian"], tmp_path)
    assert (wrong.returncode, last_line(wrong.stderr)) == (2, "error: finetune trian: no such command (did you mean 'train'?); the "
                                                           "commands: train, plan, prepare, export, generate, evaluate (finetune --help)")


def test_every_declared_floor_is_a_tested_version():
    """pyproject.toml's lower bounds (the runtime dependencies and every extra's) name the release the suite runs with
    (constraints/test.txt, at the floor's precision: >=5.24 against 5.24.0): a floor below it would promise a version no
    run tried. After scripts/lock.sh moves a pin, this names the floor to raise."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {canonicalize_name(name): Version(version) for line in (REPO / "constraints" / "test.txt").read_text().splitlines()
            if line and not line.startswith("#") for name, version in [line.split("==")]}
    requirements = [Requirement(r) for r in project["dependencies"] + [r for extra in project["optional-dependencies"].values()
                                                                      for r in extra]]
    untested = []
    for req in requirements:
        floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
        name = canonicalize_name(req.name)
        if not floors or name == "finetune" or name not in pins:  # no floor, an extra of ours, a GPU extra (not installed here)
            continue
        floor, pin = floors[0], pins[name]
        if pin.release[:len(floor.release)] != floor.release or pin not in req.specifier:
            untested.append(f"{req} (tested: {pin})")
    assert untested == [], untested
    assert len([r for r in requirements if canonicalize_name(r.name) in pins]) >= 25
