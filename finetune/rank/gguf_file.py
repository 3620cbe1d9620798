"""A merged Hugging Face model -> one GGUF file (llama.cpp, Ollama), written with the `gguf` package.

The `gguf` package ships the format (GGUFWriter), the tensor names (TensorNameMap: Hugging Face module paths ->
blk.N.attn_q ...) and the quantizers, but not llama.cpp's converter (convert_hf_to_gguf.py lives in llama.cpp's
repository, not on PyPI). What a family's file needs beyond renaming is small and written here, as the inverse
of what transformers' GGUF loader undoes when it reads the file back (transformers/modeling_gguf_pytorch_utils.py):
llama's q/k rows permuted for llama.cpp's rotary layout, Gemma's norms stored as 1 + w, GPT-2's Conv1D weights
transposed, a MoE's fused gate_up experts split in two.

Families: those transformers' GGUF loader reads (ARCH), so the tests load every file back and compare its logits
with the merged model's; any other is refused in one line (`refusal`). The weights: f16 (2-D and larger tensors
in float16, norms and biases in float32, as llama.cpp writes them) or q8_0 (blocks of 32 int8 with one fp16 scale;
rows whose length is not a multiple of 32 stay f16).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

FORMATS = ("f16", "q8_0", "q4_0")

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen2_moe": "qwen2moe", "qwen3": "qwen3",
        "qwen3_moe": "qwen3moe", "phi3": "phi3", "gpt2": "gpt2", "gemma2": "gemma2", "gemma3_text": "gemma3"}
"""model_type -> GGUF architecture, for the families transformers' GGUF loader reads back (mistral is llama in GGUF)."""

WHY_NOT = {"mixtral": "a mixtral GGUF is llama's with experts, which transformers' GGUF loader reads as a dense llama"}
"""Families whose GGUF architecture transformers lists but cannot read whole."""


def refusal(model_type: str) -> str | None:
    """Why `model_type` cannot be exported to GGUF here (one line), or None."""
    if model_type in ARCH:
        return None
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    why = WHY_NOT.get(model_type) or f"transformers' GGUF loader reads no {model_type} file (it reads " + \
        ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")) + ")"
    return (f"--gguf: {why}, so this export could not be checked against the model; export without --gguf "
            "and convert with llama.cpp's convert_hf_to_gguf.py")


