"""Loading that scales (finetune.rank.model.read_dtype, finetune.rank.engine.common.place, FSDP2's cast of its shards):
a pretrained checkpoint whose weights share one dtype is read in it, each weight a view of the memory-mapped file (the
page cache, shared by the node's ranks), and cast to the training dtype where each rank's part lands. Measured on a
68M-parameter Llama saved in bf16 beside its mixed twin (the same weights, its norms stored in fp32: read whole in fp32
on every rank's host, as every checkpoint was read before): the model read takes a fraction of the fp32 model's private
host memory, the losses equal the fp32 read's to the bit, and the planner counts what is still read whole (random
init, mixed dtypes, .bin files) per rank and per node."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, read_metrics, train_here
from finetune.rank.model import read_dtype
from ranks import launch_here

sys.path.insert(0, str(REPO / "scripts"))
from benchmark_loading import mixed as _mixed, save as _save  # noqa: E402 - the checkpoints the benchmark measures

RUN = ["+recipe=quickstart_sft", "model=pretrained", "train.max_steps=2", "optim.warmup_steps=0", "train.micro_batch_size=2",
       "train.global_batch_size=4", "train.eval_every=0", "data.eval=null", "data.eval_size=8", "train.exact_match_samples=0"]
MIB = 2**20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path, int]:
    root = tmp_path_factory.mktemp("loading")
    params = _save(root / "bf16", hidden=1024, layers=6)
    _mixed(root / "bf16", root / "mixed")
    return root / "bf16", root / "mixed", params


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A tiny bf16 checkpoint (for what is read from its headers)."""
    where = tmp_path_factory.mktemp("small") / "bf16"
    _save(where, hidden=64, layers=1)
    return where


def _cfg(path: Path | str, revision: str | None = None):
    from finetune.config import ModelConfig

    return ModelConfig(path=str(path), tokenizer=str(path), revision=revision)


def test_the_read_dtype_and_its_reason(small, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    got = read_dtype(_cfg(small), str(small), torch.float32, quantized=False, zero3=False)
    assert got == (torch.bfloat16, "read in bfloat16 (the checkpoint's own), memory-mapped, cast to float32 on the device")
    got = read_dtype(_cfg(small), str(small), torch.bfloat16, quantized=False, zero3=False)  # precision=bf16_pure
    assert got == (torch.bfloat16, "read in bfloat16 (the checkpoint's own), memory-mapped")
    assert read_dtype(_cfg(small), str(small), torch.float32, quantized=True, zero3=False) == (
        torch.float32, "read in float32 around the 4-bit base")
    assert read_dtype(_cfg(small), str(small), torch.float32, quantized=False, zero3=True) == (
        torch.float32, "read in float32 into ZeRO-3's partitions")

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    save_file({"a": torch.zeros(4, dtype=torch.bfloat16), "b": torch.zeros(4), "step": torch.zeros(2, dtype=torch.int64)},
              mixed / "model.safetensors")
    assert read_dtype(_cfg(mixed), str(mixed), torch.float32, quantized=False, zero3=False) == (
        torch.float32, "read in float32 on the host (the checkpoint mixes bfloat16 and float32)")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save({"a": torch.zeros(4)}, legacy / "pytorch_model.bin")
    assert read_dtype(_cfg(legacy), str(legacy), torch.float32, quantized=False, zero3=False) == (
        torch.float32, "read in float32 on the host (no safetensors headers to read here)")

    # a hub id: its snapshot in the Hugging Face cache where it was downloaded, its dtype unknown before that
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert read_dtype(_cfg("org/model"), "org/model", torch.float32, quantized=False, zero3=False) == (
        torch.float32, "read in float32 on the host (not downloaded yet: its dtype is unknown)")
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "model.safetensors").write_bytes((small / "model.safetensors").read_bytes())
    assert read_dtype(_cfg("org/model"), "org/model", torch.float32, quantized=False, zero3=False)[0] == torch.bfloat16


def _steps(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r.get("kind") == "train"]


def _loading(run_dir: Path, rank: int = 0) -> dict:
    return json.loads((run_dir / "ranks" / f"{rank}.json").read_text())["loading"]


