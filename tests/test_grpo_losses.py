"""The online method's loss variants (finetune/methods/grpo.py): each option against its paper's formula on a case
computed by hand (loss and gradient), its rules, and a short run per option showing that it changes what trains."""

from __future__ import annotations

import json
import math

import pytest

from finetune.config import ConfigError
from finetune.methods import rewards
from finetune.methods.grpo import GRPO, GrpoConfig, GrpoLoss, RatioLevel, RewardScale, group_advantages, grpo_loss
from finetune.methods.collectives import batch_std
from finetune.methods.online import completion_mask

from conftest import train_here

torch = pytest.importorskip("torch")

# two completions of 2 and 1 tokens (the third column is padding), ratio 1 (one update per rollout), no KL
MASK = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
A1, A2 = 0.8, -0.3


def _loss(loss_type, **kw):
    logps = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    loss, _ = grpo_loss(logps, torch.tensor([A1, A2]), torch.tensor(MASK), epsilon=0.2, beta=0.0, reference=None,
                        loss_type=loss_type, **kw)
    loss.backward()
    return loss.item(), logps.grad.view(-1).tolist()


def flat(rows):
    return [x for row in rows for x in row]


@pytest.mark.parametrize("loss_type,value,grads", [
    # DeepSeekMath eq. 3: each completion's tokens averaged, completions summed (the loop divides by 2 completions)
    (GrpoLoss.grpo, -(A1 + A2), [[-A1 / 2, -A1 / 2, 0.0], [-A2, 0.0, 0.0]]),
    # TRL's bnpo: the micro-batch's 3 tokens averaged, weighed as its 2 completions
    (GrpoLoss.bnpo, 2 / 3 * -(2 * A1 + A2), [[-A1 * 2 / 3, -A1 * 2 / 3, 0.0], [-A2 * 2 / 3, 0.0, 0.0]]),
    # Dr. GRPO: every token over the constant completion_tokens (4 here)
    (GrpoLoss.dr_grpo, -(2 * A1 + A2) / 4, [[-A1 / 4, -A1 / 4, 0.0], [-A2 / 4, 0.0, 0.0]]),
    # DAPO eq. 10: every token the same weight (the loop divides by the global batch's 3 tokens)
    (GrpoLoss.dapo, -(2 * A1 + A2), [[-A1, -A1, 0.0], [-A2, 0.0, 0.0]]),
])
def test_each_loss_type_weighs_the_tokens_as_its_paper(loss_type, value, grads):
    got, grad = _loss(loss_type, max_tokens=4)
    assert got == pytest.approx(value)
    assert grad == pytest.approx(flat(grads))


def test_dapo_is_normalised_by_tokens_and_its_metrics_by_completions():
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "advantages": torch.zeros(2),
             "labels": torch.tensor([[-100, 5, 6, -100], [-100, 7, -100, -100]]), "kept": torch.tensor([1.0, 1.0])}
    dapo, grpo = GRPO(GrpoConfig(loss_type=GrpoLoss.dapo)), GRPO(GrpoConfig())
    assert (dapo.count(batch), dapo.metric_count(batch)) == (3, 2)
    assert (grpo.count(batch), grpo.metric_count(batch)) == (2, 2)
    batch["kept"] = torch.tensor([0.0, 1.0])  # mask_truncated_completions: the first was cut before its EOS
    assert dapo.count(batch) == 1 and completion_mask(batch).tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_rewards_are_scaled_by_the_group_the_batch_or_nothing():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 0.0]])
    centred = [[0.5, -0.5, -0.5, 0.5], [0.5, 0.5, 0.5, -1.5]]
    assert group_advantages(r, RewardScale.none).tolist() == centred  # Dr. GRPO: no std
    group = [math.sqrt(1 / 3), 1.0]  # each group's sample std: (1, 0, 0, 1) and (2, 2, 2, 0)
    assert group_advantages(r, RewardScale.group).view(-1).tolist() == pytest.approx(
        [c / (s + 1e-4) for row, s in zip(centred, group) for c in row])

    class Replica:
        owner = True

    whole = batch_std([r[0], r[1]], Replica())  # one process: the global batch is this rank's rollout
    assert whole == pytest.approx(float(r.std()))
    assert group_advantages(r, RewardScale.batch, whole).view(-1).tolist() == pytest.approx(
        [c / (whole + 1e-4) for c in flat(centred)])


