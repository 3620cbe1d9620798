"""Images in rows, for a vision-language model (finetune.families.vision): how a row holds them, and its processor's part
in tokenizing and batching them. No torch at import: the launcher checks every row with it.

A row holds images in either of the forms people's datasets have:
- content parts, as transformers' processors and chat templates take them: a message's `content` a list of
  `{"type": "text", "text": ...}` and `{"type": "image", "image": PATH_OR_BYTES}` (also `"path"`, and `{"type":
  "image_url", "image_url": {"url": PATH}}`, OpenAI's shape);
- a top-level `images` list and `<image>` in the text where each goes, in order (the ShareGPT form LLaMA-Factory and
  ms-swift read), in any conversational form (chat, sharegpt, alpaca, completion).
An image is a path (relative to the data file: `anchor`), its encoded bytes, `{"bytes": ..., "path": ...}` (a
`datasets` Image column undecoded), or a PIL image (decoded). Internally every message's text keeps `<image>`
(`PLACEHOLDER`) where an image goes and the row's images in order; the chat template renders each as content parts
(`as_parts`).

The processor (`Pictures`) is the model's own (AutoProcessor's class, from the model directory), made to work without
torchvision where transformers allows it (finetune.data.processors). It says how many tokens each image becomes
(`Pictures.expand`, at tokenization: the token cache then keeps exact lengths and the image references), and turns a
micro-batch's images into the model's inputs off the step (`Pictures.batch`, in collate: the loop's read-ahead thread).
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

from finetune.config import ConfigError
from finetune.data.processors import load_processor

PLACEHOLDER = "<image>"
"""Where an image goes in a message's text (the ShareGPT form's placeholder, and the form every row is read into)."""
PART_KEYS = ("image", "path", "url", "image_url")
"""Where an image content part holds its image."""
IN_BATCH = "image."
"""The prefix of a micro-batch's image inputs (collate adds them; `seen` gives them to the model's forward)."""
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
"""A processor's settings in a model directory (its chat template travels with the tokenizer)."""
TURN_KEYS = ("messages", "prompt", "chosen", "rejected", "completion")
"""Where a row's messages are, in the forms that hold them (a conversation, a pair's prompt and responses, KTO's
completion)."""
TOKEN_SIDE = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "cross_attention_mask")
"""What a processor returns per token rather than per image: computed from the batch's own ids (`token_extras`)."""


# ---------------------------------------------------------------------------------------------
# Rows: where their images are


def has_images(row: dict[str, Any]) -> bool:
    """Whether a row holds images (a top-level `images` list, or image content parts)."""
    if row.get("images"):
        return True
    return any(_is_image_part(p) for m in _turns(row) for p in (m.get("content") if isinstance(m.get("content"), list) else []))


