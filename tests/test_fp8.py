"""precision=fp8 (finetune/rank/fp8.py): the layers the rule converts and keeps, the refusals in one line (on CPU before
launch, at launch on a machine without a GPU, and on a rank whose device has no FP8 matmuls), and on a GPU of compute
capability 8.9+ (-m gpu) the loss curve of bf16 within a tolerance over 200 steps."""

from __future__ import annotations

import pytest
import torch

from finetune.config import ConfigError
from finetune.rank import fp8

from conftest import last_line, read_metrics, run_cli, tiny_model

fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < fp8.CAPABILITY,
                             reason="needs an NVIDIA GPU of compute capability 8.9 or newer")


def test_every_linear_but_the_output_layer_and_odd_sizes_is_converted():
    from transformers import LlamaConfig, LlamaForCausalLM

    net, _ = tiny_model()
    converted, kept = fp8.chosen(net)
    assert kept == {"lm_head": "the output layer"}
    assert len(converted) == 7 * net.config.num_hidden_layers and all(n.startswith("model.layers.") for n in converted)
    odd = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=100, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=4, vocab_size=103))
    converted, kept = fp8.chosen(odd)
    assert sorted(converted) == [f"model.layers.0.self_attn.{p}_proj" for p in "koqv"]
    assert kept["model.layers.0.mlp.down_proj"] == "100 x 64, not multiples of 16" and len(kept) == 4
    assert fp8.describe(converted, kept, "tensorwise") == (
        "fp8: 4 linear layers in FP8 (tensorwise scaling), 4 in bf16: model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj "
        "(64 x 100, not multiples of 16); model.layers.0.mlp.down_proj (100 x 64, not multiples of 16); lm_head (the output layer)")


def test_a_rank_without_fp8_matmuls_refuses_in_one_line():
    net, _ = tiny_model()
    with pytest.raises(ConfigError) as e:
        fp8.convert(net, "rowwise", torch.device("cpu"))
    assert str(e.value) == ("precision.fp8=rowwise: this rank runs on cpu, and FP8 matmuls need an NVIDIA GPU of compute capability "
                            "8.9 or newer (L4, RTX 4090, H100, H200, B200): use precision=bf16")
    assert not any(type(m).__name__ == "Float8Linear" for m in net.modules())


@pytest.mark.parametrize("overrides,message", [
    (["train.device=cpu"], "precision=fp8 (precision.fp8=tensorwise) with train.device=cpu: FP8 matmuls need an NVIDIA GPU of "
                           "compute capability 8.9 or newer (L4, RTX 4090, H100, H200, B200): use precision=bf16 on CPU"),
    (["zero=stage2"], "precision=fp8 (precision.fp8=tensorwise) with zero.stage=2: DeepSpeed's engine casts the model and runs its "
                      "own precision; use precision=fp8 with full fine-tuning on parallelism=single, ddp or fsdp, or precision=bf16"),
    (["peft=lora"], "precision=fp8 (precision.fp8=tensorwise) with peft=lora: the adapters' base layers are not converted; use "
                    "precision=fp8 with full fine-tuning on parallelism=single, ddp or fsdp, or precision=bf16"),
    (["parallelism=tp2", "launcher.nproc_per_node=2"],
     "precision=fp8 (precision.fp8=tensorwise) with parallelism.tp=2: torchao's float8 tensor-parallel styles are not wired into "
     "the layouts; use precision=fp8 with full fine-tuning on parallelism=single, ddp or fsdp, or precision=bf16"),
])
def test_refusals(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(["precision=fp8", *overrides])
    assert str(e.value) == message


def test_precision_fp8_is_bf16_with_fp8_and_only_there(compose):
    cfg = compose(["precision=fp8", "precision.fp8=rowwise"])
    assert (cfg.precision.name.value, cfg.precision.fp8.value) == ("bf16", "rowwise")
    with pytest.raises(ConfigError, match=r"^precision.fp8=tensorwise has no effect with precision=fp16 \(only with bf16\)"):
        compose(["precision=fp16", "precision.fp8=tensorwise"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_real_launch_without_a_gpu_is_refused_before_any_rank(tmp_path):
    out = run_cli("+recipe=quickstart_sft", "precision=fp8", "train.max_steps=2", "optim.warmup_steps=0", f"hydra.run.dir={tmp_path}",
                  cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    assert last_line(out.stderr).startswith("error: precision=fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (FP8 "
                                            "matmuls), but this machine has no NVIDIA GPU")
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.gpu
@fp8_gpu
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_follows_the_bf16_loss_curve(tmp_path, scaling):
    """200 steps of the quickstart on one GPU in bf16 and in FP8 from the same initial weights and batches: the mean loss
    of the last 20 steps within 3% of bf16's (FP8's e4m3 keeps 3 mantissa bits against bf16's 7, and the rounding of
    each step's matmuls averages out over a run: torchao reports Llama-3 8B curves within noise of bf16's; 3% is about
    the step-to-step spread of this tiny run's loss), and the model line names the layers converted."""
    base = ["+recipe=quickstart_sft", "train.device=cuda", "parallelism=single", "launcher.nproc_per_node=1", "train.max_steps=200",
            "train.eval_every=0", "train.exact_match_samples=0", "data.eval_size=0", "data.eval=null"]
    curves = {}
    for name, extra in (("bf16", ["precision=bf16"]), ("fp8", ["precision=fp8", f"precision.fp8={scaling}"])):
        out = run_cli(*base, *extra, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path, timeout=1200)
        assert out.returncode == 0, out.stderr[-3000:]
        curves[name] = [m["loss"] for m in read_metrics(tmp_path / name) if m["kind"] == "train"]
        if name == "fp8":
            assert f"fp8: 14 linear layers in FP8 ({scaling} scaling), 1 in bf16: lm_head (the output layer)" in out.stdout
    tail = {name: sum(c[-20:]) / 20 for name, c in curves.items()}
    print(f"mean loss of steps 181-200: bf16 {tail['bf16']:.4f}, fp8 {scaling} {tail['fp8']:.4f}")
    assert tail["fp8"] == pytest.approx(tail["bf16"], rel=0.03)
    assert curves["fp8"][0] == pytest.approx(curves["bf16"][0], rel=0.02)  # the first step: the same weights and batch
