"""finetune.evaluate and train.eval_tasks: lm-evaluation-harness on a run's final/. The shipped tasks give what our own
generation and log-likelihoods give on the same rows; the CLI writes eval/results.json, summary.json's benchmarks and a
benchmark row; an adapter run is evaluated merged; train.eval_tasks runs after training into the same MLflow run; and
the mistakes are one line each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import last_line, read_metrics, readme_commands, run_cli, run_shell, shown_under, train_here

RUN = "outputs/quickstart_sft"
TINY = ["+recipe=quickstart_sft", "train.max_steps=2", "optim.warmup_steps=0", "train.global_batch_size=8", "train.micro_batch_size=4",
        "data.eval_size=8", "train.exact_match_samples=0", "train.memory_report=false"]


def command(part: str) -> str:
    found = [c for c in readme_commands("finetune.evaluate") if part in c]
    assert len(found) == 1, f"the site has {len(found)} finetune.evaluate commands with {part!r}"
    return found[0]


@pytest.fixture(scope="module")
def run_copy(shipped, tmp_path_factory):
    """The session's trained quickstart run, copied (this module adds to its summary and metrics), where the site's
    commands (After training) expect it."""
    here = tmp_path_factory.mktemp("bench")
    shutil.copytree(shipped / RUN, here / RUN, ignore=shutil.ignore_patterns(".lock", "tensorboard"))
    return here


def our_examples(run_dir: Path, tokenizer) -> tuple[list, list]:
    """The quickstart's eval rows tokenized as training tokenized them: instructions (SFT) and pairs (DPO)."""
    from finetune import config
    from finetune.config import ASSETS
    from finetune.data.forms import to_messages, to_pair
    from finetune.data.sources import load_rows
    from finetune.data.tokenize import encode, encode_pair, uses_chat_template

    cfg = config.load(run_dir / "config.yaml")
    chat = uses_chat_template(tokenizer, cfg.data.template)
    sft = [encode(to_messages(r, cfg.data.format, cfg.data.system_prompt, "t"), tokenizer, chat)
           for r in load_rows(str(ASSETS / "data/quickstart/eval.jsonl"), "train", "t").rows]
    pairs = [encode_pair(*to_pair(r, cfg.data.system_prompt, "t"), tokenizer, chat)
             for r in load_rows(str(ASSETS / "data/quickstart_dpo/eval.jsonl"), "train", "t").rows]
    return sft, pairs


@torch.no_grad()
def response_logprob(model, example) -> float:
    """Sum of log p(response token | before) over the response, its closing EOS left out (lm-eval scores the text)."""
    ids = torch.tensor([example.input_ids[:-1]])
    logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    return float(logps[torch.arange(len(targets)), targets][example.prompt_len - 1:].sum())


@pytest.mark.slow
def test_shipped_tasks_give_our_own_generation_and_loglikelihoods(shipped):
    """On the trained quickstart: quickstart_exact's answers are our greedy generations of the training-rendered prompts
    (so its exact match is ours), quickstart_choice's log-likelihoods are our forward's (so its accuracy is ours)."""
    from finetune.rank import evaluate, finished
    from finetune.rank.heldout import generate

    n = 24
    run = finished.locate(str(shipped / RUN))
    results = evaluate.evaluate(run, ["quickstart_exact", "quickstart_choice"], limit=n, batch_size=8, num_fewshot=None,
                                device="cpu", log_samples=True)
    model, tok = finished.load(run)
    sft, pairs = our_examples(shipped / RUN, tok)
    texts = generate(model, tok, sft[:n], batch_size=8, max_new_tokens=32, device=torch.device("cpu"))
    rows = sorted(results["samples"]["quickstart_exact"], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in rows] == texts
    ours = sum(t.strip() == e.reference.strip() for t, e in zip(texts, sft)) / n
    assert results["results"]["quickstart_exact"]["exact_match,none"] == pytest.approx(ours)

    rows = sorted(results["samples"]["quickstart_choice"], key=lambda s: s["doc_id"])
    theirs = [s["resps"][i][0][0] for s in rows for i in (0, 1)]  # each choice: [(log-likelihood, is greedy)]
    mine = [response_logprob(model, e) for p in pairs[:n] for e in (p.chosen, p.rejected)]
    assert theirs == pytest.approx(mine, rel=1e-4, abs=1e-4)
    accuracy = sum(mine[2 * i] >= mine[2 * i + 1] for i in range(n)) / n
    assert results["results"]["quickstart_choice"]["acc,none"] == pytest.approx(accuracy)
    assert evaluate.metrics_of(results) == {"quickstart_exact/exact_match": pytest.approx(ours),
                                            "quickstart_choice/acc": pytest.approx(accuracy)}


