"""What is on disk and on this machine, checked before any rank starts: the model directory, the
tokenizer and the device, read as plain files (json, pathlib: no torch, no transformers).

`check(cfg)` is called by the launcher after the config is validated; it raises `ConfigError`
with one line naming the key, the file and what to do. Hub ids are left to the ranks (they need
the hub). The ranks keep their own checks (model.load_tokenizer / load_model, model.resolve_attention,
dist.init, the DeepSpeed engine) as the second line of defence.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

from finetune.config import AttnImpl, Config, ConfigError, Device, ModelConfig, Precision
from finetune.families import attention_limits, pick_attention
from finetune.families.vision import Vision, vision_of

WEIGHTS = ("model.safetensors", "pytorch_model.bin")
"""Single-file weights; a sharded checkpoint has WEIGHT.index.json naming its shards instead."""

def check(cfg: Config) -> None:
    """The model directory, the tokenizer, the two against each other, and the device. Raises
    ConfigError at the first problem; a dry run only reports what this machine lacks (it may
    preview a launch meant for another machine), as the memory plan does."""
    arch = check_model_dir(cfg.model)
    tokenizer = check_tokenizer_dir(cfg.model)
    if arch is not None and tokenizer is not None:
        check_vocab(cfg.model, arch, tokenizer)
    if cfg.model.init is not None and cfg.model.init.vocab_size is not None and tokenizer is not None:
        count = token_ids(tokenizer, tokenizer_key(cfg.model)[0])
        if count is not None and count > cfg.model.init.vocab_size:
            raise ConfigError(f"model.init.vocab_size={cfg.model.init.vocab_size} is below the tokenizer's {count} token ids "
                              f"(ids from {cfg.model.init.vocab_size} up would index past the embedding): set it to at least "
                              f"{count}, or null for exactly the tokenizer's")
    try:
        check_device(cfg)
    except ConfigError as e:
        if not cfg.launcher.dry_run:
            raise
        print(f"# {e} (a real launch on this machine would be refused)", flush=True)


def hub_unreachable(key: str, repo: str) -> ConfigError | None:
    """A hub id a real launch reads (`key`: model.path, model.tokenizer, method.teacher): None when this machine's Hugging
    Face cache holds it or the hub answers a connection; else the refusal, said now rather than after huggingface_hub's
    retries on every rank (about 50 s on a machine with no network). Behind a proxy huggingface_hub is left to try."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot_download(repo, local_files_only=True)
        return None
    except (LocalEntryNotFoundError, ValueError, OSError):
        pass
    if constants.HF_HUB_OFFLINE:
        why = "HF_HUB_OFFLINE is set"
    elif any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    else:
        url = urlparse(constants.ENDPOINT)
        where = (url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80))
        try:
            socket.create_connection(where, timeout=5).close()
            return None
        except OSError as e:
            why = f"{where[0]}:{where[1]} cannot be reached from here ({e.strerror or e})"
    return ConfigError(f"{key}={repo} is a hub id that is not in this machine's Hugging Face cache, and {why}: download it where "
                       f"there is a network (hf download {repo} --local-dir DIR) and give {key}=DIR, or set HF_ENDPOINT to a "
                       "mirror this machine reaches")


def is_local(path: str) -> bool:
    """A local path rather than a hub id: it exists, or it is written as one (./, ../, /, ~)."""
    return path.startswith((".", "/", "~")) or Path(path).expanduser().exists()


def read_json(file: Path, key: str) -> dict[str, Any]:
    """A JSON object from a file; anything else is one line naming the key that led to it, the file
    and (malformed JSON) the line."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: {file}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}): "
                          "fix the file or download it again") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: {file} must hold a JSON object, got {type(value).__name__}: fix the file or download it again")
    return value


def local_config(cfg: ModelConfig, whole: bool = False) -> dict[str, Any] | None:
    """The (text) config.json of the model as this machine can read it: a local model.path's, else
    model.architecture (the keys a recipe declares for a hub id); None if neither. A multimodal
    wrapper's language model is its `text_config` (`whole`: the wrapper itself, as the planner counts it)."""
    file = Path(cfg.path or "").expanduser() / "config.json"
    if cfg.path and file.is_file():
        arch = read_json(file, "model.path")
        return arch if whole else arch.get("text_config") or arch
    if cfg.architecture and cfg.init is None:
        return dict(cfg.architecture)
    return None


