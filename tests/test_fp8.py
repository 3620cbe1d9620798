"""precision=fp8 (finetune/rank/fp8.py): the layers the rule converts and keeps, the refusals in one line (on CPU before
launch, at launch on a machine without a GPU, and on a rank whose device has no FP8 matmuls); through torch's CPU FP8
matmuls (precision.fp8_on_cpu=true) the loss curve of bf16 within a tolerance over 200 steps, and every layout it
composes with following one process's FP8 run (FSDP2's FP8 all-gather with checkpointing and its resume, tensor parallel
with LoRA, a pipeline with rowwise scales); on a GPU of compute capability 8.9+ (-m gpu) the same curves, where FP8
is fast."""

from __future__ import annotations

import pytest
import torch

from finetune.config import ConfigError
from finetune.rank import fp8

from conftest import last_line, read_metrics, run_cli, tiny_model, train_here
from ranks import launch_here

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
    sharded, kept_sharded = fp8.chosen(net, tp=8)  # a shard of each size a multiple of 16: k and v (128 x 64) stay bf16
    assert kept_sharded["model.layers.0.self_attn.k_proj"] == "128 x 64, not multiples of 128 (16 per parallelism.tp=8 shard)"
    assert len(sharded) == 5 * net.config.num_hidden_layers and len(kept_sharded) == 1 + 2 * net.config.num_hidden_layers
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
                           "compute capability 8.9 or newer (L4, RTX 4090, H100, H200, B200): use precision=bf16 on CPU (or "
                           "precision.fp8_on_cpu=true to check the recipe's numerics through torch's CPU FP8 matmuls, slower "
                           "than bf16)"),
    (["zero=stage2"], "precision=fp8 (precision.fp8=tensorwise) with zero.stage=2: DeepSpeed's engine casts the model and runs its "
                      "own precision; use precision=fp8 on the torch layouts (single, ddp, fsdp, tp, pp) with full fine-tuning, "
                      "LoRA or DoRA, or precision=bf16"),
    (["peft=qlora"], "precision=fp8 (precision.fp8=tensorwise) with peft=qlora: its base layers are bitsandbytes' 4-bit ones, not "
                     "linear layers torchao's FP8 can take; use precision=fp8 on the torch layouts (single, ddp, fsdp, tp, pp) "
                     "with full fine-tuning, LoRA or DoRA, or precision=bf16"),
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
    with pytest.raises(ConfigError, match=r"^precision.fp8_on_cpu=true has no effect with precision=fp32 \(only with bf16\)"):
        compose(["precision.fp8_on_cpu=true"])
    with pytest.raises(ConfigError) as e:
        compose(["precision=bf16", "precision.fp8_on_cpu=true"])
    assert str(e.value) == "precision.fp8_on_cpu=true has no effect without precision=fp8: remove it, or add precision=fp8"
    for layout in (["parallelism=tp2"], ["parallelism=pp2"], ["parallelism=fsdp", "peft=lora"], ["parallelism=ddp", "peft=dora"]):
        assert compose(["precision=fp8", *layout, "launcher.nproc_per_node=2"]).precision.fp8.value == "tensorwise"  # not refused


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


SHORT = ["+recipe=quickstart_sft", "train.max_steps=3", "optim.warmup_steps=0", "train.eval_every=0", "train.exact_match_samples=0",
         "data.eval_size=0", "data.eval=null", "train.tensorboard=false"]
ON_CPU = ["precision=fp8", "precision.fp8_on_cpu=true"]
ONE = ["parallelism=single", "launcher.nproc_per_node=1"]


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if m["kind"] == "train"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, list[float]]:
    """3 steps of the quickstart on one CPU rank (in this process): bf16, and FP8 through torch's CPU FP8 matmuls with
    tensorwise scales (full fine-tuning, LoRA) and rowwise ones; each run's losses."""
    tmp = tmp_path_factory.mktemp("fp8_one")
    runs = {"bf16": ["precision=bf16"], "tensorwise": ON_CPU, "lora": [*ON_CPU, "peft=lora"], "rowwise": [*ON_CPU, "precision.fp8=rowwise"]}
    for name, extra in runs.items():
        train_here([*SHORT, *ONE, *extra], tmp / name)
    return {name: losses(tmp / name) for name in runs}


def test_on_cpu_every_converted_matmul_is_rounded_to_fp8(one_process):
    """The first step's loss (the same initial weights and batch) moves from bf16's by FP8's rounding, 4e-4 of it
    measured, 30x what the layouts below move it by, and differently for rowwise scales: the layers really run in FP8."""
    bf16, tensorwise, rowwise = (one_process[k][0] for k in ("bf16", "tensorwise", "rowwise"))
    assert abs(tensorwise - bf16) > 2e-4 * bf16 and abs(rowwise - bf16) > 2e-4 * bf16 and abs(rowwise - tensorwise) > 2e-4 * bf16
    assert one_process["lora"][0] == tensorwise  # LoRA's adapters start at zero: the same FP8 base
    assert one_process["lora"][1:] != pytest.approx(one_process["tensorwise"][1:], rel=1e-2)  # and only the adapters train


