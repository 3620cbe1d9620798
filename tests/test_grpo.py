"""GRPO (method=grpo): advantages and the loss against hand computations, the rewards, the rollout (seeded, cut at
EOS, labels on the completion only), the rules, and a 2-rank run through the real CLI."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from finetune.config import ConfigError, MethodConfig
from finetune.data.tokenize import IGNORE
from finetune.methods.grpo import GRPO, group_advantages, grpo_loss
from finetune.methods.online import sample, split_rows
from finetune.methods import rewards
from finetune.methods.grpo import GrpoConfig

from conftest import GenerationEngine, last_line, read_metrics, run_cli, tiny_model
from ranks import launch_here


def method(**kw) -> MethodConfig:
    return GrpoConfig(**kw)


def test_advantages_are_z_scores_within_each_group():
    a = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    std = math.sqrt(1 / 3)  # the sample std of (1, 0, 0, 1)
    assert a[0].tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 1 + [-0.5 / (std + 1e-4), 0.5 / (std + 1e-4)])
    assert a[1].tolist() == [0.0] * 4  # all alike: nothing to learn from this prompt


def test_loss_and_gradient_by_hand():
    """Two completions of 2 and 1 tokens; rho = 1, so the loss is -(A - beta KL) per token, averaged per completion."""
    logps = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    adv = torch.tensor([0.8, -0.3])
    loss, kl = grpo_loss(logps, adv, mask, epsilon=0.2, beta=0.1, reference=ref)
    k = math.exp(-0.5) + 0.5 - 1  # pi_ref/pi - log(pi_ref/pi) - 1 at delta = -0.5; 0 where they agree
    assert loss.item() == pytest.approx(-(0.8 - 0.1 * k / 2) - 0.8 / 1 * 0 + 0.3)  # completion 1: mean of (0.8 - .1k, 0.8)
    assert kl.item() == pytest.approx(k / 2)
    loss.backward()
    # d/dlogp of -(A rho) is -A/|o|; of beta KL: beta (1 - exp(delta)) / |o|
    assert logps.grad.tolist()[0] == pytest.approx([(-0.8 + 0.1 * (1 - math.exp(-0.5))) / 2, -0.8 / 2, 0.0])
    assert logps.grad.tolist()[1] == pytest.approx([0.3, 0.0, 0.0])


def test_the_clip_stops_the_gradient_beyond_the_range():
    """With old log-probs (several updates per rollout), a ratio above 1 + eps with a positive advantage is clipped."""
    logps = torch.tensor([[math.log(1.5)], [math.log(1.1)]], requires_grad=True)
    loss, _ = grpo_loss(logps, torch.tensor([1.0, 1.0]), torch.ones(2, 1), epsilon=0.2, beta=0.0, reference=None,
                        old_logps=torch.zeros(2, 1))
    assert loss.item() == pytest.approx(-(1.2 + 1.1))
    loss.backward()
    assert logps.grad.view(-1).tolist() == pytest.approx([0.0, -1.1])  # clipped: no gradient; inside: -A rho


def test_builtin_and_user_rewards(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text("def short(*, completions, **_):\n    return [1.0 if len(c) < 3 else 0.0 for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = method(rewards=["exact_match", "format", "length", "myrewards:short"], reward_weights=[1.0, 0.5, 1.0, 2.0],
                 format_pattern=r"\d+", completion_tokens=8)
    rs = rewards.resolve(cfg)
    total, each = rewards.score(rs, prompts=["p", "p"], completions=[" 12 ", "abcd"], answers=["12", "12"], completion_tokens=[2, 4])
    assert each == {"exact_match": [1.0, 0.0], "format": [1.0, 0.0], "length": [-0.25, -0.5], "myrewards:short": [0.0, 0.0]}
    assert total == pytest.approx([1 + 0.5 - 0.25, -0.5])


USER_REWARDS = """import math

def divides(*, completions, **_):
    return [1 / (len(c) - 4) for c in completions]

def nan(*, completions, **_):
    return [math.nan if c.startswith("a") else 1.0 for c in completions]

def words(*, completions, **_):
    return [c.split()[0] if c.strip() else 0.0 for c in completions]

def one(*, completions, **_):
    return [1.0]

def flags(*, completions, **_):
    return [c == "abcd" for c in completions]