def vocabulary(directory: Path) -> dict[str, int] | None:
    """token -> id of a local fast tokenizer (tokenizer.json: its model's vocabulary and its added tokens), or None."""
    file = directory / "tokenizer.json"
    if not file.is_file():
        return None
    tok = json.loads(file.read_text())
    vocab = tok.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):  # a unigram model's list of [piece, score]
        vocab = {piece: i for i, (piece, _) in enumerate(vocab or [])}
    return {**vocab, **{t["content"]: t["id"] for t in tok.get("added_tokens", [])}}


def local_vision(cfg: ModelConfig) -> Vision | None:
    """The vision-language model a local config.json (or model.architecture) describes (finetune.families.vision); None
    for a text model, a model.init, or a hub id this machine cannot read."""
    whole = local_config(cfg, whole=True) if cfg.init is None else None
    return vision_of(whole) if whole else None


def model_config(cfg: ModelConfig) -> dict[str, Any] | None:
    """The model's config.json keys as this machine can read them without a download: model.init's,
    a local model.path's config.json, or model.architecture; None for a hub id without it."""
    if cfg.init is not None:  # vocab_size null: the tokenizer's, which config.json would state (left out: unknown here)
        return {k: v for k, v in vars(cfg.init).items() if not (k == "vocab_size" and v is None)}
    return local_config(cfg)


def config_source(cfg: ModelConfig) -> str:
    """Where local_config read the model's config from, for messages."""
    file = Path(cfg.path or "").expanduser() / "config.json"
    return str(file) if cfg.path and file.is_file() else "model.architecture"


MISSING_KEY = object()


def architecture_mismatch(declared: dict[str, Any], loaded: Any, source: str) -> str | None:
    """The first key of model.architecture whose value differs from the config the model loads
    with (a transformers config object, read with getattr so its aliases count), as one line;
    None when they agree."""
    for key, want in declared.items():
        have = getattr(loaded, key, MISSING_KEY)
        if isinstance(have, tuple):
            have = list(have)
        if have is MISSING_KEY or have != want:
            shown = "no such key" if have is MISSING_KEY else f"{key}={have!r}"
            return (f"model.architecture.{key}={want!r} but {source} has {shown}: the memory plan and the layout checks "
                    f"were made for the declared architecture; correct model.architecture.{key} (copy it from the model's "
                    "config.json)")
    return None


# ---------------------------------------------------------------------------------------------
# The model directory


def check_model_dir(m: ModelConfig) -> dict[str, Any] | None:
    """A local model.path: a directory with a transformers config.json and its weights. Returns
    the (text) config, or None for a hub id or a model.init."""
    if m.path is None or not is_local(m.path):
        return None
    path = Path(m.path).expanduser()
    if not path.exists():
        if m.recipe_if_missing is not None:  # a dry run: the recipe would make it first
            return None
        raise ConfigError(f"model.path={m.path}: no such directory: give a local model directory (config.json and weights) "
                          "or a hub id such as Qwen/Qwen2.5-0.5B")
    if not path.is_dir():
        raise ConfigError(f"model.path={m.path} is a file: give the model's directory (config.json and weights) or a hub id")
    if not (path / "config.json").is_file():
        adapter = path / "adapter_config.json"
        if adapter.is_file():
            base = read_json(adapter, "model.path").get("base_model_name_or_path") or "BASE"
            raise ConfigError(f"model.path={m.path} is a PEFT adapter (adapter_config.json, no config.json): merge it into its base "
                              f"first (python scripts/merge_adapter.py {m.path} MERGED_DIR, then model.path=MERGED_DIR), or set "
                              f"model.path={base} (its base model)")
        raise ConfigError(f"model.path={m.path} has no config.json (it has: {listing(path)}): give a Hugging Face model directory "
                          "(what save_pretrained writes) or a hub id")
    whole = read_json(path / "config.json", "model.path")
    arch = local_config(m)
    assert arch is not None
    if not (whole.get("model_type") or whole.get("architectures")):
        raise ConfigError(f"model.path: {path / 'config.json'} names no model_type (nor architectures): it is not a transformers "
                          "model config; download the model's own config.json")
    if not m.from_scratch:
        check_weights(m.path, path)
    return arch