@pytest.mark.slow
def test_readme_command_writes_results_summary_and_a_benchmark_row(run_copy):
    out = run_shell(command("tasks=quickstart_exact,quickstart_choice"), cwd=run_copy)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = run_copy / RUN
    results = json.loads((run_dir / "eval/results.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    expected = {f"{task}/{metric}": results["results"][task][f"{metric},none"]
                for task, metric in (("quickstart_exact", "exact_match"), ("quickstart_choice", "acc"))}
    assert summary["benchmarks"] == expected and summary["after"]["eval_loss"] > 0  # merged, the rest kept
    assert summary["after_training"]["benchmarks"] > 0
    rows = read_metrics(run_dir)
    assert rows[-1] == {"kind": "benchmark", "step": 200, **expected}
    assert results["config"]["limit"] == 32 and "quickstart_exact" in out.stdout  # the command's limit; lm-eval's table
    assert last_line(out.stdout) == f"benchmarks   {run_dir.relative_to(run_copy)}/eval/results.json (summary.json: benchmarks): " + \
        ", ".join(f"{k} {v:.4g}" for k, v in expected.items())


@pytest.mark.slow
def test_readme_refusal_as_written(run_copy):
    out = run_shell(command("tasks=quickstart_exact,nope"), cwd=run_copy)
    shown = shown_under(command("tasks=quickstart_exact,nope"))  # the line the site prints under the command
    assert out.returncode == 2 and out.stderr == shown + "\n"


@pytest.mark.slow
def test_an_adapter_run_is_evaluated_over_its_base(tmp_path):
    """A LoRA run's final/ is an adapter: lm-eval scores the base with the adapter applied (PEFT's own forward, not
    merged), not the base alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.rank import evaluate, finished

    run_dir = tmp_path / "lora"
    train_here([*TINY, "peft=lora", "optim.lr=0.05"], run_dir)
    run = finished.locate(str(run_dir))
    assert run.adapter is not None
    results = evaluate.evaluate(run, ["quickstart_choice"], limit=2, batch_size=2, num_fewshot=None, device="cpu", log_samples=True)
    base = AutoModelForCausalLM.from_pretrained(run.base).eval()
    _, tok = finished.load(run)
    _, pairs = our_examples(run_dir, tok)
    alone = response_logprob(base, pairs[0].chosen)
    adapted = response_logprob(PeftModel.from_pretrained(base, run.model).eval(), pairs[0].chosen)
    row = min(results["samples"]["quickstart_choice"], key=lambda s: s["doc_id"])
    assert row["resps"][0][0][0] == pytest.approx(adapted, rel=1e-4) and abs(adapted - alone) > 1e-2


@pytest.mark.slow
def test_train_eval_tasks_runs_after_training_into_the_same_mlflow_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    out = run_cli(*TINY, "train.eval_tasks=[quickstart_choice]", "train.loggers=[jsonl,mlflow]", "train.progress_bar=false",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    results = json.loads((tmp_path / "run/eval/results.json").read_text())
    accuracy = results["results"]["quickstart_choice"]["acc,none"]
    assert summary["benchmarks"] == {"quickstart_choice/acc": accuracy} and results["config"]["limit"] is None
    assert read_metrics(tmp_path / "run")[-1] == {"kind": "benchmark", "step": 2, "quickstart_choice/acc": accuracy}
    from mlflow import MlflowClient

    client = MlflowClient()
    (found,) = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])  # one run: resumed, not a new one
    assert found.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "benchmark/quickstart_choice/acc")] == [(2, accuracy)]
    assert len(client.get_metric_history(found.info.run_id, "train/loss")) == 2
    kept = json.loads(Path(client.download_artifacts(found.info.run_id, "summary.json", str(tmp_path / "dl"))).read_text())
    assert kept["benchmarks"] == summary["benchmarks"]  # the summary kept at the end is the one with the benchmarks


def test_quickstart_exact_scores_as_heldout_exact_match_does():
    """The shipped generate_until task's metric is finetune.rank.heldout's: the stripped answer equals the reference."""
    from lm_eval.tasks import get_task_dict

    from finetune import benchmarks

    task = get_task_dict(["quickstart_exact"], benchmarks.task_manager())["quickstart_exact"]
    doc = task.test_docs()[2]
    assert doc == {"instruction": "uppercase", "input": "tzi", "output": "TZI"}  # finetune/assets/data/quickstart/eval.jsonl's row 3
    assert task.process_results(doc, [" TZI\n"]) == {"exact_match": 1.0}
    assert task.process_results(doc, ["TZ"]) == {"exact_match": 0.0} and task.process_results(doc, ["tzi"]) == {"exact_match": 0.0}


def fake_run(run_dir: Path, compose, overrides: list[str]) -> Path:
    """A run directory as a launch leaves it, with an empty final/: enough for what is refused before loading."""
    from finetune.config import to_yaml

    (run_dir / "final").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(compose(["+recipe=quickstart_sft", *overrides])))
    return run_dir


def test_cli_refusals_are_one_line(tmp_path, compose, capsys):
    from finetune.rank import evaluate

    usage = "python -m finetune.evaluate RUN_DIR tasks=a,b [limit=N] [batch_size=B] [num_fewshot=K] [device=D]"
    sft = fake_run(tmp_path / "sft", compose, [])
    reward = fake_run(tmp_path / "reward", compose, ["method=reward", "data=quickstart_dpo", "train.exact_match_samples=0"])
    cases = {
        (sft, "task=quickstart_exact"): f"task=quickstart_exact: not an option (give key=value): {usage}",
        (sft, "tasks=quickstart_exact", "limit=0"): "limit=0: limit takes an integer >= 1 (the first N rows of each task)",
        (sft, "tasks=quickstart_exact", "--num_fewshot", "x"): "num_fewshot=x: num_fewshot takes an integer >= 0 (examples in each prompt)",
        (sft, "tasks=quickstart_exact", "device=gpu"): "device=gpu: device takes cpu, cuda or cuda:N (default: cuda when there is one)",
        (sft, "limit=3"): f"which tasks? {usage} (shipped, offline: quickstart_choice, quickstart_exact; `lm-eval ls tasks` lists lm-eval's)",
        (tmp_path / "none", "tasks=quickstart_exact"): f"{tmp_path / 'none'}: no such directory: give the directory a launch wrote "
                                                       "(hydra.run.dir, or outputs/DATE/TIME)",
        (sft, "tasks=[quickstart_exact,nope]"): "tasks=quickstart_exact,nope: no lm-eval task nope (neither in lm-eval's index nor "
                                                "shipped: quickstart_choice, quickstart_exact); `lm-eval ls tasks` lists them",
        (reward, "tasks=quickstart_exact"): "tasks=quickstart_exact: method=reward trains a sequence classifier (one score per row), "
                                            "which lm-eval's tasks cannot evaluate: they need a causal LM's next-token log-probabilities",
    }
    for argv, line in cases.items():
        assert evaluate.main([str(a) for a in argv]) == 2
        assert capsys.readouterr().err == f"error: {line}\n", argv


def test_train_eval_tasks_refusals(compose, monkeypatch):
    """Before launch: a reward run at composition; lm-eval not installed, an unknown task (the launcher's check)."""
    import importlib.util

    from finetune import benchmarks
    from finetune.config import ConfigError

    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "method=reward", "data=quickstart_dpo", "train.exact_match_samples=0",
                 "train.eval_tasks=[quickstart_choice]"])
    assert str(e.value) == ("train.eval_tasks=[quickstart_choice]: method=reward trains a sequence classifier (one score per row), "
                            "which lm-eval's tasks cannot evaluate: they need a causal LM's next-token log-probabilities; "
                            "set train.eval_tasks=[]")
    assert benchmarks.problem(["quickstart_exact", "quickstart_choice"], "sft", "k") is None
    assert benchmarks.problem([], "reward", "k") is None  # nothing asked: nothing to refuse
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert benchmarks.problem(["quickstart_exact"], "sft", "train.eval_tasks=[quickstart_exact]") == (
        'train.eval_tasks=[quickstart_exact] needs lm-evaluation-harness, which is not installed: pip install -e ".[eval]" '
        "(or pip install lm_eval)")


