"""Tool calls, reasoning blocks and chat templates (finetune.data.tools, finetune.data.templates): which tokens carry
labels, decoded; the shipped family templates (Qwen2.5, Llama 3.1, Mistral, Gemma) aligned, prefix-stable or not; the
refusals, before launch and in the ranks; one 2-step CLI run on the shipped tool-call set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conftest import run_cli, write_jsonl
from finetune import methods
from finetune.config import ASSETS, ConfigError, DataConfig, Reasoning
from finetune.data import examples, templates
from finetune.data.sources import local_rows, sources
from finetune.data.tokenize import IGNORE, encode
from finetune.data.lengths import LightTokenizer, check_tools_template

TOOLS_DATA = ASSETS / "data" / "quickstart_tools"


def family(name: str):
    """A shipped tokenizer with a real family's template (finetune/assets/tokenizers/NAME: the quickstart vocabulary)."""
    return AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / name)


def light(name: str) -> LightTokenizer:
    d = ASSETS / "tokenizers" / name
    return LightTokenizer({f.name: f for f in d.iterdir()})


def spans(tok, ex) -> list[str]:
    """The labelled runs of an example, decoded, in order."""
    runs, run = [], []
    for t, label in zip(ex.input_ids, ex.labels):
        if label != IGNORE:
            run.append(t)
        elif run:
            runs, run = [*runs, tok.decode(run)], []
    return runs + ([tok.decode(run)] if run else [])


def row(name: str, n: int = 0) -> dict:
    return json.loads((TOOLS_DATA / name).read_text().splitlines()[n])


def data(**kw) -> DataConfig:
    return DataConfig(train="x", max_length=2048, **kw)


def sft(r: dict, tok, **kw):
    return methods.get("sft").encode(r, "rows.jsonl:1", tok, data(**kw), True).items[0]


QWEN_CALL = '<tool_call>\n{"name": "string_task", "arguments": {"task": "reverse", "word": "ldpbe"}}\n</tool_call><|im_end|>\n'


def test_tool_row_labels_exactly_the_call_and_the_answer():
    """The shipped tool row through Qwen2.5's template: the call and the final answer are labelled; the tools' schemas,
    the question and the tool's result are not (though they are in the input)."""
    tok = family("qwen2_5")
    ex = sft(row("train.jsonl"), tok)
    assert spans(tok, ex) == [QWEN_CALL, "ebpdl<|im_end|>\n"]
    text = tok.decode(ex.input_ids)
    assert text == tok.apply_chat_template(*_conversation(row("train.jsonl")), tokenize=False)
    assert '"description": "Apply a string task to a word and return the result."' in text
    assert "<|im_start|>user\n<tool_response>\nebpdl\n</tool_response><|im_end|>\n" in text


def _conversation(r: dict) -> tuple[list[dict], list[dict]]:
    """The row as transformers takes it (arguments as objects), to render independently of finetune."""
    messages = [dict(m) for m in r["messages"]]
    for m in messages:
        for call in m.get("tool_calls") or []:
            call["function"] = {**call["function"], "arguments": json.loads(call["function"]["arguments"])}
    return messages, r["tools"]


def test_sharegpt_tool_row_is_the_openai_row():
    """LLaMA-Factory's ShareGPT shape (function_call / observation turns, tools as JSON text) gives the same tokens and
    labels as OpenAI's shape of the same row."""
    tok = family("qwen2_5")
    openai, sharegpt = sft(row("train.jsonl"), tok), sft(row("train_sharegpt.jsonl"), tok)
    assert (openai.input_ids, openai.labels) == (sharegpt.input_ids, sharegpt.labels)


@pytest.mark.parametrize("name,call,answer", [
    ("llama3_1", '{"name": "string_task", "parameters": {"task": "reverse", "word": "ldpbe"}}<|eot_id|>', "ebpdl<|eot_id|>"),
    ("mistral", '[TOOL_CALLS] [{"name": "string_task", "arguments": {"task": "reverse", "word": "ldpbe"}, "id": "call00001"}]</s>',
     " ebpdl</s>"),
])
def test_tool_row_through_other_families(name, call, answer):
    tok = family(name)
    assert spans(tok, sft(row("train.jsonl"), tok)) == [call, answer]


MULTI = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"},
         {"role": "user", "content": "uppercase ab"}, {"role": "assistant", "content": "AB"}]


@pytest.mark.parametrize("name,labelled", [
    ("qwen2_5", ["cba<|im_end|>\n", "AB<|im_end|>\n"]),
    ("llama3_1", ["cba<|eot_id|>", "AB<|eot_id|>"]),
    ("mistral", [" cba</s>", " AB</s>"]),
])
def test_every_turn_is_labelled_in_three_families(name, labelled):
    tok = family(name)
    ex = encode(MULTI, tok, True)
    assert spans(tok, ex) == labelled
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(MULTI, tokenize=False)


