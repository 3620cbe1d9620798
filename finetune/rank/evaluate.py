"""Benchmarks of a finished run through lm-evaluation-harness (`pip install -e ".[eval]"`).

    python -m finetune.evaluate RUN_DIR tasks=quickstart_exact,quickstart_choice [limit=N] [batch_size=B]
                                [num_fewshot=K] [device=cpu|cuda|cuda:1]

lm-eval's HFLM runs on the run's final/ (an adapter merged into its base first: finetune.rank.finished, as
`finetune.generate` loads it) with the run's tokenizer, its prompts rendered as the run's training data were: the
tokenizer's chat template, or the built-in `### User:` one (`data.template`), with `data.system_prompt`. Tasks: the
shipped ones (finetune/assets/lm_eval: quickstart_exact, quickstart_choice, offline) or any of lm-eval's (`lm-eval ls
tasks`; hub datasets need the network). Results: lm-eval's results in RUN_DIR/eval/results.json, each task's metrics in
summary.json's `benchmarks`, and one `benchmark` row (`TASK/METRIC`) to the run's `train.loggers` at its last step (a
tracker's run goes on: the same MLflow run, the W&B run's id, the trackio run's name). `train.eval_tasks=[...]` runs
the same after training. A mistake is one line and exit code 2.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from finetune import benchmarks, logs, rundir
from finetune.config import ConfigError
from finetune.rank.finished import Finished, Refusal, load, locate

RESULTS = "eval"
"""RUN_DIR/eval/: lm-eval's results (results.json)."""

OPTIONS = {"tasks": "lm-eval task names (a,b or [a,b])", "limit": "an integer >= 1 (the first N rows of each task)",
           "batch_size": "an integer >= 1, or auto", "num_fewshot": "an integer >= 0 (examples in each prompt)",
           "device": "cpu, cuda or cuda:N (default: cuda when there is one)"}
"""The key=value options and what each takes (their values are checked in `typed`)."""

USAGE = "python -m finetune.evaluate RUN_DIR tasks=a,b [limit=N] [batch_size=B] [num_fewshot=K] [device=D]"

BUILTIN_CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}### Assistant:\n{{ m['content'] }}"
                "{{ eos_token }}{% if not loop.last %}\n\n{% endif %}{% else %}### {{ m['role'] | capitalize }}:\n"
                "{{ m['content'] }}\n\n{% endif %}{% endfor %}{% if add_generation_prompt %}### Assistant:\n{% endif %}")
"""finetune.data.tokenize's built-in template (data.template=builtin, or auto without a chat template) as a chat
template, which lm-eval renders prompts with."""


