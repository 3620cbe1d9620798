"""The job as processes: run the launch command as a child (`execute`), pass its stderr through (`Relay`) and
the signals we receive on to it, kill whatever of the job outlives it (`settle`), and read what its ranks
recorded in RUN_DIR/ranks/ to say in one line why it failed (`run_job` raises `TrialFailed`).

Launcher side: no torch. finetune.launch runs one launch through it; finetune.launcher.trials one trial of a sweep.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from finetune import startup
from finetune.launcher.command import LaunchSpec
from finetune.rundir import ERROR_FILE, LAUNCHER_ENV, RANKS_DIR


class TrialFailed(Exception):
    """A launch that refused its config or whose training failed: the exit code and one-line reason."""

    def __init__(self, code: int, reason: str, hint: str = "", *, ends_sweep: bool = False) -> None:
        super().__init__(reason)
        self.code, self.hint, self.ends_sweep = code, hint, ends_sweep


def run_job(spec: LaunchSpec, run_dir: Path) -> None:
    """Run the launch command under supervision (`execute`); when it fails, raise TrialFailed with its exit code
    (the shell's for a signal) and one line: a rank's reason for a user mistake, ranks that died without a word, or
    the first rank's own failure."""
    code, killed, signum = execute(spec, log=run_dir / RANKS_DIR / "launcher.log")
    if code == 0 and not all_done(run_dir):  # deepspeed's runner exits 0 when its launch.py was killed
        code = 1
    if signum and code != 0:  # stopped by a signal: the shell's code for it (torchrun says 1, deepspeed -signum)
        code = 128 + signum
    if code == 0:
        return
    reason = run_dir / ERROR_FILE  # a rank's one-line reason for a user mistake, if it found one
    line = reason.read_text().strip() if reason.is_file() else ""
    died = silent_deaths(run_dir)
    failed = rank_failures(run_dir)  # only lost peers: the first rank's line
    if not line and died:
        line = f"{died}; the job stopped"
    line = line or (failed[0] if failed else "")
    if not line:
        raise TrialFailed(code, f"training exited with code {code}{disk_note(run_dir)}", "; see the output above")
    if killed:
        line += f" (killed {len(killed)} of its processes that outlived it: pid {', '.join(map(str, killed))})"
    raise TrialFailed(code, line + disk_note(run_dir) if died else line)


def rank_failures(run_dir: Path) -> list[str]:
    """The one-line reasons ranks recorded in RUN_DIR/ranks/R.json ('failed: ...', or 'reason' beside the final
    status), root causes first (a rank's own failure, not its peer's loss), then by rank."""
    lines = []
    for path in sorted((run_dir / RANKS_DIR).glob("*.json"), key=lambda p: int(p.stem)):
        with contextlib.suppress(ValueError, OSError):
            info = json.loads(path.read_text())
            status = info.get("status", "")
            if status.startswith("failed: ") or info.get("reason"):  # the reason stays beside the final 'exited N'
                lines.append((not info.get("root", True), info.get("reason") or status.removeprefix("failed: ")))
    return [line for _, line in sorted(lines, key=lambda kv: kv[0])]  # root causes first, then by rank


def all_done(run_dir: Path) -> bool:
    """Every rank recorded that it finished (RUN_DIR/ranks/R.json 'done'), and there was a rank."""
    statuses = []
    for path in (run_dir / RANKS_DIR).glob("*.json"):
        with contextlib.suppress(ValueError, OSError):
            statuses.append(json.loads(path.read_text()).get("status"))
    return bool(statuses) and all(s == "done" for s in statuses)


def disk_note(run_dir: Path) -> str:
    """'; the disk holding RUN_DIR is full ...' when it is (what a rank could not even record), else ''."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return ""
    if free >= 2**20:
        return ""
    return (f"; the disk holding {run_dir} is full ({free / 2**20:.1f} MiB free): free space there, then continue with "
            "train.resume=auto")


def silent_deaths(run_dir: Path) -> str | None:
    """Ranks that never recorded an end (RUN_DIR/ranks/R.json still 'running'): killed without a word."""
    dead = []
    for path in sorted((run_dir / RANKS_DIR).glob("*.json"), key=lambda p: int(p.stem)):
        with contextlib.suppress(ValueError, OSError):
            info = json.loads(path.read_text())
            if info.get("status") == "running":
                dead.append(f"rank {info['rank']} (pid {info['pid']} on {info['host']})")
    if not dead:
        return None
    return f"{', '.join(dead)} died without an error (killed: SIGKILL, or the out-of-memory killer?)"


SETTLE_S = 60
"""Seconds the job's processes that outlive the launch's own child get to end (ranks saving a
checkpoint at their step boundary) before they are killed."""


def execute(spec: LaunchSpec, log: Path | None = None) -> tuple[int, list[int], int]:
    """Run the launch as a child process sharing our stdout; its stderr passes through `Relay`
    (which keeps the launcher's own failure report out of sight: the ranks' one line says it).

    The child runs in a session of its own, so a terminal's Ctrl-C reaches this process only, and each
    SIGINT/SIGTERM we receive goes to the child's whole process group, once: torchrun passes it to its
    ranks (each in a session of its own); deepspeed's runner dies of it, while its launch.py and the
    ranks, in the group, get it themselves. No process of the job outlives us: once the child has ended,
    what is left of the job (deepspeed's launch.py and ranks after its runner died; ranks whose torchrun
    was killed) gets SETTLE_S seconds to end (with SIGTERM, so that ranks save and stop, unless a
    signal was passed on already), and is then killed. Returns the exit code, the pids killed so, and
    the first signal passed on (0: none)."""
    token = f"{os.getpid()}@{socket.gethostname()}"  # LAUNCHER_ENV: each rank stops when this process ends (loop.watch_launcher)
    env = {**os.environ, **spec.env, LAUNCHER_ENV: token, startup.TIMES_ENV: startup.launch_times()}
    proc = subprocess.Popen(spec.argv, env=env, stderr=subprocess.PIPE,
                            start_new_session=True)
    relay = threading.Thread(target=Relay(log).run, args=(proc.stderr,), daemon=True)
    relay.start()
    sent: list[int] = []

    def forward(signum: int, _frame: Any) -> None:  # Ctrl-C/SIGTERM reach the job
        sent.append(signum)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signum)
        if proc.returncode is not None:  # its group may be gone, not the rest of the job
            for pid in job_processes(token):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signum)

    main_thread = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    try:
        code = proc.wait()
        killed = settle(token, told=bool(sent))
        relay.join(timeout=10)
        return code, killed, sent[0] if sent else 0
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def settle(token: str, *, told: bool, grace: float = SETTLE_S) -> list[int]:
    """Wait for the job's processes still alive after the launch's own child ended (see `execute`);
    SIGTERM them first unless `told`; after `grace` seconds SIGKILL the rest. Returns the pids killed."""
    deadline = time.monotonic() + grace
    while True:
        left = job_processes(token)
        if not left:
            return []
        if not told:
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)
            told = True
        if time.monotonic() > deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            return left
        time.sleep(0.1)


def job_processes(token: str) -> list[int]:
    """Live processes (not zombies) of this user whose environment carries FINETUNE_LAUNCHER=`token`:
    every process of the job, wherever it was reparented ([] where /proc is not)."""
    marker = f"\0{LAUNCHER_ENV}={token}\0".encode()
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                        continue
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if marker in b"\0" + f.read():
                        found.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


class Relay:
    """Copy the job's stderr to ours as it comes (progress bars included), except torchrun's
    report of a failed child: a Python traceback ending in ChildFailedError and its ==== block,
    and elastic's `failed (exitcode ...)` log line; and the traceback of torchrun's SignalException
    or of deepspeed's runner's KeyboardInterrupt when a signal we passed on ended them. Everything, dropped lines too, goes to `log`."""

    def __init__(self, log: Path | None) -> None:
        self.log = open(log, "ab") if log is not None else None  # noqa: SIM115 - closed in run()
        self.held: list[bytes] = []  # a traceback, until its last line says whose it is
        self.rules_left = 0  # '====' lines left in a ChildFailedError report being dropped

    def run(self, stream: Any) -> None:
        pending = b""
        try:
            while chunk := os.read(stream.fileno(), 65536):
                self.keep(chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self.line(line + b"\n")
                if b"\r" in pending and not self.held and not self.rules_left:  # a progress bar: show it now
                    cut = pending.rindex(b"\r") + 1
                    self.out(pending[:cut])
                    pending = pending[cut:]
            if pending:
                self.line(pending)
            self.out(b"".join(self.held))
        finally:
            if self.log:
                with contextlib.suppress(OSError):
                    self.log.close()

    def keep(self, chunk: bytes) -> None:
        """Into the log; a full disk ends the log, never the relay (the job would block on a full pipe)."""
        if self.log:
            try:
                self.log.write(chunk)
                self.log.flush()
            except OSError:
                with contextlib.suppress(OSError):
                    self.log.close()
                self.log = None

    def line(self, line: bytes) -> None:
        if self.rules_left:
            self.rules_left -= line.startswith(b"=====")
        elif line.startswith(b"Traceback (most recent call last):"):
            self.out(b"".join(self.held))
            self.held = [line]
        elif self.held and line[:1] in (b" ", b"\t", b"^"):
            self.held.append(line)
        elif self.held and b"ChildFailedError" in line:
            self.held, self.rules_left = [], 2
        elif self.held and (line.strip() == b"KeyboardInterrupt" or b"SignalException: Process " in line):
            self.held = []  # deepspeed's runner or torchrun, ended by the signal we passed on: the ranks' line says it
        elif re.match(rb"E\d{4} .*elastic/multiprocessing/api.py:\d+\] failed \(exitcode", line):
            return
        else:
            self.out(b"".join(self.held) + line)
            self.held = []

    @staticmethod
    def out(data: bytes) -> None:
        if data:
            sys.stderr.buffer.write(data)
            sys.stderr.buffer.flush()


@contextlib.contextmanager
def signals_received() -> Iterator[set[int]]:
    """The signals this process receives meanwhile, whichever handler runs (execute() forwards them)."""
    received: set[int] = set()
    if threading.current_thread() is not threading.main_thread():  # only the main thread may watch signals
        yield received
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)  # Python writes each signal's number here
    try:
        yield received
    finally:
        signal.set_wakeup_fd(previous)
        try:
            received.update(os.read(read_fd, 4096))
        except BlockingIOError:  # none
            pass
        os.close(read_fd)
        os.close(write_fd)