def test_clip_higher_lets_a_rising_token_rise_further():
    """DAPO eq. 10: ratio 1.25 with a positive advantage is clipped at 1 + 0.2 (no gradient) but not at 1 + 0.28; a
    falling one is still clipped at 1 - 0.2."""
    for high, grad in ((None, 0.0), (0.28, -1.25)):
        logps = torch.tensor([[math.log(1.25)], [math.log(0.7)]], requires_grad=True)
        loss, _ = grpo_loss(logps, torch.tensor([1.0, -1.0]), torch.ones(2, 1), epsilon=0.2, beta=0.0, reference=None,
                            old_logps=torch.zeros(2, 1), epsilon_high=high)
        assert loss.item() == pytest.approx(-(1.25 if high else 1.2) + 0.8)  # the falling one: -min(-0.7, -0.8)
        loss.backward()
        assert logps.grad.view(-1).tolist() == pytest.approx([grad, 0.0])


def test_sequence_level_ratio_is_the_geometric_mean_of_the_tokens():
    """GSPO eq. 7: one ratio per completion, s = exp(mean_t log rho_t), the same for its tokens; d/dlogp_t of -A s is
    -A s / |o|. The token level's is -A rho_t / |o| (grpo averages the tokens)."""
    old = torch.zeros(1, 2)
    for level in (RatioLevel.sequence, RatioLevel.token):
        logps = torch.tensor([[0.1, 0.3]], requires_grad=True)
        loss, _ = grpo_loss(logps, torch.tensor([2.0]), torch.ones(1, 2), epsilon=0.5, beta=0.0, reference=None,
                            old_logps=old, level=level)
        loss.backward()
        if level == RatioLevel.sequence:
            s = math.exp(0.2)
            assert loss.item() == pytest.approx(-2 * s)
            assert logps.grad.view(-1).tolist() == pytest.approx([-2 * s / 2, -2 * s / 2])
        else:
            assert loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(0.3)))
            assert logps.grad.view(-1).tolist() == pytest.approx([-math.exp(0.1), -math.exp(0.3)])
    logps = torch.tensor([[0.4, 0.6]], requires_grad=True)  # s = exp(0.5) > 1 + 0.2: clipped, no gradient
    loss, _ = grpo_loss(logps, torch.tensor([1.0]), torch.ones(1, 2), epsilon=0.2, beta=0.0, reference=None, old_logps=old,
                        level=RatioLevel.sequence)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2) and logps.grad.tolist() == [[0.0, 0.0]]


def test_overlong_reward_is_dapos_soft_punishment():
    """DAPO eq. 13 with L_max = 8, L_cache = 4: 0 up to 4 tokens, then -1/4 per token, -1 at 8."""
    fn = rewards.resolve(GrpoConfig(rewards=["overlong"], overlong_buffer=4, completion_tokens=8))[0].fn
    assert fn(completion_tokens=[1, 4, 5, 6, 8]) == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])


