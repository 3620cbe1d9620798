"""Reward modelling (method=reward): the Bradley-Terry loss against hand computation, the score pooled at each row's
last token, every family built as a scored model or refused, the refusals, and runs through the real CLI whose final/
loads with AutoModelForSequenceClassification and scores the eval pairs exactly as the run did."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.config import ASSETS, ConfigError, DataConfig, MethodConfig, ModelConfig
from finetune.data.batches import collate, eval_batches
from finetune.data.sources import Rows, load_rows
from finetune.data.examples import tokenize
from finetune.families import FAMILIES
from finetune.methods.base import SCORED
from finetune.methods.reward import BradleyTerry, bradley_terry
from finetune.methods.reward import RewardConfig

from conftest import REPO, last_line, read_metrics, run_cli, train_here
from ranks import launch_here

QUICK = ["method=reward", "data=quickstart_dpo", "train.max_steps=3", "train.micro_batch_size=4", "train.global_batch_size=8",
         "optim.warmup_steps=0", "optim.lr=1e-3", "train.eval_every=0", "train.progress_bar=false"]


def sp(x: float) -> float:
    """softplus(x) = -log sigmoid(-x)."""
    return math.log1p(math.exp(x))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("center,expected", [
    (0.0, [sp(-1.0), sp(2.0), math.log(2)]),  # -log sigmoid(r_c - r_r): margins 1, -2, 0
    (0.01, [sp(-1.0) + 0.01 * 1.0, sp(2.0) + 0.01 * 4.0, math.log(2) + 0.01 * 9.0]),  # + c (r_c + r_r)^2: sums 1, 2, 3
], ids=["bradley-terry", "centred"])
def test_the_loss_by_hand(center, expected):
    chosen, rejected = t(1.0, 0.0, 1.5), t(0.0, 2.0, 1.5)
    assert bradley_terry(chosen, rejected, center).tolist() == pytest.approx(expected, rel=1e-12)
    loss, metrics = BradleyTerry(RewardConfig(center_rewards_coefficient=center)).rows_loss(
        torch.cat([chosen, rejected]), {"input_ids": torch.zeros(6, 1)})
    assert loss.item() == pytest.approx(sum(expected), rel=1e-6)  # summed over pairs: the loop divides by the pairs
    assert metrics["rewards/accuracy"].item() == 1.0  # only the first pair scores chosen higher (a tie is no win)
    assert (metrics["rewards/chosen"].item(), metrics["rewards/rejected"].item(), metrics["rewards/margin"].item()) == (2.5, 3.5, -1.0)


def test_the_gradient_raises_chosen_and_lowers_rejected():
    chosen, rejected = t(0.3).requires_grad_(), t(0.1).requires_grad_()
    bradley_terry(chosen, rejected).sum().backward()
    assert chosen.grad.item() == pytest.approx(-(1 - torch.sigmoid(t(0.2))).item()) == -rejected.grad.item()


def scored_model(**init):
    """The quickstart's tiny Llama as a sequence classifier (random init, one label) and the shipped tokenizer."""
    from finetune.rank import model
    from finetune.config import ModelInit, PeftConfig

    cfg = ModelConfig(tokenizer=str(ASSETS / "tokenizer"), init=ModelInit(**init))
    tok = model.load_tokenizer(cfg)
    net = model.load_model(cfg, tok, attention="sdpa", peft=PeftConfig(), compute_dtype=torch.float32, zero3=False,
                           run_dir=REPO, is_main=True, barrier=lambda: None, model_class=SCORED)
    return net, tok


def pairs(tok, n=4, split="train"):
    rows = Rows([json.loads(line) for line in (ASSETS / f"data/quickstart_dpo/{split}.jsonl").read_text().splitlines()[:n]], split)
    return tokenize(rows, tok, DataConfig(train="x", max_length=64), "data.train", "reward")[0]


