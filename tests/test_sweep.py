"""Sweeps: the summary of a sweep directory (synthetic trials), and real sweeps through the CLI."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune.launcher import sweep
from finetune.config import ASSETS

from conftest import REPO, run_cli

PNG = b"\x89PNG\r\n\x1a\n"


def make_trial(sweep_dir: Path, n: int | str, overrides: list[str], *, train: list[tuple[int, float, float]] = (),
               evals: list[tuple[int, float]] = (), memory: dict | None = None, summary: dict | None = None) -> Path:
    """A trial directory as a sweep leaves it: .hydra/overrides.yaml, metrics.jsonl, summary.json.
    `train`: (step, loss, tokens/s) rows."""
    trial = sweep_dir / str(n)
    (trial / ".hydra").mkdir(parents=True)
    (trial / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    rows = [{"kind": "eval", "step": s, "eval_loss": v} for s, v in evals if s == 0]
    rows += [{"kind": "train", "step": s, "loss": loss, "lr": 1e-3, "tokens_per_s": tps} for s, loss, tps in train]
    rows += [{"kind": "memory", "step": 2, **memory}] if memory is not None else []
    rows += [{"kind": "eval", "step": s, "eval_loss": v} for s, v in evals if s > 0]
    if rows:
        (trial / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (trial / "summary.json").write_text(json.dumps(summary))
    return trial


def small_sweep(tmp_path: Path) -> Path:
    """Three trials: one finished, one failed (by a rank's reason), one still running."""
    d = tmp_path / "sweep"
    common = ["+recipe=quickstart_sft", "train.max_steps=5"]
    make_trial(d, 0, [*common, "optim.lr=0.001", "checkpointing=none"],
               train=[(1, 4.5, 100.0), (2, 4.0, 200.0), (3, 3.5, 1000.0), (4, 3.0, 1200.0), (5, 2.5, 1100.0)],
               evals=[(0, 4.75), (5, 2.25)], memory={"mem_peak_total_mib": 12.25},
               summary={"before": {"eval_loss": 4.75}, "after": {"eval_loss": 2.25}, "memory": {"mem_peak_total_mib": 12.25}})
    failed = make_trial(d, 1, [*common, "optim.lr=0.003", "checkpointing=none"], train=[(1, 4.5, 300.0), (2, 5.5, 500.0)])
    sweep.record_failure(failed, 2, "data.train: bad | row")
    make_trial(d, 2, [*common, "optim.lr=0.001", "checkpointing=full"], train=[(1, 4.5, 90.0)],
               memory={"mem_peak_total_mib": 9.5, "mem_cuda_max_allocated_mib": 30.5})
    return d


def test_summary_of_a_small_sweep_csv_and_markdown_exactly(tmp_path):
    d = small_sweep(tmp_path)
    trials = sweep.write(d)
    assert [t.status for t in trials] == ["ok", "failed", "running"]
    assert (d / "summary.csv").read_text() == (
        "trial,overrides,status,train_loss,eval_loss,tokens_per_s,peak_mib,exit_code,reason\n"
        "0,optim.lr=0.001 checkpointing=none,ok,2.5,2.25,1100.0,12.25,0,\n"
        "1,optim.lr=0.003 checkpointing=none,failed,5.5,,400.0,,2,data.train: bad | row\n"
        "2,optim.lr=0.001 checkpointing=full,running,4.5,,90.0,30.5,,\n"
    )
    assert (d / "summary.md").read_text() == (
        "| trial | overrides | status | train loss | eval loss | tokens/s | peak MiB | reason |\n"
        "|---:|---|---|---:|---:|---:|---:|---|\n"
        "| 0 | optim.lr=0.001 checkpointing=none | ok | 2.5000 | 2.2500 | 1,100 | 12.2 |  |\n"
        "| 1 | optim.lr=0.003 checkpointing=none | failed | 5.5000 |  | 400 |  | data.train: bad \\| row |\n"
        "| 2 | optim.lr=0.001 checkpointing=full | running | 4.5000 |  | 90 | 30.5 |  |\n"
    )
    png = (d / "loss_curves.png").read_bytes()
    assert png.startswith(PNG) and len(png) > 10_000
    assert not list(d.glob(".*.tmp"))  # written whole, then renamed
    assert sweep.best(trials).trial == "0"
    assert json.loads((d / "1" / sweep.STATUS).read_text()) == {"status": "failed", "exit_code": 2, "reason": "data.train: bad | row"}


def test_csv_reads_back_with_the_csv_module(tmp_path):
    d = small_sweep(tmp_path)
    sweep.write(d)
    rows = list(csv.DictReader((d / "summary.csv").open()))
    assert [r["status"] for r in rows] == ["ok", "failed", "running"]
    assert float(rows[0]["eval_loss"]) == 2.25 and rows[1]["reason"] == "data.train: bad | row"


def test_a_trial_that_starts_again_is_no_longer_failed(tmp_path):
    d = small_sweep(tmp_path)
    sweep.clear_status(d / "1")
    assert [t.status for t in sweep.collect(d)] == ["ok", "running", "running"]


def test_varying_overrides_label_the_trials_and_trials_sort_by_number(tmp_path):
    d = tmp_path / "sweep"
    for n, extra in ((10, ["zero=stage2"]), (2, ["zero=none"]), (1, ["zero=none", "+data.packing=true"])):
        make_trial(d, n, ["+recipe=quickstart_sft", "train.max_steps=3", *extra])
    (d / "not_a_trial").mkdir()
    trials = sweep.collect(d)
    assert [t.trial for t in trials] == ["1", "2", "10"]
    assert [t.varying for t in trials] == [["zero=none", "+data.packing=true"], ["zero=none"], ["zero=stage2"]]
    assert [t.status for t in trials] == ["running"] * 3
    assert trials[1].label == "zero=none"


def test_the_first_trial_is_labelled_by_what_the_sweep_varies(tmp_path):
    """While only trial 0 exists nothing differs yet: the sweep's own record says what it varies."""
    d = tmp_path / "sweep"
    make_trial(d, 0, ["+recipe=quickstart_sft", "optim.lr=0.001", "zero=none"])
    assert sweep.collect(d)[0].label == "trial 0"
    (d / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"mode": "MULTIRUN", "overrides": {
        "task": ["+recipe=quickstart_sft", "optim.lr=1e-3,3e-3", "zero=none"]}, "sweeper": {"params": None}}}))
    assert sweep.collect(d)[0].label == "optim.lr=0.001"


