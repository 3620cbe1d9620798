"""The optimizer axis (optim=adamw|adam|sgd|momentum|adamw_8bit|adafactor): the torch optimizer every engine builds,
the DeepSpeed JSON, real runs whose loss falls and whose measured optimizer memory is the
optimizer's state (none, one momentum buffer, two Adam moments), and the refusals."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.rank import engine
from finetune.config import ConfigError
from finetune.rank.dist import Dist
from finetune.layouts.zero import deepspeed_config

from conftest import REPO, read_metrics, run_cli, tiny_model, train_here
from ranks import launch_here, torchrun_json

# option -> (torch optimizer class, its momentum, the state it keeps per parameter)
OPTIONS = {
    "adamw": (torch.optim.AdamW, None, {"exp_avg", "exp_avg_sq", "step"}),
    "adam": (torch.optim.Adam, None, {"exp_avg", "exp_avg_sq", "step"}),
    "sgd": (torch.optim.SGD, 0.0, set()),
    "momentum": (torch.optim.SGD, 0.9, {"momentum_buffer"}),
}
# Six steps at a learning rate that moves the tiny model (the yaml's own lr for sgd/momentum).
LR = {"adamw": "3e-3", "adam": "3e-3", "sgd": "3e-1", "momentum": "3e-2"}
FEW = ["train.max_steps=6", "train.global_batch_size=16", "train.eval_every=0"]
CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.mark.parametrize("option", OPTIONS)
def test_torch_engine_builds_the_chosen_optimizer(compose, option):
    cls, momentum, state = OPTIONS[option]
    cfg = compose([f"optim={option}", "optim.weight_decay=0.1"])
    net, _ = tiny_model()
    opt = engine.build(cfg, net, CPU).optimizer
    assert type(opt) is cls
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # no decay on biases and norm scales
    if momentum is None:
        assert opt.defaults["betas"] == (0.9, 0.999) and "momentum" not in opt.defaults
    else:
        assert opt.defaults["momentum"] == momentum
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert {k for s in opt.state.values() for k in s} == state


# One process, a gloo group of one: the mesh engine (FSDP2) and DeepSpeed (with and without
# ZeRO-Offload) build their optimizers; prints one JSON line per (engine, option).
ENGINES = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import torch
from conftest import tiny_model
from finetune.config import Device
from finetune.rank.dist import init
from finetune.rank.engine.deepspeed_engine import DeepSpeedEngine
from finetune.rank.engine.mesh_engine import MeshEngine
from finetune.launcher.compose import preflight

d = init(Device.cpu, deepspeed=True)
for layout in ("parallelism=fsdp", "zero=stage2", "zero=stage2_offload"):
    for option in ("adamw", "adam", "sgd", "momentum"):
        cfg = preflight([layout, f"optim={option}"])
        net, _ = tiny_model()
        if layout.startswith("zero"):
            opt = DeepSpeedEngine(net, cfg=cfg, dist=d).memory_targets()[1]
        else:
            opt = MeshEngine(net, cfg=cfg, dist=d).optimizer
        mode = getattr(opt, "adam_w_mode", getattr(opt, "adamw_mode", None))
        print(json.dumps({"layout": layout, "option": option, "class": type(opt).__name__,
                          "adamw_mode": None if mode is None else bool(mode), "momentum": opt.defaults.get("momentum")}))
"""


def test_mesh_and_deepspeed_engines_build_the_chosen_optimizer(tmp_path):
    from finetune.launcher.launch import free_port

    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-c", ENGINES, str(REPO / "tests")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    built = {(r["layout"], r["option"]): (r["class"], r["adamw_mode"], r["momentum"])
             for r in map(json.loads, (line for line in out.stdout.splitlines() if line.startswith("{")))}
    for option, (cls, momentum, _) in OPTIONS.items():
        assert built["parallelism=fsdp", option] == (cls.__name__, None, momentum)
    # DeepSpeed builds its own Adam (FusedAdam; DeepSpeedCPUAdam under offload) in AdamW or Adam
    # mode, and torch.optim.SGD from the "SGD" type, offloaded or not.
    for layout, adam in (("zero=stage2", "FusedAdam"), ("zero=stage2_offload", "DeepSpeedCPUAdam")):
        assert built[layout, "adamw"] == (adam, True, None)
        assert built[layout, "adam"] == (adam, False, None)
        assert built[layout, "sgd"] == ("SGD", None, 0.0)
        assert built[layout, "momentum"] == ("SGD", None, 0.9)


