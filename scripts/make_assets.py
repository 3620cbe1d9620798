"""Generate the shipped quickstart assets: a character-level tokenizer and a small instruction set.

The quickstart must run with no download, so the project ships what it trains on. Run this to
regenerate them (the output is deterministic and committed):

    python scripts/make_assets.py

Writes finetune/assets/tokenizer/ (a Hugging Face fast tokenizer with a chat template),
finetune/assets/data/quickstart/{train,eval}.jsonl (alpaca-style rows) and
finetune/assets/data/quickstart_dpo/{train,eval}.jsonl (the same prompts as preference pairs:
chosen = the right answer, rejected = a plausible wrong one) and
finetune/assets/data/quickstart_kto/{train,eval}.jsonl (the pairs unpaired, as KTO's data comes: each prompt
once, with its right answer labelled true or its wrong one labelled false) and
finetune/assets/data/quickstart_tools/ (the same tasks as tool calls: `make_tool_rows`),
finetune/assets/data/quickstart_codes/ (questions only a tool answers: `make_code_rows`), and
finetune/assets/tokenizers/NAME/ (the tokenizer's vocabulary with each real family's template of
finetune/assets/templates/NAME.jinja: Qwen2.5's, Llama 3.1's, Mistral's v0.3, Gemma's).
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

ASSETS = Path(__file__).resolve().parent.parent / "finetune" / "assets"

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
# One token per printable ASCII character (and newline): a tiny model learns string tasks fast.
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def make_tokenizer(out: Path, template: str = CHAT_TEMPLATE) -> None:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character, newlines too
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL[4:],
        chat_template=template,
        model_max_length=512,
    )
    fast.save_pretrained(out)


# Short instructions on purpose: a 2-layer model learns all four from ~500 steps of batch 32
# (exact match 0% -> ~97% on held-out words); long instruction sentences slow it down several-fold.
TASKS = {
    "reverse": lambda w: w[::-1],
    "uppercase": lambda w: w.upper(),
    "double": lambda w: "".join(c + c for c in w),
    "shift": lambda w: "".join(chr((ord(c) - 97 + 1) % 26 + 97) for c in w),  # a->b, z->a
}


def make_rows(rng: random.Random, n: int, seen: set[tuple[str, str]]) -> list[dict]:
    rows = []
    instructions = list(TASKS)
    while len(rows) < n:
        instruction = rng.choice(instructions)
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
        if (instruction, word) in seen:
            continue
        seen.add((instruction, word))
        rows.append({"instruction": instruction, "input": word, "output": TASKS[instruction](word)})
    return rows


def near_miss(rng: random.Random, row: dict) -> str:
    """A plausible wrong answer: the right one with one character edited, or another task's answer."""
    right = row["output"]
    while True:
        kind = rng.choice(["substitute", "delete", "repeat", "swap", "other_task"])
        chars = list(right)
        i = rng.randrange(len(chars))
        if kind == "substitute":
            chars[i] = rng.choice(string.ascii_lowercase if chars[i].islower() else string.ascii_uppercase)
        elif kind == "delete":
            del chars[i]
        elif kind == "repeat":
            chars.insert(i, chars[i])
        elif kind == "swap" and len(chars) > 1:
            j = min(i + 1, len(chars) - 1) if i + 1 < len(chars) else i - 1
            chars[i], chars[j] = chars[j], chars[i]
        elif kind == "other_task":
            chars = list(TASKS[rng.choice([t for t in TASKS if t != row["instruction"]])](row["input"]))
        wrong = "".join(chars)
        if wrong != right:
            return wrong


def make_preferences(rng: random.Random, rows: list[dict]) -> list[dict]:
    """The SFT rows as (prompt, chosen, rejected); the prompt renders exactly as the SFT row does."""
    return [{"prompt": f"{r['instruction']}\n{r['input']}", "chosen": r["output"], "rejected": near_miss(rng, r)} for r in rows]


def make_unpaired(rng: random.Random, pairs: list[dict]) -> list[dict]:
    """Each pair's prompt once, with either response and its label: about half desirable, as feedback collected
    one answer at a time is (KTO's data)."""
    out = []
    for p in pairs:
        good = rng.random() < 0.5
        out.append({"prompt": p["prompt"], "completion": p["chosen"] if good else p["rejected"], "label": good})
    return out


TOOL = {"type": "function", "function": {
    "name": "string_task", "description": "Apply a string task to a word and return the result.",
    "parameters": {"type": "object", "properties": {"task": {"type": "string", "enum": list(TASKS)}, "word": {"type": "string"}},
                   "required": ["task", "word"]}}}


TOOL_ROWS = {"eval": 32, "train": 400}  # quickstart_tools: the first rows of each split as tool calls


