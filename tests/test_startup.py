"""Where the start-up goes (finetune.startup): the process's start from /proc, the phases, the line."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from finetune import startup


@pytest.fixture(autouse=True)
def no_marks():
    startup.MARKS.clear()
    yield
    startup.MARKS.clear()


def test_a_process_start_is_read_from_proc_to_within_the_clock_tick():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        began = startup.process_start(child.pid)
    finally:
        child.kill()
        child.wait()
    assert began is not None and before - 0.02 <= began <= time.time() + 0.02
    assert startup.process_start(10**9) is None  # no such process


def test_the_breakdown_runs_from_the_launch_through_each_phase_to_the_first_step(monkeypatch):
    began = 1000.0
    monkeypatch.setattr(startup, "process_start", lambda pid="self": began)
    for name, at in (("config", 1002.5), ("start", 1002.6), ("tokenizer", 1003.0), ("data", 1003.5), ("model", 1005.0),
                     ("peft", 1006.0), ("model", 1006.25), ("eval", 1007.0), ("first step", 1007.5)):
        startup.MARKS.append((name, at))
    parts = startup.breakdown(now=1008.0, env="998.75,999.5")
    assert parts == {"launcher": 1.25, "imports": 2.5, "config": 0.1, "distributed": 0.4, "tokenizer": 0.5, "data": 1.5,
                     "model": 1.75, "peft": 0.25, "eval": 0.5, "first step": 0.5}
    assert sum(parts.values()) == pytest.approx(1008.0 - 998.75)
    assert startup.line(parts) == ("start-up: 9.2 s to the end of the first step: launcher 1.2, imports 2.5, config 0.1, "
                                   "distributed 0.4, tokenizer 0.5, data 1.5, model 1.8, peft 0.2, eval 0.5, first step 0.5")


def test_a_launch_on_another_clock_or_none_has_no_launcher_share(monkeypatch):
    monkeypatch.setattr(startup, "process_start", lambda pid="self": 1000.0)
    startup.MARKS.append(("config", 1001.0))
    assert startup.breakdown(now=1002.0, env="1005.0,1005.5") == {"imports": 1.0, "config": 1.0}  # began 5 s "before" the launch
    assert startup.breakdown(now=1002.0, env="") == {"imports": 1.0, "config": 1.0}  # started by hand, not by finetune.launch
    assert "config 1.0" in startup.line({"config": 1.0, "eval": 0.01}) and "eval" not in startup.line({"config": 1.0, "eval": 0.01})


def test_the_first_step_reports_once_and_only_where_phases_were_marked():
    assert startup.first_step_done() is None  # the loop run in-process by a test: nothing marked, nothing said
    startup.mark("config")
    parts = startup.first_step_done()
    assert parts is not None and "config" in parts
    assert startup.first_step_done() is None and startup.MARKS == []


def test_the_launcher_passes_when_the_trial_began_and_when_it_spawned():
    import finetune

    startup.LAUNCH["trial"] = None
    trial, spawn = map(float, startup.launch_times().split(","))
    assert trial == pytest.approx(finetune.IMPORTED, abs=0.001) and trial <= spawn <= time.time() + 0.001
    startup.trial_begins()  # a sweep's next trial, in the same launcher process
    try:
        trial, spawn = map(float, startup.launch_times().split(","))
        assert trial == pytest.approx(time.time(), abs=1.0) and trial <= spawn
    finally:
        startup.LAUNCH["trial"] = None


def test_the_time_after_training_is_timed_and_the_launcher_adds_the_shutdown(tmp_path, monkeypatch):
    parts = {"eval": 1.25}
    with startup.timed(parts, "export"):
        time.sleep(0.06)
    with startup.timed(None, "plot"):  # not timed
        pass
    assert list(parts) == ["eval", "export"] and 0.06 <= parts["export"] < 1.0
    parts |= {"logs": 0.01, "plot": 0.5}
    assert startup.after_line(parts).startswith(f"after training: {sum(parts.values()):.1f} s: eval 1.2, export 0.1, plot 0.5")
    summary = tmp_path / "summary.json"
    assert startup.shutdown(summary) is None  # a failed run: no summary
    summary.write_text(json.dumps({"after": {}, "after_training": parts}))
    written = summary.stat().st_mtime
    monkeypatch.setattr(startup.time, "time", lambda: written + 0.75)
    assert startup.shutdown(summary) == ("shutdown: 0.8 s from the summary to the job's end (the rank's exit, the "
                                         "launcher's wait)")
    assert json.loads(summary.read_text())["after_training"] == {**parts, "shutdown": 0.75}


def test_a_launcher_execd_by_a_shell_counts_from_its_own_python_start():
    """scripts/quickstart.sh installs, then `exec`s the launcher: the process (and /proc's start time) is the shell's, so
    its install was reported as the launcher's share of the start-up (414.9 s, of which 392.1 the install)."""
    code = "import finetune.startup as s, time; print(s.launch_times(), s.process_start(), time.time())"
    before = time.time()
    out = subprocess.run(["bash", "-c", f"sleep 1.5; exec {sys.executable} -c '{code}'"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    times, shell_start, now = out.stdout.split()
    trial, spawn = map(float, times.split(","))
    assert float(shell_start) < before + 0.5  # /proc: the shell's start, before its sleep
    # the launcher's share starts with its Python; FINETUNE_LAUNCH_TIMES carries milliseconds, so each may round up by 0.5 ms
    assert before + 1.5 <= trial <= spawn <= float(now) + 0.0005
