"""Chat templates: which one a run renders with, where each assistant message lies in a rendered conversation,
whether a template renders tools, and reasoning blocks in responses. No heavy imports (the launcher probes templates).

- The template: the tokenizer's, or data.chat_template's (a .jinja file, or a shipped one by name from
  finetune/assets/templates/: qwen2_5, llama3_1, gemma, mistral), set on the tokenizer (`override`) so that the
  token cache's key, generation and the run's saved tokenizer all see the one that trained.
- Response spans (`spans`): the whole conversation is rendered once; each assistant message's text is what the
  template adds for it after the conversation before it (rendered with the generation prompt), found in the whole
  rendering at or after where that prefix stops matching it (the two aligned by difflib where the prefix is not
  one). Templates that are prefix-stable (a conversation renders
  as a prefix of its continuation: ChatML, Llama 3, Gemma) align trivially; others align too (Mistral's puts the system
  message and the tools in the last user turn). Refused, naming the message: a template that renders an assistant
  message differently inside the conversation than at its end (e.g. one that strips earlier turns' reasoning), whose
  text then is nowhere to be found.
- Tools (`check_tools`): a template is probed once with a conversation that offers a tool, calls it and returns
  its result; one whose rendering leaves out the schema, the call's name or arguments, or the result is refused.
- Reasoning (data.reasoning, data.reasoning_tags): `split_reasoning` / `drop_reasoning` on response text.
"""

from __future__ import annotations

import re
from typing import Any

from finetune.config import ConfigError, DataConfig, ModelConfig
from finetune.config.data import TEMPLATES, template_path
from finetune.data.images import Pictures, attach
from finetune.families.vision import vision_of

Tools = list[dict[str, Any]] | None


def override(tokenizer: Any, data: DataConfig) -> Any:
    """The tokenizer with data.chat_template's template in place of its own (unchanged when that is null); a file that
    does not compile is refused naming its line (`check_compiles`)."""
    if data.chat_template:
        check_compiles(data)
        tokenizer.chat_template = template_path(data.chat_template).read_text()
    return tokenizer


def problem(template: str) -> str | None:
    """Why a chat template's text does not compile, as transformers compiles it (its sandbox, filters and extensions):
    `line N: message`; None when it compiles. Its refusals of a conversation (raise_exception) come only when rendering."""
    import jinja2
    from transformers.utils import chat_template_utils

    try:
        chat_template_utils._compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as e:
        return f"line {e.lineno}: {str(e.message).rstrip('.')}"
    except jinja2.TemplateError as e:
        return str(e).rstrip(".")
    return None


def check_compiles(data: DataConfig) -> None:
    """data.chat_template's file compiles, or one line naming the file and its line (before any row is rendered: a
    mistake in the user's template is not a mistake in a row)."""
    if data.chat_template:
        path = template_path(data.chat_template)
        why = problem(path.read_text())
        if why is not None:
            raise ConfigError(f"data.chat_template={data.chat_template}: {path}: {why}: the template does not compile, so no "
                              "conversation can be rendered: fix the file, or use a shipped template "
                              f"({', '.join(sorted(p.stem for p in TEMPLATES.glob('*.jinja')))})")


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: Tools, where: str, generation: bool = False) -> str:
    """The conversation as text, through the tokenizer's chat template; the template's own refusal as one line (a
    template that does not compile is named as the fault, not the row)."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)
    except jinja2.TemplateError as e:
        why = problem(str(tokenizer.chat_template))
        if why is not None:
            raise ConfigError(f"the tokenizer's chat template ({tokenizer.name_or_path}) does not compile ({why}), so no "
                              "conversation can be rendered: give a template that does (data.chat_template)") from None
        raise ConfigError(f"{where}: the chat template refuses this conversation ({e}): fix the row, or render with another "
                          "template (data.chat_template)") from None


def spans(messages: list[dict[str, Any]], tokenizer: Any, tools: Tools, where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the whole conversation rendered, each assistant message's [start, end) characters in it)."""
    full = render(tokenizer, messages, tools, where)
    out: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], tools, where, generation=True)
        upto = full if i == len(messages) - 1 else render(tokenizer, messages[: i + 1], tools, where)
        response = upto[_after(prompt, upto):]  # what the template adds for this message at the conversation's end
        start = full.find(response, max(cursor, _common(prompt, full))) if response.strip() else -1
        if start < 0:
            raise ConfigError(
                f"{where}: the chat template renders assistant message {i} differently inside the whole conversation than "
                "at its end, so its tokens cannot be found to label them: train on conversations ending at that message, or "
                "use another template (data.chat_template, data.template=builtin)")
        out.append((start, start + len(response)))
        cursor = start + len(response)
    return full, out


def _after(prompt: str, upto: str) -> int:
    """Where the response begins in `upto` (a conversation ending with it), given `prompt` (the conversation before it with
    the generation prompt): after the prompt when it is a prefix, else after the last stretch the two share (Mistral's
    template puts the system message in the last user turn, which is a different one in each)."""
    if upto.startswith(prompt):
        return len(prompt)
    from difflib import SequenceMatcher

    blocks = [m for m in SequenceMatcher(None, prompt, upto, autojunk=False).get_matching_blocks() if m.size]
    return blocks[-1].b + blocks[-1].size if blocks else 0


def _common(a: str, b: str) -> int:
    """The length of the longest common prefix of a and b."""
    if b.startswith(a):  # the usual case: a prefix-stable template
        return len(a)
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe_lookup", "description": "probe_description",
    "parameters": {"type": "object", "properties": {"probe_key": {"type": "string"}}, "required": ["probe_key"]}}}]