def test_deepspeed_json_follows_the_optimizer(compose):
    adam_params = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    ds = deepspeed_config(compose(["zero=stage2", "optim=adamw"]))
    assert ds["optimizer"] == {"type": "AdamW", "params": adam_params}
    assert "zero_allow_untested_optimizer" not in ds
    ds = deepspeed_config(compose(["zero=stage2", "optim=adam"]))
    assert ds["optimizer"] == {"type": "Adam", "params": {**adam_params, "adam_w_mode": False}}
    ds = deepspeed_config(compose(["zero=stage2", "optim=sgd", "optim.weight_decay=0.01"]))
    assert ds["optimizer"] == {"type": "SGD", "params": {"lr": 0.3, "momentum": 0.0, "weight_decay": 0.01}}
    assert ds["zero_allow_untested_optimizer"] is True
    ds = deepspeed_config(compose(["zero=stage3_offload", "optim=momentum"]))
    assert ds["optimizer"] == {"type": "SGD", "params": {"lr": 0.03, "momentum": 0.9, "weight_decay": 0.0}}
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Six steps of each optimizer on one CPU rank, from the same random init."""
    root = tmp_path_factory.mktemp("optim")
    for option in OPTIONS:
        train_here([f"optim={option}", f"optim.lr={LR[option]}", *FEW, "train.memory_report=categories"], root / option)
    return root


def train_losses(run_dir):
    return [m["loss"] for m in read_metrics(run_dir) if m["kind"] == "train"]


def memory(run_dir):
    return next(m for m in read_metrics(run_dir) if m["kind"] == "memory")


@pytest.mark.parametrize("option", OPTIONS)
def test_each_optimizer_trains(runs, option):
    losses = train_losses(runs / option)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses


def test_optimizer_memory_is_the_optimizer_state(runs):
    mib = {o: memory(runs / o)["mem_optimizer_mib"] for o in OPTIONS}
    params = memory(runs / "adamw")["mem_params_mib"]
    print("optimizer MiB:", {o: round(v, 3) for o, v in mib.items()}, f"params MiB: {params:.3f}")
    assert mib["sgd"] == 0  # plain SGD keeps no state
    assert mib["momentum"] == pytest.approx(params, rel=0.01)  # one fp32 buffer per parameter
    assert mib["adamw"] == pytest.approx(2 * params, rel=0.01)  # exp_avg + exp_avg_sq
    assert mib["adam"] == pytest.approx(mib["adamw"])
    assert mib["momentum"] == pytest.approx(mib["adamw"] / 2, rel=0.01)


def test_zero2_offload_momentum_on_two_ranks_matches_one_process(runs, tmp_path):
    """DeepSpeed runs torch.optim.SGD on the offloaded fp32 partitions: the same curve as the torch engine."""
    out = run_cli("optim=momentum", f"optim.lr={LR['momentum']}", *FEW, "zero=stage2_offload", "parallelism=ddp",
                  "launcher.nproc_per_node=2", "train.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    port = re.findall(r"--master_port=(\d+)", out.stdout)[0]  # DeepSpeed's CPU all-reduce buffers: the ranks removed theirs
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert "finetune.rank.deepspeed_runner --num_nodes=1 --num_gpus=2" in out.stdout
    assert json.loads((tmp_path / "run/deepspeed.json").read_text())["optimizer"]["type"] == "SGD"
    assert train_losses(tmp_path / "run") == pytest.approx(train_losses(runs / "momentum"), rel=1e-4)


@pytest.mark.parametrize("overrides,message", [
    (["optim=momentum", "optim.momentum=1.0"], "optim.momentum=1.0 must be in [0, 1): 0 for plain SGD, e.g. 0.9 with momentum"),
    (["optim=sgd", "optim.momentum=-0.5"], "optim.momentum=-0.5 must be in [0, 1): 0 for plain SGD, e.g. 0.9 with momentum"),
    (["optim.momentum=0.9"], "optim.momentum=0.9 applies to optim.name=sgd or muon only (adamw uses optim.betas): remove it, or use optim=momentum"),
    (["optim=adam", "optim.momentum=0.5"], "optim.momentum=0.5 applies to optim.name=sgd or muon only (adam uses optim.betas): remove it, or use optim=momentum"),
])
def test_momentum_refusals(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert str(e.value) == message


# -- memory-saving optimizer states (issue 18.2) ---------------------------------------------------


def test_low_memory_optimizers_are_built_and_keep_their_states(compose):
    """adamw_8bit: bitsandbytes' AdamW8bit, uint8 moments for a tensor of 4,096+ elements, fp32 below;
    adafactor: torch's, a row and a column vector per matrix."""
    import bitsandbytes as bnb

    for option, cls in (("adamw_8bit", bnb.optim.AdamW8bit), ("adafactor", torch.optim.Adafactor)):
        cfg = compose([f"optim={option}", "optim.weight_decay=0.1"])
        net, _ = tiny_model()
        opt = engine.build(cfg, net, CPU).optimizer
        assert type(opt) is cls and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        for p in net.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        embed = net.get_input_embeddings().weight
        state = opt.state[embed]
        if option == "adamw_8bit":
            assert state["state1"].dtype == state["state2"].dtype == torch.uint8 and state["state1"].shape == embed.shape
            norm = net.model.norm.weight  # 128 elements: below bitsandbytes' min_8bit_size
            assert opt.state[norm]["state1"].dtype == torch.float32
        else:
            assert state["row_var"].shape == (embed.shape[0], 1) and state["col_var"].shape == (1, embed.shape[1])