def test_mistral_is_not_prefix_stable_and_is_aligned():
    """Mistral's template puts the system message in the last message when that is the user's (a prompt to generate
    from), so the first turn's prompt is no prefix of the whole conversation (the refusal this replaced), yet each
    response is found in it."""
    tok = family("mistral")
    prompt = tok.apply_chat_template(MULTI[:2], tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(MULTI, tokenize=False)
    assert not full.startswith(prompt)
    assert prompt == "<s>[INST] be brief\n\nreverse abc[/INST]"
    assert full == "<s>[INST] reverse abc[/INST] cba</s>[INST] uppercase ab[/INST] AB</s>"
    assert spans(tok, encode(MULTI, tok, True)) == [" cba</s>", " AB</s>"]


def test_gemma_by_name_and_its_refusals():
    """data.chat_template=gemma overrides the tokenizer's; Gemma's template takes no system message and no tools, and says so."""
    tok = templates.override(AutoTokenizer.from_pretrained(ASSETS / "tokenizer"), data(chat_template="gemma"))
    assert tok.chat_template == (ASSETS / "templates" / "gemma.jinja").read_text()
    assert spans(tok, encode(MULTI[1:], tok, True)) == ["cba<end_of_turn>\n", "AB<end_of_turn>\n"]
    with pytest.raises(ConfigError, match=r"^f:1: the chat template refuses this conversation \(System role not supported\)"):
        encode(MULTI, tok, True, where="f:1")
    with pytest.raises(ConfigError, match=r"^rows.jsonl:1: this row has tools or tool calls, but the chat template leaves out "
                                          r"everything \(it raised: Conversation roles must alternate"):
        sft(row("train.jsonl"), tok)


def test_light_tokenizer_renders_tools_as_transformers_does():
    """The planner's reader (no transformers) renders the families' tool conversations to the same text."""
    messages, tools = _conversation(row("train.jsonl", 1))
    for name in ("qwen2_5", "llama3_1", "mistral"):
        assert light(name).apply_chat_template(messages, tools=tools) == family(name).apply_chat_template(messages, tools=tools, tokenize=False)


THINK = "<think>string_task gave aammkk</think>"


@pytest.mark.parametrize("mode,labelled,in_input", [
    ("keep", [QWEN_CALL.replace("reverse", "double").replace("ldpbe", "amk"), THINK + "aammkk<|im_end|>\n"], True),
    ("mask", [QWEN_CALL.replace("reverse", "double").replace("ldpbe", "amk"), "aammkk<|im_end|>\n"], True),
    ("drop", [QWEN_CALL.replace("reverse", "double").replace("ldpbe", "amk"), "aammkk<|im_end|>\n"], False),
])
def test_reasoning_keep_mask_drop(mode, labelled, in_input):
    """data.reasoning: keep trains on the block, mask keeps it in the input out of the loss, drop removes it; each counts
    its tokens (one per character here)."""
    tok = family("qwen2_5")
    r = row("train.jsonl", 1)
    assert r["messages"][-1]["content"] == THINK + "aammkk"
    ex = sft(r, tok, reasoning=Reasoning(mode))
    assert spans(tok, ex) == labelled
    assert (THINK in tok.decode(ex.input_ids)) == in_input
    assert ex.thought == len(THINK)


def test_reasoning_is_counted_in_the_data_line():
    tok = family("qwen2_5")
    rows = local_rows(sources(str(TOOLS_DATA / "eval.jsonl"), "train", "data.train")[0], streamed=False)
    _, stats = examples.tokenize(rows, tok, data(reasoning=Reasoning.mask), "data.train")
    answers = [r["messages"][-1]["content"] for r in rows.rows]
    masked = sum(a.index("</think>") + len("</think>") for a in answers if a.startswith("<think>"))  # one token per character
    assert sum(a.startswith("<think>") for a in answers) == 16
    assert stats.line("train", 2048).endswith(f", 16 rows with reasoning ({masked} tokens masked out of the loss)")


def test_reasoning_tags_are_configurable_and_a_response_of_only_reasoning_is_refused(tok):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "[r]why[/r]ok"}]
    ex = encode(messages, tok, True, data=data(reasoning=Reasoning.mask, reasoning_tags=["[r]", "[/r]"]))
    assert spans(tok, ex) == ["ok</s>"] and ex.thought == len("[r]why[/r]")
    with pytest.raises(ConfigError, match=r"^f:1: the response is nothing but reasoning, which data.reasoning=drop removes"):
        encode([messages[0], {"role": "assistant", "content": "<think>x</think> "}], tok, True, data=data(reasoning=Reasoning.drop),
               where="f:1")


