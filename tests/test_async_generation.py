"""method.async_generation (finetune/methods/background.py): the next rollout sampled in a thread by a copy of the
policy while the step trains. Its sampler draws from a generator of its own (checked against the softmax); one step
behind, the ratio to the sampler's log-probs is used; where the policy does not move the overlapped run equals the
on-policy one; a resumed run trains on the rollout its checkpoint kept; its rules and what the planner counts."""

from __future__ import annotations

import json

import pytest

from finetune.config import ConfigError

from conftest import read_metrics, train_here
from ranks import launch_here

torch = pytest.importorskip("torch")


def test_the_private_sampler_draws_the_softmax_and_leaves_the_global_generator_alone():
    from finetune.methods.sampling import GumbelMax

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    rows = logits.expand(40000, 4)

    def draws(top_p, seed=0):
        return GumbelMax(0.5, top_p, torch.Generator().manual_seed(seed))(None, rows.clone()).argmax(-1)

    state = torch.get_rng_state()
    drawn = draws(1.0)
    assert torch.equal(torch.get_rng_state(), state)  # the training step's dropout draws from the global one meanwhile
    assert torch.equal(drawn, draws(1.0)) and not torch.equal(drawn, draws(1.0, seed=1))
    freq = torch.bincount(drawn, minlength=4).float() / len(drawn)
    assert freq.tolist() == pytest.approx(torch.softmax(logits / 0.5, -1).tolist(), abs=0.01)
    nucleus = torch.bincount(draws(0.9), minlength=4).float() / len(drawn)  # softmax(2x): 0.865, 0.117, ... -> two tokens
    assert nucleus[2:].sum() == 0 and nucleus[:2].tolist() == pytest.approx((torch.softmax(logits[:2] / 0.5, -1)).tolist(), abs=0.01)


BASE = ["+recipe=quickstart_sft", "method=grpo", "method.rewards=[similarity]", "method.generations=4", "method.completion_tokens=8",
        "parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=4", "optim.warmup_steps=0", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.exact_match_samples=0", "train.eval_every=0", "data.eval_size=4", "data.eval=null",
        "method.async_generation=true", "method.epsilon=0.05"]
KEYS = ("loss", "grad_norm", "reward", "completion_tokens", "clipped")


def _run(path, *extra):
    train_here([*BASE, *extra], path)
    return [{k: m[k] for k in KEYS} for m in map(json.loads, (path / "metrics.jsonl").read_text().splitlines()) if m.get("kind") == "train"]


def test_overlapped_sampling_equals_the_on_policy_run_where_the_policy_does_not_move(tmp_path, monkeypatch):
    """lr 1e-12: the copy sampling one step ahead holds the weights the policy trains with, so the run is the one that
    samples each step's rollout just before it (lag 0): the same completions, rewards, losses and gradients."""
    from finetune.methods import background

    ahead = _run(tmp_path / "ahead", "optim.lr=1e-12")
    monkeypatch.setattr(background.Background, "lag", 0)
    now = _run(tmp_path / "now", "optim.lr=1e-12")
    assert len(ahead) == 4 and ahead == now and all(m["grad_norm"] > 0 for m in ahead)


def test_one_step_behind_the_ratio_to_the_sampler_is_used(tmp_path, monkeypatch):
    """At a learning rate that moves the policy, the rollout of step k + 1, sampled by the weights of step k - 1, trains
    at the weights of step k: the ratio leaves 1 and the clip holds tokens (`clipped`), from step 2 (step 1's rollout
    is sampled by the policy itself). Sampled just before each step (lag 0), the ratio stays 1: nothing clipped."""
    from finetune.methods import background

    ahead = _run(tmp_path / "ahead", "optim.lr=3e-2")
    assert ahead[0]["clipped"] == 0.0 and ahead[0]["loss"] == pytest.approx(0.0, abs=1e-6)
    assert all(m["clipped"] > 0 for m in ahead[1:3])
    monkeypatch.setattr(background.Background, "lag", 0)
    now = _run(tmp_path / "now", "optim.lr=3e-2")
    assert [m["clipped"] for m in now] == [0.0] * 4 and now[0] == ahead[0]


def test_through_a_vllm_server_the_thread_asks_it_and_the_ratio_is_used(tmp_path, monkeypatch, vllm_server):
    """method.vllm_servers (vLLM's stand-in in a process of its own): the thread asks the server for the next step's
    completions, the weights pushed when the copy is refreshed (every step: 4 pushes, 4 requests). One step behind, the
    ratio to the copy's log-probs is used from step 2; sampled just before each step (lag 0), nothing is clipped and
    step 1 is the same. The server samples other completions than the copy's own generator: another trajectory."""
    from finetune.methods import background

    address, health = vllm_server
    served = ["method.vllm=true", f"method.vllm_servers=[{address}]", "optim.lr=3e-2"]
    before = health()
    ahead = _run(tmp_path / "ahead", *served)
    after = health()
    assert (after["pushes"] - before["pushes"], after["requests"] - before["requests"]) == (4, 4)
    assert ahead[0]["clipped"] == 0.0 and any(m["clipped"] > 0 for m in ahead[1:])
    assert ahead != _run(tmp_path / "copy", "optim.lr=3e-2")
    monkeypatch.setattr(background.Background, "lag", 0)
    now = _run(tmp_path / "now", *served)
    assert [m["clipped"] for m in now] == [0.0] * 4 and now[0] == ahead[0] and health()["pushes"] - after["pushes"] == 4


