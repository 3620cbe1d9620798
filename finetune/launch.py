"""Entry point: compose -> validate -> build the launch -> show it -> run it.

    python -m finetune.launch +recipe=quickstart_sft [group=option] [key=value ...]
    python -m finetune.launch +recipe=quickstart_sft launcher.dry_run=true
    python -m finetune.launch -m +recipe=quickstart_sft optim.lr=1e-3,3e-3      # a sweep

Imports no torch: composing, validating and a dry run are instant and need no GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from finetune import disk, plan, rundir, startup, sweep, trackers
from finetune.compose import RECIPES, _first_line, fail, preflight, run_once, sweep_trials, typed
from finetune.config import Config, ConfigError
from finetune.data import forms
from finetune.launcher import ERROR_FILE, LAUNCHER_ENV, RANKS_DIR, LaunchSpec, build




def main() -> None:
    """Check the composition first so a user mistake is one line, then hand over to Hydra."""
    parser = hydra._internal.utils.get_args_parser()  # Hydra's own flags, unchanged
    parser.error = lambda message: fail(ConfigError(f"{message} (python -m finetune.launch --help lists the flags)"))
    args = parser.parse_intermixed_args()  # overrides before and after --config-dir DIR alike
    sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if a not in args.overrides), *args.overrides]  # as Hydra parses it
    if args.config_dir and not Path(args.config_dir).expanduser().is_dir():
        fail(ConfigError(f"--config-dir {args.config_dir}: no such directory (it holds your own recipe/NAME.yaml and group options)"))
    hydra_only = args.help or args.hydra_help or args.info or args.shell_completion or args.cfg or args.config_path \
        or args.experimental_rerun  # Hydra's own commands
    if not (args.multirun or hydra_only):
        try:  # one launch: composed once, validated before Hydra makes the run directory
            run_once(args.overrides, lambda dcfg, cfg, _: _launch(dcfg, cfg), lambda run_dir, cfg: claim(run_dir, cfg, touch=False),
                     config_dir=args.config_dir, config_name=args.config_name or "config")
        except ConfigError as e:
            fail(e)
        except TrialFailed as e:
            print(f"error: {e}{e.hint}", file=sys.stderr)
            sys.exit(e.code)
        return
    if not hydra_only:
        try:
            for overrides in sweep_trials(args.overrides):
                cfg = preflight(overrides, config_dir=args.config_dir, config_name=args.config_name or "config", rules=False)
                check_trackers(cfg)  # once for the sweep, not once per trial
        except ConfigError as e:
            fail(e)
    _hydra_main()
    if args.multirun and SWEEP["dir"] is not None:
        end_sweep()


@hydra.main(version_base="1.3", config_path=str(RECIPES), config_name="config")
def _hydra_main(dcfg: DictConfig) -> float | None:
    """One launch, or under -m one trial of the sweep. Returns the final eval loss: what sweepers minimise."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sweep_dir = Path(hydra_cfg.runtime.cwd, hydra_cfg.sweep.dir).resolve()  # relative to where the sweep started
        return run_trial(dcfg, sweep_dir, Path(hydra_cfg.runtime.output_dir).resolve())
    return _launch(dcfg)


def _launch(dcfg: DictConfig, cfg: Config | None = None) -> float | None:
    """One launch (not a sweep's trial): a failure is the last line and the exit code."""
    try:
        return launch_once(dcfg, cfg)
    except TrialFailed as e:
        print(f"error: {e}{e.hint}", file=sys.stderr)
        sys.exit(e.code)


class TrialFailed(Exception):
    """A launch that refused its config or whose training failed: the exit code and one-line reason."""

    def __init__(self, code: int, reason: str, hint: str = "", *, ends_sweep: bool = False) -> None:
        super().__init__(reason)
        self.code, self.hint, self.ends_sweep = code, hint, ends_sweep