def test_a_search_space_labels_the_trials_too(tmp_path):
    """Optuna's sweeper writes no multirun.yaml; its search space is in each trial's .hydra/hydra.yaml."""
    d = tmp_path / "sweep"
    for n in (0, 1):
        trial = make_trial(d, n, ["optim.lr=0.002", f"peft.r={4 * (n + 1)}", "train.micro_batch_size=8", "+recipe=optuna_quickstart"])
        (trial / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"mode": "MULTIRUN", "sweeper": {"params": {
            "optim.lr": "tag(log, interval(1e-4, 1e-2))", "peft.r": "choice(4, 8, 16)", "train.micro_batch_size": "choice(4, 8, 16)"}}}}))
    assert [t.label for t in sweep.collect(d)] == ["optim.lr=0.002 peft.r=4 train.micro_batch_size=8",
                                                  "optim.lr=0.002 peft.r=8 train.micro_batch_size=8"]


def test_a_metrics_line_cut_short_is_skipped(tmp_path):
    d = tmp_path / "sweep"
    trial = make_trial(d, 0, ["optim.lr=0.001"], train=[(1, 4.0, 10.0), (2, 3.0, 20.0)])
    with (trial / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 3, "lo')
    (row,) = sweep.collect(d)
    assert row.train_loss == 3.0 and row.tokens_per_s == 15.0 and row.status == "running"


def test_rebuild_script_prints_the_table(tmp_path):
    d = small_sweep(tmp_path)
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "sweep_summary.py"), str(d)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    table = (d / "summary.md").read_text()
    assert out.stdout.startswith(table)
    assert f"best         trial 0: eval_loss 2.2500  optim.lr=0.001 checkpointing=none\nsummary      {d / 'summary.md'}" in out.stdout
    assert (d / "summary.csv").is_file() and (d / "loss_curves.png").is_file()
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "sweep_summary.py"), str(tmp_path / "nowhere")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1