def write(model: Any, tokenizer_dir: Path, path: Path, fmt: str, name: str, on_grid: frozenset[str] = frozenset()) -> Path:
    """Write `model` (a merged transformers causal LM) and its tokenizer (tokenizer_dir's tokenizer.json) to `path`.
    q4_0: the weights named in `on_grid` (their values already on a 4-bit grid of 32-weight blocks: finetune.rank.qat's
    quantization, dequantized) as Q4_0 blocks holding that very grid, the rest as f16."""
    import gguf

    if fmt == "q4_0" and not on_grid:
        raise ValueError("--gguf q4_0: no weight of this model is on a 4-bit grid of 32-weight blocks (every linear layer's "
                         "input size is not a multiple of 32)")
    config = model.config.get_text_config()
    arch = ARCH[config.model_type]
    writer = _writer(path, arch)
    writer.add_name(file_name(name, tokenizer_dir))
    writer.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[fmt])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    hyperparameters(writer, config)
    vocabulary(writer, tokenizer_dir, config.vocab_size)
    for gguf_name, array, hf_name in tensors(model, arch, config):
        kind = ("f32" if any(k in gguf_name for k in KEEP_F32) else
                "f16" if fmt == "q4_0" and hf_name not in on_grid else fmt)
        data, dtype = encoded(array, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


NAMED_VOCABULARIES = {("phi-3", "phi3"): ("</s>", "<unk>", "<s>", "<|endoftext|>")}
"""Model names llama.cpp reads a vocabulary by (llama-vocab.cpp: a general.name containing "phi3" gets Phi-3's token
attributes, looked up by these tokens' text): a file of that name without them does not load ("unordered_map::at")."""


def file_name(name: str, tokenizer_dir: Path) -> str:
    """general.name for a run called `name`: as it is, unless a reader would take it for another model: transformers reads
    a llama file named exactly "mistral" as mistral (which gguf has no tensor names for), and llama.cpp a name with
    "phi3" in it as Phi-3's vocabulary (NAMED_VOCABULARIES)."""
    if name == "mistral":
        return f"{name}-model"
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"].get("vocab")
    known = (set(vocab) if isinstance(vocab, dict) else set()) | {t["content"] for t in spec.get("added_tokens", [])}
    for triggers, needs in NAMED_VOCABULARIES.items():
        if any(t in name.lower() for t in triggers) and not set(needs) <= known:
            for t in triggers:
                name = re.sub(re.escape(t), lambda m: m.group()[:-1] + "_" + m.group()[-1], name, flags=re.IGNORECASE)
    return name


def llamacpp_differs(model: Any) -> list[str]:
    """What llama.cpp computes differently from `model` whatever the file says, as `key=value (llama.cpp: ...)`: it scales
    Gemma 2 and 3's attention by 1/sqrt(head_dim) (27B: hidden/heads), where transformers takes query_pre_attn_scalar."""
    config = model.config.get_text_config()
    if config.model_type in ("gemma2", "gemma3_text"):
        head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
        scalar = config.query_pre_attn_scalar
        if scalar not in (head_dim, config.hidden_size // config.num_attention_heads):
            return [f"query_pre_attn_scalar={scalar} (llama.cpp scales attention by 1/sqrt(head_dim={head_dim}))"]
    return []


def _writer(path: Path, arch: str) -> Any:
    """gguf's GGUFWriter, which also writes an empty array of a declared element type: the format has them (a count of 0),
    llama.cpp reads them, and gguf 0.19's writer refuses them."""
    import gguf

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val: Any, vtype: Any, add_vtype: bool, sub_type: Any = None) -> bytes:
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                return (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer(path, arch)


def _first(config: Any, *names: str, default: Any = None) -> Any:
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), default)