@pytest.mark.parametrize("option,cut", [("adamw_8bit", 3.5), ("adafactor", 50)])
def test_low_memory_states_measured_and_planned(tmp_path, option, cut):
    """MemTracker's optimizer memory against the planner's per-tensor count, and the cut against AdamW's 8 bytes
    per parameter (a 3.2M-parameter Llama, h 256: bitsandbytes keeps the norms' 32-bit states)."""
    from test_plan import measured_run

    rows = {name: (p, m) for name, p, m in measured_run(tmp_path, f"optim={option}", micro=2, seq=128)}
    predicted, measured = rows["optimizer"]
    adamw = 2 * rows["weights"][1]  # fp32 weights: 4 bytes/param; AdamW 8
    print(f"{option}: optimizer {measured:.3f} MiB measured, {predicted:.3f} planned, AdamW's {adamw:.2f}")
    assert predicted == pytest.approx(measured, rel=0.05, abs=0.01)
    assert adamw / measured >= cut
    assert rows["peak"][0] == pytest.approx(rows["peak"][1], rel=0.15)


@pytest.fixture(scope="module")
def adamw_losses(tmp_path_factory) -> list[float]:
    """Six AdamW steps (fp32 moments), the curve the low-memory states are compared with."""
    run = tmp_path_factory.mktemp("adamw") / "run"
    train_here(["optim=adamw", f"optim.lr={LR['adamw']}", *FEW], run)
    return train_losses(run)


def test_adamw_8bit_follows_adamw(tmp_path, adamw_losses):
    """Six steps from the same init: 8-bit moments change the loss curve by well under a percent here."""
    train_here(["optim=adamw_8bit", f"optim.lr={LR['adamw']}", *FEW], tmp_path / "eight")
    eight, fp32 = train_losses(tmp_path / "eight"), adamw_losses
    assert eight[0] == fp32[0] and eight != fp32  # the same start; the states do differ
    assert eight == pytest.approx(fp32, rel=0.01) and eight[-1] < eight[0] - 0.1