@pytest.mark.parametrize("content,why", [
    ("<think>why ok", "opens <think> and never closes it"),
    ("why</think>ok", "has </think> with no <think> before it"),
    ("<think>a<think>b</think>ok", "opens <think> again inside a reasoning block"),
])
@pytest.mark.parametrize("mode", list(Reasoning))
def test_a_malformed_reasoning_block_is_refused_naming_the_message_in_every_mode(tok, content, why, mode):
    """A block left open, closed without opening or nested: refused for the row (in every data.reasoning mode, and in a
    preference pair's responses, which are encoded the same way), never trained as plain text without a word."""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>fine</think>yes"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": content}]
    line = (f"f:3: messages[3] (assistant) {why}: a reasoning block must be <think>...</think> (data.reasoning_tags); fix the "
            "row, or it is trained as plain text")
    with pytest.raises(ConfigError) as refused:
        encode(messages, tok, True, data=data(reasoning=mode), where="f:3")
    assert str(refused.value) == line
    with pytest.raises(ConfigError) as refused:
        methods.get("dpo").encode({"prompt": messages[:3], "chosen": "<think>a</think>b", "rejected": content}, "f:3", tok,
                                  data(reasoning=mode), True)
    assert str(refused.value) == line  # the rejected response is the pair's messages[3] too
    assert encode(messages[:2], tok, True, data=data(reasoning=mode), where="f:3").thought == len("<think>fine</think>")


def test_preference_rows_with_tool_turns_in_the_prompt():
    """DPO's (and KTO's) rows may hold the call and its result in the prompt: only each response is labelled."""
    tok = family("qwen2_5")
    r = row("train_dpo.jsonl")
    pair = methods.get("dpo").encode(r, "f:1", tok, data(), True).items[0]
    assert spans(tok, pair.chosen) == [f"{r['chosen']}<|im_end|>\n"] and spans(tok, pair.rejected) == [f"{r['rejected']}<|im_end|>\n"]
    assert "<tool_response>\nebpdl\n</tool_response>" in tok.decode(pair.chosen.input_ids)
    kto = methods.get("kto").encode(r, "f:1", tok, data(), True).items  # a pair: one desirable and one undesirable row
    assert [spans(tok, e.row) for e in kto] == [[f"{r['chosen']}<|im_end|>\n"], [f"{r['rejected']}<|im_end|>\n"]]
    bad = {**r, "chosen": {"role": "assistant", "content": None, "tool_calls": r["prompt"][1]["tool_calls"]}}
    with pytest.raises(ConfigError, match=r"^f:1: 'chosen' is a tool call: a preference response must be text"):
        methods.get("dpo").check_row(bad, data(), "f:1")


@pytest.mark.parametrize("change,message", [
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].update(name="nope"),
     "f:1: messages[1] calls 'nope', which is not among the row's tools (string_task): fix the row or remove it"),
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="{not json"),
     "f:1: messages[1].tool_calls[0]'s arguments is not valid JSON (Expecting property name enclosed in double quotes at "
     "character 1): fix the row or remove it"),
    (lambda r: r["messages"].pop(1), "f:1: messages[1] is a tool result with no tool call before it: fix the row or remove it"),
    (lambda r: r.update(tools="[{]"), "f:1: 'tools' is not valid JSON (Expecting property name enclosed in double quotes at "
                                      "character 2): fix the row or remove it"),
])
def test_malformed_tool_rows_are_refused(change, message):
    r = row("train.jsonl")
    change(r)
    with pytest.raises(ConfigError) as e:
        methods.get("sft").check_row(r, data(), "f:1")
    assert str(e.value) == message


def test_templates_that_cannot_render_tools_are_refused(tok):
    r = row("train.jsonl")
    fix = ("use a tokenizer whose chat template renders tools, or data.chat_template=qwen2_5 (llama3_1, mistral: templates "
           "shipped with finetune)")
    with pytest.raises(ConfigError) as e:
        methods.get("sft").encode(r, "f:1", tok, data(), True)
    assert str(e.value) == ("f:1: this row has tools or tool calls, but the chat template leaves out the tools' schemas, the call's "
                            f"name, the call's arguments (probed with a conversation that calls a tool): {fix}")
    with pytest.raises(ConfigError) as e:
        methods.get("sft").encode(r, "f:1", tok, data(), False)
    assert str(e.value) == ("f:1: this row has tools or tool calls, which the built-in template cannot render (data.template=builtin, "
                            f"or a tokenizer with no chat template): {fix}")


