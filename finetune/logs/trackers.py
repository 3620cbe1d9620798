"""Experiment trackers as metric sinks (finetune/logs/__init__.py's interface): W&B, MLflow and trackio, chosen by name in
`train.loggers` (`pip install -e ".[track]"`). One class per tracker holds all that tracker knows: how it starts a run
(the resolved config as its parameters, a sweep's trials grouped), how it records a row of metrics and the
generation samples, what it keeps at the end (loss.png, summary.json, config.yaml), and why it could not start
(`problem`, asked by the launcher before anything runs).

What every tracker records:
- parameters: the resolved config (RUN_DIR/config.yaml, the one the ranks read) as flat dotted keys (`optim.lr`),
  with the run's command-line overrides (RUN_DIR/.hydra/overrides.yaml) as `overrides`;
- metrics: each row of metrics.jsonl, `KIND/NAME` (`train/loss`, `eval/eval_loss`) at the row's step;
- samples (`train.sample_prompts`): a table of step, prompt, reference and output per evaluation;
- at the end, loss.png, summary.json and config.yaml as the run's files; the run marked failed when training failed;
- a sweep's trials (`train.group`, which the launcher sets to the sweep directory) in one group: W&B's group,
  trackio's group, an MLflow parent run that each trial's run is nested under.

Why not `accelerate.tracking` (accelerate is a dependency already): its trackers ask `PartialState()` whether they
run on the main process (MLflow's by default, the others through `main_process_only`), which sets up accelerate's
own view of the distributed job beside ours (and DeepSpeed's); they cover no artifacts for W&B and trackio, no
table for MLflow and no parent run across processes; and each is a few lines around the package's own
`init`/`log`/`finish`, which are all this module calls. So the sinks call each package directly.

The launcher imports this module for `problem` (stdlib only: importlib.util.find_spec, one short HTTP request);
each package is imported when its sink starts, on rank 0, in its own thread (logs.MetricsLog)."""

from __future__ import annotations

import base64
import importlib.util
import json
import netrc
import os
import time
import urllib.parse
from dataclasses import asdict, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

PROJECT = "finetune"
"""The project (W&B, trackio) or experiment (MLflow) a run goes to unless the tracker's own variable names one
(WANDB_PROJECT, MLFLOW_EXPERIMENT_NAME, TRACKIO_PROJECT)."""

INSTALL = 'pip install -e ".[track]"'
TIMEOUT_S = 5.0  # the launcher's reachability check: a server that has not answered by then is refused
SAMPLE_COLUMNS = ["step", "prompt", "reference", "output"]
KEPT = ("loss.png", "summary.json", "config.yaml")
"""The run's files a tracker keeps with its run at the end (those that exist)."""


def flat(config: Any) -> dict[str, Any]:
    """The typed config (or a plain mapping) as {dotted key: scalar}: enums by value, lists as text."""
    tree = asdict(config) if is_dataclass(config) else dict(config or {})
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, Enum):
            out[prefix[:-1]] = value.value
        elif isinstance(value, (list, tuple)):
            out[prefix[:-1]] = json.dumps([v.value if isinstance(v, Enum) else v for v in value], default=str)
        else:
            out[prefix[:-1]] = value

    walk("", tree)
    return out


def params(run_dir: Path, config: Any) -> dict[str, Any]:
    """The run's parameters: the resolved config, flat, and its command-line overrides when Hydra recorded them."""
    out = flat(config)
    overrides = run_dir / ".hydra" / "overrides.yaml"
    if overrides.is_file():
        import yaml

        out["overrides"] = " ".join(str(o) for o in yaml.safe_load(overrides.read_text()) or [])
    return out


def group_of(config: Any) -> str | None:
    """train.group (a sweep's trials: their sweep directory); None for a run on its own."""
    train = getattr(config, "train", None)
    return getattr(train, "group", None) or None


def name_of(run_dir: Path) -> str:
    """A run's name in the tracker: the last two parts of its directory (DATE/TIME, or a sweep's TIME/TRIAL)."""
    return "/".join(run_dir.resolve().parts[-2:])


def kept(run_dir: Path) -> list[Path]:
    return [run_dir / name for name in KEPT if (run_dir / name).is_file()]


