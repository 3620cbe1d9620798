"""KTO (method=kto): the loss against a hand computation, the reference point from mismatched rows, unpaired data
in its forms, the rules, and runs through the real CLI (2 ranks, LoRA with the adapter-disabled reference)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from finetune import methods
from finetune.config import ConfigError, DataConfig, MethodConfig
from finetune.data.batches import collate, for_generation
from finetune.data.sources import Rows
from finetune.data.examples import tokenize
from finetune.data.tokenize import IGNORE
from finetune.methods.kto import KTO, Labelled, kto_loss
from finetune.methods.losses import sequence_logps
from finetune.methods.kto import KtoConfig

from conftest import last_line, read_metrics, run_cli, tiny_model, train_here
from ranks import launch_here

KTO_METHOD = methods.get("kto")


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def method(**kw) -> MethodConfig:
    return KtoConfig(**kw)


def test_loss_by_hand():
    """lambda_D (1 - s(beta (r - z0))) for a desirable row, lambda_U (1 - s(beta (z0 - r))) for an undesirable one."""
    rewards, kl = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)
    good = torch.tensor([True, False, False])
    losses = kto_loss(rewards, kl, good, method(beta=0.1, desirable_weight=1.0, undesirable_weight=2.0))
    assert losses.tolist() == pytest.approx([1 - sig(0.1 * 0.5), 2 * (1 - sig(0.1 * 2.5)), 2 * (1 - sig(0.1 * -2.5))], rel=1e-12)


def batch_of(logps, reference, desirable):
    """A 2-example batch's tensors as `KTO.rows` reads them (rows, then mismatched rows)."""
    n = len(desirable)
    return {"input_ids": torch.zeros(2 * n, 3, dtype=torch.long), "reference_logps": torch.tensor(reference, dtype=torch.float64),
            "desirable": torch.tensor(desirable * 2, dtype=torch.float64)}, torch.tensor(logps, requires_grad=True)


def test_the_reference_point_is_the_mismatched_rows_mean_kl_clamped_and_not_differentiated():
    batch, logps = batch_of([-1.0, -4.0, -6.0, -2.0], [-2.0, -3.0, -7.0, -2.5], [1.0, 0.0])
    loss, metrics = KTO(method(beta=1.0)).rows(logps, batch, None)
    kl = ((-6.0 + 7.0) + (-2.0 + 2.5)) / 2  # 0.75
    assert metrics["kl"].item() == pytest.approx(kl * 2)  # summed over the 2 examples: the loop averages it
    assert loss.item() == pytest.approx((1 - sig(1.0 - kl)) + (1 - sig(kl - -1.0)), rel=1e-6)
    assert metrics["rewards/accuracy"].item() == 2  # r = 1 > z0 desirable, r = -1 < z0 undesirable
    assert metrics["rewards/signed"].item() == pytest.approx(1.0 + 1.0)
    loss.backward()
    assert logps.grad[2:].tolist() == [0.0, 0.0]  # the reference point carries no gradient
    assert logps.grad[0] < 0 < logps.grad[1]  # raise the desirable response, lower the undesirable one
    batch, logps = batch_of([-1.0, -4.0, -9.0, -9.0], [-2.0, -3.0, -7.0, -2.5], [1.0, 0.0])
    assert KTO(method()).rows(logps, batch, None)[1]["kl"].item() == 0.0  # a negative estimate is clamped at 0


UNPAIRED = [
    {"prompt": "reverse\nabc", "completion": "cba", "label": True},
    {"prompt": [{"role": "user", "content": "double\nab"}], "completion": [{"role": "assistant", "content": "aabx"}], "label": False},
    {"instruction": "uppercase", "input": "xy", "output": "XY", "label": True},
    {"prompt": "shift\nab", "chosen": "bc", "rejected": "cb"},  # a pair: one desirable and one undesirable example
]


@pytest.fixture(scope="module")
def tok():
    return tiny_model()[1]