"""


def test_a_fault_in_the_users_reward_function_names_the_function_and_its_line(tmp_path, monkeypatch):
    """The user's reward raises, returns a NaN, a word or too few values: one line naming the reward (and the file and line
    it raised at), at the rollout that called it; never a NaN loss with advice about the learning rate, or a traceback."""
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    columns = dict(prompts=["p", "p"], completions=["abcd", " 12 "], answers=["12", "12"], completion_tokens=[4, 4])

    def fault(name: str) -> str:
        with pytest.raises(ConfigError) as refused:
            rewards.score(rewards.resolve(method(rewards=[name])), **columns)
        return str(refused.value)

    assert fault("user_rewards:divides") == ("method.rewards: user_rewards:divides raised ZeroDivisionError: division by zero at "
                                             f"{tmp_path / 'user_rewards.py'}:4: fix the reward function")
    assert fault("user_rewards:nan") == ("method.rewards: user_rewards:nan returned nan for completion 0 ('abcd'), which is not "
                                         "finite: return one finite number per completion")
    assert fault("user_rewards:words") == ("method.rewards: user_rewards:words returned 'abcd' for completion 0 ('abcd'), which is "
                                           "not a number: return one finite number per completion")
    assert fault("user_rewards:one") == "method.rewards: user_rewards:one returned 1 values for 2 completions: return one number each"
    assert rewards.score(rewards.resolve(method(rewards=["user_rewards:flags"])), **columns)[0] == [1.0, 0.0]  # True counts 1


@pytest.mark.parametrize("kw,message", [
    ({"rewards": ["nope"]}, "method.rewards: nope is not a reward: use exact_match, similarity, format, length, overlong, a function as "
                            "package.module:function, or reward:PATH (a reward model trained with method=reward)"),
    ({"rewards": ["format"]}, "method.rewards: format needs method.format_pattern (the regular expression a well-formed completion "
                              "matches), e.g. method.format_pattern='<answer>.*</answer>'"),
    ({"rewards": ["no_such_module_x:f"]}, "method.rewards: no_such_module_x:f: cannot import no_such_module_x (No module named "
                                          "'no_such_module_x'): is it installed or on PYTHONPATH?"),
    ({"rewards": ["math:nothing"]}, "method.rewards: math:nothing: math has no function 'nothing'"),
    ({"rewards": ["exact_match", "length"], "reward_weights": [1.0]},
     "method.reward_weights has 1 weights for 2 rewards (exact_match, length): give one weight per reward, or none (1 each)"),
])
def test_a_wrong_reward_is_one_line(kw, message):
    with pytest.raises(ConfigError) as e:
        rewards.resolve(method(**kw))
    assert str(e.value) == message


def test_rollout_is_seeded_cut_at_eos_and_labels_only_the_completion(tok):
    net, _ = tiny_model()
    engine, cfg = GenerationEngine(net), method(generations=3, completion_tokens=6, rewards=["length"])
    prompts = [[1, 5, 20, 30], [1, 7, 8]]
    a = sample(engine, prompts, cfg, tok, seed=(0, 1, 0, 0))
    assert a == sample(engine, prompts, cfg, tok, seed=(0, 1, 0, 0))  # a resumed run samples the same completions
    assert a != sample(engine, prompts, cfg, tok, seed=(0, 2, 0, 0))
    assert len(a) == 6 and all(1 <= len(c) <= 6 for c in a)
    assert all(tok.eos_token_id not in c[:-1] for c in a)  # cut after the first EOS, which stays (it is labelled)
    objective = GRPO(cfg)
    objective.rewards = rewards.resolve(cfg)
    batch = objective.scored(prompts, [[9], [10]], a, tok)
    assert batch["input_ids"].shape[0] == 6 and objective.count(batch) == 6
    for i, c in enumerate(a):
        p = prompts[i // 3]
        labels = batch["labels"][i].tolist()
        assert batch["input_ids"][i].tolist()[: len(p) + len(c)] == p + c
        assert labels[: len(p)] == [IGNORE] * len(p) and labels[len(p) : len(p) + len(c)] == c
        assert all(t == IGNORE for t in labels[len(p) + len(c) :])
    r = torch.tensor([-len(c) / 6 for c in a]).view(2, 3)
    assert batch["advantages"].tolist() == pytest.approx(group_advantages(r).view(-1).tolist())
    assert split_rows(batch)[0] == [p for p in prompts for _ in range(3)]


def test_rules(compose):
    base = ["method=grpo"]
    for overrides, message in [
        (["method.gamma=0.5"], "method.gamma: not a key of method=grpo; its keys are name, beta, reference, generations, "
         "completion_tokens, temperature, top_p, mask_truncated_completions, overlong_buffer, dynamic_sampling, sampling_rounds, "
         "tools, max_turns, tool_timeout, rewards, reward_weights, format_pattern, vllm, vllm_memory, vllm_servers, epsilon, epsilon_high, loss_type, scale_rewards, "
         "importance_sampling_level, updates_per_rollout, async_generation"),
        (["method.reference=live"], "method.reference=live has no effect with method=grpo and method.beta=0 (no KL term, no reference): "
                                    "remove it or change the option"),
        (["method.beta=0.04", "method.reference=precomputed"], "method.reference=precomputed cannot score GRPO's completions, which are "
         "sampled while training: use method.reference=live (or adapter_disabled with peft), or method.beta=0 (no KL term)"),
        (["data.packing=true"], "data.packing=true cannot run here: method=grpo samples each prompt's completions as rows of their "
                                "own: set data.packing=false"),
        (["parallelism=pp2", "launcher.nproc_per_node=2"], "method=grpo with parallelism.pp=2 is not supported: pipeline stages cannot "
         "generate the completions (no rank holds the whole model); use fsdp, zero or tp"),
        (["logits=chunked"], "logits=chunked with method=grpo is not supported: the GRPO loss needs each token's log-prob, which the "
                             "chunked head reduces per row; use logits=full"),
        (["method.updates_per_rollout=2", "train.save_every=3"], "train.save_every=3 is not a multiple of "
         "method.updates_per_rollout=2: a checkpoint must fall between rollouts (the sampled completions are not saved); use "
         "train.save_every=2"),
        (["method.rewards=[nope]"], "method.rewards: nope is not a reward: use exact_match, similarity, format, length, overlong, a function as "
                                    "package.module:function, or reward:PATH (a reward model trained with method=reward)"),
    ]:
        with pytest.raises(ConfigError) as e:
            compose([*base, *overrides])
        assert str(e.value) == message, overrides
    cfg = compose([*base, "method.beta=0.04", "method.reference=live"])
    assert cfg.method.beta == 0.04 and compose(base).method.beta == 0.0


def test_the_planner_counts_every_completion_as_a_row(compose, monkeypatch):
    from finetune.planner.counts import architecture
    from finetune.planner.peak import plan

    monkeypatch.syspath_prepend(str(STANDIN))  # method.vllm=true composes where vLLM is installed

    sft = plan(compose(["train.micro_batch_size=8", "train.global_batch_size=16", "data.max_length=80"]))
    grpo = plan(compose(["method=grpo", "method.generations=4", "method.completion_tokens=16", "train.micro_batch_size=2",
                         "train.global_batch_size=4"]))  # rows of data.max_length 64 + 16 sampled tokens
    assert grpo.activations == pytest.approx(sft.activations, rel=0.01)  # 2 prompts x 4 completions = 8 rows
    v = architecture(compose(["method=grpo"]).model).vocab_size  # the loss's fp32 log-softmax at the completion tokens only
    assert (sft.logits, grpo.logits) == (8 * 80 * (12 * v + 8), 8 * 16 * (12 * v + 8))  # (logits_to_keep), not the prompts'
    assert "logits at the completion tokens only (8 rows x up to 16)" in " ".join(grpo.notes)
    padded = [plan(compose([*o, "data.padding_free=false"])) for o in (
        ["train.micro_batch_size=8", "train.global_batch_size=16", "data.max_length=80"],
        ["method=grpo", "method.generations=4", "method.completion_tokens=16", "train.micro_batch_size=2", "train.global_batch_size=4"])]
    assert padded[1].activations == pytest.approx(padded[0].activations, rel=0.01) and padded[1].activations > grpo.activations  # sdpa's mask
    assert padded[1].logits == padded[0].logits  # padded: every position's logits
    kv = 8 * 80 * 2 * 2 * 64 * 4  # rows x tokens x layers x (K, V) x kv_dim x fp32
    logits = 8 * v * 4 * 2  # one decoding step's fp32 logits and probabilities
    assert grpo.rollout == kv + logits and grpo.rollout_peak == grpo.weights + grpo.optimizer + kv + logits + grpo.overhead
    assert f"sampling holds a KV cache of {kv / 2**20:.1f} MiB at 80 tokens" in " ".join(grpo.notes)
    assert grpo.total == max(grpo.backward_peak, grpo.step_peak) > grpo.rollout_peak  # short completions: backward is the peak
    # the KV cache is freed before the step's forward, whose rows (the same completions, with gradients) hold more: it is
    # the peak only where the step holds less than the cache (here by hand: weights + states + a large cache)
    assert dataclasses.replace(grpo, rollout=grpo.backward_peak).peak_at == "sampling (GRPO's rollout)"
    h100 = compose(["method=grpo", "method.vllm=true", "hardware=h100_80g"])
    vllm = plan(h100)  # its share of the GPU at every moment
    assert vllm.rollout == 0 and vllm.reserved == 0.3 * h100.hardware.gpu_memory_gib * 2**30
    assert vllm.total == max(vllm.backward_peak, vllm.step_peak) >= vllm.reserved + vllm.weights + vllm.optimizer


def test_the_planned_kv_cache_is_what_generate_holds(compose):
    """transformers' own cache after sampling 4 x 3 rows: every layer's keys and values at prompt + new - 1 positions
    (the last sampled token is never fed back) equal the planner's kv_cache_bytes."""
    from finetune.planner.counts import architecture
    from finetune.planner.peak import kv_cache_bytes

    net, tok = tiny_model()
    prompts = torch.randint(5, 100, (4, 7))
    torch.manual_seed(0)
    out = net.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True, max_new_tokens=9, min_new_tokens=9,
                       num_return_sequences=3, pad_token_id=tok.pad_token_id, return_dict_in_generate=True)
    cache = out.past_key_values
    held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    arch = architecture(compose(["method=grpo"]).model)  # the same tiny Llama
    assert held == kv_cache_bytes(arch, rows=12, tokens=7 + 9 - 1, tp=1, itemsize=4)


