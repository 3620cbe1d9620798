"""Real faults, through the real CLI, on every engine they apply to (nothing patched): a genuinely full
disk (the run directory on a small tmpfs), processes killed from outside (the launcher, one rank),
Ctrl-C from a terminal, and a second launch into a live run's directory. In each: nothing half-written
is taken for a checkpoint, the last line names the cause, the exit is non-zero, no process of the job
outlives the launcher, and `train.resume=auto` ends with the uninterrupted run's weights."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.rank import checkpoint

from conftest import kill_whole_job, last_line, steps_done, wait_for
from ranks import launch_here

STEPS = 12  # every run of an engine follows the same trajectory (the schedule decays over max_steps)
RUN = [sys.executable, "-m", "finetune.launch", "+recipe=quickstart_sft", "train.progress_bar=false", "train.eval_every=0",
       "data.eval=null", "data.eval_size=0", "train.exact_match_samples=0", "train.memory_report=false", "train.tensorboard=false",
       "train.log_every=1000", "optim.warmup_steps=1", "train.micro_batch_size=2", "train.global_batch_size=4",
       f"train.max_steps={STEPS}"]
ENGINES = {
    "single": ["parallelism=single", "launcher.nproc_per_node=1"],
    "ddp": ["parallelism=ddp"],
    "fsdp": ["parallelism=fsdp"],
    "zero2": ["zero=stage2"],
}
HOST = socket.gethostname()
pytestmark = pytest.mark.cores(2)  # the faults are dealt to jobs of two ranks this test starts and watches itself


def launch(args: list[str], run_dir: Path, *, timeout: int = 300) -> subprocess.CompletedProcess:
    out = subprocess.run([*RUN, *args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return out


def start(args: list[str], run_dir: Path) -> subprocess.Popen:
    """The launcher in a session of its own, as a terminal's foreground job or a scheduler's step is."""
    return subprocess.Popen([*RUN, *args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def job_processes(run_dir: Path) -> list[str]:
    """Live processes (not zombies) of a job in `run_dir`: the ranks' recorded pids, and every process whose
    command line names the directory (the launcher, torchrun or deepspeed's runner and launch.py, the ranks)."""
    pids = set()
    for f in (run_dir / "ranks").glob("*.json"):
        with contextlib.suppress(ValueError, OSError):
            pids.add(json.loads(f.read_text())["pid"])
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_bytes()
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat.rsplit(b")", 1)[1].split()[0] == b"Z":
            continue
        if int(entry.name) in pids or str(run_dir) in cmdline:
            found.append(f"{entry.name} {cmdline[:200]}")
    return found


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final/model.safetensors")


def assert_same_weights(run_dir: Path, reference: Path) -> None:
    ours, ref = weights(run_dir), weights(reference)
    assert set(ours) == set(ref)
    worst = max(float((ours[k] - ref[k]).abs().max()) for k in ref)
    assert worst <= 1e-6, f"final weights differ from the uninterrupted run's by up to {worst:.3g}"  # CPU: the same arithmetic


def resume(engine: str, run_dir: Path, reference: Path, resumed_from: int | None = None) -> None:
    """train.resume=auto to the end; the final weights are the uninterrupted run's. The fault went through the real CLI;
    the resume and the uninterrupted reference are the ranks' part (tests/ranks.py)."""
    out = launch_here(*RUN[3:], *ENGINES[engine], "train.resume=auto", "train.save_every=0", run_dir=run_dir)  # the ranks' part
    assert out.returncode == 0, out.stderr[-3000:]
    if resumed_from is not None:
        assert f"resumed from {run_dir / 'checkpoints'}/step_{resumed_from} at step {resumed_from}" in out.stdout
    assert_same_weights(run_dir, reference)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """engine -> the run directory of its uninterrupted STEPS-step run (each made once, when first asked for)."""
    made: dict[str, Path] = {}

    def get(engine: str) -> Path:
        if engine not in made:
            run_dir = tmp_path_factory.mktemp(f"reference-{engine}") / "run"
            out = launch_here(*RUN[3:], *ENGINES[engine], f"train.save_every={STEPS}", run_dir=run_dir)  # its checkpoint sizes the disk
            assert out.returncode == 0, out.stderr[-3000:]
            made[engine] = run_dir
        return made[engine]

    return get


# ---------------------------------------------------------------------------------------------
# A full disk


@contextlib.contextmanager
def small_disk(where: Path, free: int):
    """A 64 MiB tmpfs at `where`, filled by a ballast file until `free` bytes are left; `free_space()`
    deletes the ballast. Skips the test, with the reason, where mounting is not permitted."""
    where.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"a real full disk needs a tmpfs mount, which is not permitted here: {(out.stderr or out.stdout).strip()}")
    try:
        ballast = where / "ballast"
        with open(ballast, "wb") as f:
            f.write(b"\0" * (os.statvfs(where).f_bavail * os.statvfs(where).f_frsize - free))
        yield lambda: ballast.unlink()
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def checkpoint_bytes(run_dir: Path) -> int:
    (step,) = checkpoint.complete(run_dir / "checkpoints")
    return sum(json.loads((step / "meta.json").read_text())["files"].values())