def test_refused_before_launch_with_file_and_line(compose, tmp_path):
    """The launcher finds the first row with tools and probes the run's template (read without transformers)."""
    rows = [{"instruction": "reverse", "input": "abc", "output": "cba"}, row("train.jsonl")]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = compose(["data=jsonl", f"data.train={path}", "data.max_length=1536", "model.init.max_position_embeddings=1536"])
    where = examples.check(cfg.data, cfg.method.name)
    assert where == f"{path}:2"
    with pytest.raises(ConfigError, match=rf"^{path}:2: this row has tools or tool calls, but the chat template leaves out"):
        check_tools_template(cfg, where)
    check_tools_template(compose(["data=quickstart_tools", "model.init.max_position_embeddings=1536"]), where)  # qwen2_5 renders them


def test_chat_template_keys_are_checked(compose):
    with pytest.raises(ConfigError, match=r"data.chat_template=llama9 must be a .jinja file or a shipped template \(compact, gemma, llama3_1, "
                                          r"mistral, qwen2_5\)"):
        compose(["data.chat_template=llama9"])
    with pytest.raises(ConfigError, match=r"^data.chat_template=qwen2_5 has no effect with data.template=builtin"):
        compose(["data.chat_template=qwen2_5", "data.template=builtin"])
    with pytest.raises(ConfigError, match=r"data.reasoning_tags=\['<think>'\] must be two different non-empty tags"):
        compose(["data.reasoning_tags=['<think>']"])


def test_a_jinja_file_overrides_the_template(compose, tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text((ASSETS / "templates" / "llama3_1.jinja").read_text())
    cfg = compose([f"data.chat_template={path}"])
    tok = templates.override(AutoTokenizer.from_pretrained(ASSETS / "tokenizer"), cfg.data)
    assert spans(tok, encode(MULTI, tok, True)) == ["cba<|eot_id|>", "AB<|eot_id|>"]


@pytest.mark.slow
def test_tool_calls_train_two_steps(tmp_path: Path):
    """The command of docs/sft.md (Tool calls), 2 steps: the shipped tool rows (Qwen2.5's template by name), reasoning masked, packed; the run
    saves the template it trained with."""
    out = run_cli("+recipe=quickstart_sft", "data=quickstart_tools", "model.init.max_position_embeddings=1536", "data.reasoning=mask",
                  "data.packing=true", "parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=2", "optim.warmup_steps=0", "train.micro_batch_size=1",
                  "train.global_batch_size=2", "train.eval_every=0", "train.exact_match_samples=0", "train.progress_bar=false",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    answers = [json.loads(line)["messages"][-1]["content"] for line in (TOOLS_DATA / "train.jsonl").read_text().splitlines()]
    masked = sum(a.index("</think>") + len("</think>") for a in answers if a.startswith("<think>"))  # one token per character
    assert f"data train: 400 rows, 0 responses truncated at max_length=1536, 0 dropped (prompt too long), 200 rows with reasoning " \
           f"({masked} tokens masked out of the loss)" in out.stdout
    saved = (tmp_path / "run" / "final" / "chat_template.jinja").read_text()
    assert saved == (ASSETS / "templates" / "qwen2_5.jinja").read_text()


def test_a_template_file_that_does_not_compile_is_named_not_a_row(compose, tmp_path):
    """The user's .jinja file with a mistake of its own (a block left open, a filter jinja does not have): one line naming
    the file and its line, before any row is rendered (the launcher, and the ranks again); never `FILE:1: the chat
    template refuses this conversation ... fix the row`."""
    shipped = "compact, gemma, llama3_1, mistral, qwen2_5"
    for text, why in [("{% for m in messages %}{{ m.content }}{% endfor", "line 1: unexpected end of template, expected 'end of statement block'"),
                      ("{% for m in messages %}\n{{ m.content | shout }}{% endfor %}", "line 2: No filter named 'shout'")]:
        path = tmp_path / "mine.jinja"
        path.write_text(text)
        cfg = compose([f"data.chat_template={path}"])
        line = (f"data.chat_template={path}: {path}: {why}: the template does not compile, so no conversation can be rendered: "
                f"fix the file, or use a shipped template ({shipped})")
        with pytest.raises(ConfigError) as refused:
            templates.override(AutoTokenizer.from_pretrained(ASSETS / "tokenizer"), cfg.data)
        assert str(refused.value) == line
        out = run_cli("+recipe=quickstart_sft", f"data.chat_template={path}", "launcher.dry_run=true", cwd=tmp_path, timeout=120)
        assert (out.returncode, out.stderr.strip()) == (2, f"error: {line}")
    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    tok.chat_template = "{% if %}"
    with pytest.raises(ConfigError) as refused:
        templates.render(tok, MULTI, None, "train.jsonl:1")
    assert str(refused.value) == (f"the tokenizer's chat template ({tok.name_or_path}) does not compile (line 1: Expected an "
                                  "expression, got 'end of statement block'), so no conversation can be rendered: give a "
                                  "template that does (data.chat_template)")
