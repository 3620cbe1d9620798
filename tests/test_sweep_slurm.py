"""Sweeps through hydra/launcher=submitit_slurm: a real sweep through submitit's Slurm path on this machine (the stand-in
Slurm of tests/slurm_standin), and the launcher configs finetune refuses before any trial (finetune.launcher.sweep_launchers)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

from finetune import disk
from finetune.launcher import sweep, sweep_launchers# noqa: E402
from finetune.config import ConfigError  # noqa: E402

from conftest import REPO  # noqa: E402
from test_sweep import TINY, small_data  # noqa: E402,F401 - the same tiny trial and data

STANDIN = REPO / "tests" / "slurm_standin"

def path_without_slurm() -> str:
    """PATH less any directory with an srun or sbatch (this machine has none; a cluster's login node would)."""
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not any((Path(d) / c).exists() for c in ("srun", "sbatch")))


@pytest.fixture
def slurm(tmp_path):
    """The stand-in Slurm first on PATH, its jobs under tmp_path/slurm; a job still running at the end is ended."""
    state = tmp_path / "slurm"
    yield {"PATH": f"{STANDIN}{os.pathsep}{path_without_slurm()}", "SLURM_STANDIN_DIR": str(state)}
    for pid_file in state.glob("runner-*.pid"):
        pid = int(pid_file.read_text())
        with contextlib.suppress(OSError):  # only a runner of ours that is still alive (not a reused pid)
            if b"--standin-run" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.killpg(pid, signal.SIGTERM)