def tool_row(row: dict, n: int, think: bool) -> dict:
    """One task as a tool call, OpenAI's shape: the user asks, the assistant calls string_task, the tool answers, the
    assistant answers from it (after a reasoning block when `think`)."""
    call_id = f"call{n:05d}"  # 9 characters: Mistral's template needs exactly that
    call = {"type": "function", "id": call_id, "function": {"name": "string_task", "arguments": json.dumps(
        {"task": row["instruction"], "word": row["input"]})}}
    answer = (f"<think>string_task gave {row['output']}</think>" if think else "") + row["output"]
    return {"tools": [TOOL], "messages": [
        {"role": "user", "content": f"{row['instruction']} {row['input']}"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "name": "string_task", "content": row["output"]},
        {"role": "assistant", "content": answer}]}


def sharegpt_tool_row(row: dict) -> dict:
    """The same in LLaMA-Factory's ShareGPT shape: function_call and observation turns, `tools` as JSON text."""
    call = {"name": "string_task", "arguments": {"task": row["instruction"], "word": row["input"]}}
    return {"tools": json.dumps([TOOL["function"]]), "conversations": [
        {"from": "human", "value": f"{row['instruction']} {row['input']}"}, {"from": "function_call", "value": json.dumps(call)},
        {"from": "observation", "value": row["output"]}, {"from": "gpt", "value": row["output"]}]}


def make_tool_rows(rows: list[dict], pairs: list[dict]) -> dict[str, list[dict]]:
    """quickstart_tools' files: every other row with a reasoning block; preference pairs whose prompt holds the call and
    its result (chosen: the right answer, rejected: the near miss)."""
    chat = [tool_row(r, n + 1, think=n % 2 == 1) for n, r in enumerate(rows)]
    preference = [{"tools": c["tools"], "prompt": c["messages"][:3], "chosen": p["chosen"], "rejected": p["rejected"]}
                  for c, p in zip(chat, pairs)]
    return {"chat": chat, "sharegpt": [sharegpt_tool_row(r) for r in rows], "preference": preference}


CODE_TOOL = {"type": "function", "function": {
    "name": "code", "description": "the code of a word",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}
CODE_ROWS = {"sft_eval": 32, "sft": 2000, "eval": 32, "train": 1000}
"""quickstart_codes' files and their rows; no word is in two of them."""
CALLING = 2
"""One SFT row in 2 calls the tool; the others answer at once (a guess on any word it has not seen)."""


def make_code_rows(rng: random.Random) -> dict[str, list[dict]]:
    """quickstart_codes: "code of WORD" asks for finetune.methods.toolbox.code(WORD), four digits only the tool knows (every
    WORD four letters, always where it stands: the 2-layer quickstart model names the right word in 2 calls of 3 after
    1,000 steps, none after 400; words of 3 to 6 letters it had not learnt to copy after 300). The SFT
    files (sft, sft_eval) teach the form of the exchange: every CALLING-th row calls `code` and answers with its result,
    the rest answer at once, so the model starts out calling sometimes. The RL files (train, eval) hold the question and
    the answer alone: the policy chooses to call."""
    from finetune.methods.toolbox import code

    words: set[str] = set()
    while len(words) < sum(CODE_ROWS.values()):
        words.add("".join(rng.choice(string.ascii_lowercase) for _ in range(4)))
    ordered, files = sorted(words), {}
    rng.shuffle(ordered)
    for name, n in CODE_ROWS.items():
        chosen, ordered = ordered[:n], ordered[n:]
        rows = []
        for i, word in enumerate(chosen):
            question, answer = {"role": "user", "content": f"code of \"{word}\""}, {"role": "assistant", "content": code(word)}
            if name.startswith("sft") and i % CALLING == 0:
                call = {"type": "function", "id": f"call{i:05d}", "function": {"name": "code", "arguments": json.dumps({"word": word})}}
                rows.append({"tools": [CODE_TOOL], "messages": [
                    question, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "name": "code", "content": code(word)}, answer]})
            else:
                rows.append({"tools": [CODE_TOOL], "messages": [question, answer]})
        files[name] = rows
    return files


def make_family_tokenizers(out: Path) -> None:
    """The shipped tokenizer with each family's chat template (the same vocabulary: a tiny model trains with any)."""
    for template in sorted((ASSETS / "templates").glob("*.jinja")):
        make_tokenizer(out / template.stem, template.read_text())


VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
"""Qwen2-VL's image tokens, added to the shipped vocabulary for the tiny vision-language model."""

