"""train.compile=true: each decoder layer compiled in place (regional), the eager loss curve within float
noise, compile time apart from step time, and what keeps the layers eager refused or said."""

from __future__ import annotations

import pytest
import torch

from finetune.rank import compiling
from finetune.config import ConfigError

from conftest import read_metrics, tiny_model, train_here

STEPS = ["+recipe=quickstart_sft", "train.max_steps=3", "optim.warmup_steps=1", "train.micro_batch_size=8",
         "train.global_batch_size=16", "train.exact_match_samples=0", "train.eval_every=0", "parallelism=single",
         "launcher.nproc_per_node=1"]


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ConfigError) as e:
        compiling.compile_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.device("cpu"))
    assert str(e.value) == ("train.compile=true compiles each decoder layer (transformers' GradientCheckpointingLayer), and this "
                            "Sequential model has none (remote code or an older model class): set train.compile=false")


def test_no_cpp_compiler_on_cpu_is_refused(monkeypatch):
    import torch._inductor.cpp_builder as builder

    monkeypatch.setattr(builder, "get_cpp_compiler", lambda: "no-such-g++")
    with pytest.raises(ConfigError) as e:
        compiling.compile_layers(tiny_model()[0], torch.device("cpu"))
    assert str(e.value) == ("train.compile=true on CPU compiles C++ with no-such-g++, which is not installed: install a C++ "
                            "compiler (apt install g++), or set train.compile=false")


def test_a_memory_snapshot_with_compile_is_refused(compose):
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "train.compile=true", "train.memory_snapshot=true"])
    assert str(e.value) == ("train.memory_snapshot=true with train.compile=true: the snapshot is taken by the memory probe, whose "
                            "dispatch mode keeps the layers from compiling (they would run eager): set one of them false")


def test_compile_under_tensor_parallel_is_refused(compose):
    with pytest.raises(ConfigError) as e:
        compose(["+recipe=quickstart_sft", "train.compile=true", "parallelism=tp2", "launcher.nproc_per_node=2"])
    assert str(e.value) == ("train.compile=true with parallelism.tp=2: tracing a layer whose weights are DTensor shards under "
                            "transformers' tensor-parallel hooks never ends in AOT autograd (torch 2.13: RecursionError in its "
                            "proxy tracer): use train.compile=true with parallelism=fsdp, ddp or pp, or tp without it")


def test_each_layer_is_compiled_in_place_and_keeps_its_names():
    net, _ = tiny_model()
    keys = list(net.state_dict())
    assert compiling.compile_layers(net, torch.device("cpu")) == 2
    layers = list(net.model.layers)
    assert all(layer._compiled_call_impl is not None for layer in layers)  # nn.Module.compile: the module itself
    assert list(net.state_dict()) == keys  # no _orig_mod. prefix: checkpoints and export unchanged


@pytest.mark.slow
@pytest.mark.parametrize("strategies", [[], ["peft=lora", "checkpointing=full", "data.padding_free=false"]],
                         ids=["full", "lora-checkpointing"])
def test_the_compiled_run_follows_the_eager_one(strategies, tmp_path, capsys):
    """Through the rank's own code (train.run): the same losses and gradient norms within float noise (inductor
    fuses and reorders sums), compile seconds apart from the step's, the layers eager in evaluation; and graphs really
    compiled (dynamo's own count), checkpointed layers included (padded rows: nothing splits their graph)."""
    from torch._dynamo.utils import counters

    eager = train_here([*STEPS, *strategies, "train.memory_report=false"], tmp_path / "eager")
    capsys.readouterr()
    counters.clear()
    compiled = train_here([*STEPS, *strategies, "train.compile=true", "train.memory_report=categories"], tmp_path / "compiled")
    out = capsys.readouterr().out
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    train = {name: [m for m in read_metrics(tmp_path / name) if m["kind"] == "train"] for name in ("eager", "compiled")}
    assert [m["loss"] for m in train["compiled"]] == pytest.approx([m["loss"] for m in train["eager"]], rel=1e-5)
    assert [m["grad_norm"] for m in train["compiled"]] == pytest.approx([m["grad_norm"] for m in train["eager"]], rel=1e-4)
    assert compiled["after"]["eval_loss"] == pytest.approx(eager["after"]["eval_loss"], rel=1e-5)
    assert "compile_s" not in train["eager"][0]
    assert train["compiled"][0]["compile_s"] > 0  # the first step traced and compiled the layers: not in step_s
    assert "compile: 2 decoder layers compiled in place at the first training step" in out
    assert f"compile: {train['compiled'][0]['compile_s']:.1f} s in step 1 (the first)" in out
    assert "memory: not measured by category with train.compile=true" in out  # asked for: the peak instead
    assert "MiB resident (the whole process, since the first step)" in out


def test_checkpointed_layers_around_per_sample_attention_are_said_or_refused(tmp_path):
    """Rows of several samples attend each alone outside the graph (finetune.rank.varlen): a checkpointed layer cannot be
    split around that, so dynamo runs it eagerly. Measured before this rule: train.compile=true with checkpointing=full
    on the padding-free quickstart gave eager's losses bit for bit, compile_s 0.7 s. Full: refused by the rank in one
    line; selective: the compile line names the layers that stay eager; offload, or padded rows: nothing to say."""
    from finetune.config import CheckpointingConfig

    with pytest.raises(ConfigError) as e:
        train_here([*STEPS, "checkpointing=full", "train.compile=true"], tmp_path / "full")
    assert str(e.value) == (
        "train.compile=true with checkpointing=full: padding-free micro-batches attend each sample alone outside the compiled "
        "graph (finetune.rank.varlen), and dynamo cannot split a checkpointed layer around it, so every layer would run "
        "eagerly and nothing compile: use checkpointing=offload (or selective) with train.compile=true, or set "
        "data.packing=false and data.padding_free=false (padded rows compile under checkpointing)")
    selective = CheckpointingConfig(name=compiling.Checkpointing.selective, every=3)
    assert compiling.checkpointed_eager(selective, "packed rows") == (
        "; the checkpointed layers (blocks 0, 3, 6, ...) run eagerly: packed rows attend each sample alone outside the "
        "compiled graph (finetune.rank.varlen), and dynamo cannot split a checkpointed layer around it")
    assert compiling.checkpointed_eager(CheckpointingConfig(name=compiling.Checkpointing.offload), "packed rows") == ""
    assert compiling.checkpointed_eager(selective, "") == ""