def test_unpaired_rows_in_every_form_and_pairs_as_two(tok):
    data = DataConfig(train="mem", max_length=64)
    examples, stats = tokenize(Rows(UNPAIRED, "mem"), tok, data, "data.train", "kto")
    assert stats.rows == 4 and [e.desirable for e in examples] == [True, False, True, True, False]
    responses = [tok.decode([t for t in e.row.labels if t != IGNORE]) for e in examples]
    assert responses == ["cba</s>", "aabx</s>", "XY</s>", "bc</s>", "cb</s>"]
    sft, _ = tokenize(Rows([{"instruction": "reverse", "input": "abc", "output": "cba"}], "mem"), tok, data, "x")
    assert examples[0].row.input_ids == sft[0].input_ids  # the prompt renders as the SFT row's
    # once the split is read, each example's mismatched row is its prompt with the next example's response
    KTO_METHOD.settle(examples, data, "data.train")
    for e, nxt in zip(examples, examples[1:] + examples[:1]):
        m, p = e.mismatched, e.row.prompt_len
        assert m.input_ids == e.row.input_ids[:p] + nxt.row.input_ids[nxt.row.prompt_len:]
        assert m.labels[:p] == [IGNORE] * p and m.labels[p:] == nxt.row.labels[nxt.row.prompt_len:]
    assert for_generation(examples) == [e.row for e in examples if e.desirable]  # exact match: desirable responses only
    batch = collate(examples, tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 10 and batch["desirable"].tolist() == [1.0, 0.0, 1.0, 1.0, 0.0] * 2


@pytest.mark.parametrize("row,message", [
    ({"prompt": "a", "completion": "b"}, "f:3: method=kto needs each row labelled: 'label' true (a desirable response) or false "
     "(an undesirable one), got None; or give preference pairs (chosen, rejected)"),
    ({"prompt": "a", "completion": "b", "label": 1}, "f:3: method=kto needs each row labelled: 'label' true (a desirable response) "
     "or false (an undesirable one), got 1; or give preference pairs (chosen, rejected)"),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": "  ", "label": True}, "f:3: the response 'completion' is empty "
     "(only whitespace): fix the row or remove it"),
])
def test_bad_unpaired_rows_are_named(row, message):
    with pytest.raises(ConfigError) as e:
        KTO_METHOD.check_row(row, DataConfig(train="x"), "f:3")
    assert str(e.value) == message


def test_one_example_is_refused_and_a_labelled_row_is_not_sft(tok):
    data = DataConfig(train="mem", max_length=64)
    examples, _ = tokenize(Rows(UNPAIRED[:1], "mem"), tok, data, "data.eval", "kto")
    with pytest.raises(ConfigError, match=r"^data.eval: method=kto pairs each prompt with another example's response"):
        KTO_METHOD.settle(examples, data, "data.eval")
    with pytest.raises(ConfigError) as e:
        methods.get("sft").check_row(UNPAIRED[1] | {"prompt": "p", "completion": "c"}, data, "f:2")
    assert str(e.value) == ("f:2: this row's response is labelled (label: false), which trains with method=kto (a false one would be "
                            "learned as a right answer): add method=kto, or remove the labels")


