"""optim=muon (finetune/optimizers/muon.py): torch.optim.Muon on the hidden 2-D matrices and torch.optim.AdamW on the
rest, as one optimizer: which tensor goes where, two steps of the whole rank equal to a plain loop with torch's two
optimizers, a resume equal to the uninterrupted run, the planner's state bytes equal to what the optimizer holds, DTensor
shards orthogonalised whole (FSDP2, TP and PP follow one process; a sharded checkpoint resumes on another layout), and
the layouts it refuses in one line."""

from __future__ import annotations

import pytest
import torch

from finetune import optimizers
from finetune.config import ConfigError
from finetune.planner.peak import plan
from finetune.rank import engine
from finetune.rank.dist import Dist

from conftest import read_metrics, record_steps, replay, tiny_model, train_here
from ranks import launch_here, torchrun_json

CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
FEW = ["optim=muon", "train.max_steps=2", "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0",
       "data.eval_size=0", "data.eval=null", "train.exact_match_samples=0", "train.memory_report=false", "optim.lr=3e-3",
       "optim.weight_decay=0.01", "optim.scheduler=constant", "optim.warmup_steps=0", "optim.max_grad_norm=null"]


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(compose):
    cfg = compose(["optim=muon"])
    net, _ = tiny_model()
    opt = engine.build(cfg, net, CPU).optimizer
    names = {id(p): n for n, p in net.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]}
    assert muon == {n for n, p in net.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n}
    assert muon and all(n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj") for n in muon)
    assert adamw == set(names.values()) - muon and {"model.embed_tokens.weight", "model.norm.weight"} <= adamw
    assert [type(p).__name__ for p in opt.parts.values()] == ["Muon", "AdamW"] and cfg.optim.momentum == 0.95
    assert all(g["adjust_lr_fn"] == "match_rms_adamw" for g in opt.parts[True].param_groups)


def test_two_steps_equal_torchs_muon_and_adamw_in_a_plain_loop(tmp_path, monkeypatch):
    """The whole rank (train_here) against a plain loop over the same initial weights and micro-batches: torch's Muon
    (nesterov, momentum 0.95, match_rms_adamw) on the hidden matrices, torch's AdamW on the rest, decay on the matrices."""
    seen = record_steps(monkeypatch)
    train_here(FEW, tmp_path)
    ran = [m["loss"] for m in read_metrics(tmp_path) if m["kind"] == "train"]
    net = seen["net"].train()
    ends = {id(net.get_input_embeddings().weight), id(net.get_output_embeddings().weight)}
    hidden = [p for p in net.parameters() if p.ndim == 2 and id(p) not in ends]
    rest = [p for p in net.parameters() if not (p.ndim == 2 and id(p) not in ends)]
    muon = torch.optim.Muon(hidden, lr=3e-3, weight_decay=0.01, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": 0.01},
                               {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}], lr=3e-3)
    plain = replay(seen, lambda: (muon.step(), adamw.step()))
    assert len(ran) == 2 and ran[1] != ran[0]
    assert ran == pytest.approx(plain, rel=1e-6)


def test_a_resume_gives_the_uninterrupted_losses(tmp_path):
    """Both parts' states (Muon's momentum buffers, AdamW's moments) are one state_dict, saved and loaded: 2 steps, then
    2 more from the checkpoint, equal 4 steps."""
    common = [o for o in FEW if not o.startswith("train.max_steps")]
    train_here([*common, "train.max_steps=4"], tmp_path / "whole")
    train_here([*common, "train.max_steps=2", "train.save_every=2"], tmp_path / "first")
    train_here([*common, "train.max_steps=4", f"train.resume={tmp_path / 'first/checkpoints/step_2'}"], tmp_path / "rest")
    losses = lambda run: [m["loss"] for m in read_metrics(run) if m["kind"] == "train"]  # noqa: E731
    assert losses(tmp_path / "rest")[-2:] == pytest.approx(losses(tmp_path / "whole")[-2:], rel=1e-6)


def test_the_planner_counts_what_it_holds(compose):
    """A momentum buffer (4 bytes) per hidden-matrix element, AdamW's two moments (8) on every other: the plan's state
    equals the optimizer's state_dict after a step (its step counters aside: one 4-byte scalar per AdamW tensor)."""
    cfg = compose(["optim=muon", "launcher.nproc_per_node=1", "parallelism=single"])
    net, _ = tiny_model()
    opt = engine.build(cfg, net, CPU).optimizer
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    counters = 4 * sum(len(g["params"]) for g in opt.param_groups if not g["muon"])
    assert plan(cfg).optimizer == pytest.approx(optimizers.state_dict_bytes(opt) - counters, rel=1e-6)
    adamw = plan(compose(["optim=adamw", "launcher.nproc_per_node=1", "parallelism=single"])).optimizer
    assert plan(cfg).optimizer < 0.7 * adamw