def claim(run_dir: Path, cfg: Config, *, touch: bool = True) -> bool:
    """May this launch write into `run_dir` (see `rundir.claim`; touch=False: `rundir.verdict`,
    asked before Hydra writes its own files there, before the checks that may still refuse the run).
    A live run's directory is refused first (a dry run warns), and a launch that may write there takes
    its lock (RUN_DIR/.lock, `rundir.Lock`) for the launch's life."""
    dir_key = "run_dir" if cfg.run_dir else f"hydra.{'sweep' if _sweeping() else 'run'}.dir"
    dry_run, run_dir = cfg.launcher.dry_run, run_dir.resolve()
    try:
        if run_dir not in LOCKS and rundir.busy(run_dir):  # a live run's: refused before the rest is said of it
            if dry_run:
                if touch:
                    print(f"warning: {rundir.in_use(run_dir, dir_key)}; this dry run writes nothing there", file=sys.stderr)
                return False
            raise ConfigError(rundir.in_use(run_dir, dir_key))
        # another run's results there: refused (a dry run warns), or removed with train.overwrite=true
        if touch:
            writable = rundir.claim(run_dir, cfg.train, dry_run=dry_run, dir_key=dir_key)
        else:
            writable = rundir.verdict(run_dir, cfg.train, dry_run=dry_run, dir_key=dir_key)[0]
        if touch and writable and not dry_run and run_dir not in LOCKS:  # asked before the checks: nothing made yet
            LOCKS[run_dir] = rundir.Lock.take(run_dir, shared=cfg.launcher.nnodes > 1, dir_key=dir_key)
        return writable
    except ConfigError as e:
        raise TrialFailed(2, str(e), ends_sweep=True) from None  # a sweep into an old sweep's directory stops here


LOCKS: dict[Path, rundir.Lock] = {}
"""The run directories this process holds (one at a time: a sweep's trials run one after another)."""


def release_locks() -> None:
    while LOCKS:
        LOCKS.popitem()[1].release()


def _sweeping() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def launch_once(dcfg: DictConfig, cfg: Config | None = None) -> float | None:
    """Validate (unless `cfg` is `dcfg` validated already), claim the run directory, write it, show
    the launch and run it. Returns the final eval loss (None for a dry run); raises TrialFailed."""
    try:
        return _launch_once(dcfg, cfg)
    finally:
        release_locks()  # the next trial of a sweep takes its own directory


def _launch_once(dcfg: DictConfig, cfg: Config | None = None) -> float | None:
    try:
        cfg = cfg or typed(dcfg)
        threads = env_threads()
        forms.check(cfg.data, cfg.method.name)  # missing file or malformed row: one line now, not N ranks later
        check_trackers(cfg)
        make_model_first(cfg)
        disk.check(cfg)  # the model, tokenizer and device as files on this machine: one line now, not in each rank
    except ConfigError as e:
        raise TrialFailed(2, str(e)) from None
    picked = disk.attention(cfg, disk.has_gpu())  # what the ranks will run, and why (they decide again, on their device)
    if picked:
        print(f"{'#' if cfg.launcher.dry_run else '[finetune]'} attention: {picked[0]} ({picked[1]})", flush=True)
    check_memory(cfg, list(HydraConfig.get().overrides.task))
    run_dir = Path(cfg.run_dir or HydraConfig.get().runtime.output_dir).resolve()
    writable = claim(run_dir, cfg)
    spec = build(cfg, run_dir, python=sys.executable, cpu_count=os.cpu_count() or 1, port=free_port(), env_threads=threads)
    if writable:
        try:
            sweep.clear_status(run_dir)  # a trial that starts again is not failed until it fails again
            write_files(spec, run_dir)
        except OSError as e:
            raise TrialFailed(1, f"cannot write the run directory {run_dir}: {e.strerror or e}{disk_note(run_dir)}") from None
    if cfg.launcher.dry_run:
        print(spec.files["config.yaml"], end="")
        print(f"# run directory: {run_dir}")
        for name in spec.files:
            if name != "config.yaml":
                print(f"# {run_dir / name}:\n" + "\n".join(f"#   {line}" for line in spec.files[name].splitlines()))
        print(f"# environment set: {' '.join(f'{k}={v}' for k, v in spec.env.items())}")
        print(spec.shell())
        return None
    print(f"[finetune] run directory: {run_dir}", flush=True)
    print(f"[finetune] {spec.shell()}", flush=True)
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    shutil.rmtree(run_dir / RANKS_DIR, ignore_errors=True)  # each rank records itself anew
    (run_dir / RANKS_DIR).mkdir()
    LOCKS[run_dir].share()  # the ranks hold it too: a killed launcher's ranks still keep the directory
    code, killed, signum = execute(spec, log=run_dir / RANKS_DIR / "launcher.log")
    if code == 0 and not all_done(run_dir):  # deepspeed's runner exits 0 when its launch.py was killed
        code = 1
    if signum and code != 0:  # stopped by a signal: the shell's code for it (torchrun says 1, deepspeed -signum)
        code = 128 + signum
    if code != 0:
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
    if cfg.launcher.nnodes == 1:  # the summary is rank 0's, on this node
        said = startup.shutdown(run_dir / "summary.json")
        if said:
            print(f"[finetune] {said}", flush=True)
    loss = sweep.eval_loss(run_dir)
    return loss if loss is not None else float("inf")