def test_rules(compose):
    base = ["method=kto", "data=quickstart_kto"]
    cases = [
        (["method.gamma=0.5"], "method.gamma: not a key of method=kto; its keys are name, beta, desirable_weight, undesirable_weight, reference"),
        (["method.reference=adapter_disabled"], "method.reference=adapter_disabled uses the base model under a PEFT adapter: add "
         "peft=lora (or qlora/dora), or use method.reference=precomputed"),
        (["data.packing=true"], "data.packing=true is not supported with method=kto (each response is scored in a row of its own): "
         "set data.packing=false"),
        (["data.streaming=true", "method.reference=live"], "data.streaming=true is not supported with method=kto: each example's "
         "mismatched row (for the KL reference point) takes another example's response, which needs the whole split: set "
         "data.streaming=false"),
        (["parallelism=cp2", "launcher.nproc_per_node=2"], "method=kto with parallelism.cp=2 is not supported: the KTO loss needs "
         "each response's whole log-probability before it is computed, and each rank holds a slice of the tokens; use "
         "parallelism.cp=1 (with checkpointing=full and logits=chunked for long rows)"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError) as e:
            compose([*base, *extra])
        assert str(e.value) == message, extra
    with pytest.raises(ConfigError) as e:
        compose(["method=dpo", "data=quickstart_dpo", "method.desirable_weight=2"])
    assert str(e.value) == ("method.desirable_weight: not a key of method=dpo (did you mean 'sft_weight'?); its keys are "
                            "name, loss, beta, gamma, label_smoothing, sft_weight, reference")
    assert compose([*base, "peft=lora", "method.reference=adapter_disabled", "method.undesirable_weight=1.3"]).method.undesirable_weight == 1.3


def test_one_step_on_a_model_raises_desirable_and_lowers_undesirable(tok):
    net, _ = tiny_model()
    data = DataConfig(train="mem", max_length=64)
    examples, _ = tokenize(Rows(UNPAIRED, "mem"), tok, data, "data.train", "kto")
    batch = collate(KTO_METHOD.settle(examples, data, "data.train"), tok.pad_token_id)
    with torch.no_grad():
        start = sequence_logps(net, batch)[0]
    batch["reference_logps"] = start.double()  # a fresh policy is its own reference: r = 0, z0 = 0
    objective = KTO(method(desirable_weight=1.0, undesirable_weight=1.5))
    total, metrics = objective(net, batch)
    assert objective.count(batch) == 5
    assert total.item() == pytest.approx(3 * 0.5 + 2 * 1.5 * 0.5, rel=1e-6)  # lambda_y (1 - s(0)) each
    assert metrics["kl"].item() == 0.0
    total.backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= 0.05 * p.grad
        gain = (sequence_logps(net, batch)[0] - start)[:5]
    good = batch["desirable"][:5].bool()
    assert gain[good].mean() > 0 > gain[~good].mean()


QUICK = ["method=kto", "data=quickstart_kto", "train.max_steps=3", "train.micro_batch_size=4", "train.global_batch_size=8",
         "optim.warmup_steps=0", "optim.lr=1e-3", "train.eval_every=0", "train.exact_match_samples=0"]


def test_references_agree_and_a_fresh_policy_costs_half_a_weight(tmp_path):
    runs = {}
    for ref in ("precomputed", "live"):
        summary = train_here([*QUICK, f"method.reference={ref}"], tmp_path / ref)
        runs[ref] = [m for m in read_metrics(tmp_path / ref) if m["kind"] == "train"]
        assert summary["before"]["eval_loss"] == pytest.approx(0.5, abs=1e-6) and summary["before"]["eval_kl"] == 0.0
        assert runs[ref][0]["loss"] == pytest.approx(0.5, abs=1e-6)
    assert [m["loss"] for m in runs["live"]] == pytest.approx([m["loss"] for m in runs["precomputed"]], rel=1e-5)
    assert [m["kl"] for m in runs["live"]] == pytest.approx([m["kl"] for m in runs["precomputed"]], abs=1e-6)


@pytest.mark.parametrize("overrides", [["peft=qlora", "method.reference=adapter_disabled"], ["precision=bf16", "checkpointing=full"],
                                       ["logits=chunked"]], ids=["qlora", "bf16-full", "chunked"])
def test_kto_combines_with_memory_strategies(overrides, tmp_path):
    train_here([*QUICK, *overrides], tmp_path)
    metrics = [m for m in read_metrics(tmp_path) if m["kind"] == "train"]
    assert metrics[0]["loss"] == pytest.approx(0.5, rel=2e-3)  # a policy equal to its reference, to the forward's rounding
    assert all(math.isfinite(m["loss"]) for m in metrics)


def test_two_ranks_lora_and_final_loads_with_transformers(tmp_path):
    """The ranks' part (tests/ranks.py); what the launcher starts for a preference recipe on two ranks is the e2e DPO test's."""
    from transformers import AutoModelForCausalLM

    out = launch_here(*QUICK, "train.max_steps=4", "peft=lora", "method.reference=adapter_disabled", "parallelism=ddp",
                      "launcher.nproc_per_node=2", "train.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert metrics[0]["loss"] == pytest.approx(0.5, abs=1e-5) and len(metrics) == 4
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run/final").config.model_type == "llama"


def test_data_and_method_must_agree_through_the_cli(tmp_path):
    out = run_cli("data=quickstart_kto", cwd=tmp_path)
    assert out.returncode == 2
    assert "this row's response is labelled (label: false), which trains with method=kto" in last_line(out.stderr)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    out = run_cli("method=kto", "data=jsonl", f"data.train={path}", cwd=tmp_path)
    assert out.returncode == 2
    assert last_line(out.stderr) == (f"error: {path}:1: method=kto needs each row labelled: 'label' true (a desirable response) or "
                                     "false (an undesirable one), got None; or give preference pairs (chosen, rejected)")


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny random-init model on disk: every sharded run starts from the same weights (ZeRO-3 builds a random-init
    model inside zero.Init, which draws other random numbers)."""
    path = tmp_path_factory.mktemp("kto_start") / "model"
    net, tok = tiny_model()
    net.save_pretrained(path)
    tok.save_pretrained(path)
    return ["model=pretrained", f"model.path={path}"]


@pytest.fixture(scope="module")
def one_process(start, tmp_path_factory):
    """4 KTO steps on one process (the torch engine): what the sharded runs are compared with. A micro-batch holds the
    same examples on any number of ranks, so the reference point z0 (each micro-batch's) is the same too."""
    run = tmp_path_factory.mktemp("kto_one") / "run"
    train_here([*SHARDED, *start, "method.reference=live", "parallelism=single"], run)  # in this process: the maths, not the launch
    return [m for m in read_metrics(run) if m["kind"] == "train"]


SHARDED = [*QUICK, "train.max_steps=4", "train.global_batch_size=16", "train.progress_bar=false"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["zero=stage3", "parallelism=ddp", "method.reference=live"], ["parallelism=fsdp", "method.reference=live"],
                                    ["parallelism=pp2", "logits=chunked"]], ids=["zero3", "fsdp", "pp2_chunked"])
def test_two_ranks_sharded_match_one_process(layout, start, one_process, tmp_path):
    """The row forward with gradients, the mismatched rows' without and the live reference's (sharded like the
    policy) under ZeRO-3 and FSDP2, and one forward of both halves under a pipeline (its last stage returning each
    row's log-probs; the reference precomputed), give one process's losses."""
    out = launch_here(*SHARDED, *start, *layout, "launcher.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ours = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert ours[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in one_process], rel=1e-4)
    assert [m["kl"] for m in ours] == pytest.approx([m["kl"] for m in one_process], abs=1e-5)


def test_planned_activations_leave_out_the_mismatched_rows_and_match_memtracker(compose, tmp_path):
    """The mismatched rows are forwarded without gradients: the planner counts the micro-batch's rows once (it counted
    them twice: 43.4 MiB planned, 22.4 measured), and a pipeline stage, which keeps every row, twice."""
    from finetune.planner.peak import plan
    from finetune.planner.records import compare

    run = tmp_path / "run"
    train_here(["method=kto", "data=quickstart_kto", "train.micro_batch_size=8", "train.global_batch_size=8", "model.init.hidden_size=256",
                "model.init.intermediate_size=768", "model.init.num_hidden_layers=4", "train.max_steps=2", "data.eval=null",
                "data.eval_size=0", "train.exact_match_samples=0", "train.memory_report=categories", "data.padding_free=false"], run)
    rows = {name: (p, m) for name, p, m in compare(run)}
    print(rows)
    assert rows["activations"][0] == pytest.approx(rows["activations"][1], rel=0.15)  # measured: 21.7 planned, 22.4 measured
    assert rows["peak"][0] == pytest.approx(rows["peak"][1], rel=0.15)
    common = ["data=quickstart_kto", "train.micro_batch_size=4", "train.global_batch_size=8", "data.padding_free=false"]
    sft = plan(compose([*common[1:]]))
    kto = plan(compose(["method=kto", *common]))
    assert kto.activations == pytest.approx(sft.activations, rel=0.01)
    piped = ["parallelism=pp2", "launcher.nproc_per_node=2"]
    assert plan(compose(["method=kto", *common, *piped])).activations > 1.8 * plan(compose([*common[1:], *piped])).activations
