"""finetune/disk.py: the model directory, the tokenizer and the device, checked by the launcher
before any rank starts, through the real CLI (each mistake one line, exit 2, no traceback)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, last_line, run_cli
from finetune import disk
from finetune.config import ASSETS, ConfigError
from test_errors import cli_error

SFT = ["+recipe=quickstart_sft", "model=pretrained"]
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 103, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "tie_word_embeddings": False}
"""A tiny Llama config.json whose vocabulary is the shipped tokenizer's (103 ids)."""


def model_dir(where: Path, config: dict | str | None = None, *, weights: tuple[str, ...] = ("model.safetensors",),
              tokenizer: bool = True) -> Path:
    """A model directory written by hand: config.json (a dict, raw text, or none), weight files
    (placeholders: a safetensors header with no tensors, whole as far as the header check sees)
    and the shipped tokenizer's files."""
    where.mkdir(parents=True)
    if config is not None:
        (where / "config.json").write_text(config if isinstance(config, str) else json.dumps(config, indent=2))
    for name in weights:
        (where / name).write_bytes((2).to_bytes(8, "little") + b"{}" if name.endswith(".safetensors") else b"")
    if tokenizer:
        for f in (ASSETS / "tokenizer").iterdir():
            shutil.copy(f, where)
    return where


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """A real tiny Llama written by save_pretrained, with the shipped tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("saved") / "model"
    arch = {k: v for k, v in LLAMA.items() if k not in ("model_type", "architectures")}
    LlamaForCausalLM(LlamaConfig(**arch)).save_pretrained(path)
    for f in (ASSETS / "tokenizer").iterdir():
        shutil.copy(f, path)
    return path


def test_a_saved_model_dry_runs_without_importing_torch(saved_model, tmp_path):
    """The happy path, in a subprocess: the dry run reads config.json, the weights and the tokenizer
    as files and never imports torch, transformers or deepspeed (what keeps a dry run instant)."""
    probe = ("import runpy, sys\n"
             "sys.argv = ['finetune.launch', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('finetune.launch', run_name='__main__')\n"
             "finally:\n    print('HEAVY', sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules), file=sys.stderr)\n")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", probe, *SFT, f"model.path={saved_model}", "data.max_length=128",
                          "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    wall = time.perf_counter() - start
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stderr.splitlines()
    own = [line.split("|")[0].removeprefix("import time:").strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    total = sum(int(us) for us in own if us.isdigit())  # each module's own import time, in microseconds
    print(f"dry run of a saved model: {wall:.2f} s wall, {total / 1e6:.2f} s of it importing {len(own) - 1} modules")
    assert f"model.path: {saved_model}" not in out.stdout  # nothing said about a model that is fine


@pytest.mark.parametrize("case,args,message", [
    ("nowhere", [], "model.path={d}: no such directory: give a local model directory (config.json and weights) or a hub id "
                    "such as Qwen/Qwen2.5-0.5B"),
    ("file", [], "model.path={d} is a file: give the model's directory (config.json and weights) or a hub id"),
    ("adapter", [], "model.path={d} is a PEFT adapter (adapter_config.json, no config.json): merge it into its base first "
                    "(python scripts/merge_adapter.py {d} MERGED_DIR, then model.path=MERGED_DIR), or set model.path=/models/base "
                    "(its base model)"),
    ("no_config", [], "model.path={d} has no config.json (it has: chat_template.jinja, model.safetensors, tokenizer.json, "
                      "tokenizer_config.json): give a Hugging Face model directory (what save_pretrained writes) or a hub id"),
    ("bad_json", [], "model.path: {d}/config.json:3: not valid JSON (Expecting ',' delimiter at column 3): fix the file or "
                     "download it again"),
    ("list_json", [], "model.path: {d}/config.json must hold a JSON object, got list: fix the file or download it again"),
    ("no_model_type", [], "model.path: {d}/config.json names no model_type (nor architectures): it is not a transformers model "
                          "config; download the model's own config.json"),
    ("no_weights", [], "model.path={d} holds no weights (no model.safetensors, pytorch_model.bin or their .index.json; it has: "
                       "chat_template.jinja, config.json, tokenizer.json, tokenizer_config.json): copy the weight files in, point "
                       "model.path at the complete model directory, or set model.from_scratch=true to train its architecture "
                       "from random weights"),
    ("missing_shards", [], "model.path: {d}/model.safetensors.index.json names 2 shard file(s) that are not in {d} (the first: "
                           "model-00002-of-00003.safetensors): finish the download, or point model.path at the complete copy"),
    ("no_weight_map", [], "model.path: {d}/pytorch_model.bin.index.json has no weight_map (parameter -> shard file): download it again"),
    ("no_tokenizer", [], "model.path={d} holds no tokenizer (it has: config.json, model.safetensors): a tokenizer is tokenizer.json, "
                         "tokenizer.model (sentencepiece), vocab.json + merges.txt, or vocab.txt; copy them from the model's source, "
                         "or set model.tokenizer=DIR_OR_HUB_ID"),
    ("tokenizer_config_only", ["model.tokenizer={t}"],
     "model.tokenizer={t} holds no tokenizer (it has: tokenizer_config.json): a tokenizer is tokenizer.json, tokenizer.model "
     "(sentencepiece), vocab.json + merges.txt, or vocab.txt; copy them from the model's source, or set model.tokenizer to a "
     "directory or hub id that has them"),
    ("tokenizer_nowhere", ["model.tokenizer=/nowhere/tokenizer"],
     "model.tokenizer=/nowhere/tokenizer: no such directory: give a local tokenizer directory or a hub id (model.tokenizer=null "
     "takes the one in model.path)"),
    ("small_vocab", [], "the tokenizer in model.path has 103 token ids but the model's embedding has vocab_size=100 ({d}/config.json): "
                        "ids from 100 up would index past it; the tokenizer must belong to this model (copy its files from where "
                        "the weights came from)"),
    ("small_vocab", ["model.tokenizer={t}"],
     "model.tokenizer={t} has 103 token ids but the model's embedding has vocab_size=100 ({d}/config.json): ids from 100 up would "
     "index past it; the tokenizer must belong to this model (model.tokenizer=null takes the one in model.path)"),
    ("llama", ["data.max_length=512"],
     "data.max_length=512 exceeds the model's max_position_embeddings=256 ({d}/config.json): use data.max_length=256 or less"),
    ("wide_mlp", ["parallelism=tp2"], "parallelism.tp=2 must divide the model's intermediate_size=65: use a tp that divides 65"),
    # GPT-J names its sizes as GPT-2 does (n_head, n_layer, n_inner, n_positions)
    ("gptj", ["parallelism=tp2"], "parallelism.tp=2 must divide the model's num_attention_heads=3: use a tp that divides 3"),
    ("gptj", ["parallelism=pp4", "launcher.nproc_per_node=4"],
     "parallelism.pp=4 x pp_stages_per_rank=1 = 4 pipeline stages, but the model has 3 blocks: use at most 3 stages"),
    ("gpt2", ["data.max_length=512"],
     "data.max_length=512 exceeds the model's max_position_embeddings=128 ({d}/config.json): use data.max_length=128 or less"),
    ("gptj", ["parallelism=pp2"], "pipeline parallel needs untied input/output embeddings (the first and last stages hold them): "
                                  "this model ties them; use tp or fsdp"),
    ("gpt2", ["parallelism=tp2"], "parallelism.tp=2: transformers publishes no tensor-parallel plan for model_type=gpt2 and its "
                                  "fused Conv1D layers (c_attn, c_proj, c_fc) are not the Llama layout our own plan splits: use "
                                  "parallelism=fsdp or ddp"),
    ("gpt2", ["parallelism=pp2"], "parallelism.pp=2: transformers publishes no pipeline plan for model_type=gpt2 (which modules run "
                                  "before and after its blocks), so it cannot be cut into stages: use parallelism=fsdp or ddp"),
])
def test_what_is_on_disk_is_one_line(tmp_path, case, args, message):
    d, t = tmp_path / case, tmp_path / "tok"
    gpt2 = {"model_type": "gpt2", "vocab_size": 103, "n_embd": 48, "n_head": 3, "n_layer": 3, "n_inner": None, "n_positions": 128,
            "tie_word_embeddings": True}
    weights = {"no_weights": (), "missing_shards": ("model-00001-of-00003.safetensors", "model.safetensors.index.json"),
               "no_weight_map": ("pytorch_model.bin.index.json",)}.get(case, ("model.safetensors",))
    config = {"bad_json": '{\n  "model_type": "llama"\n  "vocab_size": 103\n}\n', "list_json": "[]", "no_config": None,
              "adapter": None, "no_model_type": {"vocab_size": 103}, "small_vocab": {**LLAMA, "vocab_size": 100},
              "wide_mlp": {**LLAMA, "intermediate_size": 65}, "gpt2": gpt2, "gptj": {**gpt2, "model_type": "gptj"}}.get(case, LLAMA)
    if case == "file":
        d.write_text("")
    elif case == "adapter":
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "/models/base"}))
        (d / "adapter_model.safetensors").write_bytes(b"")
    elif case != "nowhere":
        model_dir(d, config, weights=weights, tokenizer=case != "no_tokenizer")
    if case == "missing_shards":
        shards = {f"layer.{i}": f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    if case == "no_weight_map":
        (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}}))
    if case == "tokenizer_config_only":
        t.mkdir()
        shutil.copy(ASSETS / "tokenizer" / "tokenizer_config.json", t)
    if case == "small_vocab" and args:
        shutil.copytree(ASSETS / "tokenizer", t)
    fill = lambda text: text.replace("{d}", str(d)).replace("{t}", str(t))  # noqa: E731
    assert cli_error(tmp_path, *SFT, f"model.path={d}", *map(fill, args)) == f"error: {fill(message)}"


def test_what_is_fine_passes(tmp_path, saved_model):
    """Fewer token ids than the embedding, a sharded checkpoint that is whole, a vocab.json + merges.txt
    tokenizer, gpt2's names for its sizes (in a GPT-J config), and a hub id (left to the ranks) all dry-run."""
    d = model_dir(tmp_path / "sharded", {**LLAMA, "vocab_size": 128}, weights=("model-00001-of-00002.safetensors",
                                                                                "model-00002-of-00002.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                               "b": "model-00002-of-00002.safetensors"}}))
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    (bpe / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (bpe / "merges.txt").write_text("#version: 0.2\n")
    gptj = model_dir(tmp_path / "gptj", {"model_type": "gptj", "vocab_size": 103, "n_embd": 48, "n_head": 4, "n_layer": 2,
                                         "n_inner": None, "n_positions": 1024})
    for args in ([f"model.path={d}"], [f"model.path={d}", f"model.tokenizer={bpe}"], [f"model.path={gptj}", "parallelism=tp2"],
                 ["model.path=someone/some-model"]):
        out = run_cli(*SFT, *args, "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=60)
        assert out.returncode == 0, (args, out.stderr[-1000:])


def test_model_shape_reads_the_families_aliases(tmp_path):
    from finetune.config import ModelConfig
    from finetune.launcher.rules import model_shape

    d = model_dir(tmp_path / "gpt2", {"model_type": "gpt2", "n_embd": 48, "n_head": 4, "n_layer": 2, "n_inner": None,
                                      "n_positions": 1024})
    assert model_shape(ModelConfig(path=str(d))) == {"model_type": "gpt2", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                                                     "intermediate_size": 192, "max_position_embeddings": 1024,
                                                     "tie_word_embeddings": None}
    wrapped = model_dir(tmp_path / "vlm", {"model_type": "llava", "text_config": {**LLAMA, "num_key_value_heads": None}})
    assert model_shape(ModelConfig(path=str(wrapped)))["num_key_value_heads"] == 4  # none given: as many as the heads


# ---------------------------------------------------------------------------------------------
# The device: refused by a real launch; a dry run (which may preview another machine) only says so


NO_GPU = "this machine has no NVIDIA GPU (no /proc/driver/nvidia/version, no nvidia-smi on PATH)"
needs_no_gpu = pytest.mark.skipif(disk.has_gpu(), reason="checks what a machine without a GPU refuses")


@needs_no_gpu
@pytest.mark.parametrize("args,message", [
    (["train.device=cuda"], f"train.device=cuda but {NO_GPU}: use train.device=cpu (or auto), or launch on a GPU machine"),
    (["model.attn_implementation=flash_attention_2", "precision=bf16"],
     f"model.attn_implementation=flash_attention_2 needs an NVIDIA GPU and the gpu extra (pip install -e '.[gpu]'), but {NO_GPU}: "
     "use model.attn_implementation=sdpa (or auto)"),
    pytest.param(["precision=fp16", "zero=stage2"],
                 f"precision=fp16 under DeepSpeed (zero.stage=2) but {NO_GPU}, and DeepSpeed's CPU accelerator has no fp16 on this "
                 "CPU (it needs AVX512-FP16 or AMX-FP16): use precision=bf16 or fp32",
                 marks=pytest.mark.skipif(disk.cpu_has_fp16(), reason="this CPU has fp16")),
])
def test_the_device_is_checked_before_launch(tmp_path, args, message):
    run = ["+recipe=quickstart_sft", *args, "train.max_steps=1", "optim.warmup_steps=0", f"hydra.run.dir={tmp_path / 'run'}"]
    out = run_cli(*run, cwd=tmp_path, timeout=120)
    assert (out.returncode, out.stderr, out.stdout) == (2, f"error: {message}\n", "")  # nothing started, nothing printed
    dry = run_cli(*run, "launcher.dry_run=true", cwd=tmp_path, timeout=60)
    assert dry.returncode == 0, dry.stderr[-1000:]
    assert f"# {message} (a real launch on this machine would be refused)\n" in dry.stdout


def test_flash_attention_without_the_package(compose, monkeypatch):
    """On a GPU machine without flash-attn installed (has_gpu and find_spec stand in for both)."""
    import importlib.util

    cfg = compose(["model.attn_implementation=flash_attention_2", "precision=bf16"])
    monkeypatch.setattr(disk, "has_gpu", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        disk.check(cfg)
    assert str(e.value) == ("model.attn_implementation=flash_attention_2 needs the flash-attn package, which is not installed: "
                            "pip install -e '.[gpu]', or use model.attn_implementation=sdpa (or auto)")
    cfg.train.device = disk.Device.cpu
    with pytest.raises(ConfigError) as e:
        disk.check(cfg)
    assert str(e.value) == ("model.attn_implementation=flash_attention_2 needs CUDA, but train.device=cpu: "
                            "use model.attn_implementation=sdpa (or auto)")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    cfg.train.device = disk.Device.cuda
    disk.check(cfg)  # a GPU and the package: nothing to say
    monkeypatch.setattr(disk, "has_gpu", lambda: False)
    monkeypatch.setattr(disk, "cpu_has_fp16", lambda: False)
    disk.check(compose(["precision=bf16", "zero=stage2"]))  # bf16 runs on DeepSpeed's CPU accelerator


def test_a_killed_op_builds_lock_is_refused_naming_the_file(tmp_path, monkeypatch, compose):
    """Seen here: a DeepSpeed op build killed mid-compile left TORCH_EXTENSIONS_DIR/py311_cpu/cpu_adam/lock, and
    every later offload run waited on it until its timeout. A lock older than any build is refused before launch;
    a build in progress (a fresh lock) is waited for as before."""
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam/lock"
    lock.parent.mkdir()
    lock.touch()
    cfg = compose(["zero=stage2_offload", "parallelism=ddp", "launcher.nproc_per_node=2", "train.global_batch_size=32"])
    disk.check_build_locks()  # being built now: fine
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.raises(ConfigError) as e:
        disk.check_device(cfg)
    assert str(e.value) == (f"{lock} is the lock of a DeepSpeed op build that started 60 minutes ago and never removed it (killed?); "
                            f"every rank would wait for it forever: remove it (rm {lock}) and launch again, and DeepSpeed builds the "
                            "op anew")
    disk.check_device(compose(["parallelism=ddp", "launcher.nproc_per_node=2", "train.global_batch_size=32"]))  # the torch engine builds no op


def test_a_hub_id_is_refused_at_once_where_it_is_neither_cached_nor_reachable(tmp_path, monkeypatch):
    """A real launch's hub id: in the Hugging Face cache (a snapshot of it there), fine; not there and the hub unreachable
    (HF_HUB_OFFLINE here; no network in CI, where huggingface_hub would retry for about 50 s), one line naming the key."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--cached" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--org--cached" / "refs").mkdir()
    (cache / "models--org--cached" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert disk.hub_unreachable("model.path", "org/cached") is None
    refusal = disk.hub_unreachable("method.teacher", "org/elsewhere")
    assert str(refusal) == ("method.teacher=org/elsewhere is a hub id that is not in this machine's Hugging Face cache, and "
                            "HF_HUB_OFFLINE is set: download it where there is a network (hf download org/elsewhere --local-dir "
                            "DIR) and give method.teacher=DIR, or set HF_ENDPOINT to a mirror this machine reaches")
