"""Rows with images, for vision-language models (finetune/data/images.py): the forms a row holds them in, their tokens
as the model's own processor writes them, the batch's image inputs, the refusals, the token cache, and a run through
the real command line with generation and export after it. Tiny random-init models of eleven classes with processors
built here (tests/vision_models.py); images are random PNGs."""

from __future__ import annotations

import itertools
import json

import pytest

import vision_models
from conftest import run_cli, train_here, write_jsonl
from finetune.config import ConfigError, DataConfig, ModelConfig

torch = pytest.importorskip("torch")

CLASSES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava", "llava_next", "mllama", "idefics3", "smolvlm", "internvl",
           "mistral3")
SHORT = ["+recipe=quickstart_sft", "model=pretrained", "data.format=auto", "data.eval=null", "data.eval_size=4",
         "launcher.nproc_per_node=1", "parallelism=single", "optim.warmup_steps=0", "train.micro_batch_size=2",
         "train.global_batch_size=4", "train.eval_every=0"]


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    """Model directories (config, weights, tokenizer, processor with its chat template) of every tested class."""
    root = tmp_path_factory.mktemp("vlms")
    return {name: vision_models.save(name, root / name, with_processor=True) for name in CLASSES}


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """A data directory: images of several sizes under img/, rows that name them relative to the data file."""
    root = tmp_path_factory.mktemp("images")
    (root / "img").mkdir()
    for i in range(12):
        vision_models.image(root / "img" / f"{i}.png", 28 + 3 * i, i, 36 + 2 * i)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": f"img/{i}.png"},
                                                       {"type": "text", "text": "what is it ?"}]},
                          {"role": "assistant", "content": ["small", "big"][i % 2] + " ."}]} for i in range(12)]
    write_jsonl(root / "train.jsonl", rows)
    return root


def _tokenized(path, rows, root, max_length=256, file="rows.jsonl"):
    from finetune.data.examples import load_split
    from finetune.data.templates import load_tokenizer

    data = DataConfig(train=write_jsonl(root / file, rows), eval_size=0, max_length=max_length)
    tok = load_tokenizer(ModelConfig(path=str(path)), data)
    train, _, stats = load_split(data, tok, 0)
    return tok, train, stats


MIXED = [
    {"images": ["img/1.png", "img/2.png"], "conversations": [
        {"from": "human", "value": "<image> and <image> what ?"}, {"from": "gpt", "value": "yes it is big"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "image", "image": "img/3.png"}]},
                  {"role": "assistant", "content": "small ."},
                  {"role": "user", "content": [{"type": "text", "text": "and this ? "}, {"type": "image", "path": "img/4.png"}]},
                  {"role": "assistant", "content": "big ."}]},
    {"instruction": "what is the answer ?", "output": "no"},
]


@pytest.mark.parametrize("name", CLASSES)
def test_an_image_row_becomes_the_tokens_and_loss_the_models_own_processor_gives(vlms, pictures, name):
    """Two images in one ShareGPT row: the token ids equal the processor's on the rendered conversation (each image
    expanded as the class does: Qwen's grid of its size, Gemma 3's fixed 4 within its markers, Mllama's one token), no
    image token carries a label, and the model's loss on our batch equals its loss on the processor's inputs."""
    from PIL import Image

    from finetune.data.batches import collate
    from finetune.data.images import pictures_of
    from finetune.data.tokenize import IGNORE
    from finetune.methods.sft import SFT
    from transformers import AutoModelForImageTextToText

    tok, train, _ = _tokenized(vlms[name], MIXED[:1], pictures)
    (ex,) = train
    proc = pictures_of(tok).processor
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " and "}, {"type": "image"},
                                                 {"type": "text", "text": " what ?"}]}, {"role": "assistant", "content": "yes it is big"}]
    images = [Image.open(pictures / "img" / f"{i}.png").convert("RGB") for i in (1, 2)]
    text = proc.tokenizer.apply_chat_template(conversation, chat_template=proc.chat_template, tokenize=False)  # SmolVLM's
    ref = proc(text=[text], images=[images], return_tensors="pt",  # own apply_chat_template reads its video processor
               add_special_tokens=False)
    want = ref["input_ids"][0].tolist()
    if name == "mllama":  # its processor puts a BOS first, which our template (ChatML) does not write
        assert want[0] == tok.bos_token_id
        want = want[1:]
        ref = {k: v[:, 1:] if k in ("input_ids", "attention_mask", "cross_attention_mask") else v for k, v in ref.items()}
    assert ex.input_ids == want
    config = vision_models.config(name)[0]
    image_token = config.image_token_id if hasattr(config, "image_token_id") else config.image_token_index
    assert ex.input_ids.count(image_token) > 0
    assert all(label == IGNORE for t, label in zip(ex.input_ids, ex.labels) if t == image_token)
    assert [tok.decode([t]) for t, label in zip(ex.input_ids, ex.labels) if label != IGNORE][:4] == ["yes", "it", "is", "big"]
    batch = collate([ex], tok.pad_token_id, pictures=pictures_of(tok))
    model = AutoModelForImageTextToText.from_pretrained(vlms[name]).eval()
    labels = torch.tensor([ex.labels])
    objective = SFT()  # what training computes: the summed token loss, the images passed by forward_aux
    with torch.no_grad():
        ours = objective(model, batch)[0] / objective.count(batch)
        theirs = model(**{k: v for k, v in ref.items()}, labels=labels).loss
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)


@pytest.mark.parametrize("name", ("qwen2_vl", "gemma3", "mllama", "idefics3"))
def test_a_batch_of_rows_with_and_without_images_scores_each_row_as_alone(vlms, pictures, name):
    """Two images, one image in a later turn, none (a text row) in one micro-batch: each row's summed token loss is the
    one it has in a batch of its own (the processor's image inputs laid out per row, the per-token inputs from the ids)."""
    from finetune.data.batches import collate
    from finetune.data.images import pictures_of
    from finetune.data.images import seen
    from finetune.methods.losses import token_loss_sum
    from transformers import AutoModelForImageTextToText

    tok, train, _ = _tokenized(vlms[name], MIXED, pictures)
    assert [len(e.images) for e in train] == [2, 2, 0]
    model = AutoModelForImageTextToText.from_pretrained(vlms[name]).eval()

    def sums(examples):
        batch = collate(examples, tok.pad_token_id, pictures=pictures_of(tok))
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **seen(batch)).logits
        return [float(token_loss_sum(logits[r : r + 1], batch["labels"][r : r + 1])) for r in range(len(examples))]

    together = sums(train)
    alone = [sums([e])[0] for e in train]
    assert together == pytest.approx(alone, rel=1e-5)