def hyperparameters(writer: Any, config: Any) -> None:
    """The architecture's keys llama.cpp and transformers' GGUF loader read."""
    hidden = _first(config, "hidden_size", "n_embd")
    heads = _first(config, "num_attention_heads", "n_head")
    head_dim = _first(config, "head_dim", default=hidden // heads)
    writer.add_context_length(_first(config, "max_position_embeddings", "n_positions"))
    writer.add_embedding_length(hidden)
    writer.add_block_count(_first(config, "num_hidden_layers", "n_layer"))
    writer.add_feed_forward_length(_first(config, "intermediate_size", "n_inner", default=4 * hidden))
    writer.add_head_count(heads)
    writer.add_head_count_kv(_first(config, "num_key_value_heads", default=heads))
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "rms_norm_eps", None) is not None:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "layer_norm_epsilon", None) is not None:
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") or (rope.get("full_attention") or {}).get("rope_theta") or getattr(config, "rope_theta", None)
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0) or 1.0)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    experts = _first(config, "num_experts", "num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                     ("final_logit_softcapping", writer.add_final_logit_softcapping)):
        if getattr(config, key, None):
            add(float(getattr(config, key)))


def tensors(model: Any, arch: str, config: Any) -> Any:
    """(GGUF name, float32 array, Hugging Face name) for each weight, renamed and laid out as llama.cpp's converter
    writes it."""
    import gguf

    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     _first(config, "num_hidden_layers", "n_layer"))
    tied = getattr(config, "tie_word_embeddings", False)
    heads = _first(config, "num_attention_heads", "n_head")
    kv_heads = _first(config, "num_key_value_heads", default=heads)
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp and transformers' loader tie the head to token_embd when the file has no output.weight
        array = tensor.detach().float().cpu().numpy()
        stem, _, suffix = hf_name.rpartition(".")
        if stem.endswith("experts.gate_up_proj") or hf_name.endswith("experts.gate_up_proj"):  # fused (E, 2I, H) -> gate, up
            block = hf_name.split(".layers.")[1].split(".")[0]
            half = array.shape[1] // 2
            yield f"blk.{block}.ffn_gate_exps.weight", array[:, :half], hf_name
            yield f"blk.{block}.ffn_up_exps.weight", array[:, half:], hf_name
            continue
        if suffix not in ("weight", "bias"):  # a fused expert stack is a bare parameter: experts.down_proj
            stem, suffix = hf_name, "weight"
        mapped = names.get_name(stem)
        if mapped is None:
            raise ValueError(f"--gguf: no GGUF name for {hf_name} in gguf's {arch} tensor map")
        name = f"{mapped}.{suffix}"
        if arch == "llama" and mapped.endswith(("attn_q", "attn_k")) and suffix == "weight":
            array = _permute(array, heads, heads if mapped.endswith("attn_q") else kv_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            array = array + 1  # Gemma scales by (1 + w); llama.cpp multiplies by the stored weight
        if arch == "gpt2" and mapped.endswith(("attn_qkv", "attn_output", "ffn_up", "ffn_down")) and suffix == "weight":
            array = array.T  # Conv1D keeps (in, out)
        if mapped.endswith("ffn_gate_inp_shexp"):
            array = array.reshape(-1)
        yield name, np.ascontiguousarray(array), hf_name


def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k rows (convert_hf_to_gguf.py's LlamaModel.permute)."""
    n = n_head_kv if n_head_kv != n_head else n_head
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


KEEP_F32 = ("ffn_gate_inp", "position_embd")
"""Tensors llama.cpp's converter keeps in float32 whatever the format: a MoE's routers (a rounding flips which experts a
token goes to) and learned positions."""


def encoded(array: np.ndarray, fmt: str) -> tuple[np.ndarray, Any]:
    """(data, raw dtype) for GGUFWriter.add_tensor: vectors in float32; matrices in f16, or q8_0 where rows split into 32s
    (fmt f32: float32)."""
    import gguf

    if array.ndim < 2 or fmt == "f32":
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    if fmt == "q8_0" and array.shape[-1] % 32 == 0:
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    if fmt == "q4_0":
        return q4_0_blocks(array), gguf.GGMLQuantizationType.Q4_0
    return array.astype(np.float16), gguf.GGMLQuantizationType.F16


def q4_0_blocks(array: np.ndarray) -> np.ndarray:
    """A matrix whose values are already 4-bit (each block of 32 along a row: d x q, q integers in [-8, 7]) as ggml's
    Q4_0 blocks of that very grid: per block the fp16 scale d, then 16 bytes, byte j holding q_j + 8 and (high nibble)
    q_j+16 + 8. llama.cpp's own Q4_0 quantizer picks d from the block's largest value instead; here d is found back
    from the values (the largest magnitude is 8 d or 7 d), so the file holds the weights QAT trained against, not a
    second rounding of them. Values on no such grid are refused (ValueError)."""
    width = array.shape[-1]
    if width % 32:
        raise ValueError(f"q4_0: rows of {width} weights do not split into Q4_0's blocks of 32")
    blocks = array.reshape(-1, 32).astype(np.float64)
    largest = np.abs(blocks).max(-1, keepdims=True)
    q = np.zeros_like(blocks)
    d = np.zeros_like(largest)
    pending = largest[:, 0] > 0
    for steps in (8.0, 7.0):
        scale = np.where(pending[:, None], largest / steps, 1.0)
        ratio = blocks / scale
        fits = pending & (np.abs(ratio - np.round(ratio)) < 1e-3).all(-1) & (np.round(ratio) >= -8).all(-1) & (np.round(ratio) <= 7).all(-1)
        q[fits], d[fits], pending = np.round(ratio[fits]), scale[fits], pending & ~fits
    if pending.any():
        raise ValueError(f"q4_0: {int(pending.sum())} of {len(blocks)} blocks of 32 weights are not on a 4-bit grid "
                         "(quantize the model first: finetune.rank.qat.quantize)")
    nibbles = (q + 8).astype(np.uint8)
    packed = nibbles[:, :16] | (nibbles[:, 16:] << 4)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), packed], axis=-1)
    return out.reshape(*array.shape[:-1], -1)


