"""Rollouts with tools (method.tools, finetune/methods/tool_calls.py): calls read from a completion in the forms chat
templates write them, the user's function run with its faults and time limit as its answer, the tool turn rendered by
the template and appended as context, sampling going on; only the policy's tokens labelled; the rewards given the final
answer and the whole exchange; the rules."""

from __future__ import annotations

import json
import time

import pytest

from finetune.config import ConfigError
from finetune.methods import tool_calls

from conftest import train_here

torch = pytest.importorskip("torch")

QWEN_CALL = '<tool_call>\n{"name": "string_task", "arguments": {"task": "reverse", "word": "abc"}}\n</tool_call>'


@pytest.mark.parametrize("text,opener,content,calls", [
    ("Sure." + QWEN_CALL, "<tool_call>\n", "Sure.", [("string_task", {"task": "reverse", "word": "abc"})]),  # Qwen 2.5
    ('Let me look.{"name": "f", "parameters": {"x": 1}}', "", "Let me look.", [("f", {"x": 1})]),  # Llama 3.1
    ('[TOOL_CALLS] [{"name": "f", "arguments": "{\\"x\\": 1}", "id": "abc123def"}, {"name": "g", "arguments": {}}]', "[TOOL_CALLS] ", "",
     [("f", {"x": 1}), ("g", {})]),  # Mistral: a list, arguments as JSON text
    ('{"type": "function", "function": {"name": "f", "arguments": {"y": "z"}}}', "", "", [("f", {"y": "z"})]),  # OpenAI's shape
    ("the answer is {not json} and [1, 2]", "", "the answer is {not json} and [1, 2]", []),
    ('{"name": "f"}', "", '{"name": "f"}', []),  # no arguments: not a call
])
def test_calls_are_read_in_every_form_templates_write(text, opener, content, calls):
    got_content, got = tool_calls.parse(text, opener)
    assert got_content == content and [(c["name"], c["arguments"]) for c in got] == calls


def slow(word):
    time.sleep(5)
    return word


def test_a_call_is_answered_by_the_function_or_by_what_went_wrong():
    def string_task(task, word):
        return {"reverse": word[::-1]}[task]

    functions = {"string_task": string_task, "slow": slow, "listing": lambda: [1, "a"]}
    assert tool_calls.run({"name": "string_task", "arguments": {"task": "reverse", "word": "abc"}}, functions, 1.0) == "cba"
    assert tool_calls.run({"name": "listing", "arguments": {}}, functions, 1.0) == '[1, "a"]'
    assert tool_calls.run({"name": "string_task", "arguments": {"task": "rot13", "word": "abc"}}, functions, 1.0) == "error: KeyError: 'rot13'"
    assert tool_calls.run({"name": "string_task", "arguments": {"word": "abc"}}, functions, 1.0).startswith(
        "error: TypeError: test_a_call_is_answered_by_the_function_or_by_what_went_wrong.<locals>.string_task() missing 1 required")
    assert tool_calls.run({"name": "nope", "arguments": {}}, functions, 1.0) == ("error: no function named 'nope' (there are: listing, "
                                                                                "slow, string_task)")
    tic = time.perf_counter()
    assert tool_calls.run({"name": "slow", "arguments": {"word": "x"}}, functions, 0.2) == "error: slow did not answer within 0.2 s"
    assert time.perf_counter() - tic < 2


@pytest.fixture()
def qwen(tok):
    from finetune.config.data import template_path

    tok.chat_template = template_path("qwen2_5").read_text()
    return tok


def test_the_turns_format_is_read_from_the_template(qwen, tok):
    fmt = tool_calls.turn_format(qwen)
    assert (fmt.stop, fmt.after, fmt.opener) == ("<|im_end|>", "\n", "<tool_call>\n")
    turn = tool_calls.tool_turn(qwen, [{"name": "string_task", "arguments": {"task": "reverse", "word": "abc"}}], ["cba"], 1)
    assert turn == "<|im_start|>user\n<tool_response>\ncba\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_does_not_write_calls_is_refused():
    from transformers import AutoTokenizer

    from finetune.config import ASSETS

    shipped = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")  # its template has no tools
    with pytest.raises(ConfigError, match=r"^method.tools: the chat template writes a tool call as '.*', which is not JSON naming "
                                          r"the function and its arguments"):
        tool_calls.turn_format(shipped)


