"""method=rloo (finetune/methods/rloo.py): the leave-one-out baseline, REINFORCE's loss and the KL in the reward, each
against a hand computation; its rules; and runs showing it shares GRPO's rollout and trains differently from it."""

from __future__ import annotations

import json

import pytest

from finetune.config import ConfigError
from finetune.methods.rloo import RLOO, RlooConfig, leave_one_out, rloo_loss

from conftest import train_here

torch = pytest.importorskip("torch")


def test_each_advantage_is_its_reward_minus_the_mean_of_the_others():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 2.0]])
    assert leave_one_out(r).view(-1).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, -0.5, -0.5, -0.5, 1.5])
    assert leave_one_out(torch.tensor([[3.0, 3.0]])).tolist() == [[0.0, 0.0]]  # equal rewards: no gradient


def test_the_loss_is_reinforce_over_each_whole_completion():
    """- sum_i A_i sum_t log pi(o_it): the gradient of each of a completion's tokens is -A_i (no ratio, no clip, no
    per-token mean: the whole completion is the action)."""
    logps = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss = rloo_loss(logps, torch.tensor([0.8, -0.3]), mask)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.8 * -3.0 + -0.3 * -0.5))
    assert logps.grad.view(-1).tolist() == pytest.approx([-0.8, -0.8, 0.0, 0.3, 0.0, 0.0])


def test_the_kl_to_the_reference_is_taken_from_the_reward(monkeypatch):
    """beta > 0: r_i - beta sum_t (log pi - log pi_ref) per completion, then the leave-one-out baseline of that."""
    from finetune.methods import losses

    policy = torch.tensor([[-1.0, -1.0, -4.0], [-2.0, -9.0, -9.0], [-0.5, -0.5, -0.5], [-1.0, -1.0, -1.0]])
    reference = torch.tensor([[-2.0, -1.5, 0.0], [-2.0, 0.0, 0.0], [-0.5, -1.0, -1.5], [-1.0, -1.0, -1.0]])
    labels = torch.tensor([[-100, 5, 5, -100], [-100, 5, -100, -100], [-100, 5, 5, 5], [-100, 5, 5, 5]])
    monkeypatch.setattr(losses, "labelled_logps", lambda model, batch, router=False: (policy, None))
    objective = RLOO(RlooConfig(generations=2, beta=0.5), reference=lambda model, batch, per_token: reference)
    engine = type("E", (), {"inference": staticmethod(lambda fn, batch: fn(None, batch))})()
    batch = {"labels": labels, "sum_reward": torch.tensor([1.0, 0.0, 1.0, 1.0])}
    kl = [1.0 + 0.5, 0.0, 0.0 + 0.5 + 1.0, 0.0]  # each completion's labelled tokens (columns 1.. of its labels) only
    out = objective.finished(engine, batch)
    assert out["sum_kl"].tolist() == pytest.approx(kl)
    shaped = [r - 0.5 * k for r, k in zip([1.0, 0.0, 1.0, 1.0], kl)]
    assert out["advantages"].tolist() == pytest.approx([shaped[0] - shaped[1], shaped[1] - shaped[0],
                                                        shaped[2] - shaped[3], shaped[3] - shaped[2]])


def test_rules(compose):
    base = ["+recipe=quickstart_sft", "method=rloo"]
    with pytest.raises(ConfigError, match=r"^method.epsilon: not a key of method=rloo; its keys are name, beta, reference, "):
        compose([*base, "method.epsilon=0.2"])
    with pytest.raises(ConfigError, match=r"^method.reference=live has no effect with method=rloo and method.beta=0"):
        compose([*base, "method.reference=live"])
    with pytest.raises(ConfigError, match=r"^method.reference=precomputed cannot score RLOO's completions"):
        compose([*base, "method.beta=0.05"])
    with pytest.raises(ConfigError, match=r"^method=rloo with parallelism.pp=2 is not supported"):
        compose([*base, "parallelism=pp2", "launcher.nproc_per_node=2"])


RUN = ["+recipe=quickstart_sft", "method.rewards=[similarity]", "method.generations=4", "method.completion_tokens=6",
       "parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=2", "optim.warmup_steps=0", "optim.lr=3e-2",
       "train.micro_batch_size=2", "train.global_batch_size=2", "train.exact_match_samples=0", "train.eval_every=0",
       "data.eval_size=4", "data.eval=null"]


def _train(path):
    return [r for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == "train"]


def test_rloo_trains_on_grpos_rollout_with_its_own_gradient(tmp_path):
    """The same seed samples the same first rollout under either method (the reward of step 1 is equal), and the two
    losses move the policy differently (step 1's gradient norms differ); with beta > 0 and a live reference the KL in
    the reward is 0 at step 1 (the policy is the reference) and not after."""
    rloo = _train_run(tmp_path / "rloo", "method=rloo")
    grpo = _train_run(tmp_path / "grpo", "method=grpo")
    assert rloo[0]["reward"] == grpo[0]["reward"] and rloo[0]["equal_groups"] == grpo[0]["equal_groups"]
    assert rloo[0]["grad_norm"] > 0 and rloo[0]["grad_norm"] != pytest.approx(grpo[0]["grad_norm"], rel=1e-3)
    kl = _train_run(tmp_path / "kl", "method=rloo", "method.beta=0.1", "method.reference=live")
    assert kl[0]["kl"] == 0.0 and kl[1]["kl"] != 0.0
    assert kl[0]["grad_norm"] == pytest.approx(rloo[0]["grad_norm"], rel=1e-5)  # KL 0: the same advantages


def _train_run(path, *extra):
    summary = train_here([*RUN[:1], *extra, *RUN[1:]], path)
    assert summary["after"]["eval_loss"] != summary["before"]["eval_loss"]
    return _train(path)
