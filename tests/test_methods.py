"""The training methods' seam (finetune/methods/): every method has a record that answers the whole interface,
the registry is what the rest reads, no method branch is left outside the package, and the launcher side reads the
records without torch."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from finetune import methods
from finetune.config import METHOD_CONFIGS, ConfigError, DataFormat, MethodConfig, Reference
from finetune.methods.base import Method as Interface
from finetune.methods.dpo import DpoConfig, DpoLoss

REPO = Path(__file__).resolve().parents[1]


def test_every_method_has_a_record_its_config_and_a_group_option():
    """The registry is the list: each record names itself, brings its own config class (registered for the schema),
    and recipes/method/ has one option per method, composing that class."""
    options = sorted(p.stem for p in (REPO / "recipes" / "method").glob("*.yaml"))
    assert options == sorted(methods.METHODS)
    for name, record in methods.METHODS.items():
        assert methods.get(name) is record and record.name == name
        assert issubclass(record.config, MethodConfig) and record.config().name == name
        assert METHOD_CONFIGS[name] is record.config
        assert f"defaults: [base_{name}]" in (REPO / "recipes" / "method" / f"{name}.yaml").read_text()


def test_an_unknown_method_is_refused_naming_the_methods():
    with pytest.raises(ConfigError) as e:
        methods.get("dop")
    assert str(e.value) == ("method.name=dop must be one of sft, dpo, kto, orpo, reward, grpo, rloo, distill (did you mean 'dpo'?) (choose the "
                            "method with method=NAME)")


def test_a_config_without_a_method_name_is_refused(tmp_path):
    """config.load of a config.yaml whose method section names no method: one line, not a silent sft."""
    from finetune.config import load

    path = tmp_path / "config.yaml"
    path.write_text("method: {beta: 0.1}\n")
    with pytest.raises(ConfigError) as e:
        load(path)
    assert str(e.value) == "method.name is missing: choose the method with method=NAME (one of sft, dpo, kto, orpo, reward, grpo, rloo, distill)"


@pytest.mark.parametrize("overrides,message", [
    (["method=dpo", "method.generations=4"],
     "method.generations: not a key of method=dpo; its keys are name, loss, beta, gamma, label_smoothing, sft_weight, reference"),
    (["method=grpo", "method.generatons=4"],
     "method.generatons: not a key of method=grpo (did you mean 'generations'?); its keys are name, beta, reference, generations, "
     "completion_tokens, temperature, top_p, mask_truncated_completions, overlong_buffer, dynamic_sampling, sampling_rounds, "
         "tools, max_turns, tool_timeout, rewards, reward_weights, format_pattern, vllm, vllm_memory, vllm_servers, epsilon, epsilon_high, loss_type, scale_rewards, "
         "importance_sampling_level, updates_per_rollout, async_generation"),
    (["method=sft", "method.beta=0.1"], "method.beta: not a key of method=sft; its keys are name"),
])
def test_a_key_of_another_method_is_refused_naming_the_methods_keys(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert str(e.value) == message


@pytest.mark.parametrize("name", sorted(methods.METHODS))
def test_each_record_answers_the_whole_interface(name):
    record = methods.get(name)
    asked = set(Interface.__annotations__) | {k for k, v in vars(Interface).items() if callable(v) and not k.startswith("_")}
    assert {"encode", "check_row", "join", "reference", "sampling", "validate", "objective", "config"} <= asked
    assert not [k for k in asked if not hasattr(record, k)]
    assert record.rows_per_example >= len(record.columns) >= 1  # KTO: + the mismatched row its split settles on
    assert record.forms and DataFormat.auto not in record.forms
    assert all(isinstance(getattr(record, k), (str, type(None))) for k in ("unpacked", "split_tokens"))
    assert record.reference(record.config()) in (None, *Reference)
    sampling = record.sampling(record.config())
    assert sampling is None or sampling.completions >= 2


def test_the_records_say_what_sft_and_dpo_are():
    sft, dpo = methods.get("sft"), methods.get("dpo")
    assert (sft.rows_per_example, sft.unpacked, sft.split_tokens, sft.reference(MethodConfig())) == (1, None, None, None)
    assert dpo.rows_per_example == 2 and dpo.columns == ("chosen_", "rejected_") and dpo.unpacked and dpo.split_tokens
    assert dpo.reference(DpoConfig(reference=Reference.live)) == Reference.live
    assert dpo.reference(DpoConfig(loss=DpoLoss.simpo)) is None  # reference-free


def test_the_rank_builds_the_records_loss():
    from finetune.methods.dpo import DPO
    from finetune.methods.sft import SFT
    from finetune.rank.train import build_objective

    assert type(build_objective(MethodConfig())) is SFT
    assert type(build_objective(DpoConfig())) is DPO


# a comparison with a method's name, its loss options, the pair type, a method's objective asked what it has
NAMES = "|".join(methods.METHODS)
BRANCH = re.compile(rf"([!=]=|\bin \(?)\s*[\"']({NAMES})[\"']|method\.name\s*[!=]=|\bDpoLoss\.|isinstance\([^)]*\bPair\b|"
                    r"hasattr\(objective|cfg\.method\.(?!name\b)\w+")


def test_no_method_branch_outside_the_methods_package():
    """The data, planner, rules, reference and loss read the registry: a branch on a method's name (or on its
    loss options, or the pair type) elsewhere means the next method would have to edit that file too."""
    found = []
    for path in sorted((REPO / "finetune").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(("finetune/methods/", "finetune/config/")):  # the schema declares the options
            continue
        found += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1) if BRANCH.search(line)]
    assert not found, "\n".join(found)


def test_the_launcher_side_reads_the_records_without_torch():
    code = ("import sys, finetune.methods, finetune.launcher.rules, finetune.plan, finetune.data.forms; "
            "from finetune.methods import get; get('dpo').validate; assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@dataclass
class Triple:
    """An example of three rows, as a method with groups of three would have (an Item)."""

    a: object
    b: object
    c: object
    score: tuple[float, float, float]

    @property
    def rows(self):
        return self.a, self.b, self.c

    def values(self):
        return {"scores": self.score}


def test_collate_lays_out_any_items_rows_and_values_in_row_order():
    import torch

    from finetune.data.batches import collate
    from finetune.data.tokenize import Example

    def ex(n):
        return Example([n] * n, [n] * n, 0, "")

    items = [Triple(ex(1), ex(2), ex(3), (1.0, 2.0, 3.0)), Triple(ex(4), ex(5), ex(6), (4.0, 5.0, 6.0))]
    batch = collate(items, pad_id=0)
    assert batch["input_ids"][:, 0].tolist() == [1, 4, 2, 5, 3, 6]  # row k of every item, k = 0, 1, 2
    assert batch["scores"].dtype == torch.float64 and batch["scores"].tolist() == [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]


def test_a_methods_declared_words_reach_the_rules(compose, monkeypatch):
    """The rules read the record: a method that cannot pack says why in its own words."""
    from finetune.methods.sft import Sft

    class Unpacked(Sft):
        unpacked = "method=sft here scores each row alone"

    monkeypatch.setitem(methods.METHODS, "sft", Unpacked())
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "data.packing=true"])
    assert str(e.value) == "data.packing=true cannot run here: method=sft here scores each row alone: set data.packing=false"