@pytest.mark.slow
def test_two_ranks_with_a_live_reference_through_the_cli(tmp_path, monkeypatch):
    """DDP, a KL term to a live reference, a built-in and a user's reward weighted: the step's metrics, generation timed
    apart. (The user's reward varies with the text, so every group has something to learn from.)"""
    (tmp_path / "chars.py").write_text("def count(*, completions, **_):\n    return [float(len(c) % 5) for c in completions]\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = run_cli("+recipe=quickstart_sft", "method=grpo", "method.rewards=[length,chars:count]", "method.reward_weights=[1.0,2.0]",
                  "method.beta=0.04", "method.reference=live", "method.generations=4", "method.completion_tokens=12",
                  "train.max_steps=3", "optim.warmup_steps=1", "train.micro_batch_size=2", "train.global_batch_size=4",
                  "train.exact_match_samples=4", "train.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    train = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3]
    for m in train:
        assert m["reward"] == pytest.approx(m["rewards/length"] + 2 * m["rewards/chars:count"])
        assert -1.0 <= m["rewards/length"] < 0 and 1 <= m["completion_tokens"] <= 12
        assert m["generation_s"] > 0 and m["kl"] >= 0 and math.isfinite(m["loss"])
    assert train[0]["kl"] == 0.0  # the policy is the reference until the first update
    assert train[-1]["kl"] > 0 and all(m["grad_norm"] > 0 for m in train)
    evals = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "eval"]
    assert set(evals[-1]) >= {"eval_loss", "exact_match"} and "eval_reward" not in evals[-1]
    assert (tmp_path / "run/final/model.safetensors").is_file()


def test_a_text_row_has_no_prompt_to_answer(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "just text"}\n')
    out = run_cli("method=grpo", "data=jsonl", f"data.train={path}", "data.format=text", "launcher.dry_run=true", cwd=tmp_path)
    assert out.returncode == 2
    assert last_line(out.stderr) == ("error: method=grpo samples a response to each row's prompt, and data.format=text rows have none: "
                                     "use alpaca, chat, sharegpt or completion rows")