@pytest.mark.parametrize("name", CLASSES)
def test_a_text_batch_runs_the_vision_tower_on_a_blank_image_without_changing_its_loss(vlms, pictures, name):
    """Under FSDP2 and ZeRO every rank's micro-batch runs the vision tower (`Pictures.everywhere`): a batch of text rows
    carries a blank image in its padding, and its loss and count are those of the batch without it."""
    from finetune.data.batches import collate
    from finetune.data.images import IN_BATCH, pictures_of
    from finetune.methods.sft import SFT
    from transformers import AutoModelForImageTextToText

    tok, train, _ = _tokenized(vlms[name], [_chat("what ?"), _chat("what is the answer to it ?")], pictures)
    model = AutoModelForImageTextToText.from_pretrained(vlms[name]).eval()
    plain = collate(train, tok.pad_token_id, pictures=pictures_of(tok))
    pictures_of(tok).everywhere = True
    blank = collate(train, tok.pad_token_id, pictures=pictures_of(tok))
    assert not any(k.startswith(IN_BATCH) for k in plain) and any(k.startswith(IN_BATCH) for k in blank)
    assert blank["input_ids"].shape[1] > plain["input_ids"].shape[1]
    with torch.no_grad():
        assert float(SFT()(model, blank)[0]) == pytest.approx(float(SFT()(model, plain)[0]), rel=1e-5)
    assert SFT().count(blank) == SFT().count(plain)


def test_the_image_changes_what_the_model_reads(vlms, pictures):
    """Two rows alike but for their image: equal text tokens, different training losses (the pixels reach the model
    through the objective's forward); without the image inputs the two would score alike."""
    from finetune.data.batches import collate
    from finetune.data.images import IN_BATCH, pictures_of
    from finetune.methods.sft import SFT
    from transformers import AutoModelForImageTextToText

    rows = [{"images": [f"img/{i}.png"], "messages": [{"role": "user", "content": "<image> what ?"},
                                                     {"role": "assistant", "content": "big ."}]} for i in (4, 5)]
    tok, train, _ = _tokenized(vlms["llava"], rows, pictures)
    assert train[0].input_ids == train[1].input_ids and train[0].images != train[1].images
    model = AutoModelForImageTextToText.from_pretrained(vlms["llava"]).eval()
    batches = [collate([e], tok.pad_token_id, pictures=pictures_of(tok)) for e in train]
    with torch.no_grad():
        losses = [float(SFT()(model, b)[0]) for b in batches]
        blind = [float(SFT()(model, {k: v for k, v in b.items() if not k.startswith(IN_BATCH)})[0]) for b in batches]
    assert abs(losses[0] - losses[1]) > 1e-4 and blind[0] == blind[1]


def _refused(vlms, pictures, rows, name="llava"):
    from finetune.data.examples import check

    data = DataConfig(train=write_jsonl(pictures / "bad.jsonl", rows), eval_size=0, max_length=256)
    with pytest.raises(ConfigError) as e:
        check(data, "sft")
        _tokenized(vlms[name], rows, pictures, file="bad.jsonl")
    return str(e.value)


def _chat(user, **extra):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "yes ."}], **extra}


def test_rows_that_cannot_be_read_are_refused_naming_file_and_line(vlms, pictures):
    where = f"{pictures / 'bad.jsonl'}:1"
    assert _refused(vlms, pictures, [_chat("<image> what ?", images=["img/nope.png"])]) == (
        f"{where}: image {pictures / 'img' / 'nope.png'} does not exist: fix the path (relative paths are read from the data "
        "file's directory)")
    assert _refused(vlms, pictures, [_chat("<image> <image> what ?", images=["img/1.png"])]) == (
        f"{where}: the row has 1 image(s) but its text has 2 <image> placeholder(s): put one <image> where each image goes "
        "(in a user message), or fix the 'images' list")
    assert _refused(vlms, pictures, [{"images": ["img/1.png"], "messages": [{"role": "user", "content": "what ?"},
                                                                          {"role": "assistant", "content": "<image> yes"}]}]) == (
        f"{where}: the assistant's message 1 holds an image (<image>): images go in the user's messages (the model reads "
        "them; it writes text)")
    both = {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/1.png"}]},
                         {"role": "assistant", "content": "yes"}], "images": ["img/2.png"]}
    assert _refused(vlms, pictures, [both]) == (
        f"{where}: the row gives images both as an 'images' list and as image parts in its messages: use one")
    assert _refused(vlms, pictures, [_chat("<image> what ?", images=["https://example.com/a.png"])]).startswith(
        f"{where}: image https://example.com/a.png is a URL: finetune reads images from files or the data's own bytes")
    (pictures / "img" / "text.png").write_text("not an image")
    assert _refused(vlms, pictures, [_chat("<image> what ?", images=["img/text.png"])]).startswith(
        f"{where}: image {pictures / 'img' / 'text.png'} cannot be read as an image (cannot identify image file")


def test_an_image_row_for_a_text_model_is_refused(pictures):
    from finetune.config import ASSETS
    from finetune.data.examples import load_split
    from finetune.data.templates import load_tokenizer

    data = DataConfig(train=write_jsonl(pictures / "text.jsonl", [_chat("<image> what ?", images=["img/1.png"])]),
                      eval_size=0, max_length=64)
    tok = load_tokenizer(ModelConfig(path=None, tokenizer=str(ASSETS / "tokenizer")), data)
    with pytest.raises(ConfigError, match=r"text.jsonl:1: this row has 1 image\(s\), but the model is a text model \(its "
                                          r"config.json has no vision_config\): train a vision-language model on it"):
        load_split(data, tok, 0)


def test_a_prompt_whose_images_do_not_fit_is_a_long_prompt_never_cut_inside_an_image(vlms, pictures):
    """Qwen2-VL, an image in the second user turn: its 6 tokens (a 28x36 image resized to 56x84: a 2x3 grid) are
    positions 12-17, after the first response (labelled from position 7): max_length 16 would cut inside the image, so the
    row is dropped as a long prompt would be; a text row of the same turns is cut at 16 as usual. At 18 the image fits."""
    turns = [{"role": "user", "content": "what ?"}, {"role": "assistant", "content": "yes"},
             {"role": "user", "content": "<image>"}, {"role": "assistant", "content": "big ."}]
    rows = [{"images": ["img/0.png"], "messages": turns}, {"messages": [*turns[:2], {**turns[2], "content": "it"}, turns[3]]}]
    _, train, stats = _tokenized(vlms["qwen2_vl"], rows, pictures, max_length=16)
    assert (stats["train"].dropped, stats["train"].shortest_dropped_prompt, stats["train"].truncated) == (1, 18, 1)
    assert [e.images for e in train] == [()]
    _, train, stats = _tokenized(vlms["qwen2_vl"], rows, pictures, max_length=18)
    assert stats["train"].dropped == 0 and [len(e.images) for e in train] == [1, 0]
    assert train[0].input_ids[12:18] == [train[0].input_ids[12]] * 6