@pytest.mark.slow
def test_launch_refuses_an_unknown_eval_task_before_training(tmp_path):
    out = run_cli("+recipe=quickstart_sft", "train.eval_tasks=[quickstart_exact,hellaswag,nope]", "launcher.dry_run=true",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2
    assert last_line(out.stderr) == ("error: train.eval_tasks=[quickstart_exact,hellaswag,nope]: no lm-eval task nope (neither in "
                                     "lm-eval's index nor shipped: quickstart_choice, quickstart_exact); `lm-eval ls tasks` lists them")


def test_the_builtin_template_renders_as_training_does(tok):
    """data.template=builtin: the chat template lm-eval is given renders a prompt as finetune.data.tokenize does."""
    from finetune.data.tokenize import encode
    from finetune.rank.evaluate import BUILTIN_CHAT

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "reverse\nabc"}]
    example = encode([*messages, {"role": "assistant", "content": "cba"}], tok, chat_template=False)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=BUILTIN_CHAT)
    assert tok(rendered, add_special_tokens=False)["input_ids"] == example.input_ids[: example.prompt_len]
    whole = tok.apply_chat_template([*messages, {"role": "assistant", "content": "cba"}], tokenize=False, chat_template=BUILTIN_CHAT)
    assert tok(whole, add_special_tokens=False)["input_ids"] == example.input_ids


def test_a_live_run_is_not_evaluated(tmp_path, compose, capsys):
    """Its ranks write summary.json and metrics.jsonl too: an evaluation beside them would lose one's rows or the other's.
    Refused while a launch holds RUN_DIR/.lock, naming the holder; evaluated once it is released."""
    import fcntl
    import os

    from finetune import rundir
    from finetune.rank import evaluate

    sft = fake_run(tmp_path / "sft", compose, [])
    (sft / rundir.LOCK).write_text(json.dumps({"pid": os.getpid(), "host": __import__("socket").gethostname(),
                                               "started": "2026-11-27 23:00:00"}) + "\n")
    held = os.open(sft / rundir.LOCK, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert evaluate.main([str(sft), "tasks=quickstart_exact"]) == 2
        assert capsys.readouterr().err == f"error: {rundir.in_use(sft, 'RUN_DIR')}\n"
    finally:
        os.close(held)
    assert not rundir.busy(sft)