LAYOUTS = {"fsdp": ["parallelism=fsdp"], "fsdp-lora": ["parallelism=fsdp", "peft=lora"],
           "zero3-lora-adapter_disabled": ["zero=stage3", "peft=lora", "method.beta=0.04", "method.reference=adapter_disabled"],
           "zero2-qlora-adapter_disabled": ["zero=stage2", "peft=qlora", "method.beta=0.04", "method.reference=adapter_disabled"],
           # RLOO with the KL in its reward and dynamic sampling: its refills' rounds agreed across ranks sampling in lockstep
           "fsdp-rloo-dynamic": ["parallelism=fsdp", "method=rloo", "method.beta=0.04", "method.reference=live",
                                 "method.dynamic_sampling=true", "method.sampling_rounds=3"]}


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory, request):
    """layout_run(name, vllm) -> the run directory of a 3-step 2-rank GRPO run in LAYOUTS[name] (each run once per module),
    sampling through vLLM's interface (tests/vllm_standin) with `vllm`: True, an engine on each rank; "server", the
    `vllm_server` fixture's."""
    runs = {}

    def run(name: str, vllm: bool | str = False) -> Path:
        if (name, vllm) not in runs:
            where = tmp_path_factory.mktemp(name)
            served = ["method.vllm=true", f"method.vllm_servers=[{request.getfixturevalue('vllm_server')[0]}]"] if vllm == "server" else []
            with pytest.MonkeyPatch.context() as mp:
                if vllm is True:
                    mp.setenv("PYTHONPATH", f"{STANDIN}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
                launch = run_cli if vllm is True else launch_here  # the stand-in is found on PYTHONPATH by a new process
                method = next((o for o in LAYOUTS[name] if o.startswith("method=")), "method=grpo")
                out = launch("+recipe=quickstart_sft", method, "method.rewards=[length]", "method.generations=4",
                             "method.completion_tokens=12", "train.max_steps=3", "optim.warmup_steps=1", "train.micro_batch_size=2",
                             "train.global_batch_size=4", "train.exact_match_samples=4", "train.progress_bar=false",
                             *(o for o in LAYOUTS[name] if o != method),
                             *(["method.vllm=true"] if vllm is True else served), f"hydra.run.dir={where / 'run'}", cwd=where)
            assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
            runs[name, vllm] = where / "run"
        return runs[name, vllm]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_layouts_generate_in_lockstep_and_train(name, layout_run):
    """FSDP2 and ZeRO-3 gather parameters collectively: generation runs synced across ranks (synced_gpus) and the step trains."""
    run = layout_run(name)
    train = [m for m in read_metrics(run) if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3] and all(1 <= m["completion_tokens"] <= 12 for m in train)
    assert all(m["reward"] == pytest.approx(m["rewards/length"]) for m in train)
    assert any(m["grad_norm"] > 0 for m in train) and "exact_match" in [m for m in read_metrics(run) if m["kind"] == "eval"][-1]
    if "method.dynamic_sampling=true" in LAYOUTS[name]:  # every step's rounds logged; equal groups train only when they ran out
        assert all(1 <= m["sampling_rounds"] <= 3 and (m["equal_trained"] == 0 or m["sampling_rounds"] == 3) for m in train)
        assert train[0]["kl"] == 0.0 and train[-1]["kl"] != 0.0  # RLOO's KL in the reward: the policy leaves the reference


@pytest.mark.slow
@pytest.mark.parametrize("name,vllm", [("fsdp-lora", True), ("zero3-lora-adapter_disabled", True), ("fsdp-lora", "server")])
def test_vllm_sampling_follows_the_generate_run_when_its_weights_are_the_policys(name, vllm, layout_run, request):
    """method.vllm=true through vLLM's interface (tests/vllm_standin: it samples as our generate path does, from the
    weights it was given), on each rank or in a server process (method.vllm_servers, weights pushed over gloo): the
    weights loaded before each rollout are the policy's, gathered from FSDP2's DTensors or ZeRO-3's partitions with
    the adapter merged, so the run takes the same completions, rewards and updates. The server loaded a push per
    rollout and served each rank's prompts."""
    keys = ("loss", "grad_norm", "reward", "completion_tokens", "kl")
    before = request.getfixturevalue("vllm_server")[1]() if vllm == "server" else None
    theirs = [{k: m[k] for k in keys} for m in read_metrics(layout_run(name, vllm)) if m["kind"] == "train"]
    ours = [{k: m[k] for k in keys} for m in read_metrics(layout_run(name)) if m["kind"] == "train"]
    assert len(theirs) == 3 and any(m["grad_norm"] > 0 for m in theirs)
    if before is not None:
        after = request.getfixturevalue("vllm_server")[1]()
        assert (after["pushes"] - before["pushes"], after["requests"] - before["requests"]) == (3, 3 * 2)
    for a, b in zip(ours, theirs):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_two_vllm_servers_sample_apart_and_the_run_follows_the_generate_run(layout_run, vllm_server, tmp_path):
    """method.vllm_servers=[A,B] on 2 FSDP2 + LoRA ranks: rank k pushes the weights to server k and asks it for its prompts'
    completions, seeded as ever: the run is the generate run, and each server had one push and one request a step."""
    from conftest import vllm_server_process

    keys = ("loss", "grad_norm", "reward", "completion_tokens", "kl")
    address, health = vllm_server
    pythonpath = f"{STANDIN}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    with vllm_server_process(tmp_path / "second.log", pythonpath) as (second, second_health):
        before = health()
        out = launch_here("+recipe=quickstart_sft", "method=grpo", "method.rewards=[length]", "method.generations=4",
                          "method.completion_tokens=12", "train.max_steps=3", "optim.warmup_steps=1", "train.micro_batch_size=2",
                          "train.global_batch_size=4", "train.exact_match_samples=4", "train.progress_bar=false", *LAYOUTS["fsdp-lora"],
                          "method.vllm=true", f"method.vllm_servers=[{address},{second}]", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        after, other = health(), second_health()
    assert (after["pushes"] - before["pushes"], after["requests"] - before["requests"]) == (3, 3)
    assert (other["pushes"], other["requests"], other["run"]) == (3, 3, None)
    theirs = [{k: m[k] for k in keys} for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    ours = [{k: m[k] for k in keys} for m in read_metrics(layout_run("fsdp-lora")) if m["kind"] == "train"]
    assert len(theirs) == 3 and any(m["grad_norm"] > 0 for m in theirs)
    for a, b in zip(ours, theirs):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mu,extra", [(1, []), (2, []), (1, ["method.dynamic_sampling=true"])])
def test_resume_samples_the_same_completions_and_continues_the_trajectory(mu, extra, tmp_path):
    """mu = method.updates_per_rollout: with 2, steps 1-2 train on step 1's completions (the second against the log-probs
    they were sampled with: a ratio other than 1), steps 3-4 on step 3's; the checkpoint of step 2 falls between. With
    dynamic sampling the refills are drawn again as they were (seeded by the step and round)."""
    common = ["+recipe=quickstart_sft", "method=grpo", "method.rewards=[length]", "method.generations=4", "method.completion_tokens=12",
              f"method.updates_per_rollout={mu}", *extra,
              "parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=4", "optim.warmup_steps=1", "train.micro_batch_size=2",
              "train.global_batch_size=2", "train.exact_match_samples=0", "train.eval_every=0", "train.progress_bar=false", "train.save_every=2"]
    full = launch_here(*common, f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    resumed = launch_here(*common, f"train.resume={tmp_path / 'full/checkpoints/step_2'}", f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    keys = ("loss", "grad_norm", "reward", "completion_tokens") + (("sampling_rounds", "equal_groups") if extra else ())
    rows = {name: [{k: m[k] for k in keys} for m in read_metrics(tmp_path / name) if m["kind"] == "train"] for name in ("full", "resumed")}
    assert len(rows["resumed"]) == 2 and rows["resumed"] == rows["full"][2:]  # the same completions, rewards and update
    assert any(r["grad_norm"] > 0 for r in rows["full"][2:])
    if mu == 2:
        full = [m for m in read_metrics(tmp_path / "full") if m["kind"] == "train"]
        assert [m["generation_s"] > 0 for m in full] == [True, False, True, False]  # sampled at steps 1 and 3 only
        assert full[1]["reward"] == full[0]["reward"] and full[3]["completion_tokens"] == full[2]["completion_tokens"]


def test_several_updates_reuse_one_rollout_with_the_sampling_log_probs(tok):
    from finetune.data.batches import collate
    from finetune.data.tokenize import Example
    from finetune.methods.losses import token_logps

    net, _ = tiny_model()
    engine, cfg = GenerationEngine(net), method(generations=2, completion_tokens=4, rewards=["length"], updates_per_rollout=2)
    objective = GRPO(cfg)
    prompts = collate([Example([1, 5, 20, 9], [IGNORE] * 3 + [9], 3, "x"), Example([1, 7, 9], [IGNORE] * 2 + [9], 2, "y")], tok.pad_token_id)
    first, seconds = objective.rollout(engine, [prompts], step=1, tokenizer=tok, seed=0)
    with torch.no_grad():
        assert torch.equal(first[0]["old_logps"], token_logps(net.eval(), first[0]))  # the policy that sampled them
    again, none = objective.rollout(engine, [prompts], step=2, tokenizer=tok, seed=0)
    assert again is first and none == 0.0 and seconds > 0
    third, _ = objective.rollout(engine, [prompts], step=3, tokenizer=tok, seed=0)
    assert third is not first
    with pytest.raises(RuntimeError, match="step 4 is inside a rollout of method.updates_per_rollout=2 steps"):
        GRPO(cfg).rollout(engine, [prompts], step=4, tokenizer=tok, seed=0)  # a fresh objective (resumed) mid-rollout


def test_the_rollout_benchmark_prints_both_rates_and_their_ratio():
    import re
    import subprocess
    import sys

    from conftest import REPO

    out = subprocess.run([sys.executable, str(REPO / "scripts/benchmark_rollout.py"), "--prompts", "2", "--generations", "2",
                          "--new-tokens", "4", "--hidden", "32", "--layers", "1", "--repeats", "1"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-2] == "| rows | new tokens | model.generate | grpo rollout | rollout / generate |"
    assert re.fullmatch(r"\| 2 x 2 \| 4 \| [\d,]+ tokens/s \| [\d,]+ tokens/s \| [\d.]+x \|", out.stdout.splitlines()[-1])


def test_a_reward_model_scores_prompt_and_completion_and_a_causal_lm_is_refused(tmp_path):
    """reward:PATH: a sequence classifier (method=reward's final/) scores each prompt + completion as it would alone."""
    from transformers import AutoModelForSequenceClassification, LlamaForSequenceClassification

    net, tok = tiny_model()
    net.save_pretrained(tmp_path / "causal")
    tok.save_pretrained(tmp_path / "causal")
    with pytest.raises(ConfigError) as e:
        rewards.resolve(method(rewards=[f"reward:{tmp_path / 'causal'}"]))
    assert str(e.value) == (f"method.rewards: reward:{tmp_path / 'causal'}: {tmp_path / 'causal'} is not a sequence classifier: train "
                            "one with method=reward (a merged adapter works too)")
    torch.manual_seed(0)
    scorer = LlamaForSequenceClassification(net.config.__class__(**{**net.config.to_dict(), "num_labels": 1,
                                                                       "pad_token_id": tok.pad_token_id}))
    scorer.save_pretrained(tmp_path / "scorer")
    tok.save_pretrained(tmp_path / "scorer")
    (fn,) = [r.fn for r in rewards.resolve(method(rewards=[f"reward:{tmp_path / 'scorer'}"]), load_models=True)]
    got = fn(prompts=["ab", "x"], completions=["c", "yz"], answers=["", ""], completion_tokens=[1, 2])
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "scorer").eval()
    with torch.no_grad():
        alone = [loaded(**tok(text, return_tensors="pt")).logits[0, 0].item() for text in ("abc", "xyz")]
    assert got == pytest.approx(alone, abs=1e-5)


STANDIN = Path(__file__).parent / "vllm_standin"


def test_vllm_receives_the_merged_model_under_its_hugging_face_names():
    """hf_weights of a PEFT model (LoRA with trained B, lm_head in modules_to_save) = the names and values of peft's own
    merge_and_unload, and the training weights are untouched; loaded into the stand-in, its logits are the policy's."""
    import copy

    from peft import LoraConfig, get_peft_model

    from finetune.methods.vllm_rollout import hf_weights

    net, tok = tiny_model()
    policy = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                                            modules_to_save=["lm_head"]))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    sent = dict(hf_weights(policy))
    merged = copy.deepcopy(policy).merge_and_unload()
    expected = dict(merged.named_parameters())
    assert sorted(sent) == sorted(expected)
    for name, value in sent.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in before.items())
    assert not torch.equal(sent["model.layers.0.self_attn.q_proj.weight"], before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])


def test_vllm_draws_each_prompts_samples_from_streams_of_their_own(monkeypatch):
    """vLLM seeds a request's k-th sample with its seed + k (a child request per sample). Each prompt's request gets a
    seed spaced by the group size: across the prompts of a rollout, and of the next step, no two samples share a
    stream. Seeds one apart (the earlier seed + i) made sample k of prompt i a copy of sample k-1 of prompt i+1's draws."""
    import types

    from finetune.vllm import engine as vllm_engine
    from finetune.methods import vllm_rollout
    from finetune.methods.grpo import GrpoConfig

    class Recorder:  # vLLM's LLM.generate as far as seeding goes: one child request per sample, seeded seed + k
        def generate(self, requests, params, use_tqdm=False):
            self.streams = [p.seed + k for p in params for k in range(p.n)]
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1])] * p.n) for p in params]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: types.SimpleNamespace(**kw)))
    sampler = object.__new__(vllm_rollout.VllmSampler)
    sampler.llm = Recorder()
    cfg = GrpoConfig(generations=8)
    streams = []
    for step in range(3):
        sampler.sample([[5, 6]] * 16, cfg, seed=hash((0, step, 0, 0)) % 2**63)
        streams += sampler.llm.streams
    assert len(streams) == 3 * 16 * 8 and len(set(streams)) == len(streams)
    assert all(0 <= s < 2**63 for s in streams)
    assert vllm_engine.prompt_seeds(2**63 - 1, 4, 8) == [(2**63 - 1) % (2**63 - 32) + 8 * i for i in range(4)]


