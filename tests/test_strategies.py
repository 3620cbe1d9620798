"""Single-device memory strategies: each runs and learns, and each shows its effect in measured
memory (MemTracker on CPU). Runs the rank code in-process (one CPU rank) for speed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.rank import model
from finetune.config import ASSETS, ConfigError, DataConfig, OptimConfig, Precision, PrecisionConfig, Scheduler, Strategy
from finetune.data.batches import collate
from finetune.data.pack import pack
from finetune.data.sources import load_rows
from finetune.data.examples import tokenize
from finetune.rank.dist import Dist
from finetune.rank.engine.torch_engine import TorchEngine
from finetune.methods.sft import SFT

from conftest import REPO, read_metrics, run_cli, tiny_model, train_here
from ranks import launch_here

FEW = ["train.max_steps=6", "optim.lr=3e-3", "train.eval_every=0"]


def train_losses(run_dir):
    return [m["loss"] for m in read_metrics(run_dir) if m["kind"] == "train"]


def memory(run_dir):
    return next(m for m in read_metrics(run_dir) if m["kind"] == "memory")


@pytest.mark.parametrize("option", [
    "precision=bf16", "precision=fp16", "checkpointing=full", "checkpointing=selective", "checkpointing=offload",
    "model.attn_implementation=eager", "model.attn_implementation=auto", "data.packing=true",
    "peft=lora", "peft=dora", "peft=qlora",
])
def test_each_option_runs_and_the_loss_goes_down(option, tmp_path):
    summary = train_here([*FEW, option], tmp_path / "run")
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"]


def test_an_evaluation_does_not_change_how_qlora_trains(tmp_path):
    """bitsandbytes repacks a 4-bit weight in place for its CPU inference kernel at the first forward without
    gradients (on CPUs with AVX512-BF16, such as these machines), and the gradients after it were other ones
    (the tiny Llama's loss fell 0.05 instead of 0.17 in the step after the first evaluation). model.keep_4bit_layout
    keeps the layout the weights were quantized in: the gradients after an evaluation are exactly those before it."""
    from finetune.config import CheckpointingConfig, ModelConfig, ModelInit, PeftConfig, PeftMethod

    cfg, peft = ModelConfig(tokenizer=str(ASSETS / "tokenizer"), init=ModelInit()), PeftConfig(name=PeftMethod.qlora, dropout=0.0)
    tok = model.load_tokenizer(cfg)
    net = model.load_model(cfg, tok, attention="sdpa", peft=peft, compute_dtype=torch.float32, zero3=False, run_dir=tmp_path,
                           is_main=True, barrier=lambda: None)
    net = model.apply_strategies(net, checkpointing=CheckpointingConfig(), peft=peft)
    ids = torch.randint(0, len(tok), (2, 24), generator=torch.Generator().manual_seed(0))

    def gradients():
        net.train()
        net(input_ids=ids, labels=ids).loss.backward()
        out = {n: q.grad.clone() for n, q in net.named_parameters() if q.grad is not None}
        net.zero_grad()
        return out

    before = gradients()
    net.eval()
    with torch.no_grad():
        net(input_ids=ids)
    after = gradients()
    assert before.keys() == after.keys() and len(before) == 28  # the adapters of 2 blocks x 7 linears
    assert all(torch.equal(before[n], after[n]) for n in before)


def long_data(tmp_path, rows=64):
    """Responses of ~200 characters (one token each): activations dominate memory."""
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"instruction": "repeat", "output": "abcdefghij" * 20 + str(i)}) + "\n" for i in range(rows)))
    return ["data=jsonl", f"data.train={path}", "data.max_length=256", "train.micro_batch_size=8", "train.global_batch_size=8",
            "model.init.num_hidden_layers=4", "train.max_steps=2", "optim.lr=1e-3"]


def test_full_checkpointing_halves_activation_memory(tmp_path):
    base = [*long_data(tmp_path), "train.memory_report=categories"]
    train_here(base, tmp_path / "none")
    train_here([*base, "checkpointing=full"], tmp_path / "full")
    train_here([*base, "checkpointing=selective", "checkpointing.every=2"], tmp_path / "selective")
    none, full, sel = memory(tmp_path / "none"), memory(tmp_path / "full"), memory(tmp_path / "selective")
    print(f"activations MiB: none {none['mem_activations_mib']:.1f}, selective {sel['mem_activations_mib']:.1f}, full {full['mem_activations_mib']:.1f}")
    assert full["mem_activations_mib"] <= 0.5 * none["mem_activations_mib"]
    assert full["mem_activations_mib"] < sel["mem_activations_mib"] < none["mem_activations_mib"]
    assert full["mem_params_mib"] == pytest.approx(none["mem_params_mib"])  # the weights do not change


def test_lora_cuts_gradient_and_optimizer_memory_and_qlora_cuts_weights(tmp_path):
    wide = ["model.init.hidden_size=256", "model.init.intermediate_size=768", "train.max_steps=2", "train.memory_report=categories"]
    train_here(wide, tmp_path / "full")
    train_here([*wide, "peft=lora", "peft.r=4"], tmp_path / "lora")
    train_here([*wide, "peft=qlora", "peft.r=4"], tmp_path / "qlora")
    full, lora, qlora = memory(tmp_path / "full"), memory(tmp_path / "lora"), memory(tmp_path / "qlora")
    states = lambda m: m["mem_grads_mib"] + m["mem_optimizer_mib"]  # noqa: E731
    print(f"grads+optimizer MiB: full {states(full):.2f}, lora {states(lora):.3f}; params MiB: lora {lora['mem_params_mib']:.2f}, qlora {qlora['mem_params_mib']:.2f}")
    assert states(lora) <= 0.1 * states(full)
    assert qlora["mem_params_mib"] < 0.5 * lora["mem_params_mib"]


def test_packing_fills_rows_and_keeps_the_loss(tmp_path):
    tok = AutoTokenizer.from_pretrained(ASSETS / "tokenizer")
    cfg = DataConfig(train=str(ASSETS / "data/quickstart/train.jsonl"), max_length=64)
    examples, _ = tokenize(load_rows(cfg.train, "train", "data.train"), tok, cfg, "data.train")
    packed = pack(examples, 64, seed=0)
    fraction = lambda rows: sum(len(e.input_ids) for e in rows) / (64 * len(rows))  # noqa: E731
    print(f"non-pad fraction of 64-token rows: packed {fraction(packed):.3f}")
    assert fraction(packed) > 0.9
    assert sorted(t for e in packed for t in e.labels) == sorted(t for e in examples for t in e.labels)

    # The same samples give the same loss packed or not: no sample attends to another.
    subset = examples[:40]
    rows = pack(subset, 64, seed=1)
    net, _ = tiny_model()
    sft = SFT()
    with torch.no_grad():
        plain = sum(sft(net, collate(subset[i : i + 8], tok.pad_token_id))[0].item() for i in range(0, 40, 8))
        batch = collate(rows, tok.pad_token_id)
        assert "attention_mask" not in batch and batch["position_ids"][0, 0] == 0
        packed_loss = sft(net, batch)[0].item()
        assert sft.count(batch) == sum(sft.count(collate([e], tok.pad_token_id)) for e in subset)
    assert packed_loss == pytest.approx(plain, rel=1e-5)

    train_here(["train.max_steps=2", "data.packing=true"], tmp_path / "packed")
    train_here(["train.max_steps=2", "data.padding_free=false"], tmp_path / "plain")
    train_here(["train.max_steps=2"], tmp_path / "free")  # padding-free micro-batches, the default: no padding at all
    p, u, f = (next(m for m in read_metrics(tmp_path / d) if m["kind"] == "train")["nonpad_fraction"] for d in ("packed", "plain", "free"))
    print(f"non-pad fraction per batch: packed {p:.3f}, unpacked {u:.3f}, padding-free {f:.3f}")
    assert p > 0.9 > u and f == 1.0


class _Overflow(SFT):
    """SFT whose loss is infinite on chosen calls: an injected fp16 overflow."""

    def __init__(self, bad_calls):
        super().__init__()
        self.calls, self.bad = 0, bad_calls

    def __call__(self, net, batch):
        self.calls += 1
        loss, metrics = super().__call__(net, batch)
        return (loss * float("inf") if self.calls in self.bad else loss), metrics


def test_fp16_scaler_skips_an_overflowing_step_and_recovers():
    net, tok = tiny_model(torch.float16)
    engine = TorchEngine(net, optim=OptimConfig(lr=1e-3, scheduler=Scheduler.constant), precision=PrecisionConfig(name=Precision.fp16),
                         max_steps=10, strategy=Strategy.single, dist=Dist(0, 0, 1, torch.device("cpu")))
    examples, _ = tokenize(load_rows(str(ASSETS / "data/quickstart/eval.jsonl"), "train", "d"), tok,
                                DataConfig(train="x", max_length=64), "d")
    batch = collate(examples[:8], tok.pad_token_id)
    objective = _Overflow(bad_calls={2})
    weights = lambda: torch.cat([p.detach().flatten().clone() for p in net.parameters()])  # noqa: E731

    first = engine.train_step([batch], objective, objective.count(batch))
    assert first.skipped == 0 and first.loss_scale == 2.0**16
    before = weights()
    second = engine.train_step([batch], objective, objective.count(batch))  # overflow: skipped
    assert second.skipped == 1 and second.loss_scale == 2.0**15
    assert torch.equal(weights(), before)  # the step did not touch the weights
    third = engine.train_step([batch], objective, objective.count(batch))  # recovers
    assert third.skipped == 1 and third.loss_scale == 2.0**15
    assert not torch.equal(weights(), before) and math.isfinite(third.loss_sum)


def test_lora_adapter_save_merge_reload_gives_the_same_outputs(tmp_path):
    train_here(["train.max_steps=3", "peft=lora", "peft.r=4", "optim.lr=1e-2"], tmp_path / "run")
    final = tmp_path / "run/final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()  # an adapter, not a copy of the base
    out = subprocess.run([sys.executable, str(REPO / "scripts/merge_adapter.py"), str(final), str(tmp_path / "merged")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"])
    adapted = PeftModel.from_pretrained(base, final).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.tensor([[1, 5, 20, 30, 40, 6]])
    with torch.no_grad():
        a, m = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert torch.allclose(a, m, atol=1e-4)
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "run/base").eval()
    with torch.no_grad():
        assert not torch.allclose(fresh(input_ids=ids).logits, m, atol=1e-4)  # the adapter did change the model


def test_flash_attention_without_cuda_names_the_alternative(compose):
    m = compose(["+recipe=quickstart_sft"]).model
    with pytest.raises(ConfigError) as e:
        model.resolve_attention(replace(m, attn_implementation=model.AttnImpl.flash_attention_2), Precision.bf16, torch.device("cpu"))
    assert str(e.value) == "model.attn_implementation=flash_attention_2 needs CUDA: use model.attn_implementation=sdpa (or auto)"
    assert model.resolve_attention(m, Precision.bf16, torch.device("cpu")) == ("sdpa", "auto: flash_attention_2 needs CUDA")


def test_flash_attention_in_fp32_is_refused(compose):
    with pytest.raises(ConfigError) as e:
        compose(["model.attn_implementation=flash_attention_2"])
    assert str(e.value) == "model.attn_implementation=flash_attention_2 runs in fp16/bf16 only: add precision=bf16 (or use sdpa)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_snapshot_on_gpu(tmp_path):
    train_here(["train.max_steps=2", "precision=bf16", "train.memory_snapshot=true", "train.device=cuda"], tmp_path / "run")
    assert (tmp_path / "run/memory_snapshot.pickle").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("combo", [
    ["parallelism=ddp", "checkpointing=full", "peft=lora", "precision=bf16"],
    ["zero=stage2", "peft=qlora", "checkpointing=selective"],
    ["zero=stage3", "peft=lora", "checkpointing=full"],
    ["zero=stage3", "peft=qlora", "precision=bf16"],  # 4-bit weights stored as bf16 so ZeRO-3 can shard them
])
def test_strategies_combine_on_two_ranks(combo, tmp_path):
    out = launch_here("+recipe=quickstart_sft", *combo, "train.max_steps=6", "optim.warmup_steps=1", "optim.lr=3e-3",
                  "train.exact_match_samples=0", "train.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert (tmp_path / "run/final/adapter_config.json").is_file()
