"""Staying alive: atomic checkpoints that keep the last K and know their run, refused incompatible
resumes, a full disk that leaves the previous checkpoint intact, NaN steps stopped or skipped,
SIGTERM saving a resumable checkpoint, kill -9 of the whole job or of one rank."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from finetune.rank import checkpoint
from finetune.config import ConfigError

from conftest import REPO, last_line, kill_whole_job, read_metrics, steps_done, train_here, wait_for
from ranks import launch_here

QUICK = ["train.max_steps=6", "train.micro_batch_size=8", "train.global_batch_size=8", "optim.warmup_steps=1", "train.eval_every=0",
         "data.eval_size=0", "data.eval=null", "train.exact_match_samples=0", "train.memory_report=false"]


def train_rows(run_dir):
    return [m for m in read_metrics(run_dir) if m["kind"] == "train"]


def test_checkpoints_are_complete_keep_the_last_k_and_record_their_run(tmp_path):
    train_here([*QUICK, "train.save_every=2", "train.keep_checkpoints=2"], tmp_path)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_4", "step_6"]  # step_2 pruned, no temporaries
    assert (root / "latest").read_text() == "step_6\n"
    meta = json.loads((root / "step_6/meta.json").read_text())
    assert meta["step"] == 6 and len(meta["config_hash"]) == 16
    assert meta["layout"] == {"engine": "torch", "world_size": 1, "zero_stage": None, "offload_optimizer": "none",
                              "offload_param": "none", "strategy": "single", "fsdp_offload": False, "tp": 1, "pp": 1,
                              "pp_stages_per_rank": 1, "cp": 1}
    assert meta["settings"]["optim.lr"] == 1e-4 and meta["settings"]["train.seed"] == 42
    assert (root / "step_6/rng_0.pt").is_file()
    # An unfinished save (a temporary directory, or a step without meta.json) is never what auto resumes.
    (root / ".tmp-step_8").mkdir()
    (root / "step_9").mkdir()
    assert checkpoint.resolve("auto", tmp_path) == root / "step_6"


def test_an_incompatible_resume_is_refused_naming_the_difference(tmp_path):
    train_here([*QUICK, "train.max_steps=2", "train.save_every=2"], tmp_path / "a")
    step = tmp_path / "a/checkpoints/step_2"
    with pytest.raises(ConfigError) as e:
        train_here([*QUICK, "optim.lr=3e-4", f"train.resume={step}"], tmp_path / "b")
    assert str(e.value) == (f"train.resume: {step} was trained with optim.lr=0.0001, this run has optim.lr=0.0003: "
                            "resume with the same setting, or start a fresh run")
    with pytest.raises(ConfigError) as e:
        train_here([*QUICK, "model.init.hidden_size=64", f"train.resume={step}"], tmp_path / "c")
    assert "was trained with model.init.hidden_size=128, this run has model.init.hidden_size=64" in str(e.value)
    # What does not change the trajectory may change: more steps, another save cadence.
    train_here([*QUICK, "train.max_steps=4", "train.save_every=1", f"train.resume={step}"], tmp_path / "d")
    assert [m["step"] for m in train_rows(tmp_path / "d")] == [3, 4]


def test_a_layout_the_format_cannot_change_is_refused(compose, tmp_path):
    saved = compose(["zero=stage2", "parallelism=ddp", "launcher.nproc_per_node=2", "train.global_batch_size=32"])
    step = tmp_path / "step_2"
    step.mkdir()
    meta = {"step": 2, "config_hash": checkpoint.config_hash(checkpoint.trajectory(saved)), "settings": checkpoint.trajectory(saved),
            "layout": checkpoint.layout(saved)}
    (step / "meta.json").write_text(json.dumps(meta))
    now = compose(["zero=stage2", "parallelism=ddp", "launcher.nproc_per_node=4", "train.global_batch_size=32"])
    with pytest.raises(ConfigError) as e:
        checkpoint.check_compatible(step, now)
    assert str(e.value) == (f"train.resume: {step} was saved with world_size=2 (deepspeed engine), this run has world_size=4: "
                            "that checkpoint format cannot change it; resume under DeepSpeed with the same zero stage and number of ranks")
    torch_saved = compose(["parallelism=ddp", "launcher.nproc_per_node=2", "train.global_batch_size=32"])
    meta["layout"] = checkpoint.layout(torch_saved)
    meta["config_hash"] = checkpoint.config_hash(checkpoint.trajectory(torch_saved))
    meta["settings"] = checkpoint.trajectory(torch_saved)
    (step / "meta.json").write_text(json.dumps(meta))
    checkpoint.check_compatible(step, compose(["parallelism=ddp", "launcher.nproc_per_node=4", "train.global_batch_size=32"]))


def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """In-process, a write failing with ENOSPC (test_faults.py fills a real disk, through the CLI, on every engine)."""
    from finetune.rank.engine import torch_engine

    real_save, calls = torch_engine.torch.save, []

    def full_disk(obj, path, *args, **kwargs):
        calls.append(path)
        if len([c for c in calls if str(c).endswith("state.pt")]) == 2:  # the second checkpoint's model state
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch_engine.torch, "save", full_disk)
    with pytest.raises(checkpoint.CheckpointError) as e:
        train_here([*QUICK, "train.save_every=2"], tmp_path)
    root = tmp_path / "checkpoints"
    assert re.fullmatch(  # the write failed as a full disk fails it, on a disk that is not full: a fast check of the words
        rf"saving checkpoint step_4 in {re.escape(str(root))} failed on rank 0: No space left on device \(\d+\.\d MiB free there; "
        rf"a checkpoint takes \d+\.\d MiB\): the previous checkpoint {re.escape(str(root / 'step_2'))} is intact; free space there, "
        "then continue with train.resume=auto", str(e.value)), str(e.value)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]
    assert checkpoint.resolve("auto", tmp_path) == root / "step_2"


class NanAt:
    """Wraps an objective: the loss of the given step (1-based, one micro-batch per step) is NaN."""

    def __init__(self, objective, step):
        self.objective, self.step, self.calls = objective, step, 0
        self.metrics = objective.metrics

    def count(self, batch):
        return self.objective.count(batch)

    def __call__(self, model, batch):
        loss, sums = self.objective(model, batch)
        if model.training:
            self.calls += 1
            if self.calls == self.step:
                loss = loss * float("nan")
        return loss, sums


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_nan_step_stops_naming_the_step_or_is_skipped(mode, tmp_path, monkeypatch):
    from finetune.rank import loop, train

    build = train.build_objective
    monkeypatch.setattr(train, "build_objective", lambda *a, **k: NanAt(build(*a, **k), step=3))
    weights = {}
    export = "finetune.rank.engine.torch_engine.TorchEngine.export"
    if mode == "stop":
        with pytest.raises(loop.Stopped) as e:
            train_here([*QUICK, "train.on_nonfinite=stop"], tmp_path)
        assert str(e.value) == ("step 3: the loss is nan and the gradient norm nan: stopped before training on them (the weights are "
                                "those after step 2); lower optim.lr, use precision=bf16 rather than fp16, check the data, or set "
                                "train.on_nonfinite=skip")
        assert [m["step"] for m in train_rows(tmp_path)] == [1, 2, 3]
        return
    monkeypatch.setattr(export, lambda self, path, tok: weights.update(after=[p.detach().clone() for p in self.module.parameters()]))
    train_here([*QUICK, "train.on_nonfinite=skip"], tmp_path)
    rows = train_rows(tmp_path)
    assert [m["nonfinite_skipped"] for m in rows] == [0, 0, 1, 1, 1, 1]
    assert all(torch.isfinite(p).all() for p in weights["after"])


# ---------------------------------------------------------------------------------------------
# Signals and kills, through the real CLI (2 CPU ranks)

RUN = [sys.executable, "-m", "finetune.launch", "+recipe=quickstart_sft", "train.progress_bar=false", "train.eval_every=0",
       "train.exact_match_samples=0", "train.log_every=1000", "train.memory_report=false", "optim.warmup_steps=1"]


def start(args, tmp_path, name):
    return subprocess.Popen([*RUN, *args, f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


# SIGTERM to the launcher (a scheduler's) and a rank killed mid-run, with resume to the same weights, are
# tests/test_faults.py's, on every engine they apply to (torchrun: ddp, fsdp; deepspeed: zero2).


POOL_TERMINATES = """
import time
import multiprocess
from finetune.rank import loop