class WandbApi:
    """What W&B and trackio share (trackio's API is W&B's): `module`, the package; `run`, its run."""

    queued = True  # its calls run in a thread of their own (logs.MetricsLog): a slow service never holds a step
    module: Any
    run: Any

    def write(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        self.run.log({f"{kind}/{k}": v for k, v in metrics.items()}, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.module.Table(columns=SAMPLE_COLUMNS, data=[[step, r["prompt"], r["reference"], r["output"]] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        """Nothing yet: the run ends with its files (`end`)."""

    def keep(self, files: list[Path], name: str) -> None:
        """The files as one artifact of type `results`."""
        if files:
            artifact = self.module.Artifact(name, type="results")
            for path in files:
                artifact.add_file(str(path))
            self.run.log_artifact(artifact)


class WandbSink(WandbApi):
    """Weights & Biases: a run under WANDB_PROJECT (or `finetune`), its files under RUN_DIR/wandb. Offline
    (WANDB_MODE=offline) it writes RUN_DIR/wandb/offline-run-*/run-*.wandb, which `wandb sync` uploads later."""

    output = "wandb"

    def start(self, run_dir: Path, config: Any, resume: bool = False) -> None:
        import wandb

        self.module = wandb
        earlier = wandb_run_id(run_dir) if resume else None  # the run's id: W&B resumes it (offline: `wandb sync` appends)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, name=name_of(run_dir), group=group_of(config),
                              config=params(run_dir, config), dir=str(run_dir), id=earlier, resume="allow" if earlier else None,
                              settings=wandb.Settings(console="off", quiet=True))  # the rank's own output stays as it is

    def end(self, files: list[Path], failed: bool) -> None:
        self.keep(files, f"run-{self.run.id}-results")
        self.run.finish(exit_code=1 if failed else 0)

    @staticmethod
    def problem(environ: dict[str, str]) -> str | None:
        if importlib.util.find_spec("wandb") is None:
            return f"the wandb package is not installed: {INSTALL} (or pip install wandb)"
        if environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or \
                environ.get("WANDB_DISABLED", "").lower() in ("true", "1"):
            return None
        base = environ.get("WANDB_BASE_URL", "https://api.wandb.ai").rstrip("/")
        if environ.get("WANDB_IDENTITY_TOKEN_FILE"):  # OIDC: W&B exchanges the token itself
            return None
        key = environ.get("WANDB_API_KEY") or _netrc_password(base, environ) or _wandb_settings_key(environ)
        offline = "or log offline with WANDB_MODE=offline (then `wandb sync RUN_DIR/wandb/offline-run-*`)"
        if not key:
            return f"no W&B API key for {base}: run `wandb login` or set WANDB_API_KEY, {offline}"
        auth = "Basic " + base64.b64encode(f"api:{key}".encode()).decode()
        answer = _ask(f"{base}/graphql", {"Authorization": auth, "Content-Type": "application/json"},
                      data=json.dumps({"query": "query { viewer { id } }"}).encode())
        if answer in (401, 403):
            return f"{base} refused the W&B API key (HTTP {answer}): run `wandb login --relogin` or fix WANDB_API_KEY, {offline}"
        if isinstance(answer, str):
            return f"cannot reach W&B at {base} ({answer}): check the network or WANDB_BASE_URL, {offline}"
        return None


def wandb_run_id(run_dir: Path) -> str | None:
    """The id of the W&B run that RUN_DIR/wandb holds (its directories are [offline-]run-DATE_TIME-ID), the latest."""
    runs = sorted((p for p in (run_dir / "wandb").glob("*run-*-*") if p.is_dir()), key=lambda p: p.name.split("-")[-2])
    return runs[-1].name.rsplit("-", 1)[-1] if runs else None


class MlflowSink:
    """MLflow: a run in the experiment MLFLOW_EXPERIMENT_NAME (or `finetune`) of the store MLFLOW_TRACKING_URI names
    (a server, sqlite:///PATH; unset, MLflow's default: sqlite:///mlflow.db in the working directory). Through
    MlflowClient, which keeps no global active run."""

    output = ""
    queued = True

    def start(self, run_dir: Path, config: Any, resume: bool = False) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = client = MlflowClient()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        experiment = client.get_experiment_by_name(name)
        self.experiment = experiment.experiment_id if experiment else client.create_experiment(name)
        tags, group, self.parent = {"finetune.run_dir": str(run_dir)}, group_of(config), None
        if resume and (earlier := self.run_of(run_dir)):  # after the run (finetune.evaluate): its own run goes on
            self.run_id = earlier
            client.update_run(earlier, "RUNNING")
            return
        if group:
            self.parent = self.parent_run(group)
            tags |= {"mlflow.parentRunId": self.parent, "finetune.group": group}
        self.run_id = client.create_run(self.experiment, run_name=name_of(run_dir), tags=tags).info.run_id
        values = [Param(k, str(v)[:6000]) for k, v in params(run_dir, config).items()]
        for i in range(0, len(values), 100):  # MLflow takes at most 100 parameters per call
            client.log_batch(self.run_id, params=values[i : i + 100])

    def run_of(self, run_dir: Path) -> str | None:
        """The newest MLflow run of RUN_DIR (tag finetune.run_dir), or None."""
        found = self.client.search_runs([self.experiment], f"tags.`finetune.run_dir` = '{_quoted(str(run_dir))}'", max_results=1,
                                        order_by=["attributes.start_time DESC"])
        return found[0].info.run_id if found else None

    def parent_run(self, group: str) -> str:
        """The group's parent run (tag finetune.sweep=GROUP), made by the first trial that finds none."""
        found = self.client.search_runs([self.experiment], f"tags.`finetune.sweep` = '{_quoted(group)}'", max_results=1)
        if found:
            return found[0].info.run_id
        return self.client.create_run(self.experiment, run_name=group, tags={"finetune.sweep": group}).info.run_id

    def write(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        self.write_rows([(kind, step, metrics)])

    def write_rows(self, rows: list[tuple[str, int, dict[str, float]]]) -> None:
        """Rows that waited in the queue, in as few requests as MLflow allows (1000 metrics each): one request costs
        about as much as one row (a server's round trip, a SQLite transaction)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{kind}/{k}", float(v), now, step) for kind, step, values in rows for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        data = {"step": [step] * len(rows)} | {c: [r[c] for r in rows] for c in SAMPLE_COLUMNS[1:]}
        self.client.log_table(self.run_id, data=data, artifact_file="samples.json")  # appended: one table over the run

    def close(self) -> None:
        """Nothing yet: the run ends with its files (`end`)."""

    def end(self, files: list[Path], failed: bool) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
        if self.parent:
            self.client.set_terminated(self.parent)  # its end time: the last trial's

    @staticmethod
    def problem(environ: dict[str, str]) -> str | None:
        if importlib.util.find_spec("mlflow") is None:
            return f"the mlflow package is not installed: {INSTALL} (or pip install mlflow-skinny)"
        uri = environ.get("MLFLOW_TRACKING_URI", "")
        scheme = urllib.parse.urlparse(uri).scheme
        if scheme in ("http", "https"):
            answer = _ask(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/search?max_results=1", _mlflow_auth(environ))
            if answer in (401, 403):
                return (f"the MLflow server at MLFLOW_TRACKING_URI={uri} refused the credentials (HTTP {answer}): set "
                        "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN")
            if isinstance(answer, str):
                return (f"cannot reach the MLflow server at MLFLOW_TRACKING_URI={uri} ({answer}): start it "
                        "(mlflow server ...), or point MLFLOW_TRACKING_URI at a reachable server or a local sqlite:///PATH")
            return None
        if scheme in ("", "sqlite"):
            missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
            where = f"MLFLOW_TRACKING_URI={uri}" if uri else "MLflow's default store (sqlite:///mlflow.db, MLFLOW_TRACKING_URI unset)"
            if missing:
                return f"{where} needs {' and '.join(missing)}: {INSTALL}, or point MLFLOW_TRACKING_URI at an MLflow server"
            return _unwritable(Path(urllib.parse.urlparse(uri).path[1:] if uri else "mlflow.db").parent, where)
        if scheme == "file" and environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
            return (f"MLFLOW_TRACKING_URI={uri} is a file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true: "
                    "use sqlite:///PATH/mlflow.db, or set MLFLOW_ALLOW_FILE_STORE=true")
        return None  # databricks, ...: MLflow's own configuration


class TrackioSink(WandbApi):
    """trackio: a run in the project TRACKIO_PROJECT (or `finetune`), in its local SQLite database (TRACKIO_DIR, by
    default ~/.cache/huggingface/trackio; `trackio show` opens the dashboard), or a Space / server that
    TRACKIO_SPACE_ID / TRACKIO_SERVER_URL names."""

    output = ""

    def start(self, run_dir: Path, config: Any, resume: bool = False) -> None:
        import trackio

        self.module, self.name = trackio, name_of(run_dir)
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT") or PROJECT, name=self.name, group=group_of(config),
                                config=params(run_dir, config), embed=False, auto_log_cpu=False, auto_log_gpu=False,
                                resume="allow" if resume else "never")  # resume: the run of this name goes on

    def end(self, files: list[Path], failed: bool) -> None:
        self.keep(files, f"results-{self.name.replace('/', '-')}")
        self.run.finish()  # trackio records no failure

    @staticmethod
    def problem(environ: dict[str, str]) -> str | None:
        if importlib.util.find_spec("trackio") is None:
            return f"the trackio package is not installed: {INSTALL} (or pip install trackio)"
        if environ.get("TRACKIO_SPACE_ID"):
            if not (environ.get("HF_TOKEN") or _hf_token_file(environ).is_file()):
                return f"TRACKIO_SPACE_ID={environ['TRACKIO_SPACE_ID']} needs a Hugging Face token: `hf auth login` or set HF_TOKEN"
            answer = _ask("https://huggingface.co/api/whoami-v2", {"Authorization": f"Bearer {environ.get('HF_TOKEN', '')}"})
            return f"cannot reach the Hugging Face Hub for TRACKIO_SPACE_ID ({answer})" if isinstance(answer, str) else None
        if environ.get("TRACKIO_SERVER_URL"):
            answer = _ask(environ["TRACKIO_SERVER_URL"], {})
            if isinstance(answer, str):
                return f"cannot reach TRACKIO_SERVER_URL={environ['TRACKIO_SERVER_URL']} ({answer}): start the server or unset it"
            return None
        home = environ.get("HF_HOME") or str(Path("~/.cache/huggingface").expanduser())
        return _unwritable(Path(environ.get("TRACKIO_DIR") or Path(home) / "trackio"), "trackio's local store (TRACKIO_DIR)")


TRACKERS: dict[str, type] = {"wandb": WandbSink, "mlflow": MlflowSink, "trackio": TrackioSink}
"""train.loggers' tracker names -> sink classes (logs.SINKS holds them beside jsonl and tensorboard)."""


def problems(loggers: list[str], environ: dict[str, str] | None = None) -> list[str]:
    """For each tracker in `loggers` that cannot start here, one line: train.loggers, the tracker, why, what to do.
    The launcher refuses the launch with the first (no tracker package is imported)."""
    environ = dict(os.environ if environ is None else environ)
    out = []
    for name in loggers:
        if name in TRACKERS and (why := TRACKERS[name].problem(environ)) is not None:
            out.append(f"train.loggers has {name}, but {why}; or take {name} out of train.loggers")
    return out


def _quoted(text: str) -> str:
    """`text` inside single quotes of an MLflow search filter."""
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _ask(url: str, headers: dict[str, str], data: bytes | None = None) -> int | str:
    """The HTTP status of one request (an error status too), or why there was none (refused, timed out...)."""
    import urllib.error
    import urllib.request  # here: http.client and ssl cost every config import ~20 ms

    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=TIMEOUT_S) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return str(getattr(reason, "strerror", None) or reason)


def _netrc_password(base: str, environ: dict[str, str]) -> str | None:
    """The password ~/.netrc (or $NETRC) holds for the URL's host (where `wandb login` keeps the key)."""
    try:
        path = environ.get("NETRC") or str(Path(environ.get("HOME") or Path.home()) / ".netrc")
        entry = netrc.netrc(path).authenticators(urllib.parse.urlparse(base).netloc)
    except (OSError, netrc.NetrcParseError):
        return None
    return entry[2] if entry else None


def _wandb_settings_key(environ: dict[str, str]) -> str | None:
    """An api_key in W&B's global settings file (WANDB_CONFIG_DIR, by default ~/.config/wandb)."""
    import configparser

    settings = configparser.ConfigParser()
    home = Path(environ.get("HOME") or Path.home())
    settings.read(Path(environ.get("WANDB_CONFIG_DIR") or home / ".config" / "wandb") / "settings")
    return settings.get("default", "api_key", fallback=None)


def _mlflow_auth(environ: dict[str, str]) -> dict[str, str]:
    if environ.get("MLFLOW_TRACKING_TOKEN"):
        return {"Authorization": f"Bearer {environ['MLFLOW_TRACKING_TOKEN']}"}
    if environ.get("MLFLOW_TRACKING_USERNAME"):
        pair = f"{environ['MLFLOW_TRACKING_USERNAME']}:{environ.get('MLFLOW_TRACKING_PASSWORD', '')}"
        return {"Authorization": "Basic " + base64.b64encode(pair.encode()).decode()}
    return {}


def _hf_token_file(environ: dict[str, str]) -> Path:
    return Path(environ.get("HF_HOME") or Path("~/.cache/huggingface").expanduser()) / "token"


def _unwritable(directory: Path, what: str) -> str | None:
    """Why `directory` (made if missing) cannot be written, or None."""
    try:
        directory = directory.expanduser().resolve()
        directory.mkdir(parents=True, exist_ok=True)
        if os.access(directory, os.W_OK):
            return None
        return f"{what}: {directory} is not writable: choose another directory"
    except OSError as e:
        return f"{what}: {directory} cannot be made ({e.strerror or e}): choose another directory"
