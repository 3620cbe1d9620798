"""What the GGUF export is checked with: tiny configs of every family it writes (`tiny_config`), and tiny tokenizers of
every kind a user's model brings, trained here in a fraction of a second (no hub): byte-level BPE
split as GPT-2, Llama 3 and Qwen 2 split, SentencePiece-style BPE with byte fallback with and without a prepended space
(Llama 2 and Mistral; Gemma), and a Unigram one (T5's kind, which the GGUF export refuses). `make(kind, directory)` writes
tokenizer.json and tokenizer_config.json there, as a hub checkpoint has them. Used by tests/test_export.py (transformers' reader) and by
scripts/llamacpp_check.py (what llama.cpp itself makes of the exported files)."""

from __future__ import annotations

from pathlib import Path

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, vocab_size=103, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LOADABLE = {"qwen3": dict(head_dim=128), "mistral": dict(sliding_window=None), "gemma2": dict(head_dim=256), "gemma3_text": dict(head_dim=256),
            "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2), "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
            "gpt2": dict(max_position_embeddings=1024, intermediate_size=None)}
"""Tiny configs within what transformers' GGUF loader can read back: it takes qwen3's head_dim, the MoE experts' widths
and GPT-2's n_positions / n_inner from no key of the file, so those keep transformers' defaults; it reads a mistral file as
llama (no sliding window) and assumes qwen3_moe normalises its top-k routing weights. Gemma's head_dim is its default
query_pre_attn_scalar (256), as in Gemma 2 2B and 9B: transformers' loader reads no query_pre_attn_scalar, and llama.cpp
scales attention by 1/sqrt(head_dim) (gguf_file.llamacpp_differs)."""


def tiny_config(family: str, **changes):
    """A tiny config of `family` (TINY, LOADABLE) with `changes` (vocab_size, special ids, initializer_range ...)."""
    from transformers import AutoConfig

    if family == "gpt2":
        fields = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=103, bos_token_id=1, eos_token_id=2) | changes
        return AutoConfig.for_model("gpt2", **{k: v for k, v in fields.items() if k != "pad_token_id"})
    return AutoConfig.for_model(family, **TINY | LOADABLE.get(family, {}) | changes)


LLAMA3_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

KINDS = ("bpe-gpt2", "bpe-llama3", "bpe-qwen2", "spm-llama", "spm-gemma")
"""The kinds llama.cpp reads; "unigram" is made too, for its refusal."""

PROMPTS = [
    "Hello, world! How are you today?",
    "reverse: abc123 -> 321cba",
    "The quick brown fox jumps over the lazy dog.\nNew line, then  two spaces.",
    "Numbers 1234567 and 3.14159; it's what we'll do, they'd say.",
    "  leading spaces and trailing ones  ",
    "uppercase: HELLO WORLD",
    "tabs\there and\r\nwindows lines",
    "émigré café naïve — ünïcödé ✓ 日本語",
    "double: 2 4 8 16 32 64 128",
    "shift letters: abcxyz -> bcdyza",
    "{\"json\": [1, 2, 3], \"ok\": true}",
    "a",
]
"""Texts the checks tokenize: words, numbers split by 1-3 digits or one, contractions, whitespace runs, non-ASCII
(bytes the small vocabularies never saw: byte fallback or byte tokens)."""


def corpus() -> list[str]:
    """What the tokenizers learn from: the shipped quickstart data's text, and the prompts' kinds of text."""
    import json

    from finetune.config import ASSETS

    lines = []
    for f in sorted((ASSETS / "data" / "quickstart").glob("*.jsonl"))[:1]:
        for row in f.read_text().splitlines()[:400]:
            lines.append(" ".join(str(v) for v in json.loads(row).values()))
    english = "the quick brown fox jumps over the lazy dog and it's what we'll say they'd do; numbers 123 456 789 world hello"
    return lines + [english] * 20


def make(kind: str, directory: Path, vocab_size: int = 400) -> Path:
    """A trained tokenizer of `kind` in `directory` (tokenizer.json, tokenizer_config.json); returns the directory."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    if kind.startswith("bpe-"):
        tok = Tokenizer(models.BPE())
        split = {"bpe-llama3": LLAMA3_SPLIT, "bpe-qwen2": QWEN2_SPLIT}.get(kind)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        specials = ["<|endoftext|>", "<|pad|>"]
        tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                       pad_token="<|pad|>")
    elif kind.startswith("spm-"):
        specials = ["<unk>", "<s>", "</s>"]
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials)
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        steps = ([normalizers.Prepend("\u2581")] if kind == "spm-llama" else []) + [normalizers.Replace(" ", "\u2581")]
        tok.normalizer = normalizers.Sequence(steps)
        tok.train_from_iterator(corpus(), trainer)
        # SentencePiece's byte pieces <0x00>..<0xFF> right after the specials, as Llama 2's vocabulary has them
        learned = tok.get_vocab()
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
                  for m in __import__("json").loads(tok.to_str())["model"]["merges"]]
        ordered = specials + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in sorted(learned.items(), key=lambda x: x[1])
                                                                        if t not in specials]
        vocab = {t: i for i, t in enumerate(ordered)}
        model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
        tok = Tokenizer(model)
        tok.normalizer = normalizers.Sequence(steps)
        tok.add_special_tokens(specials)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if kind == "spm-llama" else []))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.train_from_iterator(corpus(), trainers.UnigramTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"],
                                                                  unk_token="<unk>"))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}: one of {KINDS + ('unigram',)}")
    fast.save_pretrained(directory)
    return directory
