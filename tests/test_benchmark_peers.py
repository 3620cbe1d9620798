"""scripts/benchmark_peers.py (and scripts/peers_rl.py, its GRPO and DPO races): their numbers and fairness verdicts
on made-up results (fast), and the real script on a few steps of a very small model (slow)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import benchmark_peers as bp  # noqa: E402
import peers_rl as rl  # noqa: E402


def steps(tokens: list[int], seconds: list[float], losses: list[float]) -> list[dict]:
    """Step lines as every framework's are read: elapsed_s at each step's end, its tokens and loss."""
    ends = [sum(seconds[: i + 1]) for i in range(len(seconds))]
    return [{"step": i + 1, "elapsed_s": e, "tokens": t, "loss": x} for i, (t, e, x) in enumerate(zip(tokens, ends, losses))]


def result(framework: str, mode: str, repeat: int, seconds: list[float], tokens: list[int], losses: list[float],
           others: float | None = 0.01) -> dict:
    return {"framework": framework, "mode": mode, "repeat": repeat, "wall_s": 20.0 + repeat, "first_step_s": 5.0 - repeat,
            "rss_mib": 500.0 + repeat, "others": others, "steps": steps(tokens, seconds, losses)}


TOKENS = [1000, 1200, 800, 1000, 1100, 900]
LOSSES = [4.0, 3.5, 3.2, 3.0, 2.9, 2.8]


def test_steady_state_is_the_median_after_the_first_three_steps():
    # step times 5, 1, 1 (warm-up), then 0.5, 0.25, 0.5 s: tokens/s 2000, 4400, 1800 -> median 2000; step ms 500
    tokens_per_s, step_ms = bp.steady(steps(TOKENS, [5, 1, 1, 0.5, 0.25, 0.5], LOSSES))
    assert tokens_per_s == pytest.approx(2000) and step_ms == pytest.approx(500)
    assert bp.steady(steps([100, 300], [1, 1], [1, 1])) == (pytest.approx(200), pytest.approx(1000))  # too few: all


def test_table_shows_each_repeat_then_the_best_of_them_and_the_ratio_to_hf():
    runs = [result("ours", "padded", 1, [2, 1, 1, 0.5, 0.5, 0.5], TOKENS, LOSSES),
            result("hf", "padded", 1, [2, 1, 1, 1, 1, 1], TOKENS, LOSSES, others=None),
            result("hf", "padded", 2, [2, 1, 1, 2, 2, 2], TOKENS, LOSSES, others=1.2),  # a busy machine: half as fast
            result("ours", "padded", 2, [2, 1, 1, 0.4, 0.4, 0.4], TOKENS, LOSSES),
            {"framework": "trl", "mode": "packed", "repeat": 1, "error": "exit 1, 0 of 6 steps: boom"}]
    lines = bp.table(runs).splitlines()
    assert lines[0] == ("| framework | mode | tokens/s (each repeat) | others' load | step ms | first step s | wall s | peak RSS MiB "
                        "| final loss | vs HF Trainer |")
    # ours: 2,000 tokens/s (the median of 2000, 2200, 1800) and 2,500; HF 1,000 and 500. The best of each: 2,500 / 1,000;
    # step ms, first step and wall the least, RSS the most
    assert lines[2] == "| ours (finetune) | padded | 2,000 / 2,500 | 0.01 / 0.01 | 400 | 3.0 | 21.0 | 502 | 2.8000 | 2.50x |"
    assert lines[3] == "| transformers Trainer | padded | 1,000 / 500 | - / 1.20 | 1,000 | 3.0 | 21.0 | 502 | 2.8000 | 1.00x |"
    assert lines[4].startswith("| TRL SFTTrainer | packed | failed: exit 1, 0 of 6 steps: boom |")
    assert len(lines) == 5


def test_fairness_passes_on_identical_batches_and_fails_beyond_one_percent():
    expected = {"padded": TOKENS}
    noise = [x + 2e-6 for x in LOSSES]
    runs = [result("ours", "padded", 1, [1] * 6, TOKENS, LOSSES), result("hf", "padded", 1, [1] * 6, TOKENS, noise)]
    rows = bp.fairness(runs, expected)
    assert [(r["framework"], r["tokens_diff"]) for r in rows] == [("ours", 0.0), ("hf", 0.0)]
    assert rows[0]["loss_diff"] == 0 and rows[1]["loss_diff"] == pytest.approx(2e-6)
    assert rows[1]["tokens_per_step"] == pytest.approx(1000)
    text, ok = bp.fairness_text(rows, loss_tol=1e-3)
    assert ok and "OK: non-pad tokens per step" in text and "0.000% (limit 1%)" in text and "2.0e-06 (limit 1e-03)" in text

    off = TOKENS[:2] + [TOKENS[2] * 1.02] + TOKENS[3:]  # one step 2% off: other batches
    runs.append(result("trl", "padded", 1, [1] * 6, off, LOSSES))
    text, ok = bp.fairness_text(bp.fairness(runs, expected), loss_tol=1e-3)
    assert not ok and "FAIL: non-pad tokens per step, largest relative difference of any run at any step from the prepared " \
                      "batches: 2.000% (limit 1%)" in text
    assert not bp.fairness_text(bp.fairness(runs[:2], expected), loss_tol=1e-6)[1]  # 2e-6 > 1e-6: loss FAIL


def test_a_failed_run_fails_the_report(tmp_path):
    args = argparse.Namespace(loss_tol=1e-3, precision="fp32", attn="sdpa", device="cpu", hidden=64, layers=1, rows=10, max_length=128, micro_batch=8,
                                                     accum=4, steps=6, threads=2, repeats=1)
    runs = [result("ours", "padded", 1, [1] * 6, TOKENS, LOSSES),
            {"framework": "hf", "mode": "padded", "repeat": 1, "error": "exit 1, 2 of 6 steps: killed"}]
    text, ok = bp.report(runs, {"padded": TOKENS}, args)
    assert not ok and text.rstrip().endswith("FAIL: transformers Trainer padded (repeat 1): exit 1, 2 of 6 steps: killed")
    assert "NOTE" not in text


def test_a_run_on_a_busy_machine_is_noted_not_failed():
    args = argparse.Namespace(loss_tol=1e-3, precision="fp32", attn="sdpa", device="cpu", hidden=64, layers=1, rows=10, max_length=128, micro_batch=8, accum=4, steps=6,
                              threads=2, repeats=1)
    runs = [result("ours", "padded", 1, [1] * 6, TOKENS, LOSSES, others=0.8), result("hf", "padded", 1, [1] * 6, TOKENS, LOSSES)]
    text, ok = bp.report(runs, {"padded": TOKENS}, args)
    assert ok and text.rstrip().endswith("NOTE: other processes kept up to 0.80 cores busy during a run (others' load): the "
                                         "machine was not quiet, and tokens/s of those runs are lower than it can do")


def test_others_load_is_the_machines_busy_time_less_the_runs_own():
    import resource
    import time

    before, mine = bp.busy_s(), resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    while time.perf_counter() - start < 0.5:  # this process busy: counted as the script's own, not others'
        pass
    no_run = resource.struct_rusage((0,) * 16)  # the run's own CPU time: none here
    load = bp.others(before, mine, no_run, time.perf_counter() - start)
    assert before is not None and 0 <= load < 1.5  # other tests may run beside this one: up to the other core
    assert bp.others(None, mine, mine, 1.0) is None


def test_packed_rows_seq_lengths_come_from_their_position_ids():
    assert bp.seq_lengths([0, 1, 2, 0, 1, 0, 1, 2, 3]) == [3, 2, 4]
    assert bp.seq_lengths([0, 1, 2]) == [3]


def test_rows_fit_max_length_untruncated(tok, tmp_path):
    """The synthetic rows are tokenized by our pipeline whole: none is cut at data.max_length, and the longest come
    within a factor 2 of it."""
    from finetune.config import DataConfig
    from finetune.data.examples import load_split

    for max_length in (96, 512):
        path = tmp_path / f"rows_{max_length}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in bp.make_rows(300, max_length)))
        train, _, stats = load_split(DataConfig(train=str(path), format="alpaca", max_length=max_length), tok, 0)
        assert len(train) == 300 and stats["train"].truncated == 0
        assert max(len(e.input_ids) for e in train) <= max_length < 2 * max(len(e.input_ids) for e in train)


def test_missing_trl_is_one_line_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setattr(bp.importlib.util, "find_spec", lambda name: None)
    assert bp.main(["--peers", "hf,trl"]) == 2
    assert capsys.readouterr().err == 'error: TRL is not installed: pip install -e ".[bench]" (or leave it out: --peers hf)\n'
    assert bp.main(["--peers", "hf,deepspeed"]) == 2
    assert capsys.readouterr().err == "error: unknown peer 'deepspeed'; known: hf, trl\n"


def run_script(tmp_path, *args: str) -> tuple[str, list[list[str]]]:
    out = subprocess.run([sys.executable, str(REPO / "scripts/benchmark_peers.py"), "--steps", "3", "--rows", "120", "--repeats", "1",
                          "--hidden", "32", "--layers", "1", "--max-length", "96", "--out", str(tmp_path / "peers.md"), *args],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = (tmp_path / "peers.md").read_text()
    assert out.stdout.endswith(text + "\n")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return text, rows


def check_fair(text: str, rows: list[list[str]], frameworks: list[tuple[str, str]]) -> None:
    """The table has one row per run with numbers, and the fairness rows say: the same tokens, the loss within float noise."""
    runs = [r for r in rows if len(r) == 10 and r[0] != "framework"]
    assert [(r[0], r[1]) for r in runs] == frameworks
    for r in runs:
        assert all(re.fullmatch(r"[0-9,]+(\.[0-9]+)?", c) for c in r[2:-1]), r  # one repeat: one number each
        assert re.fullmatch(r"[0-9]+\.[0-9]+x", r[-1]) or (r[-1] == "-" and "transformers Trainer" not in text), r  # no HF: no ratio
    fair = [r for r in rows if len(r) == 5 and r[0] != "framework"]
    assert [(r[0], r[1]) for r in fair] == frameworks
    for name, mode, _, tokens, loss in fair:
        assert tokens == "0.000%" and float(loss) < 1e-5, (name, mode, loss)
    assert "OK: non-pad tokens per step" in text and "OK: loss" in text and "FAIL" not in text


@pytest.mark.slow
def test_ours_against_the_hf_trainer_on_three_steps(tmp_path):
    text, rows = run_script(tmp_path, "--peers", "hf", "--modes", "padded")
    check_fair(text, rows, [("ours (finetune)", "padded"), ("ours, data.padding_free=false", "padded"), ("transformers Trainer", "padded")])


@pytest.mark.slow
def test_ours_against_trl_padding_free_on_three_steps(tmp_path):
    pytest.importorskip("trl")
    text, rows = run_script(tmp_path, "--peers", "trl", "--modes", "packed")
    check_fair(text, rows, [("ours (finetune)", "packed"), ("TRL SFTTrainer", "packed")])


# --- GRPO and DPO (scripts/peers_rl.py) ---


def grpo_result(framework: str, repeat: int, seconds: list[float], rollout: list[float], rewards: list[float],
                prompts: list[str] | None = None, others: float | None = 0.01) -> dict:
    ends = [sum(seconds[: i + 1]) for i in range(len(seconds))]
    steps = [{"step": i + 1, "elapsed_s": e, "generation_s": g, "reward": r, "completion_tokens": 10.0 + repeat}
             for i, (e, g, r) in enumerate(zip(ends, rollout, rewards))]
    return {"framework": framework, "mode": "grpo", "repeat": repeat, "wall_s": 30.0 + repeat, "first_step_s": 6.0 - repeat,
            "rss_mib": 600.0 + repeat, "others": others, "steps": steps, "prompts": prompts or []}


REWARDS = [0.1, 0.2, 0.2, 0.3, 0.4, 0.5]


def test_grpo_steady_state_is_one_over_the_median_step_split_into_rollout_and_training():
    # steps of 5, 1, 1 s (warm-up), then 2, 1, 2 s, their rollouts 1.5, 0.5, 1 s: median step 2 s -> 0.5 steps/s;
    # rollout median 1 s; training (step - rollout) 0.5, 0.5, 1 -> 0.5
    run = grpo_result("ours", 1, [5, 1, 1, 2, 1, 2], [4, 0.5, 0.5, 1.5, 0.5, 1], REWARDS)
    assert rl.make_steady(run["steps"]) == pytest.approx({"steps_per_s": 0.5, "step_s": 2, "rollout_s": 1, "training_s": 0.5})
    assert rl.last_half(run["steps"]) == pytest.approx(0.4)  # steps 4-6
    assert rl.last_half(run["steps"][:5]) == pytest.approx(0.35)  # 5 steps: 4-5, the middle one left out


def test_grpo_table_shows_each_repeat_the_best_and_the_ratio_to_trl_and_the_reward_curves():
    runs = [grpo_result("ours", 1, [3, 1, 1, 1, 1, 1], [2, 0.5, 0.5, 0.6, 0.6, 0.6], REWARDS),
            grpo_result("trl", 1, [3, 2, 2, 2, 2, 2], [2, 1, 1, 1.5, 1.5, 1.5], [x / 2 for x in REWARDS], others=None),
            grpo_result("trl", 2, [3, 2, 2, 4, 4, 4], [2, 1, 1, 3, 3, 3], [x / 2 for x in REWARDS], others=1.1),
            grpo_result("ours", 2, [3, 1, 1, 1.25, 1.25, 1.25], [2, 0.5, 0.5, 0.75, 0.75, 0.75], REWARDS)]
    lines = rl.grpo_table(runs).splitlines()
    assert lines[0] == ("| framework | steps/s (each repeat) | others' load | step s | rollout s | training s | first step s | wall s "
                        "| peak RSS MiB | completion tokens | vs TRL |")
    assert lines[2] == "| ours (finetune) | 1.000 / 0.800 | 0.01 / 0.01 | 1.000 | 0.600 | 0.400 | 4.0 | 31.0 | 602 | 11.5 | 2.00x |"
    assert lines[3] == "| TRL GRPOTrainer | 0.500 / 0.250 | - / 1.10 | 2.000 | 1.500 | 0.500 | 4.0 | 31.0 | 602 | 11.5 | 1.00x |"
    curve = rl.reward_table(runs, buckets=3).splitlines()
    assert curve[0] == "| steps | ours (finetune) #1 | ours (finetune) #2 | TRL GRPOTrainer #1 | TRL GRPOTrainer #2 |"
    assert curve[2:] == ["| 1-2 | 0.150 | 0.150 | 0.075 | 0.075 |", "| 3-4 | 0.250 | 0.250 | 0.125 | 0.125 |",
                         "| 5-6 | 0.450 | 0.450 | 0.225 | 0.225 |", "| last half (4-6) | 0.400 | 0.400 | 0.200 | 0.200 |"]
    failed = rl.grpo_table([runs[0], {"framework": "trl", "mode": "grpo", "repeat": 1, "error": "exit 1, 0 of 6 steps: boom"}])
    assert failed.splitlines()[2].endswith("| - |") and failed.splitlines()[3].startswith("| TRL GRPOTrainer | failed: exit 1")


def test_grpo_fairness_compares_the_prompts_of_every_step_and_the_reward_over_the_last_half():
    expected = {"prompts": [["a\n", "b\n"], ["c\n", "d\n"]], "specials": ["<|user|>", "<|assistant|>"]}
    ours = [p for p in ("a\n", "b\n", "c\n", "d\n") for _ in range(2)]  # G = 2, decoded without special tokens
    trl = [f"<|user|>{p}<|assistant|>" for p in ours]  # TRL's: its dataset's text
    assert rl.scored_steps(trl, expected, 2) == expected["prompts"]
    args = argparse.Namespace(generations=2, reward_tol=0.05)
    runs = [grpo_result("ours", 1, [1] * 4, [0.5] * 4, [0.1, 0.2, 0.3, 0.4], ours),
            grpo_result("trl", 1, [1] * 4, [0.5] * 4, [0.1, 0.2, 0.33, 0.45], trl)]
    text, ok = rl.grpo_fairness(runs, expected, args)
    assert ok and text.startswith("OK: prompts, each step's as every run's reward was given them against the prepared steps "
                                  "(4 prompts x G 2): equal in every run\n")
    # the steps' noise: the last half's (steps 3-4) standard errors 0.05 and 0.06, 3 x sqrt(0.05^2 + 0.06^2) = 0.234
    assert "OK: reward over the last half of the steps, the mean of the repeats: ours 0.350, TRL 0.390, |difference| 0.040 " \
           "(limit 0.05; the steps' noise, 3 standard errors of the difference: 0.234); completion tokens: ours 11.0, TRL 11.0 " \
           "a completion on average" in text
    runs[1]["steps"][-1]["reward"] = 0.5  # TRL 0.415: 0.065 off
    runs[1]["prompts"] = trl[:4] + trl[6:] + trl[4:6]  # step 2's prompts swapped
    text, ok = rl.grpo_fairness(runs, expected, args)
    assert not ok and "FAIL: prompts, each step's as every run's reward was given them against the prepared steps (4 prompts " \
                      "x G 2): different in TRL GRPOTrainer #1" in text and "FAIL: reward over the last half" in text


def test_dpo_table_measures_each_reference_against_trls_and_checks_the_loss():
    runs = [result("ours", "precomputed", 1, [2, 1, 1, 0.5, 0.5, 0.5], TOKENS, LOSSES),
            result("trl", "precomputed", 1, [2, 1, 1, 1, 1, 1], TOKENS, LOSSES),
            result("ours", "live", 1, [2, 1, 1, 1, 1, 1], TOKENS, LOSSES),
            result("trl", "live", 1, [2, 1, 1, 1.5, 1.5, 1.5], TOKENS, [x + 2e-3 for x in LOSSES])]
    lines = bp.table(runs, rl.DPO).splitlines()
    assert lines[0].endswith("| final loss | vs TRL |")
    assert [(line.split(" | ")[1], line.rsplit(" | ", 1)[-1]) for line in lines[2:]] == [
        ("precomputed", "2.00x |"), ("precomputed", "1.00x |"), ("live", "1.50x |"), ("live", "1.00x |")]
    text, ok = bp.fairness_text(bp.fairness(runs, {"precomputed": TOKENS, "live": TOKENS}, rl.DPO), 1e-3, rl.DPO)
    assert not ok and "| TRL DPOTrainer | live | 1,000.0 | 0.000% | 2.0e-03 |" in text


def test_dpo_pairs_fit_max_length_untruncated_and_differ(tok, tmp_path):
    from finetune.config import DataConfig
    from finetune.data.examples import load_split

    pairs = rl.make_pairs(200, 512)
    assert all(p["chosen"] != p["rejected"] for p in pairs) and pairs[0]["rejected"] == pairs[1]["chosen"]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    train, _, stats = load_split(DataConfig(train=str(path), format="preference", max_length=512), tok, 0, "dpo")
    assert len(train) == 200 and stats["train"].truncated == stats["train"].dropped == 0


def test_each_method_has_its_defaults_and_sft_keeps_its_own():
    sft = bp.arguments([])
    assert (sft.method, sft.peers, sft.steps, sft.rows, sft.max_length, sft.micro_batch, sft.accum) == ("sft", "hf,trl", 30, 3000, 512, 8, 4)
    grpo = bp.arguments(["--method", "grpo"])
    assert (grpo.peers, grpo.steps, grpo.rows, grpo.max_length, grpo.micro_batch, grpo.accum) == ("trl", 24, 96, 128, 4, 1)
    dpo = bp.arguments(["--method", "dpo", "--steps", "5"])
    assert (dpo.peers, dpo.rows, dpo.reference) == ("trl", 5 * 8 * 4, ["precomputed"])  # one epoch: every pair once


def test_grpo_and_dpo_race_trl_only_and_name_the_extra(monkeypatch, capsys):
    assert bp.main(["--method", "grpo", "--peers", "hf,trl"]) == 2
    assert capsys.readouterr().err == "error: unknown peer 'hf'; known: trl\n"
    monkeypatch.setattr(bp.importlib.util, "find_spec", lambda name: None)
    assert bp.main(["--method", "dpo"]) == 2
    assert capsys.readouterr().err == 'error: TRL is not installed: pip install -e ".[bench]" (or race ours alone: --peers "")\n'


def run_rl(tmp_path, method: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(REPO / "scripts/benchmark_peers.py"), "--method", method, "--repeats", "1",
                          "--hidden", "32", "--layers", "1", "--out", str(tmp_path / "peers.md"), *args],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return (tmp_path / "peers.md").read_text()


@pytest.mark.slow
def test_ours_alone_grpo_scores_the_prepared_prompts(tmp_path):
    text = run_rl(tmp_path, "grpo", "--steps", "3", "--peers", "", "--micro-batch", "2", "--generations", "2", "--completion-tokens", "8")
    rows = [line for line in text.splitlines() if line.startswith("| ours (finetune) | ")]
    assert len(rows) == 1 and re.fullmatch(r"\| ours \(finetune\) \| [0-9.]+ \| [0-9.]+ \|( [0-9.,]+ \|){7} - \|", rows[0]), rows
    assert "OK: prompts, each step's as every run's reward was given them against the prepared steps (6 prompts x G 2): " \
           "equal in every run" in text and "FAIL" not in text


@pytest.mark.slow
def test_ours_against_trl_dpo_on_two_steps(tmp_path):
    pytest.importorskip("trl")
    text = run_rl(tmp_path, "dpo", "--steps", "2", "--max-length", "96", "--micro-batch", "2", "--accum", "1")
    fair = [line for line in text.splitlines() if line.startswith("| TRL DPOTrainer | precomputed | ") and "%" in line]
    assert len(fair) == 1 and "| 0.000% |" in fair[0] and float(fair[0].split(" | ")[-1].rstrip(" |")) < 1e-5, fair
    assert "OK: loss" in text and "FAIL" not in text
