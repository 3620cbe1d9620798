"""DPO: the losses against hand-computed values, their gradient direction, preference data,
the three references, and runs through the real CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from finetune.config import ASSETS, ConfigError, DataConfig, MethodConfig
from finetune.data.batches import collate
from finetune.data.forms import to_pair
from finetune.data.sources import Rows
from finetune.data.examples import tokenize
from finetune.data.tokenize import IGNORE
from finetune.methods.dpo import DPO, dpo_loss
from finetune.methods.losses import sequence_logps, token_loss_sum
from finetune.methods.dpo import DpoConfig, DpoLoss

from conftest import last_line, read_metrics, run_cli, tiny_model, train_here
from ranks import launch_here

LOG2 = math.log(2)


def method(**kw) -> MethodConfig:
    return DpoConfig(**kw)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# Fixed log-probs of one pair: policy chosen -1 (2 tokens), rejected -3 (4 tokens); reference -2 and -2.
C, R, RC, RR, NC, NR = t(-1.0), t(-3.0), t(-2.0), t(-2.0), t(2.0), t(4.0)


def sp(x: float) -> float:
    """softplus: -log sigmoid(-x)."""
    return math.log1p(math.exp(x))


@pytest.mark.parametrize(
    "cfg,expected",
    [
        # margin h = (-1 - -2) - (-3 - -2) = 2; sigmoid: -log s(beta h)
        (method(beta=0.1), sp(-0.2)),
        (method(beta=1.0), sp(-2.0)),
        # conservative DPO: (1 - eps) * -log s(beta h) + eps * -log s(-beta h)
        (method(beta=0.1, label_smoothing=0.2), 0.8 * sp(-0.2) + 0.2 * sp(0.2)),
        # ipo on per-token log-probs: h = (-0.5 - -1) - (-0.75 - -0.5) = 0.75; (h - 1/(2 beta))^2
        (method(loss=DpoLoss.ipo, beta=0.1), (0.75 - 5.0) ** 2),
        (method(loss=DpoLoss.ipo, beta=2.0), (0.75 - 0.25) ** 2),
        # hinge: relu(1 - beta h)
        (method(loss=DpoLoss.hinge, beta=0.1), 0.8),
        (method(loss=DpoLoss.hinge, beta=1.0), 0.0),
        # simpo (no reference): -log s(beta (avg_c - avg_r) - gamma); beta defaults to 2
        (method(loss=DpoLoss.simpo, gamma=1.0), sp(-(2.0 * (-0.5 + 0.75) - 1.0))),
        (method(loss=DpoLoss.simpo, beta=2.0, gamma=0.0, label_smoothing=0.1), 0.9 * sp(-0.5) + 0.1 * sp(0.5)),
    ],
    ids=["sigmoid", "sigmoid-beta1", "sigmoid-smoothing", "ipo", "ipo-beta2", "hinge", "hinge-beta1", "simpo", "simpo-smoothing"],
)
def test_losses_by_hand(cfg, expected):
    ref = (None, None) if cfg.loss == DpoLoss.simpo else (RC, RR)
    losses, chosen_rewards, rejected_rewards = dpo_loss(C, R, *ref, NC, NR, cfg)
    assert losses.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    if cfg.loss in (DpoLoss.sigmoid, DpoLoss.hinge):  # beta * (policy - reference), summed log-probs
        assert (chosen_rewards.item(), rejected_rewards.item()) == pytest.approx((cfg.beta * 1.0, cfg.beta * -1.0))
    if cfg.loss == DpoLoss.simpo:  # beta * mean token log-prob
        assert (chosen_rewards.item(), rejected_rewards.item()) == pytest.approx((2.0 * -0.5, 2.0 * -0.75))


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 10.0])
def test_policy_equal_to_reference_costs_log2_whatever_beta(beta):
    losses, chosen_rewards, rejected_rewards = dpo_loss(C, R, C, R, NC, NR, method(beta=beta))
    assert losses.item() == pytest.approx(LOG2, rel=1e-12)
    assert chosen_rewards.item() == rejected_rewards.item() == 0.0  # accuracy counts chosen > rejected: not yet


@pytest.mark.parametrize("loss", list(DpoLoss))
def test_gradient_raises_chosen_and_lowers_rejected(loss):
    chosen, rejected = t(-1.0).requires_grad_(), t(-3.0).requires_grad_()
    cfg = method(loss=loss, beta=0.1)
    ref = (None, None) if loss == DpoLoss.simpo else (RC, RR)
    dpo_loss(chosen, rejected, *ref, NC, NR, cfg)[0].sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()  # descent raises log p(chosen), lowers log p(rejected)


def test_validation_refuses_what_has_no_effect(compose):
    base = ["method=dpo", "data=quickstart_dpo"]
    cases = [
        (["method.reference=adapter_disabled"], "method.reference=adapter_disabled uses the base model under a PEFT adapter: "
         "add peft=lora (or qlora/dora), or use method.reference=precomputed"),
        (["data.packing=true"], "data.packing=true is not supported with method=dpo (chosen and rejected are scored as separate "
         "rows): set data.packing=false"),
        (["method.loss=simpo", "method.reference=live"], "method.reference=live has no effect with method.loss=simpo "
         "(reference-free): remove it or change the option"),
        (["method.gamma=0.5"], "method.gamma=0.5 has no effect with method.loss=sigmoid (only with simpo): remove it or change the option"),
        (["method.loss=ipo", "method.label_smoothing=0.1"], "method.label_smoothing=0.1 applies to method.loss=sigmoid or simpo, not ipo"),
        (["method.label_smoothing=0.5"], "method.label_smoothing=0.5 must be in [0, 0.5)"),
        (["method.beta=0"], "method.beta=0.0 must be positive"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError) as e:
            compose([*base, *extra])
        assert str(e.value) == message, extra
    with pytest.raises(ConfigError) as e:
        compose(["method.beta=0.2"])
    assert str(e.value) == "method.beta: not a key of method=sft; its keys are name"


# ---------------------------------------------------------------------------------------------
# Preference data


@pytest.fixture(scope="module")
def tok():
    return tiny_model()[1]


def test_three_row_forms_give_the_same_pair(tok):
    rows = [
        {"prompt": "reverse\nabc", "chosen": "cba", "rejected": "cab"},
        {"prompt": [{"role": "user", "content": "reverse\nabc"}], "chosen": [{"role": "assistant", "content": "cba"}],
         "rejected": {"role": "assistant", "content": "cab"}},
        {"chosen": [{"role": "user", "content": "reverse\nabc"}, {"role": "assistant", "content": "cba"}],
         "rejected": [{"role": "user", "content": "reverse\nabc"}, {"role": "assistant", "content": "cab"}]},
    ]
    pairs, stats = tokenize(Rows(rows, "mem"), tok, DataConfig(train="mem"), "data.train", "dpo")
    assert stats.rows == 3 and stats.truncated == stats.dropped == 0
    assert all(p.chosen.input_ids == pairs[0].chosen.input_ids and p.rejected.input_ids == pairs[0].rejected.input_ids for p in pairs)
    p = pairs[0]
    # The prompt is shared and carries no labels; the labels are exactly the response and EOS.
    n = p.chosen.prompt_len
    assert p.chosen.input_ids[:n] == p.rejected.input_ids[:n] and n == p.rejected.prompt_len
    assert set(p.chosen.labels[:n]) == {IGNORE}
    assert tok.decode(p.chosen.labels[n:]) == "cba</s>" and tok.decode(p.rejected.labels[n:]) == "cab</s>"
    # The SFT row with the same prompt renders the same prompt tokens.
    sft, _ = tokenize(Rows([{"instruction": "reverse", "input": "abc", "output": "cba"}], "mem"), tok, DataConfig(train="mem"), "x")
    assert sft[0].input_ids == p.chosen.input_ids


def test_multi_turn_prompt_labels_only_the_final_response(tok):
    prompt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "reverse\nab"}]
    (pair,), _ = tokenize(Rows([{"prompt": prompt, "chosen": "ba", "rejected": "ab"}], "mem"), tok, DataConfig(train="mem"),
                               "data.train", "dpo")
    labelled = [t for t in pair.chosen.labels if t != IGNORE]
    assert tok.decode(labelled) == "ba</s>"


def test_truncation_keeps_the_prompt_and_is_counted(tok):
    rows = Rows([{"prompt": "p", "chosen": "x" * 40, "rejected": "y"}, {"prompt": "q" * 40, "chosen": "a", "rejected": "b"},
                 {"prompt": "r", "chosen": "c", "rejected": "d"}], "mem.jsonl", lines=[1, 2, 3])
    cfg = DataConfig(train="mem", max_length=30)
    pairs, stats = tokenize(rows, tok, cfg, "data.train", "dpo")
    assert (stats.rows, stats.truncated, stats.dropped) == (3, 1, 1)
    first = pairs[0]
    assert len(first.chosen.input_ids) == 30 and len(first.rejected.input_ids) < 30
    assert first.chosen.input_ids[: first.chosen.prompt_len] == first.rejected.input_ids[: first.rejected.prompt_len]
    cfg.long_prompt = "error"
    with pytest.raises(ConfigError) as e:
        tokenize(rows, tok, cfg, "data.train", "dpo")
    # <|user|> + 40 characters + newline + <|assistant|>
    assert str(e.value) == ("mem.jsonl:2: the prompt is 43 tokens, data.max_length=30 leaves no room for the response: "
                            "raise data.max_length or set data.long_prompt=drop")


@pytest.mark.parametrize(
    "row,message",
    [
        ({"instruction": "a", "output": "b"}, "f:3: method=dpo needs preference rows with 'chosen' and 'rejected' (and 'prompt' "
         "unless they are whole conversations); keys present: instruction, output"),
        ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
          "rejected": [{"role": "user", "content": "z"}, {"role": "assistant", "content": "c"}]},
         "f:3: 'chosen' and 'rejected' must share every message but the last (the prompt); they differ before it"),
        ({"prompt": "a", "chosen": [{"role": "user", "content": "b"}], "rejected": "c"},
         "f:3: 'chosen' must be the response: text or one assistant message, got 1 message(s)"),
        ({"prompt": "a", "chosen": "b", "rejected": 3}, "f:3: 'rejected' must be a list of {role, content} messages, got int"),
    ],
)
def test_bad_preference_rows_are_named(row, message):
    with pytest.raises(ConfigError) as e:
        to_pair(row, None, "f:3")
    assert str(e.value) == message


def test_data_and_method_must_agree_through_the_cli(tmp_path):
    out = run_cli("method=dpo", "data=quickstart", cwd=tmp_path)
    assert out.returncode == 2
    assert last_line(out.stderr) == "error: method=dpo trains on preference pairs: data.format=alpaca must be preference or auto"
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    out = run_cli("data=jsonl", f"data.train={path}", cwd=tmp_path)
    assert out.returncode == 2
    assert last_line(out.stderr) == (f"error: {path}:1: this row is a preference pair (chosen/rejected), which trains with "
                                     "method=dpo: add method=dpo, or use alpaca/chat rows for method=sft")


# ---------------------------------------------------------------------------------------------
# The objective on a real model


def pairs_batch(tok, n=4):
    rows = Rows([json.loads(line) for line in (ASSETS / "data/quickstart_dpo/train.jsonl").read_text().splitlines()[:n]], "train")
    pairs, _ = tokenize(rows, tok, DataConfig(train="x", max_length=64), "data.train", "dpo")
    return collate(pairs, tok.pad_token_id), pairs


@pytest.mark.parametrize("loss", list(DpoLoss))
def test_one_step_raises_chosen_and_lowers_rejected_on_a_model(loss):
    net, tok = tiny_model()
    batch, _ = pairs_batch(tok)
    with torch.no_grad():
        start = sequence_logps(net, batch)[0]
    batch["reference_logps"] = start.double()
    objective = DPO(method(loss=loss))
    total, metrics = objective(net, batch)
    if loss != DpoLoss.simpo:
        assert total.item() / objective.count(batch) == pytest.approx(LOG2 if loss == DpoLoss.sigmoid else
                                                                      {DpoLoss.ipo: 25.0, DpoLoss.hinge: 1.0}[loss], rel=1e-5)
        assert metrics["rewards/accuracy"].item() == 0.0
    total.backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= 0.05 * p.grad
        after = sequence_logps(net, batch)[0]
    chosen_gain, rejected_gain = (after - start).chunk(2)
    assert chosen_gain.mean() > 0 > rejected_gain.mean()


@pytest.mark.parametrize("chunked", [False, True], ids=["logits-full", "logits-chunked"])
@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_padding_free_pairs_give_the_padded_loss_metrics_and_gradients(name, chunked):
    """data.padding_free (the default for pairs): a micro-batch's chosen and rejected rows end to end in one row, each
    attending only to itself, the log-probs summed per sample: the padded batch's loss, metrics and gradients."""
    from finetune.data.batches import SAMPLES
    from finetune.methods.orpo import ORPO, OrpoConfig
    from finetune.rank.head import ChunkedHead

    net, tok = tiny_model()
    head = ChunkedHead(net, chunk_tokens=7) if chunked else None
    padded, pairs = pairs_batch(tok, n=5)
    flat = collate(pairs, tok.pad_token_id, flat=True)
    assert flat["input_ids"].shape == (1, int(padded["attention_mask"].sum()))  # no padding
    assert flat[SAMPLES][0].bincount().tolist() == padded["attention_mask"].sum(-1).tolist()  # one sample per padded row
    with torch.no_grad():
        start = sequence_logps(net, padded)[0]
    assert torch.allclose(sequence_logps(net, flat)[0], start, rtol=1e-5, atol=1e-4)
    flat["reference_logps"] = padded["reference_logps"] = start.double() + 0.1 * torch.arange(10)  # a reference that differs
    objective = DPO(method(beta=0.1), head=head) if name == "dpo" else ORPO(OrpoConfig(), head=head, referenced=False)
    results = []
    for batch in (padded, flat):
        net.zero_grad()
        loss, metrics = objective(net, batch)
        loss.backward()
        results.append((loss.item(), {k: v.item() for k, v in metrics.items()}, [p.grad.clone() for p in net.parameters()],
                        objective.count(batch)))
    (loss_p, metrics_p, grads_p, count_p), (loss_f, metrics_f, grads_f, count_f) = results
    assert count_p == count_f == 5
    assert loss_f == pytest.approx(loss_p, rel=1e-5) and metrics_f == pytest.approx(metrics_p, rel=1e-4, abs=1e-5)
    assert all(torch.allclose(f, p, rtol=1e-4, atol=1e-6) for f, p in zip(grads_f, grads_p))


