"""ORPO (method=orpo): the loss against a hand computation, its gradient, the rules, and runs through the real CLI
from a random model (one stage: no SFT first, no reference)."""

from __future__ import annotations

import math

import pytest
import torch

from finetune import methods
from finetune.config import ConfigError, MethodConfig
from finetune.methods.orpo import ORPO, orpo_loss
from finetune.methods.losses import sequence_logps, token_loss_sum
from finetune.methods.orpo import OrpoConfig

from conftest import read_metrics, run_cli, tiny_model, train_here
from ranks import launch_here

from test_dpo import pairs_batch


def method(**kw) -> MethodConfig:
    return OrpoConfig(**kw)


def test_loss_by_hand():
    """-mean log p(chosen) - lambda log s(log odds(chosen) - log odds(rejected)), odds = p / (1 - p) of the mean log-prob."""
    chosen, rejected = math.log(0.5), math.log(0.2)  # mean token log-probs
    log_odds = math.log(0.5 / 0.5) - math.log(0.2 / 0.8)  # log 4
    expected = -math.log(0.5) - 0.1 * math.log(1 / (1 + math.exp(-log_odds)))  # log s(log 4) = log 0.8
    losses, ratio = orpo_loss(torch.tensor([chosen], dtype=torch.float64), torch.tensor([rejected], dtype=torch.float64), 0.1)
    assert losses.item() == pytest.approx(expected, rel=1e-12) and expected == pytest.approx(math.log(2) - 0.1 * math.log(0.8))
    assert ratio.item() == pytest.approx(math.log(4), rel=1e-12)


def test_gradient_raises_chosen_and_lowers_rejected_and_is_finite_near_certainty():
    chosen, rejected = torch.tensor([-0.5, -1e-9], requires_grad=True), torch.tensor([-0.4, -2.0], requires_grad=True)
    losses, _ = orpo_loss(chosen, rejected, 1.0)
    losses.sum().backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # descending raises chosen and lowers rejected
    assert torch.isfinite(losses).all() and torch.isfinite(chosen.grad).all()


def test_on_a_model_the_loss_is_the_chosen_per_token_nll_plus_the_odds_term():
    net, tok = tiny_model()
    batch, pairs = pairs_batch(tok)
    objective = ORPO(method(beta=0.25), referenced=False)
    with torch.no_grad():
        total, metrics = objective(net, batch)
        logps, lengths = sequence_logps(net, batch)
        mean = (logps / lengths).chunk(2)
        per_pair = [token_loss_sum(net(input_ids=batch["input_ids"][i : i + 1]).logits, batch["labels"][i : i + 1]) / lengths[i]
                    for i in range(len(pairs))]
    assert metrics["nll"].item() == pytest.approx(sum(per_pair).item(), rel=1e-5)  # the SFT term: the chosen rows' per-token NLL
    odds = [(c - torch.log1p(-torch.exp(c))) - (r - torch.log1p(-torch.exp(r))) for c, r in zip(*mean)]
    assert total.item() == pytest.approx(sum(n - 0.25 * torch.nn.functional.logsigmoid(o) for n, o in zip(per_pair, odds)).item(), rel=1e-5)
    assert "reference_logps" not in batch and objective.count(batch) == len(pairs)


def test_rules(compose):
    base = ["method=orpo", "data=quickstart_dpo"]
    for extra, message in [
        (["method.reference=live"], "method.reference: not a key of method=orpo; its keys are name, beta"),
        (["method.loss=ipo"], "method.loss: not a key of method=orpo; its keys are name, beta"),
        (["data.packing=true"], "data.packing=true is not supported with method=orpo (chosen and rejected are scored as separate rows): "
         "set data.packing=false"),
        (["data=quickstart"], "method=orpo trains on preference pairs: data.format=alpaca must be preference or auto"),
    ]:
        with pytest.raises(ConfigError) as e:
            compose([*base, *extra])
        assert str(e.value) == message, extra
    assert methods.get("orpo").reference(compose([*base, "data.streaming=true"]).method) is None  # streams: nothing to precompute


QUICK = ["method=orpo", "data=quickstart_dpo", "train.max_steps=3", "train.micro_batch_size=4", "train.global_batch_size=8",
         "optim.warmup_steps=0", "optim.lr=1e-3", "train.eval_every=0", "train.exact_match_samples=0"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The first step of a plain fp32 run (what the strategies are compared with)."""
    run = tmp_path_factory.mktemp("orpo_plain")
    train_here([*QUICK, "train.max_steps=1"], run)
    return [m for m in read_metrics(run) if m["kind"] == "train"][0]


@pytest.mark.parametrize("overrides", [["peft=qlora"], ["precision=bf16", "checkpointing=full", "logits=chunked"]], ids=["qlora", "bf16-chunked"])
def test_orpo_combines_with_memory_strategies(overrides, plain, tmp_path):
    train_here([*QUICK, *overrides], tmp_path / "run")
    first = [[m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"][0], plain]
    assert first[0]["loss"] == pytest.approx(first[1]["loss"], rel=2e-2)  # the same model and batch, to the strategy's rounding
    assert first[0]["nll"] == pytest.approx(first[1]["nll"], rel=2e-2)


def test_two_ranks_through_the_cli_the_loss_falls_and_final_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    out = launch_here(*QUICK, "train.max_steps=12", "parallelism=ddp", "launcher.nproc_per_node=2", "train.progress_bar=false",
                      f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(list((tmp_path / "run/ranks").glob("*.json"))) == 2 and not (tmp_path / "run/reference_logps.pt").exists()
    metrics = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3 and metrics[-1]["nll"] < metrics[0]["nll"]
    net = AutoModelForCausalLM.from_pretrained(tmp_path / "run/final")
    assert net.config.model_type == "llama"