loop.handle_signals()
with multiprocess.get_context("fork").Pool(2) as pool:
    pending = [pool.apply_async(time.sleep, (600,)) for _ in range(2)]
    time.sleep(1)  # both workers are inside a task, as when one tokenizing shard fails and the other still runs
tic = time.time()
pool.join()
print(f"terminated in {time.time() - tic:.1f}s")
"""


def test_a_forked_worker_is_ended_by_sigterm_not_caught_as_its_tasks_failure():
    """datasets.map's pool ends its workers with one SIGTERM when a shard raises (a bad row). Our handler,
    inherited by the fork, raised Stopped inside the other worker's task: the pool counted it as that
    task's failure, the worker waited for more work, and the rank hung in the pool's join (seen in CI)."""
    out = subprocess.run([sys.executable, "-c", POOL_TERMINATES], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("terminated in ")



SIGTERM_AT_FORK = """
import os, signal, time
from finetune.rank import loop

loop.handle_signals()
survived = 0
for _ in range(200):
    pid = os.fork()
    if pid == 0:  # a worker starting: the pool may terminate it before its interpreter has settled
        time.sleep(0.5)
        os._exit(0)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    survived += os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0  # it ran on as if never signalled
print(f"survived {survived}")
"""


def test_a_sigterm_that_reaches_a_child_as_it_is_forked_still_ends_it():
    """The second way the pool hung a rank (CI, under load): a shard raised while the other worker was still
    being forked, and the pool's SIGTERM reached it before the interpreter's after-fork reset, which drops
    it. With our handler installed and the signals not blocked across the fork, 184 of these 200 children
    ran on as if never signalled; with the default handler, none."""
    out = subprocess.run([sys.executable, "-c", SIGTERM_AT_FORK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "survived 0"

@pytest.mark.slow
# One engine: every engine saves through checkpoint.saving's temporary directory and rename, which is what a kill -9
# tests; DeepSpeed's own resume to the same trajectory is tests/test_deepspeed.py's and tests/test_faults.py's.
@pytest.mark.parametrize("engine", [["peft=lora"]], ids=["torch-lora-dropout"])
@pytest.mark.cores(2)
def test_kill_9_then_resume_gives_the_uninterrupted_weights(engine, tmp_path):
    """The kill goes to a job the real CLI started; the uninterrupted run and the resume are the ranks' part (tests/ranks.py)."""
    common = ["train.max_steps=60", "train.save_every=5", "train.micro_batch_size=8", *engine]
    full = launch_here(*RUN[3:], *common, run_dir=tmp_path / "full")
    assert full.returncode == 0, full.stderr[-2000:]
    proc = start(common, tmp_path, "killed")
    assert wait_for(lambda: (tmp_path / "killed/checkpoints/latest").is_file())  # mid-run: after its first checkpoint
    kill_whole_job(proc, tmp_path / "killed")
    assert not (tmp_path / "killed/final").exists()
    resumed = launch_here(*RUN[3:], *common, "train.resume=auto", run_dir=tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    name = "adapter_model.safetensors" if "peft=lora" in engine else "model.safetensors"
    ours, ref = load_file(tmp_path / f"killed/final/{name}"), load_file(tmp_path / f"full/final/{name}")
    assert set(ours) == set(ref)
    assert all(torch.allclose(ours[k], ref[k], rtol=0, atol=1e-6) for k in ref)  # CPU: the same arithmetic, measured equal


def test_resume_path_of_an_unfinished_checkpoint_is_refused(tmp_path):
    (tmp_path / "step_3").mkdir()
    with pytest.raises(ConfigError) as e:
        checkpoint.resolve(str(tmp_path / "step_3"), REPO)
    assert str(e.value) == (f"train.resume={str(tmp_path / 'step_3')!r}: {tmp_path / 'step_3'} is not a complete checkpoint "
                            "(no meta.json: it was never finished, or was written by an older version)")


# ---------------------------------------------------------------------------------------------
# Nothing is lost: another run's directory, finished resumes, changed data, damaged checkpoints


def snapshot(root, *, hydra_too=False):
    """Every file under `root`, bytes and mtime; hydra_too=False: but Hydra's own (.hydra/ and launch.log,
    which a sweep's trial writes before our code runs; a single launch asks before Hydra writes)."""
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file() and (hydra_too or (".hydra" not in p.relative_to(root).parts and p.name != "launch.log"))}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 3-step run on a copy of the quickstart data, with checkpoints at steps 1, 2 and 3."""
    from finetune.config import ASSETS

    run = tmp_path_factory.mktemp("finished")
    (run / "train.jsonl").write_bytes((ASSETS / "data/quickstart/train.jsonl").read_bytes())
    args = [*QUICK, "data=jsonl", f"data.train={run / 'train.jsonl'}", "train.max_steps=3", "train.save_every=1"]
    train_here(args, run / "run")
    return run / "run", args


def copy_run(finished, tmp_path):
    import shutil

    shutil.copytree(finished[0], tmp_path / "run")
    return tmp_path / "run"


def test_a_launch_into_a_finished_runs_directory_is_refused_and_changes_nothing(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    (run / ".hydra").mkdir(exist_ok=True)
    (run / ".hydra/overrides.yaml").write_text("- the finished run's own overrides\n")
    before = snapshot(run, hydra_too=True)
    cli = [*RUN, "launcher.nproc_per_node=1", "parallelism=single", "train.max_steps=2", f"hydra.run.dir={run}"]
    out = subprocess.run(cli, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    refusal = (f"{run} already holds a finished run (final/) and 3 checkpoints: resume with train.resume=auto, start over with "
               "train.overwrite=true, or choose another hydra.run.dir")
    assert out.stderr == f"error: {refusal}\n"
    assert snapshot(run, hydra_too=True) == before  # Hydra's .hydra/ too: asked before it writes
    dry = subprocess.run([*cli, "launcher.dry_run=true"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and dry.stderr == f"warning: {refusal}; this dry run writes nothing there\n"
    assert snapshot(run, hydra_too=True) == before


def test_a_sweep_into_an_old_sweeps_directory_stops_at_the_first_finished_trial(tmp_path):
    old = tmp_path / "sweep/0"
    (old / "final").mkdir(parents=True)
    (old / "final/model.safetensors").write_bytes(b"weights")
    (old / "summary.json").write_text("{}")
    before = snapshot(old)
    out = subprocess.run([*RUN[:3], "-m", *RUN[3:], "train.max_steps=2", "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert last_line(out.stderr) == (f"error: trial 0: {old} already holds a finished run (final/): start over with "
                                     "train.overwrite=true, or choose another hydra.sweep.dir")
    assert snapshot(old) == before and not (tmp_path / "sweep/1").exists()


def test_overwrite_replaces_the_old_results_and_contradicts_resume(finished, tmp_path, capsys):
    from finetune import rundir

    run = copy_run(finished, tmp_path)
    cfg = lambda *extra: train_cfg(extra)  # noqa: E731
    with pytest.raises(ConfigError) as e:
        rundir.claim(run, cfg("train.overwrite=true", "train.resume=auto"), dry_run=False)
    assert str(e.value) == ("train.overwrite=true would remove the checkpoints train.resume=auto continues from: choose one of them")
    assert rundir.claim(run, cfg("train.overwrite=true"), dry_run=True) is False
    assert (run / "final").is_dir()
    assert rundir.claim(run, cfg("train.overwrite=true"), dry_run=False) is True
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"[finetune] train.overwrite=true: replacing a finished run (final/) and 3 checkpoints in {run} "
        "(removed final, checkpoints, summary.json, metrics.jsonl, loss.png)")
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]  # the launch rewrites it
    # A finished run without checkpoints has nothing to resume: auto does not quietly start over on top of it.
    (run / "final").mkdir()
    with pytest.raises(ConfigError) as e:
        rundir.claim(run, cfg("train.resume=auto"), dry_run=False)
    assert str(e.value) == (f"{run} holds a finished run (final/) but no checkpoint to resume (train.resume=auto): start over "
                            "with train.overwrite=true, or choose another hydra.run.dir")


def train_cfg(overrides):
    from finetune.launcher.compose import preflight

    return preflight(list(overrides)).train


def test_resume_with_nothing_left_to_do_or_changed_data_is_refused(finished, tmp_path):
    import hashlib

    run = copy_run(finished, tmp_path)
    _, args = finished
    with pytest.raises(ConfigError) as e:
        train_here([*args, "train.resume=auto"], run)
    assert str(e.value) == (f"train.resume: {run / 'checkpoints/step_3'} is at step 3, train.max_steps=3: nothing to do: "
                            "raise train.max_steps above 3")
    data = finished[0].parent / "train.jsonl"
    moved = tmp_path / "train.jsonl"
    moved.write_bytes(data.read_bytes() + b'{"instruction": "new", "output": "row"}\n')
    changed = [a if not a.startswith("data.train=") else f"data.train={moved}" for a in args]
    with pytest.raises(ConfigError) as e:  # another file: a settings difference
        train_here([*changed, "train.max_steps=5", "train.resume=auto"], run)
    assert str(e.value).startswith(f"train.resume: {run / 'checkpoints/step_3'} was trained with data.train={data}, this run has data.train={moved}")
    saved = json.loads((run / "checkpoints/step_3/meta.json").read_text())["data"]["data.train"]["files"]
    assert saved == {str(data): hashlib.sha256(data.read_bytes()).hexdigest()}
    data_copy = data.read_bytes()
    try:
        data.write_bytes(moved.read_bytes())  # the same file, other content
        with pytest.raises(ConfigError) as e:
            train_here([*args, "train.max_steps=5", "train.resume=auto"], run)
    finally:
        data.write_bytes(data_copy)
    now = hashlib.sha256(moved.read_bytes()).hexdigest()
    assert str(e.value) == (f"train.resume: data.train file {data} changed (sha256 {saved[str(data)][:12]} then, {now[:12]} now) "
                            f"since {run / 'checkpoints/step_3'} was saved: the resumed run would train on other data; "
                            "restore it, or start a fresh run")


def test_a_damaged_newest_checkpoint_is_named_and_auto_falls_back(finished, tmp_path, capsys):
    run = copy_run(finished, tmp_path)
    _, args = finished
    step3 = run / "checkpoints/step_3"
    meta = json.loads((step3 / "meta.json").read_text())
    name, size = max(meta["files"].items(), key=lambda kv: kv[1])  # the model/optimizer state
    with open(step3 / name, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ConfigError) as e:  # named explicitly: refused
        train_here([*args, "train.max_steps=4", f"train.resume={step3}"], run)
    assert str(e.value) == (f"train.resume={str(step3)!r}: checkpoint {step3} is damaged ({name} is truncated ({size // 2} of {size} "
                            "bytes)): resume from an earlier one (train.resume=auto takes the newest intact checkpoint), or start a fresh run")
    capsys.readouterr()
    train_here([*args, "train.max_steps=4", "train.resume=auto"], run)
    assert capsys.readouterr().err.splitlines()[0] == (
        f"warning: checkpoint {step3} is damaged ({name} is truncated ({size // 2} of {size} bytes)): train.resume=auto falls back "
        f"to the previous complete checkpoint {run / 'checkpoints/step_2'}")
    assert [m["step"] for m in train_rows(run)] == [1, 2, 3, 3, 4]  # the first run's 3 steps, then 3 and 4 again from step 2
    (run / "checkpoints/step_4/meta.json").write_text('{"step": 4, ')  # a meta.json that does not parse
    warnings = []
    assert checkpoint.resolve("auto", run, warn=warnings.append) == step3  # rewritten, intact, by the resumed run
    assert warnings == [f"checkpoint {run / 'checkpoints/step_4'} is damaged (meta.json does not parse: Expecting property name "
                        "enclosed in double quotes: line 1 column 13 (char 12)): train.resume=auto falls back to the previous "
                        f"complete checkpoint {step3}"]