@pytest.fixture(scope="module")
def image_dataset(pictures, tmp_path_factory):
    """A dataset directory whose image column holds the images themselves (datasets' Image feature, as hub datasets and
    Parquet files keep them: bytes, decoded when read)."""
    import datasets

    where = tmp_path_factory.mktemp("dataset") / "ds"
    datasets.Dataset.from_dict(
        {"images": [[str(pictures / "img" / f"{i}.png")] for i in range(8)],
         "messages": [[{"role": "user", "content": "<image> what ?"}, {"role": "assistant", "content": ["big .", "small ."][i % 2]}]
                      for i in range(8)]},
        features=datasets.Features({"images": datasets.Sequence(datasets.Image()),
                                    "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}]}),
    ).save_to_disk(str(where))
    return where


def test_images_kept_as_bytes_reach_the_token_cache_as_files(vlms, image_dataset, tmp_path):
    """A dataset whose image column holds the images: the token cache keeps each image once as a file under its root,
    the examples name them, and the second load reads the cache without tokenizing again."""
    from finetune.data import cache
    from finetune.data.templates import load_tokenizer

    data = DataConfig(train=str(image_dataset), eval_size=0, max_length=128, cache_dir=str(tmp_path / "cache"))
    tok = load_tokenizer(ModelConfig(path=str(vlms["gemma3"])), data)
    said: list[str] = []
    train, _, stats, *_ = cache.load(data, tok, 0, "sft", builder=True, progress=False, say=said.append)
    assert (stats["train"].images, stats["train"].image_tokens) == (8, 32)  # Gemma 3: 4 tokens per image
    files = sorted((tmp_path / "cache" / cache.IMAGES).iterdir())
    assert len(files) == 8 and sorted(e.images[0] for e in train) == [str(f) for f in files]
    again, *_ = cache.load(data, tok, 0, "sft", builder=True, progress=False, say=said.append)
    assert [e.input_ids for e in again] == [e.input_ids for e in train] and [e.images for e in again] == [e.images for e in train]
    assert len(said) == 2 and said[1].startswith("data: cached tokens"), said


def test_an_image_changed_in_place_gets_its_rows_tokenized_again(vlms, tmp_path):
    """Qwen-VL's tokens per image follow its size: an image file replaced by a bigger one under the same path gives the
    cache's rows the tokens the new picture takes (not the old entry's), and the next load reads that entry."""
    import shutil

    from finetune.data import cache
    from finetune.data.examples import load_split
    from finetune.data.templates import load_tokenizer

    model = shutil.copytree(vlms["qwen2_vl"], tmp_path / "model")  # images of up to 112 x 112 pixels, not 56 x 56
    settings = json.loads((model / "processor_config.json").read_text())
    settings["image_processor"]["size"]["longest_edge"] = 112 * 112
    (model / "processor_config.json").write_text(json.dumps(settings))
    (tmp_path / "img").mkdir()
    for i in range(2):
        vision_models.image(tmp_path / "img" / f"{i}.png", 56, i)
    rows = write_jsonl(tmp_path / "rows.jsonl", [_chat("<image> what ?", images=[f"img/{i}.png"]) for i in range(2)])
    data = DataConfig(train=rows, eval_size=0, max_length=256, cache_dir=str(tmp_path / "cache"))
    tok = load_tokenizer(ModelConfig(path=str(model)), data)
    said: list[str] = []
    before, *_ = cache.load(data, tok, 0, "sft", builder=True, progress=False, say=said.append)
    vision_models.image(tmp_path / "big.png", 112, 5)
    shutil.copyfile(tmp_path / "big.png", tmp_path / "img" / "1.png")
    after, _, stats, _, entry = cache.load(data, tok, 0, "sft", builder=True, progress=False, say=said.append)
    fresh, _, _ = load_split(DataConfig(train=rows, eval_size=0, max_length=256, cache=False), tok, 0)
    assert [len(e.input_ids) for e in after] == [len(e.input_ids) for e in fresh]
    assert len(after[1].input_ids) > len(before[1].input_ids) and after[0].input_ids == before[0].input_ids
    assert said[1] == (f"data: 1 image(s) changed since their rows' tokens were cached ({tmp_path / 'img' / '1.png'}): the rows' "
                       f"tokens again, cached at {entry}"), said
    again = cache.load(data, tok, 0, "sft", builder=True, progress=False, say=said.append)
    assert again[-1] == entry and said[-1].startswith(f"data: cached tokens {entry}"), said


def test_a_processor_that_needs_torchvision_is_refused_naming_the_package(vlms, pictures, monkeypatch):
    """Mistral 3's PixtralProcessor, which transformers hides without torchvision, loads (its PIL image processor); a
    processor that needs torchvision for images is refused naming the package."""
    import transformers

    from finetune.data import processors

    assert processors.load_processor(str(vlms["mistral3"])).image_processor.__class__.__name__ == "PixtralImageProcessorPil"
    monkeypatch.setattr(processors, "_processor_class", lambda name: getattr(transformers, name))
    assert _refused(vlms, pictures, [_chat("<image> what ?", images=["img/1.png"])], name="mistral3") == (
        f"model.path={vlms['mistral3']}: PixtralProcessor (model_type=mistral3) needs torchvision to process images, which "
        "is not installed here: pip install torchvision (the build matching your torch: PyPI's wheel is CUDA torch's)")


@pytest.mark.parametrize("name", ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "idefics3", "smolvlm", "internvl",
                                  "mistral3"))
def test_rows_of_several_samples_with_images_score_each_sample_as_alone(vlms, pictures, name):
    """Padding-free (the micro-batch's samples end to end in one row, with a blank image's sample after them, as under
    FSDP2 and ZeRO): each sample's summed token loss is the one it has in the padded batch, its attention one sample at a
    time (finetune.rank.varlen, the vision tower's own left as it was) and, for M-RoPE classes, its 3-D positions computed
    alone (finetune.rank.vision.rope_per_sample: without them the Qwen-VL rows score otherwise)."""
    from finetune.data.batches import collate
    from finetune.data.images import pictures_of, seen
    from finetune.methods.losses import token_loss_sum
    from finetune.rank import varlen, vision
    from transformers import AutoModelForImageTextToText

    tok, train, _ = _tokenized(vlms[name], [MIXED[0], MIXED[2], MIXED[1]], pictures)
    model = AutoModelForImageTextToText.from_pretrained(vlms[name]).eval()
    tower = model.config.vision_config._attn_implementation
    padded = collate(train, tok.pad_token_id, pictures=pictures_of(tok))
    with torch.no_grad():
        logits = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], **seen(padded)).logits
    alone = [float(token_loss_sum(logits[r : r + 1], padded["labels"][r : r + 1])) for r in range(len(train))]

    def flat_sums():
        pictures_of(tok).everywhere = True
        try:
            flat = collate(train, tok.pad_token_id, flat=True, pictures=pictures_of(tok))
        finally:
            pictures_of(tok).everywhere = False
        assert flat["input_ids"].shape[0] == 1 and flat["position_ids"].shape == flat["input_ids"].shape
        with torch.no_grad():
            logits = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"], **seen(flat)).logits
        cut = [0, *itertools.accumulate(len(e.input_ids) for e in train)]
        return [float(token_loss_sum(logits[:, a:b], flat["labels"][:, a:b])) for a, b in zip(cut, cut[1:])]

    varlen.Varlen(model)
    if name.startswith("qwen"):
        assert flat_sums() != pytest.approx(alone, rel=1e-6)  # 1-D positions over the images: not the model's reading
    assert vision.rope_per_sample(model) == name.startswith("qwen")
    assert flat_sums() == pytest.approx(alone, rel=1e-6)
    assert model.config.vision_config._attn_implementation == tower


