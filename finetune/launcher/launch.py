"""Entry point: compose -> validate -> build the launch -> show it -> run it.

    python -m finetune.launch +recipe=quickstart_sft [group=option] [key=value ...]
    python -m finetune.launch +recipe=quickstart_sft launcher.dry_run=true
    python -m finetune.launch -m +recipe=quickstart_sft optim.lr=1e-3,3e-3      # a sweep

This module is one launch, in order: `main` checks the composition and hands over to Hydra, `launch_once`
checks the data, the model and the memory plan, claims the run directory, writes it (the command and its files
from finetune.launcher.command, a pure builder), shows the command and runs it; finetune.launcher.supervise runs the job's
processes and says why it failed, finetune.launcher.trials runs a sweep's trials.

Imports no torch: composing, validating and a dry run are instant and need no GPU.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from finetune import benchmarks, disk, methods, rundir, startup
from finetune.data import steps
from finetune.launcher import sweep
from finetune.logs import trackers
from finetune.launcher.command import LaunchSpec, build
from finetune.rundir import ERROR_FILE, RANKS_DIR
from finetune.launcher.compose import RECIPES, fail, preflight, run_once, sweep_trials, typed
from finetune.config import Config, ConfigError
from finetune.launcher.devices import Devices, take
from finetune.data import examples
from finetune.data.templates import check_compiles
from finetune.data.lengths import check_tools_template
from finetune.launcher.plan import read_longest, render
from finetune.planner.counts import GIB
from finetune.planner.peak import plan
from finetune.launcher.suggest import render_suggestions, suggest
from finetune.launcher.supervise import TrialFailed, disk_note, run_job
from finetune.launcher.trials import SWEEP, end_sweep, run_trial


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
        return run_trial(dcfg, sweep_dir, Path(hydra_cfg.runtime.output_dir).resolve(), launch_once)
    return _launch(dcfg)


def _launch(dcfg: DictConfig, cfg: Config | None = None) -> float | None:
    """One launch (not a sweep's trial): a failure is the last line and the exit code."""
    try:
        return launch_once(dcfg, cfg)
    except TrialFailed as e:
        print(f"error: {e}{e.hint}", file=sys.stderr)
        sys.exit(e.code)


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


DEVICES: list[Devices] = []
"""The devices this launch took (launcher.devices_per_trial): released with the run directory's lock."""


def release_locks() -> None:
    while LOCKS:
        LOCKS.popitem()[1].release()
    while DEVICES:
        DEVICES.pop().release()


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
        check_compiles(cfg.data)  # the user's template file: its own line, before any row is blamed
        tools_at = examples.check(cfg.data, cfg.method.name)  # missing file or malformed row: one line now, not N ranks later
        check_tools_template(cfg, tools_at)  # a row with tools that the chat template cannot render: the same
        steps.resolve(cfg, lambda line: print(f"{'#' if cfg.launcher.dry_run else '[finetune]'} {line}", flush=True))  # epochs
        check_trackers(cfg)
        benchmarks.check(cfg.train.eval_tasks, cfg.method.name, f"train.eval_tasks=[{','.join(cfg.train.eval_tasks)}]")
        make_model_first(cfg)
        disk.check(cfg)  # the model, tokenizer and device as files on this machine: one line now, not in each rank
        check_hub(cfg)
        check_sampler(cfg)
    except ConfigError as e:
        raise TrialFailed(2, str(e)) from None
    picked = disk.attention(cfg, disk.has_gpu())  # what the ranks will run, and why (they decide again, on their device)
    if picked:
        print(f"{'#' if cfg.launcher.dry_run else '[finetune]'} attention: {picked[0]} ({picked[1]})", flush=True)
    check_memory(cfg, list(HydraConfig.get().overrides.task))
    run_dir = Path(cfg.run_dir or HydraConfig.get().runtime.output_dir).resolve()
    writable = claim(run_dir, cfg)
    if cfg.launcher.devices_per_trial is not None:  # this launch's own devices, held until it ends (launch_once)
        try:
            DEVICES.append(take(cfg.launcher.devices_per_trial, disk.has_gpu(), wait=not cfg.launcher.dry_run,
                                said=lambda line: print(f"[finetune] {line}", flush=True)))
        except ConfigError as e:
            raise TrialFailed(2, str(e)) from None
    spec = build(cfg, run_dir, python=sys.executable, cpu_count=os.cpu_count() or 1, port=free_port(), env_threads=threads,
                 devices=DEVICES[-1] if DEVICES else None)
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
    run_job(spec, run_dir)  # raises TrialFailed with the ranks' one line when training fails
    if cfg.launcher.nnodes == 1:  # the summary is rank 0's, on this node
        said = startup.shutdown(run_dir / "summary.json")
        if said:
            print(f"[finetune] {said}", flush=True)
    loss = sweep.eval_loss(run_dir)
    return loss if loss is not None else float("inf")


def check_hub(cfg: Config) -> None:
    """A real launch's hub ids (model.path, model.tokenizer, a method's teacher, where not local paths): cached here, or
    the hub reachable (finetune.disk.hub_unreachable); a dry run only previews and is not checked."""
    if cfg.launcher.dry_run:
        return
    teacher = methods.get(cfg.method.name).teacher(cfg.method)
    for key, where in (("model.path", cfg.model.path), ("model.tokenizer", cfg.model.tokenizer),
                       ("method.teacher", teacher.where if teacher else None)):
        if where is not None and not disk.is_local(where) and (refusal := disk.hub_unreachable(key, where)) is not None:
            raise refusal


def check_sampler(cfg: Config) -> None:
    """A real launch's sampling servers (method.vllm_servers) answer: one line now, not a rank's after loading."""
    sampling = methods.get(cfg.method.name).sampling(cfg.method)
    if cfg.launcher.dry_run or sampling is None:
        return
    from finetune.vllm import wire as vllm_wire

    for address in sampling.servers:
        try:
            vllm_wire.call(f"http://{address}", "/health", timeout=10)
        except vllm_wire.ServerError as e:
            raise ConfigError(f"method.vllm_servers=[{','.join(sampling.servers)}]: {e}") from None


def check_trackers(cfg: Config) -> None:
    """A tracker in train.loggers that cannot start here (not installed, no credentials, no server): one line now,
    not a warning from rank 0 later. Imports no tracker package (finetune/logs/trackers.py)."""
    if problems := trackers.problems(cfg.train.loggers):
        raise ConfigError(problems[0])


def check_memory(cfg: Config, overrides: list[str]) -> None:
    """The memory plan before anything starts: one line when it fits; the whole plan and the
    suggestions, then a refusal, when it does not (plan.force=true launches anyway)."""
    marker = "#" if cfg.launcher.dry_run else "[finetune]"
    try:
        pl = plan(cfg)  # at data.max_length first: if that fits, the data need not be read
        longest = None
        if not pl.fits:  # padded batches may be shorter: plan the longest one the data holds
            longest = read_longest(cfg)
            pl = plan(cfg, longest)
    except ConfigError as e:
        print(f"{marker} memory plan skipped: {e}", flush=True)
        return
    where = f"hardware={cfg.hardware.name}"
    if pl.fits:
        at = "" if longest is None else f" at the longest batch, {pl.width} tokens (not at data.max_length={cfg.data.max_length})"
        print(f"{marker} memory plan: {pl.total / GIB:.2f} GiB per rank of {pl.budget / GIB:.2f} on {where}: FITS{at} "
              "(python -m finetune.plan ... for the breakdown)", flush=True)
        return
    print(render(cfg, pl), flush=True)
    print(render_suggestions(suggest(cfg, overrides, cfg.plan.suggestions, longest=longest)), flush=True)
    short = f"short by {max(pl.total - pl.budget, pl.cpu_bytes - pl.cpu_budget, pl.nvme_bytes - pl.nvme_budget) / GIB:.2f} GiB"
    if cfg.plan.force or cfg.launcher.dry_run:
        print(f"{marker} memory plan: does not fit {where} ({short}); "
              f"{'plan.force=true: launching anyway' if cfg.plan.force else 'a real launch would be refused'}", flush=True)
        return
    raise TrialFailed(2, f"the memory plan says this config does not fit {where} ({short}): pick one of the suggestions above, "
                         "declare the real machine with hardware=<option>, or launch anyway with plan.force=true")


def make_model_first(cfg: Config) -> None:
    """`model.recipe_if_missing`: when model.path (RUN_DIR/final of that recipe) does not exist yet, run the recipe
    first, into model.path's parent (a dry run only says it would); the same for a method's teacher (method=distill's
    method.teacher_recipe_if_missing, into method.teacher: a run directory or its final/)."""
    m = cfg.model
    if m.recipe_if_missing is not None:
        m.path = make_first("model.path", "model.recipe_if_missing", m.path, m.recipe_if_missing, cfg.launcher.dry_run)
    methods.get(cfg.method.name).make_first(cfg.method, lambda *args: make_first(*args, dry_run=cfg.launcher.dry_run))


def make_first(key: str, setting: str, path: str, recipe: str, dry_run: bool) -> str:
    """`path` (a run's final/, or for a teacher its run directory) resolved; made first by running +recipe=RECIPE into
    its run directory where it does not exist yet."""
    target = Path(path).expanduser().resolve()
    final = target if target.name == "final" else target / "final"
    if (final / "config.json").is_file():
        return str(target)
    user_dirs = [s.path for s in HydraConfig.get().runtime.config_sources  # --config-dir (run_once passes it as a search path)
                 if s.provider in ("command-line", "hydra.searchpath in command-line") and s.schema == "file"]
    argv = [sys.executable, "-m", "finetune.launch", *(f"--config-dir={d}" for d in user_dirs),
            f"+recipe={recipe}", f"hydra.run.dir={final.parent}"]
    if dry_run:
        print(f"# {key}={target} does not exist: a real run first makes it with\n#   {shlex.join(argv)}")
        return str(target)
    print(f"[finetune] {key}={target} does not exist: training it first with +recipe={recipe}", flush=True)
    code = subprocess.call(argv)
    if code != 0 or not (final / "config.json").is_file():
        raise ConfigError(f"{setting}={recipe} did not produce {target} (exit code {code}): see its output above, or set {key} to "
                          "an existing model")
    print(f"[finetune] made {target}; now the run itself", flush=True)
    return str(target)


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


if __name__ == "__main__":
    main()