@pytest.mark.parametrize("overrides,message", [
    (["method.epsilon_high=0.28"], "method.epsilon_high=0.28 has no effect with method.updates_per_rollout=1: each rollout trains "
     "once, at policy ratio 1, where neither the clip nor the ratio's level acts (set method.updates_per_rollout=2 or more, or method.async_generation=true): "
     "remove it or change the option"),
    (["method.importance_sampling_level=sequence"], "method.importance_sampling_level=sequence has no effect with "
     "method.updates_per_rollout=1: each rollout trains once, at policy ratio 1, where neither the clip nor the ratio's level "
     "acts (set method.updates_per_rollout=2 or more, or method.async_generation=true): remove it or change the option"),
    (["method.updates_per_rollout=2", "method.epsilon_high=0.1"], "method.epsilon_high=0.1 is below method.epsilon=0.2: it is "
     "the clip's upper side, raised above the lower one (DAPO: 0.28 beside 0.2); drop it or raise it"),
    (["method.rewards=[overlong]"], "method.rewards has overlong but method.overlong_buffer is not set: the tokens before "
     "completion_tokens where the penalty starts (DAPO: a quarter of it), e.g. method.overlong_buffer=16"),
    (["method.overlong_buffer=8"], "method.overlong_buffer=8 has no effect without the overlong reward: add overlong to "
     "method.rewards or remove it"),
    (["method.rewards=[overlong]", "method.overlong_buffer=80"], "method.overlong_buffer=80 is longer than "
     "method.completion_tokens=64: the soft zone ends at the limit; use at most 64"),
    (["method.loss_type=dapo_v2"], "invalid value for 'method.loss_type': Invalid value 'dapo_v2', expected one of [grpo, bnpo, "
     "dr_grpo, dapo]"),
])
def test_rules(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "method=grpo", *overrides])
    assert str(e.value) == message


GRPO_BASE = ["+recipe=quickstart_sft", "method=grpo", "method.rewards=[similarity]", "method.generations=3",
             "method.completion_tokens=4", "train.save_every=100"]


@pytest.mark.parametrize("option", [
    "method.loss_type=dapo", "method.loss_type=dr_grpo", "method.loss_type=bnpo", "method.scale_rewards=none",
    "method.scale_rewards=batch", "method.mask_truncated_completions=true", "method.epsilon_high=0.6",
    "method.importance_sampling_level=sequence",
])
def test_each_option_changes_what_trains(compose, tok, option):
    """Each option, composed as the command line composes it, through the objective the ranks build from it (the
    method's record): on one rollout of completions of 1 to 4 tokens, some cut before their EOS, and a policy that
    moved since it sampled them (its tokens' log-probs 0, 0.3 or 0.6 above: the ratio's options act), the loss or its
    gradient differs from the defaults'."""
    from conftest import tiny_model
    from finetune import methods
    from finetune.methods.losses import token_logps

    net, _ = tiny_model()
    eos = tok.eos_token_id
    prompts, answers = [[1, 5, 20, 30], [1, 7, 8]], [[9, 10], [11]]
    completions = [[9, 10, eos], [9, eos], [12, 13, 14, 15], [11, eos], [16, 17, 18, 19], [11, 12, eos]]

    def run(*overrides: str) -> tuple[float, float]:
        cfg = compose([*GRPO_BASE, "method.updates_per_rollout=2", *overrides]).method
        objective = methods.get("grpo").objective(cfg, None, None, None)
        objective.rewards = rewards.resolve(cfg)
        batch = objective.scored(prompts, answers, completions, tok)
        if cfg.scale_rewards == RewardScale.batch:  # the rollout's division, one process: this batch is the global one
            batch["advantages"] = group_advantages(batch["sum_reward"].view(-1, 3), RewardScale.batch,
                                                   float(batch["sum_reward"].std())).view(-1)
        with torch.no_grad():
            logps = token_logps(net, batch).float()
            batch["old_logps"] = logps - 0.3 * (torch.arange(logps.shape[1]) % 3)  # ratios 1, e^0.3, e^0.6, ...
        net.zero_grad()
        loss, _ = objective(net, batch)
        (loss / objective.count(batch)).backward()
        grad = sum(float(p.grad.norm()) ** 2 for p in net.parameters() if p.grad is not None) ** 0.5
        return float(loss) / objective.count(batch), grad

    plain, other = run(), run(option)
    assert other != pytest.approx(plain, rel=1e-4)