@pytest.mark.parametrize("name,extra", [("qwen2_vl", ["peft=lora", "peft.dropout=0", "optim.lr=1e-2"]), ("llava", [])],
                         ids=["qwen2_vl-lora", "llava"])  # no dropout: its masks follow the batch's shape
def test_padding_free_and_packed_rows_with_images_train_through_the_cli(vlms, mixed_rows, tmp_path, name, extra):
    """A vision-language run is padding-free by default (it was padded): the eval loss of the padded run, exactly (with
    LoRA's wrapper around the model too); packed rows through the token cache carry each sample's images and train."""
    common = [*_two_ranks_common(vlms, mixed_rows)[:2], f"model.path={vlms[name]}", *_two_ranks_common(vlms, mixed_rows)[3:],
              "launcher.nproc_per_node=1", "parallelism=single", "train.micro_batch_size=4", *extra]
    padded = train_here([*common, "data.padding_free=false"], tmp_path / "padded")
    free = train_here(common, tmp_path / "free")
    nonpad = {run: [json.loads(line).get("nonpad_fraction") for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
                    if json.loads(line).get("kind") == "train"] for run in ("padded", "free")}
    assert nonpad["free"] == [1.0] * 3 and all(f < 1.0 for f in nonpad["padded"])  # one row per micro-batch, no padding
    assert free["after"]["eval_loss"] == pytest.approx(padded["after"]["eval_loss"], rel=1e-6)
    assert (tmp_path / "free" / "config.yaml").read_text().count("padding_free: null") == 1
    packed = train_here([*common, "data.packing=true", "data.max_length=128", "train.micro_batch_size=1",
                         "train.global_batch_size=1", "data.cache=true", f"data.cache_dir={tmp_path / 'cache'}"], tmp_path / "packed")
    assert packed["after"]["eval_loss"] < packed["before"]["eval_loss"] - 0.1


def test_rows_of_several_samples_are_refused_where_an_image_reaches_across_the_row(vlms, compose):
    """Gemma 3's image tokens attend to each other both ways and Mllama's text reaches its images by cross-attention, both
    masked over the whole row: packing is refused and padding-free stays off, each saying why."""
    from finetune.data.rows import padding_free

    gemma = ("its image tokens' attention is shaped over the whole row by token_type_ids (Gemma 3's and 4's images attend to "
             "each other both ways), which attention one sample at a time, causal, does not keep")
    mllama = ("its text reads the images through cross-attention, masked over the whole row (cross_attention_mask), which does "
              "not keep an image with its own sample")
    for name, why in (("gemma3", gemma), ("mllama", mllama)):
        base = ["+recipe=quickstart_sft", "model=pretrained", f"model.path={vlms[name]}"]
        with pytest.raises(ConfigError) as e:
            compose([*base, "data.packing=true"])
        assert str(e.value) == f"data.packing=true cannot run with model.path={vlms[name]} ({name}): {why}: set data.packing=false"
        with pytest.raises(ConfigError) as e:
            compose([*base, "data.padding_free=true"])
        assert str(e.value) == (f"data.padding_free=true cannot run here: model.path={vlms[name]} ({name}): {why}: set "
                                "data.padding_free=false (or null)")
        assert padding_free(compose([*base, "train.micro_batch_size=4"])) == (False, f"padded: model.path={vlms[name]} ({name}): {why}")


@pytest.fixture(scope="module")
def quickstart_vlm(tmp_path_factory):
    """The shipped image quickstart as a user runs it (+recipe=quickstart_vlm: 2 ranks, 600 steps), from a directory that
    is not the data's (its rows name their images relative to the data file)."""
    tmp = tmp_path_factory.mktemp("quickstart_vlm")
    out = run_cli("+recipe=quickstart_vlm", "train.progress_bar=false", f"hydra.run.dir={tmp / 'run'}", cwd=tmp)
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp / "run", out


def _exact_match(final, rows_file) -> float:
    """The framework's own exact match (greedy, as the training loop scores it) of `final` on a file's rows."""
    from transformers import AutoModelForImageTextToText

    from finetune.data.examples import load_split
    from finetune.data.templates import load_tokenizer
    from finetune.rank.heldout import exact_match

    tok = load_tokenizer(ModelConfig(path=str(final)))
    rows, _, _ = load_split(DataConfig(train=str(rows_file), eval_size=0, format="chat", max_length=64), tok, 0)
    model = AutoModelForImageTextToText.from_pretrained(final)
    return exact_match(model, tok, rows, batch_size=32, max_new_tokens=16, device=torch.device("cpu")) / len(rows)


def test_the_image_quickstart_learns_from_the_pictures_far_above_a_blank_picture(quickstart_vlm, tmp_path):
    """+recipe=quickstart_vlm: a Qwen2-VL built from random weights (model.from_scratch) answers a square's colour and
    place; the same model shown a blank picture in place of each image answers near chance (1 in 4). The data line counts
    the images; final/ is what AutoModelForImageTextToText and the processor load."""
    from finetune.config.fields import ASSETS

    run, out = quickstart_vlm
    summary = json.loads((run / "summary.json").read_text())
    assert summary["after"]["exact_match"] >= 0.85, summary
    assert "data train: 512 rows, 0 responses truncated at max_length=64, 0 dropped (prompt too long), 512 images (2048 image " \
           "tokens, 4 per image)" in out.stdout, out.stdout
    assert "AutoModelForImageTextToText.from_pretrained / AutoProcessor.from_pretrained" in out.stdout
    assert (run / "final" / "processor_config.json").is_file()
    data = ASSETS / "data" / "quickstart_vlm"
    assert _exact_match(run / "final", data / "eval.jsonl") == pytest.approx(summary["after"]["exact_match"])
    from PIL import Image

    Image.new("RGB", (56, 56), (235, 235, 235)).save(tmp_path / "blank.png")  # the pictures' background, no square
    blank = [json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines()]
    for row in blank:
        row["messages"][0]["content"][0]["image"] = str(tmp_path / "blank.png")
    control = _exact_match(run / "final", write_jsonl(tmp_path / "blank.jsonl", blank))
    assert control <= 0.35 and summary["after"]["exact_match"] - control >= 0.5, (control, summary)


