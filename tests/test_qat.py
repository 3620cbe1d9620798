"""train.qat (finetune/rank/qat.py) and its exports (finetune.export --quantize, --gguf q4_0): the layers the rule
prepares; the fake-quantized forward equal to the quantized model's and its straight-through gradient; a QAT run whose
in-run evaluation is the exported 4-bit model's, loaded by transformers (TorchAoConfig) and as GGUF Q4_0 blocks holding
torchao's very grid; resume; the refusals. The quickstart goal (QAT against post-training quantization) is test_e2e's."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("torchao")

from finetune.config import ConfigError  # noqa: E402
from finetune.rank import qat  # noqa: E402

from conftest import read_metrics, reload_and_evaluate, run_cli, tiny_model, train_here  # noqa: E402

SHORT = ["+recipe=quickstart_sft", "parallelism=single", "launcher.nproc_per_node=1", "optim.warmup_steps=0",
         "train.eval_every=0", "train.exact_match_samples=0", "train.memory_report=false"]


def ids(n: int = 3, length: int = 24) -> torch.Tensor:
    return torch.randint(3, 99, (n, length), generator=torch.Generator().manual_seed(0))


def test_every_linear_but_the_output_layer_and_sizes_the_group_does_not_divide_is_prepared():
    net, _ = tiny_model()
    quantized, kept = qat.chosen(net, 32)
    assert kept == {"lm_head": "the output layer"} and len(quantized) == 7 * net.config.num_hidden_layers
    quantized, kept = qat.chosen(net, 96)  # 128 inputs (attention, gate, up) do not split in 96s; down_proj's 384 do
    assert quantized == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert kept["model.layers.0.self_attn.q_proj"] == "input size 128, not a multiple of train.qat_group_size=96"
    assert qat.prepare(net, "int4_weight", 96) == (
        "qat: 2 linear layers fake-quantized (int4_weight, groups of 96), 13 in full precision: model.layers.0.self_attn.q_proj, "
        "model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj ... (input size 128, not a multiple of "
        "train.qat_group_size=96); lm_head (the output layer)")
    with pytest.raises(ConfigError, match=r"^train.qat=int4_weight: no linear layer of this model can be quantized in groups of 1000 "):
        qat.prepare(tiny_model()[0], "int4_weight", 1000)


@pytest.mark.parametrize("scheme", ["int4_weight", "int8_dynamic_int4_weight", "int2_weight"])
def test_the_fake_quantized_forward_is_the_quantized_models(scheme):
    """What QAT trains through is what the export computes: the prepared model's logits equal those of the same weights
    quantized by torchao (the export's quantize), and the plain model's differ from both."""
    net, _ = tiny_model()
    exported = copy.deepcopy(net)
    qat.quantize(exported, scheme, 32)
    with torch.no_grad():
        plain = net(ids()).logits
        qat.prepare(net, scheme, 32)
        fake, real = net(ids()).logits, exported(ids()).logits
    scale = real.abs().max().item()
    assert (fake - real).abs().max().item() < 1e-4 * scale
    assert (plain - real).abs().max().item() > 1e-3 * scale  # the rounding changes what runs


def test_the_gradient_passes_straight_through_the_rounding():
    """The straight-through estimator: the prepared model's weight gradients are those of a plain model whose weights
    are the rounded values (d loss / d W = d loss / d Q(W)), at every weight but each group's largest, through which the
    group's scale (largest / 7.5) passes its own gradient."""
    net, _ = tiny_model()
    rounded = copy.deepcopy(net)
    qat.dequantize(qat.quantize(rounded, "int4_weight", 32), rounded)
    rounded.requires_grad_(True)
    qat.prepare(net, "int4_weight", 32)
    batch = ids()
    for model in (net, rounded):
        model(batch, labels=batch).loss.backward()
    for name in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        got, want = net.get_parameter(name).grad, rounded.get_parameter(name).grad
        groups = net.get_parameter(name).detach().view(got.shape[0], -1, 32).abs()
        largest = (groups == groups.amax(-1, keepdim=True)).view_as(got)
        assert torch.allclose(got[~largest], want[~largest], rtol=1e-3, atol=1e-9) and got[~largest].abs().sum() > 0
        assert not torch.allclose(got[largest], want[largest], rtol=1e-3, atol=1e-9)


def test_a_qat_run_evaluates_and_exports_the_4bit_model_transformers_and_llamacpp_files_hold(tmp_path):
    """6 steps with train.qat=int4_weight: final/ holds plain full-precision weights (no torchao keys); the run's
    eval loss after training is the exported 4-bit model's, loaded by transformers' TorchAoConfig; the GGUF's Q4_0 blocks
    hold torchao's grid (each weight exactly, up to the fp16 scale) and transformers' GGUF reader gives its logits."""
    import gguf
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    summary = train_here([*SHORT, "train.max_steps=6", "train.qat=int4_weight"], run)
    with safe_open(run / "final/model.safetensors", "pt") as f:
        assert all(k.endswith(("weight", "bias")) for k in f.keys()) and "model.layers.0.mlp.down_proj.weight" in f.keys()
    out = run_cli(str(run), "--gguf", "q4_0", cwd=tmp_path, module="finetune.export")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(merged, int4_weight (torchao, groups of 32: 14 linear layers; 1 and the rest fp32), run-q4_0.gguf, README.md)" in out.stdout
    loss, exported, _, _ = reload_and_evaluate(run / "export", run)
    assert type(exported.model.layers[0].mlp.down_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert loss == pytest.approx(summary["after"]["eval_loss"], rel=1e-5)  # the fake-quantized eval is the export's
    reference = AutoModelForCausalLM.from_pretrained(run / "final")
    qat.quantize(reference, "int4_weight", 32)
    with torch.no_grad():
        want = reference(ids()).logits
        assert torch.equal(exported(ids()).logits, want)
        read = AutoModelForCausalLM.from_pretrained(run / "export", gguf_file="run-q4_0.gguf")
        assert (read(ids()).logits - want).abs().max().item() < 2e-3 * want.abs().max().item()  # f16 scales and embeddings
    tensors = {t.name: t for t in gguf.GGUFReader(run / "export/run-q4_0.gguf").tensors}
    down = tensors["blk.1.ffn_down.weight"]
    assert down.tensor_type == gguf.GGMLQuantizationType.Q4_0 and tensors["output.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    values = gguf.quants.dequantize(down.data, down.tensor_type)
    grid = reference.model.layers[1].mlp.down_proj.weight.dequantize().float().numpy()
    assert values.shape == grid.shape and abs(values - grid).max() <= 1e-3 * abs(grid).max()


def test_resume_gives_the_uninterrupted_losses(tmp_path):
    common = [*SHORT, "train.max_steps=4", "train.save_every=2", "train.qat=int8_dynamic_int4_weight", "data.eval=null"]
    train_here(common, tmp_path / "full")
    train_here([*common, f"train.resume={tmp_path / 'full/checkpoints/step_2'}"], tmp_path / "resumed")
    losses = {name: [m["loss"] for m in read_metrics(tmp_path / name) if m["kind"] == "train"] for name in ("full", "resumed")}
    assert losses["resumed"] == pytest.approx(losses["full"][2:], rel=1e-6)


def test_a_delayed_start_trains_in_full_precision_first_and_resumes_on_the_right_side(tmp_path, capsys):
    """train.qat_after_steps=2 of 4: steps 1-2 and the first evaluation are the run without QAT's to the bit; the
    evaluation after step 2 and steps 3-4 are fake-quantized (they leave that run); resumed from step 2 the quantizers are
    on again and the losses are the uninterrupted run's; and the model line says from which step."""
    common = [*SHORT, "train.max_steps=4", "train.eval_every=2", "train.save_every=2"]
    train_here(common, tmp_path / "plain")
    capsys.readouterr()
    train_here([*common, "train.qat=int4_weight", "train.qat_after_steps=2"], tmp_path / "delayed")
    assert ("qat: 14 linear layers fake-quantized (int4_weight, groups of 32), 1 in full precision: lm_head (the output layer); "
            "fake-quantized from step 3 (train.qat_after_steps=2), full precision before") in capsys.readouterr().out
    train_here([*common, "train.qat=int4_weight", "train.qat_after_steps=2", f"train.resume={tmp_path / 'delayed/checkpoints/step_2'}"],
               tmp_path / "resumed")
    runs = {name: [(m["kind"], m.get("loss", m.get("eval_loss"))) for m in read_metrics(tmp_path / name) if m["kind"] in ("train", "eval")]
            for name in ("plain", "delayed", "resumed")}
    plain, delayed = runs["plain"], runs["delayed"]
    assert [k for k, _ in delayed] == ["eval", "train", "train", "eval", "train", "train", "eval"]
    assert delayed[:3] == plain[:3]  # full precision until step 2 is done
    assert all(abs(d - p) > 1e-7 * p for (_, d), (_, p) in zip(delayed[3:], plain[3:]))  # then the quantized grid (the same
    # path would repeat the plain run's bits, as the first three do; step 4 differs by 7e-7 of the loss)
    assert [v for k, v in runs["resumed"] if k == "train"] == pytest.approx([v for k, v in delayed[4:] if k == "train"], rel=1e-6)


def test_two_fsdp2_ranks_train_the_one_process_qat_model(tmp_path):
    """The fake-quantized layers sharded by FSDP2 (each forward rounds the gathered weight): two ranks' eval loss after
    3 steps is one process's (measured alike on DDP, ZeRO-2 and the pipeline; ZeRO-3 moves by what it moves without QAT)."""
    from ranks import launch_here

    common = [*SHORT, "train.max_steps=3", "train.qat=int4_weight"]
    alone = train_here(common, tmp_path / "one")["after"]["eval_loss"]
    out = launch_here(*common, "parallelism=fsdp", "launcher.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "qat: 14 linear layers fake-quantized (int4_weight, groups of 32), 1 in full precision: lm_head (the output layer)" in out.stdout
    assert json.loads((tmp_path / "two/summary.json").read_text())["after"]["eval_loss"] == pytest.approx(alone, rel=1e-4)


@pytest.mark.parametrize("overrides,message", [
    (["train.qat_group_size=64"], "train.qat_group_size=64 has no effect without train.qat: remove it or set "
                                  "train.qat=int4_weight (or int8_dynamic_int4_weight)"),
    (["train.qat_after_steps=10"], "train.qat_after_steps=10 has no effect without train.qat: remove it or set "
                                   "train.qat=int4_weight (or int8_dynamic_int4_weight)"),
    (["train.qat=int4_weight", "train.qat_after_steps=100"],
     "train.qat_after_steps=100 with train.max_steps=100: no step would train for the quantized grid: set "
     "train.qat_after_steps below 100 (0: from the first)"),
    (["train.qat=int4_weight", "peft=qlora"], "train.qat=int4_weight with peft=qlora: its base is already quantized (bitsandbytes' "
                                              "4-bit NF4), and QAT rounds full-precision weights: train without train.qat"),
    (["train.qat=int4_weight", "parallelism=tp2", "launcher.nproc_per_node=2"],
     "train.qat=int4_weight with parallelism.tp=2: transformers' tensor-parallel plan shards the linear layers, and the fake "
     "quantizer torchao puts inside each is not a module the plan knows: train without train.qat"),
    (["train.qat=int2_weight", "+recipe=quickstart_reward"], "train.qat=int2_weight with method=reward: the 4-bit export is a causal "
                                                             "language model's, and this method trains reward's model: train without train.qat"),
])
def test_refusals(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert str(e.value) == message


@pytest.mark.parametrize("args,message", [
    (["--gguf", "q4_0"], "--gguf q4_0 holds 4-bit weights in blocks of 32: add --quantize int4_weight (post-training "
                         "quantization), or train with train.qat=int4_weight"),
    (["--quantize", "int4_weight", "--group-size", "64", "--gguf", "q4_0"],
     "--gguf q4_0 holds 4-bit weights in blocks of 32: this export's groups are 64 weights: use --group-size 32 (and train "
     "with train.qat_group_size=32)"),
    (["--group-size", "64"], "--group-size applies to --quantize (or a run trained with train.qat): add --quantize int4_weight"),
    (["--quantize", "int4_weight", "--dtype", "bf16"], "--dtype bf16 with --quantize int4_weight: the quantized layers hold int4 "
                                                       "weights and fp32 scales, the rest stays fp32: leave --dtype out"),
])
def test_export_refusals(shipped_run, args, message, tmp_path):
    out = run_cli(str(shipped_run), *args, "--out", str(tmp_path / "out"), cwd=tmp_path, module="finetune.export")
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == f"error: {message}"


@pytest.fixture(scope="module")
def shipped_run(tmp_path_factory):
    """A 2-step run without QAT (the export refusals need a run directory)."""
    run = tmp_path_factory.mktemp("plain") / "run"
    train_here([*SHORT, "train.max_steps=2"], run)
    return run


@pytest.mark.parametrize("overrides", [["train.qat=int4_weight"], ["train.qat=int4_weight", "precision=bf16"],
                                       ["train.qat=int8_dynamic_int4_weight"]], ids=["int4-fp32", "int4-bf16", "int8-dynamic"])
def test_the_plan_counts_what_the_rounding_keeps_for_backward(overrides, compose, tmp_path):
    """What the fake quantization saves for backward (rounded weights, int8_dynamic's rounded inputs) is planned: the
    peak the rank plans at its measured micro-batches within 5% of MemTracker's, and above the plan without QAT by at
    least 1.4 MiB (MemTracker: QAT adds 3.8 MiB of activations in fp32, 1.6 under bf16, 9.5 with int8 inputs)."""
    from finetune.planner.peak import plan

    train_here([*SHORT, "train.max_steps=2", "train.memory_report=categories", *overrides], tmp_path)
    records = read_metrics(tmp_path)
    planned, memory = (next(r for r in records if r["kind"] == kind) for kind in ("plan", "memory"))
    assert planned["plan_peak_mib"] == pytest.approx(memory["mem_peak_total_mib"], rel=0.05)
    with_qat, without = (plan(compose([*SHORT, *(o for o in overrides if keep(o))])) for keep in (bool, lambda o: "qat" not in o))
    assert with_qat.total - without.total > 1.4 * 2**20