def test_a_dapo_run_trains_through_the_ranks_code(tmp_path):
    """DAPO's loss (token-level, clip-higher) and its overlong reward, composed and trained by the rank's own code for two
    updates of one rollout: it runs, logs the reward, and moves the policy. (Its truncated completions' mask would leave
    a random-init model, which never writes its EOS, nothing to learn from: the test above shows it.)"""
    summary = train_here(["+recipe=quickstart_sft", "method=grpo", "method.rewards=[similarity,overlong]",
                          "method.overlong_buffer=3", "method.generations=4", "method.completion_tokens=6",
                          "method.loss_type=dapo", "method.epsilon_high=0.28", "method.updates_per_rollout=2",
                          "train.save_every=2", "parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=2",
                          "optim.warmup_steps=0", "optim.lr=3e-2", "train.micro_batch_size=2", "train.global_batch_size=2",
                          "train.exact_match_samples=0", "train.eval_every=0", "data.eval_size=4", "data.eval=null"], tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(-1.0 <= r["rewards/overlong"] <= 0.0 for r in train)
    assert all(r["grad_norm"] > 0 for r in train) and train[1]["loss"] != train[0]["loss"]
    assert summary["after"]["eval_loss"] != summary["before"]["eval_loss"]


# dynamic sampling: prompt [1, x, 7] with x even gets G equal completions (the length reward equal: no gradient), odd x
# completions of different lengths
def _prompts(*xs):
    from finetune.data.batches import collate
    from finetune.data.tokenize import Example

    return collate([Example([1, x, 7, 9], [-100, -100, -100, 9], 3, "") for x in xs], 0)


def _rollout(tok, monkeypatch, *, dynamic=True, rounds=4, refills=((6, 5), (7, 9), (11,))):
    from types import SimpleNamespace

    from finetune.methods import online

    seeds, asked = [], []

    def sample(engine, prompts, cfg, tokenizer, seed, vllm=None, images=None, private=False):
        seeds.append(seed)
        eos = tokenizer.eos_token_id
        return [[5, eos] if p[1] % 2 == 0 else [5] * (i + 1) + [eos] for p in prompts for i in range(cfg.generations)]

    def refill(round):
        asked.append(round)
        return [_prompts(*refills[round - 1])]

    monkeypatch.setattr(online, "sample", sample)
    cfg = GrpoConfig(generations=2, completion_tokens=8, rewards=["length"], dynamic_sampling=dynamic,
                     **({"sampling_rounds": rounds} if dynamic else {}))
    objective = GRPO(cfg)
    objective.rewards = rewards.resolve(cfg)
    out, _ = objective.rollout(SimpleNamespace(dp_rank=0), [_prompts(2, 4), _prompts(3)], step=5, tokenizer=tok, seed=11,
                               refill=refill)
    return out, seeds, asked


def _xs(batch):
    return batch["input_ids"][::2, 1].tolist()  # each group's prompt (G = 2 rows each)


def test_dynamic_sampling_drops_equal_groups_and_refills_from_fresh_prompts(tok, monkeypatch):
    """Groups whose rewards are all equal are dropped, prompts drawn anew (refill) sampled until the step's 3 groups
    have distinct rewards; the micro-batches keep their sizes (2 and 1 prompts); the refills' samples are seeded by their
    round; the metrics count the rounds, the equal share of what was sampled, and of what trains."""
    out, seeds, asked = _rollout(tok, monkeypatch)
    assert [_xs(b) for b in out] == [[3, 5], [7]] and asked == [1, 2]  # round 2 filled it: the third refill not drawn
    assert seeds == [(11, 5, 0, 0), (11, 5, 0, 1), (11, 5, 0, 0, 1), (11, 5, 0, 0, 2)]
    assert all(b["advantages"].abs().min() > 0.5 for b in out)  # every trained group has a gradient
    for b in out:
        rows = b["input_ids"].shape[0]
        assert b["sum_sampling_rounds"].tolist() == [3.0] * rows
        assert b["sum_equal_groups"].tolist() == pytest.approx([3 / 7] * rows)  # 2, 4 and 6 of the 7 sampled groups
        assert b["sum_equal_trained"].tolist() == [0.0] * rows


def test_dynamic_sampling_fills_with_equal_groups_when_its_rounds_are_spent(tok, monkeypatch):
    out, _, asked = _rollout(tok, monkeypatch, rounds=2)
    assert [_xs(b) for b in out] == [[3, 5], [2]] and asked == [1]  # short of one group after 2 rounds: an equal one fills it
    assert out[1]["sum_equal_trained"].tolist() == [1.0, 1.0] and out[1]["advantages"].tolist() == [0.0, 0.0]
    assert out[0]["sum_sampling_rounds"].tolist() == [2.0] * 4


def test_without_dynamic_sampling_the_equal_groups_train_and_are_counted(tok, monkeypatch):
    out, seeds, asked = _rollout(tok, monkeypatch, dynamic=False)
    assert [_xs(b) for b in out] == [[2, 4], [3]] and asked == [] and len(seeds) == 2
    assert out[0]["sum_equal_groups"].tolist() == pytest.approx([2 / 3] * 4) and "sum_sampling_rounds" not in out[0]
    assert GRPO(GrpoConfig()).metrics[-1] == "equal_groups"


def test_refills_are_drawn_from_the_whole_dataset_by_seed_step_and_round():
    from finetune.data.batches import TrainBatches
    from finetune.data.tokenize import Example

    examples = [Example([1, i, 7, 9], [-100, -100, -100, 9], 3, "") for i in range(40)]

    def drawn(rank, step, round, seed=0):
        b = TrainBatches(examples, global_batch=8, micro_batch=2, dp_rank=rank, dp_size=2, seed=seed, pad_id=0)
        return [x for mb in b.refill(step, round) for x in mb["input_ids"][:, 1].tolist()]

    both = drawn(0, 3, 1) + drawn(1, 3, 1)
    assert len(set(both)) == 8  # one draw without replacement, split between the ranks
    assert drawn(0, 3, 1) == drawn(0, 3, 1) and drawn(0, 3, 2) != drawn(0, 3, 1) and drawn(0, 4, 1) != drawn(0, 3, 1)
    assert drawn(0, 3, 1, seed=1) != drawn(0, 3, 1)


def test_dynamic_sampling_rules(compose):
    base = ["+recipe=quickstart_sft", "method=grpo"]
    with pytest.raises(ConfigError, match=r"^method.sampling_rounds=3 has no effect without method.dynamic_sampling=true \(the "
                                          r"rounds are its refills\): remove it or change the option$"):
        compose([*base, "method.sampling_rounds=3"])
    with pytest.raises(ConfigError, match=r"^method.dynamic_sampling=true with data.streaming=true is not supported: the refills "
                                          r"draw prompts at random from the whole dataset"):
        compose([*base, "method.dynamic_sampling=true", "data.streaming=true"])


def test_dynamic_sampling_runs_through_the_loop(tmp_path):
    """Through the rank's loop (its refill: TrainBatches.refill): the metrics say how many rounds each step took, and a
    step trains equal groups only when its rounds were spent."""
    train_here(["+recipe=quickstart_sft", "method=grpo", "method.rewards=[length]", "method.generations=2",
                "method.completion_tokens=3", "method.dynamic_sampling=true", "method.sampling_rounds=3", "parallelism=single",
                "launcher.nproc_per_node=1", "train.max_steps=2", "optim.warmup_steps=0", "train.micro_batch_size=2", "train.global_batch_size=2",
                "train.exact_match_samples=0", "train.eval_every=0", "data.eval_size=4", "data.eval=null"], tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["sampling_rounds"] in (1.0, 2.0, 3.0) and 0.0 <= r["equal_groups"] <= 1.0
        assert r["equal_trained"] == 0.0 or r["sampling_rounds"] == 3.0
    assert any(r["sampling_rounds"] > 1 for r in train)  # 3-token completions of a random model: equal lengths are common