def test_each_row_is_scored_at_its_last_token_whatever_the_padding():
    net, tok = scored_model()
    assert type(net).__name__ == "LlamaForSequenceClassification" and net.config.num_labels == 1
    assert net.config.pad_token_id == tok.pad_token_id
    examples = pairs(tok)
    batch = collate(examples, tok.pad_token_id)
    assert (batch["attention_mask"] == 0).any()  # rows of different lengths: padded on the right
    with torch.no_grad():
        loss, metrics = BradleyTerry(RewardConfig())(net, batch)
        alone = [net.score(net.model(input_ids=torch.tensor([row.input_ids])).last_hidden_state[0, -1]).item()
                 for k in (0, 1) for row in (e.rows[k] for e in examples)]  # each row by itself, unpadded: its last token's score
    chosen, rejected = t(*alone[:4]), t(*alone[4:])
    assert loss.item() == pytest.approx(bradley_terry(chosen, rejected).sum().item(), rel=1e-5)
    assert metrics["rewards/margin"].item() == pytest.approx((chosen - rejected).sum().item(), abs=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_builds_a_scored_model_or_is_refused(family, compose, tmp_path):
    """The launcher refuses from FAMILIES' `scored` (no transformers there): it must say what transformers has; a scored
    family's model is what the planner counts (its score head hidden x 1 in place of lm_head)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    from finetune.planner.counts import architecture

    assert FAMILIES[family].scored == (family in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
    if not FAMILIES[family].scored:
        with pytest.raises(ConfigError) as e:
            compose(["method=reward", "data=quickstart_dpo", f"model.init.model_type={family}"])
        assert str(e.value) == (f"method=reward needs a ForSequenceClassification model and transformers has none for "
                                f"model_type={family}: use a family that has one (llama, qwen2, qwen3, mistral, gemma2, phi3, ...)")
        return
    small = dict(n_embd=64, n_layer=2, n_head=4) if family == "gpt2" else dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = AutoConfig.for_model(family, **small, vocab_size=100, pad_token_id=0, num_labels=1)
    config.to_json_file(tmp_path / "config.json")
    with torch.device("meta"):
        built = AutoModelForSequenceClassification.from_config(config)
    assert built.score.weight.shape == (1, built.config.hidden_size)
    assert architecture(ModelConfig(path=str(tmp_path))).scored().params == sum(p.numel() for p in built.parameters())


def test_the_rank_refuses_a_model_type_with_no_classifier_in_one_line():
    """A hub id's model type is first known on the rank: transformers' refusal becomes one line."""
    with pytest.raises(ConfigError) as e:
        scored_model(model_type="granite")
    assert str(e.value) == ("granite: transformers has no SequenceClassification class for this model type, which the method "
                            "needs (its AutoModelForSequenceClassification lists none): use a model family that has one")


REFUSED = [
    (["parallelism=pp2", "launcher.nproc_per_node=2"], "method=reward with parallelism.pp=2 is not supported: pipeline stages "
     "run the causal LM's forward, not the score head and its last-token pooling: use parallelism=fsdp, tp2 or a zero option"),
    (["parallelism=cp2", "launcher.nproc_per_node=2"], "method=reward with parallelism.cp=2 is not supported: a reward model "
     "scores each row at its last token, which only one rank's slice of the tokens holds; use parallelism.cp=1 (with checkpointing=full for long pairs)"),
    (["logits=chunked"], "logits=chunked with method=reward: a reward model's head is one score per row (hidden x 1), with no "
     "vocabulary logits to chunk: use logits=full"),
    (["train.exact_match_samples=8"], "train.exact_match_samples=8 with method=reward: a reward model scores rows and does not "
     "generate: set train.exact_match_samples=0 (evaluation reports eval_rewards/accuracy)"),
    (["data.packing=true"], "data.packing=true cannot run here: method=reward scores chosen and rejected each at its own last "
     "token, as rows of their own: set data.packing=false"),
    (["data.padding_free=true"], "data.padding_free=true cannot run here: method=reward scores chosen and rejected each at its own "
     "last token, as rows of their own: set data.padding_free=false (or null)"),
    (["data=quickstart"], "method=reward reads data.format=preference rows (or auto): data.format=alpaca is not one of them"),
    (["method.beta=0.2"], "method.beta: not a key of method=reward; its keys are name, center_rewards_coefficient"),
]


@pytest.mark.parametrize("extra,message", REFUSED, ids=[r[0][0].split("=")[0] for r in REFUSED])
def test_what_cannot_train_a_reward_model_is_refused_before_launch(extra, message, compose):
    with pytest.raises(ConfigError) as e:
        compose(["method=reward", "data=quickstart_dpo", *extra])
    assert str(e.value) == message


def test_a_moe_that_adds_its_router_loss_is_refused(compose, tmp_path):
    from finetune.methods.reward import ROUTER_LOSS

    config = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=259, output_router_logits=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        compose(["method=reward", "data=quickstart_dpo", "model=pretrained", f"model.path={tmp_path}", f"model.tokenizer={ASSETS / 'tokenizer'}"])
    assert str(e.value) == ROUTER_LOSS == ("method=reward with a model whose config sets output_router_logits: transformers' "
                                           "ForSequenceClassification returns no load-balancing loss to add to the loss: set "
                                           "output_router_logits false in its config.json")


def test_the_centring_key_belongs_to_reward_models(compose):
    assert compose(["method=reward", "data=quickstart_dpo", "method.center_rewards_coefficient=0.01"]).method.center_rewards_coefficient == 0.01
    for method in ("dpo", "sft"):
        with pytest.raises(ConfigError) as e:
            compose([f"method={method}", "data=quickstart_dpo" if method == "dpo" else "data=quickstart",
                     "method.center_rewards_coefficient=0.01"])
        keys = {"dpo": "name, loss, beta, gamma, label_smoothing, sft_weight, reference", "sft": "name"}[method]
        assert str(e.value) == f"method.center_rewards_coefficient: not a key of method={method}; its keys are {keys}"


def test_the_plan_counts_a_score_head_not_an_lm_head(compose):
    from finetune.planner.peak import plan

    reward, dpo = plan(compose(["method=reward", "data=quickstart_dpo"])), plan(compose(["method=dpo", "data=quickstart_dpo"]))
    net, tok = scored_model()
    assert reward.params == sum(p.numel() for p in net.parameters()) == 407_168
    assert dpo.params - reward.params == (len(tok) - 1) * 128  # lm_head (vocab x hidden) -> score (1 x hidden)


# ---------------------------------------------------------------------------------------------
# Through the real CLI, and final/ loaded back with plain transformers


def eval_scores(final: Path, run_dir: Path, margins: list[float] | None = None, autocast: torch.dtype | None = None) -> dict[str, float]:
    """The run's eval metrics recomputed by final/ loaded with AutoModelForSequenceClassification on one process (each
    pair's margin appended to `margins`; under CPU autocast to `autocast` where given)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune import config

    cfg = config.load(run_dir / "config.yaml")
    tok = AutoTokenizer.from_pretrained(final)
    net = AutoModelForSequenceClassification.from_pretrained(final).eval()
    evals, _ = tokenize(load_rows(cfg.data.eval, "eval", "data.eval"), tok, cfg.data, "data.eval", "reward")
    objective, sums, count = BradleyTerry(cfg.method), {"eval_loss": 0.0}, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        for batch in eval_batches(evals, 32, tok.pad_token_id):
            out = net(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), position_ids=batch.get("position_ids"),
                      use_cache=False)  # as BradleyTerry.__call__
            loss, metrics = objective.loss(out.logits, batch)
            if margins is not None:
                chosen, rejected = out.logits.squeeze(-1).float().chunk(2)
                margins += (chosen - rejected).tolist()
            sums["eval_loss"] += loss.item()
            for k, v in metrics.items():
                sums[f"eval_{k}"] = sums.get(f"eval_{k}", 0.0) + v.item()
            count += objective.count(batch)
    return {k: v / count for k, v in sums.items()}