def check_trackers(cfg: Config) -> None:
    """A tracker in train.loggers that cannot start here (not installed, no credentials, no server): one line now,
    not a warning from rank 0 later. Imports no tracker package (finetune/trackers.py)."""
    if problems := trackers.problems(cfg.train.loggers):
        raise ConfigError(problems[0])


def check_memory(cfg: Config, overrides: list[str]) -> None:
    """The memory plan before anything starts: one line when it fits; the whole plan and the
    suggestions, then a refusal, when it does not (plan.force=true launches anyway)."""
    marker = "#" if cfg.launcher.dry_run else "[finetune]"
    try:
        pl = plan.plan(cfg)  # at data.max_length first: if that fits, the data need not be read
        longest = None
        if not pl.fits:  # padded batches may be shorter: plan the longest one the data holds
            longest = plan.read_longest(cfg)
            pl = plan.plan(cfg, longest)
    except ConfigError as e:
        print(f"{marker} memory plan skipped: {e}", flush=True)
        return
    where = f"hardware={cfg.hardware.name}"
    if pl.fits:
        at = "" if longest is None else f" at the longest batch, {pl.width} tokens (not at data.max_length={cfg.data.max_length})"
        print(f"{marker} memory plan: {pl.total / plan.GIB:.2f} GiB per rank of {pl.budget / plan.GIB:.2f} on {where}: FITS{at} "
              "(python -m finetune.plan ... for the breakdown)", flush=True)
        return
    print(plan.render(cfg, pl), flush=True)
    print(plan.render_suggestions(plan.suggest(cfg, overrides, cfg.plan.suggestions, longest=longest)), flush=True)
    short = f"short by {max(pl.total - pl.budget, pl.cpu_bytes - pl.cpu_budget, pl.nvme_bytes - pl.nvme_budget) / plan.GIB:.2f} GiB"
    if cfg.plan.force or cfg.launcher.dry_run:
        print(f"{marker} memory plan: does not fit {where} ({short}); "
              f"{'plan.force=true: launching anyway' if cfg.plan.force else 'a real launch would be refused'}", flush=True)
        return
    raise TrialFailed(2, f"the memory plan says this config does not fit {where} ({short}): pick one of the suggestions above, "
                         "declare the real machine with hardware=<option>, or launch anyway with plan.force=true")


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


SWEEP: dict[str, Any] = {"dir": None, "trials": [], "failed": [], "summary": False}
"""The sweep this process runs (Hydra's basic launcher runs every trial here): for the last word."""


def run_trial(dcfg: DictConfig, sweep_dir: Path, trial_dir: Path) -> float:
    """One trial of a sweep. A failure is recorded (TRIAL_DIR/status.json) and the sweep goes on to the
    next trial; SWEEP_DIR's summary is rewritten before and after. Returns the final eval loss, inf for
    a failed trial (or a dry run). Ctrl-C ends the sweep."""
    startup.trial_begins()
    SWEEP["dir"] = sweep_dir
    SWEEP["trials"].append(trial_dir.name)
    dry_run = OmegaConf.select(dcfg, "launcher.dry_run", default=False) is True
    SWEEP["summary"] |= not dry_run
    if OmegaConf.select(dcfg, "train.group", default=None) is None:  # the trackers group the trials by their sweep
        dcfg.train.group = str(sweep_dir)
    if not dry_run:
        update_summary(sweep_dir)
    failure, loss = None, None
    with signals_received() as received:
        try:
            loss = launch_once(dcfg)
        except TrialFailed as e:
            failure = e
    stop = sorted(received & {signal.SIGINT, signal.SIGTERM})  # Ctrl-C ends the sweep, not just this trial
    if stop:
        code = failure.code if failure else 128 + stop[0]
        failure = TrialFailed(code, f"interrupted by {signal.Signals(stop[0]).name}" + (f": {failure}" if failure else ""),
                              f" (to go on, run the sweep again with train.resume=auto hydra.sweep.dir={sweep_dir}: "
                              "each trial continues from its own checkpoints)")
    if failure is not None:
        print(f"error: trial {trial_dir.name}: {failure}{failure.hint}", file=sys.stderr)
        if failure.ends_sweep:  # the directory holds an earlier trial's results: leave them as they are
            sys.exit(failure.code)
        sweep.record_failure(trial_dir, failure.code, str(failure))
        SWEEP["failed"].append(trial_dir.name)
        loss = float("inf")
    if not dry_run:
        update_summary(sweep_dir)
    if stop:
        sys.exit(failure.code)  # SystemExit is no Exception: Hydra's launcher lets it end the sweep
    return float("inf") if loss is None else loss  # a dry run: no loss, but a value a sweeper accepts


