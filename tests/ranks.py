"""The rank side of a launch without a CLI launch: `launch_here` composes, checks and writes the run directory as
`python -m finetune.launch` does, then starts each rank (`finetune.rank.train.main`, the code torchrun and deepspeed start)
from a fork server that imported torch, transformers, DeepSpeed and finetune once for this test worker.

Why: a CLI launch of two ranks on this machine costs about 17 s of CPU (the launcher, torchrun and two Python start-ups
importing everything), of which the ranks' own work in a 4-step test is under 2 s. Where the thing tested is what the
ranks do (a layout follows one process, a resume continues, a strategy trains), this is the same rank code and the same
written run directory at a fraction of the cost; tests of the launcher itself (what it prints, signals, supervision,
sweeps, the README's commands) keep launching it (conftest.run_cli).

Every process that trains holds its share of the machine's cores (`cores`): two ranks take both, so the other test
worker waits rather than putting a third training process on two cores.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ["ranks_preload"]
"""What the fork server imports once (tests/ranks_preload.py): everything a rank imports."""

_CONTEXT: list[multiprocessing.context.BaseContext] = []


def context() -> multiprocessing.context.BaseContext:
    """The fork server of this test process, started on first use (its start-up, ~8 s, is paid once per worker)."""
    if not _CONTEXT:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        # The server imports PRELOAD from the environment it starts in (Python 3.11's forkserver ignores sys.path): this
        # directory on PYTHONPATH for its start only. An import error there is silent: `_rank` refuses to run without it.
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(Path(__file__).parent), before) if x)
        try:
            forkserver.ensure_running()
        finally:
            if before is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = before
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def _rank(config: str, cwd: str, env: dict[str, str], log: str, argv: list[str]) -> None:
    """One rank, in a process forked from the fork server: the environment torchrun would give it, its output to `log`."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - line-buffered, as PYTHONUNBUFFERED runs
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    code = 1
    try:
        if "ranks_preload" not in sys.modules:
            raise RuntimeError("tests/ranks.py: the fork server did not import ranks_preload (import it alone to see why)")
        from finetune.rank import train

        code = train.main([config, *argv])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch_here(*args: str, cwd: Path | None = None, run_dir: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`run_cli(*ARGS, cwd=CWD)` for what the ranks do: compose ARGS as the CLI does, write the run directory
    (`hydra.run.dir=DIR` among ARGS, relative to CWD, or RUN_DIR) as the launcher writes it, run its ranks (forked, see the
    module's docstring) and wait. Returns what run_cli returns: rank 0's output as stdout, the other ranks' output then
    the launcher's last line (`error: ...`, from RUN_DIR/error.txt) as stderr, and the first non-zero exit code."""
    from finetune import startup
    from finetune.data import steps
    from finetune.launcher.command import build
    from finetune.rundir import ERROR_FILE, LAUNCHER_ENV, RANKS_DIR
    from finetune.launcher.compose import preflight
    from finetune.config import ConfigError
    from finetune.launcher.launch import env_threads, write_files

    overrides = [a for a in args if not a.startswith("hydra.run.dir=")]
    named = [a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")]
    cwd = Path(cwd) if cwd is not None else None
    with contextlib.chdir(cwd or Path.cwd()):  # relative paths among ARGS, as the CLI run in CWD reads them
        try:
            cfg = preflight([*overrides, "train.progress_bar=false"])
        except ConfigError as e:  # refused as the launcher refuses it
            return subprocess.CompletedProcess(["launch_here", *args], 2, "", f"error: {e}\n")
        steps.resolve(cfg, lambda line: None)  # epochs -> steps, as the launcher does
    if run_dir is None:
        where = named[-1] if named else cfg.run_dir
        assert where and (cwd is not None or Path(where).is_absolute()), "launch_here needs hydra.run.dir=DIR, run_dir=DIR or run_dir="
        run_dir = (cwd or Path("/")) / where
    run_dir = Path(run_dir).resolve()
    cwd = cwd or run_dir.parent
    cfg.run_dir = str(run_dir)
    spec = build(cfg, run_dir, python=sys.executable, cpu_count=os.cpu_count() or 1, port=free_port(), env_threads=env_threads())
    write_files(spec, run_dir)
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    shutil.rmtree(run_dir / RANKS_DIR, ignore_errors=True)  # each rank records itself anew, as the launcher has them
    (run_dir / RANKS_DIR).mkdir()
    world = cfg.launcher.nproc_per_node
    port = spec.env.get("MASTER_PORT") or str(cfg.launcher.master_port or free_port())
    base = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1", LAUNCHER_ENV: f"{os.getpid()}@{socket.gethostname()}",
            startup.TIMES_ENV: f"{time.time():.3f},{time.time():.3f}", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "NODE_RANK": "0"}
    logs = [run_dir / RANKS_DIR / f"{r}.out" for r in range(world)]
    ctx = context()
    with cores(world):
        procs = []
        for r in range(world):
            env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
            p = ctx.Process(target=_rank, args=(str(run_dir / "config.yaml"), str(cwd), env, str(logs[r]), []), daemon=False)
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        late = [p for p in procs if p.exitcode is None]
        if late:
            for p in late:
                p.terminate()  # SIGTERM: a rank saves and stops
            for p in late:
                p.join(60)
                if p.exitcode is None:
                    p.kill()
                    p.join()
    outs = [log.read_text() if log.is_file() else "" for log in logs]
    if late:
        raise subprocess.TimeoutExpired(["launch_here", *args], timeout, output=outs[0], stderr="".join(outs[1:]))
    codes = [p.exitcode for p in procs]
    code = next((c for c in codes if c), 0)
    code = code if code >= 0 else 128 - code
    err = "".join(outs[1:])
    if (run_dir / ERROR_FILE).is_file():
        err += f"error: {(run_dir / ERROR_FILE).read_text().strip()}\n"
    return subprocess.CompletedProcess(["launch_here", *args], code, outs[0], err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_json(script: str, cwd: Path, ranks: int = 2) -> dict:
    """`script` (Python source) run by torchrun on `ranks` CPU ranks in `cwd`; the first line its ranks print that
    starts with "{", as JSON (the test asserts on it)."""
    import json

    path = cwd / "script.py"
    path.write_text(script)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                          str(free_port()), str(path)], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))