def _turns(row: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for key in TURN_KEYS:
        value = row.get(key)
        if isinstance(value, list):
            out += [m for m in value if isinstance(m, dict)]
        elif isinstance(value, dict):
            out.append(value)
    return out


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def part_text(content: Any, where: str, what: str, images: list[Any]) -> Any:
    """A message's content as text with PLACEHOLDER where each image part was (appended to `images` in order); text
    content as it is. Refused naming the part: a part of another type, an image part without its image."""
    if not isinstance(content, list):
        return content
    text = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in ("image", "image_url"):
            value = next((part[k] for k in PART_KEYS if part.get(k) is not None), None)
            if isinstance(value, dict) and isinstance(value.get("url"), str):  # OpenAI's {"image_url": {"url": ...}}
                value = value["url"]
            if value is None:
                raise ConfigError(f"{where}: {what}.content[{i}] is an image part with no image (give it as \"image\": a path, "
                                  "or the image's bytes)")
            images.append(value)
            text.append(PLACEHOLDER)
        else:
            raise ConfigError(f"{where}: {what}.content[{i}] must be {{type: text, text: ...}} or {{type: image, image: PATH}}, "
                              f"got {part!r}")
    return "".join(text)


def row_images(row: dict[str, Any]) -> list[Any]:
    """The row's top-level `images` list (the ShareGPT form), [] when it has none."""
    value = row.get("images")
    if value is None:
        return []
    if not isinstance(value, list):
        value = [value]
    return list(value)


def check_count(texts: list[str], images: list[Any], where: str) -> None:
    """Every image has its place in the text and every place its image (`<image>` placeholders or image parts)."""
    places = sum(t.count(PLACEHOLDER) for t in texts)
    if places != len(images):
        raise ConfigError(f"{where}: the row has {len(images)} image(s) but its text has {places} {PLACEHOLDER} placeholder(s): "
                          f"put one {PLACEHOLDER} where each image goes (in a user message), or fix the 'images' list")


def anchor(row: dict[str, Any], base: Path) -> dict[str, Any]:
    """The row with its relative image paths made absolute against `base` (the data file's directory)."""
    def fix(value: Any) -> Any:
        if isinstance(value, str) and not _is_url(value) and not value.startswith(INLINE) and \
                not Path(value).expanduser().is_absolute():
            return str(base / value)
        if isinstance(value, dict) and isinstance(value.get("path"), str) and value.get("bytes") is None:
            return {**value, "path": fix(value["path"])}
        return value

    return kept_row(row, fix)


def kept_row(row: dict[str, Any], fix: Any) -> dict[str, Any]:
    """The row with `fix` applied to each image it holds (its `images` list, its messages' image parts)."""
    if isinstance(row.get("images"), list):
        row = {**row, "images": [fix(v) for v in row["images"]]}
    elif isinstance(row.get("images"), str):
        row = {**row, "images": [fix(row["images"])]}
    for key in TURN_KEYS:
        turns = row.get(key)
        if isinstance(turns, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in turns):
            row = {**row, key: [{**m, "content": [
                {**p, **{k: fix(p[k]) for k in ("image", "path") if p.get(k) is not None}} if _is_image_part(p) else p
                for p in m["content"]]}
                if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in turns]}
    return row


def _is_url(value: str) -> bool:
    return value.startswith(("http://", "https://"))


INLINE = "data:image;base64,"
"""An image held in its row's text (a data URI): how a streamed row carries an image it held as bytes."""


def inline(image: Any) -> Any:
    """An image the row holds as bytes or decoded, as a data URI (a row that travels as JSON text: a stream's); a path as
    it is."""
    import base64

    if isinstance(image, str) or (isinstance(image, dict) and image.get("bytes") is None):
        return image
    return INLINE + base64.b64encode(_encoded(image)).decode()


def _encoded(image: Any) -> bytes:
    """An image's encoded bytes (a decoded one written as PNG)."""
    if isinstance(image, dict):
        image = image["bytes"]
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def as_parts(text: str) -> Any:
    """A message's text as the content parts chat templates render images from ({"type": "image"} where PLACEHOLDER is);
    text without one as it is."""
    if PLACEHOLDER not in text:
        return text
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(text.split(PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


# ---------------------------------------------------------------------------------------------
# Images: opened, checked, kept


def describe(image: Any) -> str:
    """An image as a refusal names it: its path, or what it is."""
    if isinstance(image, str):
        return "an image's bytes (inline)" if image.startswith(INLINE) else image
    if isinstance(image, dict):
        return str(image.get("path") or "an image's bytes")
    return "an image's bytes" if isinstance(image, (bytes, bytearray)) else f"a {type(image).__name__}"


def open_image(image: Any, where: str) -> Any:
    """The image as an RGB PIL image; refused in one line naming the row and the image: a missing or unreadable file,
    a URL (download the images first: runs read local files), a value that is no image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, str) and image.startswith(INLINE):
        import base64

        image = base64.b64decode(image[len(INLINE):])
    if isinstance(image, str) and _is_url(image):
        raise ConfigError(f"{where}: image {image[:80]} is a URL: finetune reads images from files or the data's own bytes; "
                          "download them and give their paths (relative to the data file)")
    if not isinstance(image, (str, bytes, bytearray)):
        raise ConfigError(f"{where}: an image must be a path or the image's bytes, got {type(image).__name__}")
    try:
        opened = Image.open(io.BytesIO(image) if isinstance(image, (bytes, bytearray)) else Path(image).expanduser())
        opened.load()
        return opened.convert("RGB")
    except FileNotFoundError:
        raise ConfigError(f"{where}: image {describe(image)} does not exist: fix the path (relative paths are read from the "
                          "data file's directory)") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ConfigError(f"{where}: image {describe(image)} cannot be read as an image ({str(e).splitlines()[0]}): "
                          "replace the file, or remove it from the row") from None


def check_image(image: Any, where: str) -> None:
    """The launcher's check of a row's image: a path exists and is a file (its content is read when tokenizing)."""
    if isinstance(image, str) and not _is_url(image) and not image.startswith(INLINE):
        path = Path(image).expanduser()
        if not path.is_file():
            raise ConfigError(f"{where}: image {image} {'is a directory' if path.is_dir() else 'does not exist'}: fix the path "
                              "(relative paths are read from the data file's directory)")
    elif isinstance(image, str):
        open_image(image, where)  # the URL refusal


def kept(image: Any, store: Path) -> str:
    """The image as a path the token cache keeps: a path as it is; bytes or a decoded image written once to `store`,
    named by its content's hash."""
    if isinstance(image, str):
        return image
    if isinstance(image, dict) and image.get("bytes") is None and isinstance(image.get("path"), str):
        return image["path"]
    image = _encoded(image)
    file = store / f"{hashlib.sha256(image).hexdigest()[:32]}.img"
    if not file.exists():
        store.mkdir(parents=True, exist_ok=True)
        partial = file.with_suffix(f".{id(image)}.part")
        partial.write_bytes(image)
        partial.replace(file)
    return str(file)


class Pictures:
    """A vision-language model's processor as the data path uses it: what each image becomes in the text (`expand`) and
    a micro-batch's images as the model's inputs (`batch`). Loaded on first use (the token cache's workers and the
    stream's receive it pickled, without the processor)."""

    def __init__(self, source: str, revision: str | None, trust_remote_code: bool, image_token_id: int | None,
                 model_type: str) -> None:
        self.source, self.revision, self.trust_remote_code = source, revision, trust_remote_code
        self.image_token_id, self.model_type = image_token_id, model_type
        self._processor: Any = None
        self.everywhere = False
        """Every micro-batch runs the vision tower (`with_blank`): set on the ranks of a layout that gathers parameters
        or reduces gradients per module on every rank (FSDP2, ZeRO), where one rank running the tower alone would wait
        for the others in its collectives."""
        self._blank: list[int] | None = None
        self._pixels: float | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_processor": None}

    @property
    def processor(self) -> Any:
        if self._processor is None:
            self._processor = load_processor(self.source, self.revision, self.trust_remote_code)
            if not isinstance(getattr(self._processor, "image_token", None), str):
                raise ConfigError(f"model.path={self.source}: its processor ({type(self._processor).__name__}) names no "
                                  "image_token, the text it expands into each image's tokens: not supported")
            self._check_token_types()
        return self._processor

    def _check_token_types(self) -> None:
        """The per-token inputs the processor returns mean what `token_extras` computes from the ids (1 on an image's
        tokens): checked once on a probe, so a class whose types mean something else (PaliGemma's prefix and suffix)
        is refused rather than trained with a wrong mask."""
        from PIL import Image

        p = self._processor
        out = p(text=[f"a {p.image_token} b"], images=[[Image.new("RGB", (32, 32))]], add_special_tokens=False)
        ids = list(out["input_ids"][0])
        for key in ("token_type_ids", "mm_token_type_ids"):
            if key in out and list(out[key][0]) != [int(t == self.image_token_id) for t in ids]:
                raise ConfigError(f"model.path={self.source}: its processor ({type(p).__name__}) returns {key} that are not 1 "
                                  f"exactly on its image tokens (id {self.image_token_id}), which is all finetune computes "
                                  f"them as: model_type={self.model_type} is not supported yet")

    @property
    def token(self) -> str:
        """What the processor expands, once per image, in the text (Qwen's <|image_pad|>, Gemma 3's <start_of_image>)."""
        return str(self.processor.image_token)

    def save(self, path: Any) -> None:
        """The processor's files beside a model: the source model's own, copied as they are (so AutoProcessor loads them
        wherever it loaded the source: a video processor's settings, which this process may not be able to build, kept),
        or the processor as loaded when the source has none of them."""
        import shutil

        from transformers.utils import cached_file

        copied = 0
        for name in PROCESSOR_FILES:
            found = cached_file(self.source, name, revision=self.revision, _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False)
            if found and Path(found).resolve() != (Path(path) / name).resolve():
                shutil.copyfile(found, Path(path) / name)
                copied += 1
            elif found:
                copied += 1
        if not copied and self.loads():
            self.processor.save_pretrained(path)

    def loads(self) -> bool:
        """Whether its processor loads (a checkpoint without one trains on text rows; a row with an image then says why)."""
        try:
            return self.processor is not None
        except ConfigError:
            return False

    def fingerprint(self) -> str:
        """What decides the image tokens (the token cache's key): the processor's settings (none: text rows only)."""
        return hashlib.sha256(self.processor.to_json_string().encode()).hexdigest() if self.loads() else "no processor"

    def expand(self, image: Any, where: str) -> list[int]:
        """The tokens one image becomes in the text, as the processor writes them for `token` (its count from the image's
        size where the model's resolution is dynamic)."""
        p = self.processor
        out = p(text=[self.token], images=[[open_image(image, where)]], add_special_tokens=False)
        bos = p.tokenizer.bos_token_id  # Mllama's processor adds one after a text's leading images: not the image's
        return [t for t in out["input_ids"][0] if t != bos or self.token == p.tokenizer.bos_token]

    def tokenize(self, texts: list[str], images: list[Any], where: str) -> list[list[int]]:
        """Each text's tokens, each `token` in them replaced by its image's expansion (the images in order)."""
        tokenizer = self.processor.tokenizer
        found = sum(t.count(self.token) for t in texts)
        if found != len(images):
            raise ConfigError(f"{where}: the chat template writes {found} image token(s) ({self.token}) for the row's {len(images)} "
                              "image(s): use a template that renders each {\"type\": \"image\"} part once (the model's own)")
        queue = list(images)
        out = []
        for text in texts:
            pieces = text.split(self.token)
            ids = tokenizer(pieces, add_special_tokens=False)["input_ids"] if len(pieces) > 1 else \
                tokenizer([text], add_special_tokens=False)["input_ids"]
            row = list(ids[0])
            for piece in ids[1:]:
                row += self.expand(queue.pop(0), where) + list(piece)
            out.append(row)
        return out

    def batch(self, images: list[list[Any]], ids: Any) -> dict[str, Any]:
        """The model's image inputs for a micro-batch (`images`: each row's, in order; `ids`: its [rows, tokens] input
        ids): what the processor returns for them (pixel values, grids, sizes, tiles), and the per-token inputs it
        would return (`token_extras`) computed from `ids`."""
        p = self.processor
        opened = [[open_image(i, "a batch") for i in row] for row in images]
        out = p(text=[self.token * len(row) for row in opened], images=opened, return_tensors="pt", padding=True)
        batch = {k: v for k, v in out.items() if k not in TOKEN_SIDE}
        return batch | self.token_extras(set(out), ids, [len(row) for row in opened], out)

    @property
    def blank(self) -> Any:
        """The blank image (mid grey) a rank shows where it has none and the layout runs the vision tower on every rank."""
        from PIL import Image

        return Image.new("RGB", (32, 32), (128, 128, 128))

    def blank_tokens(self) -> list[int]:
        """The blank image's tokens, as its processor writes them."""
        if self._blank is None:
            self._blank = self.expand(self.blank, "a blank image")
        return self._blank

    def with_blanks(self, batch: dict[str, Any], rows: list[int], pad_id: int, ignore: int) -> dict[str, Any]:
        """The batch one blank image's tokens wider, with those tokens after the end of each of `rows`, in padding (no
        attention to them from any row, no labels: `ignore`; a sample of their own in rows of several); the image inputs
        are the caller's to make (`batch`)."""
        import torch

        tokens = torch.tensor(self.blank_tokens())
        count, n = batch["input_ids"].shape[0], len(tokens)

        def wider(t: Any, fill: int) -> Any:
            return torch.cat([t, torch.full((count, n), fill, dtype=t.dtype)], dim=1)

        out = dict(batch, input_ids=wider(batch["input_ids"], pad_id), labels=wider(batch["labels"], ignore))
        for row in rows:
            out["input_ids"][row, -n:] = tokens
        if "attention_mask" in batch:
            out["attention_mask"] = wider(batch["attention_mask"], 0)
        if "position_ids" in batch:  # rows of several samples (packed, padding-free): the blank is a sample of its own
            out["position_ids"] = torch.cat([batch["position_ids"], torch.arange(n).expand(count, n)], dim=1)
        return out

    def with_blank(self, batch: dict[str, Any], pad_id: int, ignore: int) -> dict[str, Any]:
        """A micro-batch of text rows made to run the vision tower as one with images does, computing the same loss: a
        blank image after the last row's end, in padding (`with_blanks`), with its image inputs."""
        rows = batch["input_ids"].shape[0]
        out = self.with_blanks(batch, [rows - 1], pad_id, ignore)
        inputs = self.batch([[] for _ in range(rows - 1)] + [[self.blank]], out["input_ids"])
        return out | {IN_BATCH + k: v for k, v in inputs.items()}


    def pixels_per_token(self) -> float:
        """The pixel values the processor makes per image token (a blank image's: the same for any image of a class whose
        token count follows its size, as Qwen-VL's does), which the planner turns into the vision tower's patches."""
        import torch

        if self._pixels is None:
            tokens = self.blank_tokens()
            count = sum(t == self.image_token_id for t in tokens) or len(tokens)
            values = self.batch([[self.blank]], torch.tensor([tokens])).get("pixel_values")
            self._pixels = float(values.numel()) / count if values is not None else 0.0
        return self._pixels

    def blank_row(self, prompts: list[list[int]], images: list[list[Any]]) -> tuple[list[list[int]], list[list[Any]]]:
        """Prompts to generate from, and their images, with one more row of the blank image alone where none of them
        shows one and the layout runs the vision tower on every rank (`everywhere`): generation's first forward then runs
        it as the other ranks' do. The caller drops that row's output."""
        if not self.everywhere or any(images):
            return prompts, images
        return [*prompts, self.blank_tokens()], [*images, [self.blank]]

    def token_extras(self, keys: set[str], ids: Any, counts: list[int], out: Any) -> dict[str, Any]:
        """The per-token inputs the processor returns (`keys`), for the batch's ids: which tokens are an image's
        (token_type_ids, mm_token_type_ids: 1 there, 0 elsewhere), and Mllama's cross-attention mask (each text token
        attends to the images before it)."""
        extras: dict[str, Any] = {}
        mask = (ids == self.image_token_id).long()
        for key in keys & {"token_type_ids", "mm_token_type_ids"}:
            extras[key] = mask
        if "cross_attention_mask" in keys:
            import torch
            from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                                       get_cross_attention_token_mask)

            sparse = [get_cross_attention_token_mask(row.tolist(), self.image_token_id) for row in ids]
            dense = convert_sparse_cross_attention_mask_to_dense(sparse, num_tiles=_tiles(out, counts),
                                                                 max_num_tiles=self.processor.image_processor.max_image_tiles,
                                                                 length=ids.shape[1])
            extras["cross_attention_mask"] = torch.from_numpy(dense)
        return extras


def _tiles(out: Any, counts: list[int]) -> list[list[int]]:
    """Mllama's tiles per image, per row, from its aspect-ratio mask."""
    mask = out["aspect_ratio_mask"]
    return [[int(mask[r, i].sum()) for i in range(n)] for r, n in enumerate(counts)]


APART = "image_rows"
"""The prefix of the image inputs of one row group of a micro-batch of items (`apart`): `image_rows0.pixel_values`..."""


def apart(batch: dict[str, Any], group: int, rows: int) -> dict[str, Any]:
    """Rows [group x rows, (group + 1) x rows) of a micro-batch of items (finetune.data.batches.collate lays out row k of
    every item, k = 0, 1, ...), with their own image inputs: what a method forwards apart (KTO's mismatched rows)."""
    own = f"{APART}{group}."
    out = {k: v[group * rows : (group + 1) * rows] for k, v in batch.items() if not k.startswith((IN_BATCH, APART))}
    return out | {IN_BATCH + k[len(own):]: v for k, v in batch.items() if k.startswith(own)}


SHOWN = "image_refs"
"""A micro-batch's images themselves, each row's (`Shown`): what a method that makes rows of its own from a micro-batch
(GRPO's completions of its prompts) shows them with."""


class Shown(list):
    """Each row's images (paths or bytes), travelling in a micro-batch beside its tensors: moving it to a device leaves
    it as it is."""

    def to(self, *args: Any, **kwargs: Any) -> Shown:
        return self


def seen(batch: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch's image inputs as the model's forward takes them (pixel values, grids, sizes, per-token types): {}
    for a batch of text rows."""
    return {k[len(IN_BATCH):]: v for k, v in batch.items() if k.startswith(IN_BATCH)}


def never_written(tokenizer: Any) -> dict[str, Any]:
    """generate's keyword for a vision-language model's tokenizer: the tokens an image is written with (its placeholder
    and markers) suppressed, since the model would then meet an image token without its image (GRPO trains on its
    samples; transformers refuses a count of image tokens that differs from the images'); {} for a text model."""
    pictures = pictures_of(tokenizer)
    if pictures is None or not pictures.loads():
        return {}
    image = [pictures.image_token_id] if pictures.image_token_id is not None else []
    return {"suppress_tokens": sorted({*pictures.blank_tokens(), *image})}


def pictures_of(tokenizer: Any) -> Pictures | None:
    """The processor a vision-language model's tokenizer carries (`attach`), or None for a text model."""
    return getattr(tokenizer, "finetune_pictures", None)


def attach(tokenizer: Any, pictures: Pictures | None) -> Any:
    """The tokenizer carrying the model's processor, so that every path a row is tokenized and batched on (in memory,
    the token cache's workers, a stream's worker, the ranks' batches) reads images the one way."""
    tokenizer.finetune_pictures = pictures
    return tokenizer


def save_tokenizer(tokenizer: Any, path: Any) -> None:
    """The tokenizer saved beside a model (final/, an export, a checkpoint's weights); a vision-language model's
    processor too (its image processor's settings and processor_config.json: what AutoProcessor loads), the tokenizer
    last, so that the chat template the run trained with is the one kept."""
    pictures = pictures_of(tokenizer)
    if pictures is not None:
        pictures.save(path)
    tokenizer.save_pretrained(path)
