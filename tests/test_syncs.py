"""A step without host syncs (finetune/rank/syncs.py): the ops that read a device value back on the host, counted by a
dispatch mode in every training step (train.count_host_reads -> the `host_reads` metric), are none per micro-batch on
the default padding-free path, whatever the number of micro-batches, the method or the layout; a non-finite step is
skipped inside the fused optimizer without a read; the loop's one read per step carries the step's numbers."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.data import host
from finetune.rank import syncs
from finetune.rank.engine.common import clip, skip_unless_finite

from conftest import read_metrics, train_here
from ranks import launch_here

STEPS = ["+recipe=quickstart_sft", "train.max_steps=2", "optim.warmup_steps=0", "train.count_host_reads=true", "train.eval_every=0",
         "data.eval_size=8", "train.exact_match_samples=0"]
ONE = [*STEPS, "parallelism=single", "launcher.nproc_per_node=1"]


def _reads(run_dir) -> list[tuple[int, float]]:
    return [(r["host_reads"], r["loss"]) for r in read_metrics(run_dir) if r.get("kind") == "train"]


def test_the_counter_sees_the_reads_a_gpu_would_wait_for():
    t = torch.arange(6.0)
    with syncs.HostReads() as reads:
        float(t.sum()), bool(t[0]), t[t > 2], t.nonzero(), t.tolist()
        with host.on_host():
            t.tolist()  # host work on a host copy: not counted
    assert reads.by_op == {"aten._local_scalar_dense": 2, "aten.index": 1, "aten.nonzero": 1, "Tensor.tolist": 1}
    moved = host.to_device({"x": t}, torch.device("cpu"))["x"]
    with syncs.HostReads() as reads:
        assert host.host_copy(moved, "twin") is t
        host.host_copy(t + 1, "derived")  # made on the device: read back from it
    assert reads.by_op == {"derived": 1}


def test_padding_free_steps_read_nothing_back_per_micro_batch(tmp_path):
    """1 micro-batch and 4 per step: no read inside the step either way (the loss sums on the device, the norm clips as
    a tensor, fused AdamW skips a non-finite step by itself); padded micro-batches keep transformers' own two reads
    per forward (sdpa's mask: whether the padding mask is all ones)."""
    one = train_here([*ONE, "train.micro_batch_size=32", "train.global_batch_size=32"], tmp_path / "one")
    four = train_here([*ONE, "train.micro_batch_size=8", "train.global_batch_size=32"], tmp_path / "four")
    padded = train_here([*ONE, "train.micro_batch_size=8", "train.global_batch_size=32", "data.padding_free=false"],
                        tmp_path / "padded")
    assert [r for r, _ in _reads(tmp_path / "one")] == [0, 0] and [r for r, _ in _reads(tmp_path / "four")] == [0, 0]
    assert [r for r, _ in _reads(tmp_path / "padded")] == [8, 8]  # 4 micro-batches x transformers' 2
    for a, b in zip(_reads(tmp_path / "one"), _reads(tmp_path / "four")):  # the same global batch, summed on the device
        assert a[1] == pytest.approx(b[1], rel=1e-5)
    assert one and four and padded


def test_dpo_and_fsdp2_steps_read_nothing_back(tmp_path):
    """DPO's per-sample sums of a padding-free pair batch (their count from the host copy) with its live reference, and
    FSDP2 on 2 ranks (DTensor gradients, the norm over shards, fused AdamW's skip over DTensors): no read in the step."""
    train_here([*ONE, "method=dpo", "data=quickstart_dpo", "method.reference=live", "train.micro_batch_size=4",
                "train.global_batch_size=8"], tmp_path / "dpo")
    assert [r for r, _ in _reads(tmp_path / "dpo")] == [0, 0]
    out = launch_here(*STEPS, "parallelism=fsdp", "launcher.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'fsdp'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    reads = _reads(tmp_path / "fsdp")
    assert [r for r, _ in reads] == [0, 0] and all(math.isfinite(loss) for _, loss in reads)


def test_a_non_finite_step_is_skipped_on_the_device():
    """fused AdamW told found_inf: weights, moments and step count as they were; nothing read. A finite step applies."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.tensor([1.0, float("inf"), 1.0, 1.0])
    with syncs.HostReads() as reads:
        norm = clip([p], 1.0)
        applied = skip_unless_finite(opt, norm)
    assert reads.count == 0 and not bool(applied) and torch.equal(p.detach(), torch.ones(4))
    assert float(opt.state[p]["step"]) == 0 if opt.state[p] else True
    p.grad = torch.full((4,), 2.0)
    norm = clip([p], 1.0)  # 4.0, clipped to 1: each gradient 0.5
    assert float(norm) == pytest.approx(4.0) and torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-6)
    assert bool(skip_unless_finite(opt, norm)) and float(opt.state[p]["step"]) == 1 and p.detach().lt(1).all()
