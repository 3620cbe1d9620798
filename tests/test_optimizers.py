"""The optimizer records (finetune/optimizers/): every record is read by the engine, the planner, the rules and the
launcher; a torch.optim class by name (optim.name=torch.optim.NAdam) is built from its signature, planned from its
probed state_dict, trains like a plain torch loop, resumes, and is refused where it cannot run, in one line."""

from __future__ import annotations

import math
import re

import pytest
import torch

from finetune import optimizers
from finetune.rank import engine
from finetune.config import ConfigError
from finetune.rank.dist import Dist
from finetune.layouts.zero import deepspeed_config
from finetune.planner.counts import state_bytes
from finetune.planner.peak import plan

from conftest import read_metrics, record_steps, replay, tiny_model, train_here

CPU = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
TORCH_CLASSES = {"torch.optim.NAdam": torch.optim.NAdam, "torch.optim.RAdam": torch.optim.RAdam}


def step_once(opt: torch.optim.Optimizer, net: torch.nn.Module) -> None:
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()


@pytest.mark.parametrize("name", [*optimizers.RECORDS, *TORCH_CLASSES])
def test_every_record_is_built_planned_and_launched(compose, name):
    """Each record through every reader: the torch engine builds it and it steps; the planner counts a state for it;
    the launcher writes its DeepSpeed section, or the rules refuse it under ZeRO."""
    rec = optimizers.record(name)
    cfg = compose([f"optim.name={name}"])
    net, _ = tiny_model()
    opt = engine.build(cfg, net, CPU).optimizer
    step_once(opt, net)
    assert optimizers.state_dict_bytes(opt) >= 0 and plan(cfg).optimizer >= 0
    if rec.deepspeed:
        ds = deepspeed_config(compose([f"optim.name={name}", "zero=stage2"]))
        assert ds["optimizer"]["type"] == rec.deepspeed and set(ds["optimizer"]["params"]) >= set(rec.deepspeed_keys)
    else:
        with pytest.raises(ConfigError, match="^" + re.escape(f"{rec.typed} with zero.stage=2: DeepSpeed builds its own")):
            compose([f"optim.name={name}", "zero=stage2"])


@pytest.mark.parametrize("typed,stored", [("AdamW", "adamw"), ("adamw-8bit", "adamw_8bit"), ("SGD", "sgd"),
                                          ("torch.optim.NAdam", "torch.optim.NAdam")])
def test_optim_name_is_read_as_users_spell_it(compose, typed, stored):
    assert compose([f"optim.name={typed}"]).optim.name == stored


@pytest.mark.parametrize("name,cls", TORCH_CLASSES.items())
def test_a_torch_class_is_built_with_the_keys_its_constructor_takes(compose, name, cls):
    cfg = compose([f"optim.name={name}", "optim.lr=2e-3", "optim.betas=[0.8,0.99]", "optim.eps=1e-6", "optim.weight_decay=0.1"])
    net, _ = tiny_model()
    opt = engine.build(cfg, net, CPU).optimizer
    assert type(opt) is cls
    assert (opt.defaults["lr"], opt.defaults["betas"], opt.defaults["eps"]) == (2e-3, (0.8, 0.99), 1e-6)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # no decay on biases and norm scales


def test_the_probe_step_uses_the_optim_defaults():
    """optimizers.PROBE_VALUES (what a torch class is probed with) are OptimConfig's defaults."""
    from finetune.config import OptimConfig

    o = OptimConfig()
    assert optimizers.PROBE_VALUES == optimizers.ProbeValues(o.lr, tuple(o.betas), o.eps, o.momentum)


def test_nadam_state_is_planned_as_its_state_dict_holds():
    """The planner's count (a rate per element and a constant per tensor, from one probe step) against the state_dict
    of NAdam stepped once over the tiny model's real tensors: exp_avg + exp_avg_sq (8 bytes per element), step and
    mu_product (4 bytes each per tensor)."""
    from finetune.config import OptimConfig
    from finetune.rank.engine.common import build_optimizer

    rec = optimizers.record("torch.optim.NAdam")
    assert (rec.state_bytes, rec.by_shape((1,)) - rec.state_bytes) == (8, 8)
    net, _ = tiny_model()
    params = [p for p in net.parameters() if p.requires_grad]
    opt = build_optimizer(params, OptimConfig(name="torch.optim.NAdam"))
    step_once(opt, net)
    held = optimizers.state_dict_bytes(opt)
    assert state_bytes([tuple(p.shape) for p in params], "torch.optim.NAdam") == held
    assert held == 8 * sum(p.numel() for p in params) + 8 * len(params)


def test_the_plan_counts_nadams_state_for_the_model(compose):
    """plan() over the tiny model's architecture: within a few tensors' step counters of the state_dict (the planner
    counts a block's norms as one tensor)."""
    cfg = compose(["optim.name=torch.optim.NAdam"])
    net, _ = tiny_model()
    opt = engine.build(cfg, net, CPU).optimizer
    step_once(opt, net)
    assert plan(cfg).optimizer == pytest.approx(optimizers.state_dict_bytes(opt), rel=1e-3)
    assert plan(cfg).optimizer == pytest.approx(plan(compose(["optim=adam"])).optimizer, rel=1e-3)  # both 8 bytes/param