def check_weights(key_value: str, path: Path) -> None:
    """Single-file weights, or an index whose shards are all there; each safetensors file whole."""
    shards: list[Path] = [path / name for name in WEIGHTS if (path / name).is_file()]
    for index in (path / f"{name}.index.json" for name in WEIGHTS):
        if shards or not index.is_file():
            continue
        weight_map = read_json(index, "model.path").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"model.path: {index} has no weight_map (parameter -> shard file): download it again")
        missing = sorted({shard for shard in weight_map.values() if not (path / shard).is_file()})
        if missing:
            raise ConfigError(f"model.path: {index} names {len(missing)} shard file(s) that are not in {path} (the first: "
                              f"{missing[0]}): finish the download, or point model.path at the complete copy")
        shards = sorted({path / shard for shard in weight_map.values()})
    if not shards:
        raise ConfigError(f"model.path={key_value} holds no weights (no {', '.join(WEIGHTS)} or their .index.json; it has: "
                          f"{listing(path)}): copy the weight files in, point model.path at the complete model directory, or "
                          "set model.from_scratch=true to train its architecture from random weights")
    for shard in shards:
        problem = safetensors_problem(shard) if shard.suffix == ".safetensors" else None
        if problem:
            raise ConfigError(f"model.path: {shard} is damaged or incomplete ({problem}): copy or download it again")


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file, read from its header (8 bytes of length, a JSON table of
    tensors and their byte ranges) and its size; None if it is whole. Reads the header only."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            return f"{size} bytes, shorter than its header says" if length >= 2 else f"{size} bytes, no header"
        try:
            table = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "its header is not valid JSON"
    ends = [t["data_offsets"][1] for name, t in table.items() if name != "__metadata__" and isinstance(t, dict)
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2]
    need = 8 + length + max(ends, default=0)
    return f"{size} bytes, its tensors need {need}: a download or copy was cut short" if size < need else None


SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def stored_dtypes(path: Path) -> dict[str, int]:
    """The floating-point dtypes of a local checkpoint's safetensors files and the bytes each holds, read from their
    headers ({} where it holds none: pytorch_model.bin, or no weights). What finetune.rank.model.load_model reads the
    weights in: one dtype, memory-mapped, cast on the device."""
    files = sorted(path.glob("*.safetensors"))
    found: dict[str, int] = {}
    for file in files:
        with file.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            table = json.loads(f.read(length))
        for name, t in table.items():
            if name != "__metadata__" and t.get("dtype") in SAFETENSORS_DTYPES:
                start, end = t["data_offsets"]
                found[SAFETENSORS_DTYPES[t["dtype"]]] = found.get(SAFETENSORS_DTYPES[t["dtype"]], 0) + end - start
    return found


def checkpoint_dir(path: str, revision: str | None = None) -> Path | None:
    """Where a model's files are on this machine: the local directory, or a hub id's snapshot in the Hugging Face cache
    (None: not downloaded yet)."""
    if is_local(path):
        return Path(path).expanduser()
    from huggingface_hub import try_to_load_from_cache

    for name in ("model.safetensors.index.json", "model.safetensors"):
        cached = try_to_load_from_cache(path, name, revision=revision)
        if isinstance(cached, str):
            return Path(cached).parent
    return None


def listing(path: Path, most: int = 8) -> str:
    names = sorted(p.name for p in path.iterdir())
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return (", ".join(names[:most]) + more) or "nothing"


# ---------------------------------------------------------------------------------------------
# The tokenizer, and the tokenizer against the model


def tokenizer_key(m: ModelConfig) -> tuple[str, str | None]:
    """The key that names the tokenizer and its value (model.tokenizer, or model.path when it is null)."""
    return ("model.tokenizer", m.tokenizer) if m.tokenizer is not None else ("model.path", m.path)