def test_fsdp2_and_tensor_parallel_read_the_bf16_checkpoint_memory_mapped(checkpoints, tmp_path):
    """FSDP2 on 2 ranks: the bf16 checkpoint read takes under a fifth of the private host memory its mixed twin's read
    takes (the whole fp32 model on every rank, as every run loaded before), the engine built peaks below the whole fp32
    model (each rank's fp32 shard: on a CPU device the training weights are host memory), and the losses are the fp32
    read's to the bit. Tensor parallel with LoRA (each shard cast on the device after torch cuts it, PEFT's adapters
    in fp32): its first loss, the base model's, within fp32 rounding of FSDP2's."""
    bf16, mixed, params = checkpoints
    runs = {}
    for name, where, layout in (("bf16", bf16, ["parallelism=fsdp"]), ("mixed", mixed, ["parallelism=fsdp"]),
                                ("tp", bf16, ["parallelism=tp2", "peft=lora"])):
        out = launch_here(*RUN, f"model.path={where}", f"model.tokenizer={where}", "launcher.nproc_per_node=2", *layout,
                          f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = out
    assert "weights: read in bfloat16 (the checkpoint's own), memory-mapped, cast to float32 on the device" in runs["bf16"].stdout
    assert "weights: read in float32 on the host (the checkpoint mixes bfloat16 and float32)" in runs["mixed"].stdout
    assert _steps(tmp_path / "bf16") == _steps(tmp_path / "mixed") and len(_steps(tmp_path / "bf16")) == 2
    assert _steps(tmp_path / "tp")[0] == pytest.approx(_steps(tmp_path / "bf16")[0], rel=1e-5)

    whole = 4 * params / MIB
    new, old = _loading(tmp_path / "bf16"), _loading(tmp_path / "mixed")
    print(f"fp32 model {whole:.0f} MiB; read: {new['read_private_mib']} MiB private (bf16, mapped) vs {old['read_private_mib']} "
          f"(fp32); engine built, private peak {new['private_peak_mib']} vs {old['private_peak_mib']}")
    assert old["read_private_mib"] > 0.8 * whole  # the mixed twin: the whole fp32 model on the rank's host
    assert new["read_private_mib"] < 0.2 * old["read_private_mib"]
    assert new["private_peak_mib"] < 0.75 * whole and new["private_peak_mib"] < old["private_peak_mib"]
    assert _loading(tmp_path / "bf16", 1)["read_private_mib"] < 0.2 * whole  # every rank
    assert "loading (rank 0): the model read with 0.0" in runs["bf16"].stdout


def test_one_process_and_the_live_reference_are_cast_to_the_training_dtype(checkpoints, tmp_path):
    """The torch engine casts the bf16-read policy to fp32 on its device (the mixed twin's losses to the bit), and DPO's
    live reference, read the same way, is cast like it: the first DPO loss is ln 2 (policy = reference)."""
    bf16, mixed, _ = checkpoints
    small = ["train.max_steps=1", "parallelism=single", "launcher.nproc_per_node=1"]
    train_here([*RUN, f"model.path={bf16}", f"model.tokenizer={bf16}", *small], tmp_path / "bf16")
    train_here([*RUN, f"model.path={mixed}", f"model.tokenizer={mixed}", *small], tmp_path / "mixed")
    assert _steps(tmp_path / "bf16") == _steps(tmp_path / "mixed")
    train_here([*RUN, f"model.path={bf16}", f"model.tokenizer={bf16}", *small, "method=dpo", "data=quickstart_dpo",
                "method.reference=live"], tmp_path / "dpo")
    assert _steps(tmp_path / "dpo")[0] == pytest.approx(0.6931471805599453, abs=1e-6)


def _plan(compose, path: Path, *extra: str):
    from finetune.planner.peak import plan

    return plan(compose(["model=pretrained", f"model.path={path}", f"model.tokenizer={path}", "precision=bf16",
                         "launcher.nproc_per_node=8", "hardware=h100_80g", "train.micro_batch_size=1",
                         "train.global_batch_size=8", *extra]))


def test_the_planner_counts_what_is_still_read_whole(compose, small, tmp_path):
    """Per rank, on a GPU node: nothing for a one-dtype checkpoint (mapped pages are the page cache), the whole model in
    fp32 for a random init (from_scratch; ZeRO-3 builds it partitioned), in the training dtype for mixed dtypes or
    .bin files; the node's CPU RAM holds every rank's."""
    mapped = _plan(compose, small, "parallelism=fsdp")
    assert not [n for n in mapped.notes if n.startswith("loading:")]
    scratch = _plan(compose, small, "parallelism=fsdp", "model.from_scratch=true")
    per_rank = 4 * scratch.params
    assert scratch.cpu_bytes == pytest.approx(8 * per_rank)
    assert ("loading: a random-init model is built whole in fp32 on every rank's host before it is placed (parallelism=ddp "
            f"zero=stage3 builds it partitioned): {per_rank / 2**30:.2f} GiB per rank, {8 * per_rank / 2**30:.2f} GiB per node "
            "at start") in scratch.notes
    assert not [n for n in _plan(compose, small, "parallelism=ddp", "zero=stage3", "model.from_scratch=true").notes
                if n.startswith("loading:")]

    mixed = tmp_path / "mixed"
    _mixed(small, mixed)
    got = _plan(compose, mixed, "parallelism=fsdp")
    assert got.cpu_bytes == pytest.approx(8 * 4 * got.params)
    assert any(n.startswith(f"loading: model.path={mixed} is read whole on every rank's host (its weights mix bfloat16 and "
                            "float32;") for n in got.notes)


def test_seventy_billion_from_scratch_is_refused_for_the_node_it_would_fill(compose, tmp_path):
    """Llama-3.1-70B built at random on each of 8 ranks: 263 GiB each, 2.1 TB for the node: more than its CPU RAM."""
    from finetune.planner.peak import plan

    pl = plan(compose(["+recipe=quickstart_sft", "model=llama3_1_70b", "model.from_scratch=true", "hardware=h100_80g",
                       "precision=bf16", "parallelism=fsdp", "launcher.nproc_per_node=8", "checkpointing=full",
                       "train.global_batch_size=128"]))
    assert pl.cpu_bytes == pytest.approx(8 * 4 * pl.params) and pl.cpu_bytes > pl.cpu_budget and not pl.fits