VLM_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""The quickstart template, with an image content part written as Qwen2-VL writes it (its processor expands
<|image_pad|> to one token per 28x28 pixels)."""

IMAGE_SIDE = 56  # 2 x 2 tokens of 28 x 28 pixels: one per quadrant


def make_tiny_vlm(out: Path) -> None:
    """finetune/assets/models/tiny_vlm/: a Qwen2-VL architecture (a 2-layer vision tower and a 2-layer language model of
    the quickstart's size), the shipped vocabulary with Qwen's image tokens, and its image processor (PIL: no
    torchvision). No weights: model.from_scratch builds them (random, seed 0)."""
    import transformers as T

    from finetune.data.processors import _without_video

    make_tokenizer(out, VLM_TEMPLATE)
    tok = T.AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False)
    ids = tok.convert_tokens_to_ids
    text = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})  # head_dim 32 / 2
    config = T.Qwen2VLConfig(text_config=text, vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2,
                                                                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
                             image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                             vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
                             tie_word_embeddings=False)
    config.save_pretrained(out)
    pixels = IMAGE_SIDE * IMAGE_SIDE
    images = T.Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                        size={"shortest_edge": pixels, "longest_edge": pixels})
    _without_video(T.Qwen2VLProcessor)(image_processor=images, tokenizer=tok, chat_template=VLM_TEMPLATE).save_pretrained(out)


COLORS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 60, 220), "yellow": (235, 200, 20)}
PLACES = ("top left", "top right", "bottom left", "bottom right")


def make_image_rows(rng: random.Random, n: int, out: Path, split: str) -> list[dict]:
    """`n` pictures of a coloured square in one quadrant of a grey-speckled field (finetune/assets/data/quickstart_vlm/images/),
    each asked about twice: its colour, and where it is. The text alone cannot tell (chance: 1 in 4)."""
    from PIL import Image, ImageDraw

    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        color, place = rng.choice(list(COLORS)), rng.randrange(4)
        image = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (235, 235, 235))
        draw = ImageDraw.Draw(image)
        for _ in range(12):  # specks, so that no two pictures are the same
            x, y = rng.randrange(IMAGE_SIDE), rng.randrange(IMAGE_SIDE)
            draw.point((x, y), fill=(rng.randrange(150, 235),) * 3)
        half, side = IMAGE_SIDE // 2, rng.randrange(16, 27)
        x0 = (place % 2) * half + rng.randrange(0, half - side + 1)
        y0 = (place // 2) * half + rng.randrange(0, half - side + 1)
        shade = tuple(min(255, max(0, c + rng.randrange(-20, 21))) for c in COLORS[color])
        draw.rectangle((x0, y0, x0 + side - 1, y0 + side - 1), fill=shade)
        name = f"images/{split}_{i:03d}.png"
        image.save(out / name, optimize=True)
        for question, answer in (("What color is the square?", color), ("Where is the square?", PLACES[place])):
            rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": question}]},
                                      {"role": "assistant", "content": answer}]})
    rng.shuffle(rows)
    return rows


def main() -> None:
    make_tokenizer(ASSETS / "tokenizer")
    make_family_tokenizers(ASSETS / "tokenizers")
    rng = random.Random(0)
    seen: set[tuple[str, str]] = set()
    data = ASSETS / "data" / "quickstart"
    data.mkdir(parents=True, exist_ok=True)
    preference = ASSETS / "data" / "quickstart_dpo"
    preference.mkdir(parents=True, exist_ok=True)
    unpaired = ASSETS / "data" / "quickstart_kto"
    unpaired.mkdir(parents=True, exist_ok=True)
    tools = ASSETS / "data" / "quickstart_tools"
    tools.mkdir(parents=True, exist_ok=True)
    pair_rng, label_rng = random.Random(1), random.Random(2)
    for split, n in (("eval", 256), ("train", 4000)):  # eval first: train never repeats an eval row
        rows = make_rows(rng, n, seen)
        pairs = make_preferences(pair_rng, rows)
        tool_rows = make_tool_rows(rows[:TOOL_ROWS[split]], pairs)
        for path, out in ((data / f"{split}.jsonl", rows), (preference / f"{split}.jsonl", pairs),
                          (unpaired / f"{split}.jsonl", make_unpaired(label_rng, pairs)), (tools / f"{split}.jsonl", tool_rows["chat"]),
                          (tools / f"{split}_sharegpt.jsonl", tool_rows["sharegpt"]), (tools / f"{split}_dpo.jsonl", tool_rows["preference"])):
            with open(path, "w") as f:
                for row in out:
                    f.write(json.dumps(row) + "\n")
    codes = ASSETS / "data" / "quickstart_codes"
    codes.mkdir(parents=True, exist_ok=True)
    for name, out in make_code_rows(random.Random(4)).items():
        with open(codes / f"{name}.jsonl", "w") as f:
            for row in out:
                f.write(json.dumps(row) + "\n")
    make_tiny_vlm(ASSETS / "models" / "tiny_vlm")
    pictures, image_rng = ASSETS / "data" / "quickstart_vlm", random.Random(3)
    pictures.mkdir(parents=True, exist_ok=True)
    for split, n in (("eval", 32), ("train", 256)):
        with open(pictures / f"{split}.jsonl", "w") as f:
            for row in make_image_rows(image_rng, n, pictures, split):
                f.write(json.dumps(row) + "\n")
    print(f"wrote {ASSETS}")


if __name__ == "__main__":
    main()