def check_tokenizer_dir(m: ModelConfig) -> Path | None:
    """A local tokenizer directory holds a tokenizer, not just its settings. Returns the directory,
    or None for a hub id."""
    key, source = tokenizer_key(m)
    if source is None or not is_local(source):
        return None
    path = Path(source).expanduser()
    if not path.exists():
        if key == "model.path":  # check_model_dir has said why, or the recipe makes it (recipe_if_missing)
            return None
        raise ConfigError(f"model.tokenizer={source}: no such directory: give a local tokenizer directory or a hub id "
                          "(model.tokenizer=null takes the one in model.path)")
    if not path.is_dir():
        raise ConfigError(f"{key}={source} is a file: give the tokenizer's directory (what save_pretrained writes) or a hub id")
    names = {p.name for p in path.iterdir()}
    if not ("tokenizer.json" in names or {"vocab.json", "merges.txt"} <= names or "vocab.txt" in names
            or any(n.endswith((".model", ".tiktoken")) for n in names)):
        other = "set model.tokenizer to a directory or hub id that has them" if key == "model.tokenizer" else \
            "set model.tokenizer=DIR_OR_HUB_ID"
        raise ConfigError(f"{key}={source} holds no tokenizer (it has: {listing(path)}): a tokenizer is tokenizer.json, "
                          f"tokenizer.model (sentencepiece), vocab.json + merges.txt, or vocab.txt; copy them from the "
                          f"model's source, or {other}")
    return path


def token_ids(path: Path, key: str) -> int | None:
    """How many token ids a tokenizer can produce (the largest id + 1), read from tokenizer.json or
    vocab.json (+ added_tokens.json); None when only a sentencepiece/tiktoken file says it."""
    ids: list[int] = []
    if (path / "tokenizer.json").is_file():
        tok = read_json(path / "tokenizer.json", key)
        vocab = (tok.get("model") or {}).get("vocab") or {}
        ids.append(max(vocab.values()) + 1 if isinstance(vocab, dict) and vocab else len(vocab))  # a Unigram vocab is a list
        ids += [t["id"] + 1 for t in tok.get("added_tokens") or [] if isinstance(t.get("id"), int)]
    elif (path / "vocab.json").is_file():
        vocab = read_json(path / "vocab.json", key)
        added = read_json(path / "added_tokens.json", key) if (path / "added_tokens.json").is_file() else {}
        ids += [i + 1 for i in [*vocab.values(), *added.values()] if isinstance(i, int)]
    return max(ids) if ids else None


def check_vocab(m: ModelConfig, arch: dict[str, Any], tokenizer: Path) -> None:
    """A tokenizer with more ids than the model's embedding has rows would index past it."""
    key, source = tokenizer_key(m)
    count, vocab = token_ids(tokenizer, key), arch.get("vocab_size")
    if count is None or not isinstance(vocab, int) or count <= vocab:
        return
    config = Path(m.path or "").expanduser() / "config.json"
    which, fix = (("the tokenizer in model.path", "copy its files from where the weights came from") if key == "model.path" else
                  (f"model.tokenizer={source}", "model.tokenizer=null takes the one in model.path"))
    raise ConfigError(f"{which} has {count} token ids but the model's embedding has vocab_size={vocab} ({config}): ids from "
                      f"{vocab} up would index past it; the tokenizer must belong to this model ({fix})")


# ---------------------------------------------------------------------------------------------
# The device


def has_gpu() -> bool:
    """Whether this machine has a GPU driver (NVIDIA, or AMD ROCm, which torch also calls cuda),
    without importing torch. Tests monkeypatch it."""
    return (Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None
            or Path("/dev/kfd").exists())