def test_a_completion_calls_a_tool_gets_its_result_and_is_sampled_on(qwen, monkeypatch, tmp_path):
    """Scripted samples: the first turn calls string_task, the second answers. The row is prompt + call + the tool turn
    (the template's, with the function's answer) + the answer; the call and the answer are labelled, the tool turn is
    not; exact match compares the answer; a user's reward receives the whole exchange; tool_calls counts the call."""
    from finetune.data.batches import collate
    from finetune.data.tokenize import Example
    from finetune.methods import online, rewards
    from finetune.methods.grpo import GRPO, GrpoConfig

    (tmp_path / "my_tools.py").write_text("def string_task(task, word):\n    return word[::-1] if task == 'reverse' else word\n\n"
                                          "def called(*, trajectories, **_):\n    return [float(len(t) == 3) for t in trajectories]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    asked = []

    def sample(engine, prompts, cfg, tokenizer, seed, vllm=None, images=None, private=False, stop=None):
        asked.append((len(prompts), cfg.generations, seed, stop, [tokenizer.decode(p) for p in prompts]))
        say = (QWEN_CALL + "<|im_end|>", "abc<|im_end|>") if len(seed) == 4 else ("cba<|im_end|>",)  # the second never calls
        return [tokenizer.encode(say[i % len(say)], add_special_tokens=False) for i in range(len(prompts) * cfg.generations)]

    monkeypatch.setattr(online, "sample", sample)
    cfg = GrpoConfig(generations=2, tools=["my_tools:string_task"], rewards=["exact_match", "my_tools:called"])
    objective = GRPO(cfg)
    objective.rewards = rewards.resolve(cfg)
    prompt = qwen.encode("<|im_start|>user\nreverse abc<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    answer = qwen.encode("cba", add_special_tokens=False)
    mb = collate([Example(prompt + answer, [-100] * len(prompt) + answer, len(prompt), "")], qwen.pad_token_id)
    from types import SimpleNamespace

    (batch,), _ = objective.rollout(SimpleNamespace(dp_rank=0), [mb], step=1, tokenizer=qwen, seed=0)
    assert [(n, g, s, stop) for n, g, s, stop, _ in asked] == [(1, 2, (0, 1, 0, 0), "<|im_end|>"), (1, 1, (0, 1, 0, 0, -1), "<|im_end|>")]
    turn = "\n<|im_start|>user\n<tool_response>\ncba\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert asked[1][4] == [qwen.decode(prompt) + QWEN_CALL + "<|im_end|>" + turn]  # sampled on after the tool's answer
    row, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    n = len(prompt)
    text = qwen.decode(row[n:])
    assert text.startswith(QWEN_CALL + "<|im_end|>" + turn + "cba<|im_end|>")
    seen = qwen.decode([t for t in labels[n:] if t != -100])
    assert seen == QWEN_CALL + "<|im_end|>" + "cba<|im_end|>"  # the policy's own tokens only
    assert batch["sum_rewards/exact_match"].tolist() == [1.0, 0.0]  # the answer after the call; "abc" without one
    assert batch["sum_rewards/my_tools:called"].tolist() == [1.0, 0.0]  # call, result, answer: 3 messages
    assert batch["sum_tool_calls"].tolist() == [1.0, 0.0] and batch["advantages"][0] > 0 > batch["advantages"][1]


def test_rules(compose, tmp_path, monkeypatch):
    (tmp_path / "my_tools2.py").write_text("def string_task(task, word):\n    return word\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["method=grpo", "data=quickstart_tools", "model.init.max_position_embeddings=1536"]
    compose([*base, "method.tools=[my_tools2:string_task]", "method.max_turns=2"])
    with pytest.raises(ConfigError, match=r"^method.max_turns=2 has no effect without method.tools"):
        compose([*base, "method.max_turns=2"])
    with pytest.raises(ConfigError, match=r"^method.tools: my_tools2:nothing: my_tools2 has no function 'nothing'$"):
        compose([*base, "method.tools=[my_tools2:nothing]"])
    with pytest.raises(ConfigError, match=r"^method.tools with method=grpo is not supported with this layout \(each rank's completions "
                                          r"call tools a different number of times"):
        compose([*base, "method.tools=[my_tools2:string_task]", "parallelism=fsdp", "launcher.nproc_per_node=2"])


def test_a_tool_run_trains_through_the_loop(tmp_path, monkeypatch):
    """The quickstart's tool rows (Qwen 2.5's template), a random model: the multi-turn rollout runs through the rank's
    loop and trains, its calls counted (a random model seldom writes one)."""
    (tmp_path / "my_tools3.py").write_text("def string_task(task, word):\n    return word\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train_here(["+recipe=quickstart_sft", "method=grpo", "data=quickstart_tools", "model.init.max_position_embeddings=1536",
                "method.tools=[my_tools3:string_task]", "method.rewards=[similarity]", "method.generations=2", "method.completion_tokens=8",
                "parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=2", "optim.warmup_steps=0", "train.micro_batch_size=1",
                "train.global_batch_size=1", "train.exact_match_samples=0", "train.eval_every=0", "data.eval_size=2", "data.eval=null"],
               tmp_path / "run")
    train = [r for r in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines()) if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(r["tool_calls"] == 0.0 and r["grad_norm"] > 0 for r in train)


@pytest.mark.parametrize("name,stop,opener", [("qwen2_5", "<|im_end|>", "<tool_call>\n"), ("llama3_1", "<|eot_id|>", ""),
                                              ("mistral", None, "[TOOL_CALLS] "), ("gemma", "refused", ""), ("compact", None, "")])
def test_each_shipped_template_is_read_or_refused(tok, name, stop, opener):
    from finetune.config.data import template_path

    tok.chat_template = template_path(name).read_text()
    if stop == "refused":
        with pytest.raises(ConfigError, match="which is not JSON naming the function"):
            tool_calls.turn_format(tok)
        return
    fmt = tool_calls.turn_format(tok)
    assert (fmt.stop, fmt.opener) == (stop, opener)
    assert "RESULT42" in tool_calls.tool_turn(tok, [{"name": "f", "arguments": {"x": 1}}], ["RESULT42"], 1)


def test_the_planner_counts_the_turns_of_a_tool_rollout(compose, tmp_path, monkeypatch):
    from finetune.planner.peak import plan

    (tmp_path / "my_tools4.py").write_text("def f(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ["method=grpo", "data=quickstart_tools", "model.init.max_position_embeddings=1536", "method.completion_tokens=16"]
    one, two = plan(compose(common)), plan(compose([*common, "method.tools=[my_tools4:f]", "method.max_turns=2"]))
    assert "rows: counted at" in " ".join(one.notes) and two.activations > one.activations
    assert "3 turns of method.completion_tokens=16 (the tools' results are not counted" in " ".join(two.notes)


@pytest.mark.slow
def test_the_tool_quickstart_learns_to_call_the_tool(tmp_path):
    """+recipe=quickstart_tools, 30 steps on one rank: from the shipped SFT start, which calls the tool on about half the
    questions and names the right word in 2 calls of 3, the policy calls the tool more often and more often rightly
    (rewards/finetune.methods.toolbox:correct_call, the weight-0 reward), and exact match, the reward it is trained on, follows.
    Measured here (steps 1-10 -> 21-30): calls 0.63 -> 0.85, right calls 0.36 -> 0.45, exact match 0.34 -> 0.42; the
    calls' rise is the firm one (the means of 10 steps of 32 rollouts vary by about 0.03), the others' direction is checked."""
    train_here(["+recipe=quickstart_tools", "parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=30",
                "train.log_every=1"], tmp_path / "run")
    train = [r for r in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines()) if r.get("kind") == "train"]
    assert [r["step"] for r in train] == list(range(1, 31))

    def rise(key: str) -> tuple[float, float]:
        return sum(r[key] for r in train[:10]) / 10, sum(r[key] for r in train[-10:]) / 10

    calls, right, exact = rise("tool_calls"), rise("rewards/finetune.methods.toolbox:correct_call"), rise("rewards/exact_match")
    print(f"steps 1-10 -> 21-30: calls {calls[0]:.2f} -> {calls[1]:.2f}, right calls {right[0]:.2f} -> {right[1]:.2f}, "
          f"exact match {exact[0]:.2f} -> {exact[1]:.2f}")
    assert 0.3 < calls[0] < 0.75 and calls[1] > calls[0] + 0.12, calls
    assert right[1] > right[0] + 0.03 and exact[1] > exact[0] + 0.03, (right, exact)
