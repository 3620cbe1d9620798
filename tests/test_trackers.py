"""The experiment trackers (finetune/logs/trackers.py) for real, offline: a run logs to W&B (WANDB_MODE=offline, its run file
read back with W&B's own reader, `wandb leet inspect --json`), MLflow (a local SQLite store, read back with
MlflowClient) and trackio (its local SQLite database, read back with its SQLiteStorage), and each holds the numbers
metrics.jsonl holds; the generation samples (train.sample_prompts) are the final model's own greedy outputs; a sweep's
trials share a group; a tracker that cannot start is refused before launch in one line, without importing its
package; one that fails mid-run is warned about once, and training finishes, never waiting for it."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from finetune import logs
from finetune.logs import trackers

from conftest import last_line, read_metrics, reload_and_evaluate, run_cli, site_pages, site_text, train_here

TINY = ["train.max_steps=4", "train.global_batch_size=8", "train.micro_batch_size=8", "train.eval_every=2",
        "data.eval_size=16", "train.exact_match_samples=0", "train.memory_report=false", "train.max_new_tokens=8"]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker local: W&B offline, MLflow in a SQLite file, trackio in a directory of tmp_path; run from tmp_path
    (MLflow's local artifact root is ./mlruns of the working directory)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    for name in ("WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME", "TRACKIO_PROJECT", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def wandb_records(run_dir: Path) -> list[dict]:
    """The records of the run's .wandb file, through W&B's own reader."""
    (offline_run,) = (run_dir / "wandb").glob("offline-run-*")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(offline_run)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def wandb_history(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    history: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r["type"] == "history":
            item = r["history"]["item"]
            for k, v in item.items():
                if not k.startswith("_") and isinstance(v, (int, float)):
                    history.setdefault(k, []).append((item["_step"], v))
    return history


def assert_series(got: list[tuple[int, float]], expected: list[tuple[int, float]], key: str = "") -> None:
    """A tracker's (step, value) series against metrics.jsonl's: the steps exactly, the values to float rounding
    (pytest.approx compares flat sequences only: pytest 9.2 refuses a list of tuples)."""
    assert [step for step, _ in got] == [step for step, _ in expected], key
    assert [value for _, value in got] == pytest.approx([value for _, value in expected]), key


def jsonl_series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as the trackers name it: KIND/NAME -> [(step, value)]."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["kind"] != logs.SAMPLE:
            for k, v in r.items():
                if k not in ("kind", "step"):
                    series.setdefault(f"{r['kind']}/{k}", []).append((r["step"], v))
    return series


def test_one_run_logs_the_same_numbers_to_every_tracker(offline):
    run_dir = offline / "run"
    summary = train_here([*TINY, "train.loggers=[jsonl,wandb,mlflow,trackio]", "train.sample_prompts=3",
                          "optim.lr=0.002"], run_dir)
    rows = read_metrics(run_dir)
    expected = jsonl_series(rows)
    assert [s for s, _ in expected["train/loss"]] == [1, 2, 3, 4] and [s for s, _ in expected["eval/eval_loss"]] == [0, 2, 4]
    samples = [r for r in rows if r["kind"] == logs.SAMPLE]
    assert [(r["step"], r["index"]) for r in samples] == [(s, i) for s in (0, 2, 4) for i in range(3)]

    # W&B, offline: the run file read back by W&B's reader
    records = wandb_records(run_dir)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    config = run["config"]["update"]
    assert config["optim.lr"] == 0.002 and config["train.sample_prompts"] == 3 and config["train.loggers"] == \
        '["jsonl", "wandb", "mlflow", "trackio"]'
    assert run["display_name"] == "/".join(run_dir.parts[-2:]) and run["project"] == "finetune"
    history = wandb_history(records)
    for key in ("train/loss", "train/lr", "train/grad_norm", "eval/eval_loss"):
        assert_series(history[key], expected[key], key)
    (artifact,) = [r["artifact"] for r in records if r["type"] == "artifact" and r["artifact"]["type"] == "results"]
    assert sorted(e["path"] for e in artifact["manifest"]["contents"]) == ["config.yaml", "loss.png", "summary.json"]
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]
    tables = sorted((run_dir / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"),
                    key=lambda p: int(p.name.split("_")[1]))
    table = json.loads(tables[-1].read_text())
    assert table["columns"] == ["step", "prompt", "reference", "output"]
    assert table["data"] == [[4, r["prompt"], r["reference"], r["output"]] for r in samples if r["step"] == 4]

    # MLflow, a local SQLite store: params, metric histories, the files, the samples table
    from mlflow import MlflowClient

    client = MlflowClient()
    (found,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == "/".join(run_dir.parts[-2:])
    assert found.data.params["optim.lr"] == "0.002" and found.data.params["model.init.num_hidden_layers"] == "2"
    for key in ("train/loss", "train/tokens_per_s", "eval/eval_loss"):
        got = [(m.step, m.value) for m in sorted(client.get_metric_history(found.info.run_id, key), key=lambda m: m.step)]
        assert_series(got, expected[key], key)
    assert sorted(a.path for a in client.list_artifacts(found.info.run_id)) == ["config.yaml", "loss.png", "samples.json",
                                                                                  "summary.json"]
    kept = json.loads(Path(client.download_artifacts(found.info.run_id, "summary.json", str(offline / "dl"))).read_text())
    assert kept["after"]["eval_loss"] == summary["after"]["eval_loss"]
    table = json.loads(Path(client.download_artifacts(found.info.run_id, "samples.json", str(offline / "dl"))).read_text())
    assert [dict(zip(table["columns"], row)) for row in table["data"]] == \
        [{"step": r["step"], "prompt": r["prompt"], "reference": r["reference"], "output": r["output"]} for r in samples]

    # trackio, its local SQLite database
    from trackio import SQLiteStorage

    (name,) = SQLiteStorage.get_runs("finetune")
    logged = SQLiteStorage.get_logs("finetune", name)
    got = sorted((r["step"], r["train/loss"]) for r in logged if "train/loss" in r)
    assert_series(got, expected["train/loss"])
    assert_series(sorted((r["step"], r["eval/eval_loss"]) for r in logged if "eval/eval_loss" in r), expected["eval/eval_loss"])
    assert SQLiteStorage.get_run_config("finetune", name)["optim.lr"] == 0.002

    # the samples are the model's own: the final ones are what final/ generates greedily from those prompts
    from finetune.rank.heldout import generate

    _, model, tok, evals = reload_and_evaluate(run_dir / "final", run_dir)
    import torch

    outputs = generate(model, tok, evals[:3], batch_size=8, max_new_tokens=8, device=torch.device("cpu"))
    assert [r["output"] for r in samples if r["step"] == 4] == outputs
    assert [r["reference"] for r in samples if r["step"] == 4] == [e.reference for e in evals[:3]]


def test_a_failed_run_is_marked_failed(offline):
    """Training that raises inside the run's MetricsLog: W&B's run exits 1, MLflow's is FAILED; no files are kept."""
    with pytest.raises(RuntimeError), logs.MetricsLog(offline, enabled=True, loggers=["jsonl", "wandb", "mlflow"]) as log:
        log.write("train", 1, {"loss": 2.5})
        raise RuntimeError("a rank failed")
    assert [r["exit"]["exit_code"] for r in wandb_records(offline) if r["type"] == "exit"] == [1]
    from mlflow import MlflowClient

    client = MlflowClient()
    (found,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert found.info.status == "FAILED" and found.data.metrics == {"train/loss": 2.5}
    assert client.list_artifacts(found.info.run_id) == []


class Broken:
    """A sink that fails at its second row (synchronously, or in its own thread when queued)."""

    output, queued, rows = "", False, 0

    def start(self, run_dir, config, resume=False):
        pass

    def write(self, kind, step, metrics):
        if kind == "train" and step == 2:
            raise ConnectionError("the service went away")

    def samples(self, step, rows):
        pass

    def close(self):
        pass

    def end(self, files, failed):
        pass


class BrokenQueued(Broken):
    queued = True


class Hanging(Broken):
    """A tracker whose service never answers: every call blocks."""

    queued = True

    def write(self, kind, step, metrics):
        threading.Event().wait()


@pytest.mark.parametrize("sink", [Broken, BrokenQueued])
def test_a_logger_that_fails_mid_run_is_warned_once_and_training_finishes(sink, tmp_path, monkeypatch, capfd):
    monkeypatch.setitem(logs.SINKS, "broken", sink)
    summary = train_here([*TINY, "train.loggers=[jsonl,broken]", "train.eval_every=0", "data.eval_size=0", "data.eval=null"],
                         tmp_path)
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning: train.loggers")]
    assert warnings == ["warning: train.loggers: broken failed in write at step 2 (ConnectionError: the service went away); "
                        "it is left out for the rest of the run, which goes on (metrics.jsonl has every row)"]
    assert [r["step"] for r in read_metrics(tmp_path) if r["kind"] == "train"] == [1, 2, 3, 4]
    assert "after" in summary


def test_a_tracker_that_hangs_never_holds_a_step(tmp_path, monkeypatch, capfd):
    """Its calls wait in its own thread; at the end the run waits END_TIMEOUT_S for it, then ends without it."""
    monkeypatch.setitem(logs.SINKS, "hanging", Hanging)
    monkeypatch.setattr(logs.MetricsLog, "END_TIMEOUT_S", 1.0)
    tic = time.perf_counter()
    train_here([*TINY, "train.loggers=[jsonl,hanging]", "train.eval_every=0", "data.eval_size=0", "data.eval=null"], tmp_path)
    assert time.perf_counter() - tic < 60
    assert [r["step"] for r in read_metrics(tmp_path) if r["kind"] == "train"] == [1, 2, 3, 4]
    assert "warning: train.loggers: hanging had not sent everything after 1 s; the run ends without waiting for it " \
           "(metrics.jsonl has every row)" in capfd.readouterr().err


def test_rows_that_waited_go_out_together_in_order(tmp_path, monkeypatch):
    """A queued sink with `write_rows` (MLflow's: one request per batch) gets the rows that piled up behind a slow call
    in one call, and the calls after them in order."""
    release, calls = threading.Event(), []

    class Batching(Broken):
        queued = True

        def start(self, run_dir, config, resume=False):
            release.wait(30)  # a slow start: the rows wait in the queue

        def write_rows(self, rows):
            calls.append(("write_rows", [step for _, step, _ in rows]))

        def samples(self, step, rows):
            calls.append(("samples", step))

    monkeypatch.setitem(logs.SINKS, "batching", Batching)
    log = logs.MetricsLog(tmp_path, enabled=True, loggers=["jsonl", "batching"])
    for step in (1, 2, 3):
        log.write("train", step, {"loss": 1.0})
    log.samples(3, [])
    log.write("train", 4, {"loss": 1.0})
    release.set()
    log.close()
    log.end()
    assert calls == [("write_rows", [1, 2, 3]), ("samples", 3), ("write_rows", [4])]
    release.clear()
    queued = logs.Queued("batching", Batching())  # rows right before the end of the queue: sent, and the thread ends
    queued.start(tmp_path, None)
    queued.write("train", 5, {"loss": 1.0})
    queued.write("train", 6, {"loss": 1.0})
    threading.Timer(0.2, release.set).start()
    queued.join(10)
    assert not queued.thread.is_alive() and calls[-1] == ("write_rows", [5, 6])


class Answer(http.server.BaseHTTPRequestHandler):
    """A local stand-in for a tracker's server that refuses every credential."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(401)
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing_server():
    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_a_tracker_that_cannot_start_is_named_in_one_line(refusing_server, tmp_path, monkeypatch):
    env = {"HOME": str(tmp_path)}  # no ~/.netrc: no W&B key
    assert trackers.problems(["jsonl", "wandb"], {**env, "WANDB_MODE": "offline"}) == []
    assert trackers.problems(["wandb"], env) == [
        "train.loggers has wandb, but no W&B API key for https://api.wandb.ai: run `wandb login` or set WANDB_API_KEY, or log "
        "offline with WANDB_MODE=offline (then `wandb sync RUN_DIR/wandb/offline-run-*`); or take wandb out of train.loggers"]
    assert trackers.problems(["wandb"], {**env, "WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": refusing_server})[0].startswith(
        f"train.loggers has wandb, but {refusing_server} refused the W&B API key (HTTP 401): run `wandb login --relogin`")
    netrc = tmp_path / ".netrc"  # where `wandb login` keeps the key
    netrc.write_text(f"machine {refusing_server.removeprefix('http://')}\n  login user\n  password {'k' * 40}\n")
    netrc.chmod(0o600)
    assert "refused the W&B API key (HTTP 401)" in trackers.problems(["wandb"], {**env, "WANDB_BASE_URL": refusing_server})[0]
    assert trackers.problems(["mlflow"], {"MLFLOW_TRACKING_URI": "http://127.0.0.1:1"}) == [
        "train.loggers has mlflow, but cannot reach the MLflow server at MLFLOW_TRACKING_URI=http://127.0.0.1:1 (Connection "
        "refused): start it (mlflow server ...), or point MLFLOW_TRACKING_URI at a reachable server or a local sqlite:///PATH; "
        "or take mlflow out of train.loggers"]
    assert "refused the credentials (HTTP 401)" in trackers.problems(["mlflow"], {"MLFLOW_TRACKING_URI": refusing_server})[0]
    assert trackers.problems(["mlflow"], {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db"}) == []
    assert trackers.problems(["trackio"], {"TRACKIO_DIR": str(tmp_path / "t")}) == []
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    assert trackers.problems(["trackio"], {}) == [
        'train.loggers has trackio, but the trackio package is not installed: pip install -e ".[track]" (or pip install '
        'trackio); or take trackio out of train.loggers']


def test_the_launcher_refuses_an_unreachable_tracker_without_importing_it(tmp_path):
    """Before anything starts, in one line; and the check imports none of the trackers' packages."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": "http://127.0.0.1:1"}
    out = subprocess.run([sys.executable, "-m", "finetune.launch", "+recipe=quickstart_sft", "train.loggers=[jsonl,mlflow]",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert last_line(out.stderr) == (
        "error: train.loggers has mlflow, but cannot reach the MLflow server at MLFLOW_TRACKING_URI=http://127.0.0.1:1 "
        "(Connection refused): start it (mlflow server ...), or point MLFLOW_TRACKING_URI at a reachable server or a local "
        "sqlite:///PATH; or take mlflow out of train.loggers")
    assert not (tmp_path / "run" / "ranks").exists()
    shown = site_text()  # the site (Metrics and trackers) shows this command and this line
    assert "MLFLOW_TRACKING_URI=http://127.0.0.1:1 python -m finetune.launch +recipe=quickstart_sft train.loggers=[jsonl,mlflow]\n" \
        f"{last_line(out.stderr)}\n" in shown
    probe = ("import sys; from finetune.launcher import launch; from finetune.logs import trackers; trackers.problems(['wandb', 'mlflow', 'trackio'], "
             "{'WANDB_MODE': 'offline', 'MLFLOW_TRACKING_URI': 'sqlite:///m.db', 'TRACKIO_DIR': 't'}); "
             "print(sorted(m for m in ('wandb', 'mlflow', 'trackio') if m in sys.modules))")
    imported = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert imported.stdout.strip() == "[]", imported.stderr[-2000:]


def readme_command(marker: str) -> list[str]:
    """The site's launch command that contains `marker` (Metrics and trackers), as words after `python -m finetune.launch`."""
    import shlex

    from test_readme import fenced_commands

    (command,) = {c for page in site_pages() for _, c, _ in fenced_commands(page) if marker in c}
    return shlex.split(command)[3:]


@pytest.mark.slow
def test_readme_mlflow_command_and_a_sweep_grouped(offline, monkeypatch):
    """The site's MLflow command through the real CLI (2 ranks: the samples gathered from both, in eval-set order), with
    fewer steps; then a 2-trial sweep: both trials nested under one MLflow parent run and in one W&B group."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")  # the site: export MLFLOW_TRACKING_URI=sqlite:///mlflow.db
    short = ["train.max_steps=4", "optim.warmup_steps=1", "train.eval_every=2", "train.exact_match_samples=0", "data.eval_size=16"]
    out = run_cli(*readme_command("train.loggers=[mlflow]"), *short, f"hydra.run.dir={offline / 'run'}", cwd=offline)
    assert out.returncode == 0, out.stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name("finetune").experiment_id
    (found,) = client.search_runs([experiment])
    rows = read_metrics(offline / "run")
    samples = [r for r in rows if r["kind"] == logs.SAMPLE]
    _, _, _, evals = reload_and_evaluate(offline / "run" / "final", offline / "run")
    assert [(r["index"], r["reference"]) for r in samples if r["step"] == 4] == [(i, e.reference) for i, e in enumerate(evals[:4])]
    loss = [(m.step, m.value) for m in sorted(client.get_metric_history(found.info.run_id, "train/loss"), key=lambda m: m.step)]
    assert_series(loss, [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"])

    sweep = offline / "sweep"
    out = run_cli(*readme_command("-m +recipe=quickstart_sft train.loggers=[jsonl,mlflow,wandb]"), *short,
                  "parallelism=single", "launcher.nproc_per_node=1",  # one process a trial: the grouping is what is tested
                  f"hydra.sweep.dir={sweep}", cwd=offline)
    assert out.returncode == 0, out.stderr[-3000:]
    trials = client.search_runs([experiment], f"tags.`finetune.group` = '{sweep}'")
    (parent,) = client.search_runs([experiment], f"tags.`finetune.sweep` = '{sweep}'")
    assert len(trials) == 2 and {t.data.tags["mlflow.parentRunId"] for t in trials} == {parent.info.run_id}
    assert sorted(t.data.params["optim.lr"] for t in trials) == ["0.001", "0.002"]
    groups = [[r["run"]["run_group"] for r in wandb_records(sweep / n) if r["type"] == "run"] for n in ("0", "1")]
    assert groups == [[str(sweep)], [str(sweep)]]


def test_the_readme_names_every_tracker():
    text = site_text()
    for name in trackers.TRACKERS:
        assert f"train.loggers=[jsonl,{name}]" in text, name


@pytest.mark.parametrize("overrides,error", [
    (["train.sample_prompts=4", "train.exact_match_samples=0", "data.eval_size=0", "data.eval=null"],
     "train.sample_prompts needs an eval set: set data.eval or data.eval_size"),
    (["train.sample_prompts=4", "parallelism=pp2", "launcher.nproc_per_node=2"],
     "train.sample_prompts=4 with parallelism.pp=2: pipeline stages cannot generate while training (exact match is measured "
     "on final/ after it); set train.sample_prompts=0"),
])
def test_samples_need_an_eval_set_and_a_rank_that_generates(compose, overrides, error):
    from finetune.config import ConfigError

    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", *overrides])
    assert str(e.value) == error


def test_benchmarks_after_the_run_go_to_its_own_tracker_runs(offline):
    """finetune.evaluate after training (logs.MetricsLog(resume=True)): W&B resumes the run's id, MLflow logs into the
    run of that run directory, trackio into the run of that name; none starts another run."""
    from finetune.rank import evaluate, finished

    run_dir = offline / "run"
    train_here([*TINY, "train.loggers=[jsonl,wandb,mlflow,trackio]"], run_dir)
    first_id = trackers.wandb_run_id(run_dir)
    results = {"results": {"quickstart_choice": {"alias": "quickstart_choice", "acc,none": 0.75, "acc_stderr,none": 0.1}},
               "higher_is_better": {"quickstart_choice": {"acc": True}}}
    assert evaluate.record(finished.locate(str(run_dir)), results, 0.5) == {"quickstart_choice/acc": 0.75}
    assert read_metrics(run_dir)[-1] == {"kind": "benchmark", "step": 4, "quickstart_choice/acc": 0.75}

    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert {r.name.rsplit("-", 1)[-1] for r in runs} == {first_id}  # W&B: the same run id (`wandb sync` appends)
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(runs[-1])], capture_output=True, text=True, timeout=120)
    history = wandb_history([json.loads(line) for line in out.stdout.splitlines() if line.strip()])
    assert history["benchmark/quickstart_choice/acc"] == [(4, 0.75)]

    from mlflow import MlflowClient

    client = MlflowClient()
    (found,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    assert found.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "benchmark/quickstart_choice/acc")] == [(4, 0.75)]
    assert len(client.get_metric_history(found.info.run_id, "train/loss")) == 4

    from trackio import SQLiteStorage

    name = trackers.name_of(run_dir)  # trackio reads TRACKIO_DIR once: earlier tests' runs may share its database
    assert SQLiteStorage.get_runs("finetune").count(name) == 1
    logged = SQLiteStorage.get_logs("finetune", name)
    assert [(r["step"], r["benchmark/quickstart_choice/acc"]) for r in logged if "benchmark/quickstart_choice/acc" in r] == [(4, 0.75)]
    assert len([r for r in logged if "train/loss" in r]) == 4
