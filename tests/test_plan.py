"""The memory planner (finetune/plan.py): MEMORY.md's formulas, DeepSpeed's estimators, speed, the CLI."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import REPO, last_line, run_cli
from finetune.plan import architecture, model_state_bytes_per_param, plan, zero_states

LLAMA2_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False}
LLAMA2_70B_PARAMS = 68_976_648_192  # the published count of Llama-2-70B


@pytest.fixture
def llama70b(tmp_path: Path) -> Path:
    """A local model directory holding only a Llama-2-70B-shaped config.json."""
    (tmp_path / "l70b").mkdir()
    (tmp_path / "l70b" / "config.json").write_text(json.dumps(LLAMA2_70B))
    return tmp_path / "l70b"


def ds(llama70b: Path, *extra: str, ranks: int = 4) -> list[str]:
    """A DeepSpeed bf16 run of the 70B shape on `ranks` GPUs of one node."""
    return ["model=pretrained", f"model.path={llama70b}", "precision=bf16", "parallelism=ddp", f"launcher.nproc_per_node={ranks}",
            "train.micro_batch_size=1", f"train.global_batch_size={ranks}", "hardware=h100_80g", *extra]


def states(pl) -> float:
    return pl.weights + pl.gradients + pl.optimizer


@pytest.mark.parametrize("optimizer,precision,expected", [
    ("sgd", "fp32", (4, 4, 0)),
    ("momentum", "fp32", (4, 4, 4)),
    ("adam", "fp32", (4, 4, 8)),
    ("adamw", "fp32", (4, 4, 8)),
    ("adam", "bf16", (2, 2, 12)),
    ("adamw", "fp16", (2, 2, 12)),
])
def test_model_state_bytes_match_memory_table(optimizer, precision, expected):
    assert model_state_bytes_per_param(optimizer, precision) == expected


def test_zero_formulas():
    P, N = 7e9, 8
    assert sum(zero_states(0, P, N)) == 16 * P
    assert sum(zero_states(1, P, N)) == pytest.approx(2 * P + 2 * P + 12 * P / N)
    assert sum(zero_states(2, P, N)) == pytest.approx(2 * P + 14 * P / N)
    assert sum(zero_states(3, P, N)) == pytest.approx(16 * P / N)


def test_planner_zero_stages_follow_the_paper_and_order(compose, llama70b):
    P, N = LLAMA2_70B_PARAMS, 4
    largest = architecture(compose(ds(llama70b)).model).largest_layer_params
    got = {z: plan(compose(ds(llama70b, f"zero={z}"))) for z in ("stage0", "stage1", "stage2", "stage2_offload", "stage3", "stage3_offload")}
    assert states(got["stage0"]) == pytest.approx(16 * P)
    assert states(got["stage1"]) == pytest.approx(4 * P + 12 * P / N)
    assert states(got["stage2"]) == pytest.approx(2 * P + 14 * P / N)
    assert states(got["stage3"]) == pytest.approx(16 * P / N + 4 * largest)  # + the largest module gathered (16-bit w + g)
    assert states(got["stage2_offload"]) == pytest.approx(2 * P)  # 12P/N + fp32 gradient copy 4P/N moved to CPU
    assert got["stage2_offload"].cpu_bytes == pytest.approx(16 * P)  # per node: N ranks x 16P/N
    assert states(got["stage3_offload"]) == pytest.approx(4 * largest)
    assert got["stage3_offload"].cpu_bytes == pytest.approx(18 * P)  # + the 16-bit weights
    # MEMORY.md's order, most to least per GPU, needs 16P/N < 2P (stage3 below stage2+offload): N > 8
    order = [states(plan(compose(ds(llama70b, f"zero={z}", ranks=16))))
             for z in ("stage1", "stage2", "stage2_offload", "stage3", "stage3_offload")]
    assert order == sorted(order, reverse=True)
    assert states(got["stage3"]) > states(got["stage2_offload"])  # on 4 ranks stage 3 holds more than 2P


def test_agrees_with_deepspeed_estimators(compose, llama70b):
    """DeepSpeed's estimators count an fp32 gradient copy on the GPU without offload (stage 2:
    2P + 18P/N = ours + 4P/N; stage 3: 18P/N + 4*largest = ours + 2P/N, since they leave out the
    16-bit weight shard) and a 1.5x CPU buffer factor on the offloaded states (identical otherwise)."""
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    P, N = LLAMA2_70B_PARAMS, 4
    largest = architecture(compose(ds(llama70b)).model).largest_layer_params

    cpu, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=N, cpu_offload=False)
    assert gpu == pytest.approx(states(plan(compose(ds(llama70b, "zero=stage2")))) + 4 * P / N)
    cpu, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=N, cpu_offload=True)
    pl = plan(compose(ds(llama70b, "zero=stage2_offload")))
    assert gpu == pytest.approx(states(pl)) and cpu == pytest.approx(1.5 * pl.cpu_bytes)  # N <= 4: max(4N, 16) = 16

    cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(P, largest, num_gpus_per_node=N, cpu_offload=False)
    assert gpu == pytest.approx(states(plan(compose(ds(llama70b, "zero=stage3")))) + 2 * P / N)
    cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(P, largest, num_gpus_per_node=N, cpu_offload=True,
                                                               cpu_offload_params=False)
    pl = plan(compose(ds(llama70b, "zero=stage3", "zero.offload_optimizer=cpu")))
    assert gpu == pytest.approx(states(pl)) and cpu == pytest.approx(1.5 * pl.cpu_bytes)
    cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(P, largest, num_gpus_per_node=N)
    pl = plan(compose(ds(llama70b, "zero=stage3_offload")))
    assert gpu == pytest.approx(states(pl)) and cpu == pytest.approx(1.5 * pl.cpu_bytes)


def test_70b_tp8_pp16_is_fast_and_sane(compose, llama70b):
    """The Llama-2 70B layout on 1024 GPUs. tp/pp run on our torch (mesh) engine, which keeps fp32
    weights (ZeRO's 16-bit weights are DeepSpeed-only and refused with tp/pp), so a rank holds
    4 * P / (8 x 16) bytes of weights: ~2.0 GiB, not the 70e9 * 2 / 128 of a 16-bit layout."""
    cfg = compose(["model=pretrained", f"model.path={llama70b}", "parallelism=tp8_pp16", "precision=bf16",
                   "launcher.nproc_per_node=8", "launcher.nnodes=128", "train.micro_batch_size=1",
                   "train.global_batch_size=1024", "data.max_length=4096", "hardware=h100_80g"])
    start = time.perf_counter()
    pl = plan(cfg)
    took = time.perf_counter() - start
    print(f"plan() of Llama-2-70B tp8_pp16 on 1024 ranks: {took * 1e3:.2f} ms")
    assert took < 1.0
    assert pl.params == LLAMA2_70B_PARAMS
    assert pl.weights == pytest.approx(4 * LLAMA2_70B_PARAMS / 128)
    assert pl.weights == pytest.approx(70e9 * 4 / 128, rel=0.02)
    assert pl.gradients == pl.weights and pl.optimizer == 2 * pl.weights  # no DDP buckets under tp/pp
    assert pl.activations > 0 and pl.fits


def test_activation_levers(compose):
    base = ["hardware=h100_80g", "precision=bf16", "train.micro_batch_size=4", "train.global_batch_size=32", "model.init.num_hidden_layers=8"]
    act = lambda *extra: plan(compose([*base, *extra])).activations  # noqa: E731
    assert act("model.attn_implementation=flash_attention_2") < act("model.attn_implementation=eager")  # the s^2 term gone
    assert act("model.attn_implementation=flash_attention_2") == act()  # sdpa's fused kernels do not keep it either
    assert act("checkpointing=full") < act("checkpointing=selective") < act()
    assert act("checkpointing=offload") < act()
    assert act("train.micro_batch_size=2", "train.global_batch_size=32") == pytest.approx(act() / 2)
    fp32 = plan(compose([b for b in base if b != "precision=bf16"]))
    bf16 = plan(compose(base))
    assert fp32.activations == pytest.approx(2 * bf16.activations)
    assert states(fp32) == states(bf16)  # torch engine: fp32 states in every precision


def test_peft_and_dpo(compose, llama70b):
    common = ["model=pretrained", f"model.path={llama70b}", "precision=bf16", "hardware=h100_80g", "train.micro_batch_size=1",
              "train.global_batch_size=8"]
    full = plan(compose(common))
    lora = plan(compose([*common, "peft=lora", "peft.r=16"]))
    arch = architecture(compose(common).model)
    per_layer = sum(16 * (i + o) for i, o in arch.linear_shapes().values())
    assert lora.trainable == per_layer * arch.num_hidden_layers
    assert lora.gradients == 4 * lora.trainable and lora.optimizer == 8 * lora.trainable
    assert lora.weights == pytest.approx(4 * (LLAMA2_70B_PARAMS + lora.trainable))
    qlora = plan(compose([*common, "peft=qlora"]))
    assert 0.5 * LLAMA2_70B_PARAMS < qlora.weights < 0.7 * LLAMA2_70B_PARAMS  # 4-bit blocks + constants + fp32 embed/head
    assert qlora.total < lora.total < full.total

    dpo = ["data=quickstart_dpo", "method=dpo", "hardware=h100_80g", "train.micro_batch_size=4", "train.global_batch_size=32"]
    sft = plan(compose(["hardware=h100_80g", "train.micro_batch_size=4", "train.global_batch_size=32"]))
    pre = plan(compose(dpo))
    live = plan(compose([*dpo, "method.reference=live"]))
    assert pre.activations == pytest.approx(2 * sft.activations) and pre.weights == sft.weights
    assert live.weights == pytest.approx(2 * sft.weights)


def test_cli_fits_and_does_not_fit(tmp_path, llama70b):
    start = time.perf_counter()
    ok = run_cli("+recipe=quickstart_sft", "hardware=cpu", cwd=REPO, module="finetune.plan", timeout=60)
    print(f"python -m finetune.plan (tiny): {time.perf_counter() - start:.2f} s")
    assert ok.returncode == 0, ok.stderr
    assert "GiB (2^30 bytes)" in ok.stdout and last_line(ok.stdout).startswith("FITS (headroom ")
    big = run_cli("model=pretrained", f"model.path={llama70b}", "precision=bf16", "hardware=l4_24g", cwd=REPO,
                  module="finetune.plan", timeout=60)
    assert big.returncode == 1, big.stderr
    assert last_line(big.stdout).startswith("DOES NOT FIT (short by ")
    bad = run_cli("+recipe=quickstart_sft", "hardware.gpu_memory_gb=80", cwd=REPO, module="finetune.plan", timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert last_line(bad.stderr).startswith("error: unknown key 'hardware.gpu_memory_gb'")
    missing = run_cli("model=pretrained", f"model.path={tmp_path / 'nowhere'}", cwd=REPO, module="finetune.plan", timeout=60)
    assert missing.returncode == 2 and "config.json" in last_line(missing.stderr)
