"""finetune.generate: the site's commands (After training) as written, against a quickstart model trained in this session: a prompt
rendered as training rendered it, the same greedy tokens as the model gives in-process, a file of prompts, a chat."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import REPO, last_line, readme_commands, run_shell

RUN = "outputs/quickstart_sft"


def command(part: str) -> str:
    found = [c for c in readme_commands("finetune.generate") if part in c]
    assert len(found) == 1, f"the site has {len(found)} finetune.generate commands with {part!r}"
    return found[0]


def greedy(run_dir, messages: list[dict[str, str]], max_new_tokens: int = 128) -> str:
    """What the final model answers, greedily, to the prompt the run's eval data renders for `messages`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune import config
    from finetune.data.forms import to_messages
    from finetune.data.tokenize import encode, uses_chat_template

    cfg = config.load(run_dir / "config.yaml")
    tok = AutoTokenizer.from_pretrained(run_dir / "final")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final").eval()
    rendered = to_messages({"messages": [*messages, {"role": "assistant", "content": "x"}]}, cfg.data.format.chat, cfg.data.system_prompt, "t")
    example = encode(rendered, tok, uses_chat_template(tok, cfg.data.template))
    ids = torch.tensor([example.input_ids[: example.prompt_len]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_a_prompt_is_rendered_as_the_training_data_was(shipped):
    """The run's eval example's prompt tokens are the tokens generate puts before the response."""
    import argparse

    from finetune import config
    from finetune.rank import finished
    from finetune.data.forms import to_messages
    from finetune.data.sources import load_rows
    from finetune.data.tokenize import encode
    from finetune.rank.generate import Chat

    run_dir = shipped / RUN
    cfg = config.load(run_dir / "config.yaml")
    chat = Chat(finished.locate(str(run_dir)), argparse.Namespace(system=None, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0,
                                                                   dtype="fp32"))
    for row in load_rows(cfg.data.eval, "train", "data.eval").rows[:8]:  # as finetune/methods/sft.py encodes an eval row
        example = encode(to_messages(row, cfg.data.format, cfg.data.system_prompt, "t"), chat.tokenizer, chat.chat_template)
        user = row["instruction"] + f"\n{row['input']}"
        assert chat.prompt_ids([{"role": "user", "content": user}]) == example.input_ids[: example.prompt_len]
    chat.system = "be brief"  # --system: a system turn first, rendered by the same template
    assert chat.tokenizer.decode(chat.prompt_ids([{"role": "user", "content": "hi"}])) == "<|system|>be brief\n<|user|>hi\n<|assistant|>"


@pytest.mark.slow
def test_readme_prompt_streams_the_greedy_answer(shipped):
    out = run_shell(command("--prompt"), cwd=shipped)
    assert out.returncode == 0, out.stderr[-3000:]
    prompt = re.search(r"--prompt \$'(.*?)'", command("--prompt")).group(1).replace("\\n", "\n")
    answer = greedy(shipped / RUN, [{"role": "user", "content": prompt}])
    assert answer.strip(), "the 200-step model answers something"
    assert out.stdout == answer + "\n"  # TextStreamer ends the stream with a newline


@pytest.mark.slow
def test_readme_file_of_prompts_prints_one_json_line_each(shipped):
    from test_readme import site_heredocs

    (shipped / "prompts.jsonl").write_text(site_heredocs()["prompts.jsonl"] + "\n")
    out = run_shell(command("--file prompts.jsonl"), cwd=shipped)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["reverse\nhello", "double\nabc"]
    assert [line["response"] for line in lines] == [greedy(shipped / RUN, [{"role": "user", "content": p}])
                                                   for p in ("reverse\nhello", "double\nabc")]


@pytest.mark.slow
def test_readme_chat_on_stdin_keeps_the_conversation_until_reset(shipped):
    out = run_shell(command("printf"), cwd=shipped)
    assert out.returncode == 0, out.stderr[-3000:]
    turns = out.stdout.split("assistant: ")[1:]
    assert len(turns) == 2  # /reset is no turn
    first = greedy(shipped / RUN, [{"role": "user", "content": "uppercase"}])
    after_reset = greedy(shipped / RUN, [{"role": "user", "content": "shift"}])  # no history: /reset forgot the first
    assert turns == [first + "\n", after_reset + "\n"]


@pytest.mark.slow
def test_sampling_is_seeded(shipped):
    args = f"python -m finetune.generate {RUN} --prompt $'reverse\\nabc' --temperature 1.5 --top-p 0.95 --max-new-tokens 12 --seed 3"
    one, two = (run_shell(args, cwd=shipped) for _ in range(2))
    assert one.returncode == 0 and one.stdout == two.stdout


@pytest.mark.slow
def test_a_model_directory_without_a_run_uses_its_own_chat_template(shipped, tmp_path):
    """The export of the run (a merged model, no config.yaml) answers as the run does: the tokenizer's chat template
    is what the run trained with (data.template=auto)."""
    assert run_shell(f"python -m finetune.export {RUN} --out {tmp_path / 'merged'}", cwd=shipped).returncode == 0
    out = run_shell(f"python -m finetune.generate {tmp_path / 'merged'} --prompt $'reverse\\nhello'", cwd=shipped)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == greedy(shipped / RUN, [{"role": "user", "content": "reverse\nhello"}]) + "\n"


@pytest.mark.slow
def test_refusals_are_one_line(shipped):
    out = run_shell("python -m finetune.generate no/such/run --prompt hi", cwd=shipped)
    assert out.returncode == 2 and out.stderr.strip() == \
        "error: no/such/run: no such directory (give a run directory, a model directory or a hub id)"
    out = run_shell(f"python -m finetune.generate {RUN} --file missing.txt", cwd=shipped)
    assert out.returncode == 2 and out.stderr.strip() == "error: --file missing.txt: no such file"
    assert REPO.is_dir()


def test_prompt_files_txt_and_jsonl_and_their_mistakes(tmp_path):
    from finetune.rank.finished import Refusal
    from finetune.rank.generate import read_prompts

    txt = tmp_path / "p.txt"
    txt.write_text("reverse abc\n\nupper\n")
    assert list(read_prompts(txt)) == [([{"role": "user", "content": "reverse abc"}], None, None),
                                       ([{"role": "user", "content": "upper"}], None, None)]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}], "tools": [{"name": "f"}]}\n'
                     '{"prompt": "<image> c", "images": ["i.png"]}\n')
    assert list(read_prompts(jsonl)) == [([{"role": "user", "content": "a"}], None, None),
                                         ([{"role": "user", "content": "b"}], [{"type": "function", "function": {"name": "f"}}], None),
                                         ([{"role": "user", "content": "<image> c"}], None, [str(tmp_path.resolve() / "i.png")])]
    jsonl.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(Refusal, match=r'p.jsonl:2: a line needs \{"prompt": TEXT\} or \{"messages": \[...\]\}'):
        list(read_prompts(jsonl))
    jsonl.write_text("{oops\n")
    with pytest.raises(Refusal, match=r"p.jsonl:1: not JSON"):
        list(read_prompts(jsonl))