PROBE = [
    {"role": "user", "content": "probe_question"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "probe0001", "function": {"name": "probe_lookup", "arguments": {"probe_key": "probe_value"}}}]},
    {"role": "tool", "content": "probe_result", "tool_call_id": "probe0001", "name": "probe_lookup"},
    {"role": "assistant", "content": "probe_answer"},
]
_PROBED: dict[str, list[str]] = {}


def left_out(tokenizer: Any) -> list[str]:
    """What the tokenizer's template leaves out of a conversation with a tool (empty: it renders tools), probed once per
    template."""
    template = str(tokenizer.chat_template)
    if template not in _PROBED:
        try:
            text = tokenizer.apply_chat_template(PROBE, tools=PROBE_TOOLS, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template that raises on tool turns renders none
            _PROBED[template] = [f"everything (it raised: {str(e).splitlines()[0] if str(e) else type(e).__name__})"]
        else:
            after = text[text.find("probe_question"):]
            _PROBED[template] = [what for what, mark, where in (
                ("the tools' schemas", "probe_description", text), ("the call's name", "probe_lookup", after),
                ("the call's arguments", "probe_value", after), ("the tool's result", "probe_result", after)) if mark not in where]
    return _PROBED[template]


def check_tools(tokenizer: Any, chat: bool, where: str) -> None:
    """Refuse a row with tools or tool turns (at `where`) that the run's template cannot render."""
    fix = ("use a tokenizer whose chat template renders tools, or data.chat_template=qwen2_5 (llama3_1, mistral: templates "
           "shipped with finetune)")
    if not chat:
        raise ConfigError(f"{where}: this row has tools or tool calls, which the built-in template cannot render "
                          f"(data.template=builtin, or a tokenizer with no chat template): {fix}")
    missing = left_out(tokenizer)
    if missing:
        raise ConfigError(f"{where}: this row has tools or tool calls, but the chat template leaves out {', '.join(missing)} "
                          f"(probed with a conversation that calls a tool): {fix}")


def check_blocks(messages: list[dict[str, Any]], tags: list[str], where: str) -> None:
    """Every reasoning block of the assistant's messages opens and closes once (data.reasoning_tags): a block left open,
    closed without opening or opened inside another is refused naming the message, since it would be trained as plain
    text (or cut at the wrong place) without a word."""
    opening, closing = tags
    token = re.compile(f"{re.escape(opening)}|{re.escape(closing)}")
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or not isinstance(m.get("content"), str):
            continue
        inside = False
        for found in token.finditer(m["content"]):
            if found.group() == opening and inside:
                why = f"opens {opening} again inside a reasoning block"
            elif found.group() == closing and not inside:
                why = f"has {closing} with no {opening} before it"
            else:
                inside = not inside
                continue
            break
        else:
            if not inside:
                continue
            why = f"opens {opening} and never closes it"
        raise ConfigError(f"{where}: messages[{i}] (assistant) {why}: a reasoning block must be {opening}...{closing} "
                          f"(data.reasoning_tags); fix the row, or it is trained as plain text")


def _blocks(tags: list[str]) -> re.Pattern[str]:
    return re.compile(f"{re.escape(tags[0])}.*?{re.escape(tags[1])}", re.DOTALL)


def split_reasoning(text: str, tags: list[str]) -> list[tuple[str, bool]]:
    """Response text as (piece, is_reasoning) pieces, in order: each block, tags included, apart."""
    out: list[tuple[str, bool]] = []
    done = 0
    for m in _blocks(tags).finditer(text):
        out += [(text[done:m.start()], False), (m.group(), True)]
        done = m.end()
    out.append((text[done:], False))
    return [(t, r) for t, r in out if t]


def drop_reasoning(messages: list[dict[str, Any]], tags: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages with the assistant's reasoning blocks (and the whitespace after each) removed, and the removed text."""
    pattern = re.compile(f"{_blocks(tags).pattern}\\s*", re.DOTALL)
    removed: list[str] = []
    out = []
    for m in messages:
        if m["role"] == "assistant" and tags[0] in m["content"]:
            removed += pattern.findall(m["content"])
            m = {**m, "content": pattern.sub("", m["content"])}
        out.append(m)
    return out, removed


def load_tokenizer(cfg: ModelConfig, data: DataConfig | None = None) -> Any:
    """The model's tokenizer, with data.chat_template's template in place of its own when `data` sets one (the run's saved
    tokenizer then carries the template it trained with)."""
    from transformers import AutoTokenizer

    source = cfg.tokenizer or cfg.path
    try:
        tok = AutoTokenizer.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        key = "model.tokenizer" if cfg.tokenizer else "model.path"
        raise ConfigError(f"{key}={source!r}: could not load a tokenizer: {str(e).splitlines()[0]}") from None
    if tok.pad_token is None:  # many base-model tokenizers have none; padding is masked anyway
        if tok.eos_token is None:
            raise ConfigError(f"model.tokenizer={source!r} has neither a pad nor an eos token to pad with")
        tok.pad_token = tok.eos_token
    attach(tok, pictures_for(cfg))
    return override(tok, data) if data is not None else tok


def pictures_for(cfg: ModelConfig) -> Pictures | None:
    """A vision-language model's processor, as the data path reads images with it (finetune.data.images.Pictures), or None
    for a text model: read from model.path's config (a local config.json, else transformers' AutoConfig)."""
    if cfg.path is None:
        return None
    from finetune.disk import is_local, local_config

    config = local_config(cfg, whole=True) if is_local(cfg.path) else None
    if config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(cfg.path, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code).to_dict()
        except (OSError, ValueError):
            return None  # loading the model says why
    vision = vision_of(config)
    if vision is None:
        return None
    return Pictures(cfg.path, cfg.revision, cfg.trust_remote_code, vision.image_token_id, vision.model_type)