def cpu_has_fp16() -> bool:
    """Whether this CPU has the fp16 arithmetic DeepSpeed's CPU accelerator asks oneDNN for
    (`is_fp16_supported`: AVX512-FP16 or AMX-FP16 on x86, fp16 SIMD on Arm)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = {f for line in text.splitlines() if line.startswith(("flags", "Features")) for f in line.split(":", 1)[1].split()}
    return bool(flags & {"avx512_fp16", "amx_fp16", "asimdhp"})


def flash_unavailable(cfg: Config, gpu: bool) -> str | None:
    """Why flash_attention_2 cannot run for `cfg` on a machine (`gpu`: it has one), completing
    "flash_attention_2 ..."; None when it can."""
    if not gpu or cfg.train.device == Device.cpu:
        return "needs CUDA" + (" (train.device=cpu)" if gpu else "")
    if cfg.precision.name == Precision.fp32:
        return "runs in fp16/bf16 only (precision=fp32)"
    if importlib.util.find_spec("flash_attn") is None:  # finds the package without importing it
        return "needs the flash-attn package (pip install -e '.[gpu]')"
    return None


def attention(cfg: Config, gpu: bool) -> tuple[str, str] | None:
    """(kernel, why) that model.attn_implementation picks for this model on a machine (`gpu`: it has
    one), from the model's config.json as a file (families.pick_attention); None for a hub id
    without model.architecture (the ranks decide). ConfigError for a kernel the model cannot run."""
    arch = model_config(cfg.model)
    if arch is None:
        return None
    return pick_attention(cfg.model.attn_implementation.value, str(arch.get("model_type") or ""), attention_limits(arch),
                          flash_unavailable(cfg, gpu))


NO_GPU = "this machine has no NVIDIA GPU (no /proc/driver/nvidia/version, no nvidia-smi on PATH)"


def check_device(cfg: Config) -> None:
    """What the config asks of this machine: a GPU, flash-attn, fp16 under DeepSpeed."""
    gpu, device = has_gpu(), cfg.train.device
    if device == Device.cuda and not gpu:
        raise ConfigError(f"train.device=cuda but {NO_GPU}: use train.device=cpu (or auto), or launch on a GPU machine")
    if cfg.model.attn_implementation == AttnImpl.flash_attention_2:
        fix = "use model.attn_implementation=sdpa (or auto)"
        if device == Device.cpu:
            raise ConfigError(f"model.attn_implementation=flash_attention_2 needs CUDA, but train.device=cpu: {fix}")
        if not gpu:
            raise ConfigError(f"model.attn_implementation=flash_attention_2 needs an NVIDIA GPU and the gpu extra "
                              f"(pip install -e '.[gpu]'), but {NO_GPU}: {fix}")
        if importlib.util.find_spec("flash_attn") is None:  # finds the package without importing it
            raise ConfigError("model.attn_implementation=flash_attention_2 needs the flash-attn package, which is not installed: "
                              f"pip install -e '.[gpu]', or {fix}")
    if cfg.precision.fp8 is not None and not gpu and not cfg.precision.fp8_on_cpu:
        raise ConfigError(f"precision=fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (FP8 matmuls), but {NO_GPU}: use "
                          "precision=bf16 here (or precision.fp8_on_cpu=true to check the recipe through torch's CPU FP8 matmuls)")
    if cfg.zero.enabled:
        check_build_locks()
    if cfg.precision.name == Precision.fp16 and cfg.zero.enabled and not gpu and not cpu_has_fp16():
        raise ConfigError(f"precision=fp16 under DeepSpeed (zero.stage={cfg.zero.stage}) but {NO_GPU}, and DeepSpeed's CPU "
                          "accelerator has no fp16 on this CPU (it needs AVX512-FP16 or AMX-FP16): use precision=bf16 or fp32")


STALE_BUILD_S = 600
"""A DeepSpeed op builds in under two minutes here (cpu_adam 36 s, the shm communication op 21 s on 2 cores)."""


def extension_files(pattern: str) -> list[Path]:
    """Files matching `pattern` among torch's JIT-built extensions (DeepSpeed's ops): TORCH_EXTENSIONS_DIR/<op>/..., or
    the default's ~/.cache/torch_extensions/<build, e.g. py311_cpu>/<op>/..."""
    import os

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache/torch_extensions")
    return [*root.glob(pattern), *root.glob(f"*/{pattern}")]


def check_build_locks() -> None:
    """DeepSpeed builds its ops (cpu_adam, the CPU accelerator's shm communication) with torch's extension
    builder, which takes TORCH_EXTENSIONS_DIR/<build>/<op>/lock while it compiles and removes it after. A build
    that was killed (Ctrl-C, a scheduler, a test timeout) leaves the lock behind, and every later rank waits for
    it without end, silently. A lock older than any build is that: refused here, naming the file."""
    import time

    for lock in sorted(extension_files("*/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:  # the build finished meanwhile
            continue
        if age > STALE_BUILD_S:
            raise ConfigError(f"{lock} is the lock of a DeepSpeed op build that started {age / 60:.0f} minutes ago and never removed "
                              f"it (killed?); every rank would wait for it forever: remove it (rm {lock}) and launch again, and "
                              "DeepSpeed builds the op anew")