# ---------------------------------------------------------------------------------------------------------------------
# The machine's cores, shared by the test workers
#
# Two workers on two cores: each runs one test at a time, in its own process (one training process when it trains in
# process). A job of two ranks beside the other worker's test makes three processes on two cores, which the ranks
# weather (a rank waits at a collective only until the other is scheduled again), and it fills the moments one rank
# idles (rank 0 exporting, evaluating, plotting); two such jobs at once make four, and every collective waits for a
# descheduled peer. So: a job of two ranks takes the `multi` lock (no two at once); a job of more ranks than that takes
# every core (the other worker's running test ends first, and its next one waits). Locks are flock(2)s on files in a
# directory the session's workers share; a test never waits on one while holding its share of `cores` (no deadlock).


CORES_DIR_ENV = "FINETUNE_TEST_CORES"
"""A directory shared by the test session's workers (conftest sets it before they start): its lock files."""

LOG_ENV = "FINETUNE_TEST_CORES_LOG"
"""Where set: a file each wait for the cores is appended to (test, ranks, seconds waited, seconds held), for tuning."""

HELD: dict[str, object] = {}
"""fd: this test's descriptor of cores.lock (held shared while it runs); test: its id; multi: set while it holds the
multi lock; all: set while it holds every core."""


def _lock(name: str) -> int:
    path = Path(os.environ.get(CORES_DIR_ENV) or tempfile.gettempdir()) / name
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _share_again(fd: int) -> None:
    """Take this test's share of the cores back, behind any job waiting for every core (the gate), as a new test does."""
    gate = _lock("gate.lock")
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(gate, fcntl.LOCK_UN)
    finally:
        os.close(gate)
    fcntl.flock(fd, fcntl.LOCK_SH)


@contextlib.contextmanager
def test_share(test: str = ""):
    """What every test holds while it runs: its worker's share of the cores (a shared lock on cores.lock)."""
    fd = _lock("cores.lock")
    _share_again(fd)
    HELD.update(fd=fd, test=test)
    try:
        yield
    finally:
        HELD.clear()
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextlib.contextmanager
def cores(n: int):
    """Hold what a job of N training processes needs (see above): nothing for one; the multi lock for two; every core
    for more (or where N and one more process do not fit the machine, N being two on a machine of one core)."""
    fd = HELD.get("fd")
    cpus = os.cpu_count() or 1
    if fd is None or n < 2 or HELD.get("multi") or n + 2 <= cpus:
        yield
        return
    everything = n + 1 > max(cpus, 3)
    tic = time.monotonic()
    multi, turn = _lock("multi.lock"), _lock("turn.lock")
    fcntl.flock(fd, fcntl.LOCK_UN)  # no share held while waiting: the holder of `multi` may be waiting for every core
    # in turn: a waiter holds `turn` until it has `multi`, so the holder's next job waits behind it (flock alone is not
    # fair: a worker that releases `multi` and asks again at once may win every time, and the other idles)
    fcntl.flock(turn, fcntl.LOCK_EX)
    fcntl.flock(multi, fcntl.LOCK_EX)
    fcntl.flock(turn, fcntl.LOCK_UN)
    os.close(turn)
    if everything:
        gate = _lock("gate.lock")
        fcntl.flock(gate, fcntl.LOCK_EX)  # no new test starts meanwhile
        fcntl.flock(fd, fcntl.LOCK_EX)  # the other worker's running test ends first
        fcntl.flock(gate, fcntl.LOCK_UN)
        os.close(gate)
    else:
        _share_again(fd)
    HELD["multi"] = True
    waited, tic = time.monotonic() - tic, time.monotonic()
    try:
        yield
    finally:
        del HELD["multi"]
        if everything:
            fcntl.flock(fd, fcntl.LOCK_SH)  # LOCK_EX -> LOCK_SH on the same descriptor: our share again
        fcntl.flock(multi, fcntl.LOCK_UN)
        os.close(multi)
        if os.environ.get(LOG_ENV):
            with open(os.environ[LOG_ENV], "a") as f:
                f.write(f"{HELD.get('test', '')}\t{n}\t{waited:.1f}\t{time.monotonic() - tic:.1f}\n")


@contextlib.contextmanager
def released():
    """Give up this test's share while it waits for the other worker (a file lock around a fixture it is making): that
    worker may be waiting for every core, so holding a share here would deadlock the two. Taken back after."""
    fd = HELD.get("fd")
    if fd is None or HELD.get("multi"):
        yield
        return
    fcntl.flock(fd, fcntl.LOCK_UN)
    try:
        yield
    finally:
        _share_again(fd)