def test_sft_weight_adds_the_chosen_per_token_nll():
    net, tok = tiny_model()
    batch, pairs = pairs_batch(tok)
    with torch.no_grad():
        batch["reference_logps"] = sequence_logps(net, batch)[0].double()
        plain, _ = DPO(method())(net, batch)
        weighted, _ = DPO(method(sft_weight=0.5))(net, batch)
        chosen = collate([p.chosen for p in pairs], tok.pad_token_id)
        logits = net(input_ids=chosen["input_ids"], attention_mask=chosen["attention_mask"]).logits
        per_pair = [token_loss_sum(logits[i : i + 1], chosen["labels"][i : i + 1]) / (chosen["labels"][i, 1:] != -100).sum()
                    for i in range(len(pairs))]
    assert (weighted - plain).item() == pytest.approx(0.5 * sum(per_pair).item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# The three references, end to end (one process), and through the CLI on 2 ranks

QUICK = ["method=dpo", "data=quickstart_dpo", "train.max_steps=3", "train.micro_batch_size=4", "train.global_batch_size=8",
         "optim.warmup_steps=0", "optim.lr=1e-3", "train.eval_every=0"]


def train_metrics(run_dir):
    return [m for m in read_metrics(run_dir) if m["kind"] == "train"]


@pytest.mark.parametrize("peft,references", [("none", ["precomputed", "live"]), ("lora", ["precomputed", "live", "adapter_disabled"])])
def test_references_agree_and_a_fresh_policy_costs_log2(peft, references, tmp_path):
    runs = {}
    for ref in references:
        summary = train_here([*QUICK, f"peft={peft}", f"method.reference={ref}"], tmp_path / ref)
        runs[ref] = train_metrics(tmp_path / ref)
        assert summary["before"]["eval_loss"] == pytest.approx(LOG2, abs=1e-5)
        assert summary["before"]["eval_rewards/accuracy"] == 0.0  # equal models: every margin exactly 0, not float noise
        assert runs[ref][0]["loss"] == pytest.approx(LOG2, abs=1e-5)
        assert runs[ref][0]["rewards/accuracy"] <= 0.5  # only float noise can separate identical models
    assert (tmp_path / "precomputed/reference_logps.pt").is_file() and not (tmp_path / "live/reference_logps.pt").exists()
    for ref in references[1:]:  # the same trajectory: the reference is the same model however it is held
        assert [m["loss"] for m in runs[ref]] == pytest.approx([m["loss"] for m in runs["precomputed"]], rel=1e-4)
        assert [m["rewards/margin"] for m in runs[ref]] == pytest.approx([m["rewards/margin"] for m in runs["precomputed"]], abs=1e-4)


def test_resume_reads_the_precomputed_reference_back(tmp_path):
    common = [*QUICK, "train.max_steps=4", "train.save_every=2", "data.eval=null"]
    train_here(common, tmp_path / "full")
    train_here([*common, f"train.resume={tmp_path / 'full/checkpoints/step_2'}"], tmp_path / "resumed")
    assert [m["loss"] for m in train_metrics(tmp_path / "resumed")] == pytest.approx(
        [m["loss"] for m in train_metrics(tmp_path / "full")][2:], rel=1e-6)
    (tmp_path / "full/reference_logps.pt").unlink()
    with pytest.raises(ConfigError, match="reference_logps.pt is missing: the precomputed reference log-probs came from the initial model"):
        train_here([*common, f"train.resume={tmp_path / 'full/checkpoints/step_2'}"], tmp_path / "again")


@pytest.mark.slow
def test_two_ranks_lora_with_the_adapter_disabled_reference(tmp_path):
    """The ranks' part (tests/ranks.py); what the launcher starts for a preference recipe on two ranks is the e2e DPO test's."""
    out = launch_here(*QUICK, "train.max_steps=6", "peft=lora", "method.reference=adapter_disabled", "parallelism=ddp",
                      "launcher.nproc_per_node=2", "train.exact_match_samples=8", "train.progress_bar=false",
                      "checkpointing=full", "precision=bf16", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = train_metrics(tmp_path / "run")
    assert metrics[0]["loss"] == pytest.approx(LOG2, abs=2e-3)  # bf16 forward: policy and base agree to bf16 rounding
    assert metrics[-1]["rewards/margin"] > 0
    assert (tmp_path / "run/final/adapter_config.json").is_file()
    assert "reward_acc" in out.stdout


def test_a_missing_start_model_is_made_first_by_its_recipe(tmp_path):
    """model.recipe_if_missing: the DPO run trains its SFT start first (user recipes via --config-dir too)."""
    recipes = tmp_path / "recipes" / "recipe"
    recipes.mkdir(parents=True)
    (recipes / "tiny_sft.yaml").write_text("# @package _global_\ndefaults:\n  - override /data: quickstart\n  - _self_\n"
                                           "train: {max_steps: 2, progress_bar: false, eval_every: 0}\n")
    (recipes / "tiny_dpo.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: pretrained\n  - override /data: quickstart_dpo\n"
        "  - override /method: dpo\n  - _self_\nmodel: {path: made/tiny_sft/final, recipe_if_missing: tiny_sft}\n"
        "train: {max_steps: 2, progress_bar: false, eval_every: 0}\n")
    target = tmp_path / "made/tiny_sft/final"
    dry = run_cli(f"--config-dir={tmp_path / 'recipes'}", "+recipe=tiny_dpo", "launcher.dry_run=true", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert f"# model.path={target} does not exist: a real run first makes it with" in dry.stdout
    assert f"--config-dir={tmp_path / 'recipes'} +recipe=tiny_sft hydra.run.dir={target.parent}" in dry.stdout
    assert not target.exists()
    out = run_cli(f"--config-dir={tmp_path / 'recipes'}", "+recipe=tiny_dpo", f"hydra.run.dir={tmp_path / 'dpo'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"[finetune] model.path={target} does not exist: training it first with +recipe=tiny_sft" in out.stdout
    assert (target / "model.safetensors").is_file()
    assert f"path: {target}" in (tmp_path / "dpo/config.yaml").read_text()  # resolved: ranks need no working directory


@pytest.mark.parametrize(
    "overrides",
    [
        ["peft=qlora", "method.reference=adapter_disabled"],
        ["peft=qlora", "method.reference=live", "precision=bf16"],
        ["peft=dora", "checkpointing=selective", "checkpointing.every=1"],
        ["precision=fp16", "checkpointing=offload"],
        ["precision=bf16", "checkpointing=full", "method.loss=ipo"],
    ],
    ids=lambda o: "+".join(x.split("=")[1] for x in o),
)
def test_dpo_combines_with_memory_strategies(overrides, tmp_path):
    summary = train_here([*QUICK, "train.exact_match_samples=0", "train.memory_report=categories", *overrides], tmp_path)
    first = train_metrics(tmp_path)[0]
    fresh = (0.5 / 0.1) ** 2 if "method.loss=ipo" in overrides else LOG2  # a policy equal to its reference
    assert first["loss"] == pytest.approx(fresh, rel=2e-3)  # bf16/fp16/4-bit forwards: equal to their rounding
    assert all(math.isfinite(m["loss"]) for m in train_metrics(tmp_path))
    assert summary["memory"]["mem_peak_total_mib"] > 0