def vocabulary(writer: Any, tokenizer_dir: Path, n_vocab: int) -> None:
    """The tokenizer as llama.cpp reads it: byte-level BPE ("gpt2", with its merges and the pre-tokenizer llama.cpp knows
    by name, `pre_tokenizer`), SentencePiece-style BPE with byte fallback ("llama", with whether a space is prepended), or
    a word-level vocabulary of single bytes (a byte-level BPE with no merges: the same tokens). Any other model (Unigram,
    WordPiece, a BPE that is neither) is refused in one line. Rows of the embedding past the tokenizer's vocabulary (a
    padded vocab_size) get unused [PADi] tokens."""
    import gguf
    from gguf.vocab import LlamaHfVocab, SpecialVocab, bytes_to_unicode

    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    kind = spec["model"]["type"]
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    if kind == "BPE" and spec["model"].get("byte_fallback"):
        tokens, _, types = (list(x) for x in zip(*LlamaHfVocab(tokenizer_dir).all_tokens()))
        scores = merge_scores(tokens, spec["model"].get("merges") or [])
        pad = range(len(tokens), n_vocab)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens + [f"[PAD{i}]" for i in pad])
        writer.add_token_scores(scores + [-1000.0 for _ in pad])
        writer.add_token_types(types + [gguf.TokenType.UNUSED for _ in pad])
        # llama.cpp prepends a space to a SentencePiece text unless told not to (Llama 2 does, Gemma does not)
        writer.add_add_space_prefix(space_prefix(spec))
    elif kind not in ("WordLevel", "BPE"):
        raise ValueError(f"--gguf: the tokenizer is a {kind} model (tokenizer.json), which llama.cpp reads only for "
                         "families this export does not write (T5's Unigram, BERT's WordPiece): export without --gguf")
    else:
        vocab = {i: t for t, i in spec["model"]["vocab"].items()} | {i: t["content"] for i, t in added.items()}
        if kind == "WordLevel":
            to_unicode = bytes_to_unicode()
            plain = [t for i, t in vocab.items() if i not in added]
            if any(len(t.encode()) != 1 for t in plain):
                raise ValueError("--gguf: the tokenizer is word-level with tokens longer than one byte, which llama.cpp "
                                 "has no model for: export without --gguf")
            vocab = {i: t if i in added else to_unicode[t.encode()[0]] for i, t in vocab.items()}
            writer.add_token_scores([0.0] * n_vocab)  # no merges: readers that derive them from scores find none
            # llama.cpp's BPE loader refuses a vocabulary without a merges array ("cannot find tokenizer merges"): an
            # empty one, so every word stays its single-byte tokens, as in the WordLevel tokenizer (a merge would need its
            # halves and their join in the vocabulary, which transformers' reader checks)
            writer.add_key_value(gguf.Keys.Tokenizer.MERGES, [], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
            pre = "default"  # single bytes whatever the split
        else:
            pre = pre_tokenizer(spec)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list([vocab.get(i, f"[PAD{i}]") for i in range(n_vocab)])
        writer.add_token_types([gguf.TokenType.UNUSED if i not in vocab else gguf.TokenType.CONTROL if added.get(i, {}).get("special")
                                else gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL for i in range(n_vocab)])
    special = SpecialVocab(tokenizer_dir, load_merges=kind == "BPE", n_vocab=n_vocab)
    template = tokenizer_dir / "chat_template.jinja"
    if special.chat_template is None and template.is_file():
        special.chat_template = template.read_text()
    special.add_to_gguf(writer, quiet=True)


def merge_scores(tokens: list[bytes], merges: list[Any]) -> list[float]:
    """SentencePiece scores from a BPE's merges: llama.cpp's SentencePiece model joins, again and again, the neighbours
    whose joined piece scores highest, where tokenizers' BPE applies the merge of lowest rank; so a piece scores minus
    the rank of the first merge that makes it (-1, -2, ...), and pieces no merge makes (bytes, characters, specials)
    score 0. gguf's LlamaHfVocab scores every piece -1000 (it reads no merges), and llama.cpp then joins the leftmost
    pair: other tokens than the tokenizer's."""
    rank: dict[bytes, int] = {}
    for i, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault((left + right).encode(), i)
    return [-(rank[t] + 1.0) if t in rank else 0.0 for t in tokens]


GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
"""The split of tokenizers' ByteLevel pre-tokenizer (use_regex), GPT-2's."""

PRE = {
    (GPT2_SPLIT,): "gpt-2",
    (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",): "llama-bpe",
    (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",): "qwen2",
}
"""A byte-level BPE's splits (tokenizer.json's regexes, in order) -> the llama.cpp pre-tokenizer that splits the same way
(llama-vocab.cpp: GPT-2's, Llama 3's, Qwen 2's). llama.cpp knows a pre-tokenizer only by name, so a split without an
entry here would be tokenized differently there: refused."""


def pre_tokenizer(spec: dict[str, Any]) -> str:
    """llama.cpp's name for how a byte-level BPE tokenizer.json splits text before merging; ValueError in one line
    when llama.cpp has none that splits the same way."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    splits, byte_level = [], False
    for step in steps:
        if step.get("type") == "Split" and "Regex" in step.get("pattern", {}) and step.get("behavior") == "Isolated" \
                and not step.get("invert"):
            splits.append(step["pattern"]["Regex"])
        elif step.get("type") == "ByteLevel" and not step.get("add_prefix_space"):
            byte_level = True
            if step.get("use_regex", True):
                splits.append(GPT2_SPLIT)
        else:
            raise ValueError(f"--gguf: the tokenizer's pre-tokenizer step {json.dumps(step)[:120]} has no llama.cpp "
                             "equivalent (it splits byte-level text by one named regex, with no prefix space): export "
                             "without --gguf")
    name = PRE.get(tuple(splits))
    if not byte_level or name is None:
        raise ValueError("--gguf: the tokenizer is a BPE model whose pre-tokenizer llama.cpp does not know by name "
                         f"({'not byte-level' if not byte_level else 'its split: ' + ' then '.join(splits)[:120]}; llama.cpp "
                         f"names {', '.join(PRE.values())} here), so llama.cpp would tokenize differently: export without --gguf")
    return name


def space_prefix(spec: dict[str, Any]) -> bool:
    """Whether a SentencePiece-style tokenizer.json puts "▁" before the text (a Prepend normalizer, or a Metaspace
    pre-tokenizer that prepends): llama.cpp's add_space_prefix."""
    found = []
    for key, inner in (("normalizer", "normalizers"), ("pre_tokenizer", "pretokenizers")):
        step = spec.get(key) or {}
        found += step.get(inner, []) if step.get("type") == "Sequence" else [step]
    return any(s.get("type") == "Prepend" and s.get("prepend") == "\u2581"
               or s.get("type") == "Metaspace" and (s.get("prepend_scheme") in ("always", "first") or s.get("add_prefix_space"))
               for s in found)


NOT_ARCHITECTURE = {"architectures", "dtype", "transformers_version", "_name_or_path", "pad_token_id", "bos_token_id", "eos_token_id",
                    "output_attentions", "output_hidden_states", "use_cache", "model_type"}
"""Config keys that do not change the logits (and mistral read back as llama: the same computation without a sliding window
shorter than the text)."""


def unread(path: Path, model: Any) -> list[str]:
    """What transformers' GGUF loader would build differently from `model`: its config read back from the file's metadata
    (`key=value read back (the model's: value)`), for the keys that change the logits. [] when it reads the same model."""
    from transformers import AutoConfig

    back = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    ours = model.config.get_text_config().to_dict()
    return [f"{k}={back.get(k)!r} read back (the model's: {v!r})" for k, v in ours.items()
            if k not in NOT_ARCHITECTURE and not _same(back.get(k), v)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-6 * max(abs(a), abs(b))  # GGUF stores float32
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b