@pytest.mark.slow
# Each save: torch's (single; DDP's two ranks save as one does, rank 0 writing), the mesh's (fsdp) and DeepSpeed's (zero2).
# ZeRO-3 is not among them: its save is zero2's path (DeepSpeed's save_checkpoint into checkpoint.saving's directory).
@pytest.mark.parametrize("engine", ["single", "fsdp", "zero2"])
def test_a_full_disk_keeps_the_previous_checkpoint_names_the_disk_and_resumes_to_the_same_weights(engine, reference, tmp_path):
    """The run directory on a disk with room for one checkpoint and a half: the second save fails mid-write."""
    ref = reference(engine)
    size = checkpoint_bytes(ref)
    with small_disk(tmp_path / "disk", free=size * 3 // 2 + 2**19) as free_space:
        run = tmp_path / "disk/run"
        out = launch([*ENGINES[engine], "train.save_every=1"], run)
        root = run / "checkpoints"
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
        pattern = (rf"error: training: saving checkpoint step_2 in {re.escape(str(root))} failed on (rank [01]|ranks 0 and 1): "
                   rf"No space left on device \(\d+\.\d MiB free there; a checkpoint takes {size / 2**20:.1f} MiB\): the previous "
                   rf"checkpoint {re.escape(str(root / 'step_1'))} is intact; free space there, then continue with train.resume=auto")
        assert re.fullmatch(pattern, last_line(out.stderr)), out.stderr[-3000:]
        assert job_processes(run) == []
        # Nothing half-written: no temporary directory left, and the one complete checkpoint is intact.
        assert sorted(p.name for p in root.iterdir() if not p.name.startswith("zero_to_")) == ["latest", "step_1"]
        assert checkpoint.resolve("auto", run) == root / "step_1" and checkpoint.damaged(root / "step_1") is None
        statuses = [json.loads(f.read_text()) for f in sorted((run / "ranks").glob("*.json"))]
        assert all(s["status"] == "exited 2" and s["reason"] == last_line(out.stderr).removeprefix("error: ") for s in statuses)
        assert not list((run / "ranks").glob("[0-9]*.log"))  # no unexpected exception on any rank
        free_space()
        resume(engine, run, ref, resumed_from=1)


# ---------------------------------------------------------------------------------------------
# Killed from outside


@pytest.mark.slow
# Each launcher (torchrun: ddp, fsdp; deepspeed's runner: zero2) and each engine's save (torch: ddp; mesh: fsdp; DeepSpeed);
# one rank under torchrun is single-ctrl-c's below.
@pytest.mark.parametrize("engine", ["ddp", "fsdp", "zero2"])
def test_sigkill_of_the_launcher_stops_its_ranks_with_a_checkpoint_and_resume_gives_the_same_weights(engine, reference, tmp_path):
    """SIGKILL cannot be passed on: each rank watches its launcher, and saves and stops when it is gone."""
    ref, run = reference(engine), tmp_path / "run"
    proc = start(ENGINES[engine], run)
    assert wait_for(lambda: steps_done(run) >= 2), proc.communicate()[1][-3000:] if proc.poll() is not None else "no step"
    os.kill(proc.pid, signal.SIGKILL)
    tic = time.time()
    out, _ = proc.communicate(timeout=120)  # until the ranks, which hold its stdout, are gone too
    assert wait_for(lambda: not job_processes(run), timeout=60), job_processes(run)
    print(f"the job ended {time.time() - tic:.1f}s after its launcher was killed")
    assert proc.returncode == -signal.SIGKILL
    step = checkpoint.resolve("auto", run)
    assert step is not None, out[-3000:]
    stop = (f"stopped by SIGTERM (its launcher, pid {proc.pid}, ended) after step {step.name.removeprefix('step_')}: "
            f"resumable checkpoint {step}; continue with train.resume=auto")
    ranks = {f.name: f.read_text().strip() for f in (run / "ranks").glob("*")}
    assert stop in out.splitlines(), (out[-3000:], ranks)  # rank 0's line: its stderr was the launcher's pipe, so it says it on stdout
    assert all(json.loads(f.read_text())["reason"] == stop for f in (run / "ranks").glob("*.json"))
    assert steps_done(run) < STEPS
    resume(engine, run, ref, resumed_from=int(step.name.removeprefix("step_")))


@pytest.mark.slow
# Ctrl-C and SIGTERM through each launcher (torchrun: single, fsdp; deepspeed's runner, which dies of either: zero2); a
# signalled DDP rank saves as the SIGKILL test's DDP ranks do (its launcher gone, each rank stops itself with SIGTERM).
# zero2 with Ctrl-C only: the launcher passes SIGTERM to the runner's group as it passes SIGINT (supervise.execute), and
# a rank's SIGTERM is fsdp-sigterm's.
@pytest.mark.parametrize("engine,how", [("single", "SIGINT"), ("fsdp", "SIGTERM"), ("zero2", "SIGINT")],
                         ids=["single-ctrl-c", "fsdp-sigterm", "zero2-ctrl-c"])
def test_sigterm_or_ctrl_c_saves_stops_leaves_no_process_and_resumes_to_the_same_weights(engine, how, reference, tmp_path):
    """SIGTERM to the launcher (a scheduler), or SIGINT to its whole process group (Ctrl-C in a terminal):
    deepspeed's runner dies of either without passing it on; its launch.py and the ranks still end."""
    ref, run = reference(engine), tmp_path / "run"
    proc = start(ENGINES[engine], run)
    assert wait_for(lambda: steps_done(run) >= 2), proc.communicate()[1][-3000:] if proc.poll() is not None else "no step"
    if how == "SIGTERM":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: every process of the foreground group
    _, err = proc.communicate(timeout=120)
    assert job_processes(run) == []  # none outlives the launcher
    assert proc.returncode == 128 + getattr(signal, how)
    step = checkpoint.resolve("auto", run)
    assert last_line(err) == f"error: stopped by {how} after step {step.name.removeprefix('step_')}: resumable checkpoint {step}; " \
                             "continue with train.resume=auto", err[-3000:]
    assert "KeyboardInterrupt" not in err and "Traceback" not in err
    assert steps_done(run) < STEPS
    resume(engine, run, ref, resumed_from=int(step.name.removeprefix("step_")))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero2", "fsdp"])
def test_killing_one_rank_names_it_leaves_no_process_and_the_last_checkpoint_intact(engine, tmp_path):
    run = tmp_path / "run"
    proc = start([*ENGINES[engine], "train.max_steps=2000", "train.save_every=2"], run)
    assert wait_for(lambda: (run / "checkpoints/latest").is_file() and steps_done(run) >= 3), \
        proc.communicate()[1][-3000:] if proc.poll() is not None else "no checkpoint"
    victim = json.loads((run / "ranks/1.json").read_text())
    os.kill(victim["pid"], signal.SIGKILL)
    tic = time.time()
    _, err = proc.communicate(timeout=120)
    print(f"job ended {time.time() - tic:.1f}s after rank 1 was killed")
    assert proc.returncode != 0 and time.time() - tic < 90
    assert last_line(err) == (f"error: rank 1 (pid {victim['pid']} on {victim['host']}) died without an error "
                              "(killed: SIGKILL, or the out-of-memory killer?); the job stopped"), err[-3000:]
    assert job_processes(run) == []
    step = checkpoint.resolve("auto", run)
    assert step is not None and checkpoint.damaged(step) is None


# ---------------------------------------------------------------------------------------------
# A second launch into a live run's directory


def snapshot(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """What the live run wrote before training (its config, Hydra's record): a second launch must not touch it."""
    return {p.relative_to(run_dir).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*"))
            if p.is_file() and (p.parent.name == ".hydra" or p.name in ("config.yaml", "launch.log", ".lock"))}


@pytest.mark.slow
def test_a_second_launch_into_a_live_runs_directory_is_refused_and_a_crashed_runs_lock_blocks_nothing(tmp_path):
    run = tmp_path / "run"
    live = start(["train.max_steps=2000", "train.save_every=1"], run)
    try:
        assert wait_for(lambda: steps_done(run) >= 2), live.communicate()[1][-3000:] if live.poll() is not None else "no step"
        before = snapshot(run)
        second = launch(["train.max_steps=4"], run)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert re.fullmatch(rf"error: {re.escape(str(run))} is in use by a live run \(launcher pid {live.pid} on {re.escape(HOST)}, "
                            rf"started [0-9-]+ [0-9:]+\): wait for it to end or stop it \(kill -TERM {live.pid} saves a checkpoint and "
                            r"stops it\), or choose another hydra.run.dir\n", second.stderr), second.stderr
        dry = launch(["train.max_steps=4", "launcher.dry_run=true"], run)  # reads only: warns, writes nothing there
        assert dry.returncode == 0 and dry.stderr.startswith(f"warning: {run} is in use by a live run (launcher pid {live.pid}"), \
            dry.stderr
        assert snapshot(run) == before
        done = steps_done(run)
        assert wait_for(lambda: steps_done(run) > done + 1, timeout=60) and live.poll() is None  # undisturbed
    finally:
        kill_whole_job(live, run)  # a crash (a node failure), leaving its .lock behind
    assert json.loads((run / ".lock").read_text())["pid"] == live.pid
    step = int(checkpoint.resolve("auto", run).name.removeprefix("step_"))
    out = launch([f"train.max_steps={step + 1}", "train.resume=auto"], run)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints'}/step_{step} at step {step}" in out.stdout


def test_a_lock_held_by_ranks_whose_launcher_is_gone_names_them(tmp_path):
    """The window after a launcher's SIGKILL: its ranks (sharing the lock) save and stop at their next step."""
    from finetune import rundir

    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(tmp_path / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_SH)\nprint('held', flush=True)\ntime.sleep(60)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        dead = int(gone.stdout)
        (tmp_path / ".lock").write_text(json.dumps({"pid": dead, "host": HOST, "started": "2026-01-01 00:00:00"}) + "\n")
        assert rundir.busy(tmp_path)
        assert rundir.in_use(tmp_path) == (
            f"{tmp_path} is in use by a run whose launcher (pid {dead} on {HOST}, started 2026-01-01 00:00:00) is gone, but whose "
            "ranks still run (RUN_DIR/ranks/ has their pids; they save and stop at their next step): wait for them to end, or "
            "choose another hydra.run.dir")
    finally:
        holder.kill()
        holder.wait()
    assert not rundir.busy(tmp_path)  # the kernel dropped it with its holder: a stale .lock blocks nothing