FEW = ["train.max_steps=2", "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0", "data.eval_size=0",
       "data.eval=null", "train.exact_match_samples=0", "train.memory_report=false", "optim.lr=3e-3", "optim.weight_decay=0.01",
       "optim.scheduler=constant", "optim.warmup_steps=0", "optim.max_grad_norm=null"]


@pytest.mark.parametrize("name,cls", TORCH_CLASSES.items())
def test_a_torch_class_trains_like_a_plain_torch_loop(tmp_path, monkeypatch, name, cls):
    """Two steps of the whole rank (train_here) against a plain loop over the same initial weights and the same
    micro-batches: torch's class, decay on the matrices, summed losses over the step's tokens."""
    seen = record_steps(monkeypatch)
    train_here([f"optim.name={name}", *FEW], tmp_path)
    ran = [m["loss"] for m in read_metrics(tmp_path) if m["kind"] == "train"]
    params = [p for p in seen["net"].train().parameters() if p.requires_grad]
    opt = cls([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
               {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=3e-3)
    plain = replay(seen, opt.step)
    assert len(ran) == 2 and ran[1] != ran[0]
    assert ran == pytest.approx(plain, rel=1e-6)


def test_a_torch_class_resumes_where_it_stopped(tmp_path):
    """Its state_dict is saved and loaded like torch's AdamW: 2 steps, then 2 more from the checkpoint, equal 4 steps."""
    common = ["optim.name=torch.optim.NAdam", *[o for o in FEW if not o.startswith("train.max_steps")]]
    train_here([*common, "train.max_steps=4"], tmp_path / "whole")
    train_here([*common, "train.max_steps=2", "train.save_every=2"], tmp_path / "first")
    train_here([*common, "train.max_steps=4", f"train.resume={tmp_path / 'first/checkpoints/step_2'}"], tmp_path / "rest")
    losses = lambda run: [m["loss"] for m in read_metrics(run) if m["kind"] == "train"]  # noqa: E731
    assert losses(tmp_path / "rest")[-2:] == pytest.approx(losses(tmp_path / "whole")[-2:], rel=1e-6)


@pytest.mark.parametrize("overrides,message", [
    (["optim.name=torch.optim.NAdam", "zero=stage2"],
     "optim.name=torch.optim.NAdam with zero.stage=2: DeepSpeed builds its own optimizer from the JSON (FusedAdam, CPUAdam or a "
     "torch.optim class over its flat fp32 partitions): use optim.name=torch.optim.NAdam with zero=none (parallelism=single or "
     "ddp), or optim=adamw under ZeRO"),
    (["optim.name=torch.optim.RAdam", "parallelism=fsdp", "launcher.nproc_per_node=2"],
     "optim.name=torch.optim.RAdam with parallelism=fsdp: it runs on the torch engine only (parallelism=single or ddp), its "
     "state unsharded: use optim.name=torch.optim.RAdam with parallelism=single or ddp, or a built-in optimizer (adamw, adam, "
     "sgd, adamw_8bit, muon, adafactor) with parallelism=fsdp"),
    (["optim.name=torch.optim.Nadam"],
     "optim.name=torch.optim.Nadam: torch.optim has no optimizer class Nadam (did you mean 'torch.optim.NAdam'?); it has "),
    (["optim.name=torch.optim.Adagrad", "optim.betas=[0.8,0.99]"],
     "optim.betas=[0.8,0.99] with optim.name=torch.optim.Adagrad: its constructor takes no betas (it takes lr, eps, "
     "weight_decay of optim.*): remove optim.betas, or use an optimizer that takes it"),
    (["optim.name=torch.optim.NAdam", "optim.momentum=0.9"],
     "optim.momentum=0.9 with optim.name=torch.optim.NAdam: its constructor takes no momentum (it takes lr, betas, eps, "
     "weight_decay of optim.*): remove optim.momentum, or use an optimizer that takes it"),
    (["optim.name=torch.optim.LBFGS"], "optim.name=torch.optim.LBFGS: it cannot step a probe tensor with a plain gradient"),
    (["optim.name=torch.optim.NAdam", "optim.kernel=fused"],
     "optim.kernel=fused with optim.name=torch.optim.NAdam: it chooses how torch's adamw, adam and sgd run, and "
     "optim.name=torch.optim.NAdam runs torch's own choice of implementation for NAdam: leave optim.kernel=auto, or use "
     "optim=adamw with it"),
    (["optim.name=torch.optim.NAdam", "precision=bf16_pure"],
     "precision=bf16_pure with optim.name=torch.optim.NAdam: bf16 weights need each update added with Kahan summation"),
    (["optim.name=lion"], "optim.name=lion must be one of adamw, adam, sgd, adamw_8bit, muon, adafactor, or a torch.optim class by name "
                          "(e.g. torch.optim.NAdam)"),
])
def test_torch_class_refusals(compose, overrides, message):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_a_torch_class_that_takes_momentum_gets_it(compose):
    cfg = compose(["optim.name=torch.optim.RMSprop", "optim.momentum=0.9", "optim.lr=1e-3"])
    net, _ = tiny_model()
    opt = engine.build(cfg, net, CPU).optimizer
    assert type(opt) is torch.optim.RMSprop and opt.defaults["momentum"] == 0.9
    assert "betas" not in opt.defaults and math.isclose(opt.defaults["eps"], 1e-8)