@pytest.mark.slow
def test_a_resumed_run_trains_on_the_rollout_its_checkpoint_sampled_ahead(tmp_path):
    common = [*BASE, "optim.lr=3e-2", "train.save_every=2", "train.progress_bar=false"]
    full = launch_here(*common, f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    assert (tmp_path / "full/checkpoints/step_2/rollout_0.pt").is_file()
    resumed = launch_here(*common, f"train.resume={tmp_path / 'full/checkpoints/step_2'}", f"hydra.run.dir={tmp_path / 'resumed'}",
                          cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = {name: [{k: m[k] for k in KEYS} for m in read_metrics(tmp_path / name) if m["kind"] == "train"] for name in ("full", "resumed")}
    assert len(rows["resumed"]) == 2 and rows["resumed"] == rows["full"][2:] and rows["full"][2]["clipped"] > 0


@pytest.mark.slow
def test_two_ddp_ranks_sample_ahead_through_the_cli(tmp_path):
    """The layout it is for, as a user launches it: two DDP ranks, each with its copy, a checkpoint holding each rank's
    rollout sampled ahead."""
    out = launch_here(*BASE[:5], "parallelism=ddp", "launcher.nproc_per_node=2", *BASE[7:], "train.global_batch_size=4", "optim.lr=3e-2", "train.save_every=2",
                      "train.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    train = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3, 4] and train[0]["clipped"] == 0 and any(m["clipped"] > 0 for m in train[1:])
    assert all(m["sampling_s"] > 0 for m in train)
    assert {p.name for p in (tmp_path / "run/checkpoints/step_2").glob("rollout_*.pt")} == {"rollout_0.pt", "rollout_1.pt"}


@pytest.mark.parametrize("extra,message", [
    (["parallelism=fsdp", "launcher.nproc_per_node=2"], "method.async_generation=true runs on parallelism=single or ddp: its sampler is a "
     "whole copy of the policy on each rank"),
    (["method.dynamic_sampling=true"], "method.async_generation=true with method.dynamic_sampling=true is not supported: its refills' "
     "rounds are agreed across ranks by a collective"),
    (["method.updates_per_rollout=2", "train.save_every=2"], "method.async_generation=true with method.updates_per_rollout=2 is not "
     "supported: a rollout sampled ahead trains once; drop one of them"),
    (["data.streaming=true"], "method.async_generation=true with data.streaming=true is not supported"),
])
def test_rules(compose, extra, message):
    with pytest.raises(ConfigError) as e:
        compose(["method=grpo", "method.async_generation=true", *extra])
    assert str(e.value).startswith(message)
    compose(["method=grpo", "method.async_generation=true", "method.epsilon=0.1", "parallelism=ddp", "launcher.nproc_per_node=2"])


def test_the_planner_counts_the_samplers_copy_and_its_cache_at_every_peak(compose):
    from finetune.planner.peak import plan

    common = ["method=grpo", "method.generations=4", "method.completion_tokens=16", "train.micro_batch_size=2", "train.global_batch_size=4"]
    sync, overlapped = plan(compose(common)), plan(compose([*common, "method.async_generation=true"]))
    assert overlapped.rollout == 0 and overlapped.reserved == sync.weights + sync.rollout  # a copy, and its sampling's cache
    assert overlapped.backward_peak == sync.backward_peak + overlapped.reserved  # sampling runs during the step
    assert overlapped.total == max(overlapped.backward_peak, overlapped.step_peak, overlapped.rollout_peak) > sync.total
    assert "by a copy of the policy" in " ".join(overlapped.notes)


@pytest.mark.slow
def test_the_benchmark_prints_the_synchronous_and_overlapped_step_times():
    import subprocess
    import sys

    from conftest import REPO

    out = subprocess.run([sys.executable, str(REPO / "scripts/benchmark_async.py"), "--steps", "4", "--prompts", "1", "--generations",
                          "2", "--completion-tokens", "4", "--one-thread-only"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r[0].strip() for r in rows] == ["synchronous, 1 thread", "overlapped, 1 thread each side"]
    assert all(float(r[1]) > 0 for r in rows) and float(rows[0][4]) == 0 and float(rows[1][4]) > 0  # sampling_s: background only