def test_vllm_is_refused_where_it_cannot_run(compose, monkeypatch):
    """Not installed; layouts whose weights a vLLM engine cannot take whole (tp), a 4-bit base, DoRA; its memory share without it."""
    from finetune.methods.vllm_rollout import vllm_rules

    base = ["+recipe=quickstart_sft", "method=grpo"]
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^method.vllm=true: vLLM is not installed here: pip install vllm"):
        vllm_rules(compose([*base, "method.vllm=true"]))
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(STANDIN))
    for extra, start in ((["parallelism=tp2", "launcher.nproc_per_node=2"], "method.vllm=true with parallelism.tp=2 cp=1 is not supported"),
                         (["peft=qlora"], "method.vllm=true with peft=qlora is not supported"),
                         (["peft=dora"], "method.vllm=true with peft=dora is not supported")):
        with pytest.raises(ConfigError) as e:
            compose([*base, "method.vllm=true", *extra])
        assert str(e.value).startswith(start)
    with pytest.raises(ConfigError, match=r"^method.vllm_memory=0.5 is set but method.vllm=false"):
        compose([*base, "method.vllm_memory=0.5"])


def test_a_vllm_server_needs_no_vllm_here_and_is_refused_where_it_cannot_serve(compose, monkeypatch, tmp_path):
    """method.vllm_servers: vLLM runs in the server's environment, so none is needed where training runs; the address's
    form, its use without method.vllm, a colocated memory share beside it, and layouts whose ranks share a batch; a
    launch where no server answers stops before any rank starts, saying how to start one."""
    import socket
    from finetune.methods.vllm_rollout import vllm_rules
    from finetune.planner.peak import plan

    base = ["+recipe=quickstart_sft", "method=grpo", "method.vllm=true"]
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    cfg = compose([*base, "method.vllm_servers=[localhost:8000]", "parallelism=fsdp", "launcher.nproc_per_node=2"])
    vllm_rules(cfg)
    served = plan(cfg)
    assert served.reserved == 0 and served.rollout == 0 and any("a vLLM server (method.vllm_servers) samples" in n for n in served.notes)
    for extra, start in ((["method.vllm_servers=[localhost]"], "method.vllm_servers=['localhost'] must be a list of HOST:PORT"),
                         (["method.vllm_servers=[a:1,b:2,c:3]", "parallelism=ddp", "launcher.nproc_per_node=2"],
                          "method.vllm_servers names 3 servers for 2 ranks: rank k pushes the weights to server k"),
                         (["method.vllm=false", "method.vllm_servers=[gpu7:8000]"], "method.vllm_servers=[gpu7:8000] is set but method.vllm=false"),
                         (["method.vllm_servers=[gpu7:8000]", "method.vllm_memory=0.5"], "method.vllm_memory=0.5 with method.vllm_servers: "
                          "a server takes its share of its own GPU"),
                         (["method.vllm_servers=[gpu7:8000]", "parallelism=tp2", "launcher.nproc_per_node=2"],
                          "method.vllm_servers with parallelism.tp=2 cp=1 is not supported")):
        with pytest.raises(ConfigError) as e:
            compose([*base, *extra])
        assert str(e.value).startswith(start), str(e.value)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    out = run_cli(*base, f"method.vllm_servers=[127.0.0.1:{port}]", "train.max_steps=3", "optim.warmup_steps=1",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2 and last_line(out.stderr) == (
        f"error: method.vllm_servers=[127.0.0.1:{port}]: no vLLM server answers at http://127.0.0.1:{port} ([Errno 111] Connection refused): "
        f"start one on the devices it should use with `python -m finetune.vllm --port {port}` (docs/grpo.md, vLLM server)")
    assert not (tmp_path / "run/ranks").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None or
                    os.environ.get("PYTHONPATH", "").find("vllm_standin") >= 0, reason="needs CUDA and vLLM itself")
