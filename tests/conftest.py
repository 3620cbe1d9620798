"""Shared helpers: compose configs exactly as the CLI does, and run the real CLI."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import ranks

# Tests never reach a hub: fail fast instead of retrying the network (set before any HF import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One thread per process: the suite runs two test workers on two cores, each running ranks; with more threads than
# cores every small op waits for a descheduled thread at its barrier (measured: a 4-step in-process run takes 22 s
# with 2 threads under that load, 3.5 s with 1). Set before torch is imported; the launcher honours it for the ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The token cache (finetune/data/cache.py) of this test session: shared by its runs (xdist's workers inherit it),
# never the user's, and removed when the session that made it ends.
if "FINETUNE_CACHE_DIR" not in os.environ:
    os.environ["FINETUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix="finetune-tokens-")
    atexit.register(shutil.rmtree, os.environ["FINETUNE_CACHE_DIR"], ignore_errors=True)

# The lock files by which the two test workers share the machine's cores (tests/ranks.py: a launch of two ranks waits for
# the other worker's test, which waits for it); made once by the session's first process, inherited by its workers.
if "FINETUNE_TEST_CORES" not in os.environ:
    os.environ["FINETUNE_TEST_CORES"] = tempfile.mkdtemp(prefix="finetune-cores-")
    atexit.register(shutil.rmtree, os.environ["FINETUNE_TEST_CORES"], ignore_errors=True)

REPO = Path(__file__).resolve().parent.parent

# How the two workers (pytest-xdist, --dist loadfile) share the files. The files whose tests are mostly jobs of two or
# more ranks form one scope, RANKS, dealt first to one worker, which runs them one after another: their jobs never
# overlap (two jobs of two ranks would put four training processes on two cores), and never wait for each other. The
# other worker meanwhile runs every other file (a scope each, longest first: a long file dealt last keeps one worker
# busy while the other idles), one process each (tests/ranks.py's locks keep the few two-rank jobs there apart from the
# RANKS worker's). Measured (scripts/slowest.py on the last run): RANKS' files took 1,163 s of the 3,271 s of test time.
# (xdist's own --dist loadgroup would do it with markers, but its group suffix is lost under pytest 9.2: `FileScopes`.)
RANKS = ("test_e2e.py", "test_faults.py", "test_parallel.py", "test_grpo.py", "test_deepspeed.py", "test_context.py",
         "test_families_parallel.py", "test_resilience.py", "test_multinode.py", "test_async_generation.py", "test_loading.py")
LONGEST_FIRST = ("test_bad_inputs.py", "test_dpo.py", "test_sweep.py", "test_plan.py", "test_optim.py", "test_kto.py",
                 "test_strategies.py", "test_reward.py", "test_export.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    per_file: dict[str, int] = {}
    for item in items:
        per_file[item.path.name] = per_file.get(item.path.name, 0) + 1
    order = {name: i for i, name in enumerate((*RANKS, *LONGEST_FIRST))}
    items.sort(key=lambda item: (order.get(item.path.name, len(order)), -per_file[item.path.name]))  # stable: a file's own order


OPS = {"FusedAdamBuilder": "fused_adam", "CPUAdamBuilder": "cpu_adam", "ShareMemCommBuilder": "deepspeed_shm_comm"}
"""DeepSpeed's JIT ops the suite's runs load (its Adam, its offloaded Adam, the CPU accelerator's communication): builder
-> the op's directory in TORCH_EXTENSIONS_DIR."""
_BUILDS: list[subprocess.Popen] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    """With FINETUNE_TEST_PREBUILD=1 (scripts/test.sh sets it for the whole suite), the session's first process (not an
    xdist worker) starts building the DeepSpeed ops not built yet beside the first tests (tests/build_ops.py says why);
    their output goes to test-results/ops.log."""
    if hasattr(session.config, "workerinput") or os.environ.get("FINETUNE_TEST_PREBUILD") != "1":
        return
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return
    from finetune.disk import extension_files

    missing = [op for op, name in OPS.items() if not extension_files(f"{name}/{name}.so")]
    log_dir = REPO / "test-results"
    log_dir.mkdir(exist_ok=True)
    with open(log_dir / "ops.log", "w") as log:
        log.write(f"building: {', '.join(missing) or 'none (all built)'}\n")
        log.flush()
        for op in missing:
            _BUILDS.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "build_ops.py"), op], stdout=log,
                                            stderr=subprocess.STDOUT, cwd=REPO))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Builds still running are waited for, never killed: a build killed mid-compile leaves its lock, on which every
    later DeepSpeed rank would wait (finetune/disk.py refuses such a lock after STALE_BUILD_S)."""
    for build in _BUILDS:
        build.wait()


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under --dist loadfile: a scope per file, except RANKS' files, which are one scope (one worker runs them all)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileScopes(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "RANKS" if Path(file).name in RANKS else file

    return FileScopes(config, log)


def where_the_time_went(exc: subprocess.TimeoutExpired) -> str:
    """What a launch past its time limit had done: the machine's load and the processes sharing it (two test workers on
    two cores: more training processes than cores slow every launch), then the last lines it printed (the launcher's
    plan and command, each step's line, the start-up breakdown)."""
    def tail(data: bytes | str | None, n: int = 40) -> str:
        text = data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
        return "\n".join(text.splitlines()[-n:]) or "(nothing)"

    busy = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            with contextlib.suppress(OSError, IndexError):
                if entry.name.isdigit():
                    cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    if "finetune." in cmd and "pytest" not in cmd:
                        busy.append(f"  {entry.name}: {cmd[:200]}")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{shlex.join(map(str, exc.cmd)) if isinstance(exc.cmd, list) else exc.cmd}\nran past its {exc.timeout} s limit; load "
            f"average {load} on {os.cpu_count()} cores; finetune processes alive now ({len(busy)}):\n" + "\n".join(busy) +
            f"\n--- its stdout, last lines ---\n{tail(exc.stdout)}\n--- its stderr, last lines ---\n{tail(exc.stderr)}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test failed by a subprocess's time limit says where the time went (see `where_the_time_went`)."""
    report = yield
    if call.excinfo is not None and isinstance(call.excinfo.value, subprocess.TimeoutExpired):
        report.sections.append(("where the time went", where_the_time_went(call.excinfo.value)))
    return report


@pytest.fixture(scope="module")
def tok():
    """The shipped test tokenizer (a chat template; one token per character of plain text)."""
    from transformers import AutoTokenizer

    from finetune.config import ASSETS

    return AutoTokenizer.from_pretrained(ASSETS / "tokenizer")


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """Rows as a .jsonl file; returns its path as data.train takes it."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def compose():
    """compose(overrides) -> validated Config, through the same path as `finetune.launch`."""
    from finetune.launcher.compose import preflight

    return lambda overrides=(): preflight(list(overrides))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Each test holds its share of the machine's cores from its first fixture to its last teardown (tests/ranks.py);
    @pytest.mark.cores(N) holds N for the whole test (one that starts a job of N training processes itself, not through
    run_cli or launch_here)."""
    marker = item.get_closest_marker("cores")
    with ranks.test_share(item.nodeid), ranks.cores(marker.args[0] if marker else 1):
        return (yield)


def launch_ranks(args: tuple[str, ...] | list[str], module: str = "finetune.launch") -> int:
    """How many training processes `python -m MODULE ARGS` starts on this machine: a launch's ranks (composed here, as the
    launcher composes them; a sweep: its widest trial), 1 for any other module, 0 for a dry run or a refused config."""
    if module != "finetune.launch":
        return 1
    if "launcher.dry_run=true" in args:  # prints the launch, starts nothing (composing to find out costs 0.25 s)
        return 0
    from hydra._internal.utils import get_args_parser

    if get_args_parser().parse_known_args(list(args))[1]:  # a flag Hydra's parser refuses: the launch ends before any rank
        return 0
    from finetune.launcher.compose import preflight, sweep_trials
    from finetune.config import ConfigError

    overrides = [a for a in args if not a.startswith(("-", "hydra.", "hydra/"))]
    trials = sweep_trials(overrides) if any(a in ("-m", "--multirun") for a in args) else [overrides]
    most = 0
    for trial in trials:
        try:
            cfg = preflight(trial)
        except (ConfigError, Exception):  # noqa: BLE001 - refused: the launch ends before any rank
            continue
        if not cfg.launcher.dry_run:
            most = max(most, cfg.launcher.nproc_per_node)
    return most


def run_cli(*args: str, cwd: Path, timeout: int = 600, module: str = "finetune.launch") -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` (default finetune.launch) and return the finished process, holding as many of the
    machine's cores as it starts training processes (`launch_ranks`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with ranks.cores(launch_ranks(args, module)):
        return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def launch_in_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`run_cli(*ARGS, cwd=CWD)` for a launch that the launcher refuses or only prints (a dry run): the launcher's own
    `main` in this process, its stdout and stderr captured and its exit code returned as the CLI's, without the 3-4 s of
    a Python start-up that imports everything. An exception that escapes it is written to stderr as Python would."""
    import contextlib
    import io
    import traceback

    from finetune.launcher.launch import main

    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, here, env = sys.argv, os.getcwd(), dict(os.environ)
    sys.argv = ["finetune.launch", *args]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # noqa: BLE001 - the traceback a user would see
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = argv
        os.chdir(here)
        os.environ.clear()
        os.environ.update(env)
    return subprocess.CompletedProcess(["finetune.launch", *args], code, out.getvalue(), err.getvalue())


def config_keys(model_type: str) -> set[str]:
    """The keys transformers' config class for model_type takes by name: its fields and its attribute_map's aliases."""
    import dataclasses

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return fields | set(getattr(cls, "attribute_map", {}))


def train_here(overrides: list[str], run_dir: Path) -> dict:
    """Compose like the CLI, then run the rank code in this process (one CPU rank, no torchrun):
    the fast way to exercise a strategy end to end. Returns summary.json."""
    import torch

    from finetune.rank import train
    from finetune.launcher.compose import preflight
    from finetune.config import to_yaml
    from finetune.rank.dist import Dist

    cfg = preflight([*overrides, "train.progress_bar=false", "train.tensorboard=false"])
    cfg.run_dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))  # as the launcher writes it
    train.run(cfg, Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    return json.loads((run_dir / "summary.json").read_text())


def tiny_model(compute_dtype=None):
    """The quickstart's random-init tiny Llama and its tokenizer, built in this process."""
    import torch

    from finetune.rank import model
    from finetune.config import ASSETS, ModelConfig, ModelInit, PeftConfig

    tok = model.load_tokenizer(ModelConfig(tokenizer=str(ASSETS / "tokenizer"), init=ModelInit()))
    net = model.load_model(ModelConfig(tokenizer=str(ASSETS / "tokenizer"), init=ModelInit()), tok, attention="sdpa",
                           peft=PeftConfig(), compute_dtype=compute_dtype or torch.float32, zero3=False, run_dir=REPO,
                           is_main=True, barrier=lambda: None)
    return net, tok


def record_steps(monkeypatch) -> dict:
    """finetune.rank.engine.build spied on: the returned dict gets the initial model (a copy, "net"), each step's
    micro-batches and loss count ("steps") and the objective, as a run in this process trains (train_here)."""
    import copy

    from finetune.rank import engine

    seen: dict = {"steps": []}
    build = engine.build

    def spy(cfg, net, dist):
        seen["net"] = copy.deepcopy(net)
        eng = build(cfg, net, dist)
        step = eng.train_step

        def recorded(micro_batches, objective, count):
            seen["steps"].append(([{k: v.clone() for k, v in b.items()} for b in micro_batches], count))
            seen["objective"] = objective
            return step(micro_batches, objective, count)

        eng.train_step = recorded
        return eng

    monkeypatch.setattr(engine, "build", spy)
    return seen


def replay(seen: dict, step) -> list[float]:
    """The recorded steps again in a plain loop over the recorded initial model: each micro-batch's summed loss over
    the step's count, backward, then `step()` (the optimizers' steps) and the gradients zeroed; the steps' losses."""
    net, losses = seen["net"], []
    for micro_batches, count in seen["steps"]:
        count, total = float(count), 0.0  # the engine is handed the count on the device (the step reads nothing back)
        for batch in micro_batches:
            loss, _ = seen["objective"](net, batch)
            (loss * (1 / count)).backward()  # as the engine scales it (world size 1)
            total += loss.item()
        step()
        net.zero_grad()
        losses.append(total / count)
    return losses


class GenerationEngine:
    """The torch engine's generation surface (finetune.methods.sampling.sample's), on one process."""

    lockstep, dp_rank = False, 0

    def __init__(self, model):
        self.generation_model = model

    def inference(self, fn, batch):
        self.generation_model.eval()
        return fn(self.generation_model, batch)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def reload_and_evaluate(final: Path, run_dir: Path):
    """Load RUN_DIR/final with plain transformers on one process; return (eval loss on the run's
    eval set, model, tokenizer, eval examples)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune import config
    from finetune.data.batches import eval_batches
    from finetune.data.sources import load_rows
    from finetune.data.examples import tokenize
    from finetune.methods.sft import SFT

    cfg = config.load(run_dir / "config.yaml")
    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    evals, _ = tokenize(load_rows(cfg.data.eval, "train", "data.eval"), tok, cfg.data, "data.eval")
    loss_sum = count = 0.0
    with torch.no_grad():
        for batch in eval_batches(evals, 32, tok.pad_token_id):
            loss_sum += SFT()(model, batch)[0].item()
            count += SFT().count(batch)
    return loss_sum / count, model, tok, evals


def wait_for(predicate, timeout: float = 240) -> bool:
    """Poll `predicate` every 50 ms until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def steps_done(run_dir: Path) -> int:
    """Training steps a (live) run has logged to RUN_DIR/metrics.jsonl so far."""
    try:
        return sum(m["kind"] == "train" for m in read_metrics(run_dir))
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def kill_whole_job(launcher: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL to a whole job at once, as a node failure or a scheduler's cgroup kill does: the launcher's process
    group (it was started in a session of its own) and every rank RUN_DIR/ranks/ names (each in a session of its own)."""
    ranks = [json.loads(f.read_text())["pid"] for f in (run_dir / "ranks").glob("*.json")]
    os.killpg(launcher.pid, signal.SIGKILL)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    launcher.communicate(timeout=60)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A `python -m finetune.vllm` over vLLM's stand-in (tests/vllm_standin, on the server's path only: the runs
    that sample through it need no vLLM) on a free port, one thread; -> (HOST:PORT, health() -> its /health), stopped
    at the end. Its log: vllm_server.log in the session's temporary directory."""
    log = tmp_path_factory.mktemp("vllm_server") / "vllm_server.log"
    with vllm_server_process(log, f"{Path(__file__).parent / 'vllm_standin'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}") as served:
        yield served


@contextlib.contextmanager
def vllm_server_process(log: Path, pythonpath: str, *args: str):
    """`python -m finetune.vllm --port 0 ARGS` with `pythonpath`, one thread, its stderr into `log`; -> (HOST:PORT,
    health() -> its /health); stopped on exit."""
    import urllib.request

    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    with log.open("w") as err:
        server = subprocess.Popen([sys.executable, "-m", "finetune.vllm", "--port", "0", *args], stdout=subprocess.PIPE,
                                  stderr=err, text=True, env=env)
    try:
        first = server.stdout.readline()  # "finetune.vllm: serving on http://127.0.0.1:PORT"
        assert "serving on http://" in first, first + log.read_text()[-3000:]
        address = first.rpartition("//")[2].strip()

        def health() -> dict:
            with urllib.request.urlopen(f"http://{address}/health", timeout=30) as answer:
                return json.loads(answer.read())

        yield address, health
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="session")
def shipped(tmp_path_factory, worker_id):
    """A short quickstart run where the site's after-training commands expect it, outputs/quickstart_sft under the returned
    directory (the commands run there): 2 ranks, 200 steps (enough for responses other than EOS), for export, generate and
    evaluate. Trained once for the whole suite (the first pytest-xdist worker to ask, under a file lock), then copied into
    this worker's own directory, so the commands that write into it do not meet another worker's."""
    import shutil

    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    trained = shared / "shipped-trained"
    lock = FileLock(str(shared / "shipped-trained.lock"))
    with ranks.released():  # the other worker may be training it, on both cores
        lock.acquire()
    with lock:
        if not (trained / "outputs/quickstart_sft/summary.json").is_file():
            shutil.rmtree(trained, ignore_errors=True)
            trained.mkdir()
            out = run_cli("+recipe=quickstart_sft", "train.max_steps=200", "optim.warmup_steps=5", "train.exact_match_samples=32",
                          "train.progress_bar=false", "hydra.run.dir=outputs/quickstart_sft", cwd=trained)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tmp = tmp_path_factory.mktemp("shipped")
    shutil.copytree(trained / "outputs", tmp / "outputs")
    return tmp


def site_pages() -> list[str]:
    """The documentation's pages, as paths from the repository's root: README.md (its front door), then every page of
    mkdocs.yml's nav, in nav order (tests/test_docs.py checks that the nav holds every page of docs/)."""
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml's own tags (`!relative $config_dir`) read as nothing
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    site = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=Loader)
    pages: list[str] = []

    def walk(entry) -> None:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                walk(value)
        elif isinstance(entry, list):
            for value in entry:
                walk(value)

    walk(site["nav"])
    return ["README.md", *(f"{site.get('docs_dir', 'docs')}/{page}" for page in pages if page.endswith(".md"))]


def site_text() -> str:
    """Every page of the site, one after another (site_pages' order)."""
    return "\n".join((REPO / page).read_text() for page in site_pages())


def readme_commands(module: str) -> list[str]:
    """The site's fenced `python -m MODULE ...` lines (README.md and every page of docs/, site_pages), as written (a
    trailing `# comment` dropped), each once: a command the front door and a page both show is one command."""
    import re

    out = []
    for page in site_pages():
        fenced = False
        for line in (REPO / page).read_text().splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced and re.match(rf"\s*(.*\|\s*)?python -m {re.escape(module)}\b", line):
                out.append(line.split(" # ")[0].strip())
    return list(dict.fromkeys(out))


def shown_under(command: str) -> str:
    """The line the site shows under a fenced command line that is exactly `command` (the error it prints)."""
    found = [lines[i + 1] for page in site_pages() for lines in [(REPO / page).read_text().splitlines()]
             for i, line in enumerate(lines[:-1]) if line.strip() == command]
    assert len(set(found)) == 1, f"the site shows {len(found)} lines under `{command}`: {found}"
    return found[0]


def run_shell(command: str, cwd: Path, env: dict | None = None, timeout: int = 600, stdin: str | None = None) -> subprocess.CompletedProcess:
    """A command line of the site exactly as written, through bash (its quoting), in `cwd`; holding the cores that the
    `python -m MODULE ...` it runs starts training processes on (`launch_ranks`)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # `python` is this interpreter
    words = shlex.split(command, comments=True) if "python -m " in command else []
    at = next((i for i in range(len(words) - 2) if words[i] == "python" and words[i + 1] == "-m"), None)
    n = launch_ranks(tuple(w for w in words[at + 3:] if w not in ("|", "&&", ";")), words[at + 2]) if at is not None else 1
    with ranks.cores(n):
        return subprocess.run(["bash", "-c", command], cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", "PATH": path, **(env or {})},
                              input=stdin, capture_output=True, text=True, timeout=timeout)
