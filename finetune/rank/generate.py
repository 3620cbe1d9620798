"""Talk to a trained model: one prompt, a file of prompts, or an interactive chat.

    python -m finetune.generate RUN_DIR_or_MODEL [--prompt TEXT [--image PATH ...] | --file PROMPTS.txt|.jsonl]
                                [--system TEXT] [--tools TOOLS.json] [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S]

RUN_DIR: its final/ (an adapter is merged into its base first: finetune.rank.finished), rendered as the run trained: its
data.template (the tokenizer's chat template, or the built-in one) and data.system_prompt (--system replaces it),
through the same code that tokenized the training data, so a prompt ends where the trained responses began. A model
directory or hub id works too (its own chat template, no system prompt unless --system).

--prompt streams the response to stdout as it is generated; --image (a vision-language model's, repeatable) puts each
image before the prompt's text, or where the prompt says <image>. --file: a .txt file holds one prompt per line, a
.jsonl file one {"prompt": TEXT} or {"messages": [...]} per line, optionally with "tools" (a row's own, as in the
training data: tool calls and results in its messages; images as a training row holds them); the output is one JSON line per prompt ({"prompt", "response"}).
--tools: a JSON file holding a list of function schemas, offered with every prompt that has none of its own, rendered
by the template as training rendered a row's `tools` (a template that cannot render tools is refused). Neither: a chat on stdin (each line a user turn, the conversation kept; /reset starts
over; end with EOF or /exit). --temperature 0 (the default) is greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterator

from finetune.config import ConfigError, DataFormat, Template
from finetune.data.forms import images_of, to_messages
from finetune.data.images import PLACEHOLDER, anchor, has_images, pictures_of
from finetune.data.tokenize import encode, uses_chat_template
from finetune.data.tools import tools_of
from finetune.rank.finished import Finished, Refusal, load, locate

EXIT = ("/exit", "/quit")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m finetune.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a run directory (config.yaml + final/), a model directory or a hub id")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="one prompt (the user's message); its response streams to stdout")
    source.add_argument("--file", type=Path, help="prompts: .txt (one per line) or .jsonl ({prompt} or {messages}); JSON lines out")
    parser.add_argument("--image", action="append", default=[], help="an image the prompt shows (a vision-language model); "
                        "repeat for several: each goes where the prompt says <image>, else before its text")
    parser.add_argument("--system", help="the system prompt (default: the run's data.system_prompt)")
    parser.add_argument("--tools", type=Path, help="a JSON file: a list of function schemas offered with every prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.error = lambda message: _fail(f"{message} (python -m finetune.generate --help)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        if args.file is not None and not args.file.is_file():
            raise Refusal(f"--file {args.file}: no such file")
        if args.image and args.prompt is None:
            raise Refusal("--image goes with --prompt (a .jsonl --file row holds its own images)")
        offered = read_tools(args.tools) if args.tools is not None else None
        run = locate(args.model)
        run.generative("python -m finetune.generate")
        chat = Chat(run, args)
        if args.prompt is not None:
            shown = args.prompt if PLACEHOLDER in args.prompt or not args.image else PLACEHOLDER * len(args.image) + args.prompt
            chat.reply([{"role": "user", "content": shown}], stream=True, tools=offered, images=args.image)
        elif args.file is not None:
            for messages, tools, images in read_prompts(args.file):
                response = chat.reply(messages, tools=tools if tools is not None else offered, images=images)
                print(json.dumps({"prompt": messages[-1]["content"], "response": response}), flush=True)
        else:
            interactive(chat, tools=offered)
    except (Refusal, ConfigError) as e:
        _fail(str(e))
    return 0


def _fail(line: str) -> None:
    print(f"error: {line}", file=sys.stderr)
    sys.exit(2)


class Chat:
    """A model and how its prompts are rendered: the run's template and system prompt."""

    def __init__(self, run: Finished, args: argparse.Namespace) -> None:
        import torch

        self.model, self.tokenizer = load(run, args.dtype)
        data = run.config.data if run.config is not None else None
        self.template = data.template if data is not None else Template.auto
        self.system = args.system if args.system is not None else data.system_prompt if data is not None else None
        self.chat_template = uses_chat_template(self.tokenizer, self.template)
        self.settings = {"max_new_tokens": args.max_new_tokens, "pad_token_id": self.tokenizer.pad_token_id,
                         "eos_token_id": self.tokenizer.eos_token_id}
        if args.temperature > 0:
            self.settings |= {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
        else:
            self.settings |= {"do_sample": False}
        torch.manual_seed(args.seed)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The tokens training put before a response to `messages` (offering `tools`): the conversation with a placeholder
        response, tokenized as the training data was (finetune.data.tokenize.encode), cut where the response begins."""
        return self.prompt(messages, tools)[0]

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               images: list[Any] | None = None) -> tuple[list[int], tuple[Any, ...]]:
        """`prompt_ids` showing `images` (a vision-language model's; or the image parts of `messages`), and the images
        the tokens show, in order."""
        row = {"messages": [*messages, {"role": "assistant", "content": "x"}], **({"tools": tools} if tools else {}),
               **({"images": list(images)} if images else {})}
        rendered = to_messages(row, DataFormat.chat, self.system, "the prompt")
        example = encode(rendered, self.tokenizer, self.chat_template, tools=tools, where="the prompt",
                         images=images_of(row, rendered, "the prompt"))
        return example.input_ids[: example.prompt_len], example.images

    def reply(self, messages: list[dict[str, Any]], stream: bool = False, tools: list[dict[str, Any]] | None = None,
              images: list[Any] | None = None) -> str:
        """The model's response to the conversation (showing `images`); printed token by token as it comes with `stream`."""
        import torch
        from transformers import TextStreamer

        prompt, shown = self.prompt(messages, tools, images)
        ids = torch.tensor([prompt], device=self.model.device)
        pictures = pictures_of(self.tokenizer)
        seen = {k: v.to(self.model.device) for k, v in pictures.batch([list(shown)], ids.cpu()).items()} if shown and pictures else {}
        streamer = TextStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=streamer, **self.settings, **seen)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def read_tools(path: Path) -> list[dict[str, Any]]:
    """--tools: a JSON file holding a list of function schemas (OpenAI's {type, function} or bare {name, ...})."""
    if not path.is_file():
        raise Refusal(f"--tools {path}: no such file")
    try:
        tools = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise Refusal(f"--tools {path}: not JSON ({e.msg} at line {e.lineno})") from None
    return tools_of({"tools": tools}, f"--tools {path}") or []


def read_prompts(path: Path) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[Any] | None]]:
    """Each prompt of a .txt (one per line, blank lines skipped) or .jsonl file ({"prompt"} or {"messages"}, maybe with
    "tools" and images: an "images" list or image parts) as (messages, the row's tools or None, its images list or None)."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            yield [{"role": "user", "content": line}], None, None
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise Refusal(f"{path}:{number}: not JSON ({e.msg})") from None
        tools = tools_of(row, f"{path}:{number}") if isinstance(row, dict) else None
        if isinstance(row, dict) and has_images(row):  # its image paths read from the file's directory
            row = anchor(row, path.parent.resolve())
        images = row.get("images") if isinstance(row, dict) else None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            yield [{"role": "user", "content": row["prompt"]}], tools, images
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            yield row["messages"], tools, images
        else:
            raise Refusal(f"{path}:{number}: a line needs {{\"prompt\": TEXT}} or {{\"messages\": [...]}}")


def interactive(chat: Chat, read: Any = input, tools: list[dict[str, Any]] | None = None) -> None:
    """A conversation on stdin: each line a user turn, answered as it streams; /reset forgets, /exit or EOF ends."""
    tty = sys.stdin.isatty()
    if tty:
        print("chat: type a message; /reset starts over, /exit (or Ctrl-D) ends", flush=True)
    history: list[dict[str, str]] = []
    while True:
        try:
            line = read("> " if tty else "")
        except EOFError:
            break
        if line.strip() in EXIT:
            break
        if line.strip() == "/reset":
            history = []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        print("assistant: ", end="", flush=True)
        history.append({"role": "assistant", "content": chat.reply(history, stream=True, tools=tools)})


if __name__ == "__main__":
    sys.exit(main())