def parse(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """RUN_DIR and the options (`key=value`, or `--key value` / `--key=value`), typed. Raises Refusal."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    where, words, options = argv[0], list(argv[1:]), {}
    while words:
        word = words.pop(0)
        if word.startswith("--") and "=" not in word and words:
            word = f"{word}={words.pop(0)}"
        key, sep, value = word.removeprefix("--").partition("=")
        if not sep or key not in OPTIONS:
            raise Refusal(f"{word}: not an option (give key=value): {USAGE}")
        options[key] = typed(key, value)
    if not options.get("tasks"):
        raise Refusal(f"which tasks? {USAGE} (shipped, offline: {', '.join(benchmarks.shipped())}; `lm-eval ls tasks` lists lm-eval's)")
    return where, options


def typed(key: str, value: str) -> Any:
    if key == "tasks":
        return [t.strip() for t in value.strip().strip("[]").split(",") if t.strip()]
    if key == "device":
        if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
            raise Refusal(f"device={value}: device takes {OPTIONS[key]}")
        return value
    if key == "batch_size" and value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < (1 if key != "num_fewshot" else 0):
        raise Refusal(f"{key}={value}: {key} takes {OPTIONS[key]}")
    return number


def main(argv: list[str] | None = None) -> int:
    try:
        where, options = parse(sys.argv[1:] if argv is None else argv)
        run = locate(where, need_run=True)
        assert run.run_dir is not None and run.config is not None
        if rundir.busy(run.run_dir):  # its ranks write summary.json and metrics.jsonl too: one would lose the other's
            raise Refusal(rundir.in_use(run.run_dir, "RUN_DIR"))
        benchmarks.check(options["tasks"], run.config.method.name, f"tasks={','.join(options['tasks'])}")
        metrics = run_benchmarks(run, **options)
    except (Refusal, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(said(run.run_dir, metrics))
    return 0


def said(run_dir: Path, metrics: dict[str, float]) -> str:
    """The line that ends a benchmark: where the results are, and the numbers."""
    return (f"benchmarks   {run_dir / RESULTS / 'results.json'} (summary.json: benchmarks): "
            + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))


def run_benchmarks(run: Finished, tasks: list[str], *, limit: int | None = None, batch_size: int | str = 8,
                   num_fewshot: int | None = None, device: str | None = None) -> dict[str, float]:
    """Evaluate `run`'s final/ on `tasks` and record it (eval/results.json, summary.json, the loggers). Returns the
    metrics as summary.json's `benchmarks` holds them: {TASK/METRIC: value}."""
    from lm_eval.utils import make_table

    tic = time.perf_counter()
    results = evaluate(run, tasks, limit=limit, batch_size=batch_size, num_fewshot=num_fewshot, device=device)
    print(make_table(results))
    return record(run, results, time.perf_counter() - tic)


def evaluate(run: Finished, tasks: list[str], *, limit: int | None, batch_size: int | str, num_fewshot: int | None,
             device: str | None, log_samples: bool = False) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` on final/ through HFLM: its results (with each row's with `log_samples`)."""
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM

    from finetune.data.tokenize import uses_chat_template

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Refusal(f"device={device}: no CUDA device here: use device=cpu")
    model, tokenizer = load(run)
    data = run.config.data if run.config is not None else None
    if data is not None and not uses_chat_template(tokenizer, data.template):
        tokenizer.chat_template = BUILTIN_CHAT  # as the run rendered its rows (lm-eval renders through a chat template)
    chat = bool(tokenizer.chat_template)  # a bare model without one: lm-eval's plain prompts
    lm = HFLM(pretrained=model.to(device), tokenizer=tokenizer, batch_size=batch_size, device=device)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, log_samples=log_samples,
                                   task_manager=benchmarks.task_manager(), apply_chat_template=chat,
                                   system_instruction=data.system_prompt if data is not None else None,
                                   fewshot_as_multiturn=chat)


def metrics_of(results: dict[str, Any]) -> dict[str, float]:
    """Each task's metrics as TASK/METRIC (lm-eval's `METRIC,FILTER` keys without the filter; the standard errors and
    row counts left out: results.json keeps them). A group's tasks each, and the group's own aggregate."""
    out: dict[str, float] = {}
    for task, values in results["results"].items():
        named = results.get("higher_is_better", {}).get(task, {})
        for key, value in values.items():
            metric = key.partition(",")[0]
            if metric in named and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{task}/{metric}"] = float(value)
    return out


def record(run: Finished, results: dict[str, Any], seconds: float) -> dict[str, float]:
    """RUN_DIR/eval/results.json, summary.json's `benchmarks` (and the seconds in its after_training), and a
    `benchmark` row to the run's loggers at its last step."""
    from lm_eval.utils import handle_non_serializable

    assert run.run_dir is not None and run.config is not None
    run_dir, metrics = run.run_dir.resolve(), metrics_of(results)
    (run_dir / RESULTS).mkdir(exist_ok=True)
    kept = {k: v for k, v in results.items() if k != "samples"}
    (run_dir / RESULTS / "results.json").write_text(json.dumps(kept, indent=2, default=handle_non_serializable) + "\n")
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    summary["benchmarks"] = metrics
    summary.setdefault("after_training", {})["benchmarks"] = round(seconds, 3)
    summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    rows = logs.read(run_dir) if (run_dir / logs.METRICS).is_file() else []
    step = max((r["step"] for r in rows), default=run.config.train.max_steps)
    with logs.MetricsLog(run_dir, enabled=True, loggers=run.config.train.loggers, config=run.config, resume=True) as log:
        log.write("benchmark", step, metrics)
        log.close()
    return metrics


if __name__ == "__main__":
    sys.exit(main())