def test_images_train_through_the_cli_then_generate_and_export_read_them(quickstart_vlm):
    """After the image quickstart: generate shows the model an image (its prompt holds the image's tokens) and answers
    from it; export writes a model AutoModelForImageTextToText loads with the trained weights and the processor's files,
    and refuses GGUF for it."""
    import argparse

    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from finetune.config.fields import ASSETS
    from finetune.rank.export import check
    from finetune.rank.finished import Refusal, locate
    from finetune.rank.generate import Chat

    run, _ = quickstart_vlm
    row = json.loads((ASSETS / "data" / "quickstart_vlm" / "eval.jsonl").read_text().splitlines()[0])
    picture, question = (str(ASSETS / "data" / "quickstart_vlm" / row["messages"][0]["content"][0]["image"]),
                         row["messages"][0]["content"][1]["text"])
    chat = Chat(locate(str(run)), argparse.Namespace(system=None, max_new_tokens=12, temperature=0.0, top_p=1.0, seed=0, dtype="fp32"))
    prompt, shown = chat.prompt([{"role": "user", "content": f"<image>{question}"}], images=[picture])
    config = json.loads((run / "final" / "config.json").read_text())
    assert shown == (picture,) and prompt.count(config["image_token_id"]) == 4
    assert chat.reply([{"role": "user", "content": f"<image>{question}"}], images=[picture]) == row["messages"][1]["content"]
    with pytest.raises(Refusal, match=rf"^--gguf q8_0: {run} is a vision-language model \(qwen2_vl\): llama.cpp reads one as a "
                                      "text model's GGUF plus its vision tower and projector in a separate mmproj file"):
        check(locate(str(run), need_run=True), argparse.Namespace(gguf="q8_0", push_to_hub=None))
    from finetune.rank.export import main as export  # the export command's own code, in this process

    assert export([str(run)]) == 0
    model = AutoModelForImageTextToText.from_pretrained(run / "export")
    trained = load_file(run / "final" / "model.safetensors")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in trained.items() if k in model.state_dict())
    assert (run / "export" / "processor_config.json").is_file()
    card = (run / "export" / "README.md").read_text()
    assert "pipeline_tag: image-text-to-text" in card and "base_model" not in card.split("---")[1]
    assert f"Fine-tuned with finetune from random weights (seed 0) in the architecture of `{ASSETS}/models/tiny_vlm`'s config.json" in card


def test_from_scratch_qlora_writes_its_base_whole_with_the_processor(tmp_path):
    """model.from_scratch: the shipped tiny_vlm directory holds a config, a tokenizer and a processor, no weights. An
    adapter's base (RUN_DIR/base) is the built model written whole, the processor's files with it, and QLoRA loads its
    4-bit language model from there; the adapter names it as its base."""
    from finetune.config.fields import ASSETS

    assert not any((ASSETS / "models" / "tiny_vlm").glob("*.safetensors"))
    summary = train_here(["+recipe=quickstart_vlm", "parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=2",
                          "optim.warmup_steps=0", "train.eval_every=0", "train.exact_match_samples=0", "peft=qlora"], tmp_path / "run")
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"]
    base = tmp_path / "run" / "base"
    assert (base / "model.safetensors").is_file() and (base / "processor_config.json").is_file()
    adapter = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(base)


def test_the_plan_reads_image_rows_and_is_within_15_percent_of_the_measured_peak(tmp_path, monkeypatch):
    """The launcher's plan reads the rows with their images (each image's tokens as the processor counts them: the
    longest batch, not data.max_length; the most image tokens a micro-batch holds), and on the image quickstart's model
    the planned peak is within 15% of the one MemTracker measures in the first steps, with the vision tower frozen
    (model.freeze's default: weights only) and training (its blocks' activations per patch: what training it adds is
    what the planner adds, within 25%)."""
    from finetune.data.lengths import Longest, longest_batch
    from finetune.launcher.compose import preflight
    from finetune.planner.peak import plan
    from finetune.planner.records import compare

    common = ["+recipe=quickstart_vlm", "parallelism=single", "launcher.nproc_per_node=1", f"data.cache_dir={tmp_path / 'cache'}",
              "data.eval=null", "data.eval_size=0", "train.exact_match_samples=0", "train.eval_every=0"]
    longest = longest_batch(preflight(common))
    assert isinstance(longest, Longest) and longest.width == 42, longest  # 4 image tokens + <|vision_start|>/<|vision_end|> + text
    assert (longest.image_tokens, longest.pixels_per_token) == (16 * 4, 4 * 3 * 2 * 14 * 14)  # 16 rows; 4 patches per token
    runs = {}
    for name, freeze in (("frozen", []), ("trained", ["model.freeze=[]"])):
        train_here([*common, *freeze, "train.max_steps=2", "optim.warmup_steps=0", "train.memory_report=categories"], tmp_path / name)
        runs[name] = rows = {part: (planned, measured) for part, planned, measured in compare(tmp_path / name)}
        for part in ("weights", "gradients", "optimizer"):  # the frozen tower: weights only
            assert rows[part][0] == pytest.approx(rows[part][1], rel=0.01), (name, part)
        assert rows["peak"][0] == pytest.approx(rows["peak"][1], rel=0.15), (name, rows)
    from finetune.data import lengths

    monkeypatch.setattr(lengths, "tokenize", None)  # read again from the token cache the runs wrote (its columns), not the rows
    assert longest_batch(preflight(common)) == longest
    # the training tower's activations (its blocks', per image patch): what training it adds, planned and measured
    (planned, measured), (was_planned, was_measured) = runs["trained"]["activations"], runs["frozen"]["activations"]
    assert planned - was_planned == pytest.approx(measured - was_measured, rel=0.25), runs
    assert "the vision tower trains: its blocks' activations are counted per image patch" in " ".join(
        plan(preflight([*common, "model.freeze=[]"]), longest).notes)


@pytest.fixture(scope="module")
def mixed_rows(pictures):
    """Rows with one image, two images and none, in one file: a micro-batch of two ranks may hold images on one rank and
    none on the other."""
    rows = []
    for i in range(12):
        images = [f"img/{i}.png", f"img/{(i + 1) % 12}.png"][: i % 3]
        rows.append({"images": images, "messages": [{"role": "user", "content": "<image>" * len(images) + " what is it ?"},
                                                    {"role": "assistant", "content": ["small", "big"][i % 2] + " ."}]})
    return write_jsonl(pictures / "mixed.jsonl", rows)


