"""Tiny random-init vision-language models, built from their configs with a tokenizer made here (no hub, no
torchvision): a vision tower of 2 layers, a language model of 2 (mllama: 3, one of them cross-attention), hidden 64.
`config(name)` is the transformers config; `save(name, dir)` writes a model directory (config.json, the weights and the
tokenizer) as a checkpoint on disk would be. Sizes follow the constraints each class checks (tests/test_vision.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

H, VOCAB = 64, 256
WORDS = ("user assistant system what is the answer to a an of and yes no it shows small big plus minus times equals "
         "question").split() + list(".,?!:;'\"()[]-_/+=*0123456789")


def tokenizer(bos: str = "<s>", eos: str = "</s>", pad: str = "<pad>", specials: dict[str, str] | None = None,
              extra: tuple[str, ...] = ()) -> Any:
    """A word-level tokenizer of a few dozen words; `specials`: named special tokens (tokenizer.boi_token, ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for t in [pad, "<unk>", bos, eos, *WORDS]:
        vocab.setdefault(t, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos, pad_token=pad, unk_token="<unk>",
                                  extra_special_tokens=dict(specials or {}))
    added = [e for e in ("<|im_start|>", "<|im_end|>", *extra) if e not in tok.get_vocab()]
    if added:
        tok.add_special_tokens({"additional_special_tokens": added}, replace_extra_special_tokens=False)
    return tok


def _text(**kw: Any) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512) | kw


def _vit(image_size: int, patch_size: int, **kw: Any) -> dict[str, Any]:
    return dict(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=image_size,
                patch_size=patch_size) | kw


QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _qwen(kind: str) -> tuple[Any, Any]:
    import transformers as T

    tok = tokenizer(extra=QWEN_TOKENS)
    ids = tok.convert_tokens_to_ids
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # sums to head_dim / 2
    tokens = dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                  vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    ends = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if kind == "qwen2_vl":
        return T.Qwen2VLConfig(text_config=_text(rope_parameters=rope, **ends), **tokens, vision_config=dict(
            depth=2, embed_dim=H, hidden_size=H, num_heads=4, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2)), tok
    if kind == "qwen2_5_vl":
        return T.Qwen2_5_VLConfig(text_config=_text(rope_parameters=rope, **ends), **tokens, vision_config=dict(
            depth=2, hidden_size=H, intermediate_size=128, num_heads=4, out_hidden_size=H, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])), tok
    return T.Qwen3VLConfig(text_config=_text(head_dim=16, rope_parameters={**rope, "mrope_interleaved": True}, **ends),
                           **tokens, vision_config=dict(depth=2, hidden_size=H, intermediate_size=128, num_heads=4,
                                                        out_hidden_size=H, patch_size=16, spatial_merge_size=2,
                                                        temporal_patch_size=2, num_position_embeddings=16,
                                                        deepstack_visual_indexes=[0])), tok