@pytest.mark.parametrize("name,layout,reference,within", [
    ("fsdp-full-checkpointing", ["parallelism=fsdp", "checkpointing=full", "train.save_every=2"], "tensorwise", 5e-4),
    ("tp2-lora", ["parallelism=tp2", "peft=lora"], "lora", 5e-4),
    ("pp2-rowwise", ["parallelism=pp2", "precision.fp8=rowwise"], "rowwise", 5e-4),
])
def test_on_cpu_fp8_layouts_follow_one_process(one_process, tmp_path, name, layout, reference, within):
    """Two ranks (2 CPU processes, gloo) in FP8 follow one process's FP8 run: FSDP2 (its FP8 all-gather of the weights,
    the rest gathered and computed in bf16 by its mixed-precision policy where one process autocasts over fp32 weights)
    with full checkpointing, and resumed from its step-2 checkpoint to the same step 3; tensor parallel's DTensor shards
    under LoRA and a 2-stage pipeline with rowwise scales: within 5e-4 (measured 1.2e-4, 1.7e-4 and 6e-5: bf16's
    residual stream, and the shards' partial sums rounded to bf16 before they are added), their first step within
    1.5e-4 where FP8's own rounding moves it by 4e-4 from bf16's."""
    out = launch_here(*SHORT, *ON_CPU, "launcher.nproc_per_node=2", *layout, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    said = "FSDP2 all-gathers their weights in FP8; " if name.startswith("fsdp") else ""
    scaling = "rowwise" if reference == "rowwise" else "tensorwise"
    assert (f"fp8: 14 linear layers in FP8 ({scaling} scaling; {said}on CPU: torch's CPU FP8 matmuls, slower than bf16), 1 in bf16: "
            "lm_head (the output layer)") in out.stdout
    got, want = losses(tmp_path / "run"), one_process[reference]
    assert got[0] == pytest.approx(want[0], rel=min(within, 1.5e-4)) and got == pytest.approx(want, rel=within), (got, want)
    assert abs(got[0] - want[0]) < abs(one_process["bf16"][0] - want[0]) / 3
    if name.startswith("fsdp"):
        resumed = launch_here(*SHORT, *ON_CPU, "launcher.nproc_per_node=2", *layout, f"hydra.run.dir={tmp_path / 'resumed'}",
                              f"train.resume={tmp_path / 'run/checkpoints/step_2'}", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert losses(tmp_path / "resumed") == pytest.approx(got[2:], rel=1e-6)
        from safetensors.torch import load_file

        whole, again = (load_file(tmp_path / d / "final/model.safetensors") for d in ("run", "resumed"))
        assert whole.keys() == again.keys() and all(torch.equal(whole[k], again[k]) for k in whole)
        assert not any("float8" in k or "scale" in k for k in whole)  # plain weights: the export is bf16's


def test_on_cpu_fp8_follows_the_bf16_loss_curve(tmp_path):
    """test_fp8_follows_the_bf16_loss_curve's 200 steps on one CPU rank through torch's CPU FP8 matmuls (the casts and
    scales of a GPU's, accumulated by the CPU): measured, the mean loss of steps 181-200 2.1328 in bf16 and 2.1146 in
    FP8 (tensorwise), 0.9% apart, within the GPU test's 3%."""
    base = ["+recipe=quickstart_sft", *ONE, "train.max_steps=200", "train.eval_every=0", "train.exact_match_samples=0",
            "data.eval_size=0", "data.eval=null", "train.tensorboard=false"]
    curves = {}
    for name, extra in (("bf16", ["precision=bf16"]), ("fp8", ON_CPU)):
        train_here([*base, *extra], tmp_path / name)
        curves[name] = losses(tmp_path / name)
    tail = {name: sum(c[-20:]) / 20 for name, c in curves.items()}
    print(f"mean loss of steps 181-200 on CPU: bf16 {tail['bf16']:.4f}, fp8 tensorwise {tail['fp8']:.4f}")
    assert tail["fp8"] == pytest.approx(tail["bf16"], rel=0.03) and tail["fp8"] < curves["fp8"][0] / 2
    assert curves["fp8"] != curves["bf16"]


@pytest.mark.parametrize("layout", [["parallelism=ddp"], ["parallelism=fsdp"]])
def test_the_planner_counts_fp8_as_bf16_and_says_what_it_leaves_out(compose, layout):
    """FP8 keeps bf16's weights, gradients, optimizer states and saved inputs (torchao's float8 layers save their bf16
    inputs): the plan is bf16's to the byte, and its note says so, and under FSDP2 that the FP8 all-gather's halving of
    a gathered block is not subtracted (an upper bound)."""
    from finetune.planner.peak import plan

    common = ["+recipe=quickstart_sft", *layout, "launcher.nproc_per_node=2"]
    fp8_plan, bf16_plan = plan(compose([*common, *ON_CPU])), plan(compose([*common, "precision=bf16"]))
    for term in ("weights", "gradients", "optimizer", "activations", "logits", "backward"):
        assert getattr(fp8_plan, term) == getattr(bf16_plan, term), term
    note = next(n for n in fp8_plan.notes if n.startswith("precision=fp8"))
    assert note.startswith("precision=fp8: weights, gradients and optimizer states as precision=bf16's (torchao keeps the weights "
                           "in their dtype), and activations too (its float8 layers save their bf16 inputs for the backward)")
    assert note.endswith("; FSDP2 gathers a block's converted weights in FP8 (1 byte each), counted as bf16's: an upper bound") == (
        layout == ["parallelism=fsdp"])