def assert_scores_within_fp16(run_dir: Path, after: dict[str, float]) -> None:
    """The run evaluated under fp16 autocast, the export reloads in fp32. The continuous metrics agree to fp16's rounding
    (abs 1e-3: 11 significant bits, scores of order 1). Accuracy counts the pairs scored chosen > rejected: a pair whose
    margin is within fp16's error of 0 may land on either side, so the counts may differ by at most the number of pairs
    that close, where the error is measured here, pair by pair, on the same model and rows (fp16 autocast against fp32),
    with a factor 2 for the run's own batching; every other pair must agree."""
    exact, rounded = [], []
    fp32 = eval_scores(run_dir / "final", run_dir, margins=exact)
    eval_scores(run_dir / "final", run_dir, margins=rounded, autocast=torch.float16)
    error = max(abs(a - b) for a, b in zip(exact, rounded))
    close = sum(abs(m) <= 2 * error for m in exact)
    flips = abs(round((after["eval_rewards/accuracy"] - fp32["eval_rewards/accuracy"]) * len(exact)))
    assert flips <= close, (flips, close, error)
    continuous = {k: v for k, v in after.items() if k != "eval_rewards/accuracy"}
    assert {k: fp32[k] for k in continuous} == pytest.approx(continuous, abs=1e-3)