def test_vllm_itself_samples_from_the_synced_policy_and_trains(shipped, tmp_path, monkeypatch):
    """vLLM on a GPU: built with dummy weights, synced from the quickstart model (LoRA with a trained B merged in), its greedy
    completions of the eval prompts are transformers' own on the same weights (bf16: a rare near-tie may flip, so 90%);
    then 3 GRPO steps through the CLI sample with it."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from finetune.data.batches import left_padded
    from finetune.methods.vllm_rollout import VllmSampler

    import socket

    with socket.socket() as free:  # vLLM's external launcher reads the process group's place from the environment: this
        free.bind(("127.0.0.1", 0))  # process's own (restored after the test, so the CLI run below starts clean)
        port = free.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(key, value)
    final = shipped / "outputs/quickstart_sft/final"
    tok = AutoTokenizer.from_pretrained(final)
    net = AutoModelForCausalLM.from_pretrained(final, dtype=torch.bfloat16).cuda().eval()
    policy = get_peft_model(net, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    sampler = VllmSampler(SimpleNamespace(generation_model=policy, dtype=torch.bfloat16, dp_rank=0), tok,
                          method(vllm=True, vllm_memory=0.2, completion_tokens=16), prompt_tokens=64)
    sampler.sync(SimpleNamespace(generation_model=policy))
    prompts = [tok(f"<|user|>reverse\n{w}\n<|assistant|>", add_special_tokens=False)["input_ids"] for w in ("abc", "hello", "qwerty", "xyz")] * 8
    theirs = [list(o.outputs[0].token_ids) for o in sampler.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                           SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)]
    batch = {k: v.cuda() for k, v in left_padded(prompts, tok.pad_token_id).items()}
    with torch.no_grad():
        out = policy.generate(**batch, do_sample=False, max_new_tokens=16, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    ours = [r[: r.index(tok.eos_token_id) + 1] if tok.eos_token_id in r else r for r in out[:, batch["input_ids"].shape[1]:].tolist()]
    assert sum(a == b for a, b in zip(ours, theirs)) >= 0.9 * len(ours), (ours[:4], theirs[:4])
    monkeypatch.undo()
    run = run_cli("+recipe=quickstart_grpo", f"model.path={final}", "method.vllm=true", "method.vllm_memory=0.2", "peft=lora",
                  "parallelism=single", "launcher.nproc_per_node=1", "train.device=cuda", "precision=bf16", "train.max_steps=3",
                  "train.eval_every=0", "train.exact_match_samples=0", "train.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}",
                  cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    train = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert len(train) == 3 and all(m["generation_s"] > 0 and 1 <= m["completion_tokens"] <= 16 for m in train)


def test_a_vllm_server_samples_for_one_run_at_a_time(vllm_server):
    """Two runs on one server would push their weights into one engine in turn and sample from each other's: the second
    is refused (409, one line) while the first is live; once the first ends (/close) the second takes it, and the first's
    requests are refused from then on. A push the engine cannot load is drained and refused, naming the tensor."""
    import copy
    from types import SimpleNamespace

    from finetune.methods.grpo import GrpoConfig
    from finetune.methods.vllm_rollout import ServedSampler
    from finetune.vllm.wire import ServerError

    address, health = vllm_server
    net, tok = tiny_model()
    engine, cfg = SimpleNamespace(generation_model=net.eval(), dtype=None, dp_rank=0), GrpoConfig(generations=2, completion_tokens=4)
    first = ServedSampler([address], engine, tok, cfg, prompt_tokens=8)
    first.sync(engine)
    drawn = first.sample([[5, 6, 7]], cfg, seed=1)
    assert len(drawn) == 2 and health()["run"] == first.run
    broken = copy.deepcopy(net)  # a weight the engine has no place for: the server drains the push, then says which
    broken.extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ServerError, match=r"refused /weights: ValueError: loading extra \(\(3,\), torch.float32\): KeyError"):
        first.sync(SimpleNamespace(generation_model=broken))
    with pytest.raises(ServerError, match="refused /generate: ValueError: /generate before a whole /weights push"):
        first.sample([[5, 6, 7]], cfg, seed=1)
    first.sync(engine)  # the stream stayed in step: the next push loads
    with pytest.raises(ServerError, match=r"refused /init: this server samples for another run \(its last request 0 s ago; it is "
                                          r"free when that run ends or after --idle-s=600 s without a request\): start a server of "
                                          r"its own for this run$"):
        ServedSampler([address], engine, tok, cfg, prompt_tokens=8)
    first.close()
    second = ServedSampler([address], engine, tok, cfg, prompt_tokens=8)
    second.sync(engine)
    assert second.sample([[5, 6, 7]], cfg, seed=1) == drawn  # the same weights pushed, the same seed
    with pytest.raises(ServerError, match="refused /generate: this server samples for another run"):
        first.sample([[5, 6, 7]], cfg, seed=1)
    second.close()
    assert health()["run"] is None


def test_the_vllm_server_runs_without_finetunes_dependencies():
    """The server runs in vLLM's own virtualenv, where `pip install --no-deps finetune` brings it: importing it loads no
    other module of finetune and none of Hydra, OmegaConf, torch or transformers (vLLM brings those it needs)."""
    import subprocess

    probe = ("import sys, finetune.vllm.server; print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('finetune', 'hydra', 'omegaconf', 'torch', 'transformers', 'datasets', 'peft')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(["finetune", "finetune.vllm", "finetune.vllm.engine", "finetune.vllm.server", "finetune.vllm.wire"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None or
                    os.environ.get("PYTHONPATH", "").find("vllm_standin") >= 0, reason="needs CUDA and vLLM itself")
def test_a_vllm_server_on_the_gpu_samples_for_a_run_and_it_trains(shipped, tmp_path):
    """vLLM itself as the server (0.3 of this GPU), the quickstart's model sent to it; 3 GRPO steps through the CLI on CPU
    (two processes cannot share one GPU in an NCCL group: the weights go over gloo here, NCCL is for two GPUs), each
    rollout pushed, each rank's prompts served."""
    from conftest import vllm_server_process

    with vllm_server_process(tmp_path / "server.log", os.environ.get("PYTHONPATH", ""), "--gpu-memory", "0.3") as (address, health):
        run = run_cli("+recipe=quickstart_grpo", f"model.path={shipped / 'outputs/quickstart_sft/final'}", "method.vllm=true",
                      f"method.vllm_servers=[{address}]", "train.max_steps=3", "train.eval_every=0", "train.exact_match_samples=0",
                      "train.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + (tmp_path / "server.log").read_text()[-3000:]
        assert health()["pushes"] == 3 and health()["requests"] == 3 * 2
    train = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert len(train) == 3 and all(1 <= m["completion_tokens"] <= 16 for m in train)


def test_a_vllm_built_for_another_torch_is_refused_before_launch(monkeypatch):
    """vLLM's releases pin their own torch (0.33.0: torch==2.14.0, transformers<5.21): installed into this environment they
    replace the tested versions, or left beside them they do not run. Its package metadata says which: one line."""
    from importlib import metadata

    from finetune.methods import vllm_rollout as grpo

    installed = {"vllm": "0.33.0", "torch": "2.13.0+cpu", "transformers": "5.24.0"}
    pins = ["transformers<5.21.0,>=5.16.1", "torch==2.14.0", "torchaudio==2.11.0", "pytest; extra == 'test'"]

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(metadata, "requires", lambda name: pins if name == "vllm" else [])
    assert grpo.vllm_mismatch() == "vLLM 0.33.0 needs transformers<5.21.0,>=5.16.1, but this environment has transformers 5.24.0"
    installed["transformers"] = "5.20.0"
    assert grpo.vllm_mismatch() == "vLLM 0.33.0 needs torch==2.14.0, but this environment has torch 2.13.0+cpu"
    installed["torch"] = "2.14.0+cu128"
    assert grpo.vllm_mismatch() is None  # a CUDA build of the pinned release
    del installed["vllm"]
    assert grpo.vllm_mismatch() is None  # no metadata (the stand-in, a source checkout): nothing to compare


@pytest.mark.parametrize("name,options", [
    ("grpo", {"loss_type": "grpo", "updates_per_rollout": 2}),
    ("grpo", {"loss_type": "dapo", "mask_truncated_completions": True}),
    ("grpo", {"loss_type": "bnpo", "importance_sampling_level": "sequence", "updates_per_rollout": 2}),
    ("grpo", {"loss_type": "dr_grpo"}),
    ("rloo", {}),
])
def test_padding_free_rollouts_give_the_padded_loss_metrics_and_gradients(name, options):
    """data.padding_free (the online methods' default): a rollout's completions, each after its prompt, end to end in
    one row, each attending only to itself, the output layer computing the labelled positions only (logits_to_keep);
    what the forward gives per token laid back out as the padded rows (`on_grid`): the padded batch's loss, metrics,
    count and gradients, with the sampler's log-probs (the ratio of a rollout's second update), truncated completions
    masked, and a tool turn's tokens unlabelled inside a completion."""
    from finetune.data.batches import SAMPLES
    from finetune.methods.online import Group
    from finetune.methods.rloo import RLOO, RlooConfig

    net, tok = tiny_model()
    torch.manual_seed(0)
    word = lambda n: torch.randint(5, 60, (n,)).tolist()  # noqa: E731
    groups = []
    for i in range(3):
        completions = [word(n) + ([tok.eos_token_id] if n % 2 else []) for n in (2, 9, 5, 12)]
        owned = [[k % 4 != 2 for k in range(len(c))] for c in completions] if i == 1 else None  # a tool turn's tokens: context
        rewards = [0.1, 0.7, 0.4, 0.2 + i]
        groups.append(Group(word(7 + 3 * i), word(3), (), completions, rewards, {"exact_match": rewards}, owned=owned))
    results, heads = [], []  # the positions the output layer computed, per forward
    net.get_output_embeddings().register_forward_hook(lambda _, args, out: heads.append(tuple(args[0].shape[:2])))
    for flat in (False, True):
        objective = GRPO(method(**options)) if name == "grpo" else RLOO(RlooConfig())
        objective.flat = flat
        batch = objective.batch_of(groups, tok)
        if flat:
            assert batch["input_ids"].shape[0] == 1 and SAMPLES in batch
            assert batch[SAMPLES][0].bincount().tolist() == [len(g.prompt) + len(c) for g in groups for c in g.completions]
        else:
            assert batch["input_ids"].shape[0] == 12
        batch = objective.finished(GenerationEngine(net), batch)
        if "old_logps" in batch:  # the sampler was another policy: the ratio leaves 1, the clip acts
            batch["old_logps"] = batch["old_logps"] + 0.3 * torch.sin(torch.arange(batch["old_logps"].numel())).view_as(batch["old_logps"])
        net.zero_grad()
        loss, metrics = objective(net, batch)
        loss.backward()
        results.append((loss.item(), {k: float(v) for k, v in metrics.items()}, objective.count(batch), [p.grad.clone() for p in net.parameters()]))
    (loss_p, metrics_p, count_p, grads_p), (loss_f, metrics_f, count_f, grads_f) = results
    labelled = sum(len(c) for g in groups for c in g.completions) - sum(o.count(False) for o in groups[1].owned)
    assert heads[-1] == (1, labelled) and heads[0] == (12, max(len(g.prompt) + len(c) for g in groups for c in g.completions))
    assert count_f == count_p and loss_p != 0
    assert loss_f == pytest.approx(loss_p, rel=1e-5) and metrics_f == pytest.approx(metrics_p, rel=1e-5, abs=1e-6)
    assert all(torch.allclose(f, p, rtol=1e-4, atol=1e-6) for f, p in zip(grads_f, grads_p))