def _two_ranks_common(vlms, mixed_rows) -> list[str]:
    return [*SHORT[:2], f"model.path={vlms['qwen2_vl']}", f"data.train={mixed_rows}", *SHORT[2:5], "optim.warmup_steps=0",
            "train.max_steps=3", "train.global_batch_size=4", "train.eval_every=0", "train.exact_match_samples=0"]


@pytest.fixture(scope="module")
def one_process(vlms, mixed_rows, tmp_path_factory):
    """The run the two-rank layouts follow: one process, the whole global batch in one micro-batch."""
    return train_here([*_two_ranks_common(vlms, mixed_rows), "launcher.nproc_per_node=1", "parallelism=single",
                       "train.micro_batch_size=4"], tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("layout", [["parallelism=ddp"], ["parallelism=fsdp"], ["zero=stage2", "parallelism=ddp"],
                                    ["zero=stage3", "parallelism=ddp"]], ids=["ddp", "fsdp", "zero2", "zero3"])
def test_images_train_on_two_ranks_as_on_one(vlms, mixed_rows, one_process, tmp_path, layout):
    """DDP, FSDP2, ZeRO-2 and ZeRO-3 on two ranks, rows with and without images: the eval loss one process reaches
    (a rank whose micro-batch has no image still runs the vision tower, on none: the sharded layouts gather its
    parameters on every rank)."""
    from ranks import launch_here

    one = one_process
    out = launch_here(*_two_ranks_common(vlms, mixed_rows), "launcher.nproc_per_node=2", "train.micro_batch_size=2", *layout, f"hydra.run.dir={tmp_path / 'two'}",
                      cwd=tmp_path, timeout=300)
    assert out.returncode == 0, (out.stdout[-1500:], out.stderr[-1500:])
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["after"]["eval_loss"] == pytest.approx(one["after"]["eval_loss"], abs=2e-3)
    assert two["after"]["eval_loss"] < two["before"]["eval_loss"] - 0.1


def test_preference_pairs_show_their_prompts_images_to_both_rows_and_dpo_trains_on_them(vlms, pictures, tmp_path):
    """DPO pairs with images, in both preference forms (a prompt with an images list; whole conversations with image
    parts): both rows show the prompt's images; a precomputed reference scores them with the images (two pairs alike
    but for the image get different reference log-probs); DPO trains (its eval loss falls from log 2)."""
    from finetune.data.batches import collate
    from finetune.data.images import pictures_of
    from finetune.data.templates import load_tokenizer
    from finetune.data.examples import load_split
    from finetune.rank.reference import LOGPS
    from transformers import AutoModelForImageTextToText

    rows = []
    for i in range(8):
        answers = ["big .", "small ."] if i % 2 else ["small .", "big ."]
        if i % 2:
            rows.append({"prompt": "<image> what is it ?", "images": [f"img/{i}.png"], "chosen": answers[0], "rejected": answers[1]})
        else:
            prompt = [{"role": "user", "content": [{"type": "image", "image": f"img/{i}.png"}, {"type": "text", "text": "what is it ?"}]}]
            rows.append({"chosen": [*prompt, {"role": "assistant", "content": answers[0]}],
                         "rejected": [*prompt, {"role": "assistant", "content": answers[1]}]})
    data_file = write_jsonl(pictures / "pairs.jsonl", rows)
    data = DataConfig(train=data_file, eval_size=0, max_length=128)
    tok = load_tokenizer(ModelConfig(path=str(vlms["qwen2_vl"])), data)
    pairs, _, _ = load_split(data, tok, 0, "dpo")
    assert all(p.chosen.images == p.rejected.images and len(p.chosen.images) == 1 for p in pairs)
    model = AutoModelForImageTextToText.from_pretrained(vlms["qwen2_vl"]).eval()
    twin = [pairs[1], type(pairs[1])(*(type(r)(**{**vars(r), "images": pairs[3].chosen.images}) for r in pairs[1].rows))]
    with torch.no_grad():
        logps = LOGPS(model, collate(twin, tok.pad_token_id, pictures=pictures_of(tok)))
    assert abs(float(logps[0] - logps[1])) > 1e-4
    summary = train_here([*SHORT[:2], f"model.path={vlms['qwen2_vl']}", "method=dpo", f"data.train={data_file}", "data.format=auto",
                          f"data.eval={data_file}", "data.eval_size=0", "optim.warmup_steps=0", "train.max_steps=8",
                          "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_every=0", "train.exact_match_samples=0",
                          "optim.lr=1e-3"], tmp_path / "dpo")
    assert summary["before"]["eval_loss"] == pytest.approx(0.6931, abs=1e-3)
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"] - 0.05


def test_kto_rows_and_their_mismatched_rows_show_their_prompts_images(vlms, pictures, tmp_path):
    """KTO: each labelled row's mismatched row (its prompt, another row's response) shows its prompt's images; the two
    row groups it forwards apart each carry their own image inputs (the loss of each equals that group collated alone);
    KTO trains on them."""
    from finetune.data.batches import collate
    from finetune.data.examples import load_split
    from finetune.data.images import apart, pictures_of, seen
    from finetune.data.templates import load_tokenizer
    from finetune import methods
    from finetune.methods.sft import SFT
    from transformers import AutoModelForImageTextToText

    rows = [{**_chat("<image> what is it ?", images=[f"img/{i}.png"]), "label": bool(i % 2)} for i in range(8)]
    data_file = write_jsonl(pictures / "labelled.jsonl", rows)
    data = DataConfig(train=data_file, eval_size=0, max_length=128)
    tok = load_tokenizer(ModelConfig(path=str(vlms["qwen2_vl"])), data)
    train, _, _ = load_split(data, tok, 0, "kto")
    train = methods.get("kto").settle(train, data, "data.train")
    assert all(e.mismatched.images == e.row.images and e.mismatched.image_tokens == e.row.image_tokens for e in train)
    batch = collate(train[:3], tok.pad_token_id, pictures=pictures_of(tok))
    model = AutoModelForImageTextToText.from_pretrained(vlms["qwen2_vl"]).eval()
    for group in (0, 1):
        alone = collate([e.rows[group] for e in train[:3]], tok.pad_token_id, pictures=pictures_of(tok))
        part = apart(batch, group, 3)
        assert set(seen(part)) == set(seen(alone)) and all(torch.equal(seen(part)[k], seen(alone)[k]) for k in seen(alone))
        with torch.no_grad():
            width = alone["input_ids"].shape[1]
            trimmed = {k: v[:, :width] if k in ("input_ids", "labels", "attention_mask", "image.mm_token_type_ids") else v
                       for k, v in part.items()}
            assert float(SFT()(model, trimmed)[0]) == pytest.approx(float(SFT()(model, alone)[0]), rel=1e-5)
    summary = train_here([*SHORT[:2], f"model.path={vlms['qwen2_vl']}", "method=kto", f"data.train={data_file}", "data.format=auto",
                          f"data.eval={data_file}", "data.eval_size=0", "optim.warmup_steps=0", "train.max_steps=4",
                          "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_every=0",
                          "train.exact_match_samples=0", "optim.lr=1e-3"], tmp_path / "kto")
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"]


def test_grpo_samples_from_the_image_and_trains_each_completion_with_it(vlms, pictures, tmp_path, monkeypatch):
    """GRPO with image prompts: the sampler is shown each prompt's image (its generate call gets the image inputs, a
    prompt sampled as G rows of its own), each completion's training row shows its prompt's image, and the run trains;
    vLLM (given tokens, not images) is refused for a vision-language model."""
    from finetune.methods import online

    calls: list[dict] = []
    real = online.sample

    def watched(engine, prompts, cfg, tokenizer, seed, vllm=None, images=None, private=False):
        out = real(engine, prompts, cfg, tokenizer, seed, vllm, images, private)
        calls.append({"prompts": len(prompts), "images": images, "completions": len(out)})
        return out

    monkeypatch.setattr(online, "sample", watched)
    trained: list[dict] = []
    batch_of = online.Online.batch_of

    def kept(self, groups, tokenizer):
        batch = batch_of(self, groups, tokenizer)
        trained.append(batch)
        return batch

    monkeypatch.setattr(online.Online, "batch_of", kept)
    common = [*SHORT[:2], f"model.path={vlms['qwen2_vl']}", f"data.train={pictures / 'train.jsonl'}", *SHORT[2:], "method=grpo",
              "method.generations=2", "method.completion_tokens=4", "method.rewards=[similarity]", "train.max_steps=2",
              "train.exact_match_samples=0"]
    summary = train_here(common, tmp_path / "grpo")
    assert summary["after"]["eval_loss"] != summary["before"]["eval_loss"]
    assert calls and all(c["images"] and c["completions"] == 2 * c["prompts"] for c in calls)
    assert all(len(b["image_refs"]) == b["input_ids"].shape[0] and "image.pixel_values" in b for b in trained)
    assert [refs[0] for refs in trained[0]["image_refs"]][::2] == [refs[0] for refs in trained[0]["image_refs"]][1::2]
    with pytest.raises(ConfigError, match=r"method.vllm=true with model.path=.*, a vision-language model: the vLLM sampler is "
                                          r"given the prompts' tokens, not their images"):
        from finetune.launcher.compose import preflight

        preflight([*common, "method.vllm=true"])


def test_activation_checkpointing_covers_both_towers_and_trains_as_without(vlms, pictures, tmp_path):
    """model.freeze=[] (the vision tower trains too): checkpointing=full recomputes the vision tower's blocks as well as
    the language model's, and the run reaches the eval loss of the run without it; precision=bf16 trains on images."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from finetune.config import CheckpointingConfig, PeftConfig
    from finetune.families.vision import parts
    from finetune.rank import model as rank_model
    from transformers import AutoModelForImageTextToText

    net = rank_model.apply_strategies(AutoModelForImageTextToText.from_pretrained(vlms["qwen2_vl"]),
                                      checkpointing=CheckpointingConfig(name="full"), peft=PeftConfig())
    towers = parts(net)
    for tower in (towers.vision, towers.language):
        blocks = [m for m in tower.modules() if isinstance(m, GradientCheckpointingLayer)]
        assert blocks and all(b.gradient_checkpointing for b in blocks)
    common = [*SHORT[:2], f"model.path={vlms['qwen2_vl']}", f"data.train={pictures / 'train.jsonl'}", *SHORT[2:],
              "train.max_steps=2", "train.exact_match_samples=0", "model.freeze=[]"]
    plain = train_here(common, tmp_path / "plain")
    full = train_here([*common, "checkpointing=full"], tmp_path / "full")
    assert full["after"]["eval_loss"] == pytest.approx(plain["after"]["eval_loss"], abs=1e-5)
    assert full["after"]["eval_loss"] < full["before"]["eval_loss"]
    bf16 = train_here([*common, "precision=bf16"], tmp_path / "bf16")
    assert bf16["after"]["eval_loss"] == pytest.approx(plain["after"]["eval_loss"], abs=0.05)


@pytest.mark.parametrize("name", [c for c in CLASSES if c != "qwen2_vl"])  # qwen2_vl: the image quickstart
def test_every_class_trains_on_images_and_its_exact_match_reads_them(vlms, pictures, tmp_path, name):
    """Each class, composed as the command line composes it and trained by the rank's own code: the eval loss on rows with
    images falls in 3 steps, and exact match generates from the prompts with their images."""
    summary = train_here([*SHORT[:2], f"model.path={vlms[name]}", f"data.train={pictures / 'train.jsonl'}", *SHORT[2:],
                          "train.max_steps=3", "train.exact_match_samples=4", "train.max_new_tokens=2", "optim.lr=1e-2"],
                         tmp_path / name)
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"] - 0.3, summary
    assert "exact_match" in summary["after"]


@pytest.mark.parametrize("peft", ["lora", "qlora"])
def test_adapters_train_the_language_model_on_images(vlms, pictures, tmp_path, peft):
    """LoRA and QLoRA (the language model in 4 bits, the tower and projector as they are) on rows with images: PEFT's
    wrapper passes the image inputs on (the loss differs without them), and the eval loss falls."""
    from finetune.data.batches import collate
    from finetune.data.images import IN_BATCH, pictures_of
    from finetune.methods.sft import SFT
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    tok, train, _ = _tokenized(vlms["qwen2_vl"], [_chat("<image> what ?", images=["img/2.png"])], pictures)
    wrapped = get_peft_model(AutoModelForImageTextToText.from_pretrained(vlms["qwen2_vl"]),
                             LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj"]))
    batch = collate(train, tok.pad_token_id, pictures=pictures_of(tok))
    with torch.no_grad():
        seeing, blind = (float(SFT()(wrapped, b)[0]) for b in (batch, {k: v for k, v in batch.items() if not k.startswith(IN_BATCH)}))
    assert abs(seeing - blind) > 1e-3
    summary = train_here([*SHORT[:2], f"model.path={vlms['qwen2_vl']}", f"data.train={pictures / 'train.jsonl'}", *SHORT[2:],
                          "train.max_steps=3", "train.exact_match_samples=0", "optim.lr=1e-2", f"peft={peft}"], tmp_path / peft)
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"] - 0.3


def test_a_method_that_does_not_read_images_refuses_an_image_row_by_file_and_line(pictures, monkeypatch):
    """Every method reads images today; a method record whose `images` says why it cannot (a new one) refuses an image row
    before any rank starts, naming the row."""
    from finetune import methods
    from finetune.data.examples import check

    monkeypatch.setattr(methods.get("sft"), "images", "its rows are text: use another method")
    data = DataConfig(train=write_jsonl(pictures / "method.jsonl", [_chat("<image> what ?", images=["img/1.png"])]), eval_size=0)
    with pytest.raises(ConfigError, match=r"method.jsonl:1: this row has images, and method=sft does not read rows with images "
                                          r"yet: its rows are text: use another method$"):
        check(data, "sft")


def test_a_streamed_dataset_carries_its_images_inline(vlms, image_dataset, tmp_path):
    """data.streaming=true over a dataset whose image column holds the images: each streamed row carries its images as
    data URIs (rows travel as JSON text), the same pixels, and the run trains on them."""
    from finetune.data.images import INLINE, open_image
    from finetune.data.sources import parse_row, records

    first = parse_row(next(records(str(image_dataset), "train", "data.train"))["row"], "row 0")
    assert first["images"][0].startswith(INLINE)
    assert open_image(first["images"][0], "row 0").size == (36, 28)
    summary = train_here([*SHORT[:2], f"model.path={vlms['qwen2_vl']}", f"data.train={image_dataset}", "data.streaming=true",
                          *SHORT[2:], "train.max_steps=2", "train.exact_match_samples=0"], tmp_path / "stream")
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"]


def test_a_processor_whose_token_types_mean_something_else_is_refused(vlms, monkeypatch):
    """Per-token types are computed from the ids as 1 on the image's tokens (Gemma 3's token_type_ids, Qwen's
    mm_token_type_ids); a processor whose types mean something else (PaliGemma's prefix/suffix) is refused when it is
    loaded. Here: Gemma 3's, checked against another token id than its image token."""
    from finetune.data.images import Pictures

    wrong = Pictures(str(vlms["gemma3"]), None, False, image_token_id=3, model_type="gemma3")
    with pytest.raises(ConfigError, match=rf"^model.path={vlms['gemma3']}: its processor \(Gemma3Processor\) returns "
                                          r"token_type_ids that are not 1 exactly on its image tokens \(id 3\), which is all "
                                          r"finetune computes them as: model_type=gemma3 is not supported yet$"):
        wrong.processor


def test_a_text_row_that_spells_the_image_token_is_refused(vlms, pictures):
    """LLaVA's image token is the text `<image>`: a row without images whose text holds it would reach the model as an
    image token with no image (transformers stops on the count); refused naming the row."""
    with pytest.raises(ConfigError, match=r"rows.jsonl:1: the row's text holds the model's image token \(<image>, id \d+\) but "
                                          r"the row has no images: give the image"):
        _tokenized(vlms["llava"], [_chat("what is <image> ?")], pictures)


def test_generate_image_without_a_prompt_is_refused(capsys):
    from finetune.rank.generate import main

    with pytest.raises(SystemExit) as e:
        main(["some/run", "--image", "a.png"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --image goes with --prompt (a .jsonl --file row holds its own images)"


@pytest.fixture(scope="module")
def some_images(pictures):
    """Labelled rows, a third of them with an image: micro-batches (and KTO's row groups) of text rows next to ones with
    images, on one rank and not the other."""
    rows = [{"messages": [{"role": "user", "content": ("<image>" if i % 3 == 0 else "") + " what is it ?"},
                          {"role": "assistant", "content": ["small", "big"][i % 2] + " ."}],
             "images": [f"img/{i}.png"] if i % 3 == 0 else []} for i in range(12)]
    pairs = [{"images": r["images"], "prompt": r["messages"][0]["content"], "chosen": r["messages"][1]["content"],
              "rejected": ["big", "small"][i % 2] + " ."} for i, r in enumerate(rows)]
    return {"grpo": write_jsonl(pictures / "some_images.jsonl", rows),
            "kto": write_jsonl(pictures / "some_images_labelled.jsonl", [{**r, "label": bool(i % 2)} for i, r in enumerate(rows)]),
            "dpo": write_jsonl(pictures / "some_images_pairs.jsonl", pairs)}


_DDP: dict[str, float] = {}
"""Each method's eval loss under DDP on two ranks (no blank images), which the sharded layouts reach."""


@pytest.mark.parametrize("method,layout", [("dpo", "zero3"), ("dpo", "fsdp"), ("kto", "zero3"), ("kto", "fsdp"), ("grpo", "zero3"),
                                           ("grpo", "fsdp"), ("grpo", "ddp")])
def test_preference_and_online_methods_with_images_under_sharded_layouts(vlms, some_images, tmp_path, method, layout):
    """DPO (pairs), KTO (its rows and mismatched rows forwarded apart) and GRPO (sampling in lockstep, then training its
    completions) under FSDP2 and ZeRO-3 on two ranks, with rows with and without images: a forward with no image on one
    rank runs the vision tower on a blank one, as the other rank's does (a row group's blank in padding; a generation's
    blank in a row of its own, its output dropped), so every collective matches. DPO and KTO reach the eval loss DDP (no
    blank) reaches; GRPO trains and scores exact match by generation (DDP too), with and without images."""
    from ranks import launch_here

    extra = {"dpo": ["method=dpo", "data.format=auto"], "kto": ["method=kto"], "grpo": ["method=grpo", "method.generations=2", "method.completion_tokens=4",
                                             "method.rewards=[similarity]", "train.exact_match_samples=6"]}[method]
    common = [*SHORT[:2], f"model.path={vlms['qwen2_vl']}", f"data.train={some_images[method]}", *SHORT[2:5], *extra, "optim.warmup_steps=0",
              "train.max_steps=2", "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_every=0",
              "launcher.nproc_per_node=2", "optim.lr=1e-3", "data.eval_size=6"]
    sharded = {"zero3": ["zero=stage3", "parallelism=ddp"], "fsdp": ["parallelism=fsdp"], "ddp": ["parallelism=ddp"]}[layout]
    out = launch_here(*common, *sharded, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, (out.stdout[-1500:], out.stderr[-1500:])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    if method == "grpo":
        assert "exact_match" in summary["after"] and summary["after"]["eval_loss"] != summary["before"]["eval_loss"]
        return
    if method not in _DDP:
        ddp = launch_here(*common, "parallelism=ddp", f"hydra.run.dir={tmp_path / 'ddp'}", cwd=tmp_path, timeout=300)
        assert ddp.returncode == 0, ddp.stderr[-1500:]
        _DDP[method] = json.loads((tmp_path / "ddp" / "summary.json").read_text())["after"]["eval_loss"]
    assert summary["after"]["eval_loss"] == pytest.approx(_DDP[method], abs=2e-3)