def config(name: str) -> tuple[Any, Any]:
    """(the transformers config, its tokenizer) of the tiny `name` model."""
    import transformers as T

    if name.startswith("qwen"):
        return _qwen(name)
    if name == "gemma3":
        tok = tokenizer(bos="<bos>", eos="<eos>", specials={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                                            "image_token": "<image_soft_token>"})
        ids = tok.convert_tokens_to_ids
        return T.Gemma3Config(text_config=_text(head_dim=16, sliding_window=16, query_pre_attn_scalar=16),
                              vision_config=_vit(32, 8, vision_use_head=False), mm_tokens_per_image=4,
                              boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
                              image_token_index=ids("<image_soft_token>")), tok
    if name == "llava":
        tok = tokenizer(specials={"image_token": "<image>"})
        return T.LlavaConfig(text_config=dict(model_type="llama", **_text()),
                             vision_config=dict(model_type="clip_vision_model", projection_dim=H, **_vit(28, 14)),
                             image_token_index=tok.image_token_id, vision_feature_layer=-2,
                             vision_feature_select_strategy="default"), tok
    if name == "llava_next":  # LLaVA's successor: each image a base view and tiles of the best grid ("anyres")
        tok = tokenizer(specials={"image_token": "<image>"})
        return T.LlavaNextConfig(text_config=dict(model_type="llama", **_text()),
                                 vision_config=dict(model_type="clip_vision_model", projection_dim=H, **_vit(28, 14)),
                                 image_token_index=tok.image_token_id, vision_feature_layer=-2,
                                 vision_feature_select_strategy="default", image_grid_pinpoints=PINPOINTS), tok
    if name == "mllama":
        tok = tokenizer(bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", extra=("<|image|>",))
        return T.MllamaConfig(text_config=_text(num_hidden_layers=3, cross_attention_layers=[1], bos_token_id=tok.bos_token_id,
                                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
                              vision_config=dict(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_global_layers=1,
                                                 attention_heads=4, image_size=28, patch_size=14, max_num_tiles=4,
                                                 intermediate_layers_indices=[0, 1], vision_output_dim=H * 3),
                              image_token_index=tok.convert_tokens_to_ids("<|image|>")), tok
    if name == "mistral3":
        tok = tokenizer(extra=("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
        return T.Mistral3Config(text_config=dict(model_type="mistral", head_dim=16, **_text()),
                                vision_config=dict(model_type="pixtral", head_dim=16, **_vit(56, 14)),
                                image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
                                vision_feature_layer=-1), tok
    if name == "internvl":  # a Qwen2 language model; InternVL's processor names its image tokens through the tokenizer
        tok = tokenizer(extra=("<img>", "</img>", "<IMG_CONTEXT>", "<video>"),
                        specials={"start_image_token": "<img>", "end_image_token": "</img>",
                                  "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"})
        return T.InternVLConfig(text_config=dict(model_type="qwen2", **_text()),
                                vision_config=dict(hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, image_size=[28, 28], patch_size=[14, 14]),
                                image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), downsample_ratio=0.5,
                                vision_feature_layer=-1, vision_feature_select_strategy="default"), tok
    if name in ("idefics3", "smolvlm"):  # SmolVLM: Idefics3's architecture, a processor of its own (num2words)
        tok = tokenizer(extra=("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"))
        return (T.SmolVLMConfig if name == "smolvlm" else T.Idefics3Config)(text_config=dict(model_type="llama", **_text()), vision_config=_vit(32, 8),
                                image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2,
                                pad_token_id=tok.pad_token_id), tok
    raise KeyError(name)


NAMES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava", "llava_next", "mllama", "mistral3", "idefics3", "smolvlm",
         "internvl")
PINPOINTS = [[28, 56], [56, 28], [56, 56]]
"""LLaVA-NeXT's grids of tiles (its image_grid_pinpoints), in pixels."""


def build(name: str) -> Any:
    """The tiny model, random-init (seed 0)."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config(name)[0])


def template(image: str) -> str:
    """A ChatML chat template that renders an {"type": "image"} content part as `image` (what the model's own template
    writes for it: Qwen's <|vision_start|><|image_pad|><|vision_end|>, Gemma 3's <start_of_image>, ...)."""
    return ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}" + image + "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
            "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


IMAGE_SIDE = {"qwen2_vl": 56, "qwen2_5_vl": 56, "qwen3_vl": 64, "gemma3": 32, "llava": 28, "llava_next": 28, "mllama": 28,
              "idefics3": 32, "smolvlm": 32, "internvl": 28, "mistral3": 56}
"""The image size each tiny processor resizes to."""


def processor(name: str, tok: Any) -> Any:
    """The tiny `name` model's processor (its image processor's PIL class: no torchvision), with a chat template."""
    import transformers as T

    from finetune.data.processors import _without_video

    side = IMAGE_SIDE[name]
    if name.startswith("qwen"):
        patch = 16 if name == "qwen3_vl" else 14
        ip = T.Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                        size={"shortest_edge": side * side, "longest_edge": side * side})
        cls = {"qwen2_vl": T.Qwen2VLProcessor, "qwen2_5_vl": T.Qwen2_5_VLProcessor, "qwen3_vl": T.Qwen3VLProcessor}[name]
        return _without_video(cls)(image_processor=ip, tokenizer=tok,
                                   chat_template=template("<|vision_start|><|image_pad|><|vision_end|>"))
    if name == "gemma3":
        return T.Gemma3Processor(image_processor=T.Gemma3ImageProcessorPil(size={"height": side, "width": side}), tokenizer=tok,
                                 image_seq_length=4, chat_template=template("<start_of_image>"))
    if name == "llava":
        ip = T.LlavaImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        return T.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                                num_additional_image_tokens=1, chat_template=template("<image>"))
    if name == "llava_next":
        ip = T.LlavaNextImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                          image_grid_pinpoints=PINPOINTS)
        return T.LlavaNextProcessor(image_processor=ip, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                                    num_additional_image_tokens=1, chat_template=template("<image>"))
    if name == "mllama":
        return T.MllamaProcessor(image_processor=T.MllamaImageProcessorPil(size={"height": side, "width": side}, max_image_tiles=4),
                                 tokenizer=tok, chat_template=template("<|image|>"))
    if name == "idefics3":
        ip = T.Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": side},
                                         max_image_size={"longest_edge": side})
        return T.Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=4, chat_template=template("<image>"))
    if name == "internvl":  # one 28 x 28 view per image (no tiles): 4 patches, merged to 1 token
        ip = T.GotOcr2ImageProcessorPil(size={"height": side, "width": side}, crop_to_patches=False)
        return _without_video(T.InternVLProcessor)(image_processor=ip, tokenizer=tok, image_seq_length=1,
                                                   chat_template=template("<IMG_CONTEXT>"))
    if name == "smolvlm":  # it takes a video processor too, which needs torchvision: built without one, as finetune does
        ip = T.SmolVLMImageProcessorPil(do_image_splitting=False, size={"longest_edge": side},
                                        max_image_size={"longest_edge": side})
        return _without_video(T.SmolVLMProcessor)(image_processor=ip, tokenizer=tok, image_seq_len=4,
                                                  chat_template=template("<image>"))
    if name == "mistral3":  # transformers hides PixtralProcessor without torchvision: the class finetune loads instead
        from finetune.data.processors import _processor_class

        ip = T.PixtralImageProcessorPil(size={"longest_edge": side}, patch_size={"height": 14, "width": 14})
        return _processor_class("PixtralProcessor")(image_processor=ip, tokenizer=tok, patch_size=14, spatial_merge_size=2,
                                                    chat_template=template("[IMG]"))
    raise KeyError(name)


def save(name: str, where: Path, with_processor: bool = False) -> Path:
    """A model directory of the tiny `name` model: config.json, weights, tokenizer (and its processor, with a chat
    template: what a vision-language checkpoint on the hub holds)."""
    _, tok = config(name)
    build(name).save_pretrained(where)
    tok.save_pretrained(where)
    if with_processor:
        processor(name, tok).save_pretrained(where)  # Pixtral's names its image processor PixtralImageProcessor, as the hub's
    return where


def image(where: Path, side: int = 40, seed: int = 0, width: int | None = None) -> Path:
    """A random RGB PNG of `side` x `width` pixels."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((side, width or side, 3)) * 255).astype("uint8")
    Image.fromarray(pixels).save(where)
    return where