@pytest.mark.parametrize("overrides,message", [
    (["optim=adamw_8bit", "zero=stage2"], "optim=adamw_8bit with zero.stage=2: DeepSpeed builds its own optimizer from the JSON"),
    (["optim=adafactor", "zero=stage3"], "optim=adafactor with zero.stage=3: DeepSpeed builds its own optimizer from the JSON"),
])
def test_low_memory_optimizer_refusals(compose, overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        compose(overrides)


@pytest.mark.parametrize("option,reference", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam)])
def test_low_precision_adam_is_torchs_update_with_its_moments_rounded(option, reference):
    """optim.state_dtype: with fp32 moments the update is torch's, bit for bit; with bf16 moments the moments
    are stored in bf16 and the weights follow torch's within rounding; a saved state loads back in bf16
    (torch's load_state_dict casts floating-point states to the parameter's dtype) and steps on identically."""
    from finetune.rank.engine.common import LowPrecisionAdam

    torch.manual_seed(0)
    start, grads = torch.randn(64, 32), [torch.randn(64, 32) for _ in range(12)]

    def run(make, steps):
        w = torch.nn.Parameter(start.clone())
        opt = make([{"params": [w], "weight_decay": 0.1}])
        for g in grads[:steps]:
            w.grad = g.clone()
            opt.step()
        return w, opt

    kw = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8}
    torch_w, _ = run(lambda groups: reference(groups, **kw), 12)
    same, _ = run(lambda groups: LowPrecisionAdam(groups, **kw, decoupled=option == "adamw", state_dtype=torch.float32), 12)
    assert torch.equal(same, torch_w)
    low, opt = run(lambda groups: LowPrecisionAdam(groups, **kw, decoupled=option == "adamw"), 12)
    assert {k: v.dtype for k, v in opt.state[low].items()} == {"step": torch.float32, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
    moved, moved_low = torch_w - start, low - start
    assert not torch.equal(low, torch_w)
    assert (moved_low - moved).norm() / moved.norm() < 0.01

    half, opt = run(lambda groups: LowPrecisionAdam(groups, **kw, decoupled=option == "adamw"), 6)
    saved = opt.state_dict()
    w = torch.nn.Parameter(half.detach().clone())
    again = LowPrecisionAdam([{"params": [w], "weight_decay": 0.1}], **kw, decoupled=option == "adamw")
    again.load_state_dict(saved)
    assert again.state[w]["exp_avg"].dtype == again.state[w]["exp_avg_sq"].dtype == torch.bfloat16
    for g in grads[6:]:
        w.grad = g.clone()
        again.step()
    assert torch.equal(w, low)


def test_bf16_states_measured_and_planned(tmp_path):
    """optim.state_dtype=bf16 over fp32 weights: MemTracker's optimizer memory is half of AdamW's 8 bytes per
    parameter (the weights' own 4), and the planner counts 4."""
    from test_plan import measured_run

    rows = {name: (p, m) for name, p, m in measured_run(tmp_path, "optim.state_dtype=bf16", micro=2, seq=128)}
    predicted, measured = rows["optimizer"]
    weights = rows["weights"][1]
    print(f"bf16 states: optimizer {measured:.3f} MiB measured, {predicted:.3f} planned, fp32 weights {weights:.3f}")
    assert measured == pytest.approx(weights, rel=0.01)  # 2 x 2 bytes = the fp32 weights' 4
    assert predicted == pytest.approx(measured, rel=0.05)
    assert rows["peak"][0] == pytest.approx(rows["peak"][1], rel=0.15)


@pytest.mark.slow
@pytest.mark.parametrize("option", ["optim.state_dtype=bf16", "optim=adafactor", "optim=adamw_8bit"])
def test_low_memory_states_under_fsdp_follow_one_process_and_resume(tmp_path, option):
    """Each low-memory optimizer steps DTensor shards: FSDP2 on 2 ranks follows one process, and its distributed
    checkpoint resumes with the same trajectory: on 1 rank (DCP reshards the moments, the factored statistics),
    or, for the 8-bit moments, whose block scales cover each rank's shard, on the same layout, with a refusal
    naming why on another."""
    common = ["+recipe=quickstart_sft", option, "train.max_steps=4", "optim.warmup_steps=1", "train.micro_batch_size=8",
              "train.exact_match_samples=0", "train.progress_bar=false", "train.eval_every=0", "train.save_every=2"]
    train_here([*common, "parallelism=single", "launcher.nproc_per_node=1"], tmp_path / "one")  # in this process: the maths
    fsdp = launch_here(*common, "parallelism=fsdp", f"hydra.run.dir={tmp_path / 'fsdp'}", cwd=tmp_path)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert train_losses(tmp_path / "fsdp") == pytest.approx(train_losses(tmp_path / "one"), rel=1e-4)
    assert train_losses(tmp_path / "one")[-1] < train_losses(tmp_path / "one")[0] - 0.02
    step_2 = tmp_path / "fsdp/checkpoints/step_2"
    ranks = "launcher.nproc_per_node=2" if option == "optim=adamw_8bit" else "launcher.nproc_per_node=1"
    resumed = launch_here(*common, "parallelism=fsdp", ranks, f"train.resume={step_2}", f"hydra.run.dir={tmp_path / 'resumed'}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert train_losses(tmp_path / "resumed") == pytest.approx(train_losses(tmp_path / "fsdp")[2:], rel=1e-6)
    if option == "optim=adamw_8bit":
        other = launch_here(*common, "parallelism=fsdp", "launcher.nproc_per_node=1", f"train.resume={step_2}",
                        f"hydra.run.dir={tmp_path / 'other'}", cwd=tmp_path)
        assert other.returncode != 0
        assert other.stderr.strip().splitlines()[-1] == (
            f"error: resume: train.resume: {step_2} was saved with world_size=2, this run has world_size=1: optim=adamw_8bit's "
            "block scales cover each rank's own shard of a weight, so its checkpoint resumes on the same layout only: resume "
            "with the saved parallelism and launcher.nproc_per_node")


def test_bf16_states_follow_adamw(tmp_path, adamw_losses):
    """Six steps from the same init: bf16 moments (rounded to nearest each step) keep the loss curve within a
    percent of fp32 moments'."""
    train_here(["optim.state_dtype=bf16", f"optim.lr={LR['adamw']}", *FEW], tmp_path / "bf16")
    low, fp32 = train_losses(tmp_path / "bf16"), adamw_losses
    assert low[0] == fp32[0] and low != fp32
    assert low == pytest.approx(fp32, rel=0.01) and low[-1] < low[0] - 0.1


@pytest.mark.parametrize("overrides,message", [
    (["optim.state_dtype=bf16", "optim=sgd"], "optim.state_dtype=bf16 with optim=sgd: it sets the dtype of adam/adamw's two moments, "
                                              "and optim=sgd keeps no state: use optim=adamw with it, or optim.state_dtype=null"),
    (["optim.state_dtype=bf16", "optim=adamw_8bit"], "optim.state_dtype=bf16 with optim=adamw_8bit: it sets the dtype of adam/adamw's "
                                                     "two moments, and optim=adamw_8bit keeps its moments in 8 bits"),
    (["optim.state_dtype=bf16", "zero=stage2"], "optim.state_dtype=bf16 with zero.stage=2: DeepSpeed builds its own optimizer "
                                                "(FusedAdam or CPUAdam over its fp32 partitions, fp32 moments)"),
    (["optim.state_dtype=fp32", "precision=bf16_pure"], "optim.state_dtype=fp32 with precision=bf16_pure: its Kahan-compensated "
                                                        "optimizers (optimi) keep the moments in the parameters' dtype, bf16"),
])
def test_state_dtype_refusals(compose, overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        compose(overrides)


def test_state_dtype_builds_its_optimizer_on_each_engine(compose):
    from finetune.rank.engine.common import LowPrecisionAdam

    net, _ = tiny_model()
    opt = engine.build(compose(["optim.state_dtype=bf16", "optim=adam"]), net, CPU).optimizer
    assert type(opt) is LowPrecisionAdam and not opt.decoupled and opt.state_dtype == torch.bfloat16
    assert type(engine.build(compose(["optim.state_dtype=fp32"]), tiny_model()[0], CPU).optimizer) is torch.optim.AdamW


def test_bf16_states_are_planned_and_offered_on_sharded_layouts(compose):
    """The planner halves the optimizer's bytes; plan.suggest offers bf16 moments, 8-bit moments and factored
    statistics on every layout but DeepSpeed's, and neither bf16 moments nor the uncompensated optimizers under
    bf16_pure (whose moments are bf16 already)."""
    from finetune.planner.peak import plan
    from finetune.launcher.suggest import moves

    for layout in (["parallelism=fsdp", "launcher.nproc_per_node=2"], ["parallelism=tp2", "launcher.nproc_per_node=2"],
                   ["parallelism=single", "launcher.nproc_per_node=1"]):
        fp32, low = plan(compose(layout)), plan(compose([*layout, "optim.state_dtype=bf16"]))
        assert low.optimizer == pytest.approx(fp32.optimizer / 2) and low.weights == fp32.weights
        offered = [m.overrides for axis in moves(compose(layout)) for m in axis]
        assert ("optim.state_dtype=bf16",) in offered
        assert ("optim=adamw_8bit",) in offered and ("optim=adafactor",) in offered
    offered = [m.overrides for axis in moves(compose(["precision=bf16_pure"])) for m in axis]
    assert ("optim.state_dtype=bf16",) not in offered and ("optim=adamw_8bit",) not in offered
    offered = [m.overrides for axis in moves(compose(["zero=stage2"])) for m in axis]
    assert not any(o[0].startswith("optim") for o in offered if o)


# Two gloo ranks: optimizers.sharded's optimizers over DTensor shards (rows as FSDP2 shards them, evenly and not,
# columns as a row-wise TP linear does, a replicated vector, a 3-D stack) against the plain optimizers over the
# whole tensors; prints one JSON line from rank 0.
SHARDS = """
import copy, json, os, torch, torch.distributed as dist
import bitsandbytes as bnb
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from finetune.optimizers.sharded import ShardedAdafactor, ShardedAdamW8bit

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
cases = [((64, 96), Shard(0)), ((63, 97), Shard(0)), ((64, 96), Shard(1)), ((40,), Replicate()), ((3, 8, 6), Shard(0)),
         ((4000, 2), Shard(0))]  # 8,000 elements: 8-bit states, though each shard holds 4,000 (< bitsandbytes' 4,096)
starts = [torch.randn(shape) for shape, _ in cases]
grads = [[torch.randn(shape) for shape, _ in cases] for _ in range(8)]

def run(whole_cls, shard_cls, **kw):
    whole = [torch.nn.Parameter(s.clone()) for s in starts]
    shards = [torch.nn.Parameter(distribute_tensor(s.clone(), mesh, [pl])) for s, (_, pl) in zip(starts, cases)]
    a = whole_cls([{"params": whole, "weight_decay": 0.1}], lr=1e-2, **kw)
    b = shard_cls([{"params": shards, "weight_decay": 0.1}], lr=1e-2, **kw)
    for step, gs in enumerate(grads):
        for w, s, g in zip(whole, shards, gs):
            w.grad, s.grad = g.clone(), distribute_tensor(g.clone(), mesh, s.placements)
        a.step(); b.step()
        if step == 3:  # a copy, as DCP writes it: the state dict holds the live moments
            saved = copy.deepcopy(b.state_dict())
    errors = [((s.full_tensor() - w).norm() / (w - s0).norm()).item() for w, s, s0 in zip(whole, shards, starts)]
    return errors, b, shards, saved

out = {}
errors, opt, _, _ = run(torch.optim.Adafactor, ShardedAdafactor)
out["adafactor"] = errors
out["adafactor_states"] = [sorted((k, str(v.placements[0])) for k, v in opt.state[p].items() if isinstance(v, DTensor))
                           for p in opt.param_groups[0]["params"][:3]]
errors, opt, shards, saved = run(bnb.optim.AdamW8bit, ShardedAdamW8bit, betas=(0.9, 0.999), eps=1e-8)
out["adamw_8bit"] = errors
out["adamw_8bit_dtypes"] = [str(opt.state[p]["state1"].dtype) for p in shards]
out["saved"] = {k: [type(v).__name__, list(v.shape)] for k, v in saved["state"][1].items() if k in ("state1", "absmax1")}
# the state saved after step 4, loaded into a fresh optimizer over the step-4 weights, steps 5-8 identically
again = [torch.nn.Parameter(distribute_tensor(s.clone(), mesh, [pl])) for s, (_, pl) in zip(starts, cases)]
opt2 = ShardedAdamW8bit([{"params": again, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
replay = ShardedAdamW8bit([{"params": again, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
for gs in grads[:4]:
    for p, g in zip(again, gs):
        p.grad = distribute_tensor(g.clone(), mesh, p.placements)
    replay.step()
opt2.load_state_dict(saved)
for gs in grads[4:]:
    for p, g in zip(again, gs):
        p.grad = distribute_tensor(g.clone(), mesh, p.placements)
    opt2.step()
out["resumed_equal"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(again, shards))
if dist.get_rank() == 0:
    print(json.dumps(out), flush=True)
dist.destroy_process_group()
os._exit(0)  # as finetune.train ends: the interpreter's teardown with bitsandbytes loaded can abort a finished process
"""


def test_sharded_optimizers_step_dtensor_shards_like_the_whole_tensors(tmp_path):
    """Adafactor over DTensor shards is torch's Adafactor over the whole tensors (to float rounding), its row and
    column statistics sharded like the rows and columns. AdamW8bit over shards follows bitsandbytes' over the
    whole tensors within its quantization (the block scales cover each shard), decides 8-bit states by the whole
    tensor's size (a 8,000-element weight whose shards hold 4,000 each), saves DTensors (the moments placed like
    the weight, the scales a padded chunk per rank), and a saved state loads back and steps on bit for bit."""
    got = torchrun_json(SHARDS, tmp_path)
    print(got)
    assert max(got["adafactor"]) < 1e-5
    assert got["adafactor_states"] == [[["col_var", "R"], ["row_var", "S(0)"]], [["col_var", "R"], ["row_var", "S(0)"]],
                                       [["col_var", "S(1)"], ["row_var", "R"]]]
    assert max(got["adamw_8bit"]) < 0.02 and min(got["adamw_8bit"]) == 0.0  # the replicated vector's 32-bit states: exact
    assert got["adamw_8bit_dtypes"] == ["torch.uint8", "torch.uint8", "torch.uint8", "torch.float32", "torch.float32", "torch.uint8"]
    assert got["saved"] == {"state1": ["DTensor", [63, 97]], "absmax1": ["DTensor", [2 * 13]]}  # 32 x 97 elements: 13 blocks
    assert got["resumed_equal"] is True


@pytest.mark.parametrize("scheduler,warmup,min_ratio", [("cosine", 0, 0.0), ("cosine", 3, 0.1), ("linear", 0, 0.0), ("linear", 4, 0.0),
                                                        ("constant", 0, 0.0), ("constant", 5, 0.0)])
def test_the_schedule_is_transformers_own(compose, scheduler, warmup, min_ratio):
    """The warmup + decay schedules are written out (importing transformers' pulls peft, bitsandbytes and torch's
    compiler into every rank); their factors equal transformers' at every step, beyond the last one too."""
    from transformers import get_scheduler

    from finetune.rank.engine.common import build_scheduler

    cfg = compose(["+recipe=quickstart_sft", f"optim.scheduler={scheduler}", f"optim.warmup_steps={warmup}",
                   f"optim.min_lr_ratio={min_ratio}"]).optim
    name, extra = {"cosine": ("cosine_with_min_lr", {"min_lr_rate": min_ratio}), "linear": ("linear", {}),
                   "constant": ("constant_with_warmup", {})}[scheduler]
    lrs = []
    for make in (lambda opt: build_scheduler(opt, cfg, 20),
                 lambda opt: get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=20, scheduler_specific_kwargs=extra)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
        sched, seen = make(opt), []
        for _ in range(24):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        lrs.append(seen)
    assert lrs[0] == lrs[1]  # bit for bit
    assert lrs[0][warmup] == pytest.approx(0.3)  # the peak after warmup, then down to lr x min_lr_ratio (constant: stays)
    assert lrs[0][20] == pytest.approx(0.3 if scheduler == "constant" else 0.3 * min_ratio)


# ---------------------------------------------------------------------------------------------
# optim.kernel: how torch's adamw/adam/sgd run (issue 28)

KERNEL_OPS = {"fused": "_fused_", "foreach": "_foreach_", "loop": None}
"""The aten op name each kernel's update shows in torch.profiler (the loop runs plain per-tensor ops)."""


def kernel_ops(optimizer: torch.optim.Optimizer) -> set[str]:
    """The fused and multi-tensor ops one optimizer step runs, as torch.profiler records them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        optimizer.step()
    return {e.name for e in prof.events() if "_fused_" in e.name or "_foreach_" in e.name}


@pytest.mark.parametrize("option", OPTIONS)
def test_each_kernel_runs_what_it_names_and_the_same_update(compose, option):
    """Twenty steps of the same gradients: foreach is the loop bit for bit; fused (auto's choice on CPU) is within
    float rounding of it (Adam's, measured: 1-2 ulp of the weights; SGD's equal); the profiler shows the kernel each ran."""
    from finetune.rank.engine.common import build_optimizer

    cls, _, _ = OPTIONS[option]
    weights = {}
    for kernel in ("auto", "fused", "foreach", "loop"):
        cfg = compose([f"optim={option}", f"optim.lr={LR[option]}", "optim.weight_decay=0.01", f"optim.kernel={kernel}"])
        model, _ = tiny_model()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, cfg.optim)
        assert type(optimizer) is cls
        grads = torch.Generator().manual_seed(1)
        for step in range(20):
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads)
            if step == 0:
                ran = kernel_ops(optimizer)
                op = KERNEL_OPS["fused" if kernel == "auto" else kernel]
                assert (any(op in name for name in ran) if op else not ran), (kernel, ran)
            else:
                optimizer.step()
        weights[kernel] = torch.cat([p.detach().flatten() for p in params])
    assert torch.equal(weights["foreach"], weights["loop"]) and torch.equal(weights["auto"], weights["fused"])
    worst = float((weights["fused"] - weights["loop"]).abs().max())
    assert worst <= 1e-6 * float(weights["loop"].abs().max()), worst  # another kernel, the same update (SGD's: bit for bit)


def test_the_fused_kernel_trains_as_the_loop_does(tmp_path, adamw_losses):
    """Six AdamW steps through the real loop: optim.kernel=loop (torch's CPU default before) against auto (fused),
    the adamw_losses fixture: the same loss curve within float noise."""
    train_here(["optim=adamw", f"optim.lr={LR['adamw']}", *FEW, "optim.kernel=loop"], tmp_path / "loop")
    assert train_losses(tmp_path / "loop") == pytest.approx(adamw_losses, rel=1e-5)


@pytest.mark.parametrize("overrides,message", [
    (["optim.kernel=fused", "optim=adamw_8bit"], "optim.kernel=fused with optim=adamw_8bit: it chooses how torch's adamw, adam and "
                                                 "sgd run, and optim=adamw_8bit runs bitsandbytes' 8-bit kernel: leave "
                                                 "optim.kernel=auto, or use optim=adamw with it"),
    (["optim.kernel=foreach", "zero=stage2"], "optim.kernel=foreach with zero.stage=2: DeepSpeed builds its own optimizer "
                                              "(FusedAdam or CPUAdam over its fp32 partitions): leave optim.kernel=auto under ZeRO, "
                                              "or use zero=none with it"),
    (["optim.kernel=loop", "precision=bf16_pure"], "optim.kernel=loop with precision=bf16_pure: its Kahan-compensated optimizers "
                                                   "(optimi) run their own update: leave optim.kernel=auto, or use precision=bf16 "
                                                   "with it"),
    (["optim.kernel=fused", "optim.state_dtype=bf16"], "optim.kernel=fused with optim.state_dtype=bf16: its update (finetune's "
                                                       "LowPrecisionAdam) runs one parameter at a time: leave optim.kernel=auto, "
                                                       "or optim.state_dtype=null with it"),
    (["optim.kernel=foreach", "parallelism=tp2", "launcher.nproc_per_node=2"], "optim.kernel=foreach with parallelism.tp=2: tensor parallel splits some "
                                                  "parameters into DTensor shards and leaves the rest plain tensors, and one fused "
                                                  "or foreach call takes one kind: leave optim.kernel=auto (the loop under tp), or "
                                                  "use optim.kernel=loop"),
])
def test_kernel_refusals(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert str(e.value) == message


def test_dtensor_shards_beside_plain_tensors_step_in_the_loop(monkeypatch):
    """Tensor parallel's parameters: DTensor shards and plain tensors in one group, which torch's fused and foreach
    calls refuse ("got mixed torch.Tensor and DTensor"): auto takes the loop, an explicit kernel is refused on the rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from finetune.config import OptimKernel
    from finetune.optimizers.kernels import kernel

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29400 + os.getpid() % 500))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        shard = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
        plain = torch.nn.Parameter(torch.randn(4))
        assert kernel(OptimKernel.auto, [shard, plain]) == {"foreach": False}
        assert kernel(OptimKernel.auto, [shard]) == {"fused": True} and kernel(OptimKernel.auto, [plain]) == {"fused": True}
        with pytest.raises(ConfigError) as e:
            kernel(OptimKernel.fused, [shard, plain])
        assert str(e.value) == ("optim.kernel=fused: some parameters are DTensor shards (tensor parallel) and some plain tensors, "
                                "and one fused or foreach call takes one kind: use optim.kernel=auto or loop")
        shard.grad, plain.grad = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]), torch.ones(4)
        torch.optim.AdamW([shard, plain], lr=0.1, **kernel(OptimKernel.auto, [shard, plain])).step()  # it runs
    finally:
        dist.destroy_process_group()