def test_tools_are_offered_as_the_template_renders_them(tmp_path):
    """--tools (or a row's own "tools"): the prompt is what the tokenizer's chat template renders for the conversation with
    those tools and a generation prompt (Qwen2.5's shipped template), and the answer comes after it; a template that cannot
    render tools, and a file that is not a list of schemas, are refused in one line."""
    import argparse

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from finetune.config import ASSETS
    from finetune.rank.finished import locate
    from finetune.rank.generate import Chat

    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizers/qwen2_5")
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    row = json.loads((ASSETS / "data/quickstart_tools/eval.jsonl").read_text().splitlines()[0])
    messages = row["messages"][:1]
    chat = Chat(locate(str(tmp_path / "model")), argparse.Namespace(system=None, max_new_tokens=4, temperature=0.0, top_p=1.0, seed=0,
                                                                      dtype="fp32"))
    text = tok.apply_chat_template(messages, tools=row["tools"], add_generation_prompt=True, tokenize=False)
    assert chat.prompt_ids(messages, row["tools"]) == tok(text, add_special_tokens=False)["input_ids"]
    assert "string_task" in tok.decode(chat.prompt_ids(messages, row["tools"])) and "string_task" not in tok.decode(chat.prompt_ids(messages))
    (tmp_path / "tools.json").write_text(json.dumps(row["tools"]))
    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"messages": messages, "tools": row["tools"]}) + "\n")
    out = run_shell(f"python -m finetune.generate {tmp_path / 'model'} --file {tmp_path / 'p.jsonl'} --tools {tmp_path / 'tools.json'} "
                    "--max-new-tokens 4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in lines] == ["shift biqpmz"] * 2 and lines[0]["response"] == lines[1]["response"]
    (tmp_path / "bad.json").write_text('{"name": "f"}')
    out = run_shell(f"python -m finetune.generate {tmp_path / 'model'} --prompt hi --tools {tmp_path / 'bad.json'}", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip() == (f"error: --tools {tmp_path / 'bad.json'}: 'tools' must be a list of function "
                                                          "schemas (or its JSON text), got dict")


@pytest.mark.slow
def test_tools_with_a_template_that_cannot_render_them_are_refused(shipped, tmp_path):
    (tmp_path / "tools.json").write_text('[{"name": "f"}]')
    out = run_shell(f"python -m finetune.generate {RUN} --prompt hi --tools {tmp_path / 'tools.json'}", cwd=shipped)
    assert out.returncode == 2 and last_line(out.stderr).startswith("error: the prompt: this row has tools or tool calls, but the "
                                                                    "chat template leaves out the tools' schemas"), out.stderr