SHARDS = """
import json, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import finetune.optimizers.muon as muon
from finetune.optimizers.muon import WholeMatrixMuon

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
cases = [((64, 96), Shard(0)), ((63, 97), Shard(0)), ((64, 96), Shard(1)), ((96, 40), Shard(1))]
starts = [torch.randn(shape) for shape, _ in cases]
grads = [[torch.randn(shape) for shape, _ in cases] for _ in range(4)]
kw = dict(lr=1e-2, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")

def run(cls):
    whole = [torch.nn.Parameter(s.clone()) for s in starts]
    shards = [torch.nn.Parameter(distribute_tensor(s.clone(), mesh, [pl])) for s, (_, pl) in zip(starts, cases)]
    a, b = torch.optim.Muon(whole, **kw), cls(shards, **kw)
    for gs in grads:
        for w, s, g in zip(whole, shards, gs):
            w.grad, s.grad = g.clone(), distribute_tensor(g.clone(), mesh, s.placements)
        a.step(); b.step()
    placed = [str(b.state[s]["momentum_buffer"].placements[0]) for s in shards]
    return [((s.full_tensor() - w).norm() / (w - s0).norm()).item() for w, s, s0 in zip(whole, shards, starts)], placed

ns, calls = muon._zeropower_via_newtonschulz, []
muon._zeropower_via_newtonschulz = lambda g, *a: (calls.append(list(g.shape)), ns(g, *a))[1]
ours, placed = run(WholeMatrixMuon)
muon._zeropower_via_newtonschulz = ns
each = [None, None]
dist.all_gather_object(each, calls)
theirs, _ = run(torch.optim.Muon)
if dist.get_rank() == 0:
    print(json.dumps({"whole": ours, "torch_on_shards": theirs, "placed": placed, "calls": each}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.cores(2)
def test_shards_are_orthogonalised_whole(tmp_path):
    """Over DTensor shards (rows or columns, even or not, wide or tall) WholeMatrixMuon steps bit for bit as torch's Muon
    over the whole matrices (the same gathered update, the same Newton-Schulz), each rank orthogonalising every other
    matrix and receiving the rest, its momentum buffers placed like the weights;
    torch's Muon given the shards runs Newton-Schulz through DTensor's sharded matmuls, whose bf16 partial sums round
    otherwise (what optim=muon under FSDP2 would do without it)."""
    got = torchrun_json(SHARDS, tmp_path)
    print(got)
    assert got["whole"] == [0.0] * 4
    assert max(got["torch_on_shards"]) > 1e-3
    assert got["placed"] == ["S(0)", "S(0)", "S(1)", "S(1)"]
    assert got["calls"] == [[[64, 96], [64, 96]] * 4, [[63, 97], [96, 40]] * 4]  # 4 steps, each rank its 2 of the 4 matrices


SHARDED = [*FEW[1:], "train.max_steps=4", "train.save_every=2", "train.progress_bar=false", "optim.weight_decay=0.01"]


@pytest.mark.slow
@pytest.mark.cores(2)
def test_fsdp2_tp_and_pp_follow_one_process_and_a_sharded_checkpoint_resumes_on_one_rank(tmp_path):
    """Four steps of the quickstart under FSDP2, TP and PP (two ranks each) give one process's losses (FSDP2 within
    1e-5: the same whole updates; TP and PP within 1e-4: their forward and gradients reduce in another order); the
    FSDP2 run's step-2 checkpoint (DCP: the momentum buffers and moments as shards) resumes on one rank to the same
    last two losses."""
    train_here(["+recipe=quickstart_sft", *SHARDED, "parallelism=single", "launcher.nproc_per_node=1"], tmp_path / "one")
    losses = lambda run: [m["loss"] for m in read_metrics(tmp_path / run) if m["kind"] == "train"]  # noqa: E731
    one = losses("one")
    assert len(one) == 4 and one[-1] < one[0] - 0.3
    for layout, tol in (("fsdp", 1e-5), ("tp2", 1e-4), ("pp2", 1e-4)):
        out = launch_here("+recipe=quickstart_sft", *SHARDED, f"parallelism={layout}", "launcher.nproc_per_node=2",
                          f"hydra.run.dir={tmp_path / layout}", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert losses(layout) == pytest.approx(one, rel=tol), layout
    out = launch_here("+recipe=quickstart_sft", *SHARDED, "parallelism=fsdp", "launcher.nproc_per_node=1",
                      f"train.resume={tmp_path / 'fsdp/checkpoints/step_2'}", f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert losses("resumed") == pytest.approx(losses("fsdp")[2:], rel=1e-6)


def test_the_planner_counts_the_whole_update_gathered_under_fsdp(compose):
    """The step's temporaries: one hidden matrix at a time, its whole update gathered in fp32 under FSDP2 (on one
    process the update is already whole): the sharded step holds more than the shard's share of the single one."""
    single = plan(compose(["optim=muon", "launcher.nproc_per_node=1", "parallelism=single"]))
    fsdp = plan(compose(["optim=muon", "launcher.nproc_per_node=2", "parallelism=fsdp"]))
    lora = plan(compose(["optim=muon", "launcher.nproc_per_node=1", "parallelism=single", "peft=lora"]))
    assert single.step_temp > 0 and fsdp.step_temp > single.step_temp and lora.step_temp == 0


@pytest.mark.parametrize("overrides,message", [
    (["zero=stage2"], "optim=muon with zero.stage=2: DeepSpeed builds its own optimizer from the JSON"),
])
def test_refusals(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(["optim=muon", *overrides])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