def update_summary(sweep_dir: Path) -> None:
    """Rewrite the sweep's summary files; a failure to do so must not end a long sweep."""
    try:
        sweep.write(sweep_dir)
    except Exception as e:  # noqa: BLE001 - reported, and the next trial rewrites it anyway
        print(f"[finetune] warning: could not update the sweep summary in {sweep_dir}: {_first_line(str(e))}", file=sys.stderr)


def end_sweep() -> None:
    """After the last trial: the table, where the summary is, and exit code 1 when a trial failed."""
    sweep_dir, failed = SWEEP["dir"], SWEEP["failed"]
    if SWEEP["summary"]:  # not after a dry run
        print("\n" + sweep.report(sweep_dir, sweep.collect(sweep_dir)), end="")
    if failed:
        where = sweep_dir / (sweep.MARKDOWN if SWEEP["summary"] else f"N/{sweep.STATUS}")
        print(f"error: {len(failed)} of {len(SWEEP['trials'])} trials failed (trial {', '.join(failed)}); reasons in {where}",
              file=sys.stderr)
        sys.exit(1)


def make_model_first(cfg: Config) -> None:
    """`model.recipe_if_missing`: when model.path (RUN_DIR/final of that recipe) does not exist yet,
    run the recipe first, into model.path's parent (a dry run only says it would)."""
    m = cfg.model
    if m.recipe_if_missing is None:
        return
    target = Path(m.path).expanduser().resolve()
    m.path = str(target)  # the ranks may not share our working directory's meaning of a relative path
    if (target / "config.json").is_file():
        return
    user_dirs = [s.path for s in HydraConfig.get().runtime.config_sources  # --config-dir (run_once passes it as a search path)
                 if s.provider in ("command-line", "hydra.searchpath in command-line") and s.schema == "file"]
    argv = [sys.executable, "-m", "finetune.launch", *(f"--config-dir={d}" for d in user_dirs),
            f"+recipe={m.recipe_if_missing}", f"hydra.run.dir={target.parent}"]
    if cfg.launcher.dry_run:
        print(f"# model.path={target} does not exist: a real run first makes it with\n#   {shlex.join(argv)}")
        return
    print(f"[finetune] model.path={target} does not exist: training it first with +recipe={m.recipe_if_missing}", flush=True)
    code = subprocess.call(argv)
    if code != 0 or not (target / "config.json").is_file():
        raise ConfigError(f"model.recipe_if_missing={m.recipe_if_missing} did not produce {target} (exit code {code}): "
                          "see its output above, or set model.path to an existing model")
    print(f"[finetune] made {target}; now the run itself", flush=True)


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


def env_threads() -> int | None:
    """OMP_NUM_THREADS from the environment this launch runs in (None when unset), checked."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise TrialFailed(2, f"OMP_NUM_THREADS={value!r} in the environment is not a whole number of threads: unset it, or set "
                             "launcher.omp_num_threads")
    return int(value)


def free_port() -> int:
    """A port nobody listens on now (the rendezvous port when launcher.master_port is null)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_files(spec: LaunchSpec, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, content in spec.files.items():
        (run_dir / name).write_text(content)


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


if __name__ == "__main__":
    main()