def sweep_cli(*args: str, cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m finetune.launch -m ARGS` with `env` over this process's environment."""
    return subprocess.run([sys.executable, "-m", "finetune.launch", "-m", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


@pytest.mark.slow
@pytest.mark.cores(2)
def test_a_slurm_sweep_runs_each_trial_as_a_task_of_a_job_array(tmp_path, small_data, slurm):
    """Two trials as one job array (%2: both at once, a core each): submitit's own sbatch file, `sbatch`, its pickles, `srun
    python -m submitit.core._submit` in each task; both trials train, and the launching process prints the summary."""
    d = tmp_path / "sweep"
    out = sweep_cli("+recipe=quickstart_sft", "optim.lr=1e-3,2e-3", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=7",
                    "hydra.launcher.cpus_per_task=1", "hydra.launcher.gpus_per_node=1", "launcher.devices_per_trial=1", *TINY,
                    *small_data, "data.max_length=64", f"hydra.sweep.dir={d}", cwd=tmp_path,
                    env={**slurm, "FINETUNE_DEVICE_LOCKS": str(tmp_path / "locks")})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = sweep.collect(d)
    assert [(t.trial, t.status) for t in rows] == [("0", "ok"), ("1", "ok")]
    assert [r.split(",")[:3] for r in (d / "summary.csv").read_text().splitlines()[1:]] == [
        ["0", "optim.lr=0.001", "ok"], ["1", "optim.lr=0.002", "ok"]]
    assert (d / "summary.md").read_text() in out.stdout and "best         trial " in out.stdout

    (submission,) = (tmp_path / "slurm").glob("submission-*.sh")  # one sbatch: the whole sweep is one array
    job = submission.stem.split("-")[1]
    lines = submission.read_text().splitlines()
    for line in ("#SBATCH --array=0-1%2", "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=1",
                 "#SBATCH --gpus-per-node=1", "#SBATCH --time=7", "export SUBMITIT_EXECUTOR=slurm"):
        assert line in lines, submission.read_text()
    assert lines[-1].startswith("srun --unbuffered --output ") and f"{sys.executable} -u -m submitit.core._submit " in lines[-1]
    for n in (0, 1):  # each trial ran in its array task, under submitit's Slurm job environment
        log = (d / ".submitit" / f"{job}_{n}" / f"{job}_{n}_0_log.out").read_text()
        assert f"Starting with JobEnvironment(job_id={job}_{n}, " in log and "Job completed successfully" in log
        assert f"id: '{job}_{n}'" in (d / str(n) / ".hydra" / "hydra.yaml").read_text()
        assert (tmp_path / "slurm" / f"state-{job}_{n}").read_text() == "COMPLETED\n"
    (start0, end0), (start1, end1) = [((t / "config.yaml").stat().st_mtime, (t / "summary.json").stat().st_mtime)
                                      for t in sweep.trial_dirs(d)]
    assert start1 < end0 and start0 < end1  # the array ran both tasks at once
    if not disk.has_gpu():  # each on a core of its own (launcher.devices_per_trial=1)
        import json

        assert sorted(json.loads((t / "ranks" / "0.json").read_text())["cpus"] for t in sweep.trial_dirs(d)) == [[0], [1]]


NO_SLURM = ("hydra/launcher=submitit_slurm submits each trial with sbatch and srun, which this machine does not have "
            "({} not on PATH): run the sweep on the cluster's login node, or use hydra/launcher=submitit_local or "
            "hydra/launcher=joblib here")


def test_without_sbatch_and_srun_the_slurm_launcher_is_one_line(tmp_path):
    d = tmp_path / "sweep"
    out = sweep_cli("+recipe=quickstart_sft", "optim.lr=1e-3,2e-3", "hydra/launcher=submitit_slurm", "launcher.dry_run=true",
                    f"hydra.sweep.dir={d}", cwd=tmp_path, env={"PATH": path_without_slurm()}, timeout=60)
    assert (out.returncode, out.stderr.strip()) == (2, "error: " + NO_SLURM.format("sbatch and srun"))
    assert not d.exists()
    only_sbatch = tmp_path / "bin"  # sbatch alone (submitit's tasks run `srun`)
    only_sbatch.mkdir()
    (only_sbatch / "sbatch").symlink_to(STANDIN / "sbatch")
    out = sweep_cli("+recipe=quickstart_sft", "optim.lr=1e-3,2e-3", "hydra/launcher=submitit_slurm", "launcher.dry_run=true",
                    f"hydra.sweep.dir={d}", cwd=tmp_path, env={"PATH": f"{only_sbatch}{os.pathsep}{path_without_slurm()}"},
                    timeout=60)
    assert (out.returncode, out.stderr.strip()) == (2, "error: " + NO_SLURM.format("srun"))
    assert not d.exists()


TASKS = ("hydra.launcher.tasks_per_node=2: a trial is one task that starts its own launcher.nproc_per_node=1 ranks, so 2 tasks "
         "would each start a whole copy of the trial: keep hydra.launcher.tasks_per_node=1 and set launcher.nproc_per_node to "
         "the ranks a trial runs")


@pytest.mark.parametrize(("launcher", "overrides", "line"), [
    ("submitit_slurm", ["hydra.launcher.tasks_per_node=2"], TASKS),
    ("submitit_local", ["hydra.launcher.tasks_per_node=2"], TASKS),
    ("submitit_slurm", ["hydra.launcher.nodes=2"],
     "hydra.launcher.nodes=2: a trial of a sweep runs on one node, and 2 nodes would each start a whole copy of it (finetune's "
     "multi-node launches are started once per node: see docs/multi-node.md): keep hydra.launcher.nodes=1"),
    ("submitit_slurm", ["hydra.launcher.gpus_per_node=1", "launcher.nproc_per_node=2"],
     "hydra.launcher.gpus_per_node=1 gives each trial's job fewer GPUs than its launcher.nproc_per_node=2 ranks, a GPU each: "
     "set hydra.launcher.gpus_per_node=2 (or launcher.nproc_per_node=1)"),
    ("submitit_slurm", ["hydra.launcher.gpus_per_node=2", "launcher.nproc_per_node=1,4"],  # the sweep's widest trial
     "hydra.launcher.gpus_per_node=2 gives each trial's job fewer GPUs than its launcher.nproc_per_node=4 ranks, a GPU each: "
     "set hydra.launcher.gpus_per_node=4 (or launcher.nproc_per_node=2)"),
], ids=["slurm-tasks", "local-tasks", "slurm-nodes", "slurm-gpus", "slurm-gpus-swept"])
def test_a_launcher_config_that_cannot_run_a_trial_is_one_line_before_any_trial(tmp_path, slurm, launcher, overrides, line):
    d = tmp_path / "sweep"
    path = slurm if launcher == "submitit_slurm" else {"PATH": path_without_slurm()}  # submitit_local needs no Slurm
    ranks = [] if any(o.startswith("launcher.nproc_per_node=") for o in overrides) else ["launcher.nproc_per_node=1"]
    out = sweep_cli("+recipe=quickstart_sft", *ranks, "optim.lr=1e-3,2e-3", f"hydra/launcher={launcher}", *overrides,
                    "launcher.dry_run=true", f"hydra.sweep.dir={d}", cwd=tmp_path, env=path, timeout=60)
    assert (out.returncode, out.stderr.strip()) == (2, f"error: {line}")
    assert not d.exists()
    assert not list((tmp_path / "slurm").glob("submission-*"))  # nothing submitted


def launcher_config(target: str, nproc: int = 1, devices: int | None = None, **launcher) -> DictConfig:
    """The parts of a sweep's composed config that finetune.launcher.sweep_launchers reads."""
    return OmegaConf.create({"hydra": {"launcher": {"_target_": target, "tasks_per_node": 1, "nodes": 1, "gpus_per_node": None,
                                                    **launcher}, "overrides": {"task": []}},
                             "launcher": {"nproc_per_node": nproc, "devices_per_trial": devices}})


SLURM_TARGET = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"


def test_what_is_not_checked(monkeypatch):
    """Other launchers are not submitit's; a Slurm job without gpus_per_node (its GPUs asked for otherwise, or a trial
    that takes launcher.devices_per_trial of what it is given) is left as it is; as many GPUs as ranks is right."""
    monkeypatch.setenv("PATH", str(STANDIN))
    for target in ("hydra._internal.core_plugins.basic_launcher.BasicLauncher",
                   "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"):
        sweep_launchers.check(launcher_config(target, tasks_per_node=4, nodes=2))
    config = launcher_config(SLURM_TARGET, nproc=2, devices=2)
    sweep_launchers.check(config)
    assert config.hydra.launcher.gpus_per_node is None  # not changed
    sweep_launchers.check(launcher_config(SLURM_TARGET, nproc=2, gpus_per_node=2))
    sweep_launchers.check(launcher_config(SLURM_TARGET.replace("Slurm", "Local"), nproc=4, gpus_per_node=1))  # Slurm's key
    with pytest.raises(ConfigError, match=r"^hydra.launcher.gpus_per_node=1 gives"):
        sweep_launchers.check(launcher_config(SLURM_TARGET, nproc=2, gpus_per_node=1))


def test_submitit_local_on_a_gpu_machine_needs_its_gpus_named(monkeypatch):
    """submitit's local executor gives every trial CUDA_VISIBLE_DEVICES of its first gpus_per_node GPUs, none when that is
    unset: on a machine with a GPU, a local sweep without it is refused (its trials would train on CPU without a word)."""
    from finetune.launcher import sweep_launchers as checks

    local = SLURM_TARGET.replace("Slurm", "Local")
    monkeypatch.setattr(checks, "has_gpu", lambda: True)
    with pytest.raises(ConfigError) as refused:
        checks.check(launcher_config(local, nproc=1, devices=1))
    assert str(refused.value) == ("hydra/launcher=submitit_local hides this machine's GPUs from every trial unless "
                                  "hydra.launcher.gpus_per_node is set: set it to the GPUs the sweep may use, and "
                                  "launcher.devices_per_trial to each trial's share")
    checks.check(launcher_config(local, nproc=1, devices=1, gpus_per_node=4))
    monkeypatch.setattr(checks, "has_gpu", lambda: False)
    checks.check(launcher_config(local, nproc=1, devices=1))  # no GPU: nothing hidden