def test_a_cli_run_exports_a_model_that_scores_as_it_trained(tmp_path):
    run = tmp_path / "run"
    out = run_cli(*QUICK, f"hydra.run.dir={run}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(run) if m["kind"] == "train"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(2), abs=0.05)  # a fresh score head: chosen and rejected score alike
    assert "reward_acc" in out.stdout and f"checkpoint   {run / 'final'}  (AutoModelForSequenceClassification" in out.stdout
    config = json.loads((run / "final/config.json").read_text())
    assert (config["architectures"], config["num_labels"] if "num_labels" in config else len(config["id2label"])) == (
        ["LlamaForSequenceClassification"], 1)
    after = json.loads((run / "summary.json").read_text())["after"]
    assert set(after) == {"eval_loss", "eval_rewards/accuracy", "eval_rewards/chosen", "eval_rewards/margin", "eval_rewards/rejected"}
    assert eval_scores(run / "final", run) == pytest.approx(after, rel=1e-5, abs=1e-6)


def test_lora_trains_and_saves_the_score_head_and_merges_into_a_classifier(tmp_path):
    summary = train_here([*QUICK, "peft=lora"], tmp_path / "run")
    final = tmp_path / "run/final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and "score" in adapter["modules_to_save"]
    from safetensors.torch import load_file

    saved = load_file(final / "adapter_model.safetensors")
    score = [k for k in saved if "score" in k]
    assert score and saved[score[0]].shape == (1, 128)  # the trained head travels with the adapter
    out = subprocess.run([sys.executable, str(REPO / "scripts/merge_adapter.py"), str(final), str(tmp_path / "merged")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "merged/config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    assert eval_scores(tmp_path / "merged", tmp_path / "run") == pytest.approx(summary["after"], rel=1e-5, abs=1e-6)
    # finetune.export merges it into a classifier too (not a causal LM with a fresh head); GGUF and generate refuse it
    out = subprocess.run([sys.executable, "-m", "finetune.export", str(tmp_path / "run"), "--out", str(tmp_path / "export")],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert eval_scores(tmp_path / "export", tmp_path / "run") == pytest.approx(summary["after"], rel=1e-5, abs=1e-6)
    for argv, line in ((["finetune.export", "--gguf", "f16"], f"error: --gguf f16: {tmp_path / 'run'} is a reward model (a sequence "
                        "classifier), and GGUF holds causal language models for llama.cpp: export it without --gguf"),
                       (["finetune.generate", "--prompt", "hi"], f"error: {tmp_path / 'run'} is a reward model (a sequence classifier: "
                        "one score per text), which python -m finetune.generate cannot use: it needs a causal language model "
                        "(method=sft, dpo, kto or orpo)")):
        out = subprocess.run([sys.executable, "-m", argv[0], str(tmp_path / "run"), *argv[1:]], capture_output=True, text=True,
                             timeout=120, cwd=REPO)
        assert (out.returncode, last_line(out.stderr)) == (2, line)


@pytest.mark.parametrize("overrides", [["peft=dora", "checkpointing=full", "precision=bf16"], ["precision=fp16", "checkpointing=offload"],
                                       ["model.init.model_type=mixtral"]],
                         ids=lambda o: "+".join(x.split("=")[1] for x in o))
def test_reward_models_combine_with_memory_strategies(overrides, tmp_path):
    summary = train_here([*QUICK, "train.memory_report=categories", *overrides], tmp_path)
    train = [m for m in read_metrics(tmp_path) if m["kind"] == "train"]
    losses = [m["loss"] for m in train]
    assert losses[0] == pytest.approx(math.log(2), abs=0.05) and all(math.isfinite(x) for x in losses)
    assert not any("router_aux_loss" in m for m in train)  # a MoE's sequence classifier returns none
    assert summary["memory"]["mem_peak_total_mib"] > 0
    if "precision=fp16" in overrides:  # evaluated under fp16 autocast, reloaded in fp32
        assert_scores_within_fp16(tmp_path, summary["after"])
    elif not any(o.startswith("peft=") for o in overrides):
        assert eval_scores(tmp_path / "final", tmp_path) == pytest.approx(summary["after"], abs=1e-3)


def test_fsdp_on_two_ranks_follows_one_process(tmp_path):
    one = train_here(QUICK, tmp_path / "one")
    run = tmp_path / "fsdp"
    out = launch_here(*QUICK, "parallelism=fsdp", "launcher.nproc_per_node=2", f"hydra.run.dir={run}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(p.name for p in (run / "ranks").glob("*.json")) == ["0.json", "1.json"]
    assert [m["loss"] for m in read_metrics(run) if m["kind"] == "train"] == pytest.approx(
        [m["loss"] for m in read_metrics(tmp_path / "one") if m["kind"] == "train"], rel=1e-4)
    assert eval_scores(run / "final", run) == pytest.approx(one["after"], rel=1e-4, abs=1e-5)  # gathered from the shards


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["zero=stage3"], ["parallelism=tp2"], ["peft=qlora"]], ids=["zero3", "tp2", "ddp-qlora"])
def test_other_layouts_train_and_export_a_classifier(layout, tmp_path):
    run = tmp_path / "run"
    out = launch_here(*QUICK, "parallelism=ddp", "launcher.nproc_per_node=2", *layout, f"hydra.run.dir={run}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert all(math.isfinite(m["loss"]) for m in read_metrics(run) if m["kind"] == "train")
    after = json.loads((run / "summary.json").read_text())["after"]
    if any(x.startswith("peft=") for x in layout):  # an adapter with the score head beside it
        assert json.loads((run / "final/adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    else:
        assert eval_scores(run / "final", run) == pytest.approx(after, rel=1e-4, abs=1e-5)


def test_a_refusal_reaches_the_command_line(tmp_path):
    out = run_cli("method=reward", "data=quickstart_dpo", "parallelism=pp2", "launcher.nproc_per_node=2", "launcher.dry_run=true",
                  cwd=tmp_path)
    assert out.returncode == 2
    assert last_line(out.stderr) == ("error: method=reward with parallelism.pp=2 is not supported: pipeline stages run the causal "
                                     "LM's forward, not the score head and its last-token pooling: use parallelism=fsdp, tp2 or a "
                                     "zero option")
