"""What the benchmarks (lm-evaluation-harness: `python -m finetune.evaluate`, `train.eval_tasks`) need before anything
loads: the package installed, task names lm-eval knows, a model that has next-token log-probabilities. Launcher side: no
torch (lm-eval's task index imports none), so `finetune.launch` refuses a bad `train.eval_tasks` before training starts.

The shipped tasks live in finetune/assets/lm_eval (YAML and the loader of their data, the quickstart's held-out rows),
and run offline: `quickstart_exact` (generate_until: the greedy answer equals the reference) and `quickstart_choice`
(multiple_choice: the right answer is likelier than a near miss). Any task of lm-eval's own index works too (hub
datasets need the network)."""

from __future__ import annotations

import functools
import importlib.util

from finetune.config import ASSETS, ConfigError

TASKS_DIR = ASSETS / "lm_eval"
"""The shipped lm-eval tasks: TaskManager(include_path=TASKS_DIR)."""

INSTALL = 'pip install -e ".[eval]" (or pip install lm_eval)'


def shipped() -> list[str]:
    """The shipped tasks' names (their YAML files')."""
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))


@functools.lru_cache(maxsize=1)
def task_manager() -> object:
    """lm-eval's task index with the shipped tasks (scanning lm-eval's YAML files takes seconds: made once)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


def problem(tasks: list[str], method: str, key: str) -> str | None:
    """Why `tasks` cannot be evaluated for a run of `method` (`key`: how the user named the tasks,
    train.eval_tasks or tasks=), or None. Asks lm-eval's task index only when the rest is right."""
    if not tasks:
        return None
    if (why := method_problem(method, key)) is not None:
        return why
    if importlib.util.find_spec("lm_eval") is None:
        return f"{key} needs lm-evaluation-harness, which is not installed: {INSTALL}"
    known = set(task_manager().all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        return (f"{key}: no lm-eval task {', '.join(unknown)} (neither in lm-eval's index nor shipped: "
                f"{', '.join(shipped())}); `lm-eval ls tasks` lists them")
    return None


def method_problem(method: str, key: str) -> str | None:
    """Why a run of `method` cannot be benchmarked (its model is a sequence classifier), or None."""
    from finetune import methods
    from finetune.methods.base import CAUSAL_LM

    record = methods.get(method)
    if record.model_class == CAUSAL_LM:
        return None
    return (f"{key}: method={record.name} trains a sequence classifier (one score per row), which lm-eval's tasks cannot "
            "evaluate: they need a causal LM's next-token log-probabilities")


def check(tasks: list[str], method: str, key: str) -> None:
    """Raise ConfigError with `problem`'s line."""
    if (why := problem(tasks, method, key)) is not None:
        raise ConfigError(why)