def test_sweep_module_imports_no_torch():
    code = "import sys, finetune.launcher.sweep, finetune.launch; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# ---------------------------------------------------------------------------------------------
# Real sweeps through the CLI: one CPU rank, 3 steps, 64 training rows.


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("data")
    for split, rows in (("train", 64), ("eval", 16)):
        lines = (ASSETS / "data" / "quickstart" / f"{split}.jsonl").read_text().splitlines()[:rows]
        (d / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return ["data=jsonl", f"data.train={d / 'train.jsonl'}", f"data.eval={d / 'eval.jsonl'}"]


TINY = ["train.max_steps=3", "optim.warmup_steps=1", "train.exact_match_samples=0", "train.eval_every=0", "train.progress_bar=false",
        "train.tensorboard=false", "launcher.nproc_per_node=1", "parallelism=single", "train.global_batch_size=16"]


def read_csv(sweep_dir: Path) -> list[dict]:
    return list(csv.DictReader((sweep_dir / "summary.csv").open()))


@pytest.mark.slow
def test_sweep_over_memory_strategies_summarises_every_trial(tmp_path, small_data):
    """2 x 2: micro batch (16, or 4 with 4 accumulation steps) x activation checkpointing, one launch each. (What a trial
    launches follows its own config, as any launch's does: a sweep over ZeRO stages launches DeepSpeed's runner for
    the ZeRO trials, tests/test_launcher.py.)"""
    d = tmp_path / "sweep"
    out = run_cli("-m", "+recipe=quickstart_sft", "train.micro_batch_size=16,4", "checkpointing=none,full", *TINY, *small_data,
                  "data.max_length=64", f"hydra.sweep.dir={d}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(p.name for p in d.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    rows = read_csv(d)
    assert [r["overrides"] for r in rows] == [
        "train.micro_batch_size=16 checkpointing=none", "train.micro_batch_size=16 checkpointing=full",
        "train.micro_batch_size=4 checkpointing=none", "train.micro_batch_size=4 checkpointing=full"]
    assert [r["status"] for r in rows] == ["ok"] * 4
    for r in rows:
        assert r["exit_code"] == "0" and r["reason"] == ""
        assert float(r["eval_loss"]) == pytest.approx(json.loads((d / r["trial"] / "summary.json").read_text())["after"]["eval_loss"])
        assert float(r["tokens_per_s"]) > 0 and float(r["peak_mib"]) > 0
    # the same math whatever the memory strategy; full checkpointing, and a smaller micro batch, keep fewer activations
    assert [float(r["train_loss"]) for r in rows] == pytest.approx([float(rows[0]["train_loss"])] * 4, rel=1e-4)
    assert float(rows[1]["peak_mib"]) < float(rows[0]["peak_mib"]) and float(rows[2]["peak_mib"]) < float(rows[0]["peak_mib"])
    table = (d / "summary.md").read_text()
    assert table.count("| ok |") == 4 and table in out.stdout
    assert "best         trial " in out.stdout
    assert (d / "loss_curves.png").read_bytes().startswith(PNG)
    rebuilt = subprocess.run([sys.executable, str(REPO / "scripts" / "sweep_summary.py"), str(d)], capture_output=True, text=True, timeout=60)
    assert rebuilt.returncode == 0 and rebuilt.stdout.startswith(table) and (d / "summary.md").read_text() == table


def test_a_swept_value_that_no_trial_accepts_is_refused_before_any_trial(tmp_path):
    d = tmp_path / "sweep"
    out = run_cli("-m", "+recipe=quickstart_sft", "train.max_steps=3,0", "optim=adamw,adamm", f"hydra.sweep.dir={d}", cwd=tmp_path, timeout=60)
    assert (out.returncode, out.stderr.strip()) == (2, "error: train.max_steps=0 must be at least 1")
    assert not d.exists()
    out = run_cli("-m", "+recipe=quickstart_sft", "optim=adamw,adamm", f"hydra.sweep.dir={d}", cwd=tmp_path, timeout=60)
    assert (out.returncode, out.stderr.strip()) == (2, "error: unknown optim option 'adamm' (did you mean 'adam'?); available: adafactor, adam, adamw, adamw_8bit, momentum, muon, sgd")
    assert not d.exists()


@pytest.mark.slow
def test_failed_trials_are_recorded_and_the_sweep_goes_on(tmp_path, small_data):
    """warmup_steps=5 with max_steps=3 breaks a rule across fields (refused by the trial's validation);
    max_length=8 leaves the prompts no room, which a rank finds (data.long_prompt=error): both are
    recorded with their reason, the other trial trains, the exit code is 1."""
    d = tmp_path / "sweep"
    tiny = [o for o in TINY if not o.startswith("optim.warmup_steps=")]
    out = run_cli("-m", "+recipe=quickstart_sft", "optim.warmup_steps=0,5", "data.max_length=64,8",
                  "data.long_prompt=error", *tiny, *small_data, f"hydra.sweep.dir={d}", cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_csv(d)
    assert [(r["overrides"], r["status"], r["exit_code"]) for r in rows] == [
        ("optim.warmup_steps=0 data.max_length=64", "ok", "0"),
        ("optim.warmup_steps=0 data.max_length=8", "failed", "2"),  # the rank's own code for a mistake it found (one process: no torchrun between)
        ("optim.warmup_steps=5 data.max_length=64", "failed", "2"),
        ("optim.warmup_steps=5 data.max_length=8", "failed", "2"),
    ]
    assert math.isfinite(float(rows[0]["eval_loss"]))
    assert "the prompt is" in rows[1]["reason"] and "leaves no room for the response" in rows[1]["reason"]
    refused = "optim.warmup_steps=5 must be below train.max_steps=3"
    assert rows[2]["reason"] == rows[3]["reason"] == refused
    assert json.loads((d / "2" / "status.json").read_text()) == {"status": "failed", "exit_code": 2, "reason": refused}
    assert f"error: trial 2: {refused}" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: 3 of 4 trials failed (trial 1, 2, 3)")
    table = (d / "summary.md").read_text()
    assert table.count("| failed |") == 3 and table in out.stdout
    rebuilt = subprocess.run([sys.executable, str(REPO / "scripts" / "sweep_summary.py"), str(d)], capture_output=True, text=True, timeout=60)
    assert rebuilt.returncode == 0 and rebuilt.stdout.startswith(table) and (d / "summary.md").read_text() == table


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
                    reason="hydra-optuna-sweeper is not installed (pip install -e '.[sweep]')")
def test_optuna_recipe_searches_and_gets_the_eval_loss(tmp_path, small_data):
    d = tmp_path / "sweep"
    out = run_cli("-m", "+recipe=optuna_quickstart", "hydra.sweeper.n_trials=2", *TINY, *small_data, "data.max_length=64",
                  f"hydra.sweep.dir={d}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_csv(d)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert all(r["overrides"].split()[0].startswith("optim.lr=") and "peft.r=" in r["overrides"] for r in rows)
    results = yaml.safe_load((d / "optimization_results.yaml").read_text())
    assert results["best_value"] == pytest.approx(min(float(r["eval_loss"]) for r in rows))  # what Optuna saw: our eval loss
    assert set(results["best_params"]) == {"optim.lr", "peft.r", "train.micro_batch_size"}
    assert "name: lora" in (d / "0" / "config.yaml").read_text()


@pytest.mark.slow
def test_ctrl_c_ends_the_sweep_and_records_the_trial_as_interrupted(tmp_path, small_data):
    """Ctrl-C (SIGINT to the whole foreground process group) during trial 0 of 2: the trial saves, is
    recorded as interrupted, trial 1 never starts, and the sweep exits non-zero."""
    import os
    import signal
    import time

    d = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "finetune.launch", "-m", "+recipe=quickstart_sft", "optim.lr=1e-3,2e-3", *TINY[1:],
                             "train.max_steps=2000", "train.log_every=1000", *small_data, "data.max_length=64",
                             f"hydra.sweep.dir={d}"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 240
    while time.time() < deadline and not ((d / "0/metrics.jsonl").is_file() and '"kind": "train"' in (d / "0/metrics.jsonl").read_text()):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: launcher, torchrun and ranks at once
    out, err = proc.communicate(timeout=180)
    assert proc.returncode != 0, out[-2000:] + err[-2000:]
    assert sorted(p.name for p in d.iterdir() if p.is_dir()) == ["0"]  # trial 1 never started
    status = json.loads((d / "0" / "status.json").read_text())
    step = int(status["reason"].split("after step ")[1].split(":")[0])
    checkpoint = d / "0" / "checkpoints" / f"step_{step}"
    assert status == {"status": "failed", "exit_code": proc.returncode,
                      "reason": f"interrupted by SIGINT: stopped by SIGINT after step {step}: resumable checkpoint {checkpoint}; "
                                "continue with train.resume=auto"}
    assert (checkpoint / "meta.json").is_file() and (d / "0/checkpoints/latest").read_text() == f"step_{step}\n"
    assert [(r["trial"], r["status"], r["exit_code"], r["reason"]) for r in read_csv(d)] == [
        ("0", "failed", str(proc.returncode), status["reason"])]
    assert f"error: trial 0: {status['reason']} (to go on, run the sweep again with train.resume=auto hydra.sweep.dir={d}: " \
           "each trial continues from its own checkpoints)" in err.splitlines()
    # as the line says: trial 0 continues from its checkpoint, trial 1 starts; a path spelled otherwise is the same file
    respelled = [a.replace("/train.jsonl", "//train.jsonl") for a in small_data]
    again = run_cli("-m", "+recipe=quickstart_sft", "optim.lr=1e-3,2e-3", *TINY[1:], f"train.max_steps={step + 1}", *respelled,
                    "data.max_length=64", f"hydra.sweep.dir={d}", "train.resume=auto", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {checkpoint} at step {step}" in again.stdout
    assert [r["status"] for r in read_csv(d)] == ["ok", "ok"]
    assert [m["step"] for m in map(json.loads, (d / "0/metrics.jsonl").read_text().splitlines()) if m["kind"] == "train"][-1] == step + 1


def spans(sweep_dir: Path) -> list[tuple[float, float]]:
    """Each trained trial's (start, end): when its launch wrote config.yaml, when training wrote summary.json."""
    return [((d / "config.yaml").stat().st_mtime, (d / "summary.json").stat().st_mtime) for d in sweep.trial_dirs(sweep_dir)
            if (d / "summary.json").is_file()]


def cores_taken(sweep_dir: Path) -> list[list[int]]:
    """The CPU cores each trained trial's rank could run on, as the rank found them (RUN_DIR/ranks/0.json)."""
    return [json.loads((d / "ranks" / "0.json").read_text())["cpus"] for d in sweep.trial_dirs(sweep_dir)
            if (d / "summary.json").is_file()]


@pytest.mark.slow
@pytest.mark.cores(2)
@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is None,
                    reason="hydra-joblib-launcher is not installed (pip install -e '.[sweep]')")
def test_trials_side_by_side_each_on_its_own_core_give_the_summary_of_one_after_another(tmp_path, small_data, monkeypatch):
    """hydra/launcher=joblib with two workers and launcher.devices_per_trial=1: three one-rank trials, two at a time, each on
    a core no other trial holds; the summary is the one the same trials give one after another (Hydra's basic launcher),
    loss for loss, and the launching process says it. The time each way: scripts/benchmark_sweep.py."""
    monkeypatch.setenv("FINETUNE_DEVICE_LOCKS", str(tmp_path / "locks"))
    trials = ["optim.lr=1e-3,2e-3,3e-3", "launcher.devices_per_trial=1", *TINY, *small_data, "data.max_length=64"]
    side = run_cli("-m", "+recipe=quickstart_sft", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *trials,
                   f"hydra.sweep.dir={tmp_path / 'side'}", cwd=tmp_path)
    assert side.returncode == 0, side.stdout[-3000:] + side.stderr[-3000:]
    one = run_cli("-m", "+recipe=quickstart_sft", *trials, f"hydra.sweep.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    rows, reference = read_csv(tmp_path / "side"), read_csv(tmp_path / "one")
    assert [r["status"] for r in rows] == ["ok"] * 3
    same = ("trial", "overrides", "status", "train_loss", "eval_loss", "exit_code", "reason")
    assert [{k: r[k] for k in same} for r in rows] == [{k: r[k] for k in same} for r in reference]
    assert (tmp_path / "side" / "summary.md").read_text() in side.stdout and "best         trial 2" in side.stdout
    (start0, end0), (start1, end1), *_ = spans(tmp_path / "side")
    assert start1 < end0 and start0 < end1  # trials 0 and 1 ran at the same time
    taken = cores_taken(tmp_path / "side")
    assert sorted(taken[:2]) == [[0], [1]] and all(t in ([0], [1]) for t in taken)
    assert cores_taken(tmp_path / "one") == [[0]] * 3  # one after another: the first core is free for each
    one_spans = spans(tmp_path / "one")
    assert all(end <= later_start for (_, end), (later_start, _) in zip(one_spans, one_spans[1:]))  # one after another


@pytest.mark.slow
@pytest.mark.cores(2)
@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                    reason="hydra-submitit-launcher is not installed (pip install -e '.[sweep]')")
def test_submitit_local_runs_trials_as_processes_of_their_own_and_records_a_failure(tmp_path, small_data, monkeypatch):
    """hydra/launcher=submitit_local: a process per trial, both at once on a core each; a trial that fails (a rule its
    overrides break) is recorded as in any sweep, and the launching process ends with the count and exit code 1."""
    monkeypatch.setenv("FINETUNE_DEVICE_LOCKS", str(tmp_path / "locks"))
    d = tmp_path / "sweep"
    tiny = [o for o in TINY if not o.startswith("optim.warmup_steps=")]
    out = run_cli("-m", "+recipe=quickstart_sft", "hydra/launcher=submitit_local", "optim.warmup_steps=1,5", "optim.lr=1e-3,2e-3",
                  "launcher.devices_per_trial=1", *tiny, *small_data, "data.max_length=64", f"hydra.sweep.dir={d}", cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_csv(d)
    refused = "optim.warmup_steps=5 must be below train.max_steps=3"
    assert [(r["overrides"], r["status"], r["reason"]) for r in rows] == [
        ("optim.warmup_steps=1 optim.lr=0.001", "ok", ""), ("optim.warmup_steps=1 optim.lr=0.002", "ok", ""),
        ("optim.warmup_steps=5 optim.lr=0.001", "failed", refused), ("optim.warmup_steps=5 optim.lr=0.002", "failed", refused)]
    assert out.stderr.strip().splitlines()[-1] == f"error: 2 of 4 trials failed (trial 2, 3); reasons in {d / 'summary.md'}"
    (start0, end0), (start1, end1) = spans(d)
    assert start1 < end0 and start0 < end1
    assert sorted(cores_taken(d)) == [[0], [1]]
